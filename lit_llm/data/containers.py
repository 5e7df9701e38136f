"""Typed containers passed between data, policy and losses, with TorchRL's names.

``Text``, ``Tokens``, ``Masks``, ``LogProbs`` and ``ChatHistory`` are tensorclasses (``TensorClass["nocast"]``)
with a ``prompt`` / ``response`` / ``full`` triple, as in TorchRL's ``torchrl.modules.llm.policies.common``.

Batching convention (docs/ARCHITECTURE.md):

* one item has ``batch_size=[]`` and 1-D fields (``[T]``);
* an **unpadded** batch (``padded=False``) is a lazy stack (``tensordict.lazy_stack``) of per-row items with
  ``batch_size=[B]``; read the ragged fields with ``td.get("prompt", as_list=True)`` or pad them on the fly with
  ``td.get("prompt", as_padded_tensor=True, padding_side="left", padding_value=pad_id)``;
* a **padded** batch (``padded=True``) holds ``[B, T]`` tensors: ``prompt`` left-padded, ``response``
  right-padded, ``full`` left-padded (the layout used for generation).

Conversions (the TorchRL seed, ``torchrl/data/llm``): :meth:`ChatHistory.to_tokens`, :meth:`ChatHistory.to_text`,
:meth:`Text.to_tokens`, :meth:`Text.to_history`, :meth:`Tokens.to_text`, :meth:`Tokens.to_history`. Each works on
one item or on a batch (a lazy stack, or a ``[B]``-shaped instance) and returns the same kind; batched results are
unpadded lazy stacks. Response = full minus the prompt prefix (by ids for tokens, by characters for text); when the
prompt is not a prefix a :class:`~lit_llm.data.errors.PrefixMismatchError` names the template and the position
(DESIGN.md property 2).
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorClass, lazy_stack

from lit_llm.data.container_utils import (
    _TEMPLATE_FIX,
    _as_list,
    _as_long_1d,
    _as_one_row,
    _encode,
    _holds_one_row,
    _is_batched,
    _one_item,
    _padded_tokens,
    _require_history,
    _rows,
    _split_at_last_assistant,
    _template_arg,
    _text_prefix_error,
    template_display_name,
)
from lit_llm.data.errors import check_prefix

if TYPE_CHECKING:
    from lit_llm.data.history import History

__all__ = ["ChatHistory", "LogProbs", "Masks", "Text", "Tokens", "template_display_name"]


# -------------------------------------------------------------------------------------------------------- containers
class Text(TensorClass["nocast"]):
    """Text of a prompt, its response and the full sequence.

    Conversions (here and in :class:`Tokens`, :class:`ChatHistory`) keep the batch shape: a ``[B]`` or ``[B, n]``
    container converts row by row; an unbatched one whose fields hold a batch of one row (a ``[1, n]`` History, a
    ``[1, T]`` id tensor, a one-element list, as TorchRL's tests build them) gives fields holding that batch of one
    (one-element lists, ``[1, T]`` ids, a ``[1, n]`` History), as TorchRL does.

    Attributes:
        prompt: the prompt text (e.g. a rendered chat with the generation prompt). ``str`` per item; a batch holds
            ``B`` strings (``td.prompt`` is then a list-like of ``str``).
        response: the response text (what follows the prompt). ``str`` per item.
        full: ``prompt + response``. ``str`` per item.
    """

    prompt: str | None = None
    response: str | None = None
    full: str | None = None

    def to_tokens(self, tokenizer: Any, padding: bool = False, truncation: bool = False, *,
                  max_length: int | None = None, return_tensors: str = "pt") -> Tokens:
        """Tokenize: ``full`` once, ``prompt`` once, ``response`` = full ids minus the prompt ids (TorchRL's signature).

        Special tokens are not added (``add_special_tokens=False``): the texts are expected to be rendered chats that
        already carry them. ``full`` defaults to ``prompt + response`` when absent; ``response`` is never tokenized
        on its own, so ``tokens.full == cat(tokens.prompt, tokens.response)`` (DESIGN.md property 1). A container
        holding only ``full`` gives ``Tokens(full=...)`` (no split is known from text alone).

        Args:
            tokenizer: a Hugging Face tokenizer.
            padding: batches only: return ``[B, T]`` tensors (``padded=True``: prompt left-, response right-, full
                left-padded with ``tokenizer.pad_token_id``) instead of a lazy stack of rows. Ignored for one item.
            truncation: truncate each text to ``max_length`` tokens (the tokenizer's ``model_max_length`` when
                ``None``), as the tokenizer does; the prompt must still be a prefix of the full ids.
            max_length: see ``truncation``.
            return_tensors: ``"pt"`` only (torch tensors; accepted for TorchRL parity).

        Returns:
            :class:`Tokens` with 1-D ``torch.long`` fields (``padded=False``); a lazy stack of them for a batch, or
            one padded ``[B]`` instance with ``padding=True``. ``response`` is ``None`` when neither ``response``
            nor ``full`` is set.

        Raises:
            ValueError: ``return_tensors`` other than ``"pt"``; neither ``prompt`` nor ``full`` is set; ``padding``
                without a pad token; an unbatched container holding several rows.
            PrefixMismatchError: the prompt text is not a prefix of ``full`` (position in characters), or its ids
                are not a prefix of the full ids (a BPE merge across the boundary; position in tokens).
        """
        if return_tensors != "pt":
            raise ValueError(f"Text.to_tokens: return_tensors={return_tensors!r} is not supported; lit_llm "
                             f"containers hold torch tensors (return_tensors='pt').")
        kw = {"truncation": truncation, "max_length": max_length} if truncation else {}
        if _is_batched(self):
            rows = [row.to_tokens(tokenizer, truncation=truncation, max_length=max_length) for row in _rows(self)]
            return _padded_tokens(rows, tokenizer, "Text.to_tokens") if padding else lazy_stack(rows)
        if _holds_one_row(self):
            return _as_one_row(_one_item(self).to_tokens(tokenizer, truncation=truncation, max_length=max_length))
        item = self
        if item.prompt is None and item.full is not None:
            return Tokens(full=_encode(tokenizer, item.full, **kw), padded=False)
        prompt, full = item.prompt, item._full_text("Text.to_tokens")
        prompt_ids = _encode(tokenizer, prompt, **kw)
        if full is None:
            return Tokens(prompt=prompt_ids, padded=False)
        full_ids = _encode(tokenizer, full, **kw)
        check_prefix(prompt_ids, full_ids, template_name="<text: Text.to_tokens>")
        return Tokens(prompt=prompt_ids, response=full_ids[prompt_ids.numel():], full=full_ids, padded=False)

    def to_history(self, tokenizer: Any = None, chat_template_name: str | None = None) -> ChatHistory:
        """Parse the texts back into messages (see :func:`lit_llm.data.chat_parsing.parse_chat_text`).

        ``prompt`` is parsed with its trailing generation prompt (an empty, unfinished assistant turn) removed;
        ``full`` (``prompt + response`` when absent) is parsed whole; ``response`` is the messages of ``full`` after
        the prompt's messages (an unfinished final reply has ``is_complete=False``). A container holding only
        ``full`` is split as TorchRL splits it: the response is the last assistant message and what follows it, the
        prompt what precedes it.

        Args:
            tokenizer: the tokenizer the text was rendered with; its chat template gives the family when
                ``chat_template_name`` is ``None``. (A string here is taken as ``chat_template_name``, the older
                lit_llm signature ``to_history(name)``.)
            chat_template_name: a registered template name or parser family (``"chatml"``, ``"llama3"``, ...;
                TorchRL's ``"chatml_format"`` is ``"chatml"``); ``None``: detected as ``History.from_text`` does
                (the tokenizer's template, its name, else ChatML).

        Returns:
            :class:`ChatHistory` with 1-D histories ``[n_messages]``; a lazy stack of them for a batch.

        Raises:
            ValueError: neither ``prompt`` nor ``full`` is set, the family is unknown or cannot be read off the
                tokenizer, or the text is not a rendered chat of it.
            PrefixMismatchError: the prompt text is not a prefix of ``full``.
        """
        from lit_llm.data.chat_parsing import resolve_parser
        from lit_llm.data.history import History

        if isinstance(tokenizer, str) and chat_template_name is None:
            tokenizer, chat_template_name = None, tokenizer
        if _is_batched(self):
            return lazy_stack([row.to_history(tokenizer, chat_template_name) for row in _rows(self)])
        if _holds_one_row(self):
            return _as_one_row(_one_item(self).to_history(tokenizer, chat_template_name))
        _, parser = resolve_parser(chat_template_name, None, tokenizer)

        def parse(text: str) -> list[dict]:
            parsed = parser(text)
            return list(parsed) if isinstance(parsed, (list, tuple)) else parsed.to_chats()

        item = self
        if item.prompt is None and item.full is not None:
            full_msgs = parse(item.full)
            prompt_msgs, resp_msgs = _split_at_last_assistant(full_msgs)
            return ChatHistory(prompt=History.from_chats(prompt_msgs) if prompt_msgs else None,
                               response=History.from_chats(resp_msgs) if resp_msgs else None,
                               full=History.from_chats(full_msgs))
        full = item._full_text("Text.to_history")
        prompt_msgs = parse(item.prompt)
        if prompt_msgs and prompt_msgs[-1]["role"] == "assistant" and not prompt_msgs[-1]["content"]:
            prompt_msgs = prompt_msgs[:-1]  # the generation prompt, not a message
        out = ChatHistory(prompt=History.from_chats(prompt_msgs) if prompt_msgs else None)
        if full is not None:
            full_msgs = parse(full)
            out.full = History.from_chats(full_msgs)
            resp_msgs = full_msgs[len(prompt_msgs):]
            if resp_msgs:
                out.response = History.from_chats(resp_msgs)
        return out

    def _full_text(self, what: str) -> str | None:
        if self.prompt is None:
            raise ValueError(f"{what}: the 'prompt' field is None (and no 'full'); set Text(prompt=...) or "
                             f"Text(full=...) first.")
        if self.full is None:
            return None if self.response is None else self.prompt + self.response
        if not self.full.startswith(self.prompt):
            raise _text_prefix_error(self.prompt, self.full, what)
        return self.full


class Tokens(TensorClass["nocast"]):
    """Token ids of a prompt, its response and the full sequence (``torch.long``).

    Attributes:
        prompt: ``[T_p]`` per item; ``[B, T_p]`` **left**-padded when ``padded=True``.
        response: ``[T_r]`` per item; ``[B, T_r]`` **right**-padded when ``padded=True``. The sampled ids, ending
            with the stop token when generation stopped (DESIGN.md property 5).
        full: ``cat(prompt, response)``, ``[T_p + T_r]`` per item; ``[B, T]`` **left**-padded when ``padded=True``.
        padded: whether the tensors are padded ``[B, T]`` tensors (``True``) or ragged per-item tensors in a lazy
            stack (``False``).
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    padded: bool | None = None

    def to_text(self, tokenizer: Any, skip_special_tokens: bool = False) -> Text:
        """Decode the ids (TorchRL's signature).

        ``full`` defaults to ``cat(prompt, response)``; when both ``prompt`` and ``full`` are set, ``response`` text
        is the decoded full text minus the decoded prompt text. A container holding only ``full`` gives
        ``Text(full=...)``.

        Args:
            tokenizer: a Hugging Face tokenizer.
            skip_special_tokens: drop special tokens from the texts (default ``False``: keep them, so the text
                re-tokenizes to the same ids and parses back into messages).

        Returns:
            :class:`Text`; a lazy stack of them for a batch.

        Raises:
            ValueError: the tokens are padded (unpad them first: the pad id can equal the end-of-turn id); an
                unbatched container holding several rows.
            PrefixMismatchError: the decoded prompt is not a prefix of the decoded full text.
        """
        if _is_batched(self):
            return lazy_stack([row.to_text(tokenizer, skip_special_tokens) for row in _rows(self)])
        if self.padded:
            raise ValueError("Tokens.to_text: padded=True; decode unpadded tokens (a lazy stack), as pad == eos.")
        if _holds_one_row(self):
            return _as_one_row(_one_item(self).to_text(tokenizer, skip_special_tokens))
        item = self

        def dec(t: torch.Tensor | None) -> str | None:
            if t is None:
                return None
            return tokenizer.decode(_as_long_1d(t, "ids").tolist(), skip_special_tokens=skip_special_tokens)

        full = item.full
        if full is None and item.prompt is not None and item.response is not None:
            full = torch.cat([_as_long_1d(item.prompt, "prompt"), _as_long_1d(item.response, "response")])
        prompt_text, full_text = dec(item.prompt), dec(full)
        response_text = dec(item.response)
        if prompt_text is not None and full_text is not None:
            if not full_text.startswith(prompt_text):
                raise _text_prefix_error(prompt_text, full_text, "Tokens.to_text")
            response_text = full_text[len(prompt_text):]
        return Text(prompt=prompt_text, response=response_text, full=full_text)

    def to_history(self, tokenizer: Any, chat_template_name: str | None = None,
                   skip_special_tokens: bool = False) -> ChatHistory:
        """Decode (:meth:`to_text`) then parse (:meth:`Text.to_history`), TorchRL's signature.

        Args:
            tokenizer: a Hugging Face tokenizer (its chat template gives the family when ``chat_template_name`` is
                ``None``).
            chat_template_name: the template family (``"chatml"``, ``"llama3"``, ...; ``"chatml_format"`` =
                ``"chatml"``).
            skip_special_tokens: passed to :meth:`to_text`. Keep ``False`` for families whose turn markers are
                special tokens (ChatML, Llama 3, ...): without them the text no longer parses as a conversation.

        Returns:
            :class:`ChatHistory`; a lazy stack of them for a batch.

        Raises:
            ValueError: see :meth:`to_text` and :meth:`Text.to_history`.
        """
        return self.to_text(tokenizer, skip_special_tokens).to_history(tokenizer, chat_template_name)


class Masks(TensorClass["nocast"]):
    """Masks over the ``full`` sequence (``torch.bool``).

    Attributes:
        all_attention_mask: ``[T]`` per item; ``[B, T]`` **left**-padded (``False`` at padding) when
            ``padded=True``. ``True`` on every real token of ``full``.
        all_assistant_mask: ``[T]`` per item; ``[B, T]`` left-padded like ``full``. ``True`` on the tokens a model
            generates for each assistant turn (DESIGN.md property 3); ``None`` when unknown.
        padded: whether the masks are padded ``[B, T]`` tensors or ragged per-item tensors in a lazy stack.
    """

    all_attention_mask: torch.Tensor | None = None
    all_assistant_mask: torch.Tensor | None = None
    padded: bool | None = None


class LogProbs(TensorClass["nocast"]):
    """Per-token log-probabilities ``log p(x_t | x_<t)`` (``torch.float32``), aligned with :class:`Tokens`.

    Attributes:
        prompt: ``[T_p]`` per item; ``[B, T_p]`` left-padded when ``padded=True``. Position 0 is ``0.0``.
        response: ``[T_r]`` per item; ``[B, T_r]`` right-padded when ``padded=True``. Entry ``t`` is the
            log-prob of ``response[t]`` given the prompt and ``response[:t]``.
        full: ``[T]`` per item; ``[B, T]`` left-padded when ``padded=True``. ``full[t] = log p(x_t | x_<t)``;
            position 0 and padding are ``0.0`` (DESIGN.md property 4).
        padded: whether the tensors are padded ``[B, T]`` tensors or ragged per-item tensors in a lazy stack.
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    padded: bool | None = None


class ChatHistory(TensorClass["nocast"]):
    """Chat messages of a prompt, its response and the whole conversation.

    Attributes:
        prompt: :class:`~lit_llm.data.history.History` ``[n_prompt]`` (the conversation before the reply).
        response: History ``[n_response]`` (usually one assistant message; ``is_complete=False`` when unfinished).
        full: History ``[n_prompt + n_response]``; defaults to ``prompt.extend(response)`` in the conversions.
    """

    prompt: History | None = None
    response: History | None = None
    full: History | None = None

    def __post_init__(self) -> None:
        """TorchRL's check: each History has one more batch dimension than the container (its messages). A History
        with the container's own rank (e.g. ``history[:, 0]``, one message per row) gets a ``UserWarning`` and is
        unsqueezed along its last dimension (as a lazy stack), as TorchRL does.

        Raises:
            TypeError: a field that is not a History (e.g. a list of message dicts).
        """
        for name in ("prompt", "response", "full"):
            value = getattr(self, name)
            if value is None:
                continue
            _require_history(value, name, "ChatHistory")
            if getattr(value, "batch_dims", None) == self.batch_dims:
                warnings.warn(
                    f"ChatHistory.{name}: the History should have one more batch dimension than the ChatHistory (its "
                    f"messages), got {value.batch_dims} and {self.batch_dims}; it is unsqueezed along the last "
                    f"dimension (one message per row).", UserWarning, stacklevel=2)
                setattr(self, name, lazy_stack([value], -1))

    def to_text(self, tokenizer: Any, chat_template: str | os.PathLike | None = None, *,
                chat_template_name: str | None = None, **template_kwargs: Any) -> Text:
        """Render: prompt with the generation prompt, full without; response = full text minus the prompt text.

        A container holding only ``full`` is split as TorchRL splits it: the prompt is the conversation before its
        last assistant message, the response that message and what follows (no assistant message: ``full`` only).

        Args:
            tokenizer: a Hugging Face tokenizer.
            chat_template: a Jinja string, a ``.jinja`` path or a template name; ``None`` for the tokenizer's own.
            chat_template_name: TorchRL's name for the template (``"chatml_format"``, ``"qwen"``, ``"llama3"``, ...;
                see :mod:`lit_llm.data.template_registry`); exclusive with ``chat_template``.
            **template_kwargs: passed to :meth:`History.apply_chat_template` (e.g. ``enable_thinking``).

        Returns:
            :class:`Text`; a lazy stack of them for a batch.

        Raises:
            ValueError: neither ``prompt`` nor ``full`` is set; both ``chat_template`` and ``chat_template_name``;
                an unbatched container holding several rows.
            TypeError: a field that is not a History.
            PrefixMismatchError: the rendered prompt is not a prefix of the rendered full conversation (names the
                template and the character position).
        """
        chat_template = _template_arg(chat_template, chat_template_name, "ChatHistory.to_text")
        if _is_batched(self):
            return lazy_stack([row.to_text(tokenizer, chat_template, **template_kwargs) for row in _rows(self)])
        if _holds_one_row(self):
            return _as_one_row(_one_item(self).to_text(tokenizer, chat_template, **template_kwargs))
        prompt_h, full_h = self._prompt_and_full("ChatHistory.to_text")
        kw = dict(chat_template=chat_template, tokenize=False, return_dict=False, **template_kwargs)
        if prompt_h is None:
            return Text(full=full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw))
        prompt = prompt_h.apply_chat_template(tokenizer, add_generation_prompt=True, **kw)
        if full_h is None:
            return Text(prompt=prompt)
        full = full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw)
        if not full.startswith(prompt):
            raise _text_prefix_error(
                prompt, full, f"Chat template {template_display_name(chat_template)!r}", _TEMPLATE_FIX
            )
        return Text(prompt=prompt, response=full[len(prompt):], full=full)

    def to_tokens(
        self, tokenizer: Any, chat_template: str | os.PathLike | None = None, *, chat_template_name: str | None = None,
        **template_kwargs: Any
    ) -> Tokens:
        """Tokenize: prompt rendered with the generation prompt, full rendered without; response by ids.

        ``response`` = the full ids minus the prompt ids, after checking with
        :func:`~lit_llm.data.errors.check_prefix` that the prompt ids are an exact prefix (DESIGN.md property 2);
        so ``tokens.full == cat(tokens.prompt, tokens.response)``. A container holding only ``full`` is split at its
        last assistant message (as :meth:`to_text`).

        Args:
            tokenizer: a Hugging Face tokenizer.
            chat_template: a Jinja string, a ``.jinja`` path or a template name; ``None`` for the tokenizer's own.
            chat_template_name: TorchRL's name for the template (``"chatml_format"``, ``"qwen"``, ...); exclusive
                with ``chat_template``.
            **template_kwargs: passed to :meth:`History.apply_chat_template` (e.g. ``enable_thinking``,
                ``allow_special_tokens``).

        Returns:
            :class:`Tokens` with 1-D ``torch.long`` fields and ``padded=False``; a lazy stack for a batch.
            ``response`` and ``full`` are ``None`` when neither ``full`` nor ``response`` is set; ``prompt`` and
            ``response`` are ``None`` for a ``full``-only conversation without an assistant message.

        Raises:
            ValueError: neither ``prompt`` nor ``full`` is set; both ``chat_template`` and ``chat_template_name``;
                an unbatched container holding several rows.
            TypeError: a field that is not a History.
            PrefixMismatchError: the prompt ids are not a prefix of the full ids (names the template and position),
                e.g. Qwen3 removing the reasoning of earlier assistant turns once a reply follows.
        """
        chat_template = _template_arg(chat_template, chat_template_name, "ChatHistory.to_tokens")
        if _is_batched(self):
            return lazy_stack([row.to_tokens(tokenizer, chat_template, **template_kwargs) for row in _rows(self)])
        if _holds_one_row(self):
            return _as_one_row(_one_item(self).to_tokens(tokenizer, chat_template, **template_kwargs))
        prompt_h, full_h = self._prompt_and_full("ChatHistory.to_tokens")
        kw = dict(chat_template=chat_template, tokenize=True, return_dict=False, **template_kwargs)
        if prompt_h is None:
            full_ids = full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw)
            return Tokens(full=_as_long_1d(full_ids, "full"), padded=False)
        prompt_ids = _as_long_1d(prompt_h.apply_chat_template(tokenizer, add_generation_prompt=True, **kw), "prompt")
        if full_h is None:
            return Tokens(prompt=prompt_ids, padded=False)
        full_ids = _as_long_1d(full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw), "full")
        check_prefix(prompt_ids, full_ids, template_name=template_display_name(chat_template))
        return Tokens(prompt=prompt_ids, response=full_ids[prompt_ids.numel():], full=full_ids, padded=False)

    def _prompt_and_full(self, what: str) -> tuple[History | None, History | None]:
        """``(prompt, full)`` of one item; ``prompt`` is ``None`` only for a ``full``-only conversation without an
        assistant message."""
        item = _one_item(self)
        for name in ("prompt", "response", "full"):
            _require_history(getattr(item, name), name, what)
        if item.prompt is None:
            if item.full is None:
                raise ValueError(f"{what}: the 'prompt' and 'full' fields are None; set ChatHistory(prompt=History...) "
                                 f"or ChatHistory(full=History...) first.")
            roles = [r for r in _as_list(item.full.role) if r != "<none>"]
            last = max((i for i, r in enumerate(roles) if r == "assistant"), default=None)
            if last is None or last == 0:
                return None, item.full
            return item.full[:last], item.full
        if item.full is not None:
            return item.prompt, item.full
        if item.response is None:
            return item.prompt, None
        return item.prompt, item.prompt.extend(item.response, inplace=False)


