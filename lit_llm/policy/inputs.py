"""Reading the log-prob version's inputs: full ids, assistant masks, prompt lengths and the distribution layout.

:class:`LogProbInputsMixin` is mixed into :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`; no
forward pass happens here. ``tokens.full`` in the input is scored as it is, never re-tokenised (DESIGN.md property 1);
prompt ids are checked to be a prefix of the full ids (property 2); history-mode assistant masks come from the chat
template's render (property 3); ids a model cannot score fail loudly, naming the row (property 7).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase, lazy_stack
from torch import Tensor

from lit_llm.data.containers import template_display_name
from lit_llm.data.errors import check_prefix
from lit_llm.policy.common import _flatten
from lit_llm.policy.deferred import check_value, deferring
from lit_llm.policy.dist_layout import DistLayout
from lit_llm.policy.generation import check_token_ids, pad_rows
from lit_llm.policy.logprobs import check_packed_positions
from lit_llm.policy.rows import _dense, _present, _real_rows, read_rows, read_strings

__all__ = ["LogProbInputsMixin"]


class LogProbInputsMixin:
    """How :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper` reads a log-prob version's input.

    Implements :meth:`_prompt_lengths` and :meth:`_dist_layout` of
    :class:`~lit_llm.policy.dists.MaskedDistributionsMixin` (list it before ``LLMWrapperBase`` in the bases). The host
    class provides ``model``, ``tokenizer``, ``chat_template``, ``input_mode``, ``input_key``, ``tokens_key``,
    ``masks_key``, ``attention_mask_key``, ``device``, ``generation_config``, ``_k``, ``_missing``, ``_encode``,
    ``_tokens_padded``,
    ``_check_not_padded_without_mask`` and ``_completion_layout``. :meth:`_render_ids` also renders the generate
    version's history prompts.
    """

    def _tokens_attention_key(self, td: TensorDictBase) -> NestedKey:
        """Where the attention mask of the input ids is read: ``masks.all_attention_mask``, else (tokens mode, TorchRL's
        fallback) ``attention_mask_key`` when the input has it."""
        masks_key = self._k(self.masks_key, "all_attention_mask")
        if self.input_mode != "tokens" or _present(td, masks_key):
            return masks_key
        other = getattr(self, "attention_mask_key", None)
        return other if other is not None and _present(td, other) else masks_key

    # ---------------------------------------------------------------------------------------------- log-probs
    def _full_inputs(self, td: TensorDictBase) -> tuple[list[Tensor], list[Tensor] | None, list[int] | None]:
        """Per-row full ids, assistant masks (history mode) and prompt lengths (when the input has ``tokens.prompt``).

        ``tokens.full`` in the input wins in every mode (never re-tokenised; in tokens mode the ids are read at
        ``input_key``, ``tokens.full`` by default); a dense ``[B, T]`` one is unpadded with
        ``masks.all_attention_mask``, which ``tokens.padded=True`` requires.

        Raises:
            ValueError: the input key is missing; padded ids without their attention mask.
        """
        attn_key = self._tokens_attention_key(td)
        ids_key = self.input_key if self.input_mode == "tokens" else self._k(self.tokens_key, "full")
        self._check_not_padded_without_mask(td, ids_key, attn_key)
        full = read_rows(td, ids_key, attention_key=attn_key)
        asst = None
        if full is None:
            if self.input_mode == "history":
                rendered = self._render_full(td)
                full = [r[0] for r in rendered]
                asst = [r[1] for r in rendered]
            elif self.input_mode == "text":
                texts = read_strings(td, self.input_key)
                if texts is None:
                    raise self._missing(td, self.input_key, "full strings, or tokens.full")
                full = [self._encode(t) for t in texts]
            else:
                raise self._missing(td, self.input_key, "full ids, 1-D per row")
        check_id_dtype(full, ids_key, type(self).__name__)
        full = [f.long() for f in full]
        prompt_lens = self._input_prompt_lengths(td, full)
        if self.input_mode == "history" and asst is None:
            asst = self._assistant_for_ids(td, full, prompt_lens)
        return full, asst, prompt_lens

    def _render_full(self, td: TensorDictBase, key: NestedKey | None = None) -> list[tuple[Tensor, Tensor]]:
        key = key or self.input_key
        hist = td.get(key, None)
        if hist is None:
            raise self._missing(td, key, "full History [B, n_messages], or tokens.full")
        return [self._render_ids(h, add_generation_prompt=False)
                for h in history_rows(hist, key, type(self).__name__)]

    def _render_ids(self, history: Any, *, add_generation_prompt: bool) -> tuple[Tensor, Tensor]:
        """One conversation's ids ``[T]`` (long) and assistant mask ``[T]`` (bool; all False without assistant)."""
        has_assistant = "assistant" in list(history.role)
        enc = history.apply_chat_template(self.tokenizer, chat_template=self.chat_template,
                                          add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=has_assistant)
        ids = enc["input_ids"].long()
        mask = enc["assistant_masks"].bool() if has_assistant else torch.zeros(ids.numel(), dtype=torch.bool)
        return ids, mask

    def _assistant_for_ids(self, td: TensorDictBase, full: list[Tensor],
                           prompt_lens: list[int] | None) -> list[Tensor]:
        """Assistant masks aligned to given ``tokens.full`` ids (history mode).

        Order: (1) ``masks.all_assistant_mask`` of the input when its rows match the ids' lengths (the generate
        version writes it); (2) the render of ``history.full`` when its ids start with the given ids and the rest
        holds no assistant token (e.g. ChatML's trailing ``"\\n"``); (3) the response positions after
        ``tokens.prompt``.

        Raises:
            ValueError: none of these applies (the message names the keys to provide).
        """
        given = read_rows(td, self._k(self.masks_key, "all_assistant_mask"),
                          attention_key=self._k(self.masks_key, "all_attention_mask"))
        if given is not None and all(g.numel() == f.numel() for g, f in zip(given, full)):
            return [g.bool().to(f.device) for g, f in zip(given, full)]
        out: list[Tensor] = []
        rendered = self._render_full(td) if td.get(self.input_key, None) is not None else None
        for b, f in enumerate(full):
            if rendered is not None:
                ids, mask = rendered[b]
                n = f.numel()
                if ids.numel() >= n and torch.equal(ids[:n].to(f.device), f) and not bool(mask[n:].any()):
                    out.append(mask[:n].to(f.device))
                    continue
            if prompt_lens is not None:
                m = torch.zeros(f.numel(), dtype=torch.bool, device=f.device)
                m[prompt_lens[b]:] = True
                out.append(m)
                continue
            raise ValueError(
                f"{type(self).__name__}: row {b}: cannot align an assistant mask with the given tokens.full (its ids "
                f"differ from the render of {self.input_key!r}). Pass masks.all_assistant_mask or tokens.prompt "
                f"with tokens.full (the generate version's output has both)."
            )
        return out

    def _input_prompt_lengths(self, td: TensorDictBase, full: list[Tensor]) -> list[int] | None:
        """Prompt lengths from ``tokens.prompt`` (checked to be a prefix of each full row), or ``None``."""
        key = self._k(self.tokens_key, "prompt")
        try:
            dense_padded = isinstance(td.get(key, None), Tensor) and self._tokens_padded(td)
        except Exception:  # a ragged lazy stack cannot be stacked: unpadded rows
            dense_padded = False
        rows = read_rows(td, key)
        if rows is None:
            return None
        out = []
        for b, (p, f) in enumerate(zip(rows, full)):
            p = p.to(f.device)
            if dense_padded:
                out.append(_unpad_left_prefix(p, f, b))
                continue
            check_prefix(p, f, template_name=f"tokens.prompt vs tokens.full (row {b})")
            out.append(p.numel())
        return out

    def _prompt_lengths(self, td: TensorDictBase, full_rows: Callable[[], list[Tensor]]) -> list[int] | None:
        """Prompt lengths from ``tokens.prompt``, else (history mode) from rendering ``history.full`` minus its last
        message with the generation prompt; ``None`` when neither is in the input (``full_rows`` is then not called).

        Raises:
            ValueError: a conversation that does not end with an assistant message.
            PrefixMismatchError: the prompt ids are not a prefix of the full ids (DESIGN.md property 2).
        """
        has_history = self.input_mode == "history" and td.get(self.input_key, None) is not None
        if not has_history and not _present(td, self._k(self.tokens_key, "prompt")):
            return None
        full_rows = full_rows()
        lens = self._input_prompt_lengths(td, full_rows)
        if lens is not None or not has_history:
            return lens
        lens = []
        rows = history_rows(td.get(self.input_key), self.input_key, type(self).__name__)
        for b, (h, f) in enumerate(zip(rows, full_rows)):
            roles = list(h.role)
            last = max(i for i, r in enumerate(roles) if r != "<none>")
            if roles[last] != "assistant":
                raise ValueError(f"get_sft_dist: row {b} of {self.input_key!r} ends with a {roles[last]!r} message; "
                                 f"the SFT head trains on the final assistant reply. End every conversation with an "
                                 f"assistant message, or use get_rlhf_dist (every assistant turn).")
            p = h[:last].apply_chat_template(self.tokenizer, chat_template=self.chat_template,
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
            name = template_display_name(self.chat_template)
            check_prefix(p.to(f.device), f, template_name=f"{name} (row {b})")
            lens.append(p.numel())
        return lens

    def _padded_full(self, full: list[Tensor]) -> tuple[Tensor, Tensor]:
        check_token_ids(self.model, full, what=f"{type(self).__name__} (log-prob version): tokens.full")
        dev = self.device
        ids = pad_rows([f.to(dev) for f in full], self.generation_config.pad_token_id, side="left")
        attn = pad_rows([torch.ones(f.numel(), dtype=torch.bool, device=dev) for f in full], False, side="left")
        return ids, attn

    # ---------------------------------------------------------------------------------------------- distributions
    def _dist_layout(self, tensordict: TensorDictBase) -> DistLayout:
        """Ids and masks of :meth:`get_dist`'s layout (dense as given, ragged left-padded, packed, or GRPO), no
        forward."""
        if "completion_ids" in tensordict.keys():
            return self._completion_layout(tensordict, self.device)
        single = tensordict.batch_dims == 0
        if single:
            flat = lazy_stack([tensordict])
        elif tensordict.batch_dims == 2:
            flat = _flatten(tensordict)
        elif tensordict.batch_dims == 1:
            flat = tensordict
        else:
            raise ValueError(f"{type(self).__name__}: input batch_size must be [], [B] or [B, n] for a "
                             f"distribution, got {list(tensordict.batch_size)}.")
        if "position_ids" in flat.keys():
            return self._packed_layout(flat, single)
        dense = self._dense_full(flat)
        if dense is not None:
            ids, attn, asst = dense
        else:
            full, asst_rows, _ = self._full_inputs(flat)
            ids, attn = self._padded_full(full)
            if asst_rows is None:  # outside history mode: an assistant mask given with the ids (e.g. by a dataset)
                given = read_rows(flat, self._k(self.masks_key, "all_assistant_mask"),
                                  attention_key=self._k(self.masks_key, "all_attention_mask"))
                if given is not None and all(g.numel() == f.numel() for g, f in zip(given, full)):
                    asst_rows = given
            asst = None if asst_rows is None else pad_rows([a.to(self.device).bool() for a in asst_rows], False,
                                                           side="left")
        return DistLayout(tokens=ids, attention_mask=attn, assistant_mask=asst, source=flat, single=single)

    def _packed_layout(self, td: TensorDictBase, single: bool) -> DistLayout:
        """The packed layout (detected by the top-level key ``"position_ids"``, :mod:`lit_llm.data.packing`): dense
        ids and masks as given, several sequences per row told apart by ``position_ids`` restarting at 0.

        Raises:
            ValueError: the ids or attention mask are not dense ``[B, T]``; the input also holds ``tokens.prompt`` or
                is in history mode (a prompt cannot be matched to a packed row: the sft head takes each sequence's
                last run of assistant tokens); position ids that do not restart at 0 and count up by 1.
        """
        name = type(self).__name__
        if self.input_mode == "history" or _present(td, self._k(self.tokens_key, "prompt")):
            raise ValueError(f"{name}: packed rows (input key 'position_ids') cannot be read with tokens.prompt or "
                             f"history prompts (a prompt is not a prefix of a packed row); pass "
                             f"masks.all_assistant_mask (the sft head takes each sequence's last run of assistant "
                             f"tokens) and input_mode='tokens'.")
        dense = self._dense_full(td)
        if dense is None:
            ids_key = self.input_key if self.input_mode == "tokens" else self._k(self.tokens_key, "full")
            raise ValueError(f"{name}: packed rows (input key 'position_ids') need dense [B, T] ids at {ids_key!r} and "
                             f"{self._k(self.masks_key, 'all_attention_mask')!r} of the same shape.")
        ids, attn, asst = dense
        pos = td.get("position_ids")
        if not isinstance(pos, Tensor):
            raise ValueError(f"{name}: 'position_ids' must be a dense [B, T] integer tensor.")
        pos = check_packed_positions(pos.to(attn.device), attn, f"{name} (log-prob version)")
        return DistLayout(tokens=ids, attention_mask=attn, assistant_mask=asst, source=td, single=single,
                          position_ids=pos)

    def _dense_full(self, td: TensorDictBase) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """The dense fast path: ``(ids, attention mask, assistant mask or None)`` as given, or ``None`` when the input
        has no dense ``[B, T]`` full ids with a dense attention mask of the same shape.

        Raises:
            ValueError: an attention mask that is not bool/0-1, or ids a model cannot score (named row).
        """
        ids_key = self.input_key if self.input_mode == "tokens" else self._k(self.tokens_key, "full")
        attn_key = self._tokens_attention_key(td)
        ids, attn = _dense(td, ids_key), _dense(td, attn_key)
        if ids is None or attn is None or ids.dim() != 2 or attn.shape != ids.shape:
            return None

        given = attn.dtype

        def not_a_mask() -> ValueError:
            return ValueError(f"{type(self).__name__}: {attn_key!r} must be a bool (or 0/1 integer) [B, T] mask "
                              f"aligned with {ids_key!r}; got dtype {given}. Pass attention_mask.bool().")

        if attn.dtype.is_floating_point or attn.dtype.is_complex:
            raise not_a_mask()
        if attn.dtype != torch.bool:  # values: one host read outside a training step, none inside one
            check_value(((attn != 0) & (attn != 1)).any(), not_a_mask)
        dev = self.device
        ids, attn = ids.to(dev), attn.to(dev).bool()
        ids = _checked_dense_ids(self.model, ids, attn, f"{type(self).__name__} (log-prob version): {ids_key!r}")
        asst = _dense(td, self._k(self.masks_key, "all_assistant_mask"))
        if asst is not None and asst.shape == ids.shape:
            return ids, attn, asst.to(dev).bool() & attn
        if self.input_mode != "history":
            return ids, attn, None
        rows = _real_rows(ids, attn)
        asst_rows = self._assistant_for_ids(td, rows, self._input_prompt_lengths(td, rows))
        asst = torch.zeros_like(attn)
        asst[attn] = torch.cat([a.to(dev).bool() for a in asst_rows])
        return ids, attn, asst


def _checked_dense_ids(model: Any, ids: Tensor, attn: Tensor, what: str) -> Tensor:
    """:func:`check_token_ids` of the real tokens of dense ``[B, T]`` ids, tested on the whole tensor: the dtype and
    a width over the context are read from the shapes (checked at once); the values (an empty row, an id outside the
    vocabulary, a row longer than the context) with :func:`~lit_llm.policy.deferred.check_value` (one host read
    outside a training step, none inside one; on failure the per-row check names the culprit).

    Returns:
        ``ids`` as given; inside a training step (:func:`~lit_llm.policy.deferred.deferring`) a copy with the real
        tokens' ids clamped into the vocabulary (the same values when the check passes), so that a check deferred to
        the step's read cannot index outside the embedding meanwhile.
    """
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        check_token_ids(model, _real_rows(ids, attn), what=what)  # raises: names the row and the dtype
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    lengths = attn.sum(-1)
    if context is not None and ids.shape[1] > context and bool(lengths.max() > context):  # learned positions
        check_token_ids(model, _real_rows(ids, attn), what=what)  # would index outside their table: at once
    bad = (lengths == 0).any()
    if vocab is not None:
        bad |= (attn & ((ids < 0) | (ids >= vocab))).any()

    def error() -> Exception:
        try:
            check_token_ids(model, _real_rows(ids, attn), what=what)
        except ValueError as e:
            return e
        return ValueError(f"{what}: ids a model cannot score")  # not reached: check_token_ids tests the same

    check_value(bad, error)
    return torch.where(attn, ids.clamp(0, vocab - 1), ids) if vocab is not None and deferring() else ids


def _unpad_left_prefix(prompt_row: Tensor, full_row: Tensor, row: int) -> int:
    """Length of the real prompt in a left-padded dense ``prompt_row``: the longest suffix that is a prefix of
    ``full_row`` (padding cannot be read from ids, as pad == eos; a row whose prompt starts with the pad id is
    only ambiguous when the pad run also matches, and the longest match is taken).

    Raises:
        ValueError: no suffix matches (pass unpadded tokens).
    """
    width = prompt_row.numel()
    matches = [p for p in range(1, min(width, full_row.numel()) + 1)
               if torch.equal(prompt_row[width - p:], full_row[:p])]
    if not matches:
        raise ValueError(f"row {row}: the left-padded tokens.prompt is not a prefix of tokens.full; pass unpadded "
                         f"tokens (pad_output=False).")
    return max(matches)



def check_id_dtype(rows: list[Tensor], key: NestedKey, owner: str = "policy") -> None:
    """Refuse non-integer token ids (``[1.0, 2.5, 3.9]`` would otherwise be scored as ``[1, 2, 3]``).

    Raises:
        ValueError: a floating, complex or bool row; names the key and the row.
    """
    for b, r in enumerate(rows):
        if isinstance(r, Tensor) and (r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool):
            raise ValueError(f"{owner}: token ids at {key!r} (row {b}) have dtype {r.dtype}; token ids must be an "
                             f"integer tensor (torch.long). Pass the tokenizer's integer ids, not a cast copy.")


def history_rows(hist: Any, key: NestedKey, owner: str = "policy") -> list:
    """The rows of a ``[B, n_messages]`` History input as ``[n_messages]`` Histories; a ``[B]`` History (one message
    per row, e.g. ``history[:, 0]``) gives one-message rows (TorchRL's ``ChatHistory`` unsqueezes it alike).

    Raises:
        TypeError: the entry is not a History (TorchRL's error type); names the key and the fix.
    """
    if not callable(getattr(hist, "apply_chat_template", None)) or not hasattr(hist, "unbind"):
        raise TypeError(f"{owner}: the input at {key!r} must be a History (lit_llm.data.history.History, batch "
                        f"[B, n_messages]), got {type(hist).__name__}. Build it with History.from_chats(...) and "
                        f"wrap it in ChatHistory(prompt=...).")
    if hist.batch_dims == 0:
        raise TypeError(f"{owner}: the input at {key!r} is a single message (batch_size=[]); the input needs a batch "
                        f"dimension (batch_size=[B]).")
    return [lazy_stack([h]) if h.batch_dims == 0 else h for h in hist.unbind(0)]
