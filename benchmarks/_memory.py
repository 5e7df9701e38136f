"""Peak-memory helpers shared by the benchmarks (Linux ``/proc``): current RSS, ``VmHWM`` reset."""

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
