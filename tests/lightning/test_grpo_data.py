"""GRPO prompt data: the synthetic arithmetic task (seeded, ranges, disjoint splits), GSM8K prompts, the resumable
prompt loader."""

from __future__ import annotations

import json

import pytest
import torch

from lit_llm.data.arithmetic import arithmetic_prompts, arithmetic_split
from lit_llm.data.datasets import DataFormatError
from lit_llm.lightning.grpo_data import GRPODataModule, PromptBatchLoader, collate_prompts, gsm8k_prompts


def _problem(row):
    a, op, rest = row["prompt"][-1]["content"].removeprefix("What is ").split(" ", 2)
    return int(a), op, int(rest.split("?")[0])


def test_arithmetic_split_seeded_disjoint_and_correct():
    train, held = arithmetic_split(300, 50, seed=3, low=5, high=30, ops=["+", "-", "*"])
    again, held_again = arithmetic_split(300, 50, seed=3, low=5, high=30, ops=["+", "-", "*"])
    assert train == again and held == held_again
    other, _ = arithmetic_split(300, 50, seed=4, low=5, high=30, ops=["+", "-", "*"])
    assert other != train
    problems = [_problem(r) for r in train]
    assert len(set(problems)) == 300 and not set(problems) & {_problem(r) for r in held}
    for row, (a, op, b) in zip(train, problems):
        assert 5 <= a <= 30 and 5 <= b <= 30
        assert row["answer"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert row["prompt"][-1]["content"] == f"What is {a} {op} {b}? Reply with just the number."
    assert {op for _, op, _ in problems} == {"+", "-", "*"}
    assert train[0]["sample_id"] == "arithmetic-train:0" and held[0]["sample_id"] == "arithmetic-eval:0"


def test_arithmetic_errors():
    with pytest.raises(ValueError, match="cannot draw 10 distinct train problems from 4"):
        arithmetic_prompts(10, low=1, high=2)
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['/'\]"):
        arithmetic_prompts(3, ops=["/"])
    with pytest.raises(ValueError, match="low <= high"):
        arithmetic_prompts(3, low=9, high=1)


def test_gsm8k_prompts(tmp_path, gsm8k_dir):
    rows = gsm8k_prompts(str(gsm8k_dir / "test.jsonl"), system_prompt="Be brief.", limit=3)
    first = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])
    assert len(rows) == 3 and rows[0]["answer"] == first["answer"]
    assert rows[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content":
                                                                               first["question"]}]
    assert rows[0]["sample_id"].endswith("test.jsonl:1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: missing or empty key\(s\) \['answer'\]"):
        gsm8k_prompts(str(bad))
    assert len(gsm8k_prompts(str(bad), on_bad_row="skip")) == 1


def test_prompt_loader_deals_ranks_and_resumes():
    rows = [{"prompt": f"p{i}", "sample_id": f"s{i}"} for i in range(10)]
    loader = PromptBatchLoader(rows, batch_size=3, seed=1)
    assert len(loader) == 3
    epoch0 = [b["sample_id"] for b in loader]
    epoch1 = [b["sample_id"] for b in loader]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0) and epoch0 != epoch1
    fresh = PromptBatchLoader(rows, batch_size=3, seed=1)
    it = iter(fresh)
    next(it)
    state = fresh.state_dict()
    resumed = PromptBatchLoader(rows, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert [b["sample_id"] for b in resumed] == epoch0[1:]
    r0 = PromptBatchLoader(rows, batch_size=2, seed=1, rank=0, world_size=2)
    r1 = PromptBatchLoader(rows, batch_size=2, seed=1, rank=1, world_size=2)
    a, b = [s for x in r0 for s in x["sample_id"]], [s for x in r1 for s in x["sample_id"]]
    assert len(a) == len(b) == 4 and not set(a) & set(b)
    with pytest.raises(ValueError, match="cannot fill one step"):
        PromptBatchLoader(rows, batch_size=11)
    with pytest.raises(ValueError, match="different keys"):
        collate_prompts([{"a": 1}, {"b": 2}])


def test_datamodule_renders_prompt_ids_once(tokenizer):
    dm = GRPODataModule(batch_size=4, num_train=12, num_eval=5, eval_batch_size=2, system_prompt="Be brief.")
    dm.setup()
    assert len(dm.train_rows) == 12 and len(dm.eval_rows) == 5
    row = dm.train_rows[0]
    expected = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    expected = expected["input_ids"] if isinstance(expected, dict) else expected
    assert row["prompt_ids"].tolist() == list(expected)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "sample_id", "prompt_ids"} and len(batch["prompt"]) == 4
    assert all(isinstance(p, torch.Tensor) for p in batch["prompt_ids"])
    assert [len(b["prompt"]) for b in dm.val_dataloader()] == [2, 2, 1]
    short = GRPODataModule(batch_size=1, num_train=4, num_eval=0, max_prompt_length=5)
    with pytest.raises(DataFormatError, match="no training prompt left"):
        short.setup()
    with pytest.raises(ValueError, match="task='gsm8k' needs --data.path"):
        GRPODataModule("gsm8k")


def test_missing_gsm8k_eval_file_names_its_own_option(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    dm = GRPODataModule("gsm8k", path=str(train), eval_path=str(tmp_path / "test.jsonl"), batch_size=1, num_eval=1)
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl.*--data\.eval_path"):
        dm.setup()
