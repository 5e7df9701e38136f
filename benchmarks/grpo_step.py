"""Seconds per GRPO optimizer step, split into generation and training (issue 6 benchmark).

Setting (issue 6): the embedded SmolLM2-135M-Instruct, 8 prompts x 8 generations, at most 32 new tokens, sampling at
temperature 1.0, on the synthetic arithmetic prompts, one optimizer step per batch (``dapo`` loss, AdamW). Each
precision runs in a fresh Lightning ``Trainer`` for ``--steps`` steps; the first ``--warmup`` steps are discarded and
the median of the rest is reported: ``step`` (s), ``generation`` (rollout sampling, KV cache), ``training``
(log-probs of the completion tokens with the chunked LM head + backward + optimizer), tokens/s of training (prompt +
completion tokens of the trained rows per second of training), and the peak RSS. Every run (ours or TRL's, per
precision) is a separate child process, so each peak RSS is that run's own.

When ``trl`` is installed (``pip install -e '.[bench]'``) TRL's ``GRPOTrainer`` runs with the same settings in the
same invocation (``--trl``) and its median step time is printed beside ours. Measured outside this project on this
machine, TRL took 39.9-40.9 s per step (generation 10.8 s, training 29-30 s) in fp32.

``--parts`` instead times the two halves of a step in one process, outside Lightning: one rollout (generation +
rewards) and one forward+backward of its 64 rows, with ``share_prompts`` on and off, in fp32 and under bf16 autocast
(each twice; where the step's time goes).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_step.py                       # fp32 and bf16-mixed
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_step.py --model tiny --steps 3 --precisions 32-true  # smoke
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_step.py --parts                         # generation / training
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from _memory import machine_line
from lightning.pytorch import Callback, Trainer

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule

REWARDS = ["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward"]


TIME_KEYS = ("time/step", "time/generation", "time/training", "train/tokens_per_sec")


class StepMetrics(Callback):
    """Keeps ``keys`` of the logged metrics after every training batch (those present)."""

    def __init__(self, keys: tuple[str, ...] = TIME_KEYS) -> None:
        self.keys = keys
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.rows.append({k: float(m[k]) for k in self.keys if k in m})


def fit_steps(model: str, precision: str, steps: int, prompts: int, generations: int, max_new_tokens: int,
              keys: tuple[str, ...] = TIME_KEYS, **options) -> list[dict[str, float]]:
    """Fit ``steps`` GRPO steps on the arithmetic prompts (``GRPOModule(**options)``) and return ``keys`` of every
    step's logged metrics."""
    module = GRPOModule(model, reward_funcs=REWARDS, num_generations=generations, max_new_tokens=max_new_tokens,
                        temperature=1.0, micro_batch_size=prompts * generations, log_samples_every=0,
                        optimizer=partial(torch.optim.AdamW, lr=1e-6), **options)
    data = GRPODataModule("arithmetic", batch_size=prompts, num_train=prompts * steps, num_eval=0)
    metrics = StepMetrics(keys)
    trainer = Trainer(max_steps=steps, precision=precision, accelerator="auto", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[metrics])
    trainer.fit(module, data)
    return metrics.rows


def run_ours(model: str, precision: str, steps: int, warmup: int, prompts: int, generations: int,
             max_new_tokens: int) -> dict[str, float]:
    """Median step / generation / training seconds of ``steps - warmup`` GRPO steps."""
    all_rows = fit_steps(model, precision, steps, prompts, generations, max_new_tokens)
    rows = all_rows[warmup:] or all_rows
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    return out


def run_trl(precision: str, steps: int, prompts: int, generations: int, max_new_tokens: int) -> dict[str, float] | None:
    """Median seconds per step of TRL's ``GRPOTrainer`` with the same settings (and the peak RSS), or ``None``
    without ``trl``."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    from lit_llm.data.arithmetic import arithmetic_prompts
    from lit_llm.models import load_model
    from lit_llm.rewards import strict_arithmetic_reward

    model, tokenizer = load_model()
    rows = arithmetic_prompts(prompts * steps, seed=0)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    config = GRPOConfig(output_dir="/tmp/lit_llm_trl_bench", per_device_train_batch_size=prompts * generations,
                        num_generations=generations, max_completion_length=max_new_tokens, temperature=1.0,
                        max_steps=steps, learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no",
                        bf16=precision == "bf16-mixed", use_cpu=not torch.cuda.is_available())
    stamps: list[float] = []

    from transformers import TrainerCallback

    class _Stamp(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            stamps.append(time.perf_counter())

    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[strict_arithmetic_reward],
                          args=config, train_dataset=dataset, callbacks=[_Stamp()])
    start = time.perf_counter()
    trainer.train()
    deltas = [b - a for a, b in zip([start, *stamps], stamps)]
    return {"time/step": statistics.median(deltas[1:] or deltas),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2}


def run_parts(model: str, prompts: int, generations: int, max_new_tokens: int) -> None:
    """Print the seconds of one rollout and of one forward+backward of its rows (shared prompts on / off), through
    the objects training runs: the engine's rollout (batcher on) and the log-prob version's masked distribution."""
    from lit_llm.data.arithmetic import arithmetic_prompts

    module = GRPOModule(model, reward_funcs=REWARDS, num_generations=generations, max_new_tokens=max_new_tokens,
                        temperature=1.0, micro_batch_size=prompts * generations, log_samples_every=0)
    rows = arithmetic_prompts(prompts, seed=0)
    batch = {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}
    rollout = None
    for bf16 in (False, True, False, True):
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), module.versions.generating():
            rollout = module.engine.rollout(batch, step=0)
        print(f"rollout {'bf16' if bf16 else 'fp32'}: {time.perf_counter() - t:.2f} s "
              f"(generation {rollout.generation_time:.2f} s)", flush=True)
    mbs = module.micro_batches(rollout)
    shapes = [(tuple(mb.prompt_ids.shape), tuple(mb.completion_ids.shape)) for mb in mbs]
    print(f"micro-batches (prompts, completions): {shapes}")
    for share in (True, False):
        scorer = module.versions.log_prob_version.get_new_version(share_prompts=share)
        for bf16 in (False, True, False, True):
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                for mb in mbs:
                    lp, ent = scorer.get_dist(mb.policy_inputs()).log_prob_and_entropy(mb.completion_ids)
                    lp.sum().backward()
            module.model.zero_grad(set_to_none=True)
            print(f"forward+backward, share_prompts={share}, {'bf16' if bf16 else 'fp32'}: "
                  f"{time.perf_counter() - t:.2f} s", flush=True)


def _child(a: argparse.Namespace, impl: str, precision: str) -> dict[str, float] | None:
    """Run one measurement in a fresh process (its own peak RSS); ``None`` when that run reports nothing."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--precisions", precision, "--model", a.model,
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--prompts", str(a.prompts), "--generations",
           str(a.generations), "--max-new-tokens", str(a.max_new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {precision} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer (needs trl)")
    p.add_argument("--parts", action="store_true", help="time one rollout and one forward+backward instead")
    p.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)  # one measurement, in a child
    a = p.parse_args()
    if not a.worker:
        print(machine_line(), flush=True)
    if a.parts:
        run_parts(a.model, a.prompts, a.generations, a.max_new_tokens)
        return
    if a.worker:
        args = (a.precisions[0], a.steps)
        r = run_ours(a.model, *args, a.warmup, a.prompts, a.generations, a.max_new_tokens) if a.worker == "ours" \
            else run_trl(*args, a.prompts, a.generations, a.max_new_tokens)
        print("RESULT " + json.dumps(r), flush=True)
        return
    print(f"{a.prompts} prompts x {a.generations} generations, <= {a.max_new_tokens} new tokens, model {a.model}, "
          f"{torch.get_num_threads()} threads")
    for precision in a.precisions:
        r = _child(a, "ours", precision)
        line = (f"lit_llm {precision:>10}: step {r['time/step']:.2f} s = generation {r['time/generation']:.2f} s + "
                f"training {r['time/training']:.2f} s; {r.get('train/tokens_per_sec', float('nan')):.0f} trained "
                f"tokens/s; peak RSS {r['peak_rss_gb']:.2f} GB")
        print(line, flush=True)
        if a.trl:
            t = _child(a, "trl", precision)
            print(f"TRL     {precision:>10}: " + ("trl not installed" if t is None else
                                                  f"step {t['time/step']:.2f} s; peak RSS {t['peak_rss_gb']:.2f} GB "
                                                  f"-> lit_llm is {t['time/step'] / r['time/step']:.2f}x"),
                  flush=True)


if __name__ == "__main__":
    main()
