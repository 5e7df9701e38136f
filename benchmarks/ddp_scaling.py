"""DDP scaling on CPU: SFT samples/s with 1 process vs 2 processes (Lightning's DDP, gloo) -- issue 7.

Each configuration is a fresh ``lit-llm fit`` subprocess on the synthetic arithmetic task (``configs/sft_tiny.yaml``
with overrides): the same per-rank batch (``--batch-size`` samples per optimizer step per process, one micro-batch),
so 2 processes train 2x the samples per step (weak scaling, as DDP is used). No validation, CSV logger only, one
checkpoint at the end (outside the timed window). Samples/s comes from the run's own metrics: a step's wall time is
``train/step_tokens / train/tokens_per_sec`` (both logged by :class:`~lit_llm.lightning.module.PolicyModule` every
step, the time between two step ends), and ``samples/s = batch_size * processes / step time``; the median over the
steps after ``--warmup`` is reported, with trained tokens/s alike. Process start-up, model loading and tokenisation
are outside the timed window.

Threads: every process gets ``--threads`` intra-op threads (``OMP_NUM_THREADS``, default 1: the same compute per
process for both configurations, and polite on a shared machine); with ``--threads 0`` the single process gets all
cores and each of the 2 processes half of them (the fair "same machine" comparison).

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ddp_scaling.py                       # tiny model, 1 vs 2 processes
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ddp_scaling.py --model smollm2-135m-instruct --steps 4 --warmup 1 \\
        --batch-size 4 --max-length 128
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _memory import machine_line

ROOT = Path(__file__).resolve().parents[1]


def run(processes: int, args: argparse.Namespace) -> dict[str, float]:
    """One ``lit-llm fit`` run with ``processes`` DDP ranks; returns the median samples/s and tokens/s."""
    steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="ddp_scaling_") as tmp:
        threads = args.threads or max(1, (os.cpu_count() or 1) // processes)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": str(threads)}
        script = Path(sys.executable).parent / "lit-llm"
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lit_llm.lightning.cli"]
        cmd += ["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--model.model", args.model,
                "--trainer.default_root_dir", tmp, "--trainer.max_steps", str(steps),
                "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "1000000",
                "--samples.num_samples", "0", "--data.num_samples", str(args.batch_size * processes * steps),
                "--data.batch_size", str(args.batch_size), "--data.micro_batch_size", str(args.batch_size),
                "--data.max_length", str(args.max_length), "--model.token_accuracy", "false",
                "--trainer.accelerator", "cpu", "--trainer.devices", str(processes)]
        if processes > 1:
            cmd += ["--trainer.strategy", "ddp"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{processes} process(es): exit {proc.returncode}\n{proc.stdout[-2000:]}"
                               f"{proc.stderr[-4000:]}")
        with open(Path(tmp) / "csv" / "version_0" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train/tokens_per_sec")]
    timed = rows[args.warmup:]
    step_s = [float(r["train/step_tokens"]) / float(r["train/tokens_per_sec"]) for r in timed]
    med = statistics.median(step_s)
    return {"processes": processes, "threads": threads, "steps": len(timed), "step_s": med,
            "samples_per_s": args.batch_size * processes / med,
            "tokens_per_s": statistics.median(float(r["train/tokens_per_sec"]) for r in timed), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | smollm2-135m-instruct | a local HF folder")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step per process")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per process (0 = cores / processes)")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    print(machine_line(), flush=True)
    load = os.getloadavg()
    print(f"# model={args.model} batch/process={args.batch_size} max_length={args.max_length} "
          f"cores={os.cpu_count()} load before={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")
    results = [run(n, args) for n in args.processes]
    base = results[0]["samples_per_s"]
    print("| processes | threads/process | step (s, median) | samples/s | trained tok/s | speed-up | run wall (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['processes']} | {r['threads']} | {r['step_s']:.3f} | {r['samples_per_s']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['samples_per_s'] / base:.2f}x | {r['wall_s']:.0f} |")
    load = os.getloadavg()
    print(f"# load after={load[0]:.2f},{load[1]:.2f},{load[2]:.2f}")


if __name__ == "__main__":
    main()
