"""One-message ``lit-llm`` errors: the option, the allowed values and a near match, no traceback.

jsonargparse reports a bad override as ~70 lines of usage and a nested message ("Does not validate against any of
the Union subtypes", ``Given value: NestedArg(...)``); a module's own ``ValueError`` raised while the run is built
comes with a traceback. This module turns both into ``lit-llm: error: <first line>`` plus one hint line:

* :func:`explain_parse_error` rewrites a jsonargparse message (the parser's ``error``) into
  ``--model.init_args.loss_type: 'dapo2' is not allowed; use one of: dapo, grpo, dr_grpo, bnpo (did you mean
  dapo?)``, ``--trainer.max_stepz: unknown option (did you mean --trainer.max_steps?)`` or
  ``--model.init_args.loss_typ: GRPOModule has no option loss_typ (did you mean --model.init_args.loss_type?)``.
  Allowed values come from the option's type (``Literal``, ``bool``, ``Enum``, ``None``), near matches from
  :func:`difflib.get_close_matches`.
* :func:`explain_config_error` puts the root cause's own text first (``GRPOModule: num_generations must be an
  integer >= 2, got 1.``) and names the option that set it (``--model.init_args.num_generations``, given 1).

``LIT_LLM_DEBUG=1`` (:data:`DEBUG_ENV`) keeps jsonargparse's full message and the traceback. Imports neither torch
nor Lightning (the ``lit-llm`` entry uses it before it knows the subcommand).
"""

from __future__ import annotations

import ast
import builtins
import difflib
import enum
import importlib
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lit_llm.cli_config_files import in_config_file

__all__ = ["DEBUG_ENV", "CLIConfigError", "OneLineErrors", "allowed_values", "debug_enabled", "explain_config_error",
           "explain_parse_error", "near"]

#: Environment variable: set (to anything but ``""``/``0``/``false``) for jsonargparse's full messages and tracebacks.
DEBUG_ENV = "LIT_LLM_DEBUG"

_NOISE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value type:",
          "Given value:", "- Expected a <class 'NoneType'>")
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", dict: "a mapping", list: "a list"}


class OneLineErrors:
    """Mixin for a jsonargparse ``ArgumentParser``: ``error()`` writes ``<error_prefix>: error: <first line>`` (from
    :func:`explain_parse_error`) and a hint line to stderr and exits 2, instead of the usage and the nested message
    (kept with :data:`DEBUG_ENV`, and when the parser raises instead of exiting, ``exit_on_error=False``)."""

    error_prefix = "lit-llm"

    def parse_args(self, args: Sequence[str] | None = None, *more: Any, **kwargs: Any) -> Any:
        """The parser's own, keeping the command line (for :func:`in_config_file`)."""
        self._command_line = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        return super().parse_args(args, *more, **kwargs)

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error or debug_enabled():
            super().error(message, ex)
        command_line = getattr(self, "_command_line", None) or ()
        parser = getattr(ex, "subcommand_parser", None) or _subcommand_parser(self, command_line)
        prog = parser.prog.replace(" [options]", "")
        line = in_config_file(explain_parse_error(message, parser), command_line)
        sys.stderr.write(f"{self.error_prefix}: error: {line}\n"
                         f"  (`{prog} --help` lists the options; {DEBUG_ENV}=1 shows the parser's full message)\n")
        self.exit(2)


def _subcommand_parser(parser: Any, command_line: Sequence[str]) -> Any:
    """The parser of the subcommand named on ``command_line`` (``fit``), else ``parser``: a config file's unknown key
    is reported by the root parser (``--print_config``), whose own options do not hold the subcommand's."""
    for action in getattr(parser, "_actions", []):
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict):
            return next((choices[a] for a in command_line if a in choices), parser)
    return parser


class CLIConfigError(ValueError):
    """A run could not be built from its configuration; ``str()`` is the whole message (first line: the cause's own
    text, then the option that set it). The cause is ``__cause__``; a ``ValueError`` whatever the cause's type, so
    that code catching the modules' ``ValueError`` keeps working."""


class EveryRankError(ValueError):
    """A refusal that every rank of a distributed run raises alike (worked out from what every rank holds, or after a
    collective): ``lit-llm`` prints it once, on global rank 0 (:func:`lit_llm.lightning.console_errors.
    print_user_error`); every rank still exits with status 2."""


def debug_enabled() -> bool:
    """Whether :data:`DEBUG_ENV` asks for full parser messages and tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def near(given: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``choices`` closest to ``given`` (difflib ratio >= 0.6, case-insensitive), best first."""
    choices = list(dict.fromkeys(choices))
    lower = {c.lower(): c for c in choices}
    return [lower[m] for m in difflib.get_close_matches(given.lower(), list(lower), n=n, cutoff=0.6)]


def _show(value: Any) -> str:
    """A value as written on the command line / in YAML: ``null``, ``true``, bare strings."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return value.name
    return str(value)


def allowed_values(hint: Any) -> tuple[list[str], list[str]]:
    """What a type hint accepts: ``(values, kinds)``, the finite values (``Literal`` members, ``true``/``false``,
    ``Enum`` names, ``null``) as written on the command line and the open-ended kinds (``an integer``, ``a string``,
    a class name); ``Union`` / ``Optional`` members are joined in order."""
    if isinstance(hint, str) or hint is None:
        return [], []
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return [_show(v) for v in typing.get_args(hint)], []
    if origin in (typing.Union, types.UnionType):
        values: list[str] = []
        kinds: list[str] = []
        for member in typing.get_args(hint):
            v, k = allowed_values(member)
            values += [x for x in v if x not in values]
            kinds += [x for x in k if x not in kinds]
        return values, kinds
    if hint is type(None):
        return ["null"], []
    if hint is bool:
        return ["true", "false"], []
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return [m.name for m in hint], []
    base = origin or hint
    if base in _TYPE_WORDS:
        return [], [_TYPE_WORDS[base]]
    name = getattr(base, "__name__", None)
    return [], [f"a {name}" if name else str(hint)]


def describe_allowed(hint: Any) -> str:
    """``one of: a, b, c`` / ``an integer`` / ``one of: sync, async or an integer`` for :func:`allowed_values`."""
    values, kinds = allowed_values(hint)
    if values:
        return "one of: " + ", ".join(values) + (f" or {' or '.join(kinds)}" if kinds else "")
    return " or ".join(kinds)


# ------------------------------------------------------------------------------------------------ parse errors
def _import(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _param_hint(cls: type, name: str) -> Any:
    """The annotation of ``name`` in ``cls.__init__`` (or a base class's, for ``**kwargs`` chains)."""
    for klass in getattr(cls, "__mro__", (cls,)):
        init = klass.__dict__.get("__init__")
        if init is None or name not in inspect.signature(init).parameters:
            continue
        try:
            return typing.get_type_hints(init).get(name)
        except Exception:  # an annotation that does not resolve: describe nothing rather than fail the message
            return None
    return None


def _class_options(cls: type) -> list[str]:
    """The init arguments jsonargparse accepts for ``cls`` (its own and its bases' through ``**kwargs``)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, "x", fail_untyped=False)
    except Exception:
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    return [a.dest[2:] for a in parser._actions if a.dest.startswith("x.") and "." not in a.dest[2:]]


def _subclasses(base: type) -> list[type]:
    out, todo = [], list(base.__subclasses__())
    while todo:
        cls = todo.pop(0)
        if cls not in out and not cls.__name__.startswith("_"):
            out.append(cls)
            todo.extend(cls.__subclasses__())
    return out


def _action_hint(parser: Any, dest: str) -> Any:
    for action in getattr(parser, "_actions", []):
        if action.dest == dest:
            return getattr(action, "_typehint", None) or getattr(action, "type", None)
    return None


def _option_strings(parser: Any) -> list[str]:
    return [s for a in getattr(parser, "_actions", []) for s in a.option_strings if s.startswith("--")]


def _given(lines: Sequence[str]) -> str | None:
    for line in lines:
        m = re.search(r"NestedArg\(key='[^']*', val=(.*)\)$", line)
        if m:
            try:
                return _show(ast.literal_eval(m.group(1)))
            except (ValueError, SyntaxError):
                return m.group(1)
    for line in lines:
        m = re.search(r"Given value: (.*?)\. Got value: ", line) or re.search(r"Got value: (.*)$", line)
        if m and "Namespace(" not in m.group(1):
            return m.group(1).strip()
    for line in lines:  # a value from a config file: "Given value: dapo2" (not a mapping)
        m = re.match(r"\s*Given value: ([^{\[(]*)$", line)
        if m and not m.group(1).startswith(("NestedArg", "Namespace")):
            return m.group(1).strip()
    return None


def _detail(lines: Sequence[str]) -> str:
    """The informative lines of a jsonargparse message fragment, joined: noise and ``Got value`` dropped,
    ``Expected a <class 'int'>`` written ``expected an integer``."""
    out = []
    for line in lines:
        text = re.sub(r"^- ", "", line.strip())
        if not text or any(text.startswith(n.removeprefix("- ")) for n in _NOISE) or text.startswith("Parser key"):
            continue
        if text.startswith("Expected a path but") or text.endswith('Parser key "' + text[12:-2] + '":'):
            continue
        text = re.sub(r"\. Got value: (.*)$", lambda m: f", got {m.group(1)!r}" if "(" not in m.group(1) else "", text)
        text = re.sub(r"^Not of type \w+: ", "", text)
        text = re.sub(r"^Type .* expects a function or a callable class: ", "expected a class or function: ", text)
        text = re.sub(r"Expected a <class '(\w+)'>",
                      lambda m: "expected " + _TYPE_WORDS.get(getattr(builtins, m.group(1), None), f"a {m.group(1)}"),
                      text)
        if text.startswith("expected a class or function: ") and text.rstrip().endswith(":"):
            continue
        if text not in out:
            out.append(text)
    rest = [t for t in out if not t.startswith("Expected a dot import path string")]
    return "; ".join(rest or out)


def _attribute_hint(detail: str) -> str:
    """``(did you mean torch.optim.AdamW?)`` for ``module 'torch.optim' has no attribute 'Adamw'``."""
    m = re.search(r"module '([\w.]+)' has no attribute '(\w+)'", detail)
    if not m:
        return ""
    try:
        names = dir(importlib.import_module(m.group(1)))
    except Exception:
        return ""
    close = near(m.group(2), [n for n in names if not n.startswith("_")], n=1)
    return f" (did you mean {m.group(1)}.{close[0]}?)" if close else ""


def _unknown_options(tokens: str, parser: Any) -> str:
    known = _option_strings(parser)
    parts = []
    for token in tokens.split():
        if not token.startswith("-"):
            continue
        option = token.split("=", 1)[0]
        close = near(option, known, n=1)
        parts.append(f"{option}: unknown option" + (f" (did you mean {close[0]}?)" if close else ""))
    return "; ".join(parts) or f"unexpected arguments: {tokens}"


def explain_parse_error(message: str, parser: Any = None) -> str:
    """The first line of ``lit-llm: error: ...`` for a jsonargparse error ``message`` raised by ``parser`` (the
    subcommand's parser, whose actions give the option names and types): the option, the value given, the allowed
    values and a near match. A message of another shape comes back with its noise lines removed."""
    lines = message.splitlines()
    m = re.match(r"unrecognized arguments: (.*)$", message.strip())
    if m:
        return _unknown_options(m.group(1), parser)
    m = (re.match(r"(?:Subcommand '[^']+'|Group '([^']+)') does not accept option '([^']+)'$", message.strip())
         or re.match(r"()Option '([^']+)' is not accepted$", message.strip()))
    if m:  # an unknown key in a --config file
        return _unknown_options("--" + ".".join(k for k in m.groups() if k), parser)
    m = re.match(r"the following arguments are required: (.*)$", message.strip())
    if m:
        known = set(_option_strings(parser))
        names = [n.strip() for n in m.group(1).split(",")]
        shown = [n if n.startswith("-") or f"--{n}" not in known and known else f"--{n}" for n in names]
        return f"the following options are required: {', '.join(shown)}"
    top = re.match(r'Parser key "([^"]+)":', lines[0]) if lines else None
    if top is None:
        return _detail(lines) or message
    key = top.group(1)
    cls_i = next((i for i, x in enumerate(lines) if "Problem with given class_path" in x), None)
    given = _given(lines)
    if cls_i is None:
        rest = lines[1:]
        same_line = lines[0][top.end():].strip()  # 'Parser key "config": File does not exist: ...' on one line
        if same_line:
            rest = [same_line, *rest]
        class_path_error = any("dot import path" in x or "Import path" in x for x in rest)
        hint = _action_hint(parser, key)
        if class_path_error:  # --model.class_path Typo: the imported subclasses of the option's base class
            bases = [b for b in typing.get_args(hint) or (hint,) if isinstance(b, type) and b is not type(None)]
            names = [c.__name__ for b in bases for c in [b, *_subclasses(b)]]
            close = near((given or "").rpartition(".")[2], names, n=1)
            return (f"--{key}.class_path: '{given}' is not a {bases[0].__name__ if bases else 'known class'}"
                    + (f"; use one of: {', '.join(names)}" if names else "")
                    + (f" (did you mean {close[0]}?)" if close else ""))
        return _value_message(f"--{key}", given, hint, _detail(rest))
    cls_path = re.search(r"class_path '([^']+)'", lines[cls_i]).group(1)
    try:
        cls = _import(cls_path)
    except Exception:
        cls = None
    name = cls_path.rpartition(".")[2]
    unknown_i = next((i for i in range(cls_i, len(lines)) if "is not accepted" in lines[i]), None)
    if unknown_i is not None:
        return _unknown_class_option(key, cls, name, lines[cls_i + 1:unknown_i + 1])
    inner = [(i, m.group(1)) for i in range(cls_i + 1, len(lines))
             for m in re.finditer(r'Parser key "([^"]+)"', lines[i])]
    if not inner:
        return f"--{key}: {name}: {_detail(lines[cls_i + 1:])}"
    last_i = inner[-1][0]
    indent = len(lines[last_i]) - len(lines[last_i].lstrip())
    body = [x for x in lines[last_i + 1:] if not x.strip() or len(x) - len(x.lstrip()) > indent]
    if not lines[last_i].rstrip().endswith(":"):  # the key and its message on one line
        body.insert(0, lines[last_i].rsplit(":", 1)[-1])
    args = [a for _, a in inner]
    hint = _param_hint(cls, args[0]) if cls is not None and len(args) == 1 and "." not in args[0] else None
    option = f"--{key}.init_args." + ".init_args.".join(args)
    return _value_message(option, _given(body) or given, hint, _detail(body))


def _nested_options(cls: type) -> dict[str, str]:
    """``{name: dotted option}`` of ``cls`` (a module) for a near match: its own options, then those of its default
    optimizer class as ``optimizer.init_args.<name>`` (``lr`` is an optimizer option, not a module one)."""
    options = {o: o for o in _class_options(cls)}
    try:
        optimizer = inspect.signature(cls).parameters.get("optimizer")
    except (TypeError, ValueError):
        optimizer = None
    if optimizer is not None and isinstance(optimizer.default, type):
        for o in _class_options(optimizer.default):
            options.setdefault(o, f"optimizer.init_args.{o}")
    return options


def _unknown_class_option(key: str, cls: type | None, name: str, lines: Sequence[str]) -> str:
    """``--model.init_args.optimizer.init_args.lrr: AdamW has no option lrr (did you mean ...lr?)``: ``lines`` are
    jsonargparse's from the class_path problem to the ``Option 'x' is not accepted`` line; the parser keys between
    them are the nested options (a class_path in an init argument) the unknown one is under."""
    arg = re.search(r"Option '([^']+)' is not accepted", lines[-1]).group(1)
    inner = [m.group(1) for line in lines for m in re.finditer(r'Parser key "([^"]+)"', line)]
    prefix = f"--{key}.init_args." + "".join(f"{k}.init_args." for k in inner)
    if inner:  # the class is the nested one: Got value: Namespace(class_path='torch.optim.AdamW', ...)
        m = re.search(r"class_path='([^']+)'", lines[-1])
        try:
            cls = _import(m.group(1)) if m else None
        except Exception:
            cls = None
        name = m.group(1).rpartition(".")[2] if m else inner[-1]
        options = {o: o for o in _class_options(cls)} if cls is not None else {}
    else:
        options = _nested_options(cls) if cls is not None else {}
    close = near(arg, options, n=1)
    tail = (f" (did you mean {prefix}{options[close[0]]}?)" if close
            else f"; its options: {', '.join(options)}" if options else "")
    return f"{prefix}{arg}: {name} has no option {arg}" + tail


def _value_message(option: str, given: str | None, hint: Any, detail: str) -> str:
    values, _ = allowed_values(hint)
    if values and given is not None and not re.search(r"use one of|available", detail, re.I):
        close = near(given, [v for v in values if v != "null"], n=1)
        return (f"{option}: '{given}' is not allowed; use {describe_allowed(hint)}"
                + (f" (did you mean {close[0]}?)" if close else ""))
    got = f", got {given!r}" if given is not None and ", got " not in detail else ""
    return f"{option}: {detail}{got}" + _attribute_hint(detail)


# ------------------------------------------------------------------------------------------ config-time errors
def _is_wrapper(exc: BaseException) -> bool:
    """Whether ``exc`` is jsonargparse's wrapping of another error (its own exception types, or a Union / class_path
    message), as opposed to an error that states its cause itself (``DataFormatError(...) from JSONDecodeError``)."""
    text = str(exc)
    return (type(exc).__module__.startswith("jsonargparse") or "Problem with given class_path" in text
            or any(n in text for n in _NOISE[:2]))


def root_cause(exc: BaseException) -> BaseException:
    """The error to report for ``exc``: the innermost ``__cause__`` through jsonargparse's wrappers (it wraps a
    class's own error in its Union message); an error raised ``from`` another one in our code (a
    ``DataFormatError`` from a ``JSONDecodeError``) is kept, since its own text names the input and the fix."""
    seen = set()
    while exc.__cause__ is not None and id(exc) not in seen and _is_wrapper(exc):
        seen.add(id(exc))
        exc = exc.__cause__
    return exc


def _option_like(word: str, text: str) -> bool:
    """Whether ``word`` appears in ``text`` as an option, not as an English word: an identifier with ``_``
    (``num_generations``), or written ``--word`` / ``x.word`` / ``word=`` / quoted (``'word'``, ```word```); not
    as a folder of a quoted path (``'path/to/file.py'``)."""
    if "_" in word:
        return True
    w = re.escape(word)
    return re.search(rf"(--|\.|[`'\"])\b{w}\b(?![/\\])|\b{w}\s*=(?!=)|\b{w}[`'\"]", text) is not None


def _find_option(text: str, config: Mapping[str, Any] | None) -> tuple[str, Any] | None:
    """The ``model``/``data`` init argument or ``trainer`` key named in ``text`` as an option (:func:`_option_like`:
    ``num_generations``, ``model.dtype``, ``accelerator='gpuu'``; a bare ``path`` in prose is not one), with its
    value. Of several, the first whose value holds a value quoted in ``text`` (``'strict_arithmetic_rewrd'`` is in
    ``reward_funcs``, not ``eval_reward_funcs``), else the first named. Options left unset (``None`` or empty) are
    never named: a message that suggests one (``rename_columns``) was not caused by it."""
    if not config:
        return None
    candidates: dict[str, tuple[str, Any]] = {}
    for section in ("model", "data", "trainer"):
        node = config.get(section) if hasattr(config, "get") else None
        if node is None or not hasattr(node, "get"):
            continue
        init = node.get("init_args") if section != "trainer" else node
        if init is None or not hasattr(init, "items"):
            continue
        prefix = f"--{section}.init_args." if section != "trainer" else "--trainer."
        for k, v in init.items():
            if v is None or (isinstance(v, (str, list, tuple, dict)) and not v):
                continue  # unset (null, empty): a message naming it is advice, not the option's doing
            candidates.setdefault(k, (prefix + k, v))
    found = [candidates[w] for w in dict.fromkeys(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
             if w in candidates and len(w) > 2 and _option_like(w, text)]
    quoted = [q for q in re.findall(r"'([^'\s]{3,})'", text)]
    for option in found:
        if any(q in str(option[1]) for q in quoted):
            return option
    return found[0] if found else None


def _notes(exc: BaseException, root: BaseException) -> list[str]:
    """The ``__notes__`` of ``root`` and of the errors from ``exc`` down to it (``__cause__`` chain), root's first,
    each once, stripped, those already in ``root``'s text left out."""
    chain = [exc]
    while chain[-1] is not root and chain[-1].__cause__ is not None and len(chain) < 50:
        chain.append(chain[-1].__cause__)
    text = str(root)
    notes: list[str] = []
    for e in reversed(chain):
        for note in getattr(e, "__notes__", None) or ():
            note = str(note).strip()
            if note and note not in notes and note not in text:
                notes.append(note)
    return notes


def explain_config_error(exc: BaseException, config: Mapping[str, Any] | None = None) -> str:
    """The message for an error raised while the run is built (classes instantiated): the root cause's own text
    first, then a line naming the option it concerns (looked up by name in ``config``: the subcommand's parsed
    config) and :data:`DEBUG_ENV` for the traceback. The exceptions' ``__notes__`` (PEP 678: an environment's error
    names its episode and sample in one, :meth:`lit_llm.rollouts.episodes.EpisodeEngine.run_episodes`) end the first
    line, joined with ``"; "`` (the root cause's first, then those of the errors wrapping it; each once)."""
    root = root_cause(exc)
    text = str(root).strip() or type(root).__name__
    if "--" in text.splitlines()[0]:  # the message names its options itself
        where = ""
    else:
        found = _find_option(text, config)
        where = f"set by {found[0]} {_show(found[1])}; " if found else f"{type(root).__name__}; "
    notes = _notes(exc, root)  # after the option look-up: a note quotes a prompt's text, not an option
    if notes:
        first, *rest = text.splitlines()
        text = "\n".join([f"{first}; {'; '.join(notes)}", *rest])
    return f"{text}\n  ({where}{DEBUG_ENV}=1 shows the traceback)"
