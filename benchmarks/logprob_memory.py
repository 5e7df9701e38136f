"""Peak memory and time of per-token log-probs: chunked LM-head kernel vs naive full logits (issue 3).

Each configuration runs in a FRESH subprocess that loads the real SmolLM2-135M-Instruct (vocab 49,152), builds a
seeded random batch ``[B, T]`` (no padding), does a tiny warm-up, releases freed heap memory (``malloc_trim``),
resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` = 5, so the model-loading peak does not count) and
then times ``--repeats`` runs (reporting the fastest; the memory peak covers them all) of:

- ``backbone``: the decoder only, stopping at the final hidden states ``[B, T, H]`` (backward: ``hidden.sum()``);
- ``naive``: ``log_softmax(model(ids).logits[:, :-1]).gather(ids[:, 1:])`` - full ``[B, T, V]`` fp32 logits;
- ``chunked``: :func:`lit_llm.policy.logprobs.model_token_log_probs` (LM head + log-softmax per ``chunk_size`` rows,
  logits recomputed in backward).

Forward-only runs are under ``torch.no_grad()`` (old/reference log-probs); "fwd+bwd" runs call
``log_probs.sum().backward()`` (parameter gradients are allocated in every mode). The reported memory is the peak RSS
above the post-load baseline (``VmHWM - VmRSS`` before the run); the *head part* of a mode is its peak minus the
``backbone`` peak with the same backward setting (<= 0 when the head's peak stays under the backbone's own peak).
Times are wall-clock and process CPU time (``time.process_time``, all threads) of the fastest repeat, with its
system CPU time and minor page faults (``getrusage``: each fault is a 4 KiB page touched for the first time since the
allocator got it from the kernel); on a shared
machine the CPU time is the steadier basis for the ``CPU / naive`` ratio. Every run also prints ``sum log p`` so the
two log-prob paths can be seen to agree.

Usage::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/logprob_memory.py            # 8 x 512, all 6 runs (minutes)
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/logprob_memory.py --quick    # 2 x 128 sanity check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _memory import GB, machine_line
from _memory import release_and_reset_peak as _release_and_reset_peak
from _memory import status_kb as _status_kb

MODES = ("backbone", "naive", "chunked")


def _step(model, mode: str, ids, mask, backward: bool, chunk_size: int, matmul_dtype):
    """One measured computation; returns a float checksum."""
    import torch

    from lit_llm.policy.logprobs import model_token_log_probs, naive_token_log_probs

    with torch.set_grad_enabled(backward):
        if mode == "backbone":
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
            loss = out.sum()
        elif mode == "naive":
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            lp = naive_token_log_probs(logits[:, :-1], ids[:, 1:])
            del logits
            loss = lp.sum()
        else:
            lp = model_token_log_probs(model, ids, mask, chunk_size=chunk_size, matmul_dtype=matmul_dtype)
            loss = lp.sum()
        if backward:
            loss.backward()
    return float(loss.detach())


def worker(args: argparse.Namespace) -> dict:
    import torch

    from lit_llm.models import load_model

    torch.manual_seed(args.seed)
    model, _ = load_model()
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    mm = torch.bfloat16 if args.matmul_dtype == "bf16" else None
    _step(model, args.mode, ids[:1, :16], mask[:1, :16], args.backward, args.chunk_size, mm)  # warm-up
    model.zero_grad(set_to_none=True)
    base = _release_and_reset_peak()
    times, cpu_times, sys_times, faults = [], [], [], []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        t0, c0, r0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
        checksum = _step(model, args.mode, ids, mask, args.backward, args.chunk_size, mm)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        sys_times.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    seconds = min(times)
    peak = _status_kb("VmHWM") * 1024
    return dict(mode=args.mode, backward=args.backward, batch=args.batch, seq=args.seq, vocab=vocab,
                chunk_size=args.chunk_size, matmul_dtype=args.matmul_dtype, threads=torch.get_num_threads(),
                seconds=seconds, times=times, cpu_seconds=min(cpu_times), sys_seconds=min(sys_times),
                minor_faults=min(faults), load_avg=os.getloadavg()[0],
                peak_above_base_gb=(peak - base) / GB, peak_rss_gb=peak / GB, checksum=checksum)


def run_fresh(mode: str, backward: bool, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--batch", str(args.batch),
           "--seq", str(args.seq), "--chunk-size", str(args.chunk_size), "--seed", str(args.seed),
           "--matmul-dtype", args.matmul_dtype if mode == "chunked" else "fp32", "--repeats", str(args.repeats)]
    if backward:
        cmd.append("--backward")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {mode} backward={backward} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    base = {r["backward"]: r["peak_above_base_gb"] for r in results if r["mode"] == "backbone"}
    naive_s = {r["backward"]: r["cpu_seconds"] for r in results if r["mode"] == "naive"}
    lines = ["| pass | path | wall (s) | CPU (s) | CPU / naive | sys CPU (s) | page faults (k) | "
             "peak above base (GB) | head part (GB) | sum log p |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        head = r["peak_above_base_gb"] - base[r["backward"]] if r["backward"] in base else float("nan")
        ratio = r["cpu_seconds"] / naive_s[r["backward"]] if r["backward"] in naive_s else float("nan")
        name = r["mode"] + (f" (chunk {r['chunk_size']}, {r['matmul_dtype']})" if r["mode"] == "chunked" else "")
        is_bb = r["mode"] == "backbone"
        ratio_s, head_s, sum_s = ("-", "-", "-") if is_bb else (f"{ratio:.2f}x", f"{head:.2f}", f"{r['checksum']:.1f}")
        lines.append(f"| {'fwd+bwd' if r['backward'] else 'fwd'} | {name} | {r['seconds']:.1f} | "
                     f"{r['cpu_seconds']:.1f} | {ratio_s} | {r['sys_seconds']:.2f} | {r['minor_faults'] / 1000:.0f} | "
                     f"{r['peak_above_base_gb']:.2f} | {head_s} | {sum_s} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--matmul-dtype", choices=("fp32", "bf16"), default="fp32", help="chunked kernel's LM-head matmul")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per process (time = min; memory = max)")
    p.add_argument("--quick", action="store_true", help="2 x 128 tokens: a sanity check, not the issue's numbers")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--passes", default="fwd,bwd", help="comma-separated subset of fwd,bwd")
    p.add_argument("--json", type=Path, help="also write the raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        print(machine_line(), flush=True)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if args.quick:
        args.batch, args.seq = 2, 128
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    results = []
    for backward in [b for b, name in ((False, "fwd"), (True, "bwd")) if name in args.passes.split(",")]:
        for mode in modes:
            r = run_fresh(mode, backward, args)
            print(f"# {mode:8s} backward={backward!s:5s} {r['seconds']:7.2f} s wall {r['cpu_seconds']:7.2f} s CPU  "
                  f"peak +{r['peak_above_base_gb']:.3f} GB  load {r['load_avg']:.1f}",
                  file=sys.stderr, flush=True)
            results.append(r)
    print(f"B={args.batch}, T={args.seq}, vocab={results[0]['vocab']}, threads={results[0]['threads']}, "
          f"fp32 model\n")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
