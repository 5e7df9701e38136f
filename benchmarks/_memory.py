"""Helpers shared by the benchmarks (Linux ``/proc``): current RSS, ``VmHWM`` reset, and the machine line every
benchmark prints first (CPU model, the flags that decide bf16 speed, cores, threads)."""

from __future__ import annotations

import ctypes
import gc

GB = 1024**3


def status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status (this benchmark needs Linux)")


def release_and_reset_peak() -> int:
    """Free what can be freed, reset VmHWM to the current RSS and return the current RSS in bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kb("VmRSS") * 1024


def commit() -> str:
    """The checkout's commit (short hash, ``+dirty`` with uncommitted changes), or ``"unknown"`` outside git."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def machine_line() -> str:
    """``"CPU: <model>; flags: avx2 avx512f avx512_bf16 amx_bf16 ...; <n> cores; torch threads <t>; commit <sha>"``:
    the CPU facts that decide whether bf16 is native (AVX512-BF16 / AMX) or emulated (AVX2 only: bf16 several times
    slower), and the tree measured."""
    import os

    import torch

    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return (f"CPU: {model}; flags: {' '.join(shown) or 'none of avx2/avx512f/avx512_bf16/amx'}; "
            f"{os.cpu_count()} cores; torch threads {torch.get_num_threads()}; commit {commit()}")
