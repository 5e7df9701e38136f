"""Masked next-token distributions of the log-prob version: ``get_dist``, the ``get_*_dist`` heads, ``head_mask``.

:class:`MaskedDistributionsMixin` is the distribution half of :class:`~lit_llm.policy.common.LLMWrapperBase`, which
inherits it (TorchRL's names, including the ``_get_dist_with_*`` aliases). The input's :class:`DistLayout` (ids and
masks, no forward pass) gives a ``[B, T]`` mask (a loss head, an explicit mask or a mask key), then one backbone pass
gives :class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical` over hidden states (no ``[B, T, V]`` logits).
:meth:`MaskedDistributionsMixin.head_mask` gives a head's mask without a forward pass, so training code counts a
step's denominator before any backward (DESIGN.md property 6); the SFT head's prompt is a prefix of the full ids or
an error (property 2) and its response ends at the stop token (properties 3 and 5). The layout and its mask
arithmetic live in :mod:`lit_llm.policy.dist_layout` (:class:`DistLayout` and :data:`COMPLETION_KEYS` re-exported).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from lit_llm.policy.batching import caller_context, in_context
from lit_llm.policy.dist_layout import COMPLETION_KEYS, DistLayout, _last_run, _repad_index, _sequence_ids
from lit_llm.policy.heads import HEADS, head_positions, scorable_positions
from lit_llm.policy.rows import _dense, _key, _real_rows

__all__ = ["COMPLETION_KEYS", "DistLayout", "HEADS", "MaskedDistributionsMixin"]


class MaskedDistributionsMixin:
    """The ``get_dist`` family of :class:`~lit_llm.policy.common.LLMWrapperBase` (see the module docstring).

    Subclasses implement :meth:`_dist_layout`, :meth:`_dist_hidden_states` and :meth:`_prompt_lengths`. The host
    class provides ``generate``, ``input_key``, ``tokens_key``, ``masks_key`` (set by ``LLMWrapperBase._init_common``)
    and ``_run_exclusive`` (:class:`~lit_llm.policy.batching.BatchingMixin`).
    """

    # ------------------------------------------------------------------------------------------------ dists
    # Every get_*_dist and head_mask goes: _dist_layout (ids, masks; no forward pass) -> a [B, T] mask ->
    # _make_dist (one backbone pass in _dist_hidden_states, then ChunkedLLMMaskedCategorical).
    temperature: float = 1.0
    chunk_size: int = 1024

    def _check_dist_version(self, name: str) -> None:
        if self.generate:
            raise NotImplementedError(f"{name} needs the log-prob version (generate=False); use "
                                      f"get_new_version(generate=False).")

    def get_dist(self, tensordict: TensorDictBase, *, mask: Tensor | None = None, mask_key: NestedKey | None = None,
                 tensordict_out: TensorDictBase | None = None, logits_key: NestedKey = "logits",
                 as_padded_tensor: bool | None = None, as_nested_tensor: bool | None = None,
                 padding_value: float | None = None, padding_side: str | None = None,
                 layout: torch.layout | None = None):
        """Masked next-token distribution of the log-prob version, computed from hidden states (no ``[B, T, V]``).

        Returns a :class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical` built from one backbone pass
        (:func:`~lit_llm.policy.logprobs.token_hidden_states`; with autograd when grad is enabled in the caller, at
        the wrapper's ``temperature`` and ``chunk_size``), so ``dist.log_prob(dist.tokens)[:, t] = log p(x_t | x_<t)``
        on masked-in positions (= ``log_probs.full``) and 0.0 elsewhere; ``log_prob``/``entropy``/
        ``log_prob_and_entropy`` run the chunked LM head on the masked-in positions only. ``dist.logits`` (and
        ``forward(td, logits_only=True)``) are the only paths that materialise full logits.

        Layouts (``dist.tokens`` is the ``[B, T]`` ids the positions refer to):

        * **dense**: the input holds a dense ``tokens.full [B, T]`` (in ``"tokens"`` mode: the ``input_key``) and a
          dense ``masks.all_attention_mask [B, T]`` (bool or 0/1, one contiguous block per row): they are used as
          they are, left- or right-padded, and ``dist.tokens`` is that tensor (on the wrapper's device);
        * **ragged / history / text** inputs: the rows are left-padded, as ``log_probs.full`` with ``pad_output=True``;
        * **packed**, detected by the top-level key ``"position_ids"`` (``[B, T]``, restarting at 0 for each of the
          several sequences of a row, :mod:`lit_llm.data.packing`): dense ids and masks as given; the sequences never
          attend to each other (:func:`~lit_llm.policy.logprobs.token_hidden_states`), each sequence's first token
          has no prediction, and the sft head's response is each sequence's last run of assistant tokens
          (``tokens.prompt`` and history inputs are refused);
        * **prompt/completion (GRPO)**, detected by the top-level key ``"completion_ids"``: the input holds
          ``prompt_ids [P, Lp]`` (left-padded), ``prompt_mask [P, Lp]``, ``completion_ids [N, Lc]`` (right-padded),
          ``completion_mask [N, Lc]``, ``prompt_index [N]`` and optionally ``loss_mask [N, Lc]`` (default
          ``completion_mask``). The dist is over ``[N, Lc]`` (``dist.tokens = completion_ids``, default mask
          ``loss_mask & completion_mask``) and its hidden states come from
          :func:`~lit_llm.policy.logprobs.completion_hidden_states` with the wrapper's ``share_prompts``. Prompt
          tokens are never scored in this layout.

        An input of batch shape ``[]`` gives a dist over ``[T]``; ``[B, n]`` is flattened to ``[B * n, T]``.

        Args:
            tensordict: the log-prob version's input (see the class docstring and the layouts above).
            mask: an explicit ``[B, T]`` bool mask in the layout above (``[T]`` for a ``[]`` input; ``[N, Lc]`` for
                the GRPO layout). Wins over ``mask_key``.
            mask_key: ``(masks_key, "all_attention_mask")`` or ``(masks_key, "all_assistant_mask")`` (the layout's
                own masks), or a key of the input holding a dense mask of the layout's shape (e.g. ``"loss_mask"``).
            padding_side: ``"left"`` or ``"right"``: re-pad the returned dist's rows (hidden states, mask,
                ``dist.tokens``) to that side; ``None`` (default) keeps the layout's. ``mask`` and ``mask_key`` are
                always read in the input's layout (above), before re-padding.
            tensordict_out, logits_key, as_padded_tensor, as_nested_tensor, padding_value, layout: TorchRL's
                arguments. Accepted only with a value that matches what this dist is (``None``; ``logits_key=
                "logits"``; ``as_padded_tensor=True``; ``as_nested_tensor=False``; ``padding_value=0.0``;
                ``layout=torch.strided``); any other value raises ``ValueError("... not supported: <why>")``.
                Any other keyword is a ``TypeError``.

        Every mask is intersected with the positions that have a prediction: each row's first real token and
        padding are never scored (their hidden states are zeros); in the GRPO layout, with ``completion_mask``.
        Default mask: every real token but each row's first (the generic head), or ``loss_mask`` (GRPO layout).

        Returns:
            ``ChunkedLLMMaskedCategorical`` with ``.tokens`` set (long ``[B, T]``).

        Raises:
            NotImplementedError: called on the generate version.
            ValueError: ``mask`` has the wrong shape or dtype; ``mask_key`` is absent or not of the layout's shape;
                missing GRPO keys; see also the log-prob version's input errors.
        """
        self._check_dist_version("get_dist")
        side = _check_dist_args("get_dist", tensordict_out=tensordict_out, logits_key=logits_key,
                                as_padded_tensor=as_padded_tensor, as_nested_tensor=as_nested_tensor,
                                padding_value=padding_value, padding_side=padding_side, layout=layout)
        dist_layout = self._dist_layout(tensordict)
        if mask is not None:
            chosen = self._explicit_mask(dist_layout, mask, "get_dist", "mask")
        elif mask_key is not None:
            chosen = self._mask_from_key(dist_layout, mask_key, "get_dist")
        else:
            chosen = self._head_mask(dist_layout, "generic", "get_dist")
        return self._make_dist(dist_layout, chosen, side)

    def head_mask(self, tensordict: TensorDictBase, head: Literal["sft", "rlhf", "generic"]) -> Tensor:
        """The ``[B, T]`` bool mask that ``get_<head>_dist(tensordict)`` uses, **without any forward pass**.

        Training code counts its step denominator from it (DESIGN.md property 6) before any backward. Positions are
        those of :meth:`get_dist`'s layout (dense input as given, ragged input left-padded, ``[N, Lc]`` for the GRPO
        layout, ``[T]`` for a ``[]`` input). Heads:

        * ``"generic"``: every attended token except each row's first (it has no prediction);
        * ``"rlhf"``: ``masks.all_assistant_mask & attended & not first`` (every assistant turn);
        * ``"sft"``: the response of the last turn: the tokens after the prompt, where the prompt is (1)
          ``tokens.prompt`` when the input has it (checked to be a prefix of ``tokens.full``, DESIGN.md property 2),
          else (2) in history mode the render of ``history.full`` minus its last message with the generation prompt,
          else (3) when only an assistant mask is known, the response is the **last contiguous run of assistant
          tokens** of each row (by DESIGN.md property 3 exactly the final turn's tokens after its generation prompt
          through its stop token). With an assistant mask the response ends at the row's last assistant token, so a
          separator the template renders after the stop token (ChatML's ``"\\n"``) is out (property 5).
        * GRPO layout: every head gives ``loss_mask & completion_mask``.

        A row with no trainable token gives an all-False row.

        Args:
            tensordict: the log-prob version's input.
            head: ``"sft"``, ``"rlhf"`` or ``"generic"``.

        Returns:
            ``[B, T]`` torch.bool on the wrapper's device, equal to ``get_<head>_dist(tensordict).mask``.

        Raises:
            NotImplementedError: called on the generate version.
            ValueError: unknown ``head``; ``"rlhf"`` without an assistant mask; ``"sft"`` with no way to find the
                prompt (no ``tokens.prompt``, no history, no assistant mask); a conversation not ending with an
                assistant message (history mode).
            PrefixMismatchError: the prompt ids are not a prefix of ``tokens.full`` (DESIGN.md property 2).
        """
        self._check_dist_version("head_mask")
        if head not in HEADS:
            raise ValueError(f"head_mask: unknown head {head!r}; choose one of {HEADS}.")
        layout = self._dist_layout(tensordict)
        out = self._head_mask(layout, head, f"head_mask({head!r})")
        return out[0] if layout.single else out

    def _head_dist(self, tensordict: TensorDictBase, head: str, name: str, *, padding_side: str | None = None,
                   keys: dict[str, tuple[NestedKey | None, NestedKey]] | None = None, head_mask: Tensor | None = None,
                   **kwargs: Any):
        """One head's dist. ``keys``: ``arg name -> (given key, default key)``; a non-default key replaces the
        layout's mask of that kind (see :meth:`_get_dist_with_prompt_mask`). ``head_mask`` (lit_llm's extension of
        every ``get_<head>_dist``): the mask :meth:`head_mask` returned for this same input and head, so a caller
        that counted its step from it (a training module) does not have it computed twice; ``None``: computed here.

        Raises:
            ValueError: ``head_mask`` together with a mask key (the head's own mask is then not the one asked for),
                or of the wrong shape.
        """
        self._check_dist_version(name)
        side = _check_dist_args(name, padding_side=padding_side, **kwargs)
        layout = self._dist_layout(tensordict)
        keys = {arg: (key, default) for arg, (key, default) in (keys or {}).items()
                if key is not None and _key(key) != _key(default)}
        if head_mask is not None:
            if keys:
                raise ValueError(f"{name}: head_mask (the head's own mask, head_mask(td, {head!r})) cannot be combined "
                                 f"with {sorted(keys)}; drop one.")
            return self._make_dist(layout, self._explicit_mask(layout, head_mask, name, "head_mask"), side)
        restrict = None
        if "attention_mask_key" in keys:  # positions also restricted to the mask at that key
            restrict = self._mask_from_key(layout, keys["attention_mask_key"][0], name, "attention_mask_key")
        if "assistant_mask_key" in keys:
            if head == "rlhf":
                mask = self._mask_from_key(layout, keys["assistant_mask_key"][0], name, "assistant_mask_key")
                return self._make_dist(layout, mask if restrict is None else mask & restrict, side)
            asst = self._dense_key(layout, keys["assistant_mask_key"][0], name, "assistant_mask_key")
            layout = replace(layout, assistant_mask=asst)
        if "prompt_mask_key" in keys:
            prompt = self._dense_key(layout, keys["prompt_mask_key"][0], name, "prompt_mask_key")
            mask = self._scorable(layout) & ~prompt
        else:
            mask = self._head_mask(layout, head, name)
        return self._make_dist(layout, mask if restrict is None else mask & restrict, side)

    def _default_mask_key(self, name: str) -> tuple[str, ...]:
        return (*_key(self.masks_key), name)

    def _get_dist_with_attention_mask(self, tensordict: TensorDictBase, attention_mask_key: NestedKey | None = None,
                                      logits_key: NestedKey = "logits", padding_side: str | None = None,
                                      **kwargs: Any):
        """Generic head: every attended token but each row's first (TorchRL name); see :meth:`head_mask`.

        Args:
            attention_mask_key: default ``(masks_key, "all_attention_mask")`` (the layout's); another key of the
                input holding a dense ``[B, T]`` mask in :meth:`get_dist`'s layout restricts the positions to it
                (``ValueError`` naming it when absent or of the wrong shape).
            logits_key, padding_side, **kwargs: as in :meth:`get_dist` (``tensordict_out``, ``as_padded_tensor``,
                ``as_nested_tensor``, ``padding_value``, ``layout``); any other keyword is a ``TypeError``.
        """
        return self._head_dist(tensordict, "generic", "get_generic_dist", padding_side=padding_side,
                               logits_key=logits_key, keys={"attention_mask_key": (
                                   attention_mask_key, self._default_mask_key("all_attention_mask"))}, **kwargs)

    def _get_dist_with_assistant_mask(self, tensordict: TensorDictBase, assistant_mask_key: NestedKey | None = None,
                                      logits_key: NestedKey = "logits", padding_side: str | None = None,
                                      **kwargs: Any):
        """RLHF head: the assistant tokens of every turn, ``masks.all_assistant_mask`` (TorchRL name); see
        :meth:`head_mask`.

        Args:
            assistant_mask_key: default ``(masks_key, "all_assistant_mask")``; another key of the input holding a
                dense ``[B, T]`` mask in :meth:`get_dist`'s layout is used instead (``ValueError`` naming it when
                absent or of the wrong shape).
            logits_key, padding_side, **kwargs: as in :meth:`_get_dist_with_attention_mask`.

        Raises:
            ValueError: no assistant mask (``input_mode`` is not ``"history"`` and the input carries none).
        """
        return self._head_dist(tensordict, "rlhf", "get_rlhf_dist", padding_side=padding_side,
                               logits_key=logits_key, keys={"assistant_mask_key": (
                                   assistant_mask_key, self._default_mask_key("all_assistant_mask"))}, **kwargs)

    def _get_dist_with_prompt_mask(self, tensordict: TensorDictBase, tokens_key: NestedKey | None = None,
                                   logits_key: NestedKey = "logits", assistant_mask_key: NestedKey | None = None,
                                   attention_mask_key: NestedKey | None = None, padding_side: str | None = None,
                                   *, prompt_mask_key: NestedKey | None = None, **kwargs: Any):
        """SFT head: the response tokens only (after the prompt, stop token included; TorchRL name); see
        :meth:`head_mask` for how the prompt is found.

        Args:
            tokens_key: only the default ``(tokens_key, "prompt")`` of the wrapper (``ValueError`` otherwise: the
                prompt ids are read there; set the wrapper's ``tokens_key`` or pass ``prompt_mask_key``).
            assistant_mask_key: a key of the input holding a dense ``[B, T]`` assistant mask in :meth:`get_dist`'s
                layout, used in place of ``masks.all_assistant_mask`` to find (and end) the response.
            attention_mask_key: a key of a dense ``[B, T]`` mask that restricts the positions.
            prompt_mask_key: a key of a dense ``[B, T]`` mask of the prompt tokens: the response is every scorable
                token outside it (instead of the head's own prompt lookup).
            logits_key, padding_side, **kwargs: as in :meth:`_get_dist_with_attention_mask`.

        Raises:
            PrefixMismatchError: the prompt ids are not a prefix of ``tokens.full`` (DESIGN.md property 2).
            ValueError: no way to know the prompt (no ``tokens.prompt``, no history, no assistant mask); a mask key
                that is absent or of the wrong shape; an argument value that is not supported.
        """
        name = "get_sft_dist"
        default_tokens = (*_key(self.tokens_key), "prompt")
        if tokens_key is not None and _key(tokens_key) != default_tokens:
            raise ValueError(f"{name}: tokens_key={tokens_key!r} not supported: the prompt ids are read from "
                             f"{default_tokens!r} (the wrapper's tokens_key); set the wrapper's tokens_key, or pass "
                             f"prompt_mask_key=<key of a [B, T] prompt mask>.")
        return self._head_dist(tensordict, "sft", name, padding_side=padding_side, logits_key=logits_key, keys={
            "assistant_mask_key": (assistant_mask_key, self._default_mask_key("all_assistant_mask")),
            "attention_mask_key": (attention_mask_key, self._default_mask_key("all_attention_mask")),
            "prompt_mask_key": (prompt_mask_key, ("\0",))}, **kwargs)

    def _get_dist_with_custom_mask(self, tensordict: TensorDictBase, mask: Tensor, logits_key: NestedKey = "logits",
                                   padding_side: str | None = None, **kwargs: Any):
        """Distribution with an explicit ``[B, T]`` mask (TorchRL name): ``get_dist(tensordict, mask=mask, ...)``."""
        return self.get_dist(tensordict, mask=mask, logits_key=logits_key, padding_side=padding_side, **kwargs)

    def _prompt_lengths(self, td: TensorDictBase, full_rows: Callable[[], list[Tensor]]) -> list[int] | None:
        """Per-row prompt lengths of the unpadded full ids (``full_rows()``, only called when needed), or ``None``
        when the input does not tell."""
        raise NotImplementedError

    def get_sft_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Prompt-masked distribution (response tokens only); see :meth:`_get_dist_with_prompt_mask`."""
        return self._get_dist_with_prompt_mask(tensordict, **kwargs)

    def get_rlhf_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Assistant-masked distribution; see :meth:`_get_dist_with_assistant_mask`."""
        return self._get_dist_with_assistant_mask(tensordict, **kwargs)

    def get_generic_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Attention-masked distribution; see :meth:`_get_dist_with_attention_mask`."""
        return self._get_dist_with_attention_mask(tensordict, **kwargs)

    _get_sft_dist = get_sft_dist
    _get_rlhf_dist = get_rlhf_dist
    _get_generic_dist = get_generic_dist

    # --- dist internals -----------------------------------------------------------------------------------------
    def _dist_layout(self, tensordict: TensorDictBase) -> DistLayout:
        """The :class:`DistLayout` of a log-prob input (subclasses; no forward pass)."""
        raise NotImplementedError

    def _dist_hidden_states(self, layout: DistLayout) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(hidden [B, T, H] aligned to layout.tokens, head weight [V, H], head bias [V] or None)`` (subclasses)."""
        raise NotImplementedError

    def _make_dist(self, layout: DistLayout, mask: Tensor, side: str | None = None):
        from lit_llm.policy.masked_dist import ChunkedLLMMaskedCategorical

        # with batching on, the backbone runs on the worker thread (never beside a shared batch): carry the caller's
        # grad mode and autocast there, as both are thread-local
        hidden, weight, bias = self._run_exclusive(layout, self._dist_hidden_in_context,
                                                   context=caller_context(layout.tokens.device.type))
        tokens = layout.tokens
        if side is not None:  # re-pad each row's block of real tokens to that side
            index = _repad_index(layout.attention_mask, side)
            hidden = hidden.gather(1, index[..., None].expand_as(hidden))
            mask, tokens = mask.gather(1, index), tokens.gather(1, index)
        if layout.single:
            hidden, mask, tokens = hidden[0], mask[0], tokens[0]
        dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias, temperature=self.temperature,
                                           chunk_size=self.chunk_size, matmul_dtype=getattr(self, "matmul_dtype", None))
        dist.tokens = tokens
        return dist

    def _dist_hidden_in_context(self, layout: DistLayout, *, context: tuple[bool, torch.dtype | None]):
        with in_context(context, layout.tokens.device.type), self._model_context():
            return self._dist_hidden_states(layout)

    def _model_context(self) -> AbstractContextManager:
        """The context every model call of this wrapper runs in (subclasses: e.g. peft adapters disabled)."""
        return nullcontext()

    def _scorable(self, layout: DistLayout) -> Tensor:
        """``[B, T]`` bool: the positions that have a prediction (:func:`~lit_llm.policy.heads.scorable_positions`;
        every completion token in the GRPO layout)."""
        if layout.completion is not None:
            return layout.attention_mask
        return scorable_positions(layout.attention_mask, layout.position_ids)

    def _head_mask(self, layout: DistLayout, head: str, name: str) -> Tensor:
        if layout.completion is not None:
            return layout.completion["loss_mask"]
        scorable = self._scorable(layout)
        asst = layout.assistant_mask
        if head == "rlhf":
            if asst is None:
                raise ValueError(f"{name}: no assistant mask at {(*_key(self.masks_key), 'all_assistant_mask')}; it "
                                 f"comes from input_mode='history' or from the generate version's output. Pass "
                                 f"masks.all_assistant_mask, or use the generic/sft head.")
        if head != "sft":
            return head_positions(head, scorable, assistant_mask=asst)
        attn = layout.attention_mask
        if layout.position_ids is not None:  # packed: the response is each sequence's last run of assistant tokens
            if asst is None:
                raise ValueError(f"{name}: packed rows (input key 'position_ids') need "
                                 f"{(*_key(self.masks_key), 'all_assistant_mask')} for the sft head: each packed "
                                 f"sequence's response is its last run of assistant tokens.")
            return head_positions("sft", scorable,
                                  response_mask=_last_run(asst & attn, _sequence_ids(layout.position_ids, attn)))
        lens = self._prompt_lengths(layout.source, lambda: _real_rows(layout.tokens, attn))
        if lens is None:
            if asst is None:
                raise ValueError(
                    f"{name}: the prompt is unknown: pass {(*_key(self.tokens_key), 'prompt')} with the full ids, "
                    f"use input_mode='history' with {(*_key(self.history_key), 'full')!r}, or pass "
                    f"{(*_key(self.masks_key), 'all_assistant_mask')} (the last run of assistant tokens of each row "
                    f"is the response).")
            return head_positions("sft", scorable, response_mask=_last_run(asst & attn))
        rank = attn.long().cumsum(-1) - 1  # index of each token inside its row's real tokens
        mask = scorable & (rank >= torch.as_tensor(lens, device=attn.device)[:, None])
        if asst is not None:  # end at the last assistant token (the stop token), not at a separator after it
            pos = torch.arange(attn.shape[-1], device=attn.device).expand_as(attn)
            last = torch.where(asst & mask, pos, torch.full_like(pos, -1)).amax(-1)
            mask &= (pos <= last[:, None]) | (last < 0)[:, None]
        return head_positions("sft", scorable, response_mask=mask)

    def _explicit_mask(self, layout: DistLayout, mask: Any, name: str, what: str) -> Tensor:
        shape = tuple(layout.tokens.shape)
        if isinstance(mask, Tensor) and layout.single and tuple(mask.shape) == shape[1:]:
            mask = mask.unsqueeze(0)
        if not isinstance(mask, Tensor) or mask.dtype.is_floating_point or tuple(mask.shape) != shape:
            got = f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
            want = list(shape[1:]) if layout.single else list(shape)
            raise ValueError(f"{name}: {what} must be a bool (or 0/1 integer) tensor of shape {want} aligned with "
                             f"dist.tokens (see get_dist for the layout); got {got}.")
        return mask.to(layout.tokens.device).bool() & self._scorable(layout)

    def _dense_key(self, layout: DistLayout, key: NestedKey, name: str, arg: str) -> Tensor:
        """The dense ``[B, T]`` bool mask at ``key`` of the input (not intersected with anything)."""
        value = _dense(layout.source, _key(key))
        if value is None:
            raise ValueError(f"{name}: {arg}={key!r} is not a dense mask of the input (keys: "
                             f"{sorted(map(str, layout.source.keys(True, True)))}).")
        shape = tuple(layout.tokens.shape)
        if layout.single and tuple(value.shape) == shape[1:]:
            value = value.unsqueeze(0)
        if value.dtype.is_floating_point or tuple(value.shape) != shape:
            raise ValueError(f"{name}: {arg}={key!r} must hold a bool (or 0/1 integer) tensor of shape "
                             f"{list(shape)} aligned with dist.tokens; got {value.dtype} {list(value.shape)}.")
        return value.to(layout.tokens.device).bool()

    def _mask_from_key(self, layout: DistLayout, mask_key: NestedKey, name: str, arg: str = "mask_key") -> Tensor:
        key = _key(mask_key)
        if layout.completion is None and key == (*_key(self.masks_key), "all_attention_mask"):
            return self._scorable(layout)
        if layout.completion is None and key == (*_key(self.masks_key), "all_assistant_mask"):
            if layout.assistant_mask is None:
                raise ValueError(f"{name}: {arg} {mask_key!r}: the input has no assistant mask (it comes from "
                                 f"input_mode='history' or the generate version's output).")
            return layout.assistant_mask & self._scorable(layout)
        value = _dense(layout.source, key)
        if value is None:
            raise ValueError(f"{name}: {arg} {mask_key!r} is not a dense mask of the input (keys: "
                             f"{sorted(map(str, layout.source.keys(True, True)))}); pass mask=... instead.")
        return self._explicit_mask(layout, value, name, f"the mask at {arg} {mask_key!r}")

    def _completion_layout(self, td: TensorDictBase, device: torch.device | None) -> DistLayout:
        """The GRPO prompt/completion layout (see :meth:`get_dist`); full checks run with the backbone pass."""
        missing = [k for k in COMPLETION_KEYS if k not in td.keys()]
        if missing:
            raise ValueError(f"get_dist: the prompt/completion layout (detected by the top-level key "
                             f"'completion_ids') needs the keys {list(COMPLETION_KEYS)}; missing {missing}. Provide "
                             f"them, or drop 'completion_ids' to score full sequences.")
        c = {k: td.get(k) for k in COMPLETION_KEYS}
        if not all(isinstance(v, Tensor) for v in c.values()):
            raise ValueError(f"get_dist: the prompt/completion keys {list(COMPLETION_KEYS)} must hold tensors.")
        c = {k: v.to(device) for k, v in c.items()}
        ids, cmask = c["completion_ids"], c["completion_mask"]
        if ids.dim() != 2 or cmask.shape != ids.shape or cmask.dtype.is_floating_point:
            raise ValueError(f"get_dist: completion_ids and completion_mask must be [N, Lc] (ids long, mask bool or "
                             f"0/1); got {list(ids.shape)} {ids.dtype} and {list(cmask.shape)} {cmask.dtype}.")
        cmask = c["completion_mask"] = cmask.bool()
        layout = DistLayout(tokens=ids, attention_mask=cmask, assistant_mask=None, source=td, completion=c)
        loss = td.get("loss_mask", None)
        c["loss_mask"] = cmask if loss is None else self._explicit_mask(layout, loss, "get_dist", "loss_mask")
        return layout


def _check_dist_args(name: str, *, padding_side: str | None = None, tensordict_out: TensorDictBase | None = None,
                     logits_key: NestedKey = "logits", as_padded_tensor: bool | None = None,
                     as_nested_tensor: bool | None = None, padding_value: float | None = None,
                     layout: torch.layout | None = None) -> str | None:
    """Reject TorchRL ``get_dist`` arguments this dist cannot honour (ValueError naming each and why); return the
    ``padding_side`` to re-pad to (``None``: the layout's). Unknown keywords are a TypeError (Python's)."""
    def refuse(arg: str, value: Any, why: str) -> None:
        raise ValueError(f"{name}: {arg}={value!r} not supported: {why}.")

    if padding_side is not None and padding_side not in ("left", "right"):
        refuse("padding_side", padding_side, "choose 'left' or 'right' (None keeps the input's layout)")
    if tensordict_out is not None:
        refuse("tensordict_out", type(tensordict_out).__name__,
               "get_dist returns a distribution and writes nothing to a tensordict")
    if _key(logits_key) != ("logits",):
        refuse("logits_key", logits_key, "this dist is computed from hidden states and never materialises logits, "
               "so there is no logits entry to read; use dist.logits (or forward(td, logits_only=True)) for them")
    if as_padded_tensor is not None and not as_padded_tensor:
        refuse("as_padded_tensor", as_padded_tensor, "masked distributions are padded [B, T]")
    if as_nested_tensor:
        refuse("as_nested_tensor", as_nested_tensor, "masked distributions are padded [B, T], not nested")
    if padding_value is not None and float(padding_value) != 0.0:
        refuse("padding_value", padding_value, "padded logits are never materialised; masked-out and padded "
               "positions give log_prob 0.0")
    if layout is not None and layout != torch.strided:
        refuse("layout", layout, "masked distributions are dense (torch.strided)")
    return padding_side
