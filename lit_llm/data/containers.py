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
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorClass, lazy_stack

from lit_llm.data.errors import PrefixMismatchError, check_prefix

if TYPE_CHECKING:
    from lit_llm.data.history import History

__all__ = ["ChatHistory", "LogProbs", "Masks", "Text", "Tokens", "template_display_name"]


# ----------------------------------------------------------------------------------------------------------- helpers
def template_display_name(chat_template: str | os.PathLike | None) -> str:
    """A short name for a chat template, used in error messages (as ``History.apply_chat_template`` names it).

    Args:
        chat_template: a path to a ``.jinja`` file (-> its file name), a Jinja string (-> ``"<inline template>"``)
            or ``None`` (-> ``"tokenizer default"``).

    Returns:
        The name.
    """
    if chat_template is None:
        return "tokenizer default"
    if isinstance(chat_template, os.PathLike) or ("{" not in chat_template and chat_template.endswith(".jinja")):
        return os.path.basename(os.fspath(chat_template))
    if "{" not in chat_template:
        return chat_template  # a named template of the tokenizer
    return "<inline template>"


def _is_batched(obj: TensorClass) -> bool:
    return obj.batch_dims > 0


def _rows(obj: TensorClass) -> list:
    if obj.batch_dims != 1:
        raise ValueError(
            f"{type(obj).__name__} conversion: expected one item (batch_size=[]) or a batch (batch_size=[B]), got "
            f"batch_size={list(obj.batch_size)}; reshape or index it first."
        )
    return list(obj.unbind(0))


_TEXT_FIX = "Build the full text as prompt + response, or pass the response instead of the full text."
_TEMPLATE_FIX = (
    "The template renders the conversation differently once a reply follows; use a template whose generation "
    "prompt is a prefix of the rendered reply, or masks from the full render (assistant mask) instead of slicing."
)


def _text_prefix_error(prompt: str, full: str, what: str, fix: str = _TEXT_FIX) -> PrefixMismatchError:
    n = min(len(prompt), len(full))
    pos = next((i for i in range(n) if prompt[i] != full[i]), n)
    return PrefixMismatchError(
        f"{what}: the prompt text is not a prefix of the full text; first difference at character position {pos} "
        f"(prompt {prompt[pos:pos + 20]!r} vs full {full[pos:pos + 20]!r}). {fix}"
    )


def _as_long_1d(ids: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(ids)
    if t.dim() != 1:
        raise ValueError(f"Tokens.{name}: expected a 1-D id tensor per item, got shape {list(t.shape)}.")
    return t.to(torch.long)


# -------------------------------------------------------------------------------------------------------- containers
class Text(TensorClass["nocast"]):
    """Text of a prompt, its response and the full sequence.

    Attributes:
        prompt: the prompt text (e.g. a rendered chat with the generation prompt). ``str`` per item; a batch holds
            ``B`` strings (``td.prompt`` is then a list-like of ``str``).
        response: the response text (what follows the prompt). ``str`` per item.
        full: ``prompt + response``. ``str`` per item.
    """

    prompt: str | None = None
    response: str | None = None
    full: str | None = None

    def to_tokens(self, tokenizer: Any) -> Tokens:
        """Tokenize: ``full`` once, ``prompt`` once, ``response`` = full ids minus the prompt ids.

        Special tokens are not added (``add_special_tokens=False``): the texts are expected to be rendered chats that
        already carry them. ``full`` defaults to ``prompt + response`` when absent; ``response`` is never tokenized
        on its own, so ``tokens.full == cat(tokens.prompt, tokens.response)`` (DESIGN.md property 1).

        Args:
            tokenizer: a Hugging Face tokenizer.

        Returns:
            :class:`Tokens` with 1-D ``torch.long`` fields (``padded=False``); a lazy stack of them for a batch.
            ``response`` is ``None`` when neither ``response`` nor ``full`` is set.

        Raises:
            ValueError: ``prompt`` is missing.
            PrefixMismatchError: the prompt text is not a prefix of ``full`` (position in characters), or its ids
                are not a prefix of the full ids (a BPE merge across the boundary; position in tokens).
        """
        if _is_batched(self):
            return lazy_stack([row.to_tokens(tokenizer) for row in _rows(self)])
        prompt, full = self.prompt, self._full_text("Text.to_tokens")
        prompt_ids = _encode(tokenizer, prompt)
        if full is None:
            return Tokens(prompt=prompt_ids, padded=False)
        full_ids = _encode(tokenizer, full)
        check_prefix(prompt_ids, full_ids, template_name="<text: Text.to_tokens>")
        return Tokens(prompt=prompt_ids, response=full_ids[prompt_ids.numel():], full=full_ids, padded=False)

    def to_history(self, chat_template_name: str) -> ChatHistory:
        """Parse the texts back into messages (see :func:`lit_llm.data.chat_parsing.parse_chat_text`).

        ``prompt`` is parsed with its trailing generation prompt (an empty, unfinished assistant turn) removed;
        ``full`` (``prompt + response`` when absent) is parsed whole; ``response`` is the messages of ``full`` after
        the prompt's messages (an unfinished final reply has ``is_complete=False``).

        Args:
            chat_template_name: the template family (``"chatml"``, ``"llama3"``, ...).

        Returns:
            :class:`ChatHistory` with 1-D histories ``[n_messages]``; a lazy stack of them for a batch.

        Raises:
            ValueError: ``prompt`` is missing, the family is unknown, or the text is not a rendered chat of it.
            PrefixMismatchError: the prompt text is not a prefix of ``full``.
        """
        from lit_llm.data.chat_parsing import parse_chat_text
        from lit_llm.data.history import History

        if _is_batched(self):
            return lazy_stack([row.to_history(chat_template_name) for row in _rows(self)])
        full = self._full_text("Text.to_history")
        prompt_msgs = parse_chat_text(self.prompt, chat_template_name)
        if prompt_msgs and prompt_msgs[-1]["role"] == "assistant" and not prompt_msgs[-1]["content"]:
            prompt_msgs = prompt_msgs[:-1]  # the generation prompt, not a message
        out = ChatHistory(prompt=History.from_chats(prompt_msgs) if prompt_msgs else None)
        if full is not None:
            full_msgs = parse_chat_text(full, chat_template_name)
            out.full = History.from_chats(full_msgs)
            resp_msgs = full_msgs[len(prompt_msgs):]
            if resp_msgs:
                out.response = History.from_chats(resp_msgs)
        return out

    def _full_text(self, what: str) -> str | None:
        if self.prompt is None:
            raise ValueError(f"{what}: the 'prompt' field is None; set Text(prompt=...) first.")
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

    def to_text(self, tokenizer: Any) -> Text:
        """Decode the ids, keeping special tokens (``skip_special_tokens=False``).

        ``full`` defaults to ``cat(prompt, response)``; when both ``prompt`` and ``full`` are set, ``response`` text
        is the decoded full text minus the decoded prompt text.

        Args:
            tokenizer: a Hugging Face tokenizer.

        Returns:
            :class:`Text`; a lazy stack of them for a batch.

        Raises:
            ValueError: the tokens are padded (unpad them first: the pad id can equal the end-of-turn id).
        """
        if _is_batched(self):
            return lazy_stack([row.to_text(tokenizer) for row in _rows(self)])
        if self.padded:
            raise ValueError("Tokens.to_text: padded=True; decode unpadded tokens (a lazy stack), as pad == eos.")

        def dec(t: torch.Tensor | None) -> str | None:
            return None if t is None else tokenizer.decode(_as_long_1d(t, "ids").tolist(), skip_special_tokens=False)

        full = self.full
        if full is None and self.prompt is not None and self.response is not None:
            full = torch.cat([_as_long_1d(self.prompt, "prompt"), _as_long_1d(self.response, "response")])
        prompt_text, full_text = dec(self.prompt), dec(full)
        response_text = dec(self.response)
        if prompt_text is not None and full_text is not None:
            if not full_text.startswith(prompt_text):
                raise _text_prefix_error(prompt_text, full_text, "Tokens.to_text")
            response_text = full_text[len(prompt_text):]
        return Text(prompt=prompt_text, response=response_text, full=full_text)

    def to_history(self, tokenizer: Any, chat_template_name: str) -> ChatHistory:
        """Decode (:meth:`to_text`) then parse (:meth:`Text.to_history`).

        Args:
            tokenizer: a Hugging Face tokenizer.
            chat_template_name: the template family (``"chatml"``, ``"llama3"``, ...).

        Returns:
            :class:`ChatHistory`; a lazy stack of them for a batch.
        """
        return self.to_text(tokenizer).to_history(chat_template_name)


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

    def to_text(self, tokenizer: Any, chat_template: str | os.PathLike | None = None, **template_kwargs: Any) -> Text:
        """Render: prompt with the generation prompt, full without; response = full text minus the prompt text.

        Args:
            tokenizer: a Hugging Face tokenizer.
            chat_template: a Jinja string or a ``.jinja`` path; ``None`` for the tokenizer's own.
            **template_kwargs: passed to :meth:`History.apply_chat_template` (e.g. ``enable_thinking``).

        Returns:
            :class:`Text`; a lazy stack of them for a batch.

        Raises:
            ValueError: ``prompt`` is missing.
            PrefixMismatchError: the rendered prompt is not a prefix of the rendered full conversation (names the
                template and the character position).
        """
        if _is_batched(self):
            return lazy_stack([row.to_text(tokenizer, chat_template, **template_kwargs) for row in _rows(self)])
        full_h = self._full_history("ChatHistory.to_text")
        kw = dict(chat_template=chat_template, tokenize=False, **template_kwargs)
        prompt = self.prompt.apply_chat_template(tokenizer, add_generation_prompt=True, **kw)
        if full_h is None:
            return Text(prompt=prompt)
        full = full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw)
        if not full.startswith(prompt):
            raise _text_prefix_error(
                prompt, full, f"Chat template {template_display_name(chat_template)!r}", _TEMPLATE_FIX
            )
        return Text(prompt=prompt, response=full[len(prompt):], full=full)

    def to_tokens(
        self, tokenizer: Any, chat_template: str | os.PathLike | None = None, **template_kwargs: Any
    ) -> Tokens:
        """Tokenize: prompt rendered with the generation prompt, full rendered without; response by ids.

        ``response`` = the full ids minus the prompt ids, after checking with
        :func:`~lit_llm.data.errors.check_prefix` that the prompt ids are an exact prefix (DESIGN.md property 2);
        so ``tokens.full == cat(tokens.prompt, tokens.response)``.

        Args:
            tokenizer: a Hugging Face tokenizer.
            chat_template: a Jinja string or a ``.jinja`` path; ``None`` for the tokenizer's own.
            **template_kwargs: passed to :meth:`History.apply_chat_template` (e.g. ``enable_thinking``,
                ``allow_special_tokens``).

        Returns:
            :class:`Tokens` with 1-D ``torch.long`` fields and ``padded=False``; a lazy stack for a batch.
            ``response`` and ``full`` are ``None`` when neither ``full`` nor ``response`` is set.

        Raises:
            ValueError: ``prompt`` is missing.
            PrefixMismatchError: the prompt ids are not a prefix of the full ids (names the template and position),
                e.g. Qwen3 removing the reasoning of earlier assistant turns once a reply follows.
        """
        if _is_batched(self):
            return lazy_stack([row.to_tokens(tokenizer, chat_template, **template_kwargs) for row in _rows(self)])
        full_h = self._full_history("ChatHistory.to_tokens")
        kw = dict(chat_template=chat_template, tokenize=True, return_dict=False, **template_kwargs)
        prompt_ids = _as_long_1d(self.prompt.apply_chat_template(tokenizer, add_generation_prompt=True, **kw), "prompt")
        if full_h is None:
            return Tokens(prompt=prompt_ids, padded=False)
        full_ids = _as_long_1d(full_h.apply_chat_template(tokenizer, add_generation_prompt=False, **kw), "full")
        check_prefix(prompt_ids, full_ids, template_name=template_display_name(chat_template))
        return Tokens(prompt=prompt_ids, response=full_ids[prompt_ids.numel():], full=full_ids, padded=False)

    def _full_history(self, what: str) -> History | None:
        if self.prompt is None:
            raise ValueError(f"{what}: the 'prompt' field is None; set ChatHistory(prompt=History...) first.")
        if self.full is not None:
            return self.full
        if self.response is None:
            return None
        return self.prompt.extend(self.response, inplace=False)


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.long)
