"""Parse rendered chat text back into messages: the engine behind ``History.from_text``.

One parser per template family. Each reads the turn markers the family's templates write and returns the
messages in order, as ``{"role": str, "content": str, "is_complete": bool}`` dicts. The content is exactly the
text between a turn's header and its end-of-turn marker (no trimming): what a template changed on purpose
(trimmed content, a default system prompt, a system message folded into the first user turn) stays changed.

A final turn without its end-of-turn marker (an unfinished generation, or a bare generation prompt such as
``"<|im_start|>assistant\\n"``, which parses as an empty assistant message) has ``is_complete=False``.

Families (names accepted by :func:`parse_chat_text`; formats as rendered by the templates in
``shared/data/chat_templates``):

=================  ==========================================================================================
name(s)            turn format
=================  ==========================================================================================
chatml, smollm2,   ``<|im_start|>{role}\\n{content}<|im_end|>\\n``
qwen
llama3             ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`` (or ``<|eom_id|>``);
                   role ``ipython`` -> ``tool``
mistral, llama2    ``[INST] {user} [/INST] {assistant}{eos}``; system as ``{system}\\n\\n`` before the first
                   ``[INST]`` (Mistral) or as ``<<SYS>>\\n{system}\\n<</SYS>>\\n\\n`` opening the first user turn
                   (Llama-2), both returned as a ``system`` message; ``llama2`` also drops the space the template
                   writes before ``{eos}``
gemma              ``<start_of_turn>{role}\\n{content}<end_of_turn>\\n``; role ``model`` -> ``assistant``
phi3               ``<|{role}|>\\n{content}<|end|>\\n``
zephyr             ``<|{role}|>\\n{content}{eos}\\n``
=================  ==========================================================================================

BOS/EOS strings depend on the tokenizer the template was rendered with (the SmolLM2 tokenizer renders
``bos_token`` as ``<|im_start|>`` and ``eos_token`` as ``<|im_end|>``). Pass ``bos_token``/``eos_token`` to pin
them; by default the common ones (:data:`DEFAULT_BOS_TOKENS`, :data:`DEFAULT_EOS_TOKENS`) are accepted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from lit_llm.data.errors import InvalidConversationError

__all__ = ["CHAT_TEMPLATE_NAMES", "DEFAULT_BOS_TOKENS", "DEFAULT_EOS_TOKENS", "parse_chat_text"]

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
    "chatml": _HeaderFamily(re.compile(r"<\|im_start\|>" + _ROLE + r"\n"), ("<|im_end|>",), "\n"),
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

_ALIASES = {"smollm2": "chatml", "qwen": "chatml", "mistral": "mistral", "llama2": "llama2"}

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
        ValueError: ``chat_template_name`` is unknown (the message lists the known names).
        InvalidConversationError: the text is not a conversation of that family (names the position and the
            text found there).
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
    raise ValueError(
        f"parse_chat_text: unknown chat_template_name {chat_template_name!r}; known names: "
        f"{', '.join(CHAT_TEMPLATE_NAMES)}."
    )


# ------------------------------------------------------------------------------------------------------- internals
def _error(name: str, text: str, pos: int, expected: str) -> InvalidConversationError:
    return InvalidConversationError(
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

