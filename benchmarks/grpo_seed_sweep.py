"""Seed sweep of the main job (issue 17): ``lit-llm fit --config configs/grpo_arithmetic.yaml`` once per seed.

Each seed runs in a FRESH ``lit-llm fit`` subprocess with ``seed_everything`` and ``model.init_args.rollout_seed``
both set to the seed (the demo config's two seeds, varied together), under its own run folder. After each run the
script reads the run's ``metrics.csv`` and reports:

- strict and lenient greedy accuracy (``eval/strict_arithmetic_reward``, ``eval/arithmetic_answer_reward``, 200
  held-out problems) at every evaluation, the best and the last strict accuracy;
- ``lit-llm fit`` wall time (seconds, the subprocess from start to exit, model loading and every evaluation included)
  and the median step time (``time/step``);
- collapse flags (issue 17's definition): mean entropy (``train/entropy``) < 0.01 for 5 consecutive steps; fraction of
  zero-std reward groups (``train/frac_reward_zero_std``) > 0.9 for 5 consecutive steps; strict accuracy at an
  evaluation more than 15 points below its best so far;
- the precision the run resolved to (from its log) and the CPU model and flags (``_memory.machine_line``).

``--avx2`` sets ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`` in the runs:
emulation of an AVX2-only CPU on an AVX-512 machine (the kernels torch, oneDNN and MKL pick; not the real hardware's
speed). The sweep is a measurement, not a test: 5 seeds take about an hour on a 2-core CPU. Runs on a loaded machine
give the same accuracies (rollouts are seeded, and a run is bit-reproducible at a given thread count and CPU
capability) but longer wall times; the script prints the 1-minute load average at the start and end of each run. The
demo config's ``trainer.max_time`` (60 min) stops a slow run early: on a loaded machine pass
``-- --trainer.max_time null`` to see every step. Recipe variants go after ``--`` too, e.g.
``-- --model.init_args.reward_funcs "[strict_arithmetic_reward, bare_number_closeness_curriculum_reward]"
--model.init_args.reward_weights "[1.0, 1.0]"``.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_seed_sweep.py --seeds 0 1 2 3 4 --avx2
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/grpo_seed_sweep.py --seeds 1 --summarize runs/sweep/seed1  # re-read
    .venv/bin/python benchmarks/grpo_seed_sweep.py --seeds 5 -- --trainer.max_steps 40   # extra lit-llm arguments
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _memory import machine_line

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
STRICT, LENIENT = "eval/strict_arithmetic_reward", "eval/arithmetic_answer_reward"
#: Issue 17's collapse definition.
ENTROPY_FLOOR, ZERO_STD_CEILING, CONSECUTIVE, ACCURACY_DROP = 0.01, 0.9, 5, 0.15


def _float(x: str | None) -> float:
    try:
        return float(x) if x not in (None, "") else math.nan
    except ValueError:
        return math.nan


def _runs_of(flags: list[bool], n: int) -> int | None:
    """The first index at which ``n`` consecutive True values end, or ``None``."""
    count = 0
    for i, f in enumerate(flags):
        count = count + 1 if f else 0
        if count >= n:
            return i
    return None


def summarize(run_dir: Path) -> dict:
    """Read ``run_dir``'s newest ``metrics.csv`` (Lightning CSV logger layout) into the sweep's figures.

    Raises:
        FileNotFoundError: no ``metrics.csv`` under ``run_dir``.
    """
    files = sorted(run_dir.glob("**/metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no metrics.csv under {run_dir}: did the run start?")
    with open(files[-1], newline="") as fh:
        rows = list(csv.DictReader(fh))
    train = [r for r in rows if r.get("train/reward")]
    evals = [r for r in rows if r.get(STRICT)]
    steps = [int(_float(r["step"])) for r in train]
    entropy = [_float(r.get("train/entropy")) for r in train]
    zero_std = [_float(r.get("train/frac_reward_zero_std")) for r in train]
    strict = [(int(_float(r["step"])), _float(r[STRICT])) for r in evals]
    lenient = [(int(_float(r["step"])), _float(r.get(LENIENT))) for r in evals]
    drop_at, best = None, -1.0
    for s, acc in strict:
        if drop_at is None and best - acc > ACCURACY_DROP:
            drop_at = s
        best = max(best, acc)
    low_entropy = _runs_of([e < ENTROPY_FLOOR for e in entropy], CONSECUTIVE)
    flat = _runs_of([z > ZERO_STD_CEILING for z in zero_std], CONSECUTIVE)
    step_times = [_float(r.get("time/step")) for r in train if r.get("time/step")]
    lengths = [_float(r.get("train/completions/mean_length")) for r in train]
    return {
        "steps": len(train),
        "strict": strict, "lenient": lenient,
        "best_strict": max((a for _, a in strict), default=math.nan),
        "last_strict": strict[-1][1] if strict else math.nan,
        "median_step_s": statistics.median(step_times) if step_times else math.nan,
        "collapse": {"entropy_below_0.01_x5_at_step": None if low_entropy is None else steps[low_entropy],
                     "zero_std_above_0.9_x5_at_step": None if flat is None else steps[flat],
                     "strict_drop_over_15_points_at_step": drop_at},
        # bare answers dominate: "85" + end of turn is 2-4 tokens, the base model's sentences ~14
        "first_step_mean_length_at_most_5": next((steps[i] for i, n in enumerate(lengths) if n <= 5), None),
    }


def run_seed(seed: int, args: argparse.Namespace, extra: list[str]) -> dict:
    """Run ``lit-llm fit`` for ``seed`` in a subprocess; return :func:`summarize`'s figures plus wall time, load and
    the resolved precision."""
    out = Path(args.out) / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.avx2:
        env.update(AVX2_ENV)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [str(Path(sys.executable).with_name("lit-llm")), "fit", "--config", args.config, "--wandb", "false",
           "--seed_everything", str(seed), "--model.init_args.rollout_seed", str(seed),
           "--trainer.default_root_dir", str(out / "run"), *extra]
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with open(out / "log.txt", "w") as log:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    text = (out / "log.txt").read_text(errors="replace")
    precision = re.search(r"precision[^\n]*?(32-true|bf16-mixed|bf16-true|16-mixed)", text)
    result = {"seed": seed, "exit": rc, "wall_s": round(wall, 1), "load_1min": [load0, load1],
              "precision": precision.group(1) if precision else "?", **summarize(out / "run")}
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    return result


def print_table(results: list[dict]) -> None:
    evals = sorted({s for r in results for s, _ in r["strict"]})
    print("| seed | " + " | ".join(str(s) for s in evals) + " | best | wall | median step | precision | collapse |")
    print("|---" * (len(evals) + 6) + "|")
    for r in results:
        strict = dict(r["strict"])
        lenient = dict(r["lenient"])
        cells = [f"{100 * strict[s]:.1f} / {100 * lenient[s]:.1f}" if s in strict else "-" for s in evals]
        flags = [k for k, v in r["collapse"].items() if v is not None]
        print(f"| {r['seed']} | " + " | ".join(cells) + f" | {100 * r['best_strict']:.1f} | "
              f"{r.get('wall_s', math.nan) / 60:.1f} min | {r['median_step_s']:.1f} s | {r.get('precision', '?')} | "
              f"{', '.join(flags) or 'none'} |")
    last = [r["last_strict"] for r in results]
    if last:
        print(f"strict at the last evaluation: median {100 * statistics.median(last):.1f}%, "
              f"min {100 * min(last):.1f}%, seeds >= 50%: {sum(a >= 0.5 for a in last)} of {len(last)}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--config", default="configs/grpo_arithmetic.yaml")
    p.add_argument("--out", default="runs/grpo_seed_sweep", help="one folder per seed below it")
    p.add_argument("--avx2", action="store_true", help="emulate an AVX2-only CPU (ATEN/oneDNN/MKL caps)")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: torch's)")
    p.add_argument("--summarize", action="store_true", help="only re-read the seeds' existing run folders")
    p.add_argument("--json", default=None, help="also write every seed's figures here")
    args = p.parse_args(argv)
    print(machine_line(), "| AVX2 emulated" if args.avx2 else "", flush=True)
    results = []
    for seed in args.seeds:
        if args.summarize:  # wall time, load and precision from the run's summary.json when it wrote one
            saved = Path(args.out) / f"seed{seed}" / "summary.json"
            kept = {k: v for k, v in json.loads(saved.read_text()).items() if k in ("exit", "wall_s", "load_1min",
                                                                                 "precision")} if saved.exists() else {}
            results.append({"seed": seed, **kept, **summarize(Path(args.out) / f"seed{seed}" / "run")})
        else:
            results.append(run_seed(seed, args, extra))
            r = results[-1]
            print(f"seed {seed}: exit {r['exit']}, {r['wall_s'] / 60:.1f} min, strict "
                  + " ".join(f"{s}:{100 * a:.1f}" for s, a in r["strict"]), flush=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
