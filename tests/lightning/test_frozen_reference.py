"""The frozen KL reference under bf16-mixed keeps its ``Linear`` weights in bf16 (issue 28): autocast's cast cache
keeps only weights that require grad, so a frozen fp32 copy is re-cast at every forward pass. Counted on the CPU
(autocast's bf16 casts, ``aten._to_copy``), values compared bit for bit; not run on a GPU."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from sync_counter import CastCounter

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.policy.frozen_weights import cast_frozen_matmul_weights
from lit_llm.policy.logprobs import model_token_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

#: The tiny model's ``Linear`` layers under its head: 2 layers x (q, k, v, o, gate, up, down).
LINEARS = 14


def reference_log_probs(model, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), CastCounter() as counter:
        lp = model_token_log_probs(model, ids, torch.ones_like(ids))
    return lp, counter.casts


def test_cast_reference_gives_the_same_log_probs_bit_for_bit_with_fewer_casts(tiny):
    frozen = copy.deepcopy(tiny).eval().requires_grad_(False)
    ids = torch.randint(5, 2000, (2, 9), generator=torch.Generator().manual_seed(0))
    before, casts_before = reference_log_probs(frozen, ids)
    names = cast_frozen_matmul_weights(frozen, torch.bfloat16)
    after, casts_after = reference_log_probs(frozen, ids)
    assert torch.equal(before, after) and after.dtype == torch.float32
    assert len(names) == LINEARS and "lm_head" not in names
    assert casts_before - casts_after == LINEARS  # each Linear weight was cast once per forward pass; now never
    assert frozen.lm_head.weight.dtype == frozen.model.embed_tokens.weight.dtype == torch.float32
    assert frozen.model.norm.weight.dtype == frozen.model.layers[0].input_layernorm.weight.dtype == torch.float32


def test_trained_weights_are_refused(tiny):
    with pytest.raises(ValueError, match=r"^cast_frozen_matmul_weights: model\.embed_tokens\.weight requires grad; "
                                         r"only a frozen copy"):
        cast_frozen_matmul_weights(copy.deepcopy(tiny).requires_grad_(True), torch.bfloat16)


@pytest.mark.parametrize(("precision", "linear_dtype"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_sft_reference_is_cast_under_bf16_mixed_only(precision, linear_dtype):
    module = SFTModule("tiny", kl_coef=0.1)
    dm = SFTDataModule(format="arithmetic", num_samples=2, batch_size=2, max_length=48, val_limit=1, tokenizer="tiny")
    Trainer(max_steps=1, accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0).fit(module, dm)
    reference = module.versions.reference_version.model
    assert reference.model.layers[0].self_attn.q_proj.weight.dtype == linear_dtype
    assert reference.lm_head.weight.dtype == reference.model.norm.weight.dtype == torch.float32
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}  # the trained master weights


def test_reference_moved_to_the_strategy_root_device_not_the_module_device():
    """Callbacks' ``setup`` runs before the strategy moves the module to its device (``strategy.setup``), so the
    reference (not a submodule of the module) goes to ``trainer.strategy.root_device``, where the module will be: a
    GPU run's reference left on the CPU would meet GPU inputs. The meta device stands in for the GPU here."""
    module = SFTModule("tiny", kl_coef=0.1)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("meta")), global_rank=0,
                              world_size=1, datamodule=None)
    module.versions.setup(trainer, module, "fit")
    assert {p.device.type for p in module.versions.reference_version.model.parameters()} == {"meta"}
    assert {p.device.type for p in module.model.parameters()} == {"cpu"}  # the module: moved by the strategy later
