"""Host (CPU) memory between steps: give freed heap pages back to the operating system, and read the process's
resident set size for the dashboards.

Why: PyTorch's CPU allocator returns tensors to glibc's ``malloc``, which keeps freed blocks in its arenas for reuse
instead of returning the pages (only blocks above the dynamic mmap threshold, at most 32 MiB, go straight back). A
training step allocates and frees gigabytes of activations of sizes that change from step to step (rollouts of
different lengths), and rollout workers and episodes allocate from up to ``8 x cores`` per-thread arenas, whose free
blocks the training thread cannot reuse, so the free-but-held memory grows. Measured on the tool-using calculator
config (issue 16, SmolLM2-135M, bf16-mixed, 2-core CPU; docs/results/grpo_calculator.md, "Memory"): without
releases, after the first optimizer step the process held 7.1 GB resident of which 1.4 GB were live allocations and
4.9 GB free blocks inside the arenas, and the 30-step run peaked at 14.5 GiB (8.3 GiB with the releases);
``malloc_trim(0)`` after a step (glibc >= 2.8 also releases free pages in the middle of every arena, not only at the
heap top) took the process from 5.9 to 2.2 GB in ~0.3 s.

:func:`trim_host_memory` is called by :class:`~lit_llm.lightning.module.PolicyModule` on the CPU after every
validation loop, and after optimizer steps and GRPO rollouts when the resident set has grown by
:attr:`~lit_llm.lightning.module.PolicyModule.host_memory_release_growth` since that call site's last release
(:meth:`~lit_llm.lightning.module.PolicyModule.release_host_memory`). Elsewhere than glibc (macOS, Windows, musl) it
does nothing and returns ``False``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from typing import Any

__all__ = ["host_peak_rss_bytes", "host_rss_bytes", "trim_host_memory"]


@cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim`` (``int malloc_trim(size_t pad)``), or ``None`` where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim  # the process's own C library (no ldconfig lookup)
    except (OSError, AttributeError):  # musl and other C libraries without malloc_trim
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim_host_memory() -> bool:
    """Return the free pages of every glibc malloc arena to the operating system (``malloc_trim(0)``).

    Costs a walk over the arenas' free blocks (~0.3 s after a step that freed ~4 GB, milliseconds when little was
    freed); the released pages are faulted in again (zeroed) when next allocated. Safe at any time: live allocations
    are not touched.

    Returns:
        ``True`` if glibc's ``malloc_trim`` ran, ``False`` where it is not available (non-Linux, non-glibc).
    """
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def host_rss_bytes() -> int | None:
    """The current resident set size of this process in bytes (``/proc/self/statm``), ``None`` where there is no
    procfs (macOS, Windows)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_peak_rss_bytes() -> int | None:
    """The peak resident set size of this process so far in bytes (``getrusage`` ``ru_maxrss``: KiB on Linux, bytes
    on macOS), ``None`` where there is no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
