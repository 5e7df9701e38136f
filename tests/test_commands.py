"""``test``, ``predict`` and ``chat`` do what their names say (issue 30, item 7): ``test`` is not offered (left out
of ``lit-llm --help``, one error line naming ``validate`` / ``evaluate`` / ``predict``); ``lit-llm predict`` writes
greedy completions of a prompt file as JSONL, with rewards when reward functions are given; ``lit-llm chat`` without
``--model`` chats with the embedded model, like every other command's default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_llm import chat, cli_front, models

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
ENV.pop("LIT_LLM_DEBUG", None)

TEST_LINE = ("lit-llm: error: `lit-llm test` is not offered (lit_llm's modules have no test_step); evaluate a "
             "checkpoint with `lit-llm validate --config CONFIG --ckpt_path CKPT --data.init_args.eval_path TEST_FILE` "
             "(GRPO: greedy answers scored by eval_reward_funcs; SFT: the validation loss), `lit-llm evaluate --model "
             "CKPT --data gsm8k/test.jsonl` (GSM8K accuracy) or `lit-llm predict --model CKPT --data TEST_FILE --out "
             "rows.jsonl --reward_funcs [...]` (completions and rewards per prompt).")


def test_test_is_refused_naming_what_to_use(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_front.front(["test", "--config", "configs/sft_tiny.yaml", "--ckpt_path", "last"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [TEST_LINE]


def test_help_lists_only_offered_commands():
    assert cli_front.offered_commands() == ["fit", "validate", "export", "plot", "chat", "evaluate", "predict"]
    text = cli_front.top_parser().format_help()
    assert text.startswith("usage: lit-llm [-h] {fit,validate,export,plot,chat,evaluate,predict} ...")
    assert "    test " not in text
    assert "    predict             Greedy completions and rewards for a prompt file.\n" in text


def test_chat_defaults_to_the_embedded_model():
    assert chat.DEFAULT_MODEL == models.DEFAULT_MODEL


@pytest.mark.slow
def test_cli_test_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "test", "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.splitlines() == [TEST_LINE]


@pytest.mark.slow
def test_cli_chat_without_model_answers_with_the_embedded_model():
    """Piped stdin, greedy, 4 tokens: the reply equals the embedded model's own greedy reply (chat.reply)."""
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "chat", "--max_new_tokens", "4", "--device",
                           "cpu"], input="What is 2 + 3?\n", cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    model, tokenizer = models.load_model()
    expected = chat.reply(model, tokenizer, [{"role": "user", "content": "What is 2 + 3?"}], max_new_tokens=4)
    assert expected and proc.stdout.strip() == expected


# ------------------------------------------------------------------------------------------------ lit-llm predict
PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"},
           {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 10 - 1?"}],
            "answer": "9"},
           {"prompt": "Say hi", "answer": "no number"}]


def char_count_reward(completions, answer, **kwargs):
    """A reward of the test: the completion's length in characters, None where the answer has no digit."""
    from lit_llm.rewards.answers import completion_text

    return [None if not any(ch.isdigit() for ch in a) else float(len(completion_text(c)))
            for c, a in zip(completions, answer)]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from lit_llm.models import load_tokenizer, tiny_model

    tokenizer = load_tokenizer()
    return tiny_model(tokenizer, seed=3), tokenizer


def test_predict_writes_greedy_completions_and_rewards(model_and_tokenizer, tmp_path):
    import json

    import torch

    from lit_llm.data.prompts import tokenize_prompts
    from lit_llm.evaluation import predict

    model, tokenizer = model_and_tokenizer
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    rows, gen = predict(model, tokenizer, str(data), reward_funcs=[char_count_reward], max_new_tokens=6,
                        batch_size=2)
    chats = [[{"role": "user", "content": "What is 2 + 3?"}], PROMPTS[1]["prompt"],
             [{"role": "user", "content": "Say hi"}]]
    # independently: each prompt alone (no padding) through HF generate, greedy, 6 new tokens
    expected = []
    for ids in tokenize_prompts(chats, tokenizer):
        with torch.no_grad():
            out = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=6,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(out[0, ids.numel():].tolist(), skip_special_tokens=True))
    assert [r["completion"] for r in rows] == expected
    assert [r["sample_id"] for r in rows] == [f"{data}:{i}" for i in (1, 2, 3)]
    assert [r["prompt"] for r in rows] == chats  # string prompts are one user message (--string_prompts chat)
    assert [r["rewards"] for r in rows] == [{"char_count_reward": float(len(expected[0]))},
                                            {"char_count_reward": float(len(expected[1]))},
                                            {"char_count_reward": None}]
    assert gen.generated_tokens == sum(int(r.numel()) for r in gen.response_ids)


def test_predict_names_a_column_a_reward_needs(model_and_tokenizer, tmp_path):
    from lit_llm.evaluation import predict
    from lit_llm.rewards import RewardError

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "What is 2 + 3?"}\n')
    with pytest.raises(RewardError, match=r"^reward function 'arithmetic_answer_reward' needs the column 'answer', "
                                          r"but --data .*p.jsonl has only the columns \[\]"):
        predict(*model_and_tokenizer, str(data), reward_funcs=["arithmetic_answer_reward"], max_new_tokens=2)


@pytest.mark.slow
def test_cli_predict_writes_jsonl_and_refuses_an_existing_out(tmp_path):
    import json

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    args = [sys.executable, "-m", "lit_llm.cli_entry", "predict", "--model", "tiny", "--data", "prompts.jsonl",
            "--out", "out/pred.jsonl", "--max_new_tokens", "3", "--device", "cpu", "--reward_funcs",
            "[arithmetic_answer_reward]"]
    proc = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 3 and summary["out"] == "out/pred.jsonl"
    rows = [json.loads(line) for line in (tmp_path / "out" / "pred.jsonl").read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["completion", "prompt", "rewards", "sample_id", "truncated"]] * 3
    assert [r["rewards"]["arithmetic_answer_reward"] is None for r in rows] == [False, False, True]
    assert os.listdir(tmp_path / "out") == ["pred.jsonl"]
    again = subprocess.run(args, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert again.returncode == 2 and again.stderr.splitlines() == [
        "lit-llm predict: error: --out 'out/pred.jsonl' exists; choose another --out or pass --overwrite true to "
        "replace it.", "  (LIT_LLM_DEBUG=1 shows the traceback)"]
