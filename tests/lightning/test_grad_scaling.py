"""``16-mixed``'s GradScaler in PolicyModule's manual step (issue 28, lit_llm/lightning/grad_scaling.py): clipping and
the non-finite check see unscaled gradients, Lightning's plugin does not unscale twice, and an overflow is the
scaler's skip, not the module's error.

The CPU has no fp16 autocast worth testing with (and ``lit_llm`` turns ``16-mixed`` into ``bf16-mixed`` on the CPU),
so the stand-in is Lightning's own ``MixedPrecision("16-mixed")`` plugin with a CPU ``GradScaler`` and its autocast
turned off: the losses are scaled and the gradients unscaled exactly as under fp16 AMP, the forward runs in fp32, and
with a power-of-two scale a step's numbers equal ``32-true``'s bit for bit. Not run on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.plugins.precision import MixedPrecision

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.grad_scaling import grad_scaler, plugin_unscale_skipped, unscale_gradients
from lit_llm.lightning.sft import SFTModule

pytestmark = pytest.mark.usefixtures("one_thread")


class ScaledFP32Precision(MixedPrecision):
    """``16-mixed``'s loss scaling (a CPU ``GradScaler``) with the forward pass left in fp32."""

    def __init__(self, init_scale: float) -> None:
        super().__init__("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))

    def autocast_context_manager(self) -> torch.autocast:
        return torch.autocast("cpu", enabled=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)  # scale-sensitive (AdamW would hide a wrong gradient scale)


def fit(max_steps: int, plugin: MixedPrecision | None = None, **module_kwargs) -> tuple[SFTModule, list[float]]:
    """``(module, the gradient norm logged at each step)`` of an SFT fit on the tiny model."""
    seed_everything(0)
    module = SFTModule("tiny", optimizer=sgd, **module_kwargs)
    norms: list[float] = []
    real = module._log_step

    def log_step(totals, grad_norm, opt):
        norms.append(float(grad_norm))
        real(totals, grad_norm, opt)

    module._log_step = log_step
    dm = SFTDataModule(format="arithmetic", num_samples=8, batch_size=2, max_length=48, val_limit=1, tokenizer="tiny")
    Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            plugins=[plugin] if plugin is not None else None).fit(module, dm)
    return module, norms


def test_clipping_sees_unscaled_gradients():
    """Two steps clipped hard (grad_clip 0.01): the same logged norms and weights as 32-true, bit for bit; before,
    the norm was 1024x larger and the clipped update 1024x too small. Lightning's plugin stepped both times without
    "unscale_() has already been called"."""
    plain, plain_norms = fit(2, grad_clip=0.01)
    scaled, scaled_norms = fit(2, ScaledFP32Precision(2.0**10), grad_clip=0.01)
    assert scaled.trainer.precision == "16-mixed" and scaled.global_step == 2
    assert scaled_norms == plain_norms and all(n > 0.01 for n in plain_norms)  # clipping was active
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), scaled.model.parameters()))
    assert grad_scaler(scaled.trainer).get_scale() == 2.0**10  # no overflow: the scale did not move in 2 steps


def test_overflow_is_the_scalers_skip_not_an_error(monkeypatch):
    """A scale so large that the scaled gradients overflow (2**127 x a finite loss made 2**20 times larger, so that
    every gradient above 2**-19 overflows): with on_nonfinite="raise" the step is skipped by the scaler (weights
    untouched), its scale halved, the step counted as Lightning counts an AMP step, the non-finite norm logged; no
    error (the loss itself is finite)."""
    real = SFTModule.micro_batch_loss

    def larger(self, mb, normalizer):
        loss, stats = real(self, mb, normalizer)
        return loss * 2.0**20, stats

    monkeypatch.setattr(SFTModule, "micro_batch_loss", larger)
    seed_everything(0)
    before = [p.detach().clone() for p in SFTModule("tiny").model.parameters()]
    module, norms = fit(1, ScaledFP32Precision(2.0**127), on_nonfinite="raise")
    assert module.global_step == 1 and len(norms) == 1 and not math.isfinite(norms[0])  # inf or NaN (inf - inf)
    assert int(module.skipped_steps) == 0
    assert grad_scaler(module.trainer).get_scale() == 2.0**126
    assert all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))


def test_a_skipped_step_leaves_the_scaler_ready_for_the_next(monkeypatch):
    """on_nonfinite="skip" and a NaN loss at the first step: the module's own skip (its unscaled state reset with
    GradScaler.update), then a normal step (unscale_ would raise on a state left unscaled)."""
    real = SFTModule.micro_batch_loss
    calls = {"n": 0}

    def nan_first(self, mb, normalizer):
        loss, stats = real(self, mb, normalizer)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] == 1 else loss), stats

    monkeypatch.setattr(SFTModule, "micro_batch_loss", nan_first)
    module, norms = fit(1, ScaledFP32Precision(2.0**10), on_nonfinite="skip")
    assert int(module.skipped_steps) == 1 and module.global_step == 1 and len(norms) == 1


def test_without_a_scaler_nothing_is_done():
    layer = torch.nn.Linear(2, 1)
    layer(torch.ones(1, 2)).sum().backward()
    grad = layer.weight.grad.clone()
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    assert unscale_gradients(object(), opt) is None and torch.equal(layer.weight.grad, grad)
    with plugin_unscale_skipped(None, opt):
        opt.step()


def test_plugin_unscale_is_skipped_for_that_optimizer_only():
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale tensor is made lazily, by the first scale()
    a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    a.grad, b.grad = torch.full((1,), 8.0), torch.full((1,), 8.0)
    opt_a, opt_b = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    scaler.unscale_(opt_a)
    with plugin_unscale_skipped(scaler, opt_a):
        scaler.unscale_(opt_a)  # the plugin's second call: nothing
        scaler.unscale_(opt_b)
    assert a.grad.item() == b.grad.item() == 2.0
    assert "unscale_" not in vars(scaler)  # the class's method again
    with pytest.raises(RuntimeError, match=r"^unscale_\(\) has already been called on this optimizer"):
        scaler.unscale_(opt_a)
