"""Named chat templates: the ones shipped in the package (``lit_llm/data/templates``) and those added at run time.

Every name resolves to Jinja text. The shipped templates carry ``{% generation %}`` markers around what a model
generates for an assistant turn (the content through its end-of-turn token, never the separator after it: DESIGN.md
property 3) and otherwise render byte for byte as their model's template (``tests/data/test_template_registry.py``).

=====================  ======================================================================================
name (aliases)         template
=====================  ======================================================================================
``chatml``             ChatML, TorchRL's ``chatml_format`` (no BOS, no default system prompt); the fallback for
(``chatml_format``)    a tokenizer without a template of its own
``qwen``               Qwen2.5 base models (``Qwen/Qwen2.5-0.5B``; default system prompt "You are a helpful
                       assistant."), TorchRL's ``qwen``
``qwen2.5-instruct``   Qwen2.5-Instruct (default system prompt "You are Qwen, created by Alibaba Cloud. ...");
                       lit_llm's ``qwen`` before issue 29
``qwen3``              Qwen3 (reasoning, ``enable_thinking``; drops the reasoning of earlier turns)
``llama``              Llama 4 text chats (``<|header_start|>`` / ``<|eot|>``), TorchRL's ``llama``
``llama3``             Llama 3 Instruct (``<|start_header_id|>`` / ``<|eot_id|>``)
``llama2``             Llama 2 chat (``[INST]`` / ``<<SYS>>``)
``mistral``            Mistral Instruct (``[INST]``)
``gemma``              Gemma instruct (``<start_of_turn>``)
``phi3``               Phi-3 (``<|user|>`` / ``<|end|>``)
``zephyr``             Zephyr (``<|user|>`` / ``eos_token``)
``dialogpt``           DialoGPT / GPT-2 (each message followed by ``eos_token``)
``falcon``             Falcon instruct (``User: ...`` / ``Assistant: ...``), TorchRL's ``falcon``
``deepseek``           DeepSeek LLM chat (``User: ...`` / ``Assistant: ...{eos}``), TorchRL's ``deepseek``
=====================  ======================================================================================

:func:`add_chat_template` registers more (TorchRL's signature). :func:`detect_template_name` picks a name from a
tokenizer's ``name_or_path`` (TorchRL's keywords) or from template text; ``History.apply_chat_template`` uses it only
for a tokenizer without a template of its own (the tokenizer's template is never replaced), ``History.from_text`` to
choose a parser.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from lit_llm.data.errors import UnknownChatTemplateError

__all__ = [
    "CHAT_TEMPLATE_ALIASES",
    "CHAT_TEMPLATE_FILES",
    "DEFAULT_TEMPLATE_NAME",
    "RegisteredTemplate",
    "add_chat_template",
    "canonical_template_name",
    "chat_template_names",
    "chat_templates_dir",
    "detect_template_name",
    "get_chat_template",
    "detect_family_from_text",
    "registered_template",
    "remove_chat_template",
]

#: TorchRL's ``chat_template_name`` values -> lit_llm's names.
CHAT_TEMPLATE_ALIASES: dict[str, str] = {"chatml_format": "chatml"}

#: Shipped template names -> file in :func:`chat_templates_dir`.
CHAT_TEMPLATE_FILES: dict[str, str] = {
    name: f"{name}.jinja" for name in (
        "chatml", "qwen", "qwen2.5-instruct", "qwen3", "llama", "llama3", "llama2", "mistral", "gemma", "phi3",
        "zephyr", "dialogpt", "falcon", "deepseek")
}

#: The template of a tokenizer without a chat template of its own (TorchRL's fallback).
DEFAULT_TEMPLATE_NAME = "chatml"

#: Parsing family of each shipped template (``lit_llm.data.chat_parsing``).
_FAMILIES: dict[str, str] = {"qwen": "chatml", "qwen2.5-instruct": "chatml", "qwen3": "chatml"}

#: TorchRL's detection from a tokenizer's ``name_or_path`` (lower-cased substring -> template name), in its order.
_NAME_KEYWORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("qwen",), "qwen"), (("dialogpt", "microsoft/dialo"), "dialogpt"), (("falcon", "tiiuae/falcon"), "falcon"),
    (("deepseek",), "deepseek"), (("llama",), "llama"),
)

#: Detection from template text: the first marker found gives the parsing family.
_TEXT_MARKERS: tuple[tuple[str, str], ...] = (
    ("<|im_start|>", "chatml"), ("<|header_start|>", "llama"), ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"), ("<<SYS>>", "llama2"), ("[INST]", "mistral"), ("<|end|>", "phi3"),
    ("<|user|>", "zephyr"), ("'User: '", "deepseek_or_falcon"),
)


@dataclass(frozen=True)
class RegisteredTemplate:
    """A named chat template.

    Attributes:
        name: the name (lower case).
        template: the Jinja text.
        family: the parser ``History.from_text`` uses (a name of :func:`lit_llm.data.chat_parsing.parse_chat_text`),
            or ``None`` when ``inverse_parser`` is given.
        inverse_parser: ``text -> History | list[dict]`` (TorchRL's ``inverse_parser``), or ``None``.
        keywords: lower-cased substrings of a tokenizer's ``name_or_path`` that select this template when the
            tokenizer has no template of its own.
    """

    name: str
    template: str
    family: str | None = None
    inverse_parser: Callable[[str], Any] | None = None
    keywords: tuple[str, ...] = field(default_factory=tuple)


_ADDED: dict[str, RegisteredTemplate] = {}


def chat_templates_dir() -> Path:
    """The package folder holding the shipped ``.jinja`` files (``lit_llm/data/templates``)."""
    return Path(str(resources.files("lit_llm.data").joinpath("templates")))


def canonical_template_name(name: str) -> str:
    """``name`` lower-cased with TorchRL's aliases applied (``"chatml_format"`` -> ``"chatml"``)."""
    low = str(name).lower()
    return CHAT_TEMPLATE_ALIASES.get(low, low)


def chat_template_names() -> list[str]:
    """Every name a template can be selected by: shipped, added, and the aliases; sorted."""
    return sorted({*CHAT_TEMPLATE_FILES, *_ADDED, *CHAT_TEMPLATE_ALIASES})


def registered_template(name: str) -> RegisteredTemplate | None:
    """The template registered under ``name`` (aliases applied, case-insensitive), ``None`` for other names.
    A template added with :func:`add_chat_template` wins over a shipped one of the same name."""
    canon = canonical_template_name(name)
    if canon in _ADDED:
        return _ADDED[canon]
    if canon in CHAT_TEMPLATE_FILES:
        text = (chat_templates_dir() / CHAT_TEMPLATE_FILES[canon]).read_text(encoding="utf-8")
        return RegisteredTemplate(canon, text, _FAMILIES.get(canon, canon))
    return None


def get_chat_template(name: str) -> str:
    """The Jinja text of the template named ``name``.

    Raises:
        UnknownChatTemplateError: an unknown name (names the known ones and :func:`add_chat_template`).
    """
    found = registered_template(name)
    if found is None:
        raise UnknownChatTemplateError(
            f"Unknown chat template name {name!r}; known names: {', '.join(chat_template_names())}. Register a "
            f"template with lit_llm.data.add_chat_template(name, template), or pass chat_template= (Jinja text or a "
            f".jinja path)."
        )
    return found.template


def add_chat_template(template_name: str, template: str, inverse_parser: Callable[[str], Any] | None = None,
                      model_family_keywords: Sequence[str] | None = None, *, family: str | None = None) -> None:
    """Register a chat template under ``template_name`` for this process (TorchRL's ``add_chat_template``).

    Unlike TorchRL, ``{% generation %}`` markers are optional: without them the assistant masks are derived from
    renders of the conversation's prefixes (DESIGN.md property 3). A name that is already registered is replaced.

    Args:
        template_name: the name (case-insensitive) for ``chat_template_name=`` / ``chat_template=``.
        template: the Jinja text.
        inverse_parser: ``text -> History`` (or a list of message dicts) used by ``History.from_text`` for this
            name; default: the parser of ``family``, else of the family read off the template text.
        model_family_keywords: substrings of a tokenizer's ``name_or_path`` (case-insensitive) that select this
            template for a tokenizer without a template of its own, checked before the shipped keywords.
        family: a parser name of :func:`lit_llm.data.chat_parsing.parse_chat_text` (e.g. ``"chatml"``).

    Raises:
        TypeError: ``template`` is not a string, ``inverse_parser`` is not callable.
        ValueError: an empty name, a template that is not valid Jinja.
    """
    if not isinstance(template, str):
        raise TypeError(f"add_chat_template: template must be the Jinja text (str), got {type(template).__name__}.")
    if inverse_parser is not None and not callable(inverse_parser):
        raise TypeError("add_chat_template: inverse_parser must be a callable text -> History.")
    name = str(template_name).strip().lower()
    if not name:
        raise ValueError("add_chat_template: template_name is empty.")
    from jinja2 import Environment, TemplateSyntaxError

    try:
        env = Environment(extensions=["jinja2.ext.loopcontrols"])
        env.parse(re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template))
    except TemplateSyntaxError as e:
        raise ValueError(f"add_chat_template: template {name!r} is not valid Jinja: {e}") from e
    if family is None and inverse_parser is None:
        family = detect_family_from_text(template)
    keywords = tuple(k.lower() for k in (model_family_keywords or ()))
    _ADDED[canonical_template_name(name)] = RegisteredTemplate(name, template, family, inverse_parser, keywords)


def remove_chat_template(template_name: str) -> None:
    """Forget a template added with :func:`add_chat_template` (shipped templates stay)."""
    _ADDED.pop(canonical_template_name(template_name), None)


def detect_family_from_text(template: str | None) -> str | None:
    """The parsing family of a template or of rendered text, from the turn markers in it, or ``None``."""
    if not isinstance(template, str):
        return None
    for marker, family in _TEXT_MARKERS:
        if marker in template:
            if family == "deepseek_or_falcon":
                return "deepseek" if "eos_token" in template else "falcon"
            return family
    return None


def detect_template_name(tokenizer: Any = None, template: str | None = None) -> str | None:
    """A registered template name for ``tokenizer`` or ``template`` text (TorchRL's detection).

    Order: keywords of templates added with :func:`add_chat_template`, then TorchRL's keywords on the tokenizer's
    ``name_or_path`` (``qwen``, ``dialogpt``, ``falcon``, ``deepseek``, ``llama``), then the turn markers of
    ``template`` (or of the tokenizer's own template). ``None`` when nothing matches.
    """
    name = str(getattr(tokenizer, "name_or_path", "") or "").lower()
    if name:
        for reg in _ADDED.values():
            if any(k in name for k in reg.keywords):
                return reg.name
        for keys, tpl in _NAME_KEYWORDS:
            if any(k in name for k in keys):
                return tpl
    if template is None:
        own = getattr(tokenizer, "chat_template", None)
        template = own.get("default") if isinstance(own, dict) else own
    return detect_family_from_text(template)
