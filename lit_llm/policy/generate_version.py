"""The generate version's forward pass (:class:`GenerateVersionMixin`, inherited by
:class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`): prompt (History / text / ids) -> left-padded ids
-> :func:`~lit_llm.policy.generation.generate_tokens` (KV cache, every eos id of the generation config stops a row,
sampled ids and their log-probs kept, per-row seeds from the input's :data:`SAMPLING_SEED_KEY`) -> the ``tokens``,
``masks``, ``log_probs``, ``text``, ``history`` and ``truncated`` outputs."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from lit_llm.data.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from lit_llm.policy.generation import GenerationOutput, generate_tokens, rows_to_device
from lit_llm.policy.inputs import check_id_dtype, history_rows
from lit_llm.policy.logprobs import base_causal_lm
from lit_llm.policy.rows import read_rows, read_strings
from lit_llm.policy.sampling import row_seed

__all__ = ["SAMPLING_SEED_KEY", "GenerateVersionMixin"]

#: Optional per-row input key of the generate version: the base seed of the row's own sampling generator.
SAMPLING_SEED_KEY = "sampling_seed"


class GenerateVersionMixin:
    """The generate version of :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`: :meth:`_generate`
    (its ``_forward_impl`` when ``generate=True``). The host class provides ``model``, ``tokenizer``, ``input_mode``,
    ``input_key``, ``chat_template``, ``generation_config``, ``num_samples``, ``return_log_probs``, ``device``, the
    output keys, ``_container`` (:class:`~lit_llm.policy.common.LLMWrapperBase`), ``_render_ids`` and
    ``_tokens_attention_key`` (:class:`~lit_llm.policy.inputs.LogProbInputsMixin`), ``_missing``,
    ``_check_not_padded_without_mask``, ``_encode`` and ``_decode``.
    """

    def _prompt_inputs(self, td: TensorDictBase) -> tuple[list[Tensor], list[str] | None, list | None,
                                                        list[Tensor] | None]:
        """Per-row prompt ids, prompt texts, prompt Histories and prompt assistant masks."""
        key = self.input_key
        if self.input_mode == "history":
            hist = td.get(key, None)
            if hist is None:
                raise self._missing(td, key, "prompt History [B, n_messages]")
            rows = history_rows(hist, key, type(self).__name__)
            texts = [h.apply_chat_template(self.tokenizer, chat_template=self.chat_template, tokenize=False,
                                           add_generation_prompt=True, return_dict=False) for h in rows]
            ids, masks = zip(*(self._render_ids(h, add_generation_prompt=True) for h in rows))
            return list(ids), texts, rows, list(masks)
        if self.input_mode == "text":
            texts = read_strings(td, key)
            if texts is None:
                raise self._missing(td, key, "prompt strings")
            return [self._encode(t) for t in texts], texts, None, None
        attn_key = self._tokens_attention_key(td)
        self._check_not_padded_without_mask(td, key, attn_key)
        ids = read_rows(td, key, attention_key=attn_key)
        if ids is None:
            raise self._missing(td, key, "prompt ids, 1-D per row")
        check_id_dtype(ids, key, type(self).__name__)
        return [r.long() for r in ids], None, None, None

    def _sampling_seeds(self, td: TensorDictBase, n: int) -> list[int] | None:
        """``B * n`` seeds (b-major) from the input's ``"sampling_seed"``: ``row_seed(sampling_seed[b], k)`` of one
        base per row (shape ``[B]``), or, with ``num_samples = n``, ``row_seed(sampling_seed[b, k], 0)`` of one base
        per sample (shape ``[B, n]``: a caller that seeds every sample itself, e.g. GRPO's rollout engine; the same
        stream as that seed given for a row of its own); ``None`` when the input has no such key.

        Raises:
            ValueError: the entry is not one integer per row (shape ``[B]``) or per sample (``[B, n]``), integer
                dtype.
        """
        if SAMPLING_SEED_KEY not in td.keys():
            return None
        value = td.get(SAMPLING_SEED_KEY)
        batch = td.batch_size[0]
        per_sample = self.num_samples is not None and isinstance(value, Tensor) and value.shape == (batch, n)
        if not isinstance(value, Tensor) or (value.shape != (batch,) and not per_sample) \
                or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            desc = (f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, Tensor)
                    else type(value).__name__)
            raise ValueError(
                f"{type(self).__name__}: {SAMPLING_SEED_KEY!r} must hold one integer seed per row (an int64 tensor of "
                f"shape [{batch}], or a 0-d int64 entry per row; with num_samples={n}, or one per sample: [{batch}, "
                f"{n}]), got {desc}. Store torch.tensor(seed) per row.")
        if per_sample:  # each given seed is the base of its own sample's stream, as a [B] seed is with n = 1
            return [row_seed(base, 0) for base in value.reshape(-1).tolist()]
        return [row_seed(base, k) for base in value.tolist() for k in range(n)]

    def _generate(self, td: TensorDictBase) -> tuple[dict, int | None]:
        prompts, texts, hists, prompt_am = self._prompt_inputs(td)
        n = self.num_samples or 1
        seeds = self._sampling_seeds(td, n)

        def rep(rows: list | None) -> list | None:
            return None if rows is None else [r for r in rows for _ in range(n)]

        dev = self.device
        gen = self._sample(prompts, seeds, n)  # the prompts as given (on the host: read there, copied once)
        prompts = rows_to_device(prompts, dev)  # each prompt once (its n samples share its prefill), in one copy
        prompts, texts, hists, prompt_am = rep(prompts), rep(texts), rep(hists), rep(prompt_am)
        resp, resp_lp = gen.response_ids, gen.response_log_probs
        full = [torch.cat([p, r]) for p, r in zip(prompts, resp)]
        group = self.num_samples
        pad = self.generation_config.pad_token_id
        tok_pads = {"prompt": (pad, "left"), "response": (pad, "right"), "full": (pad, "left")}
        res: dict[NestedKey, Any] = {}
        res[self.tokens_key] = self._container(Tokens, {"prompt": prompts, "response": resp, "full": full},
                                               group=group, pads=tok_pads)
        attn = [torch.ones(f.numel(), dtype=torch.bool, device=dev) for f in full]
        asst = None
        if prompt_am is not None:
            asst = [torch.cat([m.to(dev), torch.ones(r.numel(), dtype=torch.bool, device=dev)])
                    for m, r in zip(prompt_am, resp)]
        res[self.masks_key] = self._container(
            Masks, {"all_attention_mask": attn, "all_assistant_mask": asst}, group=group,
            pads={"all_attention_mask": (False, "left"), "all_assistant_mask": (False, "left")})
        if self.return_log_probs:
            lp_full = [torch.cat([torch.zeros(p.numel(), device=dev), lp]) for p, lp in zip(prompts, resp_lp)]
            res[self.log_probs_key] = self._container(
                LogProbs, {"response": resp_lp, "full": lp_full}, group=group,
                pads={"response": (0.0, "right"), "full": (0.0, "left")})
        truncated = gen.truncated.tolist()
        if texts is not None:
            resp_text = [self._decode(r) for r in resp]
            res[self.text_key] = self._container(
                Text, {"prompt": texts, "response": resp_text, "full": [p + r for p, r in zip(texts, resp_text)]},
                group=group)
        if hists is not None:
            res[self.history_key] = self._container(
                ChatHistory, self._histories(hists, resp, truncated), group=group)
        trunc = gen.truncated
        res["truncated"] = trunc if group is None else trunc.reshape(-1, group)
        return res, group

    def _sample(self, prompts: list[Tensor], seeds: list[int] | None, n: int) -> GenerationOutput:
        """The decoding itself (the backend's half of the generate version): ``n`` samples of each of the ``B``
        prompts (b-major, ``seeds`` one per sample or ``None``) by :func:`~lit_llm.policy.generation.generate_tokens`.
        """
        return generate_tokens(base_causal_lm(self.model), prompts, self.generation_config, device=self.device,
                               seeds=seeds, tokenizer=self.tokenizer, num_samples=n)

    def _histories(self, prompts: list, resp: list[Tensor], truncated: list[bool]) -> dict[str, list]:
        from lit_llm.data.history import History

        responses, fulls = [], []
        eos = set(self.generation_config.eos_token_ids)
        for h, r, cut in zip(prompts, resp, truncated):
            # an eos token's text is not content (its id stays); a stop string's token is (it completes the text)
            content = self._decode(r[:-1] if not cut and int(r[-1]) in eos else r)
            msg = History.from_chats([{"role": "assistant", "content": content, "is_complete": not cut}])
            responses.append(msg)
            fulls.append(h.extend(msg, inplace=False))
        return {"prompt": prompts, "response": responses, "full": fulls}
