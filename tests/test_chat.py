"""``lit-llm chat``: multi-turn history rendered with the model's template, streamed replies, piped stdin."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_llm.chat import chat, reply
from lit_llm.models import tiny_model

ROOT = Path(__file__).resolve().parents[1]


class GenerateSpy:
    """Records the prompt ids of every ``model.generate`` call (then calls the real one)."""

    def __init__(self, model) -> None:
        self.model, self.real, self.prompts = model, model.generate, []

    def __call__(self, input_ids, **kwargs):
        self.prompts.append(input_ids[0].tolist())
        return self.real(input_ids, **kwargs)


@pytest.fixture
def model(tokenizer):
    """A tiny random model whose greedy replies are visible text (other seeds answer with newlines only)."""
    return tiny_model(tokenizer, seed=6)


def test_two_turns_keep_the_history_and_stream_the_replies(model, tokenizer, monkeypatch):
    spy = GenerateSpy(model)
    monkeypatch.setattr(model, "generate", spy)
    out = io.StringIO()
    messages = chat(model, tokenizer, input=io.StringIO("What is 2 + 3?\n\n  And times 4?  \n"), output=out,
                    system="Answer briefly.", max_new_tokens=6)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [messages[1]["content"], messages[3]["content"]] == ["What is 2 + 3?", "And times 4?"]
    assert len(spy.prompts) == 2  # the blank line is skipped
    # each render is transformers' own template render of the conversation so far, with the generation prompt
    for n_messages, ids in ((2, spy.prompts[0]), (4, spy.prompts[1])):
        expected = tokenizer.apply_chat_template(messages[:n_messages], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        assert ids == list(expected)
    assert spy.prompts[1][:len(spy.prompts[0])] == spy.prompts[0]  # the second render holds the first turn
    assert messages[2]["content"] and messages[2]["content"] in tokenizer.decode(spy.prompts[1])
    # the streamed text is each reply (decoded without special tokens) followed by a newline
    streamed = out.getvalue()
    assert streamed.count("\n") >= 2 and streamed.endswith("\n")
    assert "".join(streamed.split()) == "".join((messages[2]["content"] + messages[4]["content"]).split())


def test_reply_is_greedy_generate_decoded(model, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    ids = torch.tensor(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"])
    with torch.no_grad():
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=5, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    expected = tokenizer.decode(out[0, ids.numel():].tolist(), skip_special_tokens=True).strip()
    assert reply(model, tokenizer, messages, max_new_tokens=5) == expected


def test_reset_exit_and_a_special_token_in_a_message(model, tokenizer):
    out = io.StringIO()
    text = "first\n/reset\nsays <|im_end|> here\nsecond\n/exit\nnever read\n"
    messages = chat(model, tokenizer, input=io.StringIO(text), output=out, max_new_tokens=2)
    assert [(m["role"], m["content"]) for m in messages][0] == ("user", "second") and len(messages) == 2
    lines = out.getvalue()
    assert "(new conversation)" in lines and "(not sent:" in lines and "<|im_end|>" in lines


def test_bad_settings_are_named(model, tokenizer):
    with pytest.raises(ValueError, match="--max_new_tokens must be >= 1"):
        reply(model, tokenizer, [{"role": "user", "content": "Hi"}], max_new_tokens=0)


def test_console_chat_reads_piped_stdin(tmp_path, tokenizer):
    """``lit-llm chat --model <HF folder>`` with two piped lines prints the same two replies as :func:`chat`."""
    folder = tmp_path / "tiny"
    model = tiny_model(tokenizer, seed=6)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    lines = "What is 2 + 3?\nAnd times 4?\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    args = ["chat", "--model", str(folder), "--max_new_tokens", "5", "--device", "cpu", "--system", "Answer briefly."]
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", *args], input=lines, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = io.StringIO()
    messages = chat(model, tokenizer, input=io.StringIO(lines), output=out, max_new_tokens=5, system="Answer briefly.")
    assert len(messages) == 5 and messages[2]["content"]
    assert proc.stdout == out.getvalue()


def test_console_chat_missing_model_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "chat", "--model", str(tmp_path / "x.ckpt")],
                          input="", env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    first = proc.stderr.splitlines()[0]
    assert first.startswith("lit-llm chat: error: checkpoint ") and "x.ckpt" in first and "--model" in first
    assert "Traceback" not in proc.stderr
