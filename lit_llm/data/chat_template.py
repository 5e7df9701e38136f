"""Render a conversation with a Jinja chat template and turn renders into ids and masks.

Rendering goes through transformers' ``render_jinja_template`` (:class:`Renderer`); :func:`resolve_template` turns
the ``chat_template`` / ``chat_template_name`` arguments (text, ``.jinja`` path, named template or ``None``) into
template text; ``_tokenize`` and ``_pad`` turn renders into ids and masks. ``History.apply_chat_template`` is the
public entry point.

The character spans of the assistant turns come from ``lit_llm.data.assistant_spans``; characters map to tokens with
the fast tokenizer's offset mapping; a token whose characters overlap a span is in the mask (as in transformers'
``apply_chat_template``), so a BPE merge of a template newline with leading spaces of the content (``ĊĠ``) puts that
token in the mask. The named templates live in ``lit_llm.data.template_registry``; this module re-exports the names
it used to hold.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_llm.data.assistant_spans import CONTINUATION_ANCHOR, STOP_STRINGS, render_continuation
from lit_llm.data.errors import ChatTemplateError, TokenizerRequiredError, UnknownChatTemplateError
from lit_llm.data.renderer import Renderer
from lit_llm.data.template_registry import (
    CHAT_TEMPLATE_ALIASES,
    CHAT_TEMPLATE_FILES,
    DEFAULT_TEMPLATE_NAME,
    add_chat_template,
    canonical_template_name,
    chat_template_names,
    chat_templates_dir,
    detect_template_name,
    get_chat_template,
    registered_template,
)

__all__ = [
    "CHAT_TEMPLATE_ALIASES", "CHAT_TEMPLATE_FILES", "CONTINUATION_ANCHOR", "STANDARD_TEMPLATE_VARIABLES",
    "STOP_STRINGS", "Renderer", "add_chat_template", "canonical_template_name", "chat_template_names",
    "chat_templates_dir", "check_template_kwargs", "detect_template_name", "get_chat_template",
    "loop_variables", "render_continuation", "resolve_template", "set_chat_template", "template_takes_tools",
    "template_variables",
]

# Names other modules import (kept so they keep working).
_ = (add_chat_template,)


def template_takes_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable (Qwen2.5, Qwen3, Llama-3.1 do; SmolLM2's, ChatML
    and Llama-3's do not: tools must then be described in the system prompt).

    Raises:
        ChatTemplateError: the template is not valid Jinja.
    """
    return "tools" in template_variables(template)


def _parse_template(template: str) -> Any:
    """The jinja2 AST of a chat template (transformers' ``{% generation %}`` tags removed).

    Raises:
        ChatTemplateError: the template is not valid Jinja.
    """
    import re

    from jinja2 import TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)  # transformers' extension tags
    try:
        return ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(text)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template is not valid Jinja: {e}") from e


def template_variables(template: str) -> set[str]:
    """The variables a Jinja chat template reads from its context (jinja2's ``meta.find_undeclared_variables``:
    every name read before the template sets it, e.g. ``{"messages", "add_generation_prompt", "enable_thinking"}``
    for Qwen3's), transformers' ``{% generation %}`` tags ignored.

    Raises:
        ChatTemplateError: the template is not valid Jinja.
    """
    from jinja2 import meta

    return set(meta.find_undeclared_variables(_parse_template(template)))


def loop_variables(template: str) -> set[str]:
    """The names a chat template binds for each message itself: ``for`` targets (``message``), ``loop``, and
    variables ``set`` only inside a ``for`` body (Qwen3's ``content`` / ``reasoning_content``). jinja2 counts the
    latter as read from the context (an iteration may read it before its ``set``), but they are the template's
    per-message scratch, not options a user passes; a variable also set outside any loop (``{% if not date_string
    is defined %}{% set date_string = ... %}``) is a real option and is not among them.

    Raises:
        ChatTemplateError: the template is not valid Jinja.
    """
    from jinja2 import nodes

    ast = _parse_template(template)

    def stored(node: Any) -> set[str]:
        return {n.name for n in [node, *node.find_all(nodes.Name)]
                if isinstance(n, nodes.Name) and n.ctx in ("store", "param")}

    in_loops: set[str] = {"loop"}
    inside: set[int] = set()
    for loop in ast.find_all(nodes.For):
        in_loops |= stored(loop.target)
        for body in (*loop.body, *loop.else_):
            for assign in [body, *body.find_all((nodes.Assign, nodes.AssignBlock))]:
                if isinstance(assign, (nodes.Assign, nodes.AssignBlock)):
                    in_loops |= stored(assign.target)
                    inside.add(id(assign))
    outside = set().union(*[stored(a.target) for a in ast.find_all((nodes.Assign, nodes.AssignBlock))
                            if id(a) not in inside])
    return in_loops - outside


#: What every render gives a template besides ``chat_template_kwargs``: transformers' own arguments and globals
#: (``render_jinja_template``) and the tokenizer's special tokens. A key among them overrides it, so it is never
#: reported as unread.
STANDARD_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "raise_exception",
    "strftime_now", "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens"})


def check_template_kwargs(template: str, kwargs: Mapping[str, Any], *, template_name: str,
                          option: str = "--model.init_args.chat_template_kwargs") -> None:
    """Refuse ``chat_template_kwargs`` keys the chat template never reads: Jinja renders an unknown variable as
    undefined without a word, so a misspelled ``enable_thinkng`` would leave the template's default in force.

    Args:
        template: the Jinja text the renders use.
        kwargs: the template variables given (``chat_template_kwargs``).
        template_name: names the template in the message (file name, template name, ``"tokenizer default"``).
        option: the option that holds ``kwargs``, named in the message.

    Raises:
        ChatTemplateError: names the unread key(s), a close match (``difflib``) where there is one, the variables
            the template reads besides :data:`STANDARD_TEMPLATE_VARIABLES`, and the fix; also a template that is
            not valid Jinja.
    """
    import difflib

    if not kwargs:
        return
    reads = template_variables(template)
    own = sorted(reads - STANDARD_TEMPLATE_VARIABLES - loop_variables(template))
    unread = [k for k in kwargs if k not in reads and k not in STANDARD_TEMPLATE_VARIABLES]
    if not unread:
        return
    key = unread[0]
    close = difflib.get_close_matches(key, own, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listed = (f"it reads {', '.join(own)}" if own else
              "it reads no variable besides the standard ones (messages, add_generation_prompt, tools, ...)")
    more = f" (also unread: {', '.join(repr(k) for k in unread[1:])})" if unread[1:] else ""
    raise ChatTemplateError(
        f"{option}: the chat template ({template_name}) never reads {key!r}{more}, so it would be ignored; "
        f"{listed}.{hint} Fix: use one of its variables, or drop the key.")


def _own_template(tokenizer: Any, tools: Any) -> str | None:
    """The tokenizer's own chat template (its default, or the ``tool_use`` one when tools are given), or ``None``."""
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        return None
    return tokenizer.get_chat_template(None, tools)


def resolve_template(tokenizer: Any, chat_template: str | os.PathLike | None, tools: Any = None, *,
                     chat_template_name: str | None = None) -> tuple[str, str]:
    """Return ``(template_text, name)``; ``name`` is used in error messages.

    ``chat_template_name`` (a registered name, :mod:`lit_llm.data.template_registry`) selects a named template;
    otherwise ``chat_template`` is, in this order: ``None``, a ``.jinja`` path, one of the tokenizer's named
    templates, an existing file, a registered name (aliases such as ``"chatml_format"`` applied), or the Jinja text
    itself. ``None`` means the tokenizer's own template; for a tokenizer without one, the template registered for its
    ``name_or_path`` (TorchRL's detection: ``qwen``, ``llama``, ...) or else ChatML (TorchRL's fallback). A
    tokenizer's own template is never replaced by detection.

    Raises:
        ChatTemplateError: both arguments given, a ``.jinja`` path that does not exist, a string that is neither
            Jinja, a file nor a known name.
        UnknownChatTemplateError: an unknown ``chat_template_name`` (names the known ones).
        TokenizerRequiredError: no tokenizer.
    """
    if tokenizer is None:
        raise TokenizerRequiredError(
            "A tokenizer is needed to render a chat template (its special tokens reach the template and it "
            "tokenizes the render); pass tokenizer=AutoTokenizer.from_pretrained(...)."
        )
    if chat_template_name is not None:
        if chat_template is not None:
            raise ChatTemplateError(
                f"Pass chat_template or chat_template_name, not both (got {_short_repr(chat_template)} and "
                f"{chat_template_name!r})."
            )
        return get_chat_template(chat_template_name), canonical_template_name(chat_template_name)
    if chat_template is None:
        own = _own_template(tokenizer, tools)
        if own is not None:
            return own, "tokenizer default"
        name = detect_template_name(tokenizer) if getattr(tokenizer, "name_or_path", None) else None
        name = name if name is not None and registered_template(name) is not None else DEFAULT_TEMPLATE_NAME
        return get_chat_template(name), f"{name} (the tokenizer has no chat template)"
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
        found = registered_template(chat_template)
        if found is not None:
            return found.template, found.name
        raise UnknownChatTemplateError(
            f"chat_template={chat_template!r} is not a Jinja template (it has no '{{'), not an existing file and not "
            f"one of the tokenizer's named templates ({sorted(named) or 'none'}) nor a known template name "
            f"({', '.join(chat_template_names())}). Pass the template text, the path of a .jinja file, a known name, "
            f"or None for the tokenizer's own template."
        )
    return chat_template, "<inline template>"


def _short_repr(x: Any, n: int = 60) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."


def set_chat_template(tokenizer: Any, chat_template: str | os.PathLike) -> str:
    """Make ``chat_template`` (Jinja text, ``.jinja`` path, a registered name or one of the tokenizer's named
    templates) the tokenizer's default template, so renders without an explicit template and ``save_pretrained`` use
    it. A tokenizer with named templates keeps them; the override becomes its ``"default"``.

    Returns:
        The template name used in error messages (file name, template name or ``"<inline template>"``).

    Raises:
        ChatTemplateError: a path that does not exist, a name that is neither a template nor a file.
    """
    text, name = resolve_template(tokenizer, chat_template, None)
    current = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = {**current, "default": text} if isinstance(current, dict) else text
    return name


# ---------------------------------------------------------------------- tokenisation helpers
def _tokenize(tokenizer: Any, text: str, spans: list[tuple[int, int]] | None, name: str) -> dict[str, torch.Tensor]:
    # token ids are made on the host whatever torch's default device is (issue 28: no tensor on a default device)
    if spans is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids_t = torch.tensor(ids, dtype=torch.long, device="cpu")
        return {"input_ids": ids_t, "attention_mask": torch.ones_like(ids_t)}
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError(
            f"Assistant masks need a fast tokenizer (offset mappings); {type(tokenizer).__name__} is not. Load it "
            f"with AutoTokenizer.from_pretrained(..., use_fast=True)."
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids_t = torch.tensor(enc["input_ids"], dtype=torch.long, device="cpu")
    mask = torch.zeros(len(ids_t), dtype=torch.bool, device="cpu")
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
            fill = torch.full((length - len(x),), value, dtype=x.dtype, device=x.device)
            rows.append(torch.cat([fill, x] if side == "left" else [x, fill]))
        result[key] = torch.stack(rows)
    return result
