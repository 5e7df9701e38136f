"""What a GRPO step spends on metrics: thread CPU seconds of each metric-only computation, as a share of the step's
training part (issue 31, item 2).

Runs ``grpo_train_cost.py``'s workload (SmolLM2-135M-Instruct, 8 arithmetic prompts x 8 generations, <= 32 new
tokens, ``dapo``, AdamW, one intra-op thread) and wraps the pieces of a step in thread-CPU timers
(``time.thread_time``: the training thread alone, so a loaded machine changes these figures little). Per step it
prints the training part (``PolicyModule.training_step``) and each wrapped piece; nested pieces are each timed whole
(a row's seconds include the rows nested in it, see the ``in`` column).

The entropy rides inside the chunked LM-head kernel's forward and cannot be wrapped apart. Its in-step cost is the
kernel forward's seconds of a run with ``--no-entropy`` (``log_prob_and_entropy`` -> ``log_prob`` and zeros: the same
loss, the same rollouts) subtracted from a normal run's. After training, the kernel is also run on the last step's
inputs (hidden states, LM head, targets) with and without ``want_entropy``, ``--kernel-repeats`` times each,
alternated (the entropy has no gradient at ``entropy_coef: 0``: the backward pass is the same either way); that
figure's page faults depend on what the allocator holds then, so prefer the in-step one. ``--dynamic-sampling`` adds
DAPO's dynamic sampling (as ``configs/grpo_arithmetic.yaml``) and times its bookkeeping. Results: benchmarks/README.md,
"Metric-only work in a GRPO step".

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/grpo_metric_cost.py --steps 3
    ... benchmarks/grpo_metric_cost.py --steps 3 --no-entropy        # the entropy's in-step A/B
    # the shipped configs' micro-batching (grpo_arithmetic.yaml: 16 rows, 4 micro-batches per step):
    ... benchmarks/grpo_metric_cost.py --steps 3 --micro-batch-size 16
    # the structure on the tiny test model (seconds):
    ... benchmarks/grpo_metric_cost.py --steps 3 --model tiny [--dynamic-sampling]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import defaultdict
from functools import partial, wraps
from typing import Any

import torch
from _memory import machine_line
from grpo_train_cost import REWARDS
from lightning.pytorch import Trainer

from lit_llm.lightning import grpo as grpo_mod
from lit_llm.lightning import grpo_metrics
from lit_llm.lightning import module as module_mod
from lit_llm.lightning import versions as versions_mod
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.objectives import grpo as objective_mod
from lit_llm.policy import kernel, masked_dist

#: (owner, attribute, row label, parent label, metric-only?) of each timed piece
PIECES = [
    (module_mod.PolicyModule, "training_step", "training part (PolicyModule.training_step)", "", False),
    (grpo_mod.GRPOModule, "step_denominator", "step count (GRPOModule.step_denominator)", "training part", False),
    (grpo_mod.GRPOModule, "micro_batch_loss", "micro-batch loss forward (GRPOModule.micro_batch_loss)",
     "training part", False),
    (kernel._ChunkedTokenLogProbs, "forward", "LM-head kernel forward (log-probs + entropy)", "micro-batch loss",
     False),
    (kernel._ChunkedTokenLogProbs, "backward", "LM-head kernel backward", "training part (in backward)", False),
    (objective_mod, "grpo_loss", "grpo_loss (surrogate + its metrics)", "micro-batch loss", False),
    (objective_mod, "mismatch_metrics", "sampler/trainer mismatch metrics (mismatch_metrics)", "grpo_loss", True),
    (objective_mod, "masked_min_max", "ratio min/max (masked_min_max)", "grpo_loss", True),
    (objective_mod, "_masked_mean", "clip fractions, ratio/entropy means (_masked_mean)", "grpo_loss", True),
    (grpo_metrics.GRPOStepStats, "add", "step statistics per micro-batch, first-iteration ranges "
     "(GRPOStepStats.add)", "micro-batch loss", True),
    (grpo_mod.GRPOModule, "micro_batch_real_tokens", "real-token counts (micro_batch_real_tokens, x2 per "
     "micro-batch)", "training part", True),
    (grpo_mod.GRPOModule, "_log_step", "step sums all-reduced (GRPOModule._log_step)", "training part", True),
    (grpo_mod.GRPOModule, "_log_rollout", "batch metrics + log_dict (GRPOModule._log_rollout)", "step, after the "
     "training part", True),
    (grpo_mod, "rollout_metrics", "rollout metrics (rollout_metrics)", "_log_rollout", True),
    (module_mod.PolicyModule, "release_host_memory", "host-memory release (release_host_memory)", "step", False),
    (versions_mod, "informative_groups", "dynamic sampling: groups with unequal rewards (informative_groups)",
     "rollout (before the training part)", False),
    (versions_mod, "select_groups", "dynamic sampling: kept groups, advantages recomputed (select_groups)",
     "rollout (before the training part)", False),
    (versions_mod.SamplingCap, "update", "dynamic sampling: cap bookkeeping (SamplingCap.update)",
     "rollout (before the training part)", True),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--kernel-repeats", type=int, default=5)
    p.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO's dynamic sampling on (max_sampling_rounds 3), as configs/grpo_arithmetic.yaml")
    p.add_argument("--no-entropy", action="store_true",
                   help="train with the kernel's entropy off (log_prob_and_entropy -> log_prob and zeros): the in-step "
                        "A/B of its cost")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(machine_line(), flush=True)

    cpu: dict[str, list[float]] = defaultdict(list)  # label -> seconds per call
    faults: dict[str, list[tuple[int, float]]] = defaultdict(list)  # label -> (minor page faults, system s) per call
    captured: dict[str, Any] = {}

    def timed(fn, label):
        @wraps(fn)
        def run(*args, **kwargs):
            t, r = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return fn(*args, **kwargs)
            finally:
                cpu[label].append(time.thread_time() - t)
                r1 = resource.getrusage(resource.RUSAGE_THREAD)
                faults[label].append((r1.ru_minflt - r.ru_minflt, r1.ru_stime - r.ru_stime))
        return run

    for owner, attr, label, _, _ in PIECES:
        fn = owner.__dict__[attr]
        if isinstance(fn, staticmethod):
            inner = fn.__func__
            if attr == "forward":  # keep the last call's inputs for the entropy A/B
                def keep(ctx, h, weight, bias, y, *rest, _f=inner):
                    captured.update(h=h.detach().clone(), weight=weight.detach(), bias=bias, y=y.clone(), rest=rest)
                    return _f(ctx, h, weight, bias, y, *rest)
                inner = keep
            setattr(owner, attr, staticmethod(timed(inner, label)))
        else:
            setattr(owner, attr, timed(fn, label))

    if a.no_entropy:
        def log_prob_only(self, value, *, return_hits=False):
            lp = self.log_prob(value)
            return lp, torch.zeros_like(lp)
        masked_dist.ChunkedLLMMaskedCategorical.log_prob_and_entropy = log_prob_only
    module = grpo_mod.GRPOModule(a.model, reward_funcs=REWARDS, num_generations=8, max_new_tokens=32,
                                 temperature=1.0, micro_batch_size=a.micro_batch_size, log_samples_every=0,
                                 optimizer=partial(torch.optim.AdamW, lr=1e-6), dynamic_sampling=a.dynamic_sampling)
    data = GRPODataModule("arithmetic", batch_size=8, num_train=8 * a.steps * (3 if a.dynamic_sampling else 1),
                          num_eval=0)
    Trainer(max_steps=a.steps, precision=a.precision, accelerator="cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0).fit(module, data)

    # per-step seconds of each piece (calls between two training parts; _log_rollout comes after its step's)
    labels = [label for _, _, label, _, _ in PIECES]
    train = cpu[labels[0]]
    print(f"\nmicro_batch_size {a.micro_batch_size}; training part CPU s per step: {[round(s, 2) for s in train]}")
    print("| piece | in | metric only | CPU s per step (steps 2+) | share of the training part | minor faults, "
          "system s per step |")
    print("|---|---|---|---:|---:|---:|")
    n, skip = len(train), 1 if len(train) > 1 else 0
    varying: list[str] = []
    base = statistics.mean(train[skip:])
    for _, _, label, parent, metric in PIECES:
        calls, flts = cpu.get(label, []), faults.get(label, [])
        if len(calls) % n == 0:  # the same number of calls every step: steps 2+
            first, steps = len(calls) // n * skip, n - skip
        else:  # a varying number of calls per step (dynamic sampling's rounds): the mean over every step
            first, steps = 0, n
        s = sum(calls[first:]) / steps
        f, sy = sum(x[0] for x in flts[first:]) / steps, sum(x[1] for x in flts[first:]) / steps
        print(f"| {label} | {parent} | {'yes' if metric else ''} | {s:.4f} | {100 * s / base:.2f}% | {f:.0f}, "
              f"{sy:.2f} |")
        if first == 0 and steps == n and calls:
            varying.append(f"{label}: CPU s per call {[round(c, 4) for c in calls]}")
    for line in varying:
        print(line)

    # entropy: the kernel forward on the last step's inputs, with and without it (alternated)
    if captured:
        h, w, b, y, rest = captured["h"], captured["weight"], captured["bias"], captured["y"], captured["rest"]
        temperature, chunk_size, _, mm_dtype, want_hits = rest
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.kernel_repeats):
            for ent in (True, False):
                with torch.no_grad():
                    t = time.thread_time()
                    kernel._ChunkedTokenLogProbs.apply(h, w, b, y, temperature, chunk_size, ent, mm_dtype, want_hits)
                    times[ent].append(time.thread_time() - t)
        with_e, without = statistics.median(times[True]), statistics.median(times[False])
        print(f"\nkernel forward on {h.shape[0]} scored positions x vocab {w.shape[0]} (chunk {chunk_size}), "
              f"medians of {a.kernel_repeats}: with entropy {with_e:.3f} s, without {without:.3f} s: entropy "
              f"{with_e - without:.3f} s per call = {100 * (with_e - without) / base:.2f}% of the training part "
              f"per micro-batch call")


if __name__ == "__main__":
    main()
