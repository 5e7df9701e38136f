"""The behaviours TorchRL's own tests pin (pytorch/rl ``test/llm/test_wrapper.py`` and ``test/llm/test_conversions.py``,
main at ae9719f17), checked on lit_llm with the tiny model (issue 12, item 7).

Grouped by the TorchRL test class they mirror; each docstring names the TorchRL test. These are lit_llm's own tests
of the same behaviours (SmolLM2's tokenizer, exact values where TorchRL only checks types); where lit_llm deliberately
differs the test pins lit_llm's behaviour and ``docs/torchrl_parity.md`` states the difference.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, ThreadPoolExecutor, wait

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from lit_llm.data.history import History
from lit_llm.policy import TransformersWrapper

GK = {"max_new_tokens": 4, "do_sample": False}  # greedy: padded and unpadded runs give the same ids
PROMPTS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Are you happy? Say yes or no."}],
    [{"role": "system", "content": "You are a very helpful assistant, but more handsome."},
     {"role": "user", "content": "Explain the difference between a cat and a dog."}],
]
REPLIES = ["Yes.", "A cat meows, a dog barks."]
FULLS = [p + [{"role": "assistant", "content": r}] for p, r in zip(PROMPTS, REPLIES)]
TEXTS = ["Are you happy? Say yes or no.", "Explain the difference between a cat and a dog. Be very detailed."]
OUTS = ["text", "masks", "tokens", "log_probs", "history"]


def _wrapper(tiny, tokenizer, **kw):
    return TransformersWrapper(tiny, tokenizer=tokenizer, **{"generate_kwargs": dict(GK), **kw})


def _rows(container, key):
    value = container.get(key, as_list=True)
    return [value] if isinstance(value, (torch.Tensor, str)) else list(value)


def _check_rows(out, pad_output: bool, ref=None) -> None:
    """TorchRL's ``check_output_shapes``, exact: every ``full``-aligned tensor (ids, log-probs, both masks) has the
    ids' shape; per row ``tokens.full == cat(prompt, response)`` (unpadded) and, for padded output, the real ids
    under the attention mask equal the unpadded run's rows ``ref``."""
    flat = out if out.batch_dims == 1 else lazy_stack([out])
    for b in range(flat.batch_size[0]):
        row = flat[b]
        t, lp, m = row["tokens"], row["log_probs"], row["masks"]
        shapes = {t.full.shape, lp.full.shape, m.all_attention_mask.shape}
        if m.all_assistant_mask is not None:
            shapes.add(m.all_assistant_mask.shape)
        assert len(shapes) == 1
        if pad_output:
            assert t.padded is True and lp.padded is True and m.padded is True
            real = t.full[m.all_attention_mask.bool()]
            if ref is not None:
                assert real.tolist() == ref[b].tolist()
        else:
            assert t.padded is False and lp.padded is False and m.padded is False
            assert bool(m.all_attention_mask.all())
            if t.prompt is not None and t.response is not None:
                assert t.full.tolist() == t.prompt.tolist() + t.response.tolist()
                assert lp.full[t.prompt.numel():].tolist() == lp.response.tolist()


def _history_td(chats, key="history", field="prompt", batched=True):
    td = TensorDict({key: ChatHistory(**{field: History.from_chats(chats)}, batch_size=[len(chats)])},
                    batch_size=[len(chats)])
    return td if batched else td[0]


def _ids(tokenizer, texts):
    return [torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


# ================================================================================================ TestWrappers
class TestWrappers:
    def test_legacy_names_and_conflicts(self, tiny, tokenizer):
        """Mirrors ``TestWrappers.test_legacy_parameter_names`` and ``test_parameter_conflict_resolution``:
        ``max_tokens``/``n`` become ``max_new_tokens``/``num_return_sequences``; with both names the legacy one wins
        (lit_llm warns where TorchRL is silent)."""
        w = _wrapper(tiny, tokenizer, input_mode="text",
                     generate_kwargs={"max_tokens": 10, "n": 1, "temperature": 0.7})
        assert w.generate_kwargs == {"max_new_tokens": 10, "num_return_sequences": 1, "temperature": 0.7}
        with pytest.warns(UserWarning, match="legacy"):
            w = _wrapper(tiny, tokenizer, input_mode="text", generate_kwargs={
                "max_tokens": 20, "max_new_tokens": 10, "n": 2, "num_return_sequences": 1, "temperature": 0.7})
        assert w.generate_kwargs == {"max_new_tokens": 20, "num_return_sequences": 2, "temperature": 0.7}
        assert w.num_samples == 2

    @pytest.mark.parametrize("kwargs, message", [
        ({"temperature": -0.1}, "temperature must be non-negative"),
        ({"top_p": 1.5}, "top_p must be between 0 and 1"),
        ({"top_k": 0}, "top_k must be positive"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive"),
        ({"do_sample": False, "temperature": 0.7}, "do_sample=False .* contradicts temperature=0.7"),
    ])
    def test_parameter_validation(self, tiny, tokenizer, kwargs, message):
        """Mirrors ``TestWrappers.test_parameter_validation``: the same five settings raise ``ValueError`` at
        construction (lit_llm's messages say the fix too)."""
        with pytest.raises(ValueError, match=message):
            _wrapper(tiny, tokenizer, input_mode="text", generate_kwargs=kwargs)

    @pytest.mark.parametrize("generate", [True, False])
    @pytest.mark.parametrize("pad_output", [True, False])
    @pytest.mark.parametrize("batched", [True, False])
    def test_history_input_mode(self, tiny, tokenizer, generate, pad_output, batched):
        """Mirrors ``TestWrappers.test_history_input_mode``: in/out keys, every container returned, ``padded`` flags,
        one shape for all ``full``-aligned tensors; generate: ``str`` response for an unbatched input, list for a
        batch; log-prob version: ``text.response`` / ``text.prompt`` ``None``."""
        w = _wrapper(tiny, tokenizer, input_mode="history", generate=generate, pad_output=pad_output)
        assert w.in_keys == [("history", "prompt" if generate else "full")]
        assert w.out_keys[:5] == OUTS and w.out_keys[5:] == (["truncated"] if generate else [])
        td = _history_td(PROMPTS if generate else FULLS, field="prompt" if generate else "full", batched=batched)
        out = w(td)
        for key in OUTS:
            assert key in out.keys()
        assert isinstance(out["text"], Text) and isinstance(out["tokens"], Tokens)
        assert isinstance(out["masks"], Masks) and isinstance(out["log_probs"], LogProbs)
        assert isinstance(out["history"], ChatHistory)
        ref = None
        if pad_output:
            unpadded = _wrapper(tiny, tokenizer, input_mode="history", generate=generate)(
                _history_td(PROMPTS if generate else FULLS, field="prompt" if generate else "full", batched=batched))
            flat = unpadded if batched else lazy_stack([unpadded])
            ref = [flat[b]["tokens"].full for b in range(flat.batch_size[0])]
        _check_rows(out, pad_output, ref)
        if not generate:  # as TorchRL: the log-prob version's text is ``full`` only
            flat = out if batched else lazy_stack([out])
            assert all(flat[b]["text"].response is None and flat[b]["text"].prompt is None
                       for b in range(flat.batch_size[0]))
            return
        response = out["text"].response if not batched else out["text"].get("response", as_list=True)
        assert isinstance(response, str) if not batched else all(isinstance(r, str) for r in response)

    def test_single_history_item_unsqueeze(self, tiny, tokenizer):
        """Mirrors ``TestWrappers.test_single_history_item_unsqueeze``: ``ChatHistory(prompt=history[:, 0])`` (one
        message per row) warns, is unsqueezed, and generates one reply per row."""
        hist = History.from_chats(PROMPTS)
        with pytest.warns(UserWarning, match="unsqueezed along the last dimension"):
            ch = ChatHistory(prompt=hist[:, 0], batch_size=[2])
        assert ch.prompt.batch_size == torch.Size([2, 1])
        out = _wrapper(tiny, tokenizer, input_mode="history")(TensorDict(history=ch, batch_size=[2]))
        assert out.batch_size == torch.Size([2]) and len(out["text"].get("response", as_list=True)) == 2
        _check_rows(out, False)

    @pytest.mark.parametrize("generate", [True, False])
    @pytest.mark.parametrize("pad_output", [True, False])
    @pytest.mark.parametrize("batched", [True, False])
    def test_text_input_mode(self, tiny, tokenizer, generate, pad_output, batched):
        """Mirrors ``TestWrappers.test_text_input_mode``: in keys, the input text is returned unchanged, a response
        text when generating, ``tokens.response`` a tensor (padded) or rows (unpadded)."""
        w = _wrapper(tiny, tokenizer, input_mode="text", generate=generate, pad_output=pad_output)
        field = "prompt" if generate else "full"
        assert w.in_keys == [("text", field)]
        td = TensorDict(text=Text(**{field: TEXTS}, batch_size=[2]), batch_size=[2])
        out = w(td if batched else td[0])
        assert out["text"].get(field) == (TEXTS if batched else TEXTS[0])
        for key in ("text", "masks", "tokens", "log_probs"):
            assert key in out.keys()
        ids = _ids(tokenizer, TEXTS)
        if generate:
            assert out["text"].response is not None
            rows = out["tokens"].response if pad_output else out["tokens"].get("response", as_list=True)
            if pad_output or not batched:
                assert isinstance(rows, torch.Tensor)
            else:
                assert isinstance(rows, list) and len(rows) == 2
            prompts = _rows(out["tokens"], "prompt") if not pad_output else None
            if prompts is not None:
                assert [p.tolist() for p in prompts] == [i.tolist() for i in (ids if batched else ids[:1])]
        else:
            fulls = out["tokens"].get("full", as_list=True) if not pad_output else None
            if fulls is not None:
                fulls = [fulls] if not batched else fulls
                assert [f.tolist() for f in fulls] == [i.tolist() for i in (ids if batched else ids[:1])]

    @pytest.mark.parametrize("generate", [True, False])
    @pytest.mark.parametrize("pad_output", [True, False])
    @pytest.mark.parametrize("batched", [True, False])
    def test_tokens_input_mode(self, tiny, tokenizer, generate, pad_output, batched):
        """Mirrors ``TestWrappers.test_tokens_input_mode``: left-padded ``[B, T]`` ids with the tokenizer's
        ``attention_mask`` at ``attention_mask_key`` (TorchRL's default key): the padding is dropped, so the rows
        are exactly the unpadded ids."""
        enc = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        assert not bool(enc["attention_mask"].all())  # the rows differ in length: there is padding to drop
        field = "prompt" if generate else "full"
        w = _wrapper(tiny, tokenizer, input_mode="tokens", attention_mask_key="attention_mask",
                     generate=generate, pad_output=pad_output)
        assert w.in_keys == [("tokens", field)]
        td = TensorDict(tokens=Tokens(**{field: enc["input_ids"]}, batch_size=[2]),
                        attention_mask=enc["attention_mask"], batch_size=[2])
        out = w(td if batched else td[0])
        for key in ("masks", "tokens", "log_probs"):
            assert key in out.keys()
        ids = _ids(tokenizer, TEXTS) if batched else _ids(tokenizer, TEXTS[:1])
        if not batched:  # td[0] holds the first row with its left padding
            ids = [enc["input_ids"][0][enc["attention_mask"][0].bool()]]
        got = out["tokens"].get(field, as_list=True) if not pad_output else None
        if got is not None:
            got = [got] if not batched else got
            assert [g.tolist() for g in got] == [i.tolist() for i in ids]
        else:
            flat = out if batched else lazy_stack([out])
            if not generate:
                for b in range(flat.batch_size[0]):
                    real = flat[b]["tokens"].full[flat[b]["masks"].all_attention_mask.bool()]
                    assert real.tolist() == ids[b].tolist()

    def test_dense_tokens_without_a_mask_are_all_real(self, tiny, tokenizer):
        """Deliberate difference with ``TestWrappers.test_tokens_input_mode``'s fallback (TorchRL builds the mask as
        ``ids != pad_token_id``): lit_llm never reads padding off the ids (pad == eos for SmolLM2), so a dense tensor
        without any attention mask is taken as all real tokens."""
        ids = torch.tensor([[2, 2, 5, 6], [7, 8, 9, 10]])  # 2 = <|im_end|> = pad
        out = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)(
            TensorDict(tokens=Tokens(full=ids, batch_size=[2]), batch_size=[2]))
        assert [r.tolist() for r in out["tokens"].get("full", as_list=True)] == ids.tolist()

    def test_errors(self, tiny, tokenizer):
        """Mirrors ``TestWrappers.test_invalid_input_mode``, ``test_missing_input_key``,
        ``test_generate_false_without_log_probs`` and ``test_invalid_history_type`` (the last raises the same
        ``TypeError`` when the container is built, before the wrapper is called: a deliberate difference)."""
        with pytest.raises(ValueError, match="input_mode must be one of"):
            _wrapper(tiny, tokenizer, input_mode="invalid_mode")
        w = _wrapper(tiny, tokenizer, input_mode="history", input_key="history")
        with pytest.raises(ValueError, match="the input has no 'history'"):
            w(TensorDict(batch_size=[2]))
        with pytest.raises(ValueError, match="return_log_probs=False contradicts generate=False"):
            _wrapper(tiny, tokenizer, generate=False, return_log_probs=False)
        with pytest.raises(TypeError, match="'prompt' must be a History"):
            ChatHistory(prompt="not a history object")

    @pytest.mark.parametrize("batch", [1, 2, 3])
    @pytest.mark.parametrize("pad_output", [True, False])
    def test_batch_sizes(self, tiny, tokenizer, batch, pad_output):
        """Mirrors ``TestWrappers.test_batch_sizes``: ``B`` prompts give ``B`` response texts and id rows."""
        chats = [[{"role": "system", "content": "S"}, {"role": "user", "content": f"Question {i}?"}]
                 for i in range(batch)]
        out = _wrapper(tiny, tokenizer, input_mode="history", pad_output=pad_output)(_history_td(chats))
        assert len(out["text"].get("response", as_list=True)) == batch
        rows = out["tokens"].response if pad_output else out["tokens"].get("response", as_list=True)
        assert len(rows) == batch

    @pytest.mark.parametrize("batched", [True, False])
    def test_custom_input_key(self, tiny, tokenizer, batched):
        """Mirrors ``TestWrappers.test_custom_input_key``: ``input_key=("custom_history_key", "prompt")``."""
        w = _wrapper(tiny, tokenizer, input_mode="history", input_key=("custom_history_key", "prompt"))
        assert w.in_keys == [("custom_history_key", "prompt")]
        out = w(_history_td(PROMPTS, key="custom_history_key", batched=batched))
        for key in ("text", "masks", "tokens", "log_probs"):
            assert key in out.keys()

    @pytest.mark.parametrize("return_log_probs", [True, False])
    def test_selective_outputs(self, tiny, tokenizer, return_log_probs):
        """Mirrors ``TestWrappers.test_selective_outputs``: ``out_keys`` follow the ``return_*`` flags in TorchRL's
        order, and only those containers are written (lit_llm adds ``truncated`` to the generate version's)."""
        w = _wrapper(tiny, tokenizer, input_mode="history", return_log_probs=return_log_probs)
        expected = ["text", "masks", "tokens"] + (["log_probs"] if return_log_probs else []) + ["history"]
        assert w.out_keys == expected + ["truncated"]
        out = w(_history_td(PROMPTS))
        assert ("log_probs" in out.keys()) is return_log_probs

    @pytest.mark.parametrize("batched", [True, False])
    def test_log_probs_only_mode(self, tiny, tokenizer, batched):
        """Mirrors ``TestWrappers.test_log_probs_only_mode``: the log-prob version of a full conversation returns
        ``log_probs.full`` and, as TorchRL, ``text.full`` only (``text.prompt`` / ``text.response`` ``None``).
        lit_llm's addition: ``tokens`` / ``log_probs`` are split at the last assistant turn (TorchRL: ``None``)."""
        w = _wrapper(tiny, tokenizer, input_mode="history", generate=False)
        out = w(_history_td(FULLS, field="full", batched=batched))
        chats = FULLS if batched else FULLS[:1]
        flat = out if batched else lazy_stack([out])
        for b, chat in enumerate(chats):
            row = flat[b]
            assert row["text"].full == _render(tokenizer, chat)
            assert row["text"].prompt is None and row["text"].response is None
            assert tokenizer.decode(row["tokens"].response.tolist()) == f"{REPLIES[b]}<|im_end|>\n"
            assert row["log_probs"].response.shape == row["tokens"].response.shape
            assert row["log_probs"].full.shape == row["tokens"].full.shape

    @pytest.mark.parametrize("batched", [True, False])
    def test_unpadded_output_with_as_list(self, tiny, tokenizer, batched):
        """Mirrors ``TestWrappers.test_unpadded_output_with_as_list`` and ``test_tensorclass_structure``: with
        ``pad_output=False`` ``get(..., as_list=True)`` gives ``str``/tensor for one item, lists for a batch."""
        out = _wrapper(tiny, tokenizer, input_mode="history")(_history_td(PROMPTS, batched=batched))
        text, tokens, lps = (out.get(k, as_list=True) for k in ("text", "tokens", "log_probs"))
        if not batched:
            assert isinstance(text.response, str)
            assert isinstance(tokens.get("response", as_list=True), torch.Tensor)
            assert isinstance(lps.get("response", as_list=True), torch.Tensor)
            return
        assert len(text.response) == 2 and all(isinstance(r, str) for r in text.response)
        for container in (tokens, lps):
            rows = container.get("response", as_list=True)
            assert isinstance(rows, list) and len(rows) == 2 and all(isinstance(r, torch.Tensor) for r in rows)
        assert [r.numel() for r in tokens.get("response", as_list=True)] == \
               [r.numel() for r in lps.get("response", as_list=True)]

    @pytest.mark.parametrize("input_mode", ["history", "text", "tokens"])
    @pytest.mark.parametrize("pad_output", [True, False])
    @pytest.mark.parametrize("batched", [True, False])
    def test_num_samples(self, tiny, tokenizer, input_mode, pad_output, batched):
        """Mirrors ``TestWrappers.test_num_samples``: ``num_samples=2`` gives batch ``[2]`` for one prompt and
        ``[B, 2]`` for a batch, in each input mode."""
        w = _wrapper(tiny, tokenizer, input_mode=input_mode, pad_output=pad_output, num_samples=2)
        if input_mode == "history":
            td = _history_td(PROMPTS)
        elif input_mode == "text":
            td = TensorDict(text=Text(prompt=TEXTS, batch_size=[2]), batch_size=[2])
        else:
            td = TensorDict(tokens=lazy_stack([Tokens(prompt=i, padded=False) for i in _ids(tokenizer, TEXTS)]),
                            batch_size=[2])
        out = w(td if batched else td[0])
        assert out.batch_size == (torch.Size([2, 2]) if batched else torch.Size([2]))


# ===================================================================================== TestDistributionMethods
class TestDistributionMethods:
    @pytest.mark.parametrize("strategy", ["sft", "rlhf", "generic"])
    @pytest.mark.parametrize("pad_output", [True, False])
    def test_transformers_distribution_methods(self, tiny, tokenizer, strategy, pad_output):
        """Mirrors ``TestDistributionMethods.test_transformers_distribution_methods``: ``_get_sft_dist`` (tokens mode,
        dense or ragged ids with masks), ``_get_rlhf_dist`` and ``_get_generic_dist`` (history mode) give a
        distribution whose ``log_prob`` of the output ids has the ids' shape; its values are the wrapper's own
        log-probs on the mask (exact to float tolerance), 0 off it."""
        if strategy == "sft":
            enc = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            attn = enc["attention_mask"].bool()
            asst = attn.clone()
            asst[:, : attn.shape[-1] // 2] = False
            td = TensorDict({"tokens": Tokens(full=enc["input_ids"]), "masks": Masks(
                all_attention_mask=attn, all_assistant_mask=asst)}, batch_size=[2]).to_lazystack(0)
            if not pad_output:
                td = TensorDict({"tokens": lazy_stack([Tokens(full=enc["input_ids"][b][attn[b]], padded=False)
                                                       for b in range(2)]),
                                 "masks": lazy_stack([Masks(all_attention_mask=attn[b][attn[b]],
                                                            all_assistant_mask=asst[b][attn[b]], padded=False)
                                                      for b in range(2)])}, batch_size=[2])
            mode = "tokens"
        else:
            td = _history_td(FULLS, field="full").to_lazystack(0)
            mode = "history"
        w = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode=mode, generate=False, pad_output=pad_output)
        dist = {"sft": w._get_sft_dist, "rlhf": w._get_rlhf_dist, "generic": w._get_generic_dist}[strategy](td)
        assert hasattr(dist, "log_prob") and hasattr(dist, "sample")
        out = w(td.copy())
        ids = out.get(("tokens", "full"), as_padded_tensor=True, padding_side="left",
                      padding_value=tokenizer.pad_token_id)
        lp = dist.log_prob(ids.long())
        assert lp.shape == ids.shape
        ref = out.get(("log_probs", "full"), as_padded_tensor=True, padding_side="left", padding_value=0.0)
        mask = dist.mask
        torch.testing.assert_close(lp[mask], ref[mask], atol=1e-4, rtol=0)
        assert bool((lp[~mask] == 0).all())

    def test_transformers_custom_masking(self, tiny, tokenizer):
        """Mirrors ``TestDistributionMethods.test_transformers_custom_masking``: ``_get_dist_with_custom_mask`` with
        a mask of the padded ``log_probs.full`` shape scores exactly the masked positions."""
        w = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="history", generate=False, pad_output=True)
        td = _history_td(FULLS, field="full")
        out = w(td.copy())
        lp_full = out["log_probs"].full
        custom = torch.zeros_like(lp_full, dtype=torch.bool)
        custom[:, -5:] = True
        dist = w._get_dist_with_custom_mask(td, custom)
        got = dist.log_prob(out["tokens"].full)
        torch.testing.assert_close(got[custom], lp_full[custom], atol=1e-4, rtol=0)
        assert bool((got[~custom] == 0).all())


# ===================================================================================================== TestPacking
class TestPacking:
    @pytest.mark.parametrize("input_mode", ["history", "text", "tokens"])
    @pytest.mark.parametrize("pad_output", [True, False])
    def test_batch_equals_rows_scored_alone(self, tiny, tokenizer, input_mode, pad_output):
        """Mirrors ``TestPacking.test_packing_history`` / ``test_packing_text`` / ``test_packing_tokens``: TorchRL
        pins that the packed forward pass equals the padded one. lit_llm has only the padded pass (position ids from
        the attention mask); the property behind the test is that each row gets the log-probs it has alone."""
        if input_mode == "history":
            td = _history_td(FULLS, field="full")
        elif input_mode == "text":
            td = TensorDict(text=Text(full=TEXTS, batch_size=[2]), batch_size=[2])
        else:
            td = TensorDict(tokens=lazy_stack([Tokens(full=i, padded=False) for i in _ids(tokenizer, TEXTS)]),
                            batch_size=[2])
        w = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode=input_mode, generate=False,
                                pad_output=pad_output, pad_model_input=True)
        batch = w(td.copy())
        for b in range(2):
            alone = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode=input_mode, generate=False)(
                td[b:b + 1].copy())
            ref = alone["log_probs"].get("full", as_list=True)[0]
            got = batch["log_probs"].get("full", as_list=True)[b] if not pad_output else \
                batch["log_probs"].full[b][batch["masks"].all_attention_mask[b]]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    def test_pad_model_input_false_and_generate_refused(self, tiny, tokenizer):
        """``pad_model_input=False`` (packing) raises naming why; any value raises for the generate version, as in
        TorchRL (``pad_model_input is not supported when generate=True``)."""
        with pytest.raises(ValueError, match=r"pad_model_input=False \(a packed forward pass\) is not supported"):
            TransformersWrapper(tiny, tokenizer=tokenizer, generate=False, pad_model_input=False)
        with pytest.raises(ValueError, match="pad_model_input is not supported when generate=True"):
            TransformersWrapper(tiny, tokenizer=tokenizer, generate=True, pad_model_input=True)


# ==================================================================================================== TestBatching
class TestBatching:
    def test_batching(self, tiny, tokenizer):
        """Mirrors ``TestBatching.test_batching``: two threads of two prompts each fill ``min_batch_size=4`` and each
        caller gets its own rows back."""
        w = _wrapper(tiny, tokenizer, input_mode="text", min_batch_size=4)
        inputs = [TensorDict(text=Text(prompt=[f"Question {i}?", f"Question {i + 2}?"], batch_size=[2]),
                             batch_size=[2]) for i in range(2)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(w, x) for x in inputs]
            wait(futures, timeout=60)
            results = [f.result(timeout=0) for f in futures]
        w.cleanup_batching()
        assert [list(r["text"].prompt) for r in results] == [["Question 0?", "Question 2?"],
                                                              ["Question 1?", "Question 3?"]]
        assert all(len(r["text"].get("response", as_list=True)) == 2 for r in results)

    def test_batching_uneven(self, tiny, tokenizer):
        """Mirrors ``TestBatching.test_batching_uneven``: calls of 1, 3 and 2 rows with ``min_batch_size=5`` each
        get their own prompts back (the last one after the timeout at the latest)."""
        w = _wrapper(tiny, tokenizer, input_mode="text", min_batch_size=5, batching_timeout=5)
        prompts = [["Question 1?"], ["Question 2?", "Question 3?", "Question 4?"], ["Question 5?", "Question 6?"]]
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = []
            for p in prompts:
                futures.append(pool.submit(w, TensorDict(text=Text(prompt=p, batch_size=[len(p)]),
                                                         batch_size=[len(p)])))
                time.sleep(0.05)
            done, _ = wait(futures, timeout=60)
        w.cleanup_batching()
        assert len(done) == 3
        assert [list(f.result()["text"].prompt) for f in futures] == prompts

    def test_batching_cleanup(self, tiny, tokenizer):
        """Mirrors ``TestBatching.test_batching_cleanup``: ``get_batching_state`` carries TorchRL's keys; queued calls
        show in ``queue_size``/``pending_futures``; after ``cleanup_batching()`` the queue is empty and
        ``lock_state == "unlocked"``."""
        w = _wrapper(tiny, tokenizer, input_mode="text", min_batch_size=3, batching_timeout=30)
        state = w.get_batching_state()
        assert (state["batching_enabled"], state["min_batch_size"], state["queue_size"],
                state["pending_futures"]) == (True, 3, 0, 0)
        pool = ThreadPoolExecutor(max_workers=2)
        futures = [pool.submit(w, TensorDict(text=Text(prompt=[f"Test {i}"], batch_size=[1]), batch_size=[1]))
                   for i in range(2)]
        deadline = time.monotonic() + 10
        while w.get_batching_state()["pending_futures"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        state = w.get_batching_state()
        assert (state["queue_size"], state["pending_futures"]) == (2, 2)
        w.cleanup_batching()  # TorchRL's default flush=False: the queued calls are cancelled
        wait(futures, timeout=60)
        pool.shutdown(wait=True)
        state = w.get_batching_state()
        assert (state["queue_size"], state["pending_futures"], state["lock_state"]) == (0, 0, "unlocked")
        for f in futures:
            with pytest.raises(CancelledError, match="cleanup_batching"):
                f.result()

    def test_batching_configuration_validation(self, tiny, tokenizer):
        """Mirrors ``TestBatching.test_batching_configuration_validation``: ``min <= max`` accepted (equal too),
        ``min > max`` raises TorchRL's message, either bound alone is fine; with ``batching=True``
        ``min_batch_size=None`` is stored as 1 (TorchRL's ``_min_batch_size == 1``)."""
        for lo, hi in ((2, 5), (3, 3), (5, None), (None, 2)):
            w = _wrapper(tiny, tokenizer, input_mode="text", batching=True, min_batch_size=lo, max_batch_size=hi)
            state = w.get_batching_state()
            assert (w._min_batch_size, w._max_batch_size) == (lo or 1, hi)
            assert (state["min_batch_size"], state["max_batch_size"]) == (lo or 1, hi)
        with pytest.raises(ValueError, match=r"min_batch_size \(5\) must be <= max_batch_size \(2\)"):
            _wrapper(tiny, tokenizer, input_mode="text", batching=True, min_batch_size=5, max_batch_size=2)

    def test_standardized_generation_parameters(self, tiny, tokenizer):
        """Mirrors ``TestBatching.test_standardized_generation_parameters`` (xfail in TorchRL): the sampling settings
        are kept under their transformers names; beam-search settings (``length_penalty``, ``early_stopping``) and
        ``logprobs`` are refused naming the key (a deliberate difference: TorchRL passes them on)."""
        kwargs = {"max_new_tokens": 10, "num_return_sequences": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
                  "repetition_penalty": 1.1, "do_sample": True, "num_beams": 1, "skip_special_tokens": True}
        w = _wrapper(tiny, tokenizer, input_mode="text", generate_kwargs=kwargs)
        assert w.generate_kwargs == kwargs
        for key, value in (("length_penalty", 1.0), ("early_stopping", False), ("logprobs", True)):
            with pytest.raises(ValueError, match=f"'{key}' is not supported"):
                _wrapper(tiny, tokenizer, input_mode="text", generate_kwargs={**kwargs, key: value})

    def test_max_batch_size_alone_keeps_min_batch_size_none(self, tiny, tokenizer):
        """TorchRL's ``__init__`` without ``batching``: ``max_batch_size`` alone turns batching on and keeps
        ``_min_batch_size`` ``None`` (``get_batching_state()["min_batch_size"] is None``), which batches from one
        row (TorchRL's documented meaning): a one-row call runs at once, not after ``batching_timeout``."""
        w = _wrapper(tiny, tokenizer, input_mode="text", max_batch_size=2, batching_timeout=120)
        state = w.get_batching_state()
        assert (w.batching, w._min_batch_size, state["min_batch_size"], state["max_batch_size"]) == (
            True, None, None, 2)
        with ThreadPoolExecutor(max_workers=1) as pool:
            out = pool.submit(w, TensorDict(text=Text(prompt=["Question?"], batch_size=[1]), batch_size=[1]))
            assert list(out.result(timeout=60)["text"].prompt) == ["Question?"]  # 120 s if it waited for more rows
        assert w.get_batching_state()["batches_run"] == 1
        assert w.get_new_version(generate=False)._batching_settings()["min_batch_size"] is None  # carried as is
        w.cleanup_batching()

    @pytest.mark.parametrize("min_batch_size", [None, 1])
    def test_batching_null_dimension(self, tiny, tokenizer, min_batch_size):
        """Mirrors ``TestBatching.test_batching_null_dimension``: a ``batch_size=[]`` input keeps ``[]`` (prompt a
        ``str``) with and without batching; a ``[2]`` input keeps ``[2]``."""
        w = _wrapper(tiny, tokenizer, input_mode="text", min_batch_size=min_batch_size)
        prompt = "Single question without batch dimension?"
        out = w(TensorDict(text=Text(prompt=prompt), batch_size=[]))
        assert out.batch_size == torch.Size([]) and out["text"].prompt == prompt
        for key in ("text", "tokens", "masks", "log_probs"):
            assert key in out.keys()
        out = w(TensorDict(text=Text(prompt=["Question 1?", "Question 2?"], batch_size=[2]), batch_size=[2]))
        assert out.batch_size == torch.Size([2]) and list(out["text"].prompt) == ["Question 1?", "Question 2?"]
        w.cleanup_batching()


# ========================================================================================= test_conversions.py
SIMPLE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
          {"role": "assistant", "content": "Hi there!"}]
MULTI = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "2+2 equals 4."}, {"role": "user", "content": "Thanks!"},
         {"role": "assistant", "content": "You're welcome!"}]


def _render(tokenizer, msgs, gen=False) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def _batch_of_rows():
    """TorchRL's fixture: a lazy stack of unbatched ChatHistory, each holding a ``[1, n]`` History."""
    hist = History.from_chats([SIMPLE, MULTI])
    return lazy_stack([ChatHistory(full=hist[i:i + 1]) for i in range(2)])


class TestChatHistoryConversions:
    def test_history_to_text_single_and_prompt_response(self, tokenizer):
        """Mirrors ``test_history_to_text_single`` and ``test_history_to_text_prompt_response``: an unbatched
        ChatHistory holding a ``[1, n]`` History gives one-element lists; ``full == prompt + response``."""
        text = ChatHistory(full=History.from_chats([SIMPLE])).to_text(tokenizer)
        assert list(text.full) == [_render(tokenizer, SIMPLE)]
        text = ChatHistory(prompt=History.from_chats([SIMPLE[:2]]), full=History.from_chats([SIMPLE])).to_text(
            tokenizer)
        assert list(text.prompt) == [_render(tokenizer, SIMPLE[:2], gen=True)]
        assert list(text.full) == [text.prompt[0] + text.response[0]] == [_render(tokenizer, SIMPLE)]

    def test_history_to_text_batch(self, tokenizer):
        """Mirrors ``test_history_to_text_batch``: a ``[2]`` stack of rows holding ``[1, n]`` Histories gives
        ``text.full[b]`` a one-element list."""
        text = _batch_of_rows().to_text(tokenizer)
        assert text.batch_size == torch.Size([2])
        assert [list(f) for f in text.full] == [[_render(tokenizer, SIMPLE)], [_render(tokenizer, MULTI)]]

    def test_history_to_tokens(self, tokenizer):
        """Mirrors ``test_history_to_tokens_single`` / ``_batch`` / ``_prompt_response``: ``padded=False``, ids of the
        rendered chat, ``len(prompt) + len(response) == len(full)`` and ``full == prompt ++ response``."""
        ref = tokenizer.apply_chat_template(SIMPLE, tokenize=True, return_dict=False)
        tokens = ChatHistory(full=History.from_chats([SIMPLE])).to_tokens(tokenizer)
        assert tokens.padded is False and tokens.full.tolist() == [ref]
        batch = _batch_of_rows().to_tokens(tokenizer)
        assert batch.batch_size == torch.Size([2]) and not any(batch.padded)
        assert batch.get("full", as_nested_tensor=True).is_nested
        split = ChatHistory(prompt=History.from_chats([SIMPLE[:2]]), full=History.from_chats([SIMPLE])).to_tokens(
            tokenizer)
        p, r, f = (split._tensordict.get(k, as_list=True)[0] for k in ("prompt", "response", "full"))
        assert p.numel() + r.numel() == f.numel() and f.tolist() == p.tolist() + r.tolist() == ref


class TestTokensConversions:
    def test_tokens_to_text(self, tokenizer):
        """Mirrors ``test_tokens_to_text_single`` / ``_batch`` / ``_prompt_response``: decoding gives the rendered
        text (special tokens kept), one-element lists for a ``[1, T]`` row, prompt/response/full when split."""
        tokens = ChatHistory(full=History.from_chats([SIMPLE])).to_tokens(tokenizer)
        assert list(tokens.to_text(tokenizer).full) == [_render(tokenizer, SIMPLE)]
        text = _batch_of_rows().to_tokens(tokenizer).to_text(tokenizer)
        assert text.batch_size == torch.Size([2]) and len(text.full) == 2
        split = ChatHistory(prompt=History.from_chats([SIMPLE[:2]]), full=History.from_chats([SIMPLE]))
        text = split.to_tokens(tokenizer).to_text(tokenizer)
        assert text.prompt is not None and text.response is not None
        assert text.full[0] == text.prompt[0] + text.response[0]

    def test_tokens_to_text_padded_error(self, tokenizer):
        """Mirrors ``test_tokens_to_text_padded_error``: padded tokens raise ``ValueError`` naming padding."""
        tokens = ChatHistory(full=History.from_chats([SIMPLE])).to_tokens(tokenizer)
        tokens.padded = True
        with pytest.raises(ValueError, match="padded=True"):
            tokens.to_text(tokenizer)

    def test_tokens_to_history(self, tokenizer):
        """Mirrors ``test_tokens_to_history_single`` / ``_batch``: the messages come back (batch shape kept)."""
        back = ChatHistory(full=History.from_chats([SIMPLE])).to_tokens(tokenizer).to_history(tokenizer)
        assert isinstance(back, ChatHistory) and back.full.batch_size == torch.Size([1, 3])
        assert list(back.full[0].content) == [m["content"] for m in SIMPLE]
        back = _batch_of_rows().to_tokens(tokenizer).to_history(tokenizer)
        assert back.batch_size == torch.Size([2])
        assert list(back[1].full[0].content) == [m["content"] for m in MULTI]


class TestTextConversions:
    def test_text_to_tokens(self, tokenizer):
        """Mirrors ``test_text_to_tokens_single`` / ``_batch`` / ``_prompt_response``: the tokenizer's ids
        (no added special tokens), ``padded=False``, a nested tensor for a ragged batch, all three fields when
        split."""
        ids = _ids(tokenizer, ["Hello, how are you?", "I'm doing great!"])
        single = Text(full=["Hello, how are you?"]).to_tokens(tokenizer)
        assert single.padded is False and single.full.tolist() == [ids[0].tolist()]
        text = Text._from_tensordict(TensorDict(batch_size=(2,)).to_lazystack(0))
        with text.view(-1) as flat:
            flat.full = ["Hello, how are you?", "I'm doing great!"]
        batch = text.to_tokens(tokenizer)
        assert batch.batch_size == torch.Size([2])
        assert [r.tolist() for r in batch.get("full", as_nested_tensor=True).unbind(0)] == [i.tolist() for i in ids]
        split = Text(prompt=["Hello"], response=[", how are you?"], full=["Hello, how are you?"]).to_tokens(tokenizer)
        assert split.prompt is not None and split.response is not None and split.full is not None
        assert split.full.tolist() == [split.prompt[0].tolist() + split.response[0].tolist()]

    def test_text_to_tokens_padding(self, tokenizer):
        """``test_text_to_tokens_padding_error``: TorchRL raises "Padding is not yet supported". Deliberate
        difference: lit_llm pads a batch (prompt left-, response right-, full left-padded); for one item
        ``padding`` changes nothing."""
        one = Text(full=["Hello, how are you?"]).to_tokens(tokenizer, padding=True)
        assert one.full.tolist() == [_ids(tokenizer, ["Hello, how are you?"])[0].tolist()]
        batch = Text(full=["Hi", "Hello, how are you?"], batch_size=[2]).to_tokens(tokenizer, padding=True)
        assert batch.padded is True and batch.full.shape[0] == 2

    def test_text_to_history(self, tokenizer):
        """Mirrors ``test_text_to_history_single`` / ``_batch``: parsing the rendered text gives the messages."""
        text = ChatHistory(full=History.from_chats([SIMPLE])).to_text(tokenizer)
        back = text.to_history(tokenizer)
        assert isinstance(back, ChatHistory) and list(back.full[0].role) == [m["role"] for m in SIMPLE]
        back = _batch_of_rows().to_text(tokenizer).to_history(tokenizer)
        assert back.batch_size == torch.Size([2]) and back[1].full.batch_size == torch.Size([1, 5])


class TestBijectivity:
    def test_round_trips(self, tokenizer):
        """Mirrors ``test_history_to_text_to_history``, ``test_history_to_tokens_to_text_to_history``,
        ``test_text_to_tokens_to_text`` and ``test_tokens_to_text_to_tokens_shape_preserved``: exact round trips
        (same contents, same text, same ids, not just "within 2 tokens")."""
        hist = History.from_chats([SIMPLE])
        assert ChatHistory(full=hist).to_text(tokenizer).to_history(tokenizer).full.content == hist.content
        back = ChatHistory(full=hist).to_tokens(tokenizer).to_text(tokenizer).to_history(tokenizer)
        assert back.full.content == hist.content
        text = Text(full=["Hello, how are you?"])
        assert list(text.to_tokens(tokenizer).to_text(tokenizer).full) == ["Hello, how are you?"]
        tokens = ChatHistory(full=hist).to_tokens(tokenizer)
        assert tokens.to_text(tokenizer).to_tokens(tokenizer).full.tolist() == tokens.full.tolist()

    def test_default_system_prompt_of_the_template(self, tokenizer):
        """SmolLM2's template adds its default system message to a chat without one, so that chat does not round
        trip through text (the template's doing, not the conversion's): the parsed history gains that message."""
        hist = History.from_chats([SIMPLE[1:]])
        back = ChatHistory(full=hist).to_text(tokenizer).to_history(tokenizer)
        assert list(back.full[0].role) == ["system", "user", "assistant"]
        assert list(back.full[0].content)[1:] == ["Hello", "Hi there!"]


class TestBatchDimensions:
    def test_single_and_nested_batch_dimensions(self, tokenizer):
        """Mirrors ``test_single_batch_dimension`` and ``test_nested_batch_dimensions``: ``[2]`` and ``[2, 2]``
        batches keep their batch shape through to_text / to_tokens / to_history, row for row."""
        batch = _batch_of_rows()
        assert batch.to_text(tokenizer).batch_size == torch.Size([2])
        assert batch.to_tokens(tokenizer).batch_size == torch.Size([2])
        assert batch.to_text(tokenizer).to_history(tokenizer).batch_size == torch.Size([2])
        nested = lazy_stack([_batch_of_rows(), _batch_of_rows()])
        assert nested.batch_size == torch.Size([2, 2])
        text, tokens = nested.to_text(tokenizer), nested.to_tokens(tokenizer)
        assert text.batch_size == torch.Size([2, 2]) and tokens.batch_size == torch.Size([2, 2])
        assert list(text[1, 1].full) == [_render(tokenizer, MULTI)]
        assert tokens[1, 0].full.tolist() == [tokenizer.apply_chat_template(SIMPLE, tokenize=True, return_dict=False)]

