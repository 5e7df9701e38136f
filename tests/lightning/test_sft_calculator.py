"""The SFT data module's built-in calculator task (``format: calculator``): synthetic tool traces rendered as the
episode engine renders the task (the tool in a system message for SmolLM2, through ``tools=`` for templates that take
it), trained with the assistant (rlhf) mask: the call turn and the answer, never the prompt or the tool result; and
``configs/sft_calculator_tools.yaml`` end to end with the tiny model, exported to the HF folder a GRPO run starts
from."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.rollouts.envs import CalculatorEnv, Tool, calculator

ROOT = Path(__file__).resolve().parents[2]
STOP = "<|im_end|>"


def runs(tokenizer, ids, mask) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    out, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [tokenizer.decode(cur)], []
    return out + ([tokenizer.decode(cur)] if cur else [])


def data(tokenizer, **kw) -> SFTDataModule:
    dm = SFTDataModule(format="calculator", **{"num_samples": 4, "eval_limit": 2, "loss_head": "rlhf", **kw})
    dm.tokenizer = tokenizer
    dm.setup()
    return dm


def test_calculator_traces_train_the_call_and_the_answer(tokenizer):
    dm = data(tokenizer)
    rows = CalculatorEnv.make_sft_rows(4, 0)
    assert dm.tools is None  # SmolLM2's template takes no tools=: the tool is described in the system message
    assert [s.sample_id for s in dm.train_samples] == [f"calculator-train:{i}" for i in range(4)]
    assert [s.sample_id for s in dm.val_samples] == ["calculator-eval:0", "calculator-eval:1"]
    for sample, row in zip(dm.train_samples, rows):
        m = row["messages"]
        assert sample.input_ids.tolist() == list(tokenizer.apply_chat_template(m, return_dict=False))
        assert m[0]["role"] == "system" and "<tools>" in m[0]["content"]
        assert runs(tokenizer, sample.input_ids, sample.assistant_mask) == [m[2]["content"] + STOP,
                                                                           m[4]["content"] + STOP]
        assert runs(tokenizer, sample.input_ids, sample.response_mask) == [m[4]["content"] + STOP]
        assert sample.reference == m[4]["content"]


def test_calculator_traces_use_tools_of_templates_that_take_them(tokenizer, templates_dir):
    template = templates_dir / "stock-qwen2_5.jinja"
    dm = data(tokenizer, chat_template=str(template))
    assert dm.tools == [Tool(calculator).schema]
    rows = CalculatorEnv.make_sft_rows(4, 0, tools_in_system=False)
    for sample, row in zip(dm.train_samples, rows):
        m = row["messages"]
        assert [x["role"] for x in m] == ["user", "assistant", "tool", "assistant"]
        ref = tokenizer.apply_chat_template(m, tools=dm.tools, chat_template=template.read_text(), return_dict=False)
        assert sample.input_ids.tolist() == list(ref)
        assert runs(tokenizer, sample.input_ids, sample.assistant_mask) == [m[1]["content"] + STOP,
                                                                           m[3]["content"] + STOP]


def test_calculator_format_options_and_errors(tokenizer):
    with pytest.raises(ValueError, match=r"--data\.format is 'calculator' \(the synthetic task reads no file\) but "
                                         r"--data\.path is set"):
        SFTDataModule("chat.jsonl", format="calculator")
    with pytest.warns(UserWarning, match=r"format 'calculator' with loss head 'sft': the tool-call turn is not "
                                         r"trained \(only the final answer is\); set --model\.loss rlhf"):
        data(tokenizer, loss_head="sft")
    dm = data(tokenizer, system_prompt="Be brief.")
    text = tokenizer.decode(dm.train_samples[0].input_ids)
    assert "</tool_call>\n\nEach result comes back" in text and "Be brief.\n\n# Tools" in text


@pytest.mark.slow
def test_sft_calculator_tools_config_runs_and_exports(tmp_path, tokenizer):
    """The shipped config with the tiny model: one step over 4 traces; the step trains exactly the assistant tokens
    (the two assistant turns of each trace, counted from their own tokenisation); the export loads as a model."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "lit_llm.lightning.cli"]
    fit = [*cli, "fit", "--config", str(ROOT / "configs/sft_calculator_tools.yaml"), "--model.init_args.model", "tiny",
           "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1", "--trainer.val_check_interval",
           "1", "--trainer.precision", "32-true", "--data.init_args.num_samples", "4", "--data.init_args.batch_size",
           "4", "--data.init_args.micro_batch_size", "2", "--data.init_args.eval_limit", "2",
           "--samples.max_new_tokens", "4", "--checkpoint.every_n_train_steps", "1"]
    proc = subprocess.run(fit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        (row,) = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert math.isfinite(float(row["train/loss"]))

    def n_tokens(text: str) -> int:
        return len(tokenizer(text + STOP, add_special_tokens=False)["input_ids"])

    traces = CalculatorEnv.make_sft_rows(4, 0)
    assert float(row["train/step_tokens"]) == sum(n_tokens(t["messages"][2]["content"])
                                                  + n_tokens(t["messages"][4]["content"]) for t in traces)
    out = tmp_path / "hf"
    proc = subprocess.run([*cli, "export", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"), "--out",
                           str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from lit_llm.models import load_model

    model, tok = load_model(str(out))  # what a GRPO config's `model: <folder>` loads
    assert model.config.hidden_size == 64 and tok.chat_template == tokenizer.chat_template
