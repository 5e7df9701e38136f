"""Conversation validation before rendering and the special-token check (DESIGN.md property 8).

Role and content checks shared by ``History.from_chats`` and ``History.apply_chat_template``, and the refusal of
special-token strings typed inside message content (``find_special_tokens``, ``_check_special_tokens``).
"""

from __future__ import annotations

from typing import Any

from lit_llm.data.errors import InvalidConversationError, SpecialTokenInContentError

__all__ = ["PAD_ROLE", "ROLES", "find_special_tokens"]

ROLES = ("system", "user", "assistant", "tool")
"""Roles a message may have."""

PAD_ROLE = "<none>"
"""Role of the padding messages of ragged batches; rendering skips them."""


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



def _short(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."
