"""``LLMWrapperBase``: the backend-independent half of TorchRL's LLM policy wrapper.

Re-made after ``torchrl/modules/llm/policies/common.py`` on tensordict only. A wrapper has two *versions* sharing
one model: ``generate=True`` (prompt -> response, with the sampled ids and their log-probs) and ``generate=False``
(full sequence -> teacher-forced log-probs and the masked distributions the losses use). This module holds what does
not depend on the backend: settings and keys, reading rows from a tensordict, assembling the output containers
(:mod:`lit_llm.data.containers`), in-place/new/empty outputs, ``num_samples`` grouping, ``get_new_version`` and the
``get_*_dist`` family with :meth:`LLMWrapperBase.head_mask`. Subclasses implement
:meth:`LLMWrapperBase._forward_impl`, :meth:`LLMWrapperBase._aligned_logits` and, for the distributions,
:meth:`LLMWrapperBase._dist_layout` / :meth:`LLMWrapperBase._dist_hidden_states` (the distributions are
:class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical` over hidden states: no ``[B, T, V]`` logits).

Layout of every ``[B, T]`` output (``pad_output=True``): ``prompt`` left-padded, ``response`` right-padded, ``full``
and the masks left-padded (so ``full`` is contiguous on the right, as generation sees it). ``pad_output=False``:
ragged per-row tensors in lazy stacks (``td.get(key, as_list=True)``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torch import Tensor

from lit_llm.policy.batching import BatchingMixin
from lit_llm.policy.generation import pad_rows

__all__ = ["COMPLETION_KEYS", "DistLayout", "HEADS", "INPUT_MODES", "LLMWrapperBase", "read_rows", "read_strings"]

INPUT_MODES = ("history", "text", "tokens")


def _key(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def read_rows(td: TensorDictBase, key: NestedKey, *, attention_key: NestedKey | None = None) -> list[Tensor] | None:
    """Read a per-row 1-D tensor entry of a ``[B]`` tensordict as ``B`` unpadded rows.

    A lazy stack (ragged rows) is returned row by row. A dense ``[B, T]`` tensor is unpadded with the attention
    mask found at ``attention_key`` (when present with the same shape), since padding can never be read from the ids
    (pad == eos for SmolLM2); without a mask every position is a real token.

    Args:
        td: a tensordict with ``batch_dims == 1``.
        key: the entry, e.g. ``("tokens", "full")``.
        attention_key: where a dense entry's attention mask lives, e.g. ``("masks", "all_attention_mask")``.

    Returns:
        ``B`` 1-D tensors, or ``None`` when the entry is absent.
    """
    rows = _rows_of(td, key)
    if rows is None or attention_key is None:
        return rows
    masks = _rows_of(td, attention_key)
    if masks is None or any(m.shape != r.shape for m, r in zip(masks, rows)):
        return rows
    return [r[m.bool()] for r, m in zip(rows, masks)]


def _rows_of(td: TensorDictBase, key: NestedKey) -> list[Tensor] | None:
    if not _present(td, key):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        value = td.get(key, None, as_list=True)
    if value is None:
        return None
    if isinstance(value, Tensor):
        return list(value.unbind(0))
    return [torch.as_tensor(v) for v in value]


def read_strings(td: TensorDictBase, key: NestedKey) -> list[str] | None:
    """Read a per-row ``str`` entry of a ``[B]`` tensordict as a list of ``B`` strings (``None`` when absent)."""
    if not _present(td, key):
        return None
    value = td.get(key, None)
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [str(v) for v in value]


def _present(td: TensorDictBase, key: NestedKey) -> bool:
    key = _key(key)
    try:
        return td.get(key, None) is not None
    except Exception:  # a ragged lazy stack cannot be stacked by a plain get, but it is there
        return True


def _stack_rows(items: list, group: int | None) -> Any:
    """Lazy-stack row containers; with ``group=n`` build ``[B, n]`` (b-major rows)."""
    if group is None:
        return lazy_stack(items)
    return lazy_stack([lazy_stack(items[i:i + group]) for i in range(0, len(items), group)])


class LLMWrapperBase(BatchingMixin, TensorDictModuleBase):
    """Base class of LLM policy wrappers (TorchRL's ``LLMWrapperBase`` names and semantics).

    Subclasses call :meth:`_init_common` from ``__init__`` and implement :meth:`_forward_impl` (the generate and
    log-prob versions), :meth:`_aligned_logits` (``[B, T, V]`` logits aligned to ``tokens.full``),
    :meth:`_dist_layout` (ids and masks of a distribution, no forward pass) and :meth:`_dist_hidden_states` (hidden
    states aligned to those ids, plus the LM head), and set ``temperature`` / ``chunk_size``.

    Input keys (``input_key`` overrides): ``generate=True`` reads ``(<mode key>, "prompt")``, ``generate=False``
    reads ``(<mode key>, "full")``, where the mode key is ``history_key``, ``text_key`` or ``tokens_key``.

    Attributes:
        model: the wrapped model (shared by every version from :meth:`get_new_version`).
        tokenizer: its tokenizer.
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``.
        input_key: the nested key read as input.
        generate: which version this is.
        pad_output: padded ``[B, T]`` outputs (``True``) or ragged lazy stacks (``False``).
        inplace: ``True`` (write into the input), ``False`` (a new tensordict with the input's entries and the
            outputs) or ``"empty"`` (a new tensordict with the outputs only).
        num_samples: responses per prompt (batch shape ``[B, num_samples]``) or ``None`` (batch shape ``[B]``).
    """

    def _init_common(self, *, model: Any, tokenizer: Any, input_mode: str, input_key: NestedKey | None,
                     generate: bool, pad_output: bool, inplace: bool | Literal["empty"] | None,
                     num_samples: int | None, return_log_probs: bool | None, history_key: NestedKey,
                     text_key: NestedKey, tokens_key: NestedKey, masks_key: NestedKey, log_probs_key: NestedKey,
                     batching: bool | None, min_batch_size: int | None, max_batch_size: int | None,
                     batching_timeout: float) -> None:
        if input_mode not in INPUT_MODES:
            raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {input_mode!r}.")
        if not isinstance(pad_output, bool):
            raise ValueError(f"pad_output must be a bool, got {pad_output!r}.")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 1):
            raise ValueError(f"num_samples must be a positive integer or None, got {num_samples!r}.")
        if not generate and num_samples is not None:
            raise ValueError("num_samples is only meaningful for generate=True; the log-prob version scores the "
                             "given sequences. Drop num_samples (get_new_version(generate=False, num_samples=None)).")
        self._user_inplace = inplace
        if inplace is None:
            inplace = num_samples is None
        if inplace not in (True, False, "empty"):
            raise ValueError(f"inplace must be True, False, 'empty' or None, got {inplace!r}.")
        if inplace is True and num_samples is not None:
            raise ValueError("inplace=True cannot hold num_samples responses per prompt (the batch shape becomes "
                             "[B, num_samples]); use inplace=False or 'empty'.")
        if return_log_probs is False and not generate:
            raise ValueError("return_log_probs=False contradicts generate=False: the log-prob version exists to "
                             "return log-probs. Leave return_log_probs=None.")
        if tokenizer is None and input_mode != "tokens":
            raise ValueError(f"tokenizer is required for input_mode={input_mode!r}; pass tokenizer=... .")
        self.model = model
        self.tokenizer = tokenizer
        self.input_mode = input_mode
        self.generate = bool(generate)
        self.pad_output = pad_output
        self.inplace = inplace
        self.num_samples = num_samples
        self.return_log_probs = True if return_log_probs is None else bool(return_log_probs)
        self.history_key, self.text_key, self.tokens_key = history_key, text_key, tokens_key
        self.masks_key, self.log_probs_key = masks_key, log_probs_key
        self._user_input_key = input_key
        mode_key = {"history": history_key, "text": text_key, "tokens": tokens_key}[input_mode]
        self.input_key = input_key if input_key is not None else (*_key(mode_key), "prompt" if generate else "full")
        self.in_keys = [self.input_key]
        out = [tokens_key, masks_key]
        if generate and input_mode in ("history", "text"):
            out.insert(0, text_key)
        if self.return_log_probs:
            out.append(log_probs_key)
        if generate and input_mode == "history":
            out.append(history_key)
        if generate:
            out.append("truncated")
        self.out_keys = out
        self._init_batching(batching, min_batch_size, max_batch_size, batching_timeout)

    # ------------------------------------------------------------------------------------------------ versions
    def _settings(self) -> dict[str, Any]:
        """Constructor kwargs that reproduce this wrapper (subclasses extend it)."""
        return dict(
            tokenizer=self.tokenizer, input_mode=self.input_mode, input_key=self._user_input_key,
            generate=self.generate, pad_output=self.pad_output, inplace=self._user_inplace,
            num_samples=self.num_samples,
            return_log_probs=None if self.return_log_probs else False, history_key=self.history_key,
            text_key=self.text_key, tokens_key=self.tokens_key, masks_key=self.masks_key,
            log_probs_key=self.log_probs_key,
        )

    def get_new_version(self, *, share_batching_state: bool = False, **overrides: Any) -> LLMWrapperBase:
        """A wrapper over the **same** model object with every setting carried over except ``overrides``.

        Typical use: ``policy.get_new_version(generate=False)`` gives the log-prob version of a generating policy.
        Rules: batching settings are carried over; a custom ``input_key`` ending in ``"prompt"``/``"full"`` has that
        suffix swapped when ``generate`` flips, and is reset to the default when ``input_mode`` changes (unless
        ``input_key`` is overridden too); settings are carried over as they were passed, so defaulted ones are
        derived again (``inplace=None`` against the new ``num_samples``; in :class:`TransformersWrapper` the log-prob
        ``temperature`` and ``num_samples`` from overridden ``generate_kwargs``); switching to
        ``generate=False`` drops ``num_samples`` and resets ``inplace`` and ``return_log_probs`` to their defaults
        unless overridden.

        Args:
            share_batching_state: the new version joins this wrapper's batching queue and worker thread (both must
                batch with the same settings), so generate and log-prob calls are served by one worker; by default
                the new version gets a fresh queue.
            **overrides: any constructor keyword argument (positional ``model`` is not accepted).

        Returns:
            A new wrapper of the same class.

        Raises:
            TypeError: ``model`` is passed (use the constructor for another model).
        """
        if "model" in overrides:
            raise TypeError("get_new_version keeps the same model; build a new wrapper for another model.")
        kwargs = {**self._settings(), **self._batching_settings()}
        gen = overrides.get("generate", self.generate)
        if "input_key" not in overrides:
            key = self._user_input_key
            if "input_mode" in overrides and overrides["input_mode"] != self.input_mode:
                key = None
            elif key is not None and gen != self.generate and _key(key)[-1] in ("prompt", "full"):
                key = (*_key(key)[:-1], "prompt" if gen else "full")
            kwargs["input_key"] = key
        if not gen and self.generate:
            kwargs["num_samples"] = None
            kwargs["inplace"] = None
            kwargs["return_log_probs"] = None
        kwargs.update(overrides)
        new = type(self)(self.model, **kwargs)
        if share_batching_state:
            new._adopt_batching_state(self)
        return new

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, tensordict: TensorDictBase, *, tensordict_out: TensorDictBase | None = None,
                logits_only: bool = False, batch_order: int | None = None, **kwargs: Any) -> TensorDictBase:
        """Run the version selected by ``generate`` on ``tensordict`` (batch shape ``[]``, ``[B]`` or, for the
        log-prob version, ``[B, n]``).

        Args:
            tensordict: the input (see the class docstring for the keys).
            tensordict_out: write the outputs into this tensordict instead (overrides ``inplace``).
            logits_only: log-prob version only: return a tensordict with ``"logits"`` (``[B, T, V]`` fp32,
                temperature-scaled, aligned to ``tokens.full`` left-padded: ``logits[:, t]`` scores ``x_t``; zeros at
                position 0 and padding), ``tokens.full`` and the masks, all left-padded. Besides ``dist.logits``,
                the one path that materialises full logits (TorchRL parity; :meth:`get_dist` does not use it).
            batch_order: with batching on, where this call's rows go in a shared batch (rows sort by
                ``(batch_order, arrival, row index)``, calls without one last); not a kwarg of the function, so rows
                with different orders share batches. See :mod:`lit_llm.policy.batching` for the recipe that makes a
                shared batch identical to one unbatched call. Ignored with batching off and by exclusive calls
                (``logits_only``, ``tensordict_out``).
            **kwargs: passed to :meth:`_forward_impl`.

        Returns:
            The output tensordict (see ``inplace``).

        Raises:
            ValueError: ``logits_only`` with ``generate=True``; missing input keys (named in the message).
        """
        if logits_only and self.generate:
            raise ValueError("logits_only=True needs the log-prob version; use get_new_version(generate=False).")
        if logits_only or tensordict_out is not None:
            # Never merged with other callers: logits would be padded to another caller's rows, and
            # tensordict_out belongs to this caller alone.
            return self._run_exclusive(tensordict, self._forward_dispatch, tensordict_out=tensordict_out,
                                       logits_only=logits_only, **kwargs)
        return self._run_maybe_batched(tensordict, self._forward_dispatch, batch_order=batch_order, **kwargs)

    def _forward_dispatch(self, td: TensorDictBase, *, tensordict_out: TensorDictBase | None = None,
                          logits_only: bool = False, **kwargs: Any) -> TensorDictBase:
        if td.batch_dims == 0:
            out = self._forward_dispatch(lazy_stack([td]), logits_only=logits_only, **kwargs)
            out = out[0]
            if tensordict_out is not None:
                tensordict_out.update(out)
                return tensordict_out
            if self.inplace is True and not logits_only:
                td.update(out)
                return td
            return out
        group = None
        flat = td
        if td.batch_dims == 2 and not self.generate:
            group = td.batch_size[1]
            flat = _flatten(td)
        elif td.batch_dims != 1:
            raise ValueError(f"{type(self).__name__}: input batch_size must be [], [B] (or [B, n] for the log-prob "
                             f"version), got {list(td.batch_size)}.")
        if logits_only:
            return self._aligned_logits(flat)
        results, out_group = self._forward_impl(flat, **kwargs)
        group = out_group or group
        if group is not None and not self.generate:
            results = {k: _regroup(v, group) for k, v in results.items()}
        return self._merge(td, results, tensordict_out, group if self.generate else None)

    def _merge(self, td: TensorDictBase, results: dict[NestedKey, Any], tensordict_out: TensorDictBase | None,
               group: int | None) -> TensorDictBase:
        if tensordict_out is not None:
            out = tensordict_out
        elif group is not None:  # [B] -> [B, n]
            batch = [td.batch_size[0], group]
            if self.inplace == "empty":
                out = TensorDict(batch_size=batch, device=td.device)
            else:
                out = lazy_stack([lazy_stack([r.copy() for _ in range(group)]) for r in td.unbind(0)])
        elif self.inplace is True:
            out = td
        elif self.inplace == "empty":
            out = TensorDict(batch_size=td.batch_size, device=td.device)
        else:
            out = td.copy()
        for key, value in results.items():
            out.set(key, value)
        return out

    def _forward_impl(self, td: TensorDictBase, **kwargs: Any) -> tuple[dict[NestedKey, Any], int | None]:
        """Compute the outputs for a ``[B]`` input.

        Returns:
            ``(results, group)``: ``results`` maps output keys to containers/tensors with batch ``[B]`` (or
            ``[B, group]`` for ``num_samples``), ``group`` is ``num_samples`` or ``None``.
        """
        raise NotImplementedError

    def _aligned_logits(self, td: TensorDictBase) -> TensorDictBase:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ containers
    def _container(self, cls: type, fields: dict[str, list | None], *, group: int | None = None,
                   pads: dict[str, tuple[Any, str]] | None = None) -> Any:
        """Build a container from per-row field lists, padded (``pads``: field -> (value, side)) or lazily stacked."""
        fields = {k: v for k, v in fields.items() if v is not None}
        n = len(next(iter(fields.values())))
        has_padded = "padded" in getattr(cls, "__annotations__", {}) or hasattr(cls, "padded")
        if self.pad_output and pads is not None:
            kw = {k: pad_rows(v, pads[k][0], side=pads[k][1]) for k, v in fields.items()}
            obj = cls(**kw, padded=True, batch_size=[n])
            return obj if group is None else obj.reshape(n // group, group)
        extra = {"padded": False} if has_padded and pads is not None else {}
        return _stack_rows([cls(**{k: v[i] for k, v in fields.items()}, **extra) for i in range(n)], group)

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
                 **kwargs: Any):
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
            **kwargs: ignored (TorchRL signature).

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
        layout = self._dist_layout(tensordict)
        if mask is not None:
            chosen = self._explicit_mask(layout, mask, "get_dist", "mask")
        elif mask_key is not None:
            chosen = self._mask_from_key(layout, mask_key, "get_dist")
        else:
            chosen = self._head_mask(layout, "generic", "get_dist")
        return self._make_dist(layout, chosen)

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

    def _head_dist(self, tensordict: TensorDictBase, head: str, name: str):
        self._check_dist_version(name)
        layout = self._dist_layout(tensordict)
        return self._make_dist(layout, self._head_mask(layout, head, name))

    def _get_dist_with_attention_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """Generic head: every attended token but each row's first (TorchRL name); see :meth:`head_mask`."""
        return self._head_dist(tensordict, "generic", "get_generic_dist")

    def _get_dist_with_assistant_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """RLHF head: the assistant tokens of every turn, ``masks.all_assistant_mask`` (TorchRL name); see
        :meth:`head_mask`.

        Raises:
            ValueError: no assistant mask (``input_mode`` is not ``"history"`` and the input carries none).
        """
        return self._head_dist(tensordict, "rlhf", "get_rlhf_dist")

    def _get_dist_with_prompt_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """SFT head: the response tokens only (after the prompt, stop token included; TorchRL name); see
        :meth:`head_mask` for how the prompt is found.

        Raises:
            PrefixMismatchError: the prompt ids are not a prefix of ``tokens.full`` (DESIGN.md property 2).
            ValueError: no way to know the prompt (no ``tokens.prompt``, no history, no assistant mask).
        """
        return self._head_dist(tensordict, "sft", "get_sft_dist")

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

    def _make_dist(self, layout: DistLayout, mask: Tensor):
        from lit_llm.policy.masked_dist import ChunkedLLMMaskedCategorical

        device_type = layout.tokens.device.type
        autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        # with batching on, the backbone runs on the worker thread (never beside a shared batch): carry the caller's
        # grad mode and autocast there, as both are thread-local
        hidden, weight, bias = self._run_exclusive(layout, self._dist_hidden_in_context, grad=torch.is_grad_enabled(),
                                                   autocast=autocast)
        tokens = layout.tokens
        if layout.single:
            hidden, mask, tokens = hidden[0], mask[0], tokens[0]
        dist = ChunkedLLMMaskedCategorical(hidden, weight, mask, bias=bias, temperature=self.temperature,
                                           chunk_size=self.chunk_size)
        dist.tokens = tokens
        return dist

    def _dist_hidden_in_context(self, layout: DistLayout, *, grad: bool, autocast: torch.dtype | None):
        device_type = layout.tokens.device.type
        amp = torch.autocast(device_type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with torch.set_grad_enabled(grad), amp:
            return self._dist_hidden_states(layout)

    def _scorable(self, layout: DistLayout) -> Tensor:
        """``[B, T]`` bool: the positions that have a prediction."""
        if layout.completion is not None:
            return layout.attention_mask
        attn = layout.attention_mask
        return attn & (attn.long().cumsum(-1) > 1)

    def _head_mask(self, layout: DistLayout, head: str, name: str) -> Tensor:
        if layout.completion is not None:
            return layout.completion["loss_mask"]
        scorable = self._scorable(layout)
        if head == "generic":
            return scorable
        asst = layout.assistant_mask
        if head == "rlhf":
            if asst is None:
                raise ValueError(f"{name}: no assistant mask at {(*_key(self.masks_key), 'all_assistant_mask')}; it "
                                 f"comes from input_mode='history' or from the generate version's output. Pass "
                                 f"masks.all_assistant_mask, or use the generic/sft head.")
            return asst & scorable
        attn = layout.attention_mask
        lens = self._prompt_lengths(layout.source, lambda: _real_rows(layout.tokens, attn))
        if lens is None:
            if asst is None:
                raise ValueError(
                    f"{name}: the prompt is unknown: pass {(*_key(self.tokens_key), 'prompt')} with the full ids, "
                    f"use input_mode='history' with {self.input_key!r}, or pass "
                    f"{(*_key(self.masks_key), 'all_assistant_mask')} (the last run of assistant tokens of each row "
                    f"is the response).")
            return _last_run(asst & attn) & scorable
        rank = attn.long().cumsum(-1) - 1  # index of each token inside its row's real tokens
        mask = scorable & (rank >= torch.as_tensor(lens, device=attn.device)[:, None])
        if asst is not None:  # end at the last assistant token (the stop token), not at a separator after it
            pos = torch.arange(attn.shape[-1], device=attn.device).expand_as(attn)
            last = torch.where(asst & mask, pos, torch.full_like(pos, -1)).amax(-1)
            mask &= (pos <= last[:, None]) | (last < 0)[:, None]
        return mask

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

    def _mask_from_key(self, layout: DistLayout, mask_key: NestedKey, name: str) -> Tensor:
        key = _key(mask_key)
        if layout.completion is None and key == (*_key(self.masks_key), "all_attention_mask"):
            return self._scorable(layout)
        if layout.completion is None and key == (*_key(self.masks_key), "all_assistant_mask"):
            if layout.assistant_mask is None:
                raise ValueError(f"{name}: mask_key {mask_key!r}: the input has no assistant mask (it comes from "
                                 f"input_mode='history' or the generate version's output).")
            return layout.assistant_mask & self._scorable(layout)
        value = _dense(layout.source, key)
        if value is None:
            raise ValueError(f"{name}: mask_key {mask_key!r} is not a dense mask of the input (keys: "
                             f"{sorted(map(str, layout.source.keys(True, True)))}); pass mask=... instead.")
        return self._explicit_mask(layout, value, name, f"the mask at {mask_key!r}")

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

    def log_prob(self, tensordict: TensorDictBase) -> Any:
        """Log-prob version only: run it and return ``log_probs.full`` (TorchRL's ``log_prob`` convenience)."""
        self._check_dist_version("log_prob")
        return self(tensordict).get((*_key(self.log_probs_key), "full"))


HEADS = ("sft", "rlhf", "generic")
"""Loss heads of :meth:`LLMWrapperBase.head_mask` (and ``get_sft_dist`` / ``get_rlhf_dist`` / ``get_generic_dist``)."""

COMPLETION_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "prompt_index")
"""Top-level keys of the GRPO prompt/completion layout of :meth:`LLMWrapperBase.get_dist` (plus optional
``loss_mask``)."""


@dataclass
class DistLayout:
    """Where a log-prob version's distribution lives; built from the input without any forward pass.

    Attributes:
        tokens: ``[B, T]`` integer ids the distribution's positions refer to (``dist.tokens``).
        attention_mask: ``[B, T]`` bool, real tokens (GRPO layout: ``completion_mask``).
        assistant_mask: ``[B, T]`` bool in the same layout, or ``None`` when unknown.
        source: the input (``[B]``-flattened for full sequences), for prompt lookups and ``mask_key``.
        single: the input had batch shape ``[]``: the dist is over ``[T]`` (row 0).
        completion: the GRPO layout's tensors (``COMPLETION_KEYS`` plus the effective ``loss_mask``), else ``None``.
    """

    tokens: Tensor
    attention_mask: Tensor
    assistant_mask: Tensor | None
    source: TensorDictBase
    single: bool = False
    completion: dict[str, Tensor] | None = None


def _last_run(mask: Tensor) -> Tensor:
    """``[B, T]`` bool: the last contiguous run of True of each row (all False for a row without any)."""
    pos = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    none = torch.full_like(pos, -1)
    last = torch.where(mask, pos, none).amax(-1, keepdim=True)
    start = torch.where(~mask & (pos < last), pos, none).amax(-1, keepdim=True) + 1
    return mask & (pos >= start) & (pos <= last)


def _real_rows(ids: Tensor, attention_mask: Tensor) -> list[Tensor]:
    """The unpadded rows of ``[B, T]`` ids (any padding side)."""
    return [row[m] for row, m in zip(ids.unbind(0), attention_mask.unbind(0))]


def _dense(td: TensorDictBase, key: NestedKey) -> Tensor | None:
    """``td[key]`` when it is one dense tensor (``None`` when absent, ragged or not a tensor)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            value = td.get(key, None)
    except Exception:  # a ragged lazy stack cannot be stacked
        return None
    return value if isinstance(value, Tensor) else None


def _flatten(td: TensorDictBase) -> TensorDictBase:
    """``[B, n]`` -> ``[B * n]`` lazy stack of rows (b-major)."""
    return lazy_stack([r for sub in td.unbind(0) for r in sub.unbind(0)])


def _regroup(value: Any, group: int) -> Any:
    """``[B * n]`` container/tensor -> ``[B, n]`` (row-major)."""
    if isinstance(value, Tensor):
        return value.reshape(-1, group, *value.shape[1:])
    rows = list(value.unbind(0))
    if getattr(value, "padded", None) is True:
        return value.reshape(-1, group)
    return _stack_rows(rows, group)

