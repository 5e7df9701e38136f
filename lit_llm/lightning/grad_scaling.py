"""fp16 mixed precision (``16-mixed``) in :class:`~lit_llm.lightning.module.PolicyModule`'s manual optimizer step.

Under ``16-mixed`` Lightning's ``MixedPrecision`` plugin holds a ``torch.amp.GradScaler``: every loss is multiplied
by the scaler's scale before its backward pass (``MixedPrecision.pre_backward``), so the gradients hold ``scale x``
the true gradients until the plugin's ``optimizer_step`` unscales them (``GradScaler.unscale_``), skips the optimizer
step when a gradient is inf/NaN (an fp16 overflow: ``GradScaler.step``) and lowers the scale (``GradScaler.update``).
The module clips and checks the gradient norm *before* ``opt.step()``, so it unscales first
(:func:`unscale_gradients`, no host sync) and keeps the plugin from unscaling the same gradients again inside
``opt.step()`` (:func:`plugin_unscale_skipped`; torch would raise "unscale_() has already been called on this
optimizer since the last update()"). Without a scaler (``32-true``, ``bf16-mixed``, ``*-true``) both do nothing.

A non-finite gradient norm under a scaler is the scaler's overflow, handled as the scaler handles it: the optimizer
step is skipped by ``GradScaler.step``, the scale lowered, the step still counted by Lightning (``global_step``) and
the scheduler stepped, as in torch's and Lightning's AMP loops; ``train/grad_norm`` logs ``inf`` for that step. It is
not ``model.on_nonfinite``'s error: the first steps of an fp16 run overflow by design while the scaler finds its scale.
A non-finite *loss* is still the module's error (the losses are fp32). Tested on the CPU with a stand-in plugin
(tests/lightning/test_grad_scaling.py); not run on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["grad_scaler", "plugin_unscale_skipped", "unscale_gradients"]


def grad_scaler(trainer: Any) -> torch.amp.GradScaler | None:
    """The trainer's enabled ``GradScaler`` (``trainer.precision_plugin.scaler``: ``16-mixed``), else ``None``."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def unscale_gradients(trainer: Any, optimizer: torch.optim.Optimizer) -> torch.amp.GradScaler | None:
    """Divide ``optimizer``'s gradients by the trainer's loss scale in place (``GradScaler.unscale_``: it also
    records whether a gradient is inf/NaN, for its ``step``), when there is a scaler.

    Args:
        trainer: the ``Trainer`` (its precision plugin's scaler is read).
        optimizer: the raw optimizer (``LightningOptimizer.optimizer``) whose gradients are unscaled.

    Returns:
        The scaler, or ``None`` (nothing done) without one.
    """
    scaler = grad_scaler(trainer)
    if scaler is not None:
        scaler.unscale_(optimizer)
    return scaler


@contextmanager
def plugin_unscale_skipped(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside the block, ``scaler.unscale_(optimizer)`` does nothing: wrap ``opt.step()`` with it after
    :func:`unscale_gradients`, so that Lightning's ``MixedPrecision.optimizer_step`` does not unscale twice (other
    optimizers are unscaled as usual). ``scaler=None``: a plain block."""
    if scaler is None:
        yield
        return
    own = vars(scaler).get("unscale_")
    original = scaler.unscale_

    def unscale_(opt: torch.optim.Optimizer) -> None:
        if opt is not optimizer:
            original(opt)

    scaler.unscale_ = unscale_  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del scaler.unscale_
        else:
            scaler.unscale_ = own  # type: ignore[method-assign]
