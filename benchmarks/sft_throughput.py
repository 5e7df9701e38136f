"""SFT throughput and peak memory: lit_llm's ``SFTModule`` on a Lightning ``Trainer`` vs TRL's ``SFTTrainer`` (issue 5).

Both sides fine-tune the embedded SmolLM2-135M-Instruct (fp32 weights, AdamW, lr 1e-5, grad-norm clip 1.0) on the same
GSM8K train rows, rendered with the model's chat template (question = user message, answer verbatim = assistant
message), batch 8 (no accumulation), ``max_length`` 512, completion-only loss, on the CPU:

- ``ours``: ``lit-llm``'s real training path -- :class:`~lit_llm.lightning.SFTModule` (loss head ``sft``, token-mean,
  chunked LM-head log-prob kernel, token accuracy and entropy metrics on) driven by ``lightning.Trainer.fit`` with
  :class:`~lit_llm.lightning.SFTDataModule` (``format="gsm8k"``, length-grouped batches, the default) and
  ``precision="32-true"`` or ``"bf16-mixed"``. No logger, no checkpoints, no validation.
- ``ours-packed`` (``--packing``): the same with ``SFTDataModule(packing=True)``: each step's rows (the same rows as
  ``ours``) packed into sequences of at most ``max_length`` tokens (least-padding packs), position ids restarting per
  row, rows never attending to each other (:mod:`lit_llm.data.packing`).
- ``trl``: ``trl.SFTTrainer`` with a conversational prompt/completion dataset, ``completion_only_loss=True``,
  ``per_device_train_batch_size=8``, ``max_length=512``, ``use_cpu=True`` and ``bf16=True`` for bf16 (its default
  loss, which also computes entropy and token accuracy, as ours does). No saving, no reporting.
- ``trl-packing`` / ``trl-padding-free`` / ``trl-group-by-length`` (``--packing`` adds them): the same with
  ``packing=True`` (TRL's default ``packing_strategy="bfd"``: the dataset packed into sequences of ``max_length``
  tokens, then a step's 8 packs flattened padding-free into one row with ``position_ids`` and no attention mask;
  TRL passes ``use_cache=False``, so transformers' sdpa keeps the rows apart on the CPU), ``padding_free=True``
  (a step's 8 rows flattened into one row, same mechanism) or ``train_sampling_strategy="group_by_length"``
  (transformers 5's name for ``group_by_length=True``). A TRL step of ``trl-packing`` holds 8 packs (~2-3x the rows).

Each configuration runs in a FRESH subprocess. The timed window runs from the end of the ``--warmup`` step(s) to the
end of the last step (``--warmup + --steps`` optimizer steps in all), so it covers everything a training step does:
data, forward, backward, optimizer, logging. Reported:

- ``real tok/s``: non-padding tokens (``attention_mask`` sum) of the timed steps per second -- the issue's metric;
- ``trained tok/s``: loss-masked (completion) tokens per second;
- ``peak RSS``: the process's ``VmHWM`` over the training (reset with ``/proc/self/clear_refs`` when training starts,
  after model load and tokenisation), absolute and above the RSS at that point.

The steps draw different rows on the two sides (ours: length-grouped steps, TRL: random batches), so the per-step
token counts differ; rates are per real token, and ours also profits from less padding (the printed ``pad %``).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/sft_throughput.py --steps 4                  # all 4 configurations
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/sft_throughput.py --impls ours --precisions bf16 --steps 2
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/sft_throughput.py --packing --precisions fp32 --steps 2  # packing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from _memory import GB, machine_line
from _memory import release_and_reset_peak as _release_and_reset_peak
from _memory import status_kb as _status_kb

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


TRL_SETTINGS: dict[str, dict] = {
    "trl": {},
    "trl-packing": {"packing": True},  # packing_strategy "bfd" (TRL's default): padding-free packs
    # TRL 1.16 refuses padding_free without packing unless max_length is None (it would truncate the flattened row);
    # the first 256 GSM8K rows are <= 468 tokens (mean 223) with the template, so no row is cut either way
    "trl-padding-free": {"padding_free": True, "max_length": None},
    "trl-group-by-length": {"train_sampling_strategy": "group_by_length"},  # transformers 5's group_by_length=True
}
IMPLS = ("ours", "ours-packed", *TRL_SETTINGS)


class _Clock:
    """Per-step token counts and the end time of every optimizer step."""

    def __init__(self) -> None:
        self.base_rss = 0
        self.ends: list[float] = []
        self.real: list[int] = []
        self.trained: list[int] = []
        self.padded: list[int] = []
        self.losses: list[float] = []

    def summary(self, warmup: int) -> dict:
        n = len(self.ends)
        if n <= warmup:
            raise RuntimeError(f"only {n} steps ran; need more than --warmup {warmup}")
        seconds = self.ends[-1] - self.ends[warmup - 1] if warmup else float("nan")
        real, trained, padded = (sum(x[warmup:]) for x in (self.real, self.trained, self.padded))
        peak = _status_kb("VmHWM") * 1024
        step_seconds = [b - a for a, b in zip(self.ends[warmup - 1:], self.ends[warmup:])]
        return dict(steps_timed=n - warmup, seconds=seconds, step_seconds=step_seconds,
                    real_tokens=real, trained_tokens=trained, padded_positions=padded,
                    real_tok_s=real / seconds, trained_tok_s=trained / seconds, pad_fraction=1 - real / padded,
                    peak_rss_gb=peak / GB, peak_above_base_gb=(peak - self.base_rss) / GB, losses=self.losses)


def run_ours(args: argparse.Namespace) -> dict:
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything

    from lit_llm.lightning import SFTDataModule, SFTModule

    seed_everything(args.seed)
    clock = _Clock()

    class Timer(Callback):
        def on_train_start(self, trainer, pl_module):
            clock.base_rss = _release_and_reset_peak()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.ends.append(time.perf_counter())
            mbs = batch["micro_batches"]
            clock.real.append(int(sum(mb["attention_mask"].sum() for mb in mbs)))
            clock.trained.append(int(sum(pl_module.mask(mb).sum() for mb in mbs)))
            clock.padded.append(int(sum(mb["attention_mask"].numel() for mb in mbs)))
            clock.losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))

    module = SFTModule("smollm2-135m-instruct", loss="sft", optimizer=partial(torch.optim.AdamW, lr=1e-5),
                       grad_clip=1.0, chunk_size=args.chunk_size)
    data = SFTDataModule(str(args.data), format="gsm8k", limit=args.rows, max_length=args.max_length,
                         batch_size=args.batch, seed=args.seed, group_by_length=not args.no_group_by_length,
                         packing=args.impl == "ours-packed")
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=args.warmup + args.steps,
                      precision="bf16-mixed" if args.precision == "bf16" else "32-true", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    if args.profile:
        return _profile(lambda: trainer.fit(module, datamodule=data), args)
    trainer.fit(module, datamodule=data)
    return clock.summary(args.warmup)


def run_trl(args: argparse.Namespace) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from lit_llm.data.datasets import read_jsonl
    from lit_llm.models import load_model

    torch.manual_seed(args.seed)
    clock = _Clock()
    pending: list[tuple[int, int, int]] = []

    class Counting(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            attn = inputs.get("attention_mask")  # padding-free batches (packing, padding_free) have none: no padding
            real = int(attn.sum()) if attn is not None else int(inputs["input_ids"].numel())
            pending.append((real, int((labels[:, 1:] != -100).sum()), int(inputs["input_ids"].numel())))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock.base_rss = _release_and_reset_peak()

        def on_step_end(self, a, state, control, **kw):
            clock.ends.append(time.perf_counter())
            clock.real.append(sum(p[0] for p in pending))
            clock.trained.append(sum(p[1] for p in pending))
            clock.padded.append(sum(p[2] for p in pending))
            pending.clear()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    rows = [row for _, row in read_jsonl(args.data)][: args.rows]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                             "completion": [{"role": "assistant", "content": r["answer"]}]} for r in rows])
    model, tokenizer = load_model()
    model.train()
    with tempfile.TemporaryDirectory() as out:
        settings = {"max_length": args.max_length, **TRL_SETTINGS[args.impl]}
        cfg = SFTConfig(output_dir=out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                        completion_only_loss=True, learning_rate=1e-5,
                        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
                        max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=True, bf16=args.precision == "bf16", seed=args.seed, dataloader_num_workers=0,
                        disable_tqdm=True, **settings)
        trainer = Counting(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer, callbacks=[Timer()])
        if args.profile:
            return _profile(trainer.train, args)
        trainer.train()
    return clock.summary(args.warmup)


def _profile(fn, args: argparse.Namespace) -> dict:
    """Run ``fn`` under torch.profiler (CPU) and return the top ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile)
    return {"profile": table}


def worker(args: argparse.Namespace) -> dict:
    import torch

    t0 = time.perf_counter()
    res = run_ours(args) if args.impl.startswith("ours") else run_trl(args)
    res.update(impl=args.impl, precision=args.precision, batch=args.batch, max_length=args.max_length,
               rows=args.rows, warmup=args.warmup, threads=torch.get_num_threads(), load_avg=os.getloadavg(),
               total_seconds=time.perf_counter() - t0)
    return res


def run_fresh(impl: str, precision: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--impl", impl, "--precision", precision,
           "--data", str(args.data), "--rows", str(args.rows), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--batch", str(args.batch), "--max-length", str(args.max_length), "--seed", str(args.seed),
           "--chunk-size", str(args.chunk_size)]
    if args.no_group_by_length:
        cmd.append("--no-group-by-length")
    if args.profile:
        cmd += ["--profile", str(args.profile)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {impl} {precision} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    trl = {r["precision"]: r for r in results if r["impl"] == "trl"}
    best = {}  # the fastest TRL setting per precision
    for r in results:
        if r["impl"].startswith("trl") and r["real_tok_s"] > best.get(r["precision"], {}).get("real_tok_s", 0):
            best[r["precision"]] = r
    ours = {r["precision"]: r for r in results if r["impl"] == "ours"}
    lines = ["| precision | impl | real tok/s | x TRL | x best TRL | x ours | trained tok/s | pad % | s/step | "
             "peak RSS (GB) | peak above start (GB) | load avg (1 min) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(r: dict, ref: dict | None) -> str:
        return f"{r['real_tok_s'] / ref['real_tok_s']:.2f}x" if ref else "-"

    for r in results:
        p = r["precision"]
        lines.append(f"| {p} | {r['impl']} | {r['real_tok_s']:.0f} | {ratio(r, trl.get(p))} | "
                     f"{ratio(r, best.get(p))} ({best[p]['impl'] if p in best else '-'}) | {ratio(r, ours.get(p))} | "
                     f"{r['trained_tok_s']:.0f} | {100 * r['pad_fraction']:.0f} | "
                     f"{r['seconds'] / r['steps_timed']:.1f} | {r['peak_rss_gb']:.2f} | "
                     f"{r['peak_above_base_gb']:.2f} | {r['load_avg'][0]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="GSM8K train JSONL")
    p.add_argument("--rows", type=int, default=256, help="first N rows of the file")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (>= 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-size", type=int, default=1024, help="ours: positions per LM-head chunk")
    p.add_argument("--no-group-by-length", action="store_true", help="ours: random batches like TRL")
    p.add_argument("--impls", default="ours,trl", help=f"comma-separated subset of {','.join(IMPLS)}")
    p.add_argument("--packing", action="store_true",
                   help="also run ours-packed and TRL's packing / padding_free / group_by_length settings")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    p.add_argument("--profile", type=int, default=0, help="print the top-N ops of torch.profiler (no timing)")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--precision", choices=("fp32", "bf16"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1:
        p.error("--warmup must be >= 1 (the timed window starts at the end of a step)")
    if args.worker:
        print(json.dumps(worker(args)))
        return
    print(machine_line(), file=sys.stderr, flush=True)
    results = []
    impls = [x for x in args.impls.split(",") if x]
    if args.packing:
        impls += [x for x in ("ours-packed", "trl-packing", "trl-padding-free", "trl-group-by-length")
                  if x not in impls]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(IMPLS)}")
    for precision in [x for x in args.precisions.split(",") if x]:
        for impl in impls:
            r = run_fresh(impl, precision, args)
            if "profile" in r:
                print(f"## {impl} {precision}\n{r['profile']}", flush=True)
                continue
            print(f"# {impl:19s} {precision}: {r['real_tok_s']:6.1f} real tok/s, pad {100 * r['pad_fraction']:.0f}%, "
                  f"{r['trained_tok_s']:6.1f} trained tok/s, peak {r['peak_rss_gb']:.2f} GB "
                  f"(+{r['peak_above_base_gb']:.2f}), load {r['load_avg'][0]:.1f}, "
                  f"{r['total_seconds']:.0f} s in all", file=sys.stderr, flush=True)
            results.append(r)
    if results:
        print(f"B={args.batch}, max_length={args.max_length}, rows={args.rows}, {args.warmup} warm-up + "
              f"{args.steps} timed steps, threads={results[0]['threads']}\n")
        print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
