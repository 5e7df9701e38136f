"""``LLMWrapperBase``: the backend-independent half of TorchRL's LLM policy wrapper.

Re-made after ``torchrl/modules/llm/policies/common.py`` on tensordict only. A wrapper has two *versions* sharing
one model: ``generate=True`` (prompt -> response, with the sampled ids and their log-probs) and ``generate=False``
(full sequence -> teacher-forced log-probs and the masked distributions the losses use). This module holds what does
not depend on the backend: settings and keys, assembling the output containers (:mod:`lit_llm.data.containers`),
in-place/new/empty outputs, ``num_samples`` grouping and ``get_new_version``. Reading rows from a tensordict lives in
:mod:`lit_llm.policy.rows`; the ``get_*_dist`` family with :meth:`LLMWrapperBase.head_mask` in
:class:`~lit_llm.policy.dists.MaskedDistributionsMixin`, which ``LLMWrapperBase`` inherits. Subclasses implement
:meth:`LLMWrapperBase._forward_impl`, :meth:`LLMWrapperBase._aligned_logits` and, for the distributions,
:meth:`LLMWrapperBase._dist_layout` / :meth:`LLMWrapperBase._dist_hidden_states` (the distributions are
:class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical` over hidden states: no ``[B, T, V]`` logits).

Layout of every ``[B, T]`` output (``pad_output=True``): ``prompt`` left-padded, ``response`` right-padded, ``full``
and the masks left-padded (so ``full`` is contiguous on the right, as generation sees it). ``pad_output=False``:
ragged per-row tensors in lazy stacks (``td.get(key, as_list=True)``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase
from torch import Tensor

from lit_llm.policy.batching import BatchingMixin, caller_context, in_context
from lit_llm.policy.dists import COMPLETION_KEYS, HEADS, DistLayout, MaskedDistributionsMixin
from lit_llm.policy.generation import pad_rows
from lit_llm.policy.rows import _key, read_rows, read_strings

__all__ = ["COMPLETION_KEYS", "DistLayout", "HEADS", "INPUT_MODES", "LLMWrapperBase", "read_rows", "read_strings"]

INPUT_MODES = ("history", "text", "tokens")


def _stack_rows(items: list, group: int | None) -> Any:
    """Lazy-stack row containers; with ``group=n`` build ``[B, n]`` (b-major rows)."""
    if group is None:
        return lazy_stack(items)
    return lazy_stack([lazy_stack(items[i:i + group]) for i in range(0, len(items), group)])


class LLMWrapperBase(MaskedDistributionsMixin, BatchingMixin, TensorDictModuleBase):
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
        return_text, return_tokens, return_masks, return_history: which containers the output carries (TorchRL's
            flags and defaults: ``text`` in history and text modes, ``history`` in history mode, ``tokens`` and
            ``masks`` always; both versions). ``return_log_probs`` likewise for ``log_probs``.
    """

    def _set_template_options(self, chat_template: str | None, chat_template_name: str | None,
                              tokenizer_kwargs: dict[str, Any] | None) -> None:
        """Keep the constructor's template options: ``chat_template`` (Jinja text) or ``chat_template_name`` (a
        registered name, resolved where templates are rendered, :meth:`History.apply_chat_template`, with TorchRL's
        aliases), and ``tokenizer_kwargs`` (``add_special_tokens=False`` unless given).

        Raises:
            ValueError: both ``chat_template`` and ``chat_template_name`` given.
        """
        if chat_template is not None and chat_template_name is not None:
            raise ValueError(f"pass chat_template or chat_template_name, not both (got chat_template_name="
                             f"{chat_template_name!r}).")
        self.chat_template_name = chat_template_name
        self.chat_template = chat_template if chat_template_name is None else chat_template_name
        self.tokenizer_kwargs = {"add_special_tokens": False, **(tokenizer_kwargs or {})}

    def _init_common(self, *, model: Any, tokenizer: Any, input_mode: str, input_key: NestedKey | None,
                     generate: bool, pad_output: bool, inplace: bool | Literal["empty"] | None,
                     num_samples: int | None, return_log_probs: bool | None, history_key: NestedKey,
                     text_key: NestedKey, tokens_key: NestedKey, masks_key: NestedKey, log_probs_key: NestedKey,
                     batching: bool | None, min_batch_size: int | None, max_batch_size: int | None,
                     batching_timeout: float, return_text: bool | None = None, return_masks: bool | None = None,
                     return_tokens: bool | None = None, return_history: bool | None = None) -> None:
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
        self._user_returns = {"return_text": return_text, "return_masks": return_masks,
                              "return_tokens": return_tokens, "return_history": return_history}
        for name, value in self._user_returns.items():
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool or None, got {value!r}.")
        if return_history and input_mode != "history":
            raise ValueError(f"return_history=True needs input_mode='history' (got {input_mode!r}): there is no "
                             f"History to return. Leave return_history=None.")
        if return_text and input_mode == "tokens":
            raise ValueError("return_text=True needs input_mode 'history' or 'text': the tokens mode has no text "
                             "(decode with Tokens.to_text). Leave return_text=None.")
        # TorchRL's rule: history in history mode, text in history/text modes, tokens and masks always
        self.return_history = input_mode == "history" if return_history is None else return_history
        self.return_text = input_mode in ("history", "text") if return_text is None else return_text
        self.return_tokens = True if return_tokens is None else return_tokens
        self.return_masks = True if return_masks is None else return_masks
        self.history_key, self.text_key, self.tokens_key = history_key, text_key, tokens_key
        self.masks_key, self.log_probs_key = masks_key, log_probs_key
        self._user_input_key = input_key
        mode_key = {"history": history_key, "text": text_key, "tokens": tokens_key}[input_mode]
        self.input_key = input_key if input_key is not None else (*_key(mode_key), "prompt" if generate else "full")
        self.in_keys = [self.input_key]
        # TorchRL's order (text, masks, tokens, log_probs, history), then lit_llm's "truncated" flag
        out = [k for k, on in ((text_key, self.return_text), (masks_key, self.return_masks),
                                (tokens_key, self.return_tokens), (log_probs_key, self.return_log_probs),
                                (history_key, self.return_history)) if on]
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
            log_probs_key=self.log_probs_key, **self._user_returns,
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
        # grad mode and autocast are thread-local: the batcher's worker runs the call under the caller's (calls under
        # different ones never share a batch, as this is one of the function's keyword arguments)
        context = caller_context(self.device.type)
        if logits_only or tensordict_out is not None:
            # Never merged with other callers: logits would be padded to another caller's rows, and
            # tensordict_out belongs to this caller alone.
            return self._run_exclusive(tensordict, self._forward_in_context, tensordict_out=tensordict_out,
                                       logits_only=logits_only, context=context, **kwargs)
        return self._run_maybe_batched(tensordict, self._forward_in_context, batch_order=batch_order,
                                       context=context, **kwargs)

    def _forward_in_context(self, td: TensorDictBase, *, context: tuple[bool, torch.dtype | None],
                            **kwargs: Any) -> TensorDictBase:
        with in_context(context, self.device.type), self._model_context():
            return self._forward_dispatch(td, **kwargs)

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
        flags = ((self.text_key, self.return_text), (self.tokens_key, self.return_tokens),
                 (self.masks_key, self.return_masks), (self.history_key, self.return_history))
        skip = {k for k, on in flags if not on}
        for key, value in results.items():
            if key not in skip:
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

    def log_prob(self, tensordict: TensorDictBase, **get_kwargs: Any) -> Any:
        """Log-prob version only: run it and return the response log-probs (TorchRL's ``log_prob`` convenience).

        Args:
            tensordict: the log-prob version's input.
            **get_kwargs: passed to ``TensorDict.get`` as TorchRL does: ``as_list`` (a list of 1-D tensors),
                ``as_padded_tensor`` (a ``[B, T]`` tensor), ``padding_side`` (``"left"`` / ``"right"``),
                ``padding_value``, ``as_nested_tensor``, ``layout``. Without them, ragged rows (the default
                ``pad_output=False``) come back as ``as_list=True`` would give them rather than failing to stack.

        Returns:
            ``("log_probs", "response")`` when the output has a prompt/response split (the input carries
            ``tokens.prompt``, a prefix of the scored ids); otherwise (no split known, e.g. ``tokens.full`` /
            ``text.full`` / ``history.full`` only) ``("log_probs", "full")`` -- lit_llm's documented fallback, where
            TorchRL's would be empty.
        """
        self._check_dist_version("log_prob")
        allowed = {"as_list", "as_padded_tensor", "as_nested_tensor", "padding_side", "padding_value", "layout"}
        unknown = sorted(set(get_kwargs) - allowed)
        if unknown:
            raise TypeError(f"{type(self).__name__}.log_prob: unexpected keyword arguments {unknown}; accepted "
                            f"(passed to TensorDict.get): {sorted(allowed)}.")
        out = self(tensordict)
        base = _key(self.log_probs_key)
        key = (*base, "response")
        if key not in out.keys(include_nested=True):  # checked by name: reading would stack ragged rows
            key = (*base, "full")
        if not any(get_kwargs.get(k) for k in ("as_list", "as_padded_tensor", "as_nested_tensor")):
            try:
                return out.get(key)
            except RuntimeError:  # ragged rows cannot be stacked: the rows, as TorchRL's lazy stacks give them
                return out.get(key, as_list=True)
        return out.get(key, **get_kwargs)


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

