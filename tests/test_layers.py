"""The package's shape, kept by a test (docs/ARCHITECTURE.md, "Layers"): each layer imports only itself and the
layers above it; no import circle between modules (function-level imports count); no import of another package's
private name; no module over 500 lines; every module has a row in ARCHITECTURE.md."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_llm"

#: The layers, top (imported by every other) to bottom; a module's layer is its first-level package or file name.
LAYERS = [
    {"imports", "models", "cli_config_files", "cli_errors", "cli_front", "plot"},
    {"data"},
    {"distributions"},
    {"policy"},
    {"objectives"},
    {"rewards"},
    {"rollouts"},
    {"lightning"},
    {"cli_commands", "cli_entry", "chat", "evaluation", "demo"},
]
MAX_LINES = 500


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """``(imported lit_llm module, imported names)`` of every import statement, function-level ones included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("lit_llm"):
                continue
            names = [a.name for a in node.names]
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            out += [(s, []) for s in subs]
            out.append((target, [n for n in names if f"{target}.{n}" not in known]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("lit_llm")]
    return [(t, n) for t, n in out if t in known and t != name]


def layer_of(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "lit_llm"
    for i, layer in enumerate(LAYERS):
        if key in layer:
            return i
    raise AssertionError(f"{module}: its layer {key!r} is not in tests/test_layers.py's LAYERS (and not in "
                         f"docs/ARCHITECTURE.md's layer table); add it to both.")


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, list[str]]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_each_layer_imports_only_the_layers_above_it(graph):
    upward = [f"{a} imports {b}" for a, edges in graph.items() if a != "lit_llm"
              for b, _ in edges if b != "lit_llm" and layer_of(b) > layer_of(a)]
    assert not upward, f"imports from a lower layer: {upward}"


def test_no_import_circle(graph):
    deps = {a: {b for b, _ in edges if b != "lit_llm" and not b.startswith(a + ".")}
            for a, edges in graph.items() if a != "lit_llm"}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(deps.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                               else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = "done"

    for node in sorted(deps):
        if node not in state:
            visit(node, [])
    assert not circles, f"import circles: {circles}"


def test_no_private_name_of_another_package(graph):
    def package(module: str) -> str:
        return module.rpartition(".")[0] if module.count(".") > 1 else module

    found = [f"{a} imports {n} from {b}" for a, edges in graph.items() for b, names in edges
             for n in names if n.startswith("_") and not n.startswith("__") and package(a) != package(b)]
    assert not found, f"private names imported across packages: {found}"


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_every_module_has_a_row_in_the_architecture_doc():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`(lit_llm/[\w/]+\.py)`", text)) | {f"{d}/" for d in re.findall(r"`(lit_llm/[\w/]+)/`",
                                                                                             text)}
    missing = []
    for path in modules().values():
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py":
            continue
        if rel not in named and not any(rel.startswith(d) for d in named if d.endswith("/")):
            missing.append(rel)
    assert not missing, f"modules without a row in docs/ARCHITECTURE.md: {missing}"


def _import_lines_blanked(path: Path) -> str:
    """``path``'s text with the lines of every ``import`` / ``from ... import`` statement made empty (line numbers
    kept). The same lines pylint's ``--ignore-imports`` drops, found with the standard ``ast`` module: symilar's own
    way parses each file with astroid, whose inference of the imported modules (torch, transformers) took ~4 CPU
    minutes for ``lit_llm/``; this takes well under a second."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for i in range(node.lineno - 1, node.end_lineno or node.lineno):
                lines[i] = "\n"
    return "".join(lines)


def _duplicate_blocks(paths: list[Path], root: Path) -> tuple[list[str], str]:
    """Run pylint's ``Symilar`` (6+ lines; comments, docstrings and imports ignored) over ``paths``: the report's
    "N similar lines in K files" lines and the whole report."""
    import contextlib
    import io

    from pylint.checkers.symilar import Symilar

    checker = Symilar(min_lines=6, ignore_comments=True, ignore_docstrings=True, ignore_imports=False)
    for path in paths:
        checker.append_stream(str(path.relative_to(root)), io.StringIO(_import_lines_blanked(path)))
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        checker.run()
    text = report.getvalue()
    assert "TOTAL lines=" in text, text[:2000]  # the checker ran over the files
    return [line for line in text.splitlines() if "similar lines in" in line], text


def test_no_block_of_six_lines_twice():
    """pylint's similarity checker (``Symilar``, the engine of ``duplicate-code``) over ``lit_llm/``: no block of 6+
    lines (imports, docstrings and comments ignored) written twice."""
    blocks, report = _duplicate_blocks(sorted(PACKAGE.rglob("*.py")), ROOT)
    assert not blocks, report[:4000]


def test_the_duplicate_block_check_finds_a_copied_block_but_not_a_copied_import_block(tmp_path):
    """The check above is not blind: a block written in two files is reported, a 6-line import block is not (it
    is blanked as ``--ignore-imports`` would)."""
    body = "".join(f"    total = total * {i} + {i * 7}\n" for i in range(6))
    imports = "".join(f"from os.path import {name}\n" for name in ("join", "dirname", "basename", "exists",
                                                                      "isdir", "isfile"))
    for name, fn in (("a.py", "f"), ("b.py", "g")):
        (tmp_path / name).write_text(f"{imports}\n\ndef {fn}(total):\n{body}    return total\n", encoding="utf-8")
    blocks, report = _duplicate_blocks([tmp_path / "a.py", tmp_path / "b.py"], tmp_path)
    assert blocks == ["7 similar lines in 2 files"], report  # the 6 body lines and the return
    assert "from os.path" not in report
