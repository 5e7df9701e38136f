"""vLLM vs lit_llm's own decoding loop for GRPO rollouts (issue 27), side by side in one process of ``.venv-vllm``.

``--generation``: tokens per second of sampling on ``grpo_step.py``'s workload (the embedded SmolLM2-135M-Instruct,
8 arithmetic prompts x 8 samples, <= 32 new tokens, T = 1, per-row seeds), the generate version of
``TransformersWrapper`` (our loop, one batched call, each prompt prefilled once) against ``vLLMWrapper`` on a
colocated engine holding the same weights, at the same precision (``32-true``: both fp32; ``bf16-mixed``: our loop
under bf16 autocast, a bfloat16 engine), alternated ``--repeats`` times; the median of each is printed with the ratio.

``--steps N``: GRPO seconds per optimizer step with and without ``use_vllm`` on the demo config
(``configs/grpo_arithmetic.yaml``: 8 x 8, <= 16 new tokens, dynamic sampling) and on a long-completion config
(``configs/grpo_gsm8k.yaml``: GSM8K prompts, 4 x 4 samples, <= 128 new tokens; needs ``../shared/data/gsm8k`` or
``LIT_LLM_SHARED_DATA``), each through the CLI in this process for ``N`` steps without evaluation; the median of the
steps after the first: ``time/step``, ``time/generation``, ``time/training`` and ``time/weight_push`` (the push of
the trained weights into the engine, per step).

Usage (after ``make setup-vllm``)::

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_rollouts.py --generation --repeats 3
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_rollouts.py --steps 4 --workloads demo gsm8k
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _memory import machine_line

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"demo": ("configs/grpo_arithmetic.yaml", []),
             "gsm8k": ("configs/grpo_gsm8k.yaml", ["--data.init_args.path", "{gsm8k}/train.jsonl",
                                                   "--data.init_args.eval_path", "{gsm8k}/test.jsonl",
                                                   "--trainer.precision", "32-true"])}


def arithmetic_prompt_ids(n: int, tokenizer) -> list[torch.Tensor]:
    """The ids of ``n`` arithmetic prompts rendered with the generation prompt (as the rollouts see them)."""
    from lit_llm.data.arithmetic import arithmetic_prompts
    from lit_llm.data.prompts import tokenize_prompts

    return tokenize_prompts([r["prompt"] for r in arithmetic_prompts(n, seed=0)], tokenizer)


def generation(precision: str, repeats: int, prompts: int, samples: int, max_new_tokens: int) -> None:
    """Print tokens/s of our loop and of vLLM on the same prompts, seeds and weights, alternated."""
    from lit_llm.models import load_model
    from lit_llm.policy import TransformersWrapper, vLLMWrapper
    from lit_llm.policy.vllm_engine import shared_engine
    from lit_llm.rollouts.engine import policy_responses, row_seeds
    from lit_llm.rollouts.vllm_colocate import engine_dtype

    model, tokenizer = load_model()
    model.eval()
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": 1.0}
    ours = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=kwargs,
                               num_samples=samples)
    llm = shared_engine("smollm2-135m-instruct", dtype=engine_dtype(precision), kv_cache_gib=1.0,
                        enforce_eager=True, seed=0)
    theirs = vLLMWrapper(llm, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=kwargs, num_samples=samples)
    theirs.load_weights(model.named_parameters())  # the trainer's weights, as a push would
    ids = arithmetic_prompt_ids(prompts, tokenizer)
    seeds = row_seeds(0, 0, 0, prompts, samples).reshape(prompts, samples)
    bf16 = precision.startswith("bf16")
    rates: dict[str, list[float]] = {"lit_llm": [], "vllm": []}
    for policy in (ours, theirs):  # warm-up: first-call allocations, vLLM's first batch shapes
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and policy is ours):
            policy_responses(policy, ids[:2], seeds=seeds[:2])
    for _ in range(repeats):
        for name, policy in (("lit_llm", ours), ("vllm", theirs)):
            t0 = time.perf_counter()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and name == "lit_llm"):
                responses, _, _ = policy_responses(policy, ids, seeds=seeds)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r) for r in responses)
            rates[name].append(tokens / seconds)
            print(f"  {precision} {name:>7}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s",
                  flush=True)
    a, b = statistics.median(rates["lit_llm"]), statistics.median(rates["vllm"])
    print(f"generation {precision}: lit_llm {a:.0f} tok/s, vLLM {b:.0f} tok/s (median of {repeats}): vLLM / lit_llm = "
          f"{b / a:.2f}x", flush=True)


def grpo_steps(workload: str, use_vllm: bool, steps: int, gsm8k: str) -> dict[str, float]:
    """Median per-step times of ``steps`` GRPO steps of ``workload`` (after the first) through the CLI."""
    from lit_llm.lightning.cli import main

    config, extra = WORKLOADS[workload]
    with tempfile.TemporaryDirectory() as root:
        main(["fit", "--config", str(ROOT / config), "--trainer.default_root_dir", root, "--trainer.max_steps",
              str(steps), "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0",
              "--trainer.enable_progress_bar", "false", "--checkpoint.every_n_train_steps", "1000",
              "--model.init_args.use_vllm", str(use_vllm).lower(), "--wandb", "false",
              *[e.format(gsm8k=gsm8k) for e in extra]])
        (metrics,) = Path(root).glob("csv/version_*/metrics.csv")
        with open(metrics) as f:
            rows = [r for r in csv.DictReader(f) if r.get("time/step")]
    rows = rows[1:] or rows
    keys = ["time/step", "time/generation", "time/training", "time/weight_push", "rollout/tokens_per_sec"]
    return {k: statistics.median(float(r[k]) for r in rows) for k in keys if rows[0].get(k)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--generation", action="store_true", help="time sampling only (tokens/s)")
    p.add_argument("--precisions", nargs="+", default=["32-true"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=0, help="GRPO steps per run (0: no GRPO runs)")
    p.add_argument("--workloads", nargs="+", default=["demo", "gsm8k"], choices=sorted(WORKLOADS))
    a = p.parse_args()
    print(machine_line(), flush=True)
    if a.generation:
        print(f"{a.prompts} prompts x {a.samples} samples, <= {a.max_new_tokens} new tokens, SmolLM2-135M-Instruct")
        for precision in a.precisions:
            generation(precision, a.repeats, a.prompts, a.samples, a.max_new_tokens)
    gsm8k = os.environ.get("LIT_LLM_SHARED_DATA", str(ROOT.parent / "shared" / "data")) + "/gsm8k"
    for workload in a.workloads if a.steps else []:
        if workload == "gsm8k" and not Path(gsm8k).is_dir():
            print(f"gsm8k: skipped, no GSM8K data at {gsm8k} (set LIT_LLM_SHARED_DATA)", file=sys.stderr)
            continue
        for use_vllm in (False, True):
            r = grpo_steps(workload, use_vllm, a.steps, gsm8k)
            print(f"grpo {workload} use_vllm={str(use_vllm).lower():>5}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
