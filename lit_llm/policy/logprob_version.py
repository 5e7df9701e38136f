"""The log-prob version's forward pass (:class:`LogProbVersionMixin`, inherited by
:class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`): full sequence ->
:func:`~lit_llm.policy.logprobs.model_token_log_probs` (chunked LM head, never ``[B, T, V]`` logits) ->
``log_probs.full`` (split into prompt / response where the split is known); the backbone's hidden states of its
masked distributions and the aligned ``[B, T, V]`` logits of ``logits_only``.

In history mode the text output is ``text.full`` only (``prompt`` / ``response`` ``None``, as TorchRL returns it);
``tokens``, ``log_probs`` and ``history`` are also split at the conversation's last assistant turn (TorchRL leaves
their ``prompt`` / ``response`` ``None``), so :meth:`~lit_llm.policy.common.LLMWrapperBase.log_prob` gives that
turn's log-probs."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torch import Tensor

from lit_llm.data.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from lit_llm.policy.dist_layout import DistLayout
from lit_llm.policy.generation import pad_rows
from lit_llm.policy.inputs import history_rows
from lit_llm.policy.logprobs import completion_hidden_states, lm_head, model_token_log_probs, token_hidden_states

__all__ = ["LogProbVersionMixin"]


class LogProbVersionMixin:
    """The log-prob version of :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`: :meth:`_log_probs`
    (its ``_forward_impl`` when ``generate=False``), :meth:`_dist_hidden_states` and :meth:`_aligned_logits`. The host
    class provides ``model``, ``tokenizer``, ``input_mode``, ``input_key``, ``temperature``, ``chunk_size``,
    ``share_prompts``, ``generation_config``, ``return_text``, ``return_history``, ``device``, the output keys,
    ``_container`` (:class:`~lit_llm.policy.common.LLMWrapperBase`), ``_full_inputs`` and ``_padded_full``
    (:class:`~lit_llm.policy.inputs.LogProbInputsMixin`).
    """

    def _log_probs(self, td: TensorDictBase) -> tuple[dict, None]:
        full, asst, prompt_lens = self._full_inputs(td)
        if prompt_lens is None and asst is not None and self.input_mode == "history":
            prompt_lens = _last_assistant_starts(asst)
        lp_rows = self._full_log_probs(full)
        full = [f.to(self.device) for f in full]
        pad = self.generation_config.pad_token_id
        tok = {"full": full, "prompt": None, "response": None}
        lps = {"full": lp_rows, "prompt": None, "response": None}
        if prompt_lens is not None:
            tok["prompt"] = [f[:p] for f, p in zip(full, prompt_lens)]
            tok["response"] = [f[p:] for f, p in zip(full, prompt_lens)]
            lps["prompt"] = [x[:p] for x, p in zip(lp_rows, prompt_lens)]
            lps["response"] = [x[p:] for x, p in zip(lp_rows, prompt_lens)]
        res: dict[NestedKey, Any] = {
            self.tokens_key: self._container(
                Tokens, tok, pads={"prompt": (pad, "left"), "response": (pad, "right"), "full": (pad, "left")}),
            self.masks_key: self._container(
                Masks, {"all_attention_mask": [torch.ones_like(f, dtype=torch.bool) for f in full],
                        "all_assistant_mask": None if asst is None else [a.to(self.device) for a in asst]},
                pads={"all_attention_mask": (False, "left"), "all_assistant_mask": (False, "left")}),
            self.log_probs_key: self._container(
                LogProbs, lps, pads={"prompt": (0.0, "left"), "response": (0.0, "right"), "full": (0.0, "left")}),
        }
        if self.return_text:
            dec = self.tokenizer.decode
            text = {"full": [dec(f.tolist(), skip_special_tokens=False) for f in full], "prompt": None,
                    "response": None}
            # history mode: text.full only, as TorchRL (the split lives in tokens / log_probs / history)
            if tok["prompt"] is not None and self.input_mode != "history":
                text["prompt"] = [dec(p.tolist(), skip_special_tokens=False) for p in tok["prompt"]]
                text["response"] = [f[len(p):] if f.startswith(p) else dec(r.tolist(), skip_special_tokens=False)
                                    for f, p, r in zip(text["full"], text["prompt"], tok["response"])]
            res[self.text_key] = self._container(Text, text)
        if self.return_history:
            hist = td.get(self.input_key, None)
            if hist is not None:
                res[self.history_key] = self._container(
                    ChatHistory, _split_histories(history_rows(hist, self.input_key, type(self).__name__)))
        return res, None

    def _full_log_probs(self, full: list[Tensor]) -> list[Tensor]:
        """The scoring itself (the backend's half of the log-prob version): per row, ``log_probs.full`` of the ids
        ``full[b]`` (``[T_b]`` fp32, 0.0 at position 0), by :func:`~lit_llm.policy.logprobs.model_token_log_probs`."""
        ids, attn = self._padded_full(full)
        lp = model_token_log_probs(self.model, ids, attn, temperature=self.temperature, chunk_size=self.chunk_size)
        return [row[m] for row, m in zip(lp.unbind(0), attn.unbind(0))]

    # ---------------------------------------------------------------------------------------------- distributions
    def _dist_hidden_states(self, layout: DistLayout) -> tuple[Tensor, Tensor, Tensor | None]:
        c = layout.completion
        if c is not None:
            hidden = completion_hidden_states(self.model, c["prompt_ids"], c["prompt_mask"], c["completion_ids"],
                                              c["completion_mask"], c["prompt_index"], share_prompts=self.share_prompts)
        else:
            hidden = token_hidden_states(self.model, layout.tokens, layout.attention_mask,
                                         position_ids=layout.position_ids)
        weight, bias = lm_head(self.model)  # after the backbone: a sharded model's head is gathered by then
        return hidden, weight, bias

    def _aligned_logits(self, td: TensorDictBase) -> TensorDictBase:
        full, asst, _ = self._full_inputs(td)
        ids, attn = self._padded_full(full)
        position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=attn.long(), position_ids=position_ids).logits.float()
        logits = logits / self.temperature
        aligned = torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)
        scored = attn & (attn.long().cumsum(-1) > 1)
        aligned = aligned * scored.unsqueeze(-1)
        batch = [len(full)]
        masks = Masks(all_attention_mask=attn, padded=True, batch_size=batch,
                      all_assistant_mask=None if asst is None else pad_rows(
                          [a.to(self.device) for a in asst], False, side="left"))
        return TensorDict({"logits": aligned, self.tokens_key: Tokens(full=ids, padded=True, batch_size=batch),
                           self.masks_key: masks}, batch_size=batch)


def _last_assistant_starts(asst: list[Tensor]) -> list[int] | None:
    """Per row, where the last run of the assistant mask starts (the response of a scored conversation, as TorchRL
    splits it); ``None`` when a row has no assistant token (no split is known)."""
    out = []
    for m in asst:
        m = m.bool()
        if not bool(m.any()):
            return None
        last = int(m.nonzero()[-1])
        before = (~m[:last + 1]).nonzero()
        out.append(int(before[-1]) + 1 if before.numel() else 0)
    return out


def _split_histories(rows: list) -> dict[str, list]:
    """``history.full`` rows with ``prompt`` / ``response`` split at the last assistant message (all rows must have
    one, else only ``full``)."""
    out: dict[str, list | None] = {"full": rows, "prompt": None, "response": None}
    lasts = []
    for h in rows:
        roles = [r for r in h.role if r != "<none>"]
        last = max((i for i, r in enumerate(roles) if r == "assistant"), default=None)
        if not last:  # no assistant message, or nothing before it
            return out
        lasts.append((last, len(roles)))
    out["prompt"] = [h[:last] for h, (last, _) in zip(rows, lasts)]
    out["response"] = [h[last:n] for h, (last, n) in zip(rows, lasts)]
    return out

