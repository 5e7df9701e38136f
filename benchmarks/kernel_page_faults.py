"""Page faults, system CPU time and peak memory of one chunked LM-head forward + backward (issue 31).

A fresh ``[chunk, V]`` fp32 logits tensor per chunk (201 MB for chunk 1,024 x SmolLM2's 49,152 tokens) is above
glibc's mmap threshold, so every chunk's buffer came straight from the kernel and was touched page by page (a minor
fault per 4 KiB) and handed back when freed. :func:`lit_llm.policy.kernel.chunked_token_log_probs` now writes every
chunk of a pass into one buffer. This script times the kernel alone on SmolLM2's shapes (random weights, ``N`` scored
rows, hidden size 576), with and without the entropy, and reports for the second of two runs (the first warms up):
wall seconds, system CPU seconds and minor page faults (``getrusage``) and the peak resident memory above the
baseline (``VmHWM`` after ``malloc_trim`` and a peak reset). Faults and system time do not depend much on the
machine's load; wall time does.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kernel_page_faults.py [--rows 4096] [--chunk-size 1024]
"""

from __future__ import annotations

import argparse
import resource
import time

from _memory import GB, machine_line, release_and_reset_peak, status_kb


def measure(rows: int, chunk_size: int, entropy: bool) -> dict[str, float]:
    import torch

    from lit_llm.policy.kernel import chunked_token_log_probs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, 576, generator=g, requires_grad=True)
    weight = (torch.randn(49_152, 576, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, 49_152, (rows,), generator=g)
    out: dict[str, float] = {}
    for _ in range(2):
        hidden.grad = weight.grad = None
        base = release_and_reset_peak()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        res = chunked_token_log_probs(hidden, weight, targets, chunk_size=chunk_size, return_entropy=entropy)
        loss = res[0].sum() + res[1].sum() if entropy else res.sum()
        loss.backward()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out = {"wall_s": time.perf_counter() - t0, "sys_s": r1.ru_stime - r0.ru_stime,
               "faults": r1.ru_minflt - r0.ru_minflt, "peak_gb": (status_kb("VmHWM") * 1024 - base) / GB}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="scored rows (tokens)")
    p.add_argument("--chunk-size", type=int, default=1024)
    a = p.parse_args()
    print(machine_line())
    print(f"rows {a.rows}, chunk {a.chunk_size}, vocab 49152, hidden 576, fp32, forward + backward")
    print("| entropy | wall (s) | sys CPU (s) | minor page faults (k) | peak above base (GB) |")
    print("|---|---:|---:|---:|---:|")
    for entropy in (False, True):
        r = measure(a.rows, a.chunk_size, entropy)
        print(f"| {'yes' if entropy else 'no'} | {r['wall_s']:.2f} | {r['sys_s']:.2f} | {r['faults'] / 1000:.0f} | "
              f"{r['peak_gb']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
