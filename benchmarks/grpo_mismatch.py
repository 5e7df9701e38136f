"""Sampler/trainer mismatch before / after ``old_log_probs: recompute``, and what the recompute costs (issue 15).

Setting: the embedded SmolLM2-135M-Instruct on the synthetic arithmetic prompts, ``--prompts`` x ``--generations``
completions of at most ``--max-new-tokens`` tokens at temperature 1.0, ``--steps`` GRPO steps (``dapo``, AdamW,
lr 1e-6) per run. Runs, each in a fresh ``Trainer`` (same seeds, so the same first rollout), per precision:

* ``rollout``: old log-probs = the generation-time ones (today's default) -- *before*;
* ``recompute+token_truncate``: old log-probs = the training forward under no-grad, and the generation-time gap
  corrected by TIS weights (cap 2) -- *after*.

Each run is repeated per ``--head-dtypes`` value (the trainer's ``lm_head_matmul_dtype``, issue 28: ``float32``,
the default, or ``bfloat16``: the log-prob kernel's LM-head matmul in bf16, as the sampler's own head matmul runs
under ``bf16-mixed``); ``--runs`` picks the runs (``rollout`` alone measures the mismatch).

Printed per run (first iteration of each step, medians over steps): ``mismatch/kl`` (k3 of generation-time vs
trainer log-probs on the same ids), the range of trainer / sampler probability, the range of the GRPO ratio and its
clipped fraction at the first iteration, the correction's capped fraction, and ``time/step`` / ``time/recompute``
(the recompute's share of the step is its cost).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_mismatch.py                  # fp32 and bf16-mixed, 1 step
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_mismatch.py --model tiny     # smoke
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_mismatch.py --precisions bf16-mixed --runs rollout \
        --head-dtypes float32,bfloat16                                              # lm_head_matmul_dtype
"""

from __future__ import annotations

import argparse
import statistics

from _memory import machine_line
from grpo_step import fit_steps  # the same GRPO fit as the step benchmark
from lightning.pytorch import seed_everything

KEYS = ("train/mismatch/kl", "train/mismatch/ratio_min", "train/mismatch/ratio_max",
        "train/first_iteration/ratio_min", "train/first_iteration/ratio_max", "train/first_iteration/clip_ratio",
        "train/rollout_correction/corrected_fraction", "time/step", "time/training", "time/recompute")
RUNS = {"rollout": {"old_log_probs": "rollout"},
        "recompute+token_truncate": {"old_log_probs": "recompute", "rollout_correction": "token_truncate"}}


def run(model: str, precision: str, steps: int, prompts: int, generations: int, max_new_tokens: int,
        **options) -> dict[str, float]:
    """Median of each metric over the run's steps."""
    seed_everything(0, verbose=False)
    rows = fit_steps(model, precision, steps, prompts, generations, max_new_tokens, keys=KEYS, **options)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--precisions", default="32-true,bf16-mixed")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--head-dtypes", default="float32", help="lm_head_matmul_dtype values, comma-separated")
    p.add_argument("--runs", default=",".join(RUNS), help=f"runs among {', '.join(RUNS)}, comma-separated")
    a = p.parse_args()
    print(machine_line())
    print(f"model {a.model}; {a.prompts} prompts x {a.generations} generations x <= {a.max_new_tokens} tokens; "
          f"{a.steps} step(s) per run (medians)")
    head = ("precision", "head matmul", "old_log_probs", "mismatch k3", "trainer/sampler min", "max",
            "first ratio min", "max", "clipped", "TIS capped", "step (s)", "recompute (s)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    runs = [(precision, dtype, name) for precision in a.precisions.split(",") for dtype in a.head_dtypes.split(",")
            for name in a.runs.split(",")]
    for precision, dtype, name in runs:
        r = run(a.model, precision, a.steps, a.prompts, a.generations, a.max_new_tokens, **RUNS[name],
                lm_head_matmul_dtype=dtype)
        cells = [precision, dtype, name, f"{r['train/mismatch/kl']:.2e}", f"{r['train/mismatch/ratio_min']:.6f}",
                 f"{r['train/mismatch/ratio_max']:.6f}", f"{r['train/first_iteration/ratio_min']:.6f}",
                 f"{r['train/first_iteration/ratio_max']:.6f}", f"{r['train/first_iteration/clip_ratio']:.4f}",
                 f"{r.get('train/rollout_correction/corrected_fraction', float('nan')):.4f}",
                 f"{r['time/step']:.2f}", f"{r.get('time/recompute', 0.0):.2f}"]
        print("| " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
