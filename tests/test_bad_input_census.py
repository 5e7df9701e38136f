"""The census of the bad-input cases the project keeps (issue 30, "Done when"): every case of the bad-input test
modules, counted per class, with the cheap in-process tables run once more here.

A case is one collected test item (a parametrized test counts once per parameter set) of :data:`MODULES`. Its class:

* ``clear error``: the test asserts an error, i.e. its source uses ``pytest.raises`` or one of the suites' first-line
  helpers (``first_error``, ``error_message``, ``error_lines``, ``build_error_lines``), checks exit status 2 or
  spells a ``lit-llm: error:`` line;
* ``behaviour``: the test asserts what happens instead (a warning and a count, a clean stop, nothing overwritten).

The subprocess (CLI) cases are counted, not re-run (they run once, in ``make test-slow``); the named case tables of
the parser's errors (:data:`test_cli_errors.PARSE_ERRORS` / ``CONFIG_FILE_ERRORS``) run again in-process, each
checked for one ``lit-llm: error:`` line and no traceback, and the counts of the CLI tables
(``test_cli_run_errors.CASES``, ``test_silently_ignored.CLI_CASES``) are checked against the collected items.
Run: ``pytest tests/test_bad_input_census.py -m slow -s`` prints the table (about 30 s).
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The bad-input test modules: ``(folder under tests/, module name)``.
MODULES = [("lightning", "test_export_safety"), ("lightning", "test_bad_files"), ("", "test_commands"),
           ("lightning", "test_ckpt_files"), ("lightning", "test_resume_options"),
           ("lightning", "test_silently_ignored"), ("lightning", "test_graceful_stop"),
           ("rollouts", "test_user_code_timeouts"), ("lightning", "test_cli_errors"),
           ("lightning", "test_cli_run_errors")]

ERROR = re.compile(r"pytest\.raises|\b_?first_error\(|\berror_message\(|\b(build_)?error_lines\(|returncode == 2|"
                   r"lit-llm( \w+)?: error:")


def _module(folder: str, name: str):
    path = str(ROOT / "tests" / folder) if folder else str(ROOT / "tests")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)


def _marks(fn) -> list:
    return list(getattr(fn, "pytestmark", []))


def cases(folder: str, name: str) -> list[dict]:
    """One row per test function of the module: its parameter sets, class, whether it is slow (CLI subprocess)."""
    mod = _module(folder, name)
    rows = []
    for test, fn in vars(mod).items():
        if not test.startswith("test_") or not inspect.isfunction(fn) or fn.__module__ != mod.__name__:
            continue
        marks = _marks(fn)
        count = math.prod(len(m.args[1]) for m in marks if m.name == "parametrize")
        rows.append({"module": name, "test": test, "count": count, "slow": any(m.name == "slow" for m in marks),
                     "skip": [m.name for m in marks if m.name in ("skip", "skipif", "xfail")],
                     "class": "clear error" if ERROR.search(inspect.getsource(fn)) else "behaviour"})
    return rows


@pytest.mark.slow
def test_census_counts_every_kept_case_by_class(capsys):
    rows = [r for folder, name in MODULES for r in cases(folder, name)]
    assert [r for r in rows if r["skip"]] == []  # no skipped or expected-to-fail bad-input case
    table: dict[str, dict[str, int]] = {}
    for r in rows:
        t = table.setdefault(r["module"], {"clear error": 0, "behaviour": 0, "cli": 0})
        t[r["class"]] += r["count"]
        t["cli"] += r["count"] if r["slow"] else 0
    total = {k: sum(t[k] for t in table.values()) for k in ("clear error", "behaviour", "cli")}
    with capsys.disabled():
        print(f"\n{'module':32} {'clear error':>11} {'behaviour':>9} {'of them CLI/slow':>16}")
        for name, t in table.items():
            print(f"{name:32} {t['clear error']:>11} {t['behaviour']:>9} {t['cli']:>16}")
        print(f"{'total':32} {total['clear error']:>11} {total['behaviour']:>9} {total['cli']:>16}")
    assert set(table) == {name for _, name in MODULES}
    assert total["clear error"] >= 120 and total["behaviour"] >= 40, total  # a floor: cases are only ever added
    # the named CLI tables are what their tests run (counted once, run once in make test-slow)
    run_errors, ignored = _module("lightning", "test_cli_run_errors"), _module("lightning", "test_silently_ignored")
    by_test = {(r["module"], r["test"]): r["count"] for r in rows}
    assert by_test["test_cli_run_errors", "test_setup_error_is_one_line"] == len(run_errors.CASES)
    assert by_test["test_silently_ignored", "test_cli_names_what_used_to_be_ignored"] == len(ignored.CLI_CASES)


@pytest.mark.slow
def test_census_parser_tables_run_in_process(tmp_path, capsys):
    """The parser's error tables (command line and config files): one ``lit-llm: error:`` line each, no
    traceback, exactly the table's text (cheap: parsing only, ``--print_config``)."""
    from lit_llm.lightning.cli import main

    errors = _module("lightning", "test_cli_errors")
    got, want = [], []
    for config, args, first in errors.PARSE_ERRORS:
        got.append(_first_line(main, ["fit", "--config", config, *args, "--print_config"], capsys))
        want.append(f"lit-llm: error: {first}")
    for i, (text, first) in enumerate(errors.CONFIG_FILE_ERRORS):
        mine = tmp_path / f"my{i}.yaml"
        mine.write_text(text)
        got.append(_first_line(main, ["fit", "--config", errors.SFT, "--config", str(mine), "--print_config"], capsys))
        want.append(f"lit-llm: error: {mine}:{first}")
    assert got == want


def _first_line(main, args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return err.splitlines()[0]
