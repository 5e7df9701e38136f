"""Counts the host syncs that ``lit_llm`` code makes, on CPU tensors (issue 28).

On a CPU nothing waits, but every call below would, on a CUDA tensor, make the host wait for the device (a
device-to-host copy, or an output whose size depends on the values). :class:`SyncCounter` patches those
``torch.Tensor`` methods and ``torch`` functions for the duration of a ``with`` block (all threads: the batcher's
worker and the rollout threads are counted too) and records each call whose nearest caller outside ``torch`` is in
the ``lit_llm`` package, by kind and ``module.py:function``. Calls made from transformers' modelling code, Lightning
or the tests themselves are not counted.

Kinds:

* ``item``, ``tolist``, ``cpu``, ``numpy``: a copy to the host;
* ``bool``, ``int``, ``float``, ``index``: a tensor read as a Python number (``if t:``, ``int(t)``, ``range(t)``);
* ``nonzero``, ``masked_select``, ``unique``, ``argwhere``: an output sized by the values;
* ``bool_index``: ``t[mask]`` / ``t[mask] = v`` with a boolean tensor index (a ``nonzero`` inside);
* ``to_device``: ``t.to(device)`` called from ``lit_llm`` itself (a host-to-device or device-to-host copy when the
  devices differ; counted whenever a device is passed, so that a per-row transfer shows on the CPU too; torch's own
  same-device ``.to`` calls, e.g. in ``clip_grad_norm_``, are not counted).
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lit_llm

_TORCH_DIR = os.path.dirname(torch.__file__)
_LIT_DIR = os.path.dirname(lit_llm.__file__)
_THIS = os.path.abspath(__file__)

_METHODS = {"item": "item", "tolist": "tolist", "cpu": "cpu", "numpy": "numpy", "__bool__": "bool",
            "__int__": "int", "__float__": "float", "__index__": "index", "nonzero": "nonzero",
            "masked_select": "masked_select", "unique": "unique", "argwhere": "argwhere"}
_INHERITED = object()  # the attribute came from a base class: deleted again on exit
_FUNCTIONS = {"nonzero": "nonzero", "masked_select": "masked_select", "unique": "unique", "argwhere": "argwhere"}


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _passes_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return bool(args) and isinstance(args[0], (str, torch.device, int)) and not isinstance(args[0], bool)


class SyncCounter:
    """``with SyncCounter() as c: ...`` then ``c.total()``, ``c.count(kind)``, ``c.sites`` (a Counter of
    ``(kind, "module.py:function")``)."""

    def __init__(self) -> None:
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._saved: list[tuple[object, str, object]] = []

    # ------------------------------------------------------------------------------------------------ counting
    def _record(self, kind: str, *, direct: bool = False) -> None:
        frame = sys._getframe(2)
        while frame is not None and not direct:
            path = os.path.abspath(frame.f_code.co_filename)
            if not path.startswith(_TORCH_DIR) and path != _THIS:
                break
            frame = frame.f_back
        if frame is None or not os.path.abspath(frame.f_code.co_filename).startswith(_LIT_DIR):
            return
        site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        with self._lock:
            self.sites[(kind, site)] += 1

    def total(self) -> int:
        return sum(self.sites.values())

    def count(self, kind: str | None = None, site: str | None = None) -> int:
        return sum(n for (k, s), n in self.sites.items()
                   if (kind is None or k == kind) and (site is None or s == site))

    def reset(self) -> None:
        with self._lock:
            self.sites.clear()

    # ------------------------------------------------------------------------------------------------ patching
    def _patch(self, owner: object, name: str, wrapper_of) -> None:
        original = getattr(owner, name)
        own = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else original
        self._saved.append((owner, name, own))
        setattr(owner, name, wrapper_of(original))

    def __enter__(self) -> SyncCounter:
        record = self._record

        def counted(kind):
            def wrap(original):
                @functools.wraps(original)
                def wrapper(*args, **kwargs):
                    record(kind)
                    return original(*args, **kwargs)
                return wrapper
            return wrap

        def indexed(original):
            @functools.wraps(original)
            def wrapper(self_, index, *rest):
                if _has_bool_index(index):
                    record("bool_index")
                return original(self_, index, *rest)
            return wrapper

        def to(original):
            @functools.wraps(original)
            def wrapper(self_, *args, **kwargs):
                if _passes_device(args, kwargs):
                    record("to_device", direct=True)
                return original(self_, *args, **kwargs)
            return wrapper

        for name, kind in _METHODS.items():
            self._patch(torch.Tensor, name, counted(kind))
        for name, kind in _FUNCTIONS.items():
            self._patch(torch, name, counted(kind))
        self._patch(torch.Tensor, "__getitem__", indexed)
        self._patch(torch.Tensor, "__setitem__", indexed)
        self._patch(torch.Tensor, "to", to)
        return self

    def __exit__(self, *exc) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """``with count_syncs() as c:`` -- the :class:`SyncCounter` of the block."""
    with SyncCounter() as counter:
        yield counter


class CastCounter(TorchDispatchMode):
    """Counts copies to bf16 (``aten._to_copy`` with ``dtype=torch.bfloat16``): autocast's casts (issue 28's frozen
    weights: tests/lightning/test_frozen_reference.py, tests/policy/test_frozen_weights.py). This thread only."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            self.casts += 1
        return func(*args, **kwargs)
