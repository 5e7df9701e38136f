"""Tool-using GRPO through the real ``lit-llm`` CLI (issue 16): the two configs parse; ``grpo_tools_tiny.yaml`` as
shipped trains and logs the episode metrics; the calculator chain of ``grpo_calculator.yaml`` (SFT warm-up, export,
GRPO from the exported folder) runs with the tiny model; the README's "Train an agent" example (its ``my_agent.py``,
``capitals.jsonl``, ``agent.yaml`` and command, extracted from README.md) works: its environment scores a scripted
episode exactly, and its command trains."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EPISODE_METRICS = ("train/episodes/turns_mean", "train/episodes/turns_max", "train/episodes/tool_calls_mean",
                   "train/episodes/tool_call_rate", "train/episodes/truncated",
                   "train/episodes/truncated/max_new_tokens", "train/episodes/sampled_tokens_mean",
                   "train/episodes/env_tokens_mean", "train/reward_by_turns/1", "train/rewards/env/mean",
                   "time/tools", "time/env", "time/episode_generation", "time/generation", "time/training")
EVAL_METRICS = ("eval/env_reward", "eval/tool_call_rate", "eval/turns")


@pytest.mark.parametrize("config", ["grpo_tools_tiny.yaml", "grpo_calculator.yaml"])
def test_tool_configs_parse(config, capsys):
    from lit_llm.lightning.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert "environment: calculator" in out and "task: calculator" in out
    # null: the environment's own tool_timeout (ToolEnv's 10 s or its init_args), not a silent override
    assert re.findall(r"^ +tool_timeout: (.*)$", out, flags=re.M) == ["null"]


def lit_llm(cwd: Path, *args: str, command: str = "fit") -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "lit_llm.cli_entry"] if command == "export" else \
        [sys.executable, "-m", "lit_llm.lightning.cli"]
    proc = subprocess.run([*cli, command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def check_episode_run(log_dir: Path, steps: int) -> list[dict[str, str]]:
    rows = read_csv(log_dir / "metrics.csv")
    train = [r for r in rows if r.get("train/reward")]
    assert len(train) == steps
    for key in EPISODE_METRICS:
        assert all(math.isfinite(float(r[key])) for r in train), key
    assert all(1 <= float(r["train/episodes/turns_mean"]) <= float(r["train/episodes/turns_max"]) for r in train)
    # the host-memory release ran after every step (PolicyModule.release_host_memory logs its figures)
    steps_logged = [r for r in rows if r.get("memory/host_rss_gib")]
    assert len(steps_logged) == steps
    assert all(0 < float(r["memory/host_rss_gib"]) <= float(r["memory/host_peak_rss_gib"]) for r in steps_logged)
    evals = [r for r in rows if r.get("eval/env_reward")]
    assert evals and all(0 <= float(r[k]) <= 3 for r in evals for k in EVAL_METRICS)
    samples = read_csv(log_dir / "eval_samples.csv")
    # the two episode tables share their names: step, sample_id, prompt, completion, <lead>, env_reward, ..., reason
    stats = ["turns", "tool_calls", "tool_errors", "reason"]
    assert samples and list(samples[0])[:6] == ["step", "sample_id", "prompt", "completion", "reference",
                                                "env_reward"] and list(samples[0])[-4:] == stats
    rollout_samples = read_csv(log_dir / "rollout_samples.csv")
    assert list(rollout_samples[0])[:7] == ["step", "sample_id", "prompt", "completion", "reward", "advantage",
                                            "env_reward"] and list(rollout_samples[0])[-4:] == stats
    assert rollout_samples[0]["reason"] and "<|im_start|>user\n" in rollout_samples[0]["prompt"]
    return samples


def test_grpo_tools_tiny_config_logs_episode_metrics(tmp_path):
    lit_llm(tmp_path, "--config", str(ROOT / "configs" / "grpo_tools_tiny.yaml"), "--trainer.default_root_dir",
            str(tmp_path))
    samples = check_episode_run(tmp_path / "csv" / "version_0", 4)
    assert samples[0]["sample_id"] == "calculator-eval:0"
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


def test_shipped_tiny_config_calls_the_calculator_tool(tmp_path, tokenizer, monkeypatch):
    """configs/grpo_tools_tiny.yaml as shipped, in-process, with the model's turns scripted (the random tiny model
    never writes a tool call): every episode's first turn calls ``calculator`` on the question's expression, the
    second answers with the tool's result. The environment's ``step`` runs after each model turn, the tool result
    comes back as a tool message, the answer is scored exactly: training and greedy evaluation episodes all end
    with reward 1.0 after 2 turns and 1 successful call. The real generate version still runs every turn (through
    the threaded batcher); only the ids it returns are replaced."""
    from lit_llm.lightning.cli import main
    from lit_llm.rollouts import episodes
    from lit_llm.rollouts.envs.calculator import CalculatorEnv

    real_responses = episodes.policy_responses

    def scripted(policy, prompts, *, seeds=None, batch_order=None):
        real_responses(policy, prompts, seeds=seeds, batch_order=batch_order)  # the batcher's shared passes
        ids, lps = [], []
        for prompt in prompts:
            text = tokenizer.decode(prompt.tolist())
            results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text, flags=re.S)
            if results:
                reply = f"The answer is {results[-1].strip()}.<|im_end|>"
            else:
                expression = re.findall(r"What is (.+?)\? Use the calculator", text)[-1]
                reply = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression +
                         '"}}\n</tool_call><|im_end|>')
            ids.append(torch.tensor(tokenizer.encode(reply, add_special_tokens=False), dtype=torch.long))
            lps.append(torch.full((len(ids[-1]),), -1.0))
        return ids, lps, [False] * len(prompts)

    steps: list[int] = []
    real_step = CalculatorEnv.step

    def counted_step(self, messages):
        steps.append(1)
        return real_step(self, messages)

    monkeypatch.setattr(episodes, "policy_responses", scripted)
    monkeypatch.setattr(CalculatorEnv, "step", counted_step)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", ["lit-llm"])
    main(["fit", "--config", str(ROOT / "configs" / "grpo_tools_tiny.yaml"), "--trainer.default_root_dir",
          str(tmp_path), "--trainer.enable_progress_bar", "false"])
    rows = read_csv(tmp_path / "csv" / "version_0" / "metrics.csv")
    train = [r for r in rows if r.get("train/reward")]
    evals = [r for r in rows if r.get("eval/env_reward")]
    assert len(train) == 4 and len(evals) == 3  # steps 1-4; evaluations at steps 0, 2, 4
    for r in train:
        assert float(r["train/episodes/tool_call_rate"]) == 1.0 and float(r["train/episodes/tool_success_rate"]) == 1.0
        assert float(r["train/episodes/turns_mean"]) == 2.0 and float(r["train/rewards/env/mean"]) == 1.0
        assert float(r["train/rewards/tool_call_format_reward/mean"]) == 1.0
    for r in evals:
        assert float(r["eval/env_reward"]) == 1.0 and float(r["eval/tool_call_rate"]) == 1.0
        assert float(r["eval/turns"]) == 2.0
    # two env steps per episode: 4 steps x 2 prompts x 4 generations in training, 3 x 4 held-out rows greedily
    assert len(steps) == 2 * (4 * 2 * 4 + 3 * 4)
    samples = read_csv(tmp_path / "csv" / "version_0" / "rollout_samples.csv")
    assert all(s["tool_calls"] == "1" and s["tool_errors"] == "0" and float(s["env_reward"]) == 1.0 for s in samples)


@pytest.mark.slow
def test_calculator_chain_sft_export_grpo(tmp_path):
    """The three commands of configs/grpo_calculator.yaml, with the tiny model and small sizes."""
    lit_llm(tmp_path, "--config", str(ROOT / "configs" / "sft_calculator_tools.yaml"), "--trainer.max_steps", "2",
            "--checkpoint.every_n_train_steps", "2", "--model.init_args.model", "tiny", "--data.init_args.num_samples",
            "8", "--data.init_args.batch_size", "4", "--data.init_args.micro_batch_size", "4",
            "--data.init_args.eval_limit", "2")
    lit_llm(tmp_path, "--ckpt_path", "runs/sft_calculator_tools/checkpoints/last.ckpt", "--out",
            "runs/sft_calculator_tools/hf", command="export")
    lit_llm(tmp_path, "--config", str(ROOT / "configs" / "grpo_calculator.yaml"), "--trainer.max_steps", "2",
            "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1", "--data.init_args.batch_size",
            "2", "--data.init_args.eval_batch_size", "3", "--model.init_args.num_generations", "2", "--wandb",
            "false")
    check_episode_run(tmp_path / "runs" / "grpo_calculator" / "csv" / "version_0", 2)


# ------------------------------------------------------------------------------------------- README example
def readme_example() -> dict[str, str]:
    """The "Train an agent" section's files (the code block after each "`name`:" line) and its tiny command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Train an agent"):]
    section = section[:section.index("\n## ", 3)]
    files = {name: body for name, body in
             re.findall(r"`([\w.]+)`:\n\n```\w+\n(.*?)```", section, flags=re.S)}
    (command,) = [line for line in section.splitlines() if line.startswith("lit-llm fit --config "
                                                                            "configs/grpo_tools_tiny.yaml")]
    return {**files, "command": command.split("#")[0].strip()}


def test_readme_agent_example_environment(tmp_path, monkeypatch):
    """The README's tool and environment (~20 lines) do what the section says, on a scripted episode."""
    example = readme_example()
    assert sorted(example) == ["agent.yaml", "capitals.jsonl", "command", "my_agent.py"]
    code = example["my_agent.py"]
    assert sum(bool(line.strip()) for line in code.splitlines()) <= 22
    (tmp_path / "my_agent.py").write_text(code, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_agent

    from lit_llm.rollouts.envs import ToolCall, resolve_environment

    env = resolve_environment({"class_path": "my_agent:CapitalEnv", "init_args": {"tool_timeout": 2.0}})()
    assert env.tool_timeout == 2.0 and [t.name for t in env.tools] == ["capital_of"]
    assert env.tools[0].schema["function"]["parameters"]["properties"] == {
        "country": {"type": "string", "description": 'the country\'s English name, e.g. "France".'}}
    row = {"prompt": "What is the capital of Kenya?", "answer": "Nairobi"}
    messages = env.reset(row)
    assert messages == [{"role": "user", "content": "What is the capital of Kenya?"}]
    call = {"role": "assistant", "content": ToolCall("capital_of", {"country": "kenya"}).to_text()}
    step = env.step([*messages, call])
    assert step.messages == [{"role": "tool", "name": "capital_of", "content": "Nairobi"}] and not step.done
    assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0
    final = env.step([*messages, call, *step.messages, {"role": "assistant", "content": "It is Nairobi."}])
    assert (final.reward, final.done, final.info["reason"]) == (1.0, True, "answer")
    assert env.step([*messages, {"role": "assistant", "content": "Mombasa."}]).reward == 0.0
    assert my_agent.capital_of("Atlantis") == "unknown country 'Atlantis'"
    # the README's direct check of the tool (the tiny run never calls it) prints the tool message with the city
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"```python\n(from my_agent import.*?)```", text, flags=re.S)
    printed: list = []
    exec(snippet, {"print": printed.append})  # noqa: S102 - the README's own code
    assert printed[0].messages == [{"role": "tool", "name": "capital_of", "content": "Lima"}]


def test_readme_agent_example_trains(tmp_path):
    example = readme_example()
    for name in ("my_agent.py", "capitals.jsonl", "agent.yaml"):
        (tmp_path / name).write_text(example[name], encoding="utf-8")
    args = example["command"].split()[2:]  # after "lit-llm fit"
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in args]
    lit_llm(tmp_path, *args, "--trainer.default_root_dir", str(tmp_path))
    samples = check_episode_run(tmp_path / "csv" / "version_0", 4)
    config = (tmp_path / "csv" / "version_0" / "config.yaml").read_text()
    assert "environment: my_agent:CapitalEnv" in config and "path: capitals.jsonl" in config
    assert all(s["sample_id"].startswith("capitals.jsonl:") for s in samples)
    answers = {line.split('"answer": "')[1].split('"')[0] for line in example["capitals.jsonl"].splitlines()}
    assert {s["reference"] for s in samples} <= answers


@pytest.mark.parametrize("class_path", ["my_agent.CapitalEnv", "my_agent:CapitalEnv", "{cwd}/my_agent.py:CapitalEnv",
                                        "my_agent.py:CapitalEnv"])
def test_environment_dict_class_path_from_a_config_loads_from_the_cwd(class_path, tmp_path, monkeypatch):
    """``environment: {class_path: ..., init_args: ...}`` in a YAML config, the module in the current directory and
    not on ``sys.path`` (as with the ``lit-llm`` console script): every string form of the plain spec works, the
    init_args reach the environment, the hparam keeps the dict as written."""
    from lightning.pytorch import LightningDataModule

    from lit_llm.lightning.cli import LitLLMCLI
    from lit_llm.lightning.module import PolicyModule

    (tmp_path / "my_agent.py").write_text(readme_example()["my_agent.py"], encoding="utf-8")
    class_path = class_path.format(cwd=tmp_path)
    (tmp_path / "agent.yaml").write_text(f"model:\n  init_args:\n    environment:\n      class_path: {class_path}\n"
                                         f"      init_args: {{tool_timeout: 2.0}}\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_agent", raising=False)
    try:
        cli = LitLLMCLI(PolicyModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                        run=False, args=["--config", str(ROOT / "configs" / "grpo_tools_tiny.yaml"), "--config",
                                         "agent.yaml", "--wandb", "false", "--trainer.default_root_dir",
                                         str(tmp_path)])
        env = cli.model.env_factory()
        assert (type(env).__name__, env.tool_timeout, [t.name for t in env.tools]) == ("CapitalEnv", 2.0,
                                                                                        ["capital_of"])
        assert cli.model.hparams["environment"] == {"class_path": class_path, "init_args": {"tool_timeout": 2.0}}
    finally:
        sys.modules.pop("my_agent", None)
