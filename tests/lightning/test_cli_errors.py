"""``lit-llm`` errors and help (issue 14 item 4): a bad option is one message (first stderr line: the option, the
allowed values, a near match; exit 2; no traceback); a class's own error at build time comes first, then the option
that set it (``main`` raises it as a ``CLIConfigError``, the console script prints it and exits 2); no
abbreviations; GRPOModule among the model subclasses; ``lit-llm --help`` and the extra commands' help import neither
torch nor Lightning (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal, Optional

import pytest

from lit_llm import cli_entry
from lit_llm.cli_errors import CLIConfigError, allowed_values, near
from lit_llm.lightning.cli import LitLLMCLI, main

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "configs/grpo_tiny.yaml")
SFT = str(ROOT / "configs/sft_tiny.yaml")
GRPO_TOOLS = str(ROOT / "configs/grpo_tools_tiny.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def error_lines(args: list[str], capsys) -> list[str]:
    """Run ``main(args)``; it must exit 2; returns stderr's lines."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err and "usage:" not in err, err
    return err.splitlines()


PARSE_ERRORS = [
    (GRPO, ["--model.init_args.loss_type", "dapo2"],
     "--model.init_args.loss_type: 'dapo2' is not allowed; use one of: dapo, grpo, dr_grpo, bnpo, cispo, null "
     "(did you mean dapo?)"),
    (GRPO, ["--model.rollout_mode", "asynch"],  # the short form names the canonical option
     "--model.init_args.rollout_mode: 'asynch' is not allowed; use one of: sync, async (did you mean async?)"),
    (SFT, ["--model.loss", "rlfh"],
     "--model.init_args.loss: 'rlfh' is not allowed; use one of: sft, rlhf, generic (did you mean rlhf?)"),
    (GRPO, ["--trainer.max_step", "2"],  # an abbreviation is not accepted
     "--trainer.max_step: unknown option (did you mean --trainer.max_steps?)"),
    (GRPO, ["--ckpt_pat", "last"], "--ckpt_pat: unknown option (did you mean --ckpt_path?)"),
    (GRPO, ["--model.init_args.loss_typ", "dapo"],
     "--model.init_args.loss_typ: GRPOModule has no option loss_typ (did you mean --model.init_args.loss_type?)"),
    (GRPO, ["--model.class_path", "GRPOModul"],
     "--model.class_path: 'GRPOModul' is not a PolicyModule; use one of: PolicyModule, SFTModule, GRPOModule "
     "(did you mean GRPOModule?)"),
    (GRPO, ["--wandb", "maybe"], "--wandb: 'maybe' is not allowed; use one of: true, false"),
    (GRPO, ["--model.init_args.num_generations", "abc"],
     "--model.init_args.num_generations: expected an integer, got 'abc'"),
    (GRPO, ["--data.init_args.batch_size", "x"], "--data.init_args.batch_size: expected an integer, got 'x'"),
    (GRPO, ["--model.init_args.optimizer.lr", "x"],
     "--model.init_args.optimizer.init_args.lr: expected a number, got 'x'"),
    (GRPO, ["--model.init_args.optimizer", "torch.optim.Adamw"],
     "--model.init_args.optimizer: expected a class or function: module 'torch.optim' has no attribute 'Adamw', "
     "got 'torch.optim.Adamw' (did you mean torch.optim.AdamW?)"),
    (SFT, ["--model.init_args.optimizer.init_args.lrr", "3"],  # a nested class's option: named in full
     "--model.init_args.optimizer.init_args.lrr: AdamW has no option lrr (did you mean "
     "--model.init_args.optimizer.init_args.lr?)"),
    (SFT, ["--model.init_args.lrr", "3"],  # lr is the optimizer's, not the module's (not lora_r)
     "--model.init_args.lrr: SFTModule has no option lrr (did you mean --model.init_args.optimizer.init_args.lr?)"),
]

#: ``(YAML given as a second --config, first line after "lit-llm: error: {file}:")``: a bad key or value in a config
#: file is the command line's message with the file and line and the options as YAML keys (issue 30 item 2).
CONFIG_FILE_ERRORS = [
    ("model:\n  init_args:\n    optimizer:\n      init_args:\n        lrr: 3\n",
     "5: model.init_args.optimizer.init_args.lrr: AdamW has no option lrr (did you mean "
     "model.init_args.optimizer.init_args.lr?)"),
    ("model:\n  lrr: 3\n",
     "2: model.init_args.lrr: SFTModule has no option lrr (did you mean model.init_args.optimizer.init_args.lr?)"),
    ("# comment\ntrainer:\n  max_stepz: 3\n",
     "3: trainer.max_stepz: unknown option (did you mean trainer.max_steps?)"),
    ("samples:\n  max_new_tokenz: 3\n",
     "2: samples.max_new_tokenz: unknown option (did you mean samples.max_new_tokens?)"),
    ("seed_everythin: 3\n", "1: seed_everythin: unknown option (did you mean seed_everything?)"),
    ("model:\n  init_args:\n    loss: rlfh\n",
     "3: model.init_args.loss: 'rlfh' is not allowed; use one of: sft, rlhf, generic (did you mean rlhf?)"),
]


@pytest.mark.parametrize(("config", "args", "first"), PARSE_ERRORS, ids=[" ".join(a) for _, a, _ in PARSE_ERRORS])
def test_parse_error_is_one_message(config, args, first, capsys):
    lines = error_lines(["fit", "--config", config, *args, "--print_config"], capsys)
    assert lines[0] == f"lit-llm: error: {first}"
    assert lines[1:] == ["  (`lit-llm fit --help` lists the options; LIT_LLM_DEBUG=1 shows the parser's full "
                         "message)"]


@pytest.mark.parametrize(("text", "first"), CONFIG_FILE_ERRORS, ids=[t.split(":")[0] for t, _ in CONFIG_FILE_ERRORS])
def test_config_file_error_names_the_file_and_line(text, first, tmp_path, capsys):
    mine = tmp_path / "my.yaml"
    mine.write_text(text)
    lines = error_lines(["fit", "--config", SFT, "--config", str(mine), "--print_config"], capsys)
    assert lines[0] == f"lit-llm: error: {mine}:{first}"


def test_grpo_config_file_error_names_the_file(tmp_path, capsys):
    mine = tmp_path / "my.yaml"
    mine.write_text(Path(GRPO).read_text().replace("max_new_tokens:", "max_new_tokenz:", 1))
    number = next(i for i, x in enumerate(mine.read_text().splitlines(), 1) if "max_new_tokenz" in x)
    lines = error_lines(["fit", "--config", str(mine), "--print_config"], capsys)
    assert lines[0] == (f"lit-llm: error: {mine}:{number}: model.init_args.max_new_tokenz: GRPOModule has no option "
                        f"max_new_tokenz (did you mean model.init_args.max_new_tokens?)")


def test_debug_env_keeps_jsonargparse_message(capsys, monkeypatch):
    monkeypatch.setenv("LIT_LLM_DEBUG", "1")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", GRPO, "--model.init_args.loss_type", "dapo2", "--print_config"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: lit-llm [options] fit")
    assert "Does not validate against any of the Union subtypes" in err and "lit-llm: error" not in err


def build_error_lines(args: list[str]) -> list[str]:
    """Run ``main(args)``: it must raise :class:`CLIConfigError` (the console prints it as ``lit-llm: error:``)."""
    with pytest.raises(CLIConfigError) as exc:
        main(args)
    assert isinstance(exc.value, ValueError) and exc.value.__cause__ is not None
    return str(exc.value).splitlines()


def test_module_value_error_comes_first_with_its_option(tmp_path):
    lines = build_error_lines(["fit", "--config", GRPO, "--model.init_args.num_generations", "1",
                               "--trainer.max_steps", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert lines == ["GRPOModule: num_generations must be an integer >= 2, got 1.",
                     "  (set by --model.init_args.num_generations 1; LIT_LLM_DEBUG=1 shows the traceback)"]


ENV_CASES = {
    # the module's message quotes 'path/to/my_agnt.py:CapitalEnv' (not --data.init_args.path)
    "module_typo": ("my_agnt:CapitalEnv", "my_agnt:CapitalEnv",
                    "GRPOModule: model.environment: Environment 'my_agnt:CapitalEnv' could not be loaded: "),
    # the message lists the parameters of a ToolEnv (not --model.init_args.tool_timeout)
    "bad_init_args": ('{"class_path": "capital_env:CapitalEnv", "init_args": {"bogus": 1}}',
                      "{'class_path': 'capital_env:CapitalEnv', 'init_args': {'bogus': 1}}",
                      "GRPOModule: model.environment: Environment spec {'class_path': 'capital_env:CapitalEnv', "
                      "'init_args': {'bogus': 1}}: CapitalEnv does not take these init_args"),
    "unknown_builtin": ("calculater", "calculater",
                        "GRPOModule: model.environment: Unknown environment 'calculater': not a built-in (did you "
                        "mean 'calculator'?)"),
}


@pytest.mark.parametrize("case", list(ENV_CASES))
def test_environment_spec_error_names_the_environment_option(case, tmp_path, monkeypatch):
    """An environment spec that does not resolve is attributed to --model.init_args.environment, with the spec as
    given, whatever else its message mentions (a 'path/to/...' example, the class's parameters)."""
    (tmp_path / "capital_env.py").write_text(
        "from lit_llm.rollouts.envs import ToolEnv\n\n\nclass CapitalEnv(ToolEnv):\n"
        "    def score(self, answer, row):\n        return 0.0\n")
    (tmp_path / "capitals.jsonl").write_text(json.dumps({"prompt": "Capital of France?", "answer": "Paris"}) + "\n")
    monkeypatch.chdir(tmp_path)
    given, shown, first = ENV_CASES[case]
    lines = build_error_lines(["fit", "--config", GRPO, "--data.task", "null", "--data.path", "capitals.jsonl",
                               "--model.init_args.reward_funcs", "[]", "--model.init_args.reward_weights", "null",
                               "--model.init_args.environment", given, "--trainer.max_steps", "0",
                               "--trainer.default_root_dir", str(tmp_path)])
    assert lines[0].startswith(first), lines
    if case == "bad_init_args":
        assert "its parameters are ['tool_timeout', 'on_tool_error'" in lines[0]
    if case == "module_typo":
        assert "'path/to/my_agnt.py:CapitalEnv'" in lines[0]
    assert lines[-1] == f"  (set by --model.init_args.environment {shown}; LIT_LLM_DEBUG=1 shows the traceback)"


def test_max_tool_calling_iterations_over_a_config_with_max_turns_says_to_null_it(tmp_path):
    lines = build_error_lines(["fit", "--config", GRPO_TOOLS, "--model.init_args.max_tool_calling_iterations", "3",
                               "--trainer.max_steps", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert lines == [
        "GRPOModule: max_turns=3 and max_tool_calling_iterations=3 disagree (max_turns = iterations + 1: the model "
        "answers once more after the last environment reply); set only one. A config that sets one keeps it when the "
        "other is given on the command line: pass it as null, e.g. --model.init_args.max_tool_calling_iterations 3 "
        "--model.init_args.max_turns null, or --model.init_args.max_turns 3 "
        "--model.init_args.max_tool_calling_iterations null.",
        "  (LIT_LLM_DEBUG=1 shows the traceback)"]


def test_reward_funcs_emptied_over_a_config_with_reward_weights_says_to_null_them(tmp_path):
    lines = build_error_lines(["fit", "--config", GRPO_TOOLS, "--model.init_args.reward_funcs", "[]",
                               "--trainer.max_steps", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert lines == [
        "GRPOModule: reward_weights [0.2] given without reward_funcs (the environment's reward is weighted by "
        "env_reward_weight); a config that sets reward_weights keeps them when reward_funcs is changed on the command "
        "line: pass --model.init_args.reward_weights null too (all weights 1), or one weight per function.",
        "  (LIT_LLM_DEBUG=1 shows the traceback)"]


def test_an_unknown_reward_name_is_told_before_the_weights_mismatch(tmp_path):
    """grpo_tiny sets two reward_weights: one misspelled reward_funcs entry is about its name, not the count."""
    lines = build_error_lines(["fit", "--config", GRPO, "--model.init_args.reward_funcs", "[strict_arithmetic_rewrd]",
                               "--trainer.max_steps", "0", "--trainer.default_root_dir", str(tmp_path)])
    assert lines[0].startswith("Unknown reward function 'strict_arithmetic_rewrd' (a reward_funcs / eval_reward_funcs "
                               "entry): not a built-in (did you mean 'strict_arithmetic_reward'?). Built-in reward "
                               "functions: ["), lines[0]


def test_trainer_error_names_its_option(tmp_path):
    lines = build_error_lines(["fit", "--config", SFT, "--trainer.accelerator", "gpuu", "--trainer.default_root_dir",
                               str(tmp_path)])
    assert lines[0].startswith("You selected an invalid accelerator name: `accelerator='gpuu'`. Available names are:")
    assert lines[1] == "  (set by --trainer.accelerator gpuu; LIT_LLM_DEBUG=1 shows the traceback)"


def test_module_value_error_with_debug_env_raises_it(monkeypatch):
    monkeypatch.setenv("LIT_LLM_DEBUG", "1")
    with pytest.raises(ValueError) as exc:
        main(["fit", "--config", GRPO, "--model.init_args.num_generations", "1", "--trainer.max_steps", "0"])
    chain = [exc.value, exc.value.__cause__]
    assert any("num_generations must be an integer >= 2, got 1" in str(e) for e in chain)


def test_console_script_prints_no_traceback(tmp_path):
    """Through the real console entry (a fresh interpreter): exit 2, the module's text on stderr's first line."""
    proc = subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", "fit", "--config", GRPO,
                           "--model.init_args.num_generations", "1", "--trainer.max_steps", "0"],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "lit-llm: error: GRPOModule: num_generations must be an integer >= 2, got 1.",
        "  (set by --model.init_args.num_generations 1; LIT_LLM_DEBUG=1 shows the traceback)"]
    assert "Traceback" not in proc.stderr


def test_grpo_module_in_help_and_model_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("known subclasses: lit_llm.lightning.PolicyModule, lit_llm.lightning.SFTModule, "
            "lit_llm.lightning.grpo.GRPOModule") in out
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--model.help", "GRPOModule"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--model.num_generations" in out and "--model.loss_type" in out


# -------------------------------------------------------------------------------------------- entry and help
HELP_PROBE = """
import json, sys
sys.argv = ["lit-llm", *json.loads(sys.argv[1])]
from lit_llm.cli_entry import console_main
code = 0
try:
    console_main()
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "lightning_fabric", "transformers"))
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], *[[name, "--help"] for name in cli_entry.EXTRA_COMMANDS]],
                         ids=lambda a: " ".join(a))
def test_help_imports_neither_torch_nor_lightning(args):
    proc = subprocess.run([sys.executable, "-c", HELP_PROBE, json.dumps(args)], env=ENV, capture_output=True,
                          text=True, timeout=120)
    result = json.loads(proc.stderr.splitlines()[-1])
    assert result == {"code": 0, "heavy": []}, proc.stderr
    usage = proc.stdout.splitlines()[0]
    if args == ["--help"]:
        commands = ["fit", "validate", *cli_entry.EXTRA_COMMANDS]  # test / predict are not offered (issue 30)
        assert usage == "usage: lit-llm [-h] {" + ",".join(commands) + "} ..."
        assert {"export", "plot", "chat", "evaluate"} <= set(commands)
        for name, command in cli_entry.EXTRA_COMMANDS.items():
            assert f"    {name}" in proc.stdout and command.summary in proc.stdout
    else:
        assert usage.startswith(f"usage: lit-llm {args[0]} ")


def test_lightning_command_summaries_match_lightning():
    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import _get_short_description

    assert list(cli_entry.LIGHTNING_COMMANDS) == list(LitLLMCLI.subcommands())
    for name, summary in cli_entry.LIGHTNING_COMMANDS.items():
        assert _get_short_description(getattr(Trainer, name)).startswith(summary)


def test_no_command_and_unknown_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lit-llm: error: give a command: fit, validate, export, plot, chat, evaluate, predict")
    with pytest.raises(SystemExit) as exc:
        main(["fitt", "--config", SFT])
    assert exc.value.code == ("lit-llm: error: unknown command 'fitt'; use one of: fit, validate, "
                              "export, plot, chat, evaluate, predict (did you mean fit?)")


def test_export_errors_are_one_message(tmp_path, capsys, monkeypatch):
    lines = error_lines(["export", "--ckpt_pat", "x.ckpt", "--out", str(tmp_path / "o")], capsys)
    assert lines[0] == "lit-llm export: error: --ckpt_pat: unknown option (did you mean --ckpt_path?)"
    # the console script: the export module's FileNotFoundError is one line, exit 2 (main() lets it propagate)
    monkeypatch.setattr(sys, "argv", ["lit-llm", "export", "--ckpt_path", str(tmp_path / "nope.ckpt"), "--out",
                                      str(tmp_path / "o")])
    with pytest.raises(SystemExit) as exc:
        cli_entry.console_main()
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("lit-llm export: error: checkpoint ") and "nope.ckpt" in lines[0]
    assert lines[1:] == ["  (LIT_LLM_DEBUG=1 shows the traceback)"]


def test_allowed_values_and_near():
    assert allowed_values(Optional[Literal["sync", "async"]]) == (["sync", "async", "null"], [])  # noqa: UP045
    assert allowed_values(bool) == (["true", "false"], [])
    assert allowed_values(int | None) == (["null"], ["an integer"])
    assert allowed_values(Literal[64, 32] | str) == (["64", "32"], ["a string"])
    assert near("asynch", ["sync", "async"]) == ["async", "sync"]  # best first
    assert near("asynch", ["sync", "async"], n=1) == ["async"]
    assert near("ADAMW", ["AdamW", "SGD"]) == ["AdamW"]
    assert near("zzz", ["sync", "async"]) == []


def test_config_error_keeps_the_exceptions_notes():
    """An environment's error names its episode and sample in a PEP 678 note (EpisodeEngine.run_episodes): the
    one-line message ends with the notes, the root cause's first, each once; a wrapper's text is dropped."""
    from lit_llm.cli_errors import explain_config_error

    root = RuntimeError("MathEnv.reset took longer than env_timeout 0.5 s")
    root.add_note("in episode 2 of 4 (prompt 1, generation 0, sample_id 'b')")
    root.add_note("in episode 2 of 4 (prompt 1, generation 0, sample_id 'b')")  # the same note twice: once
    wrapper = ValueError("Problem with given class_path 'lit_llm.lightning.GRPOModule'")
    wrapper.add_note("while running fit")
    wrapper.__cause__ = root
    assert explain_config_error(wrapper) == (
        "MathEnv.reset took longer than env_timeout 0.5 s; in episode 2 of 4 (prompt 1, generation 0, sample_id 'b'); "
        "while running fit\n  (RuntimeError; LIT_LLM_DEBUG=1 shows the traceback)")
    plain = ValueError("bad.jsonl:2: not a JSON object.")
    assert explain_config_error(plain) == ("bad.jsonl:2: not a JSON object.\n"
                                           "  (ValueError; LIT_LLM_DEBUG=1 shows the traceback)")
