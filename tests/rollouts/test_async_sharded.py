"""The asynchronous producer over a sharded (FSDP2) model (issue 28): its copy is a plain model built from the full
weights (``lit_llm.rollouts.model_copy``), never a deep copy of the shards; syncs gather the shards on the trainer's
thread. One-process gloo group (no real communication: the two-process run is tests/distributed/test_sharded.py's
GRPO run, in async mode)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_llm.models import tiny_model
from lit_llm.policy import TransformersWrapper
from lit_llm.policy.generation import generate_tokens
from lit_llm.policy.generation_config import resolve_generation_config
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.sharding import is_sharded, reshard_root, shard_model
from lit_llm.rewards import RewardFunctions
from lit_llm.rollouts import AsyncRollouts
from lit_llm.rollouts.model_copy import full_weights

PROMPTS = [torch.tensor([5, 17, 300]), torch.tensor([71, 8])]


@pytest.fixture
def no_deepcopy_of_sharded(monkeypatch):
    """``copy.deepcopy`` fails for a module holding ``DTensor`` parameters (a sharded model), works for the rest."""
    deepcopy = copy.deepcopy

    def guarded(x, memo=None):
        if isinstance(x, torch.nn.Module) and any(isinstance(p, DTensor) for p in x.parameters()):
            raise AssertionError(f"copy.deepcopy of a sharded {type(x).__name__}")
        return deepcopy(x, memo)

    monkeypatch.setattr(copy, "deepcopy", guarded)


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


def producer(model, tokenizer, prompts=(), **kwargs) -> AsyncRollouts:
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=True,
                                 generate_kwargs={"max_new_tokens": 3})
    return AsyncRollouts.from_policy(policy, list(prompts), tokenizer=tokenizer, reward_fn=RewardFunctions([reward]),
                                     num_generations=2, batching=False, **kwargs)


def greedy(model) -> list[list[int]]:
    config = resolve_generation_config({"max_new_tokens": 6, "do_sample": False}, model)
    with torch.no_grad():
        return [r.tolist() for r in generate_tokens(model.eval(), PROMPTS, config).response_ids]


def assert_plain_copy_of(copy_, sharded) -> None:
    """``copy_`` is an ordinary model (no shard, no FSDP unit) holding ``sharded``'s full weights and buffers, in its
    own memory."""
    assert not is_sharded(copy_) and not any(isinstance(m, FSDPModule) for m in copy_.modules())
    assert not any(isinstance(t, DTensor) for t in [*copy_.parameters(), *copy_.buffers()])
    assert not any(p.requires_grad for p in copy_.parameters()) and not copy_.training
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    got = copy_.state_dict()
    assert sorted(got) == sorted(full)
    for k, v in full.items():
        assert torch.equal(got[k], v), k
    trained = {p.to_local().untyped_storage().data_ptr() for p in sharded.parameters()}  # the shards' memory
    assert not any(p.untyped_storage().data_ptr() in trained for p in copy_.parameters())
    for (name, buf), (name2, expected) in zip(copy_.named_buffers(), sharded.named_buffers(), strict=True):
        assert name == name2 and torch.equal(buf, expected), name  # rotary inv_freq: not in the state dict


def test_async_copy_of_a_sharded_model_is_plain_and_syncs_gathered_weights(mesh, tokenizer, one_thread,
                                                                            no_deepcopy_of_sharded):
    model = tiny_model(tokenizer)
    plain = copy.deepcopy(model)  # not sharded yet: the guard lets it through
    shard_model(model, mesh)
    prod = producer(model, tokenizer, prompts=[{"prompt": ["a", "b"], "prompt_ids": PROMPTS}])
    copy_ = prod.engine.model
    assert type(copy_) is type(plain)
    assert_plain_copy_of(copy_, model)
    assert [n for n, _ in copy_.named_buffers()] == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    assert copy_.lm_head.weight is copy_.model.embed_tokens.weight  # tied again
    assert copy_.generation_config.eos_token_id == plain.generation_config.eos_token_id
    assert greedy(copy_) == greedy(plain)

    # one optimizer step on the shards, then a sync: the staged weights are the gathered full weights
    ids = torch.tensor([[5, 17, 300, 9, 44, 2], [0, 0, 71, 8, 1000, 3]])
    model.train()
    model_token_log_probs(model, ids, ids != 0).sum().backward()
    reshard_root(model)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    before = copy_.model.layers[0].self_attn.q_proj.weight.clone()
    prod.sync_weights(model, 1)
    staged, version, strict = prod._staged
    assert version == 1 and strict and not any(isinstance(t, DTensor) for t in staged.values())
    rollout = next(iter(prod))  # the producer thread loads the staged weights, then generates from its plain copy
    prod.close()
    assert rollout.policy_version.tolist() == [1] * 4 and rollout.completion_ids.shape[0] == 4
    assert not torch.equal(copy_.model.layers[0].self_attn.q_proj.weight, before)  # the step moved it
    assert_plain_copy_of(copy_, model)

    # bf16-mixed: the copy's Linear weights (not the head, norms, embeddings) in bf16, rounded from the full weights
    cast = producer(model, tokenizer, compute_dtype=torch.bfloat16).engine.model
    q = model.model.layers[0].self_attn.q_proj.weight.full_tensor()
    assert torch.equal(cast.model.layers[0].self_attn.q_proj.weight, q.to(torch.bfloat16))
    assert cast.lm_head.weight.dtype == cast.model.norm.weight.dtype == torch.float32


def test_async_copy_of_a_sharded_lora_model_syncs_its_adapters(mesh, tokenizer, one_thread, no_deepcopy_of_sharded):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters that change the greedy answers (peft starts lora_B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    plain = copy.deepcopy(model)
    shard_model(model, mesh)
    prod = producer(model, tokenizer)
    copy_ = prod.engine.model
    assert isinstance(copy_, PeftModel) and copy_.active_adapter == "default"
    assert_plain_copy_of(copy_, model)  # the frozen base copied once, with the adapters
    assert greedy(copy_) == greedy(plain)
    with torch.no_grad(), plain.disable_adapter():
        without = greedy(plain)
    assert greedy(copy_) != without  # the adapters count

    with torch.no_grad():  # a step on the adapter shards
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.5)
    prod.sync_weights(model, 2, trainable_only=True)
    staged, version, strict = prod._staged
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(staged) == adapters and len(adapters) == 8 and version == 2 and strict is False
    prod.engine.load_weights(staged, version, strict=strict)
    assert_plain_copy_of(copy_, model)


def test_full_weights_gathers_tied_weights_once_and_needs_a_module_for_trainable_only(mesh, tokenizer):
    model = tiny_model(tokenizer)
    shard_model(model, mesh)
    weights = full_weights(model)
    assert list(weights) == list(model.state_dict())
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]  # tied: one gather, one tensor
    assert not isinstance(weights["lm_head.weight"], DTensor)
    with pytest.raises(TypeError) as e:
        full_weights(weights, trainable_only=True)
    assert str(e.value) == ("full_weights: trainable_only needs a module (a state dict says nothing of "
                            "requires_grad).")
