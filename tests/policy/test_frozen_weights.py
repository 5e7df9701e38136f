"""bf16 without re-casts for the frozen weights besides the KL reference (issue 28): the asynchronous producer's copy
and the frozen base under LoRA adapters. Autocast's bf16 casts counted per forward pass (= per decode step) on the
CPU, log-probs (and, for LoRA, the adapters' gradients) compared bit for bit with autocast over the fp32 weights.
Not run on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from sync_counter import CastCounter

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.policy.frozen_weights import cast_frozen_base_weights, restore_dtype
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardFunctions
from lit_llm.rollouts import AsyncRollouts

pytestmark = pytest.mark.usefixtures("one_thread")

#: The tiny model's ``Linear`` layers under its head: 2 layers x (q, k, v, o, gate, up, down).
LINEARS = 14


def ids_batch() -> torch.Tensor:
    return torch.randint(5, 2000, (2, 9), generator=torch.Generator().manual_seed(0))


def autocast_log_probs(model, ids, *, grad: bool = False):
    """``(log-probs, bf16 casts in the forward pass, gradients of the trainable parameters)`` under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16), CastCounter() as counter:
        lp = model_token_log_probs(model, ids, torch.ones_like(ids))
    grads = {}
    if grad:
        lp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return lp.detach(), counter.casts, grads


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def test_async_copy_is_cast_once_and_syncs_round_as_autocast(tiny, tokenizer):
    """The producer's copy (compute_dtype bf16): Linear weights bf16, head / norms / embeddings fp32; one forward
    pass makes 14 casts fewer with the same log-probs as the fp32 copy; a sync (the engine's load_weights, which the
    producer calls) rounds the trained fp32 weights to bf16 exactly as autocast does."""
    trained = copy.deepcopy(tiny)  # the session's tiny model is shared: this one takes a "step" below
    policy = TransformersWrapper(trained, tokenizer=tokenizer, input_mode="tokens", generate=True,
                                 generate_kwargs={"max_new_tokens": 2})
    kwargs = {"tokenizer": tokenizer, "reward_fn": RewardFunctions([reward]), "num_generations": 2, "batching": False}
    plain = AsyncRollouts.from_policy(policy, [], **kwargs).engine.model
    cast = AsyncRollouts.from_policy(policy, [], compute_dtype=torch.bfloat16, **kwargs)
    ids = ids_batch()
    before, casts_before, _ = autocast_log_probs(plain, ids)
    after, casts_after, _ = autocast_log_probs(cast.engine.model, ids)
    assert torch.equal(before, after) and casts_before - casts_after == LINEARS
    copy_ = cast.engine.model
    assert copy_.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    assert copy_.lm_head.weight.dtype == copy_.model.norm.weight.dtype == copy_.model.embed_tokens.weight.dtype \
        == torch.float32
    with torch.no_grad():
        trained.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # a trained step's change, then a sync
    cast.engine.load_weights(trained.state_dict(), 1)
    q, source = copy_.model.layers[0].self_attn.q_proj.weight, trained.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.bfloat16 and torch.equal(q, source.to(torch.bfloat16))
    assert cast.engine.version == 1


def lora(tiny):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters that change the numbers (peft starts lora_B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_lora_base_cast_gives_autocast_numbers_bit_for_bit(tiny):
    """The frozen base of a LoRA model in bf16: the same log-probs and adapter gradients as autocast over the fp32
    base, bit for bit, 14 casts fewer per forward pass; the adapters stay fp32 and trainable; restore_dtype gives
    fp32 weights back (the bf16-rounded values)."""
    model = lora(tiny)
    ids = ids_batch()
    before, casts_before, grads_before = autocast_log_probs(model, ids, grad=True)
    names = cast_frozen_base_weights(model, torch.bfloat16)
    after, casts_after, grads_after = autocast_log_probs(model, ids, grad=True)
    assert torch.equal(before, after) and grads_before.keys() == grads_after.keys() and len(grads_after) == 12
    assert all(torch.equal(grads_before[k], grads_after[k]) for k in grads_before)
    assert casts_before - casts_after == LINEARS == len(names)
    assert sorted(n.removesuffix(".base_layer").rsplit(".", 1)[-1] for n in names) \
        == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2)
    assert sum(n.endswith(".base_layer") for n in names) == 6  # the adapted layers' base (q, v, down x 2)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert model.get_output_embeddings().weight.dtype == torch.float32
    restore_dtype(model, names)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(autocast_log_probs(model, ids)[0], before)  # bf16 values in fp32: autocast rounds to them


class BaseDtype(Callback):
    def __init__(self) -> None:
        self.seen: list[torch.dtype] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(pl_module.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype)


@pytest.mark.parametrize(("dtype", "during", "after"), [("float32", torch.bfloat16, torch.float32),
                                                        ("bfloat16", torch.bfloat16, torch.bfloat16)])
def test_lora_fit_under_bf16_mixed_holds_a_bf16_base(dtype, during, after):
    """use_peft under bf16-mixed: an fp32 base is held in bf16 during the fit and cast back after it; a base loaded
    in bf16 (model.dtype bfloat16, frozen: never updated) is accepted, where trained bf16 weights are refused."""
    module = SFTModule("tiny", dtype=dtype, use_peft=True, lora_r=4, lora_alpha=8, kl_coef=0.1)
    adapters = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    dm = SFTDataModule(format="arithmetic", num_samples=2, batch_size=2, max_length=48, val_limit=1, tokenizer="tiny")
    seen = BaseDtype()
    Trainer(max_steps=1, accelerator="cpu", precision="bf16-mixed", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[seen]).fit(module, dm)
    base = module.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert seen.seen == [during] and base.dtype == after
    trained = {n: p for n, p in module.model.named_parameters() if p.requires_grad}
    assert all(p.dtype == torch.float32 for p in trained.values())
    assert any(not torch.equal(adapters[n], p) for n, p in trained.items())  # the adapters were trained


@pytest.mark.parametrize(("precision", "linear_dtype"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_grpo_async_producer_copy_is_cast_under_bf16_mixed_only(precision, linear_dtype):
    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.grpo_data import GRPODataModule

    module = GRPOModule("tiny", reward_funcs=[reward], num_generations=2, max_new_tokens=2, micro_batch_size=4,
                        rollout_mode="async", log_samples_every=0)
    Trainer(max_steps=1, accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            limit_val_batches=0).fit(module, GRPODataModule(batch_size=2, num_train=4, num_eval=0))
    copy_ = module.versions.async_rollouts.engine.model
    assert copy_ is not module.model and copy_.model.layers[0].mlp.up_proj.weight.dtype == linear_dtype
    assert copy_.lm_head.weight.dtype == copy_.model.norm.weight.dtype == torch.float32
    assert {p.dtype for p in module.model.parameters()} == {torch.float32}  # the trained master weights
