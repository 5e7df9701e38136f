"""Full fine-tuning vs LoRA (``use_peft``) on SmolLM2-135M, fp32: seconds per step, peak RSS, gradient and optimizer
state bytes, checkpoint size, for an SFT step and a GRPO step (issue 15).

Every configuration runs in a fresh process (``--worker``), so each peak RSS (``VmHWM``) is its own: the peak is
measured from process start (it includes the loaded weights, which both variants share) and, as **train peak**, above
the RSS after the module is built (``VmHWM`` reset then). Per run: ``--warmup`` steps, then ``--steps`` timed steps
(median s/step); then the trainable parameters' gradient bytes (the step's gradients: one float per trainable weight),
the optimizer state bytes (AdamW: ``exp_avg`` + ``exp_avg_sq`` + step per trainable weight) and the size of the
checkpoint ``trainer.save_checkpoint`` writes (LoRA: adapters + their optimizer state + the base's identity).

* SFT: GSM8K train rows (``--data``; the synthetic arithmetic task when it is absent), ``--batch`` rows per step in
  micro-batches of ``--micro``, ``max_length`` 256.
* GRPO: ``--prompts`` arithmetic prompts x ``--generations`` completions of <= ``--max-new-tokens`` tokens.
* LoRA: ``lora_r`` 16, ``lora_alpha`` 32, peft's default targets (``q_proj``, ``v_proj``).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lora_memory.py                # SmolLM2, 1 warm-up + 2 steps each
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lora_memory.py --model tiny   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from _memory import GB, machine_line, release_and_reset_peak, status_kb

HERE = Path(__file__).resolve().parent
GSM8K = Path(os.environ.get("LIT_LLM_SHARED_DATA", HERE.parents[1] / "shared" / "data")) / "gsm8k" / "train.jsonl"
MB = 1024**2


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(args: argparse.Namespace) -> dict:
    from lightning.pytorch import Callback, Trainer, seed_everything

    seed_everything(0, verbose=False)
    torch.set_num_threads(args.threads)
    lora = {"use_peft": True, "lora_r": 16, "lora_alpha": 32} if args.variant == "lora" else {}
    opt = partial(torch.optim.AdamW, lr=1e-5)
    if args.recipe == "sft":
        from lit_llm.lightning.datamodules import SFTDataModule
        from lit_llm.lightning.sft import SFTModule

        module = SFTModule(args.model, optimizer=opt, token_accuracy=False, **lora)
        data = (SFTDataModule(str(GSM8K), format="gsm8k", limit=args.batch * (args.warmup + args.steps),
                              max_length=256, batch_size=args.batch, micro_batch_size=args.micro)
                if GSM8K.is_file() else
                SFTDataModule(format="arithmetic", num_samples=args.batch * (args.warmup + args.steps),
                              batch_size=args.batch, micro_batch_size=args.micro))
    else:
        from lit_llm.lightning.grpo import GRPOModule
        from lit_llm.lightning.grpo_data import GRPODataModule

        module = GRPOModule(args.model, num_generations=args.generations, max_new_tokens=args.max_new_tokens,
                            micro_batch_size=args.prompts * args.generations, log_samples_every=0, optimizer=opt,
                            **lora)
        data = GRPODataModule("arithmetic", batch_size=args.prompts,
                              num_train=args.prompts * (args.warmup + args.steps), num_eval=0)
    after_load = release_and_reset_peak()
    times: list[float] = []
    grads: list[int] = []

    class Timer(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(_bytes(p.grad for p in pl_module.model.parameters() if p.grad is not None))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.t0)

    trainer = Trainer(max_steps=args.warmup + args.steps, accelerator="cpu", devices=1, precision="32-true",
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Timer()])
    trainer.fit(module, data)
    peak_total = status_kb("VmHWM") * 1024
    opt_state = _bytes(v for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v))
    trainable = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.ckpt"
        trainer.save_checkpoint(path)
        ckpt = path.stat().st_size
    return {"recipe": args.recipe, "variant": args.variant, "s_per_step": statistics.median(times[args.warmup:]),
            "peak_rss_gb": peak_total / GB, "train_peak_gb": (peak_total - after_load) / GB,
            "trainable": trainable, "grad_mb": (grads[-1] if grads else 0) / MB, "optimizer_mb": opt_state / MB,
            "checkpoint_mb": ckpt / MB}


def run_fresh(recipe: str, variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--recipe", recipe, "--variant", variant, "--model", args.model,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--batch", str(args.batch), "--micro", str(args.micro), "--prompts", str(args.prompts),
           "--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])})
    if out.returncode:
        raise RuntimeError(f"{recipe}/{variant} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = ["| recipe | variant | trainable params | s/step | peak RSS (GB) | train peak above load (GB) | "
             "gradients (MB) | optimizer state (MB) | checkpoint (MB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    full = {r["recipe"]: r for r in results if r["variant"] == "full"}
    for r in results:
        f = full.get(r["recipe"])
        rel = "" if f is None or r is f else (f" ({100 * r['optimizer_mb'] / f['optimizer_mb']:.2f}% / "
                                               f"{100 * r['checkpoint_mb'] / f['checkpoint_mb']:.2f}% of full)")
        lines.append(f"| {r['recipe']} | {r['variant']}{rel} | {r['trainable']:,} | {r['s_per_step']:.2f} | "
                     f"{r['peak_rss_gb']:.2f} | {r['train_peak_gb']:.2f} | {r['grad_mb']:.2f} | "
                     f"{r['optimizer_mb']:.2f} | {r['checkpoint_mb']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="SFT rows per step")
    p.add_argument("--micro", type=int, default=4, help="SFT rows per micro-batch")
    p.add_argument("--prompts", type=int, default=2, help="GRPO prompts per step")
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--recipes", default="sft,grpo")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--recipe", default="sft", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="full", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"model {args.model}, fp32 (32-true), AdamW; {args.warmup} warm-up + {args.steps} timed steps per run; "
          f"SFT {args.batch} rows/step ({'GSM8K' if GSM8K.is_file() else 'arithmetic'}), GRPO {args.prompts} x "
          f"{args.generations} x <= {args.max_new_tokens} tokens; LoRA r=16, alpha=32, q_proj+v_proj")
    results = [run_fresh(recipe, variant, args) for recipe in args.recipes.split(",") for variant in ("full", "lora")]
    print(table(results))


if __name__ == "__main__":
    main()
