"""``test``, ``predict`` and ``chat`` do what their names say (issue 30, item 7): ``test`` / ``predict`` are not
offered (left out of ``lit-llm --help``, one error line naming ``validate`` / ``evaluate`` / ``chat``); ``lit-llm
chat`` without ``--model`` chats with the embedded model, like every other command's default."""

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
             "(GRPO: greedy answers scored by eval_reward_funcs; SFT: the validation loss), or `lit-llm evaluate "
             "--model CKPT --data gsm8k/test.jsonl` (GSM8K accuracy).")
PREDICT_LINE = ("lit-llm: error: `lit-llm predict` is not offered (lit_llm's modules have no predict_step); write "
                "completions with `lit-llm evaluate --model CKPT --data FILE --out rows.jsonl` (GSM8K rows, greedy), "
                "or pipe prompts to `lit-llm chat --model CKPT` (one reply per line).")


@pytest.mark.parametrize(("command", "line"), [("test", TEST_LINE), ("predict", PREDICT_LINE)])
def test_test_and_predict_are_refused_naming_what_to_use(command, line, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_front.front([command, "--config", "configs/sft_tiny.yaml", "--ckpt_path", "last"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_help_lists_only_offered_commands():
    assert cli_front.offered_commands() == ["fit", "validate", "export", "plot", "chat", "evaluate"]
    text = cli_front.top_parser().format_help()
    assert text.startswith("usage: lit-llm [-h] {fit,validate,export,plot,chat,evaluate} ...")
    assert "    test " not in text and "    predict " not in text


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
