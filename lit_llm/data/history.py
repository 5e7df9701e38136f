"""Chat messages as a tensorclass, chat-template rendering and exact assistant masks (DESIGN.md properties 3 and 8).

A :class:`History` holds chat messages batched as ``[n_messages]`` (one conversation) or ``[B, n_messages]``
(B conversations; ragged ones are padded with messages of role ``"<none>"`` that rendering skips). Names follow
TorchRL's ``torchrl.data.llm.History``.

Assistant masks (``History.apply_chat_template(..., return_assistant_tokens_mask=True)``) mark, for each assistant
message, the tokens a model generates for that turn: everything after the generation prompt up to and including
the end-of-turn text, never a separator rendered after it. Two sources of character spans:

* templates with ``{% generation %}`` markers: transformers' own tracker (``render_jinja_template``);
* any other Jinja template: spans derived from renders of the conversation's prefixes (see ``_assistant_spans``).

Characters map to tokens with the fast tokenizer's offset mapping; a token whose characters overlap a span is in
the mask (as in transformers' ``apply_chat_template``), so a BPE merge of a template newline with leading spaces of
the content (``ĊĠ``) puts that token in the mask.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorClass, lazy_stack

from lit_llm.data.errors import (
    ChatTemplateError,
    InvalidConversationError,
    NoAssistantTokensError,
    SpecialTokenInContentError,
)

__all__ = ["PAD_ROLE", "ROLES", "STOP_STRINGS", "History", "find_special_tokens"]

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have."""

PAD_ROLE = "<none>"
"""Role of the padding messages of ragged batches; rendering skips them."""

MESSAGE_KEYS = ("role", "content", "is_complete", "tool_calls")

STOP_STRINGS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>",
    "<｜end▁of▁sentence｜>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|return|>", "<|call|>",
)
"""End-of-turn texts of common template families (the tokenizer's ``eos_token`` is added at run time)."""


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
            "arguments": ...}}``) passed to the template as ``message.tool_calls``; default ``None``.
    """

    role: str
    content: str
    is_complete: bool = True
    tool_calls: list | None = None

    # ------------------------------------------------------------------ construction / conversion
    @classmethod
    def from_chats(cls, chats: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]) -> History:
        """Build a History from one conversation (``list[dict]``) or several (``list[list[dict]]``).

        Args:
            chats: messages are dicts with keys ``role`` (str, one of :data:`ROLES`) and ``content`` (str), and
                optionally ``is_complete`` (bool) and ``tool_calls`` (list or None). No other key is accepted.

        Returns:
            History of shape ``[n_messages]`` for one conversation, ``[B, max_n_messages]`` for B conversations
            (shorter rows padded at the end with role ``"<none>"``).

        Raises:
            InvalidConversationError: empty input or conversation, a message that is not a dict, a missing or
                unknown key, an unknown role, non-string content, a non-bool ``is_complete``, a non-list
                ``tool_calls``. The message names the conversation index, the message index and the key.
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
        return cls(role=m["role"], content=m["content"], is_complete=is_complete, tool_calls=tool_calls)

    @classmethod
    def from_text(cls, texts: str | Sequence[str], chat_template_name: str) -> History:
        """Parse rendered conversations back into messages (delegates to ``lit_llm.data.chat_parsing``).

        Args:
            texts: one rendered conversation, or a list of them.
            chat_template_name: the template family, as accepted by
                ``lit_llm.data.chat_parsing.parse_chat_text`` (e.g. ``"chatml"``).

        Returns:
            History ``[n_messages]`` for one text, ``[B, max_n_messages]`` (``"<none>"``-padded) for a list.

        Raises:
            whatever ``parse_chat_text`` raises for text it cannot parse; InvalidConversationError when it yields
            no message.
        """
        from lit_llm.data.chat_parsing import parse_chat_text

        if isinstance(texts, str):
            return cls.from_chats(_nonempty(parse_chat_text(texts, chat_template_name), 0))
        return cls.from_chats([_nonempty(parse_chat_text(t, chat_template_name), i) for i, t in enumerate(texts)])

    def to_chats(self) -> list[dict] | list[list[dict]]:
        """The messages as dicts, padding (``"<none>"``) dropped.

        Returns:
            ``list[dict]`` for a History of shape ``[n]`` (or ``[]``), ``list[list[dict]]`` for ``[B, n]``. Each dict
            has ``role`` and ``content``, plus ``tool_calls`` when set and ``is_complete`` when ``False``.
        """
        if self.ndim > 2:
            raise ValueError(f"History.to_chats: expected a History of shape [n] or [B, n], got {list(self.shape)}.")
        h = self.unsqueeze(0) if self.ndim == 0 else self
        data = h.tolist()
        if self.ndim == 2:
            return [_clean_conversation(row) for row in data]
        return _clean_conversation(data)

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
            ValueError: ``self`` has no batch dimension, or the dimensions do not match.
        """
        if self.ndim == 0:
            raise ValueError("History.append: self has no batch dimension; call history.unsqueeze(0) first.")
        if other.ndim != self.ndim - 1:
            raise ValueError(
                f"History.append: other must have one dimension less than self (self {list(self.shape)}, other "
                f"{list(other.shape)}); use extend() to add several messages."
            )
        dim = dim % self.ndim
        return self._replace(lazy_stack([*self.unbind(dim), other], dim=dim), inplace)

    def extend(self, other: History, *, inplace: bool = True, dim: int = -1) -> History:
        """Concatenate ``other`` (same number of dimensions) to ``self`` along ``dim``.

        Args:
            other: History with ``other.ndim == self.ndim`` and matching sizes on the other dimensions.
            inplace: modify ``self`` (and return it) or return a new History.
            dim: the dimension to grow (``-1``: messages; ``0`` on a ``[B, n]`` History: conversations).

        Raises:
            ValueError: ``self`` has no batch dimension, or the dimensions do not match.
        """
        if self.ndim == 0:
            raise ValueError("History.extend: self has no batch dimension; call history.unsqueeze(0) first.")
        if other.ndim != self.ndim:
            raise ValueError(
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
        tokenizer: Any,
        *,
        chat_template: str | os.PathLike | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        return_assistant_tokens_mask: bool = False,
        padding: bool = False,
        padding_side: str | None = None,
        allow_special_tokens: bool = False,
        **template_kwargs: Any,
    ) -> str | list[str] | torch.Tensor | list[torch.Tensor] | dict[str, Any]:
        """Render (and tokenise) the conversations with a chat template, optionally with exact assistant masks.

        Rendering is transformers' (``render_jinja_template``: same sandbox, same variables: the tokenizer's
        special tokens such as ``bos_token``, ``add_generation_prompt``, ``tools``, ``documents`` and any
        ``template_kwargs``). Tokenisation is ``tokenizer(text, add_special_tokens=False)`` as in transformers'
        ``apply_chat_template`` (templates render BOS themselves), so ``input_ids`` equal
        ``tokenizer.apply_chat_template(messages, chat_template=...)``.

        Args:
            tokenizer: a Hugging Face tokenizer (a fast one when masks are requested: offsets are needed).
            chat_template: a Jinja string, the path of a ``.jinja`` file, the name of one of the tokenizer's
                templates, or ``None`` for the tokenizer's own template.
            add_generation_prompt: append the assistant header so a model can answer the last message.
            tokenize: ``False`` returns the rendered text.
            return_dict: ``False`` returns the ids only.
            return_assistant_tokens_mask: add ``assistant_masks`` (needs ``tokenize`` and ``return_dict``).
            padding: pad a batch to ``[B, T]`` with ``tokenizer.pad_token_id`` (masks are 0/False at padding).
            padding_side: ``"left"`` or ``"right"``; default ``tokenizer.padding_side``.
            allow_special_tokens: explicit opt-in to let special-token strings typed inside message content
                (e.g. a literal ``"<|im_end|>"``) be tokenised as the control tokens they spell. Default ``False``
                raises instead (DESIGN.md property 8).
            **template_kwargs: reach the template as variables (``tools``, ``documents``, ``enable_thinking``, ...).

        Returns:
            For a History ``[n]`` (one conversation; ``padding`` has no effect): ``str`` (``tokenize=False``), a
            1-D long tensor ``[T]`` (``return_dict=False``) or a dict of 1-D tensors. For ``[B, n]``: a list of
            ``str``, a list of 1-D tensors, or a dict of lists of 1-D tensors; with ``padding=True`` ``[B, T]``
            tensors instead. The dict has ``input_ids`` (long), ``attention_mask`` (long 0/1) and, when asked,
            ``assistant_masks`` (bool, ``True`` on assistant-turn tokens, ``False`` on padding).

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
            ValueError: masks requested with ``tokenize=False`` or ``return_dict=False``; a History of more than
                2 dimensions.
        """
        if return_assistant_tokens_mask and not (tokenize and return_dict):
            raise ValueError(
                "History.apply_chat_template: return_assistant_tokens_mask=True needs tokenize=True and "
                "return_dict=True."
            )
        if self.ndim > 2:
            raise ValueError(
                f"History.apply_chat_template: expected a History of shape [n] or [B, n], got {list(self.shape)}."
            )
        template, name = _resolve_template(tokenizer, chat_template, template_kwargs.get("tools"))
        rows = self.to_chats() if self.ndim == 2 else [self.to_chats()]
        renderer = _Renderer(tokenizer, template, name, template_kwargs)
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
        else:
            result = {key: [o[key] for o in outs] for key in outs[0]}
        return result if return_dict else result["input_ids"]


# ---------------------------------------------------------------------- assistant spans
def _assistant_spans(
    renderer: _Renderer, messages: list[dict], *, add_generation_prompt: bool = False, where: str = "the conversation"
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the character span ``[start, end)`` of each assistant turn in that render.

    With ``{% generation %}`` markers in the template the spans are transformers' (the marked blocks). Otherwise,
    with ``F`` the full render and ``T(msgs, gp)`` a render of a message list (``gp`` = add_generation_prompt),
    for assistant message ``i``:

    * start: ``len(T(messages[:i], gp=True))`` when that render is a prefix of ``F``. When it is not (templates
      that render a turn differently once it is followed by a reply, e.g. DeepSeek-V3 drops the ``<think>\\n``
      opened by its generation prompt), the span starts after the longest prefix of the generation prompt
      (``T(messages[:i], gp=True)`` minus ``T(messages[:i], gp=False)``) found in ``F`` between the previous
      span's end and the start of message ``i``'s content: the part of the generation prompt the full render
      agrees with is prompt, the rest of the turn is generated. When the template cannot render ``messages[:i]``
      at all (Qwen3 on an empty list, for a conversation opening with an assistant message), the generation prompt
      is taken from a one-user-message probe conversation instead.
    * content end: message ``i`` is rendered with a private-use marker (one absent from the conversation, the
      template and its variables) appended to its content; the text after the marker is the template's text after
      the content, so the content ends ``len(that text)`` before the end of ``F`` (exact even when the template
      trims or rewrites the content, e.g. Qwen3 dropping old reasoning).
    * end: the end-of-turn text is the common prefix of the text after the content in ``F``, in
      ``T(messages[:i+1])`` and in ``T(messages[:i+1] + [probe user message])`` (this drops a document-end token
      such as Phi-3.5's final ``eos_token``). The span ends after the last stop string (:data:`STOP_STRINGS` or
      the tokenizer's ``eos_token``) in that text, else after it with trailing whitespace removed. So the stop
      token is in, a separator newline after it is out; a template without end-of-turn text (falcon-instruct)
      gets the content only, and a model trained on it cannot learn to stop.

    Args:
        renderer: the template renderer (tokenizer, template, template kwargs).
        messages: one conversation without padding.
        add_generation_prompt: passed to the full render.
        where: names the conversation in errors.

    Returns:
        ``(F, spans)``: the full render and one ``(start, end)`` per assistant message, in order.

    Raises:
        ChatTemplateError: the template raised, or a turn cannot be located in the full render.
    """
    if renderer.has_generation_markers:
        return renderer.render_with_generation_indices(messages, add_generation_prompt)
    full = renderer.render(messages, add_generation_prompt)
    stops = tuple(dict.fromkeys((*STOP_STRINGS, *([renderer.eos] if renderer.eos else []))))
    start_mark, end_mark, probe_user = _markers(renderer, messages)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        probe = dict(m, content=start_mark + m["content"] + end_mark)
        full_probe = renderer.render([*messages[:i], probe, *messages[i + 1:]], add_generation_prompt)
        mark = full_probe.find(end_mark, prev_end)
        tail_full = full_probe[mark + 1:]
        if mark < 0 or not full.endswith(tail_full):
            raise ChatTemplateError(
                f"Chat template {renderer.name!r}: cannot locate the content of assistant message {i} of {where} in "
                f"the render (the template does not render the content verbatim). Use a template with "
                f"{{% generation %}} markers for this model."
            )
        content_end = len(full) - len(tail_full)
        content_start = full_probe.find(start_mark, prev_end, mark)
        content_start = content_end if content_start < 0 else min(content_start, content_end)
        start = _span_start(renderer, messages, i, full, prev_end, content_start, where, probe_user)
        # End-of-turn text: what follows the content in every continuation of the turn.
        last = renderer.render([*messages[:i], probe], False)
        tails = [tail_full, last[last.rfind(end_mark) + 1:]]
        try:
            nxt = renderer.render([*messages[:i], probe, {"role": "user", "content": probe_user}], False)
            tails.append(nxt[nxt.rfind(end_mark) + 1:])
        except ChatTemplateError:
            pass
        eot = os.path.commonprefix(tails)
        cut = max((eot.rfind(s) + len(s) for s in stops if s in eot), default=len(eot.rstrip()))
        end = content_end + cut
        if not prev_end <= start <= end:
            raise ChatTemplateError(
                f"Chat template {renderer.name!r}: assistant message {i} of {where} maps to characters "
                f"[{start}, {end}), which overlap the previous assistant turn (ending at {prev_end})."
            )
        spans.append((start, end))
        prev_end = end
    return full, spans


def _span_start(renderer: _Renderer, messages: list[dict], i: int, full: str, prev_end: int, content_start: int,
                where: str, probe_user: str) -> int:
    prompt = renderer.render(messages[:i], True, empty_ok=True)
    if prompt is not None and full.startswith(prompt) and prev_end <= len(prompt) <= content_start:
        return len(prompt)
    # The template renders this turn differently once it is followed by a reply: find the generation prompt.
    before = renderer.render(messages[:i], False, empty_ok=True)
    if prompt is None or before is None:  # the template cannot render messages[:i] (e.g. Qwen3 on no message)
        probe = [{"role": "user", "content": probe_user}]
        prompt, before = renderer.render(probe, True, empty_ok=True), renderer.render(probe, False, empty_ok=True)
    gen = "" if prompt is None or before is None else prompt[len(os.path.commonprefix([prompt, before])):]
    for k in range(len(gen), 0, -1):
        pos = full.rfind(gen[:k], prev_end, content_start)
        if pos >= 0:
            return pos + k
    raise ChatTemplateError(
        f"Chat template {renderer.name!r}: the generation prompt {gen!r} (render of messages[:{i}] with "
        f"add_generation_prompt=True minus the one without) is not found before assistant message {i} of {where} in "
        f"the full render, so its turn cannot be delimited. Use a template with {{% generation %}} markers."
    )


def _markers(renderer: _Renderer, messages: list[dict]) -> tuple[str, str, str]:
    """Three private-use characters (never whitespace, never changed by Jinja filters) that occur nowhere in the
    conversation, the template or its variables: ``(start mark, end mark, probe user content)``."""
    used: set[str] = set()
    stack: list[Any] = [renderer.template, messages, renderer.tools, renderer.documents, renderer.variables]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            used.update(x)
        elif isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
    return next(free), next(free), next(free)


# ---------------------------------------------------------------------- rendering helpers
class _Renderer:
    """Renders message lists with one template exactly as transformers' ``apply_chat_template`` does."""

    def __init__(self, tokenizer: Any, template: str, name: str, template_kwargs: dict[str, Any]):
        import re

        self.name = name
        self.template = template
        kwargs = dict(template_kwargs)
        self.tools = kwargs.pop("tools", None)
        self.documents = kwargs.pop("documents", None)
        self.variables = {**tokenizer.special_tokens_map, **kwargs}
        self.eos = getattr(tokenizer, "eos_token", None)
        self.has_generation_markers = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None

    def _call(self, messages: list[dict], add_generation_prompt: bool, with_indices: bool):
        from jinja2.exceptions import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, indices = render_jinja_template(
                conversations=[messages], tools=self.tools, documents=self.documents, chat_template=self.template,
                return_assistant_tokens_mask=with_indices, add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"Chat template {self.name!r} raised: {e}") from e
        return texts[0], (indices[0] if with_indices else None)

    def render(self, messages: list[dict], add_generation_prompt: bool, *, empty_ok: bool = False) -> str | None:
        """Render; with ``empty_ok``, a template failing on an (empty) prefix gives ``None``."""
        try:
            return self._call(messages, add_generation_prompt, False)[0]
        except (ChatTemplateError, TypeError, IndexError, KeyError):
            if empty_ok:
                return None
            raise

    def render_with_generation_indices(self, messages: list[dict], add_generation_prompt: bool):
        text, indices = self._call(messages, add_generation_prompt, True)
        return text, [tuple(ix) for ix in indices]


def _resolve_template(tokenizer: Any, chat_template: str | os.PathLike | None, tools: Any) -> tuple[str, str]:
    """Return ``(template_text, name)``; ``name`` is used in error messages."""
    if chat_template is None:
        return tokenizer.get_chat_template(None, tools), "tokenizer default"
    if isinstance(chat_template, os.PathLike) or (
        isinstance(chat_template, str) and "{" not in chat_template and chat_template.endswith(".jinja")
    ):
        path = Path(chat_template)
        if not path.is_file():
            raise ChatTemplateError(
                f"chat_template={str(chat_template)!r} looks like a .jinja path but no such file exists. Pass an "
                f"existing .jinja file or the Jinja template text itself."
            )
        return path.read_text(encoding="utf-8"), path.name
    if not isinstance(chat_template, str):
        raise ChatTemplateError(f"chat_template must be a str or a path, got {type(chat_template).__name__}.")
    named = getattr(tokenizer, "chat_template", None)
    named = named if isinstance(named, dict) else {}
    if chat_template in named:
        return named[chat_template], chat_template
    if "{" not in chat_template:  # no Jinja tag or expression: a name or a path, never a template
        if Path(chat_template).is_file():
            return Path(chat_template).read_text(encoding="utf-8"), Path(chat_template).name
        raise ChatTemplateError(
            f"chat_template={chat_template!r} is not a Jinja template (it has no '{{'), not an existing file and not "
            f"one of the tokenizer's named templates ({sorted(named) or 'none'}). Pass the template text, the path of "
            f"a .jinja file, or None for the tokenizer's own template."
        )
    return chat_template, "<inline template>"


def find_special_tokens(tokenizer: Any, text: str) -> list[str]:
    """Special-token strings of ``tokenizer`` (its special tokens and special added tokens) occurring in ``text``.

    Returns:
        The tokens found, longest first (no duplicates).
    """
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(getattr(tok, "content", tok)))
    return [t for t in sorted(found, key=lambda t: (-len(t), t)) if t and t in text]


def _check_special_tokens(tokenizer: Any, messages: list[dict], where: str) -> None:
    for j, m in enumerate(messages):
        hits = find_special_tokens(tokenizer, m["content"])
        if hits:
            raise SpecialTokenInContentError(
                f"History.apply_chat_template: message {j} ({m['role']}) of {where} contains the special-token "
                f"string {hits[0]!r} in its content; it would be tokenised as a control token (DESIGN.md property "
                f"8). Remove or escape it, or pass allow_special_tokens=True to tokenise it as the control token "
                f"on purpose."
            )


def _validate_for_render(messages: list[dict], where: str) -> None:
    if not messages:
        raise InvalidConversationError(
            f"History.apply_chat_template: {where} is empty (only '<none>' padding). Every conversation needs at "
            f"least one message."
        )
    for j, m in enumerate(messages):
        _check_role(m.get("role"), f"History.apply_chat_template: {where}, message {j}", allow_pad=False)
        _check_content(m.get("content"), f"History.apply_chat_template: {where}, message {j}")


def _check_role(role: Any, where: str, *, allow_pad: bool) -> None:
    if role in ROLES or (allow_pad and role == PAD_ROLE):
        return
    raise InvalidConversationError(
        f"{where}: unknown role {role!r} (key 'role'). Allowed roles: {list(ROLES)}"
        + (f" (and {PAD_ROLE!r} for padding)." if allow_pad else ".")
    )


def _check_content(content: Any, where: str) -> None:
    if not isinstance(content, str):
        raise InvalidConversationError(
            f"{where}: 'content' must be a str, got {type(content).__name__} ({_short(content)}). Convert it to "
            f"text; use '' for a tool-call-only message."
        )


# ---------------------------------------------------------------------- tokenisation helpers
def _tokenize(tokenizer: Any, text: str, spans: list[tuple[int, int]] | None, name: str) -> dict[str, torch.Tensor]:
    if spans is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids_t = torch.tensor(ids, dtype=torch.long)
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"Assistant masks need a fast tokenizer (offset mappings); {type(tokenizer).__name__} is not. Load it "
            f"with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_t = torch.tensor(enc["input_ids"], dtype=torch.long)
    mask = torch.zeros(len(ids_t), dtype=torch.bool)
    for t, (a, b) in enumerate(enc["offset_mapping"]):
        # A token is in when its characters [a, b) overlap a span [s, e); zero-width tokens are never in.
        mask[t] = any(a < e and b > s for s, e in spans)
    return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t), "assistant_masks": mask}


def _pad(outs: list[dict[str, torch.Tensor]], tokenizer: Any, padding_side: str | None) -> dict[str, torch.Tensor]:
    side = padding_side or getattr(tokenizer, "padding_side", "right")
    if side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}.")
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        raise ValueError("padding=True needs tokenizer.pad_token_id; set tokenizer.pad_token (e.g. to eos_token).")
    length = max(len(o["input_ids"]) for o in outs)
    result = {}
    for key in outs[0]:
        value = pad_id if key == "input_ids" else 0
        rows = []
        for o in outs:
            x = o[key]
            fill = torch.full((length - len(x),), value, dtype=x.dtype)
            rows.append(torch.cat([fill, x] if side == "left" else [x, fill]))
        result[key] = torch.stack(rows)
    return result


# ---------------------------------------------------------------------- small helpers
def _clean_conversation(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r.get("role") == PAD_ROLE:
            continue
        d = {"role": r["role"], "content": r["content"]}
        if r.get("tool_calls") is not None:
            d["tool_calls"] = _plain(r["tool_calls"])
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


def _nonempty(messages: list[dict], index: int) -> list[dict]:
    if not messages:
        raise InvalidConversationError(f"History.from_text: text {index} parsed into no message.")
    return messages


def _short(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."
