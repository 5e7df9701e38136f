"""Chat messages as a tensorclass (DESIGN.md properties 3 and 8).

A :class:`History` holds chat messages batched as ``[n_messages]`` (one conversation) or ``[B, n_messages]``
(B conversations; ragged ones are padded with messages of role ``"<none>"`` that rendering skips). Names follow
TorchRL's ``torchrl.data.llm.History``.

:meth:`History.apply_chat_template` is the public entry point for rendering; the template rendering and the exact
assistant masks (property 3) live in ``lit_llm.data.chat_template``, the input validation and the special-token
check (property 8) in ``lit_llm.data.validation``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorClass, TensorDict, TensorDictBase, lazy_stack

from lit_llm.data.assistant_spans import STOP_STRINGS, _assistant_spans
from lit_llm.data.chat_template import Renderer, _pad, _tokenize, resolve_template
from lit_llm.data.errors import ChatParseError, HistoryShapeError, InvalidConversationError, NoAssistantTokensError
from lit_llm.data.validation import (
    PAD_ROLE,
    ROLES,
    _check_content,
    _check_role,
    _check_special_tokens,
    _short,
    _validate_for_render,
    find_special_tokens,
)

__all__ = ["MESSAGE_KEYS", "PAD_ROLE", "ROLES", "STOP_STRINGS", "History", "find_special_tokens"]

MESSAGE_KEYS = ("role", "content", "is_complete", "tool_calls", "name", "tool_call_id")
"""The keys a message dict may have (:meth:`History.from_chats`): TorchRL's ``History`` fields plus the OpenAI /
transformers keys of tool messages (``name``, ``tool_call_id``)."""


class History(TensorClass["nocast"]):
    """Chat messages, batched as ``[n_messages]`` or ``[B, n_messages]`` (TorchRL's ``History``).

    Every field is non-tensor data with the History's batch shape. Build batches with :meth:`from_chats`; ragged
    batches are padded at the end of each row with messages of role ``"<none>"`` (:data:`PAD_ROLE`), content ``""``,
    which rendering and :meth:`to_chats` skip. Indexing, ``unbind``, ``torch.stack``/``lazy_stack`` work as for any
    tensorclass; ``history.role`` is a (nested) list of ``str`` with the batch shape.

    Attributes:
        role: one of ``"system"``, ``"user"``, ``"assistant"``, ``"tool"`` (or ``"<none>"`` for padding).
        content: the message text (``str``; may be empty).
        is_complete: ``False`` when the message was cut before its end-of-turn token (e.g. a truncated
            generation). Rendering ignores it; default ``True``.
        tool_calls: optional list of tool-call dicts (``{"type": "function", "function": {"name": ...,
            "arguments": ...}}``) passed to the template as ``message.tool_calls``; default ``None``. A model's turn
            that writes its call as text (``<tool_call>{...}</tool_call>`` in ``content``, what the episode engine
            decodes) needs none.
        name: the tool's name on a ``"tool"`` message (``{"role": "tool", "name": "calculator", "content": "42"}``,
            transformers' and the environments' format); passed to the template as ``message.name``; default
            ``None``.
        tool_call_id: the id of the call a ``"tool"`` message answers (OpenAI's key; Mistral-style templates read
            it); default ``None``.

    Tool conversations are first-class: ``"tool"`` messages render as the template writes them and are never in the
    assistant mask; assistant turns (with a call in ``content`` or in ``tool_calls``) are (DESIGN.md property 3).
    """

    role: str
    content: str
    is_complete: bool = True
    tool_calls: list | None = None
    name: str | None = None
    tool_call_id: str | None = None

    # ------------------------------------------------------------------ construction / conversion
    @classmethod
    def from_chats(cls, chats: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]) -> History:
        """Build a History from one conversation (``list[dict]``) or several (``list[list[dict]]``).

        Args:
            chats: messages are dicts with keys ``role`` (str, one of :data:`ROLES`) and ``content`` (str), and
                optionally ``is_complete`` (bool), ``tool_calls`` (list or None), ``name`` and ``tool_call_id``
                (str or None; tool messages). No other key is accepted (:data:`MESSAGE_KEYS`).

        Returns:
            History of shape ``[n_messages]`` for one conversation, ``[B, max_n_messages]`` for B conversations
            (shorter rows padded at the end with role ``"<none>"``).

        Raises:
            InvalidConversationError: empty input or conversation, a message that is not a dict, a missing or
                unknown key, an unknown role, non-string content, a non-bool ``is_complete``, a non-list
                ``tool_calls``, a non-string ``name`` / ``tool_call_id``. The message names the conversation index,
                the message index and the key.
        """
        if isinstance(chats, (str, bytes)) or not isinstance(chats, Sequence) or len(chats) == 0:
            raise InvalidConversationError(
                f"History.from_chats: expected a conversation (list of message dicts) or a list of conversations, "
                f"got {_short(chats)}. Pass e.g. [{{'role': 'user', 'content': 'Hi'}}]."
            )
        if isinstance(chats[0], Mapping):
            return lazy_stack([cls._message(m, None, j) for j, m in enumerate(chats)])
        rows = []
        for b, conv in enumerate(chats):
            if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence):
                raise InvalidConversationError(
                    f"History.from_chats: conversation {b} is {_short(conv)}, not a list of message dicts. Pass "
                    f"either one conversation (list of dicts) or a list of conversations (list of lists of dicts)."
                )
            if len(conv) == 0:
                raise InvalidConversationError(
                    f"History.from_chats: conversation {b} is empty. Every conversation needs at least one message; "
                    f"drop empty conversations before building the batch."
                )
            rows.append([cls._message(m, b, j) for j, m in enumerate(conv)])
        width = max(len(r) for r in rows)
        padded = [lazy_stack(r + [cls(role=PAD_ROLE, content="")] * (width - len(r))) for r in rows]
        return lazy_stack(padded)

    @classmethod
    def _message(cls, m: Any, b: int | None, j: int) -> History:
        where = f"message {j}" if b is None else f"conversation {b}, message {j}"
        if not isinstance(m, Mapping):
            raise InvalidConversationError(
                f"History.from_chats: {where} is {_short(m)}, not a dict. Messages are dicts with keys 'role' and "
                f"'content'."
            )
        for key in ("role", "content"):
            if key not in m:
                raise InvalidConversationError(
                    f"History.from_chats: {where} has no {key!r} key (keys: {sorted(m)}). Every message needs "
                    f"'role' and 'content'."
                )
        unknown = sorted(set(m) - set(MESSAGE_KEYS))
        if unknown:
            raise InvalidConversationError(
                f"History.from_chats: {where} has unknown key(s) {unknown}; allowed keys are {list(MESSAGE_KEYS)}. "
                f"Drop the extra keys or fold them into 'content'."
            )
        _check_role(m["role"], f"History.from_chats: {where}", allow_pad=True)
        _check_content(m["content"], f"History.from_chats: {where}")
        is_complete = m.get("is_complete", True)
        if not isinstance(is_complete, bool):
            raise InvalidConversationError(
                f"History.from_chats: {where} has 'is_complete'={is_complete!r}; it must be a bool."
            )
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise InvalidConversationError(
                f"History.from_chats: {where} has 'tool_calls' of type {type(tool_calls).__name__}; it must be a "
                f"list of tool-call dicts or None."
            )
        for key in ("name", "tool_call_id"):
            value = m.get(key)
            if value is not None and not isinstance(value, str):
                raise InvalidConversationError(
                    f"History.from_chats: {where} has {key!r}={_short(value)}; it must be a str (e.g. the tool's "
                    f"name on a tool message) or None."
                )
        return cls(role=m["role"], content=m["content"], is_complete=is_complete, tool_calls=tool_calls,
                   name=m.get("name"), tool_call_id=m.get("tool_call_id"))

    @classmethod
    def from_text(cls, text: str | Sequence[str], chat_template_name: str | None = None,
                  chat_template: str | None = None, tokenizer: Any = None) -> History:
        """Parse rendered conversations back into messages (TorchRL's signature; parsers in
        ``lit_llm.data.chat_parsing``).

        The format is, in this order: ``chat_template_name``; the turn markers of ``chat_template``; the tokenizer
        (its own template's markers, then its ``name_or_path``, as TorchRL detects it); ChatML. A final turn
        without its end-of-turn token (a truncated generation) comes back with ``is_complete=False``. Content is
        kept exactly (TorchRL strips it).

        Args:
            text: one rendered conversation, or a list of them.
            chat_template_name: a registered template name (``"chatml_format"``, ``"qwen"``, ``"llama"``, ...) or a
                parser family of ``lit_llm.data.chat_parsing.parse_chat_text``.
            chat_template: the Jinja text (or registered name) the text was rendered with.
            tokenizer: the tokenizer the text was rendered with.

        Returns:
            History ``[n_messages]`` for one text, ``[B, max_n_messages]`` (``"<none>"``-padded) for a list.

        Raises:
            UnknownChatTemplateError: an unknown ``chat_template_name`` (also a ``NotImplementedError``, as in
                TorchRL).
            ChatParseError: text that is not a conversation of the format (also a ``RuntimeError``); it yields no
                message.
        """
        from lit_llm.data.chat_parsing import resolve_parser

        _, parse = resolve_parser(chat_template_name, chat_template, tokenizer)
        if isinstance(text, str):
            return _as_history(cls, parse(text), 0)
        rows = [_as_history(cls, parse(t), i) for i, t in enumerate(text)]
        return cls.from_chats([r.to_chats() for r in rows])

    def to_chats(self) -> list[dict] | list[list[dict]]:
        """The messages as dicts, padding (``"<none>"``) dropped.

        Returns:
            ``list[dict]`` for a History of shape ``[n]`` (or ``[]``), ``list[list[dict]]`` for ``[B, n]``. Each dict
            has ``role`` and ``content``, plus ``tool_calls``, ``name`` and ``tool_call_id`` when set and
            ``is_complete`` when ``False``.
        """
        if self.ndim > 2:
            raise ValueError(f"History.to_chats: expected a History of shape [n] or [B, n], got {list(self.shape)}.")
        h = self.unsqueeze(0) if self.ndim == 0 else self
        data = h.tolist()
        if self.ndim == 2:
            return [_clean_conversation(row) for row in data]
        return _clean_conversation(data)

    @classmethod
    def default_spec(cls, shape: Sequence[int] = (-1,)) -> Any:
        """A spec of History data for environments and transforms (TorchRL's ``History.default_spec``).

        Args:
            shape: the History's shape; ``-1`` (the default's last dimension) is a variable number of messages.

        Returns:
            TorchRL's ``Composite`` of ``NonTensor`` specs when TorchRL is installed, else a
            :class:`lit_llm.data.history_spec.HistorySpec` with the same fields, ``shape`` and ``zero()``.
        """
        from lit_llm.data.history_spec import history_default_spec

        return history_default_spec(cls, tuple(shape))

    # ------------------------------------------------------------------ growth
    def append(self, other: History, *, inplace: bool = True, dim: int = -1) -> History:
        """Append ``other`` (one dimension less than ``self``) along ``dim``.

        For ``self`` of shape ``[B, n]`` and ``other`` of shape ``[B]``, the result is ``[B, n + 1]`` (one new
        message per conversation, placed after any ``"<none>"`` padding, which rendering skips).

        Args:
            other: History with ``other.ndim == self.ndim - 1``.
            inplace: modify ``self`` (and return it) or return a new History.
            dim: the dimension to grow.

        Raises:
            HistoryShapeError: ``self`` has no batch dimension, or the dimensions do not match (a ``ValueError`` and,
                as in TorchRL, a ``RuntimeError``).
        """
        if self.ndim == 0:
            raise HistoryShapeError("History.append: self has no batch dimension; call history.unsqueeze(0) first.")
        if other.ndim != self.ndim - 1:
            raise HistoryShapeError(
                f"History.append: other must have one dimension less than self (self {list(self.shape)}, other "
                f"{list(other.shape)}); use extend() to add several messages."
            )
        dim = dim % self.ndim
        return self._replace(lazy_stack([*self.unbind(dim), other], dim=dim), inplace)

    def extend(self, other: History, *, inplace: bool = True, dim: int = 0) -> History:
        """Concatenate ``other`` (same number of dimensions) to ``self`` along ``dim``.

        Args:
            other: History with ``other.ndim == self.ndim`` and matching sizes on the other dimensions.
            inplace: modify ``self`` (and return it) or return a new History.
            dim: the dimension to grow (TorchRL's default ``0``: the messages of a ``[n]`` History, the
                conversations of a ``[B, n]`` one; ``-1``: always the messages).

        Raises:
            HistoryShapeError: ``self`` has no batch dimension, or the dimensions do not match (a ``ValueError`` and,
                as in TorchRL, a ``RuntimeError``).
        """
        if self.ndim == 0:
            raise HistoryShapeError("History.extend: self has no batch dimension; call history.unsqueeze(0) first.")
        if other.ndim != self.ndim:
            raise HistoryShapeError(
                f"History.extend: other must have as many dimensions as self (self {list(self.shape)}, other "
                f"{list(other.shape)}); use append() to add one message."
            )
        dim = dim % self.ndim
        return self._replace(lazy_stack([*self.unbind(dim), *other.unbind(dim)], dim=dim), inplace)

    def _replace(self, new: History, inplace: bool) -> History:
        if not inplace:
            return new
        self.__dict__["_tensordict"] = new._tensordict
        return self

    # ------------------------------------------------------------------ rendering
    def apply_chat_template(
        self,
        tokenizer: Any = None,
        *,
        chat_template: str | os.PathLike | None = None,
        chat_template_name: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool | None = None,
        return_dict: bool | None = None,
        return_assistant_tokens_mask: bool = False,
        padding: bool = False,
        padding_side: str | None = None,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        allow_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> str | list[str] | torch.Tensor | list[torch.Tensor] | dict[str, Any] | TensorDictBase:
        """Render (and tokenise) the conversations with a chat template, optionally with exact assistant masks.

        Rendering is transformers' (``render_jinja_template``: same sandbox, same variables: the tokenizer's
        special tokens such as ``bos_token``, ``add_generation_prompt``, ``tools``, ``documents`` and any
        ``template_kwargs``). Tokenisation is ``tokenizer(text, add_special_tokens=False)`` as in transformers'
        ``apply_chat_template`` (templates render BOS themselves), so ``input_ids`` equal
        ``tokenizer.apply_chat_template(messages, chat_template=...)``.

        TorchRL's arguments and defaults (TorchRL 0.14): ``tokenizer`` (positional or keyword),
        ``add_generation_prompt=True``, ``chat_template_name``, ``tokenize=None``, ``padding=False``,
        ``truncation=False``, ``return_tensors=None``, ``return_dict=None``, ``return_assistant_tokens_mask=False``,
        ``continue_final_message`` through ``template_kwargs``. So ``history.apply_chat_template(tokenizer)`` is the
        prompt's text; lit_llm's own callers pass ``add_generation_prompt`` / ``tokenize`` / ``return_dict``
        explicitly.

        Args:
            tokenizer: a Hugging Face tokenizer (a fast one when masks are requested: offsets are needed).
            chat_template: a Jinja string, the path of a ``.jinja`` file, a registered template name
                (``lit_llm.data.template_registry``), the name of one of the tokenizer's templates, or ``None``:
                the tokenizer's own template; for a tokenizer without one, the registered template its
                ``name_or_path`` names (TorchRL's detection), else ChatML.
            chat_template_name: a registered template name (``"chatml_format"``, ``"qwen"``, ``"llama"``, ...);
                exclusive with ``chat_template``.
            add_generation_prompt: append the assistant header so a model can answer the last message (default
                ``True``, TorchRL's; pass ``False`` to render a finished conversation as it is trained on).
            tokenize: ``False`` returns the rendered text; ``None`` (TorchRL's default): ``True`` when
                ``return_assistant_tokens_mask`` or ``return_tensors`` is given, else ``False``.
            return_dict: ``False`` returns the ids only; ``None`` (TorchRL's default): a dict when masks are asked
                for, else the ids.
            return_assistant_tokens_mask: add ``assistant_masks`` (needs ``tokenize`` and ``return_dict``).
            padding: pad a batch to ``[B, T]`` with ``tokenizer.pad_token_id`` (masks are 0/False at padding).
            padding_side: ``"left"`` or ``"right"``; default ``tokenizer.padding_side``.
            truncation: keep the first ``max_length`` tokens of each conversation (ids and masks).
            max_length: see ``truncation``; default ``tokenizer.model_max_length``.
            return_tensors: ``None`` or ``"pt"`` (torch tensors either way).
            allow_special_tokens: explicit opt-in to let special-token strings typed inside message content
                (e.g. a literal ``"<|im_end|>"``) be tokenised as the control tokens they spell. Default ``False``
                raises instead (DESIGN.md property 8).
            **template_kwargs: reach the template as variables (``tools``, ``documents``, ``enable_thinking``, ...).

        Returns:
            For a History ``[n]`` (one conversation; ``padding`` has no effect): ``str`` (``tokenize=False``), a
            1-D long tensor ``[T]`` (``return_dict=False``) or a dict of 1-D tensors. For ``[B, n]``: a list of
            ``str``, a list of 1-D tensors, or (TorchRL's shape) a lazy stack of ``B`` per-row TensorDicts of
            batch size ``[T_b]`` (read a ragged key with ``td.get(key, as_list=True)``); with ``padding=True`` a
            dict of ``[B, T]`` tensors instead. The dict has ``input_ids`` (long), ``attention_mask`` (long 0/1) and,
            when asked, ``assistant_masks`` (bool, ``True`` on assistant-turn tokens, ``False`` on padding).

        Note:
            Property 8 checks message ``content`` only: strings inside ``tool_calls``, ``tools``, ``documents`` or
            other template variables are not checked.

        Raises:
            InvalidConversationError: unknown role, empty conversation (all padding), non-string content.
            SpecialTokenInContentError: a special-token string in a message's content (unless
                ``allow_special_tokens``); names the conversation, message index and token.
            ChatTemplateError: the template raised (its message is kept, e.g. roles that must alternate), or the
                assistant turns cannot be located in the render, or a slow tokenizer is given with masks.
            NoAssistantTokensError: masks requested for a conversation without any assistant token.
            UnknownChatTemplateError: an unknown template name (also a ``KeyError``, as in TorchRL).
            TokenizerRequiredError: ``tokenizer`` is ``None`` (also a ``RuntimeError``, as in TorchRL).
            ValueError: masks requested with ``tokenize=False`` or ``return_dict=False``; a History of more than
                2 dimensions.
        """
        if tokenize is None:  # TorchRL's rule
            tokenize = bool(return_assistant_tokens_mask) or return_tensors is not None
        if return_dict is None:  # TorchRL's rule (its None reaches transformers, which then returns the ids)
            return_dict = bool(tokenize and return_assistant_tokens_mask)
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError(
                "History.apply_chat_template: return_assistant_tokens_mask=True needs tokenize=True and "
                "return_dict=True."
            )
        if self.ndim > 2:
            raise ValueError(
                f"History.apply_chat_template: expected a History of shape [n] or [B, n], got {list(self.shape)}."
            )
        if return_tensors not in (None, "pt"):
            raise ValueError(f"History.apply_chat_template: return_tensors={return_tensors!r} is not supported; "
                             f"lit_llm returns torch tensors (return_tensors='pt' or None).")
        template, name = resolve_template(tokenizer, chat_template, template_kwargs.get("tools"),
                                          chat_template_name=chat_template_name)
        rows = self.to_chats() if self.ndim == 2 else [self.to_chats()]
        renderer = Renderer(tokenizer, template, name, template_kwargs)
        texts, spans = [], []
        for b, msgs in enumerate(rows):
            where = f"conversation {b}" if self.ndim == 2 else "the conversation"
            _validate_for_render(msgs, where)
            if not allow_special_tokens:
                _check_special_tokens(tokenizer, msgs, where)
            if return_assistant_tokens_mask:
                text, sp = _assistant_spans(renderer, msgs, add_generation_prompt=add_generation_prompt, where=where)
                spans.append(sp)
            else:
                text = renderer.render(msgs, add_generation_prompt)
            texts.append(text)
        if not tokenize:
            return texts if self.ndim == 2 else texts[0]
        outs = [_tokenize(tokenizer, t, sp if return_assistant_tokens_mask else None, name)
                for t, sp in zip(texts, spans or [None] * len(texts))]
        if truncation:
            limit = max_length if max_length is not None else getattr(tokenizer, "model_max_length", None)
            outs = [{k: v[:limit] for k, v in o.items()} for o in outs] if limit is not None else outs
        if return_assistant_tokens_mask:
            for b, o in enumerate(outs):
                if not bool(o["assistant_masks"].any()):
                    where = f"conversation {b}" if self.ndim == 2 else "the conversation"
                    raise NoAssistantTokensError(
                        f"History.apply_chat_template: {where} has no assistant tokens with template {name!r} "
                        f"(roles: {[m['role'] for m in rows[b]]}). Assistant masks need at least one assistant "
                        f"message; drop this conversation or add the assistant reply."
                    )
        if self.ndim < 2:
            result = outs[0]
        elif padding:
            result = _pad(outs, tokenizer, padding_side)
        elif not return_dict:
            return [o["input_ids"] for o in outs]
        else:  # TorchRL's shape: a lazy stack of per-row TensorDicts
            return lazy_stack([TensorDict(o, batch_size=[len(o["input_ids"])]) for o in outs])
        return result if return_dict else result["input_ids"]


# ---------------------------------------------------------------------- small helpers
def _clean_conversation(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r.get("role") == PAD_ROLE:
            continue
        d = {"role": r["role"], "content": r["content"]}
        if r.get("tool_calls") is not None:
            d["tool_calls"] = _plain(r["tool_calls"])
        for key in ("name", "tool_call_id"):
            if r.get(key) is not None:
                d[key] = r[key]
        if r.get("is_complete", True) is False:
            d["is_complete"] = False
        out.append(d)
    return out


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _as_history(cls: type, parsed: Any, index: int) -> History:
    """A parser's result (a message list, or a History from a custom ``inverse_parser``) as a History ``[n]``."""
    if not isinstance(parsed, (list, tuple)):
        return parsed
    if not parsed:
        raise ChatParseError(f"History.from_text: text {index} parsed into no message.")
    return cls.from_chats([dict(m) for m in parsed])
