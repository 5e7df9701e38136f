"""TorchRL parity basics (issue 12, items 1 and 5) on the tiny model: ``log_prob`` on ragged batches with TorchRL's
get-kwargs, a model given as a string, float token ids, ``get_batching_state`` keys, cancellation error type."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import Tokens
from lit_llm.policy import TransformersWrapper
from lit_llm.policy.batching import BatchingCancelledError


def _ref_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of one row scored alone (position 0 is 0)."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def _ragged(prompts, responses=None) -> TensorDict:
    rows = []
    for i, p in enumerate(prompts):
        if responses is None:
            rows.append(Tokens(full=p, padded=False))
        else:
            rows.append(Tokens(prompt=p, response=responses[i], full=torch.cat([p, responses[i]]), padded=False))
    return TensorDict(tokens=lazy_stack(rows), batch_size=[len(rows)])


PROMPTS = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11, 12, 13])]
RESPONSES = [torch.tensor([20, 21]), torch.tensor([22, 23, 24, 25]), torch.tensor([26])]


# ----------------------------------------------------------------------------------------------------------- item 1
def test_log_prob_ragged_returns_response_rows(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    assert scorer.pad_output is False
    td = _ragged(PROMPTS, RESPONSES)
    lp = scorer.log_prob(td.copy())  # no kwargs: the ragged rows (not a stacking error)
    as_list = scorer.log_prob(td.copy(), as_list=True)
    assert isinstance(lp, list) and isinstance(as_list, list)
    for b, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        ref = _ref_log_probs(tiny, torch.cat([p, r]))[p.numel():]
        torch.testing.assert_close(lp[b], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(as_list[b], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_log_prob_padded_tensor_kwargs(tiny, tokenizer, side):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    td = _ragged(PROMPTS, RESPONSES)
    rows = scorer.log_prob(td.copy(), as_list=True)
    padded = scorer.log_prob(td.copy(), as_padded_tensor=True, padding_side=side, padding_value=-7.0)
    width = max(r.numel() for r in rows)
    assert padded.shape == (3, width)
    for b, r in enumerate(rows):
        n = r.numel()
        real, pad = (padded[b, width - n:], padded[b, :width - n]) if side == "left" else \
            (padded[b, :n], padded[b, n:])
        torch.testing.assert_close(real, r)
        assert (pad == -7.0).all()


def test_log_prob_falls_back_to_full_without_split(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    lp = scorer.log_prob(_ragged(PROMPTS))
    for b, p in enumerate(PROMPTS):
        torch.testing.assert_close(lp[b], _ref_log_probs(tiny, p), atol=1e-5, rtol=0)


def test_log_prob_padded_output_and_unknown_kwarg(tiny, tokenizer):
    scorer = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=True)
    td = _ragged(PROMPTS, RESPONSES)
    lp = scorer.log_prob(td.copy())
    assert isinstance(lp, torch.Tensor) and lp.shape == (3, 4)  # response padded to the longest, on the right
    torch.testing.assert_close(lp[2, :1], _ref_log_probs(tiny, torch.cat([PROMPTS[2], RESPONSES[2]]))[4:],
                               atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['bogus'\\]"):
        scorer.log_prob(td.copy(), bogus=True)


def test_log_prob_refused_on_generate_version(tiny, tokenizer):
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=True)
    with pytest.raises(Exception, match="log_prob"):
        pol.log_prob(_ragged(PROMPTS))


# ----------------------------------------------------------------------------------------------------------- item 5
def test_model_string_unknown_refused_at_construction(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="cannot be loaded.*load_model"):
        TransformersWrapper(str(missing))


def test_model_string_local_folder_loads_model_and_tokenizer(tiny, tokenizer, tmp_path):
    tiny.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    pol = TransformersWrapper(str(tmp_path), input_mode="tokens", generate=False)
    assert isinstance(pol.model, torch.nn.Module) and pol.tokenizer is not None
    assert pol.device == torch.device("cpu")
    lp = pol.log_prob(_ragged(PROMPTS))
    torch.testing.assert_close(lp[0], _ref_log_probs(tiny, PROMPTS[0]), atol=1e-5, rtol=0)
    mine = TransformersWrapper(str(tmp_path), tokenizer=tokenizer, input_mode="tokens", generate=False)
    assert mine.tokenizer is tokenizer  # a given tokenizer wins


def test_model_not_a_module_refused(tokenizer):
    with pytest.raises(ValueError, match="torch.nn.Module"):
        TransformersWrapper(object(), tokenizer=tokenizer)


@pytest.mark.parametrize("generate", [False, True])
def test_float_token_ids_raise_naming_the_key(tiny, tokenizer, generate):
    key = "prompt" if generate else "full"
    td = TensorDict(tokens=lazy_stack([Tokens(**{key: torch.tensor([1.0, 2.5, 3.9])}, padded=False)]),
                    batch_size=[1])
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=generate,
                              generate_kwargs={"max_new_tokens": 2} if generate else None)
    with pytest.raises(ValueError, match=f"'tokens', '{key}'.*torch.float32.*integer"):
        pol(td)


def test_batching_state_torchrl_keys_and_cancel_error_type(tiny, tokenizer):
    assert issubclass(BatchingCancelledError, concurrent.futures.CancelledError)
    assert issubclass(BatchingCancelledError, RuntimeError)
    pol = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False, batching=True,
                              min_batch_size=8, batching_timeout=60.0)
    results: list = [None, None]

    def call(i):
        try:
            results[i] = pol(_ragged([PROMPTS[i]]))
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while pol.get_batching_state()["queue_size"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    state = pol.get_batching_state()
    for k in ("batching_enabled", "min_batch_size", "max_batch_size", "queue_size", "processing", "lock_state",
              "pending_futures", "timeout", "batching_timeout", "pending_requests"):
        assert k in state, k
    assert state["timeout"] == state["batching_timeout"] == 60.0
    assert state["pending_futures"] == state["pending_requests"] == 2
    assert state["lock_state"] == "unlocked" and state["processing"] is False
    pol.cleanup_batching(flush=False)
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    for r in results:
        assert isinstance(r, concurrent.futures.CancelledError) and isinstance(r, BatchingCancelledError)
