"""Greedy GSM8K evaluator on the tiny model: scoring, ordering back to the input rows, truncation counts."""

from __future__ import annotations

import json

import pytest

from lit_llm.evaluation import evaluate_gsm8k
from lit_llm.models import tiny_model

ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "A much longer question: Tom has 4 apples and buys 3 more apples. How many now?",
         "answer": "4 + 3 = 7\n#### 7"},
        {"question": "What is 10 - 1? Think step by step.", "answer": "#### 9"}]


@pytest.fixture
def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_evaluate_gsm8k_counts_and_order(tokenizer, gsm8k_file, monkeypatch):

    model = tiny_model(tokenizer, seed=1)
    res = evaluate_gsm8k(model, tokenizer, str(gsm8k_file), limit=None, max_new_tokens=4, batch_size=2)
    assert res.total == 3 and [r["sample_id"].rsplit(":", 1)[1] for r in res.rows] == ["1", "2", "3"]
    assert [r["reference"] for r in res.rows] == [r["answer"] for r in ROWS]
    # 4 new tokens from a random model: every answer either stopped early or is marked truncated
    assert 0 <= res.truncated <= 3 and 3 <= res.generated_tokens <= 12
    assert res.accuracy == res.correct / 3
    assert model.training is False  # tiny_model is built in eval mode and left as it was


def test_evaluate_gsm8k_scores_with_final_answer_match(tokenizer, gsm8k_file, monkeypatch):
    """The decoded completion is scored with gsm8k_answer_reward: '#### N' or else the last number."""
    import lit_llm.evaluation as ev

    model = tiny_model(tokenizer, seed=1)
    real_decode = tokenizer.decode
    answers = iter(["#### 8", "#### 7", "so 9"])  # decoded in the rows' order (generated longest first)

    def fake_decode(ids, skip_special_tokens=False):
        if skip_special_tokens:
            return next(answers)
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", fake_decode)
    res = ev.evaluate_gsm8k(model, tokenizer, str(gsm8k_file), limit=None, max_new_tokens=2, batch_size=8)
    assert [r["correct"] for r in res.rows] == [False, True, True]
    assert res.correct == 2 and res.with_hashes == 2


def test_evaluate_gsm8k_rejects_bad_settings(tokenizer, gsm8k_file):
    with pytest.raises(ValueError, match="batch_size"):
        evaluate_gsm8k(tiny_model(tokenizer), tokenizer, str(gsm8k_file), batch_size=0)
