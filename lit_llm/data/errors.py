"""Errors raised by the data layer, and the prefix check of DESIGN.md property 2."""

from __future__ import annotations

import torch

__all__ = [
    "ChatTemplateError",
    "InvalidConversationError",
    "NoAssistantTokensError",
    "PrefixMismatchError",
    "ChatParseError",
    "HistoryShapeError",
    "SpecialTokenInContentError",
    "TokenizerRequiredError",
    "UnknownChatTemplateError",
    "check_prefix",
]


class ChatTemplateError(ValueError):
    """A chat template could not render a conversation the way the caller needs."""


class InvalidConversationError(ValueError):
    """A conversation is malformed: unknown role, empty, missing key, non-string content."""


class NoAssistantTokensError(ChatTemplateError):
    """A conversation that must train on assistant tokens has none."""


class SpecialTokenInContentError(ValueError):
    """A special-token string (e.g. ``<|im_end|>``) appears inside message content (DESIGN.md property 8)."""


class UnknownChatTemplateError(ChatTemplateError, KeyError, NotImplementedError):
    """A chat template name that is not registered. Also a ``KeyError`` and a ``NotImplementedError``: what TorchRL
    raises for an unknown name in ``apply_chat_template`` and ``from_text``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TokenizerRequiredError(ChatTemplateError, RuntimeError):
    """A render without a tokenizer (its special tokens reach the template); a ``RuntimeError`` as in TorchRL."""


class HistoryShapeError(ValueError, RuntimeError):
    """``History.append`` / ``extend`` with the wrong number of dimensions; a ``RuntimeError`` as in TorchRL."""


class ChatParseError(InvalidConversationError, RuntimeError):
    """Text that does not parse as a conversation of the given template family; a ``RuntimeError`` as in TorchRL."""


class PrefixMismatchError(ChatTemplateError):
    """The prompt ids are not an exact prefix of the full ids (DESIGN.md property 2)."""


def check_prefix(prompt_ids: torch.Tensor, full_ids: torch.Tensor, *, template_name: str = "<unknown>") -> None:
    """Raise :class:`PrefixMismatchError` unless ``prompt_ids`` is an exact prefix of ``full_ids``.

    Args:
        prompt_ids: 1-D integer tensor ``[T_prompt]`` (no padding).
        full_ids: 1-D integer tensor ``[T_full]`` (no padding).
        template_name: named in the error message (a template file name or ``"tokenizer default"``).

    Raises:
        PrefixMismatchError: names the template and the first differing position.
    """
    p = prompt_ids.reshape(-1)
    f = full_ids.reshape(-1)
    n = min(p.numel(), f.numel())
    diff = (p[:n] != f[:n]).nonzero()
    if diff.numel():
        pos = int(diff[0])
        raise PrefixMismatchError(
            f"Chat template {template_name!r}: the prompt ids are not a prefix of the full conversation's ids; first "
            f"difference at token position {pos} (prompt id {int(p[pos])} vs full id {int(f[pos])}). The template "
            f"renders earlier turns differently once a reply follows, or a BPE merge crosses the prompt/response "
            f"boundary. Use masks from the full render (assistant mask) instead of slicing by prompt length."
        )
    if p.numel() > f.numel():
        raise PrefixMismatchError(
            f"Chat template {template_name!r}: the prompt ({p.numel()} tokens) is longer than the full conversation "
            f"({f.numel()} tokens), so it cannot be its prefix; first difference at token position {f.numel()}."
        )
