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


@pytest.mark.slow
def test_no_block_of_six_lines_twice():
    """pylint's similarity checker (``symilar``, the engine of ``duplicate-code``) over ``lit_llm/``: no block of 6+
    lines (imports, docstrings and comments ignored) written twice. Slow (~3 CPU minutes): in ``make test-slow``."""
    import subprocess
    import sys

    files = sorted(str(p) for p in PACKAGE.rglob("*.py"))
    out = subprocess.run([sys.executable, "-m", "pylint.checkers.symilar", "--duplicates=6", "--ignore-imports",
                          "--ignore-docstrings", "--ignore-comments", *files], capture_output=True, text=True,
                         timeout=1200)
    blocks = [line for line in out.stdout.splitlines() if "similar lines in" in line]
    assert not blocks, out.stdout[:4000]
