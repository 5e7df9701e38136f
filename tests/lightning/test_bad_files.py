"""One line for every bad file (issue 30, item 6, this part): data that is not UTF-8 names the file, the line (or
row), the column and the byte, and the ``iconv`` fix; a model folder without ``config.json`` names the folder and
what it holds. The readers are unit tests; the console script runs in a subprocess in the slow tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_llm.data.rows import DataFormatError
from lit_llm.data.sources import non_utf8_position, read_rows
from lit_llm.models import resolve_model_path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
ENV.pop("LIT_LLM_DEBUG", None)
GRPO = str(ROOT / "configs/grpo_tiny.yaml")
HINT = "LIT_LLM_DEBUG=1 shows the traceback)"


def fix(name: str, stem: str, suffix: str) -> str:
    return (f"Fix: re-save it as UTF-8, e.g. `iconv -f latin1 -t utf-8 {name} > {stem}.utf8{suffix}` (latin1 if it "
            f"came from Excel or an old Windows tool; `file -i {name}` guesses the encoding), and point --data.path "
            f"at the new file.")


LATIN1 = {  # file name -> (bytes, line, column): 'café' in Latin-1 on the second data line
    "bad.jsonl": (b'{"prompt": "ok", "keyword": "a"}\n{"prompt": "caf\xe9", "keyword": "b"}\n', 2, 16),
    "bad.csv": (b"prompt,keyword\nok,a\ncaf\xe9,b\n", 3, 4),
    "bad.tsv": (b"prompt\tkeyword\nok\ta\ncaf\xe9\tb\n", 3, 4),
    "bad.json": (b'[{"prompt": "ok", "keyword": "a"},\n {"prompt": "caf\xe9", "keyword": "b"}]\n', 2, 17),
}


@pytest.mark.parametrize("name", list(LATIN1))
def test_non_utf8_byte_names_file_line_column_byte_and_fix(tmp_path, monkeypatch, name):
    data, line, column = LATIN1[name]
    (tmp_path / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    assert non_utf8_position(name) == (line, column, 0xE9)
    with pytest.raises(DataFormatError) as exc:
        read_rows(name)
    stem, suffix = name.split(".")
    assert str(exc.value) == (f"{name}:{line}: byte 0xe9 at column {column} is not UTF-8 (the file is in another "
                              f"encoding). {fix(name, stem, '.' + suffix)}")


def test_utf8_files_and_a_multibyte_character_at_a_line_end_read_as_before(tmp_path):
    path = tmp_path / "good.jsonl"
    path.write_text(json.dumps({"prompt": "café ü €", "keyword": "é"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert non_utf8_position(path) is None
    assert read_rows(path) == [(f"{path}:1", {"prompt": "café ü €", "keyword": "é"})]


def test_parquet_binary_column_is_text_or_names_row_column_byte(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good, bad = tmp_path / "good.parquet", tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": pa.array([b"ok", "café".encode()], type=pa.binary()),
                             "keyword": ["a", "b"]}), good)
    assert [row for _, row in read_rows(good)] == [{"prompt": "ok", "keyword": "a"},
                                                   {"prompt": "café", "keyword": "b"}]
    pq.write_table(pa.table({"prompt": pa.array([b"ok", b"caf\xe9"], type=pa.binary()), "keyword": ["a", "b"]}), bad)
    with pytest.raises(DataFormatError) as exc:
        read_rows(bad)
    assert str(exc.value) == (f"{bad}:row 2: column 'prompt': byte 0xe9 at position 4 is not UTF-8 (a binary column "
                              f"in another encoding). Fix: re-save the column as UTF-8 text, e.g. in pandas "
                              f"`df['prompt'] = df['prompt'].str.decode('latin1')` then `df.to_parquet(...)`, and "
                              f"point --data.path at the new file.")


def test_model_folder_without_config_json_names_it(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "weights").mkdir()
    with pytest.raises(FileNotFoundError) as exc:
        resolve_model_path(str(tmp_path))
    assert str(exc.value) == (
        f"load_model: model folder '{tmp_path}' has no config.json, so it is not a Hugging Face model folder (it "
        f"holds: tokenizer.json, weights/). Fix: point `model` at a folder written by save_pretrained or lit-llm "
        f"export (config.json, weights, tokenizer files), or at the embedded default 'smollm2-135m-instruct'.")


# ------------------------------------------------------------------------------------------ the console script
def run_fit(args: list[str], cwd: Path) -> list[str]:
    """stderr lines from the ``lit-llm: error:`` line on, after checking exit status 2 and no traceback."""
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "fit", "--config", GRPO, "--trainer.max_steps",
                           "1", "--trainer.default_root_dir", str(cwd / "run"), *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("lit-llm: error: ")]
    assert len(starts) == 1, proc.stderr[-3000:]
    return lines[starts[0]:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bad.jsonl", "bad.csv"])
def test_cli_non_utf8_data_is_one_line(tmp_path, name):
    data, line, column = LATIN1[name]
    (tmp_path / name).write_bytes(data)
    lines = run_fit(["--data.task", "null", "--data.path", name], tmp_path)
    stem, suffix = name.split(".")  # the message names its option (--data.path): no "set by" line
    assert lines == [f"lit-llm: error: {name}:{line}: byte 0xe9 at column {column} is not UTF-8 (the file is in "
                     f"another encoding). {fix(name, stem, '.' + suffix)}", f"  ({HINT}"]


@pytest.mark.slow
def test_cli_model_folder_without_config_json_is_one_line(tmp_path):
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "mymodel" / "README.md").write_text("weights to come")
    lines = run_fit(["--model.init_args.model", "mymodel"], tmp_path)
    assert lines == ["lit-llm: error: load_model: model folder 'mymodel' has no config.json, so it is not a Hugging "
                     "Face model folder (it holds: README.md). Fix: point `model` at a folder written by "
                     "save_pretrained or lit-llm export (config.json, weights, tokenizer files), or at the embedded "
                     "default 'smollm2-135m-instruct'.", f"  (set by --model.init_args.model mymodel; {HINT}"]


@pytest.mark.slow
def test_cli_default_root_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "notes.md").write_text("my notes")
    lines = run_fit(["--trainer.default_root_dir", "notes.md/run"], tmp_path)
    run, notes = str(tmp_path / "notes.md" / "run"), str(tmp_path / "notes.md")
    assert lines == [f"lit-llm: error: --trainer.default_root_dir {run!r} is under {notes!r}, which is a file, not a "
                     "folder; choose a folder path (or move the file).", f"  ({HINT}"]
    assert (tmp_path / "notes.md").read_text() == "my notes"  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]
