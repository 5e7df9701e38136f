"""``LLMWrapperBase``: the backend-independent half of TorchRL's LLM policy wrapper.

Re-made after ``torchrl/modules/llm/policies/common.py`` on tensordict only. A wrapper has two *versions* sharing
one model: ``generate=True`` (prompt -> response, with the sampled ids and their log-probs) and ``generate=False``
(full sequence -> teacher-forced log-probs and the masked distributions the losses use). This module holds what does
not depend on the backend: settings and keys, reading rows from a tensordict, assembling the output containers
(:mod:`lit_llm.data.containers`), in-place/new/empty outputs, ``num_samples`` grouping, ``get_new_version`` and the
``get_*_dist`` family. Subclasses implement :meth:`LLMWrapperBase._forward_impl` and
:meth:`LLMWrapperBase._aligned_logits`.

Layout of every ``[B, T]`` output (``pad_output=True``): ``prompt`` left-padded, ``response`` right-padded, ``full``
and the masks left-padded (so ``full`` is contiguous on the right, as generation sees it). ``pad_output=False``:
ragged per-row tensors in lazy stacks (``td.get(key, as_list=True)``).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torch import Tensor

from lit_llm.policy.batching import BatchingMixin
from lit_llm.policy.generation import pad_rows

__all__ = ["INPUT_MODES", "LLMWrapperBase", "read_rows", "read_strings"]

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
    log-prob versions) and :meth:`_aligned_logits` (``[B, T, V]`` logits aligned to ``tokens.full``).

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
                logits_only: bool = False, **kwargs: Any) -> TensorDictBase:
        """Run the version selected by ``generate`` on ``tensordict`` (batch shape ``[]``, ``[B]`` or, for the
        log-prob version, ``[B, n]``).

        Args:
            tensordict: the input (see the class docstring for the keys).
            tensordict_out: write the outputs into this tensordict instead (overrides ``inplace``).
            logits_only: log-prob version only: return a tensordict with ``"logits"`` (``[B, T, V]`` fp32,
                temperature-scaled, aligned to ``tokens.full`` left-padded: ``logits[:, t]`` scores ``x_t``; zeros at
                position 0 and padding), ``tokens.full`` and the masks, all left-padded. The one path that
                materialises full logits (for :meth:`get_dist`).
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
        return self._run_maybe_batched(tensordict, self._forward_dispatch, **kwargs)

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
    def _check_dist_version(self, name: str) -> None:
        if self.generate:
            raise NotImplementedError(f"{name} needs the log-prob version (generate=False); use "
                                      f"get_new_version(generate=False).")

    def get_dist(self, tensordict: TensorDictBase, *, mask: Tensor | None = None, mask_key: NestedKey | None = None,
                 **kwargs: Any):
        """Distribution over ``tokens.full``: :class:`~lit_llm.distributions.LLMMaskedCategorical`.

        Logits come from ``forward(tensordict, logits_only=True)``: ``[B, T, V]`` fp32, left-padded and aligned to
        ``tokens.full`` (``logits[:, t]`` = the temperature-scaled logits predicting ``x_t``), so
        ``dist.log_prob(tokens_full)[:, t] = log p(x_t | x_<t)`` on masked-in positions and 0 elsewhere, matching
        ``log_probs.full``. The default mask is the attention mask without each row's first token (which has no
        prediction).

        Args:
            tensordict: the log-prob version's input (see the class docstring).
            mask: an explicit ``[B, T]`` bool mask aligned to the left-padded ``tokens.full`` (wins over
                ``mask_key``).
            mask_key: a key of the logits-only output, e.g. ``("masks", "all_assistant_mask")``.

        Returns:
            ``LLMMaskedCategorical(logits, mask)``; the left-padded ``tokens.full`` is its ``.tokens`` attribute.

        Raises:
            NotImplementedError: called on the generate version.
            ValueError: ``mask`` has the wrong shape; ``mask_key`` is absent.
        """
        self._check_dist_version("get_dist")
        out = self(tensordict.copy(), logits_only=True)
        attn = out.get((*_key(self.masks_key), "all_attention_mask"))
        if mask is None:
            if mask_key is None:
                mask = attn & (attn.long().cumsum(-1) > 1)
            else:
                mask = out.get(mask_key, None)
                if mask is None:
                    raise ValueError(f"get_dist: mask_key {mask_key!r} is not in the logits-only output (keys: "
                                     f"{list(out.keys(True, True))}).")
        return self._make_dist(out, mask, "get_dist")

    def _make_dist(self, out: TensorDictBase, mask: Tensor, name: str):
        from lit_llm.distributions import LLMMaskedCategorical

        logits = out.get("logits")
        if mask.shape != logits.shape[:-1]:
            raise ValueError(f"{name}: mask shape {list(mask.shape)} does not match tokens.full (left-padded) "
                             f"{list(logits.shape[:-1])}.")
        dist = LLMMaskedCategorical(logits=logits, mask=mask.bool())
        dist.tokens = out.get((*_key(self.tokens_key), "full"))
        return dist

    def _get_dist_with_attention_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """Generic head: every attended token but each row's first (TorchRL name)."""
        self._check_dist_version("get_generic_dist")
        return self.get_dist(tensordict)

    def _get_dist_with_assistant_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """RLHF head: the assistant tokens of every turn, ``masks.all_assistant_mask`` (TorchRL name).

        Raises:
            ValueError: no assistant mask (``input_mode`` is not ``"history"`` and the input carries none).
        """
        self._check_dist_version("get_rlhf_dist")
        out = self(tensordict.copy(), logits_only=True)
        mask = out.get((*_key(self.masks_key), "all_assistant_mask"), None)
        if mask is None:
            raise ValueError(f"get_rlhf_dist: no assistant mask at {(*_key(self.masks_key), 'all_assistant_mask')}; "
                             f"it comes from input_mode='history' or from the generate version's output.")
        attn = out.get((*_key(self.masks_key), "all_attention_mask"))
        return self._make_dist(out, mask & attn & (attn.long().cumsum(-1) > 1), "get_rlhf_dist")

    def _get_dist_with_prompt_mask(self, tensordict: TensorDictBase, **kwargs: Any):
        """SFT head: the response tokens only (everything after the prompt, stop token included; TorchRL name).

        The prompt length of each row comes from ``tokens.prompt`` in the input (checked to be a prefix of
        ``tokens.full``), or in history mode from rendering ``history.full`` minus its last message with the
        generation prompt. When an assistant mask is known (history mode), the response ends at the last assistant
        token of the row, so a separator the template renders after the stop token (ChatML's ``"\\n"``) is out
        (DESIGN.md property 5), as in the datasets' ``response_mask``.

        Raises:
            PrefixMismatchError: the prompt ids are not a prefix of ``tokens.full`` (DESIGN.md property 2).
            ValueError: no way to know the prompt (no ``tokens.prompt`` outside history mode).
        """
        self._check_dist_version("get_sft_dist")
        out = self(tensordict.copy(), logits_only=True)
        attn = out.get((*_key(self.masks_key), "all_attention_mask"))
        full = out.get((*_key(self.tokens_key), "full"))
        full_rows = [row[m] for row, m in zip(full.unbind(0), attn.unbind(0))]
        flat = _flatten(tensordict) if tensordict.batch_dims == 2 else tensordict
        if flat.batch_dims == 0:
            flat = lazy_stack([flat])
        prompt_lens = self._prompt_lengths(flat, full_rows)
        lengths = attn.long().sum(-1)
        width = attn.shape[-1]
        pos = torch.arange(width, device=attn.device).expand_as(attn)
        start = (width - lengths) + torch.as_tensor(prompt_lens, device=attn.device)
        mask = attn & (pos >= start[:, None])
        asst = out.get((*_key(self.masks_key), "all_assistant_mask"), None)
        if asst is not None:  # end at the last assistant token (the stop token), not at a separator after it
            last = torch.where(asst & mask, pos, torch.full_like(pos, -1)).amax(-1)
            mask &= (pos <= last[:, None]) | (last < 0)[:, None]
        return self._make_dist(out, mask, "get_sft_dist")

    def _prompt_lengths(self, td: TensorDictBase, full_rows: list[Tensor]) -> list[int]:
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

    def log_prob(self, tensordict: TensorDictBase) -> Any:
        """Log-prob version only: run it and return ``log_probs.full`` (TorchRL's ``log_prob`` convenience)."""
        self._check_dist_version("log_prob")
        return self(tensordict).get((*_key(self.log_probs_key), "full"))


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

