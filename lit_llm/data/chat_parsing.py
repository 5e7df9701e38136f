"""Parse rendered chat text back into messages: the engine behind ``History.from_text``.

One parser per template family. Each reads the turn markers the family's templates write and returns the
messages in order, as ``{"role": str, "content": str, "is_complete": bool}`` dicts. The content is exactly the
text between a turn's header and its end-of-turn marker (no trimming): what a template changed on purpose
(trimmed content, a default system prompt, a system message folded into the first user turn) stays changed.

A final turn without its end-of-turn marker (an unfinished generation, or a bare generation prompt such as
``"<|im_start|>assistant\\n"``, which parses as an empty assistant message) has ``is_complete=False``.

Families (names accepted by :func:`parse_chat_text`; formats as rendered by the templates in
``lit_llm/data/templates`` and ``tests/fixtures/chat_templates``):

=================  ==========================================================================================
name(s)            turn format
=================  ==========================================================================================
chatml, smollm2,   ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (``<|endoftext|>`` also ends a turn)
chatml_format,
qwen, qwen3,
qwen2.5-instruct
llama              Llama 4: ``<|header_start|>{role}<|header_end|>\\n\\n{content}<|eot|>``
llama3             ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`` (or ``<|eom_id|>``);
                   role ``ipython`` -> ``tool``
mistral, llama2    ``[INST] {user} [/INST] {assistant}{eos}``; system as ``{system}\\n\\n`` before the first
                   ``[INST]`` (Mistral) or as ``<<SYS>>\\n{system}\\n<</SYS>>\\n\\n`` opening the first user turn
                   (Llama-2), both returned as a ``system`` message; ``llama2`` also drops the space the template
                   writes before ``{eos}``
gemma              ``<start_of_turn>{role}\\n{content}<end_of_turn>\\n``; role ``model`` -> ``assistant``
phi3               ``<|{role}|>\\n{content}<|end|>\\n``
zephyr             ``<|{role}|>\\n{content}{eos}\\n``
dialogpt           ``{content}{eos}`` per message; roles alternate user / assistant from a user message
falcon             ``User: {user}\\n\\n``, ``Assistant: {assistant}\\n\\n``, a leading ``{system}\\n\\n``; a turn
                   ends at ``\\n\\n`` followed by ``User: `` / ``Assistant:`` or the end of the text
deepseek           as falcon, after a BOS, with ``Assistant: {assistant}{eos}``
=================  ==========================================================================================

BOS/EOS strings depend on the tokenizer the template was rendered with (the SmolLM2 tokenizer renders
``bos_token`` as ``<|im_start|>`` and ``eos_token`` as ``<|im_end|>``). Pass ``bos_token``/``eos_token`` to pin
them; by default the common ones (:data:`DEFAULT_BOS_TOKENS`, :data:`DEFAULT_EOS_TOKENS`) are accepted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_llm.data.errors import ChatParseError, UnknownChatTemplateError

__all__ = ["CHAT_TEMPLATE_NAMES", "DEFAULT_BOS_TOKENS", "DEFAULT_EOS_TOKENS", "parse_chat_text", "resolve_parser"]

#: BOS strings accepted (once, at the very start) when ``bos_token`` is not given.
DEFAULT_BOS_TOKENS: tuple[str, ...] = ("<|begin_of_text|>", "<|im_start|>", "<|endoftext|>", "<bos>", "<s>")
#: EOS strings accepted as end of turn (Mistral/Llama-2/Zephyr) or trailing text when ``eos_token`` is not given.
DEFAULT_EOS_TOKENS: tuple[str, ...] = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<eos>", "</s>")

_ROLE = r"([A-Za-z_][\w.\-]*)"


@dataclass(frozen=True)
class _HeaderFamily:
    """A family whose turns are ``{header with role}{content}{end marker}{separator}``."""

    header: re.Pattern[str]
    ends: tuple[str, ...] | None  # None: the EOS tokens
    separator: str = ""
    roles: dict[str, str] | None = None  # rendered role -> message role


_HEADER_FAMILIES: dict[str, _HeaderFamily] = {
    "chatml": _HeaderFamily(re.compile(r"<\|im_start\|>" + _ROLE + r"\n"), ("<|im_end|>", "<|endoftext|>"), "\n"),
    "llama": _HeaderFamily(re.compile(r"<\|header_start\|>" + _ROLE + r"<\|header_end\|>\n\n"), ("<|eot|>",)),
    "llama3": _HeaderFamily(
        re.compile(r"<\|start_header_id\|>" + _ROLE + r"<\|end_header_id\|>\n\n"),
        ("<|eot_id|>", "<|eom_id|>"),
        roles={"ipython": "tool"},
    ),
    "gemma": _HeaderFamily(
        re.compile(r"<start_of_turn>" + _ROLE + r"\n"), ("<end_of_turn>",), "\n", roles={"model": "assistant"}
    ),
    "phi3": _HeaderFamily(re.compile(r"<\|(system|user|assistant|tool)\|>\n"), ("<|end|>",), "\n"),
    "zephyr": _HeaderFamily(re.compile(r"<\|(system|user|assistant|tool)\|>\n"), None, "\n"),
}

_ALIASES = {"smollm2": "chatml", "chatml_format": "chatml", "qwen": "chatml", "qwen2.5-instruct": "chatml",
            "qwen3": "chatml", "mistral": "mistral", "llama2": "llama2", "dialogpt": "dialogpt", "falcon": "falcon",
            "deepseek": "deepseek"}

#: Every name :func:`parse_chat_text` accepts.
CHAT_TEMPLATE_NAMES: tuple[str, ...] = tuple(sorted({*_HEADER_FAMILIES, *_ALIASES}))


def parse_chat_text(
    text: str, chat_template_name: str, *, bos_token: str | None = None, eos_token: str | None = None
) -> list[dict]:
    """Parse one rendered conversation into messages.

    Args:
        text: the rendered conversation (``apply_chat_template(..., tokenize=False)``, or decoded ids with special
            tokens kept), optionally ending in an unfinished assistant turn.
        chat_template_name: the template family, one of :data:`CHAT_TEMPLATE_NAMES` (case-insensitive).
        bos_token: the BOS string the text may start with; default: any of :data:`DEFAULT_BOS_TOKENS`.
        eos_token: the EOS string (end of an assistant turn for Mistral/Llama-2/Zephyr; ignored when trailing for
            the others); default: any of :data:`DEFAULT_EOS_TOKENS`.

    Returns:
        The messages in order: ``[{"role": str, "content": str, "is_complete": bool}, ...]``. Only the final
        message can have ``is_complete=False`` (no end-of-turn marker: an unfinished generation, or an empty
        assistant message for a bare generation prompt).

    Raises:
        TypeError: ``text`` is not a ``str``.
        UnknownChatTemplateError: ``chat_template_name`` is unknown (the message lists the known names; also a
            ``ValueError``, ``KeyError`` and ``NotImplementedError``).
        ChatParseError: the text is not a conversation of that family (names the position and the text found
            there; an ``InvalidConversationError`` and, as in TorchRL, a ``RuntimeError``).
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_chat_text: 'text' must be a str (a rendered chat), got {type(text).__name__}.")
    name = str(chat_template_name).lower()
    family = _ALIASES.get(name, name)
    bos = (bos_token,) if bos_token else DEFAULT_BOS_TOKENS
    eos = (eos_token,) if eos_token else DEFAULT_EOS_TOKENS
    if family in _HEADER_FAMILIES:
        return _parse_headers(text, name, _HEADER_FAMILIES[family], bos, eos)
    if family in ("mistral", "llama2"):
        return _parse_inst(text, name, bos, eos, space_before_eos=family == "llama2")
    if family == "dialogpt":
        return _parse_dialogpt(text, name, eos)
    if family in ("falcon", "deepseek"):
        return _parse_user_assistant(text, name, bos, eos, deepseek=family == "deepseek")
    raise UnknownChatTemplateError(
        f"parse_chat_text: unknown chat_template_name {chat_template_name!r}; known names: "
        f"{', '.join(CHAT_TEMPLATE_NAMES)}."
    )


# ------------------------------------------------------------------------------------------------------- internals
def _error(name: str, text: str, pos: int, expected: str) -> ChatParseError:
    return ChatParseError(
        f"parse_chat_text({name!r}): expected {expected} at character position {pos}, found "
        f"{text[pos:pos + 30]!r}. Pass text rendered with a {name!r}-family template (or the matching "
        f"chat_template_name), and bos_token/eos_token if the tokenizer uses unusual ones."
    )


def _skip_any(text: str, pos: int, options: tuple[str, ...]) -> int:
    for opt in options:
        if text.startswith(opt, pos):
            return pos + len(opt)
    return pos


def _find_first(text: str, pos: int, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
    return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None


def _parse_headers(
    text: str, name: str, fam: _HeaderFamily, bos: tuple[str, ...], eos: tuple[str, ...]
) -> list[dict]:
    ends = fam.ends if fam.ends is not None else eos
    pos = 0 if fam.header.match(text, 0) else _skip_any(text, 0, bos)
    messages: list[dict] = []
    while pos < len(text):
        m = fam.header.match(text, pos)
        if m is None:
            if messages and messages[-1]["is_complete"] and _skip_any(text, pos, eos) == len(text):
                break  # a trailing EOS some templates add after the last turn (Phi-3.5)
            raise _error(name, text, pos, "a turn header")
        role = (fam.roles or {}).get(m.group(1), m.group(1))
        start = m.end()
        hit = _find_first(text, start, ends)
        nxt = fam.header.search(text, start)
        if hit is None or (nxt is not None and nxt.start() < hit[0]):
            if nxt is not None:
                raise _error(name, text, nxt.start(), f"the end of the {role!r} turn ({' or '.join(ends)})")
            messages.append({"role": role, "content": text[start:], "is_complete": False})
            break
        messages.append({"role": role, "content": text[start : hit[0]], "is_complete": True})
        pos = hit[0] + len(hit[1])
        if fam.separator and text.startswith(fam.separator, pos):
            pos += len(fam.separator)
    if not messages:
        raise _error(name, text, 0, "at least one turn")
    return messages


_SYS2 = re.compile(r"<<SYS>>\n(.*?)\n<</SYS>>\n\n", re.DOTALL)


def _parse_inst(text: str, name: str, bos: tuple[str, ...], eos: tuple[str, ...], space_before_eos: bool) -> list:
    messages: list[dict] = []
    pos = _skip_any(text, 0, bos)
    first = text.find("[INST] ", pos)
    if first < 0:
        raise _error(name, text, pos, "'[INST] '")
    if first > pos:  # Mistral: "{system}\n\n" before the first [INST]
        pre = text[pos:first]
        if not pre.endswith("\n\n"):
            raise _error(name, text, pos, "'[INST] ' or a system prompt ending in '\\n\\n'")
        messages.append({"role": "system", "content": pre[:-2], "is_complete": True})
    pos = first
    while pos < len(text):
        pos = _skip_any(text, pos, bos) if messages else pos  # Llama-2 writes BOS before every [INST]
        if not text.startswith("[INST] ", pos):
            if messages and messages[-1]["is_complete"] and _skip_any(text, pos, eos) == len(text):
                break
            raise _error(name, text, pos, "'[INST] '")
        start = pos + len("[INST] ")
        end = text.find(" [/INST]", start)
        if end < 0:
            messages.append({"role": "user", "content": text[start:], "is_complete": False})
            break
        user = text[start:end]
        sys_m = _SYS2.match(user)
        if sys_m and not any(msg["role"] == "user" for msg in messages):
            messages.append({"role": "system", "content": sys_m.group(1), "is_complete": True})
            user = user[sys_m.end():]
        messages.append({"role": "user", "content": user, "is_complete": True})
        pos = end + len(" [/INST]")
        if pos == len(text):  # bare generation prompt
            messages.append({"role": "assistant", "content": "", "is_complete": False})
            break
        start = pos + 1 if text.startswith(" ", pos) else pos
        hit = _find_first(text, start, eos)
        if hit is None:
            messages.append({"role": "assistant", "content": text[start:], "is_complete": False})
            break
        content = text[start : hit[0]]
        if space_before_eos and content.endswith(" "):
            content = content[:-1]
        messages.append({"role": "assistant", "content": content, "is_complete": True})
        pos = hit[0] + len(hit[1])
    return messages



def _parse_dialogpt(text: str, name: str, eos: tuple[str, ...]) -> list[dict]:
    """``{content}{eos}`` per message, roles alternating user / assistant from the first message (the format writes
    no role); a final segment without EOS is an unfinished message."""
    messages: list[dict] = []
    pos = 0
    while pos < len(text):
        hit = _find_first(text, pos, eos)
        role = "user" if len(messages) % 2 == 0 else "assistant"
        if hit is None:
            messages.append({"role": role, "content": text[pos:], "is_complete": False})
            break
        messages.append({"role": role, "content": text[pos:hit[0]], "is_complete": True})
        pos = hit[0] + len(hit[1])
    if not messages:
        raise _error(name, text, 0, "at least one message")
    return messages


_NEXT_TURN = re.compile(r"\n\n(?=User: |Assistant:|$)")


def _parse_user_assistant(text: str, name: str, bos: tuple[str, ...], eos: tuple[str, ...], deepseek: bool) -> list:
    """Falcon / DeepSeek: ``User: {u}\\n\\n``, ``Assistant: {a}`` + ``\\n\\n`` (Falcon) or ``{eos}`` (DeepSeek),
    a leading ``{system}\\n\\n``. The generation prompt ``Assistant:`` parses as an empty unfinished reply."""
    messages: list[dict] = []
    pos = _skip_any(text, 0, bos) if deepseek else 0
    while pos < len(text):
        if text.startswith("Assistant:", pos):
            start = pos + len("Assistant:")
            start += text.startswith(" ", start)
            if deepseek:
                hit = _find_first(text, start, eos)
                end, nxt = (hit[0], hit[0] + len(hit[1])) if hit else (None, None)
            else:
                m = _NEXT_TURN.search(text, start)
                end, nxt = (m.start(), m.end()) if m else (None, None)
            if end is None:
                messages.append({"role": "assistant", "content": text[start:], "is_complete": False})
                break
            messages.append({"role": "assistant", "content": text[start:end], "is_complete": True})
            pos = nxt
            continue
        role, start = ("user", pos + len("User: ")) if text.startswith("User: ", pos) else ("system", pos)
        if role == "system" and messages:
            raise _error(name, text, pos, "'User: ' or 'Assistant:'")
        m = _NEXT_TURN.search(text, start)
        if m is None:
            messages.append({"role": role, "content": text[start:], "is_complete": False})
            break
        messages.append({"role": role, "content": text[start:m.start()], "is_complete": True})
        pos = m.end()
    if not messages:
        raise _error(name, text, 0, "at least one turn")
    return messages


def resolve_parser(chat_template_name: str | None = None, chat_template: str | None = None,
                   tokenizer: Any = None) -> tuple[str, Callable[[str], Any]]:
    """The parser ``History.from_text`` uses: ``(name, text -> messages or History)``.

    Order: ``chat_template_name`` (a registered template, its ``inverse_parser`` when it has one, or a name of
    :func:`parse_chat_text`); else the turn markers of ``chat_template`` (Jinja text or a registered name); else the
    tokenizer (the turn markers of its own template, then TorchRL's keywords on its ``name_or_path``); else ChatML
    (TorchRL's default). The tokenizer's ``eos_token`` pins the end of turn of the families that end a turn with it.

    Raises:
        UnknownChatTemplateError: an unknown ``chat_template_name`` (names the known ones).
    """
    from lit_llm.data.template_registry import (
        canonical_template_name,
        chat_template_names,
        detect_family_from_text,
        detect_template_name,
        registered_template,
    )

    family = None
    if chat_template_name is not None:
        reg = registered_template(chat_template_name)
        if reg is not None and reg.inverse_parser is not None:
            return reg.name, reg.inverse_parser
        family = reg.family if reg is not None else canonical_template_name(chat_template_name)
        if family not in CHAT_TEMPLATE_NAMES:
            raise UnknownChatTemplateError(
                f"History.from_text: unknown chat_template_name {chat_template_name!r}; known names: "
                f"{', '.join(sorted({*chat_template_names(), *CHAT_TEMPLATE_NAMES}))}. Register one with "
                f"lit_llm.data.add_chat_template(name, template, inverse_parser=...)."
            )
    elif chat_template is not None:
        reg = registered_template(chat_template) if "{" not in str(chat_template) else None
        family = reg.family if reg is not None else detect_family_from_text(str(chat_template))
    elif tokenizer is not None:
        own = getattr(tokenizer, "chat_template", None)
        own = own.get("default") if isinstance(own, dict) else own
        family = detect_family_from_text(own) if own else None
        if family is None:
            name = detect_template_name(tokenizer)
            reg = registered_template(name) if name is not None else None
            if reg is not None and reg.inverse_parser is not None:
                return reg.name, reg.inverse_parser
            family = reg.family if reg is not None else name
    family = family or "chatml"
    eos = getattr(tokenizer, "eos_token", None) if family in _EOS_FAMILIES else None
    return family, lambda text: parse_chat_text(text, family, eos_token=eos)


#: Families whose turns end with the tokenizer's EOS string.
_EOS_FAMILIES = ("zephyr", "mistral", "llama2", "dialogpt", "deepseek")
