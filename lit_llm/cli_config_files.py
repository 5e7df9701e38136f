"""Where a ``lit-llm`` option was set: on the command line or in one of its ``--config`` YAML files, and on which
line (:func:`in_config_file`), so that a bad key or value in a config file is reported as ``my.yaml:12:
model.init_args.lrr: ...`` like the command line's ``--model.init_args.lrr: ...``
(:class:`lit_llm.cli_errors.OneLineErrors`). Imports neither torch nor Lightning."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["in_config_file"]


def _yaml_line(path: str, keys: Sequence[str]) -> int | None:
    """The 1-based line of the key ``keys`` (``model``, ``init_args``, ``lrr``) in the YAML file ``path`` (an
    ``init_args`` level may be left out in the file, as jsonargparse allows); ``None`` when it is not there."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    found = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            return None
        match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == key), None)
        if match is None:
            if key == "init_args":
                continue
            return None
        found, node = match
    return None if found is None else found.start_mark.line + 1


def _dotted(option: str) -> str:
    return option.lstrip("-").split("=", 1)[0].replace(".init_args.", ".")


def in_config_file(line: str, command_line: Sequence[str]) -> str:
    """``line`` (``--model.init_args.lrr: ...``, from :func:`lit_llm.cli_errors.explain_parse_error`) told where the
    option was set when it is not on ``command_line`` but in one of its ``--config`` files (the last that has it):
    ``my.yaml:12: model.init_args.lrr: SFTModule has no option lrr (did you mean
    model.init_args.optimizer.init_args.lr?)`` (options written as YAML keys, without ``--``). Other lines come back
    unchanged."""
    m = re.match(r"--([\w.]+)(: .*)$", line, re.S)
    if m is None:
        return line
    key, rest = m.groups()
    args = list(command_line)
    if any(a.startswith("--") and _dotted(a) == _dotted(key) for a in args):
        return line
    files = [a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
             for i, a in enumerate(args) if a in ("--config", "-c") or a.startswith("--config=")]
    for path in reversed(files):
        number = _yaml_line(path, key.split(".")) if os.path.isfile(path) else None
        if number is not None:
            return f"{path}:{number}: {key}" + re.sub(r"(did you mean )--", r"\1", rest)
    return line
