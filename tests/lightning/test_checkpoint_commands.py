"""What a user does with a ``lit-llm fit`` checkpoint: export it (readable by others), chat with it, evaluate it on
GSM8K, validate it (samples labelled with its step) and resume from it (a weights-only one is an error naming the
option). One tiny SFT run (4 steps) makes the checkpoint for all of them."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from lit_llm.lightning.cli import main
from lit_llm.lightning.export import export_checkpoint, load_checkpoint_module

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs" / "sft_tiny.yaml")
ROWS = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "Tom has 4 apples and buys 3 more. How many now?", "answer": "4 + 3 = 7\n#### 7"},
        {"question": "What is 10 - 1?", "answer": "#### 9"}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft_run")
    main(["fit", "--config", SFT, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "4",
          "--trainer.val_check_interval", "4", "--checkpoint.every_n_train_steps", "4", "--samples.num_samples", "1",
          "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true", "--checkpoint.save_top_k", "0"])
    return root


@pytest.fixture(scope="module")
def ckpt(run_dir) -> Path:
    path = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(path, map_location="cpu", weights_only=False)["global_step"] == 4
    return path


def test_save_top_k_0_keeps_one_resumable_last_ckpt(run_dir, ckpt):
    """As the real-model configs do (the demo's 135M checkpoints are 1.6 GB each): only last.ckpt, full state."""
    import yaml

    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]
    assert {"optimizer_states", "loops", "state_dict"} <= set(torch.load(ckpt, map_location="cpu", weights_only=False))
    for name in ("grpo_arithmetic.yaml", "grpo_gsm8k.yaml", "sft_gsm8k.yaml"):
        section = yaml.safe_load((ROOT / "configs" / name).read_text())["checkpoint"]
        assert section["save_top_k"] == 0 and section["save_last"] is True
        assert section.get("save_weights_only", False) is False


@pytest.mark.parametrize(("umask", "dir_mode", "file_mode"), [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_modes_follow_the_umask(ckpt, tmp_path, umask, dir_mode, file_mode):
    old = os.umask(umask)
    try:
        out = export_checkpoint(ckpt, tmp_path / "parent" / "hf")
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in files}
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: file_mode for p in files}


def test_validate_labels_samples_with_the_checkpoint_step(ckpt, tmp_path):
    cli = main(["validate", "--config", SFT, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(ckpt),
                "--samples.num_samples", "2", "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 0  # Lightning's own counter in validate: the label must not come from it
    (samples,) = tmp_path.glob("csv/version_*/samples.csv")
    rows = list(csv.DictReader(samples.open()))
    assert [r["step"] for r in rows] == ["4", "4"]
    assert cli.model.eval_step == 4


def test_eval_step_is_global_step_without_a_checkpoint():
    from lit_llm.lightning.sft import SFTModule

    module = SFTModule("tiny")
    assert module.eval_step == 0
    module.on_load_checkpoint({"global_step": 7})
    assert module.eval_step == 7


def test_resume_from_a_weights_only_checkpoint_names_the_option(ckpt, tmp_path, monkeypatch, capsys):
    full = torch.load(ckpt, map_location="cpu", weights_only=False)
    weights_only = {k: v for k, v in full.items() if k not in ("optimizer_states", "lr_schedulers", "callbacks")}
    path = tmp_path / "weights.ckpt"
    torch.save(weights_only, path)
    from lit_llm.cli_entry import console_main

    monkeypatch.setattr(sys, "argv", ["lit-llm", "fit", "--config", SFT, "--trainer.default_root_dir",
                                      str(tmp_path / "run"), "--trainer.max_steps", "6", "--ckpt_path", str(path),
                                      "--trainer.enable_progress_bar", "false"])
    with pytest.raises(SystemExit) as exc:
        console_main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    first = next(line for line in err.splitlines() if line.startswith("lit-llm: error:"))
    assert first.startswith(f"lit-llm: error: --ckpt_path {path}: this is a weights-only checkpoint")
    assert "checkpoint.save_weights_only" in first and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


def test_chat_with_a_checkpoint(ckpt, monkeypatch, capsys):
    from lit_llm.chat import chat, command

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\nAnd 4 + 4?\n"))
    command(["--model", str(ckpt), "--max_new_tokens", "4", "--device", "cpu"])
    printed = capsys.readouterr().out
    module = load_checkpoint_module(ckpt)
    out = io.StringIO()
    messages = chat(module.model.eval(), module.tokenizer, input=io.StringIO("What is 2 + 3?\nAnd 4 + 4?\n"),
                    output=out, max_new_tokens=4)
    assert len(messages) == 4 and printed == out.getvalue()


def test_evaluate_gsm8k_from_lit_llm(ckpt, tmp_path, capsys):
    from lit_llm.evaluation import command, evaluate_gsm8k

    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    res = command(["--model", str(ckpt), "--data", str(data), "--limit", "0", "--max-new-tokens", "4",
                   "--batch_size", "2", "--device", "cpu", "--out", str(tmp_path / "rows.jsonl")])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total"] == 3 and summary["model"] == str(ckpt)
    assert [json.loads(line)["reference"] for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == \
        [r["answer"] for r in ROWS]
    module = load_checkpoint_module(ckpt)
    direct = evaluate_gsm8k(module.model, module.tokenizer, str(data), limit=None, max_new_tokens=4, batch_size=2)
    assert [r["completion"] for r in res.rows] == [r["completion"] for r in direct.rows]
    assert summary["accuracy"] == direct.accuracy


def test_export_of_an_agent_checkpoint_whose_environment_is_not_importable(tmp_path):
    """``lit-llm export`` needs only the weights: a GRPO checkpoint whose ``environment`` names a module that is not
    importable here (``my_agent.py`` left in the run's folder) exports the same weights; the loaded module keeps the
    spec in its hparams and refuses to build the environment."""
    import lightning
    from transformers import AutoModelForCausalLM

    from lit_llm.lightning.grpo import GRPOModule

    module = GRPOModule("tiny", environment="calculator", max_turns=2)
    spec = {"class_path": "lit_llm_missing_agent:CapitalEnv", "init_args": {"tool_timeout": 2.0}}
    hparams = {**module.hparams, "environment": spec, "_class_path": "lit_llm.lightning.grpo.GRPOModule"}
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": lightning.__version__}, path)
    with pytest.raises(ValueError, match="lit_llm_missing_agent"):
        load_checkpoint_module(path, resolve_environment=True)
    loaded = load_checkpoint_module(path)
    assert loaded.hparams["environment"] == spec
    with pytest.raises(RuntimeError, match="loaded for its weights only"):
        loaded.env_factory()
    out = export_checkpoint(path, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    expected = module.model.state_dict()
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    assert torch.load(path, weights_only=False)["hyper_parameters"]["environment"] == spec
