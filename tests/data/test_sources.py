"""Reading data sources into rows with ids: JSONL (file:line), Parquet / CSV / TSV / JSON through `datasets`
(file:row N, nested message lists read back as written), Hub names (an error offline; online through
`datasets.load_dataset` with the parsed name, config and split), and the errors that name the option and the fix."""

from __future__ import annotations

import json

import datasets
import pytest

from lit_llm.data.datasets import DataFormatError, read_examples
from lit_llm.data.sources import HubOfflineError, read_rows

CHATS = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "n": 1},
    {"messages": [{"role": "system", "content": "Be short."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}], "n": 2},
]


def test_jsonl_rows_keep_file_line_ids(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(CHATS[0]) + "\n\n" + json.dumps(CHATS[1]) + "\n")
    assert read_rows(path) == [(f"{path}:1", CHATS[0]), (f"{path}:3", CHATS[1])]
    assert read_rows(path, limit=1) == [(f"{path}:1", CHATS[0])]


def test_parquet_json_csv_tsv_rows(tmp_path):
    pq = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(CHATS).to_parquet(str(pq))
    # Arrow would give the shorter conversation's messages the same keys; they read back exactly as written
    assert read_rows(pq) == [(f"{pq}:row 1", CHATS[0]), (f"{pq}:row 2", CHATS[1])]
    arr = tmp_path / "chats.json"
    arr.write_text(json.dumps(CHATS))  # a JSON array of objects
    assert read_rows(arr) == [(f"{arr}:row 1", CHATS[0]), (f"{arr}:row 2", CHATS[1])]
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,answer\nWhat is 1 + 2?,3\n\"Say \"\"hi\"\", please\",hi\n")
    # a column holding a non-number is read as strings (pandas' CSV reader, used by datasets)
    assert read_rows(csv) == [(f"{csv}:row 1", {"prompt": "What is 1 + 2?", "answer": "3"}),
                              (f"{csv}:row 2", {"prompt": 'Say "hi", please', "answer": "hi"})]
    tsv = tmp_path / "p.tsv"
    tsv.write_text("prompt\tanswer\nq1\ta1\nq2\ta2\nq3\ta3\n")
    assert read_rows(tsv, limit=2) == [(f"{tsv}:row 1", {"prompt": "q1", "answer": "a1"}),
                                       (f"{tsv}:row 2", {"prompt": "q2", "answer": "a2"})]


def test_csv_column_types_are_inferred_per_column(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,answer\nWhat is 1 + 2?,3\nWhat is 2 + 2?,4\n")
    rows = read_rows(csv)
    assert rows == [(f"{csv}:row 1", {"prompt": "What is 1 + 2?", "answer": 3}),
                    (f"{csv}:row 2", {"prompt": "What is 2 + 2?", "answer": 4})]


def test_parquet_examples_for_sft(tmp_path):
    pq = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(CHATS).to_parquet(str(pq))
    a, b = read_examples(pq, system_prompt="Sys.")
    assert a.sample_id == f"{pq}:row 1" and b.sample_id == f"{pq}:row 2"
    assert a.messages == [{"role": "system", "content": "Sys."}, *CHATS[0]["messages"]]
    assert a.num_prompt_messages == 2 and a.reference == "Hello"
    assert b.messages == CHATS[1]["messages"] and b.num_prompt_messages == 2  # its own system prompt wins


def test_missing_file_and_unsupported_suffix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet.*--data\.eval_path"):
        read_rows(tmp_path / "nope.parquet", option="--data.eval_path")
    bad = tmp_path / "data.xlsx"
    bad.write_text("x")
    with pytest.raises(DataFormatError, match=r"unsupported file type '\.xlsx'.*\.parquet"):
        read_rows(bad)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataFormatError, match=r"broken\.parquet: cannot be read by datasets\.load_dataset"):
        read_rows(broken)
    empty = tmp_path / "empty.csv"
    empty.write_text("prompt,answer\n")
    with pytest.raises(DataFormatError, match=r"empty\.csv: cannot be read .*no data"):
        read_rows(empty)


def test_hub_name_offline_is_an_error_naming_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    called = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: called.append(a))
    with pytest.raises(HubOfflineError, match=r"'openai/gsm8k:main:train' \(--data\.path\) is not a local file.*"
                                              r"offline.*point --data\.path at a local file"):
        read_rows("openai/gsm8k:main:train")
    assert not called


def test_hub_name_online_goes_through_load_dataset(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    calls = []

    def fake_load(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list([{"question": "q1", "answer": "#### 1"},
                                           {"question": "q2", "answer": "#### 2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = read_rows("openai/gsm8k:main:test", limit=1)
    assert calls == [("openai/gsm8k", {"name": "main", "split": "test"})]
    assert rows == [("openai/gsm8k:test:row 1", {"question": "q1", "answer": "#### 1"})]
    read_rows("user/prompts", split="test")
    read_rows("user/prompts:validation")
    assert calls[1:] == [("user/prompts", {"name": None, "split": "test"}),
                         ("user/prompts", {"name": None, "split": "validation"})]
    with pytest.raises(DataFormatError, match="NAME:CONFIG:SPLIT"):
        read_rows("a:b:c:d")
