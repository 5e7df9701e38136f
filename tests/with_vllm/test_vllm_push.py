"""Pushing a trainer's weights into the in-process engine (``load_weights``): outputs change and equal a fresh engine
loaded with the same weights, a prompt seen before the push is not answered from the old weights' KV, and the
tensors never leave this process."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from vllm_test_inputs import ENGINE_KWARGS, rows, tokens_td

from lit_llm.data.containers import Tokens
from lit_llm.policy import vLLMWrapper
from lit_llm.policy.vllm_engine import load_weights, make_engine

pytestmark = pytest.mark.vllm

#: Longer than two KV blocks (128 tokens on the CPU backend), so a repeated prompt is served from the prefix cache.
LONG_PROMPT = torch.arange(1000, 1300)
#: fp32 on vLLM's CPU kernels: the same weights give log-probs within ~2e-6 across batch compositions.
ATOL = 1e-5
GREEDY = {"max_new_tokens": 4, "do_sample": False}


@pytest.fixture(scope="module")
def engine():
    llm = make_engine("tiny-vllm", **ENGINE_KWARGS)
    yield llm
    del llm


@pytest.fixture(scope="module")
def fresh_engine(new_weights, engine):
    """An engine started from the new weights' folder. Kept until the module ends: deleting an in-process engine
    tears down vLLM's process-wide distributed state, which every other engine of the process uses."""
    llm = make_engine(new_weights[1], **ENGINE_KWARGS)
    yield llm
    del llm


@pytest.fixture(scope="module")
def new_weights(hf_tiny, tmp_path_factory):
    """``(state_dict, folder)``: the tiny model's weights plus seeded noise, and the same saved as an HF folder."""
    model, tok = hf_tiny
    gen = torch.Generator().manual_seed(1)
    # named_parameters: the tied head once (its checkpoint has no lm_head.weight); state_dict() names it twice
    state = {k: v.detach() + 0.5 * torch.randn(v.shape, generator=gen) for k, v in model.named_parameters()}
    folder = tmp_path_factory.mktemp("pushed")
    model.save_pretrained(folder, state_dict=state)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    tok.save_pretrained(folder)
    return state, folder


def answer(llm, prompts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy response ids and log-probs (generate version) of ``prompts`` on ``llm``."""
    out = vLLMWrapper(llm, input_mode="tokens", generate_kwargs=GREEDY)(tokens_td(prompts))
    return rows(out, ("tokens", "response")), rows(out, ("log_probs", "response"))


def scores(llm, full) -> list[torch.Tensor]:
    """Log-prob version (vLLM's prompt log-probs) of the ``full`` id rows on ``llm``."""
    td = lazy_stack([TensorDict(tokens=Tokens(full=f)) for f in full])
    return rows(vLLMWrapper(llm, input_mode="tokens", generate=False)(td), ("log_probs", "full"))


def test_push_changes_outputs_to_those_of_a_fresh_engine_and_resets_the_prefix_cache(engine, fresh_engine,
                                                                                       new_weights, hf_tiny):
    state, _ = new_weights
    prompts = [LONG_PROMPT, torch.tensor([5, 6, 7, 8])]
    before_ids, before_lp = answer(engine, prompts)  # LONG_PROMPT's KV now sits in the prefix cache
    before_scores = scores(engine, prompts)
    want_ids, want_lp = answer(fresh_engine, prompts)
    want_scores = scores(fresh_engine, prompts)

    # the bug pushing must avoid: reloaded weights without a prefix-cache reset answer a prompt seen before from the
    # old weights' KV (its first response log-prob then differs from the fresh engine's)
    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
    _, stale_lp = answer(engine, prompts[:1])
    assert (stale_lp[0][0] - want_lp[0][0]).abs() > 1e-3
    assert engine.reset_prefix_cache()
    torch.testing.assert_close(answer(engine, prompts[:1])[1][0], want_lp[0], atol=ATOL, rtol=0)

    # back to the start, with the tied head named once (load_weights pushes it as lm_head.weight too)
    vLLMWrapper(engine, input_mode="tokens").load_weights(hf_tiny[0].named_parameters())
    again_ids, again_lp = answer(engine, prompts)
    assert all(torch.equal(a, b) for a, b in zip(again_ids, before_ids))
    for a, b in zip(again_lp, before_lp):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)

    load_weights(engine, iter(state.items()))
    got_ids, got_lp = answer(engine, prompts)
    assert all(torch.equal(a, b) for a, b in zip(got_ids, want_ids))
    for got, want, before in zip(got_lp, want_lp, before_lp):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert (got - before).abs().max() > 1e-2  # the push changed the outputs
    for got, want, before in zip(scores(engine, prompts), want_scores, before_scores):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert (got - before).abs().max() > 1e-2


def test_push_hands_the_tensors_over_in_this_process(engine, hf_tiny):
    assert type(engine.llm_engine.engine_core).__name__ == "InprocClient"
    state = hf_tiny[0].state_dict()
    handed = []

    def weights():  # a generator cannot be pickled: only a call in this process can read it
        for name, tensor in state.items():
            handed.append(name)
            yield name, tensor

    load_weights(engine, weights())
    assert handed == list(state)


def test_load_weights_refuses_what_is_not_an_in_process_engine(engine, monkeypatch):
    with pytest.raises(ValueError, match=r"^load_weights: expected a vllm\.LLM, got dict\.$"):
        load_weights({}, [])
    class SyncMPClient:  # vLLM's client of an engine core in a child process
        pass

    monkeypatch.setattr(engine.llm_engine, "engine_core", SyncMPClient())
    with pytest.raises(ValueError, match=r"^load_weights: the engine core runs in another process \(SyncMPClient\), "
                                         r"where the weights would be serialised and copied; build the engine with "
                                         r"VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        load_weights(engine, [])
