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
validation loop, after optimizer steps once the resident set has grown by
:attr:`~lit_llm.lightning.module.PolicyModule.host_memory_release_growth` since that site's mark (its first call, then
its last release), and after taking a GRPO rollout when the rollout itself grew the process that much since the
step's end (:meth:`~lit_llm.lightning.module.PolicyModule.release_host_memory`). A release is not free: its pages are
faulted in (zeroed) again by the next allocations, ~0.9M faults and ~3 s of system time per SmolLM2 GRPO step when the
loss's ~3.4 GB were released before every loss (issue 31). At fit start the module also calls
:func:`limit_malloc_arenas` (:attr:`~lit_llm.lightning.module.PolicyModule.host_malloc_arenas`: the rollout threads
allocate from the main thread's arena, so the loss and the rollout reuse each other's freed blocks) and
:func:`keep_freed_pages` (:attr:`~lit_llm.lightning.module.PolicyModule.host_malloc_keep_freed_pages`: freed blocks
above the mmap threshold stay in the heap for the next step instead of being unmapped): a steady run then faults in
almost nothing after its first steps and never releases. Elsewhere than glibc (macOS, Windows, musl) all three do
nothing and return ``False``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import cache
from typing import Any

__all__ = ["host_peak_rss_bytes", "host_rss_bytes", "keep_freed_pages", "limit_malloc_arenas", "trim_host_memory"]

#: glibc's ``mallopt`` parameters (``<malloc.h>``): the most arenas it creates; the free space at the heap top above
#: which ``free`` returns it to the system; the most blocks it serves with their own ``mmap``.
M_ARENA_MAX, M_TRIM_THRESHOLD, M_MMAP_MAX = -8, -1, -4


@cache
def _libc_function(name: str, *argtypes: Any) -> Any:
    """The process's own C library's function ``name`` returning ``int`` (glibc's ``malloc_trim``, ``mallopt``), or
    ``None`` off Linux or where the C library has none (musl and others)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None), name)  # no ldconfig lookup
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt(param, value)`` for each ``(param, value)`` in turn: ``True`` if every one was accepted,
    ``False`` at the first refusal or where there is no ``mallopt`` (non-Linux, non-glibc)."""
    fn = _libc_function("mallopt", ctypes.c_int, ctypes.c_int)  # int mallopt(int param, int value)
    return fn is not None and all(fn(param, value) == 1 for param, value in settings)


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for the rest of the process (``mallopt(M_ARENA_MAX, arenas)``), so
    that threads started from now on allocate from the existing arenas (with ``1``: the main thread's) instead of
    ``8 x cores`` arenas of their own.

    Why: the blocks a thread frees go back to its own arena, which other threads' allocations do not reuse. A GRPO
    rollout generates in worker threads and the loss runs in the main thread, so with glibc's default each step's
    loss faulted in fresh pages for ~3.4 GB of activations while the rollout's freed blocks sat in the workers'
    arenas (or, released before the loss, were faulted in again): ~0.9M extra page faults, ~3 s of system time per
    SmolLM2 GRPO step on a 2-core CPU (issue 31; benchmarks/README.md). With one arena the loss reuses them.

    Takes effect for threads that have no arena yet, and only while the process has made at most glibc's
    ``arena_test`` (8 on 64-bit) arenas: glibc fixes its limit the first time it would create more. Threads that
    share an arena take turns on its lock per ``malloc`` / ``free`` (PyTorch's CPU allocations are per tensor, not per
    element: not measurable in the benchmarks above).

    Args:
        arenas: at least 1.

    Returns:
        ``True`` if glibc's ``mallopt`` accepted it, ``False`` where it is not available (non-Linux, non-glibc).

    Raises:
        ValueError: ``arenas`` below 1.
    """
    if arenas < 1:
        raise ValueError(f"limit_malloc_arenas: arenas={arenas!r} must be at least 1")
    return _mallopt((M_ARENA_MAX, int(arenas)))


def keep_freed_pages() -> bool:
    """Make glibc's ``malloc`` keep the pages of freed blocks for reuse for the rest of the process, whatever their
    size, until :func:`trim_host_memory` returns them: every block comes from the heap (``mallopt(M_MMAP_MAX, 0)``:
    none gets its own ``mmap``, which ``free`` unmaps at once) and ``free`` never shrinks the heap top
    (``mallopt(M_TRIM_THRESHOLD, -1)``, "disables trimming completely" in ``mallopt(3)``).

    Why: by default a block above the dynamic mmap threshold (at most 32 MiB: the logits, the attention and MLP
    activations of a long micro-batch) is mapped on ``malloc`` and unmapped on ``free``, so each step faults in and
    zeroes fresh pages for all of them: ~0.5M page faults and ~3.8 s of system time per steady SmolLM2 GRPO step on a
    2-core CPU, 0.05-0.13M and ~1 s with this (issue 31, benchmarks/README.md). The cost: the heap holds the freed
    blocks (peak resident +0.07-0.11 GiB on that run, +0.06 GB in 3 steps of the tool-using calculator config, one
    run each); :class:`~lit_llm.lightning.module.PolicyModule`'s releases return them once the resident set has grown
    past its mark.

    "Every size" holds in the main arena, where every thread allocates under ``limit_malloc_arenas(1)``; in other
    arenas glibc still maps a block larger than their 64 MiB heaps and unmaps a heap that became empty. Under another
    allocator (``LD_PRELOAD`` jemalloc / tcmalloc) ``mallopt`` may answer without acting.

    Returns:
        ``True`` if glibc's ``mallopt`` accepted both, ``False`` where it is not available (non-Linux, non-glibc).
    """
    return _mallopt((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))


def trim_host_memory() -> bool:
    """Return the free pages of every glibc malloc arena to the operating system (``malloc_trim(0)``).

    Costs a walk over the arenas' free blocks (~0.3 s after a step that freed ~4 GB, milliseconds when little was
    freed); the released pages are faulted in again (zeroed) when next allocated. Safe at any time: live allocations
    are not touched.

    Returns:
        ``True`` if glibc's ``malloc_trim`` ran, ``False`` where it is not available (non-Linux, non-glibc).
    """
    fn = _libc_function("malloc_trim", ctypes.c_size_t)  # int malloc_trim(size_t pad)
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
