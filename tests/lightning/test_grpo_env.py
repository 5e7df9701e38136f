"""GRPOModule with an environment (issue 16): episodes as rollouts in sync and async mode, per-step episode metrics
computed independently from the rollouts' episodes, the tools column of the reward functions, greedy episode
evaluation (metrics and whole episodes in eval_samples.csv), setup checks and option errors."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch
from episode_models import CapitalAfterToolEnv, key_rows, save_tiny_with_stops, write_rows
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_llm.lightning.grpo import DEFAULT_REWARDS, GRPOModule, check_environment_task, environment_hparam
from lit_llm.lightning.grpo_data import GRPODataModule, collate_prompts
from lit_llm.objectives.grpo import compute_advantages
from lit_llm.rewards import RewardError, resolve_reward
from lit_llm.rollouts import EpisodeEngine, RolloutError
from lit_llm.rollouts.envs import (
    CalculatorEnv,
    Environment,
    EnvironmentSpecError,
    GuessNumberEnv,
    Tool,
    ToolEnv,
    builtin_environment_name,
    resolve_environment,
)
from lit_llm.rollouts.episodes import ENGINE_REASONS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stops_model(tmp_path_factory) -> str:
    """Sampled turns of ~3.5 ids (7% cut at 8 new tokens): episodes of one and two turns."""
    return save_tiny_with_stops(tmp_path_factory.mktemp("tiny_stops"), every=4)


@pytest.fixture(scope="module")
def even_stops_model(tmp_path_factory) -> str:
    """Every even id stops: the greedy turns of the seed-0 tiny model stop within a few ids."""
    return save_tiny_with_stops(tmp_path_factory.mktemp("tiny_even_stops"), every=2)


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def spy_rollouts(module: GRPOModule) -> list:
    """Keep every rollout the (sync) engine returns."""
    seen, rollout = [], module.engine.rollout

    def spy(*args, **kwargs):
        seen.append(rollout(*args, **kwargs))
        return seen[-1]
    module.engine.rollout = spy
    return seen


def key_module(model: str, **kw) -> GRPOModule:
    args = dict(environment=CapitalAfterToolEnv, num_generations=4, max_new_tokens=8, max_turns=2,
                micro_batch_size=16, log_samples_every=0, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    args.update(kw)
    return GRPOModule(model, **args)


def key_data(tmp_path, **kw) -> GRPODataModule:
    path = write_rows(tmp_path / "keys.jsonl", key_rows(24))
    return GRPODataModule(path=path, **{"batch_size": 3, "num_eval": 0, **kw})


def trainer(steps: int, *callbacks, root, **kw) -> Trainer:
    """A quiet CPU trainer whose tables (rollout_samples.csv, ...) go to ``root`` (a tmp folder)."""
    args = dict(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                default_root_dir=root)
    args.update(kw)
    return Trainer(callbacks=[*callbacks], **args)


def test_episode_metrics_match_the_rollouts(stops_model, tmp_path):
    """Every logged episode metric equals its definition computed here from the step's RolloutBatch.episodes."""
    seed_everything(0)
    module = key_module(stops_model, log_samples_every=1, num_logged_samples=3)
    assert isinstance(module.engine, EpisodeEngine) and module.rewards is None
    seen, rec = spy_rollouts(module), Recorder()
    trainer(3, rec, root=tmp_path).fit(module, key_data(tmp_path))
    assert len(seen) == len(rec.steps) == 3
    # the sampled-episodes table: the evaluation table's columns, the whole episode (prompt + completion)
    with open(tmp_path / "rollout_samples.csv") as f:
        table = list(csv.reader(f))
    assert table[0] == ["step", "sample_id", "prompt", "completion", "reward", "advantage", "env_reward", "turns",
                        "tool_calls", "tool_errors", "reason"]
    assert len(table) == 1 + 3 * 3
    for step, rb in enumerate(seen, start=1):
        for i, row in enumerate(table[1 + 3 * (step - 1):1 + 3 * step]):
            e, p = rb.episodes[i], int(rb.prompt_index[i])
            question = module.tokenizer.decode(rb.prompt_ids[p][rb.prompt_mask[p]].tolist())
            assert row == [str(step), rb.sample_id[i], question, rb.completion[i], str(round(float(rb.reward[i]), 4)),
                           str(round(float(rb.advantage[i]), 4)), str(round(e["env_reward"], 4)), str(e["turns"]),
                           str(e["tool_calls"]), str(e["tool_errors"]), e["reason"]]
            assert "<|im_start|>user\nFind the code of key " in row[2] and row[2].endswith("assistant\n")
    all_turns = set()
    for rb, m in zip(seen, rec.steps):
        eps = rb.episodes
        n = len(eps)
        assert n == 12 and list(rb.rewards.keys()) == ["env"]
        turns = [e["turns"] for e in eps]
        all_turns.update(turns)
        calls, errors = sum(e["tool_calls"] for e in eps), sum(e["tool_errors"] for e in eps)
        expect = {"train/episodes/turns_mean": sum(turns) / n, "train/episodes/turns_max": max(turns),
                  "train/episodes/tool_calls_mean": calls / n,
                  "train/episodes/tool_call_rate": sum(e["tool_calls"] > 0 for e in eps) / n,
                  "train/episodes/truncated": sum(e["truncated"] for e in eps) / n,
                  "train/episodes/sampled_tokens_mean": sum(e["sampled_tokens"] for e in eps) / n,
                  "train/episodes/env_tokens_mean": sum(e["env_tokens"] for e in eps) / n,
                  "train/reward": float(rb.reward.mean()), "train/rewards/env/mean": float(rb.reward.mean()),
                  "time/tools": sum(e["tool_time"] for e in eps), "time/env": sum(e["env_time"] for e in eps)}
        for reason in ENGINE_REASONS:
            expect[f"train/episodes/truncated/{reason}"] = sum(e["truncated"] and e["reason"] == reason
                                                               for e in eps) / n
        for k in set(turns):
            rewards = [float(rb.reward[i]) for i in range(n) if turns[i] == k]
            expect[f"train/reward_by_turns/{k}"] = sum(rewards) / len(rewards)
        if calls:
            expect["train/episodes/tool_success_rate"] = 1 - errors / calls
        for key, value in expect.items():
            assert m[key] == pytest.approx(value, abs=1e-5), key
        # provenance: the trained ids are the sampled ones; an episode of 2 turns holds the tool message's ids
        for i, e in enumerate(eps):
            assert int(rb.loss_mask[i].sum()) == e["sampled_tokens"]
            assert int(rb.completion_lengths[i]) == e["sampled_tokens"] + e["env_tokens"]
            assert (e["turns"] == 2) == ("<|im_start|>tool\nThe code of" in rb.completion[i])
            assert e["tool_calls"] == e["turns"] - 1  # a first turn cut at max_new_tokens never reaches the tool
            assert e["reason"] in ("answer", "max_new_tokens") and e["truncated"] == (e["reason"] != "answer")
        # group advantages over the episodes of each prompt
        adv, _ = compute_advantages(rb.reward, 4)
        assert torch.allclose(rb.advantage, adv)
    assert all_turns == {1, 2}  # both endings happened: truncated first turns and full two-turn episodes


def test_tools_column_and_reward_functions_over_episodes(tokenizer):
    """reward_funcs get the environment's tool schemas as a 'tools' column (tool_call_format_reward reads it) and
    whole episodes as completions; their columns are the batch's plus 'tools'."""
    got = {}

    def spy_reward(prompts, completions, completion_ids, tools, answer, **kwargs):
        got.update(prompts=prompts, completions=completions, tools=tools, answer=answer, keys=sorted(kwargs))
        return [0.5] * len(completions)

    module = GRPOModule("tiny", environment="calculator", reward_funcs=[spy_reward, "tool_call_format_reward"],
                        reward_weights=[1.0, 2.0], num_generations=2, max_new_tokens=6, max_turns=2)
    rows = CalculatorEnv.make_rows(2, seed=1)
    rb = module.engine.rollout(collate_prompts(rows), step=0)
    schema = Tool(CalculatorEnv.tools[0]).schema
    assert got["tools"] == [[schema]] * 4
    assert got["answer"] == [r["answer"] for r in rows for _ in range(2)]
    assert got["keys"] == ["expression", "trainer_state"]
    assert all(c[0]["role"] == "assistant" for c in got["completions"])
    assert got["prompts"][0][0]["role"] == "system" and "<tools>" in got["prompts"][0][0]["content"]
    assert list(rb.rewards.keys()) == ["env", "spy_reward", "tool_call_format_reward"]
    # total = env + 1.0 * 0.5 + 2.0 * format (the random model neither answers nor calls: env = format = 0)
    assert torch.equal(rb.rewards["tool_call_format_reward"], torch.zeros(4))
    assert torch.allclose(rb.reward, rb.rewards["env"] + 0.5)


def test_default_rewards_single_turn_unchanged_and_none_with_an_environment():
    single = GRPOModule("tiny")
    assert single.env_factory is None and type(single.engine).__name__ == "RolloutEngine"
    assert single.rewards.funcs == [resolve_reward(f) for f in DEFAULT_REWARDS]
    assert single.objective.max_completion_length == single.max_new_tokens
    env = GRPOModule("tiny", environment="guess_number")
    assert env.rewards is None and env.eval_rewards is None and env.engine.reward_fn is None
    assert sorted(env.eval_metrics) == ["env_reward", "tool_call_rate", "turns"]


def test_option_errors():
    with pytest.raises(ValueError, match=r"\['max_turns', 'tool_timeout', 'env_reward_weight'\] apply to multi-turn"):
        GRPOModule("tiny", max_turns=3, tool_timeout=1.0, env_reward_weight=0.5)
    with pytest.raises(ValueError, match="dr_grpo.*max_episode_tokens"):
        GRPOModule("tiny", environment="calculator", loss_type="dr_grpo")
    module = GRPOModule("tiny", environment="calculator", loss_type="dr_grpo", max_episode_tokens=48)
    assert module.objective.max_completion_length == module.engine.max_completion_length == 48
    with pytest.raises(EnvironmentSpecError, match="calculater.*did you mean 'calculator'"):
        GRPOModule("tiny", environment="calculater")
    with pytest.raises(ValueError) as e:
        GRPOModule("tiny", environment="calculator", max_turns=2, max_tool_calling_iterations=3)
    assert str(e.value) == (
        "GRPOModule: max_turns=2 and max_tool_calling_iterations=3 disagree (max_turns = iterations + 1: the model "
        "answers once more after the last environment reply); set only one. A config that sets one keeps it when the "
        "other is given on the command line: pass it as null, e.g. --model.init_args.max_tool_calling_iterations 3 "
        "--model.init_args.max_turns null, or --model.init_args.max_turns 2 "
        "--model.init_args.max_tool_calling_iterations null.")
    assert GRPOModule("tiny", environment="calculator", max_turns=4, max_tool_calling_iterations=3).engine.max_turns \
        == 4  # agreeing values are fine
    assert GRPOModule("tiny", environment="calculator", max_tool_calling_iterations=3).engine.max_turns == 4
    fix = ("a config that sets reward_weights keeps them when reward_funcs is changed on the command line: pass "
           "--model.init_args.reward_weights null too (all weights 1), or one weight per function.")
    with pytest.raises(ValueError) as e:
        GRPOModule("tiny", environment="calculator", reward_funcs=[], reward_weights=[1.0])
    assert str(e.value) == ("GRPOModule: reward_weights [1.0] given without reward_funcs (the environment's reward is "
                            f"weighted by env_reward_weight); {fix}")
    with pytest.raises(RewardError) as e:  # the type of RewardFunctions' own check
        GRPOModule("tiny", reward_funcs=["strict_arithmetic_reward"], reward_weights=[1.0, 0.5])
    assert str(e.value) == ("GRPOModule: reward_weights [1.0, 0.5] has 2 entries but reward_funcs "
                            f"['strict_arithmetic_reward'] has 1; {fix}")
    with pytest.raises(ValueError, match="reward_funcs is empty"):
        GRPOModule("tiny", reward_funcs=[])


def test_environment_columns_checked_at_setup_before_any_rollout(tmp_path):
    module = GRPOModule("tiny", environment="guess_number", num_generations=2, max_new_tokens=4)
    dm = key_data(tmp_path)  # a file of the user's whose rows lack the game's secret
    with pytest.raises(RolloutError, match=r"GuessNumberEnv needs the column\(s\) \['secret'\], but the training "
                                           r"prompts of GRPODataModule has only \['key', 'mode', 'prompt', "
                                           r"'sample_id'\]"):
        trainer(1, root=tmp_path).fit(module, dm)
    assert module.engine.num_policy_calls == 0


class ResetOnlyEnv(Environment):
    """A user environment that forgot step (the tiny model's turns never end, so training alone would not notice)."""

    required_columns = ("key",)


class NoScoreToolEnv(ToolEnv):
    """A tool task that forgot score."""

    tools = [CalculatorEnv.tools[0]]


@pytest.mark.parametrize(("environment", "message"), [
    (ResetOnlyEnv, "environment ResetOnlyEnv does not implement step(messages) -> EnvStep, the environment's reply to "
                   "each model turn; it inherits Environment.step, which raises NotImplementedError. Write "
                   "ResetOnlyEnv.step(messages)."),
    (NoScoreToolEnv, "environment NoScoreToolEnv does not implement score(answer, row) -> float, the reward of the "
                     "final answer (a turn without tool calls); it inherits ToolEnv.score, which raises "
                     "NotImplementedError. Write NoScoreToolEnv.score(answer, row)."),
])
def test_environment_without_step_or_score_fails_at_setup(tmp_path, environment, message):
    module = GRPOModule("tiny", environment=environment, num_generations=2, max_new_tokens=2)
    with pytest.raises(RolloutError) as e:
        trainer(1, root=tmp_path).fit(module, key_data(tmp_path))
    assert str(e.value) == message
    with pytest.raises(RolloutError) as e:  # without a data module too
        trainer(1, root=tmp_path, limit_val_batches=None).validate(module, [{"prompt": ["Hi"], "key": ["k0"]}])
    assert str(e.value) == message
    assert module.engine.num_policy_calls == 0


def test_environment_task_without_environment_warns(tmp_path):
    module = GRPOModule("tiny", reward_funcs=["arithmetic_answer_reward"], num_generations=2, max_new_tokens=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(1, root=tmp_path).fit(module, GRPODataModule("calculator", batch_size=1, num_train=2, num_eval=0))
    expected = ("GRPOModule: data.task='calculator' holds the prompts of the 'calculator' environment, but "
                "model.environment is not set: they are trained as single completions. Set "
                "--model.init_args.environment calculator for episodes.")
    assert [str(w.message) for w in caught if "data.task=" in str(w.message)] == [expected]


def _mismatch(name: str, task: str, other: str) -> str:
    return (f"GRPOModule: model.environment='{name}' plays its episodes on the rows of data.task='{name}', but "
            f"data.task='{task}': its prompts were not made for the '{name}' environment (training would run without "
            f"an error, on the wrong task). Fix: set --data.task {name}, or --data.task null with --data.path <your "
            f"rows> (a 'prompt' column and the environment's columns), or {other}.")


def test_builtin_environment_with_another_builtin_task_fails_at_setup(tmp_path):
    """environment calculator + task arithmetic has every column the calculator reads (answer), so it would train
    silently on the wrong prompts: setup stops it before any rollout, naming both options and the fixes."""
    module = GRPOModule("tiny", environment="calculator", num_generations=2, max_new_tokens=2)
    dm = GRPODataModule("arithmetic", batch_size=1, num_train=2, num_eval=0)
    expected = _mismatch("calculator", "arithmetic",
                         "drop --model.init_args.environment for single-turn GRPO on the 'arithmetic' prompts")
    with pytest.raises(ValueError) as e:
        trainer(1, root=tmp_path).fit(module, dm)
    assert str(e.value) == expected
    assert module.engine.num_policy_calls == 0
    # the default data module (no task, no path) is the arithmetic task too; validate checks as well
    with pytest.raises(ValueError, match="but data.task='arithmetic'"):
        trainer(1, root=tmp_path, limit_val_batches=None).validate(module, GRPODataModule(num_train=2, num_eval=2))


@pytest.mark.parametrize(("environment", "task", "other"), [
    ("guess_number", "calculator", "set --model.init_args.environment calculator for 'calculator' episodes"),
    ("calculator", "guess_number", "set --model.init_args.environment guess_number for 'guess_number' episodes"),
    ("calculator", "gsm8k", "drop --model.init_args.environment for single-turn GRPO on the 'gsm8k' prompts"),
    ({"class_path": "calculator", "init_args": {"tool_timeout": 2.0}}, "arithmetic",
     "drop --model.init_args.environment for single-turn GRPO on the 'arithmetic' prompts"),
])
def test_check_environment_task_errors(environment, task, other):
    factory = resolve_environment(environment)
    name = builtin_environment_name(factory)
    with pytest.raises(ValueError) as e:
        check_environment_task(factory, task)
    assert str(e.value) == _mismatch(name, task, other)


def test_check_environment_task_allows_matching_and_user_pairs():
    class MyCalculator(CalculatorEnv):
        pass
    for env, task in [("calculator", "calculator"), ("guess_number", "guess_number"), ("calculator", None),
                      (MyCalculator, "arithmetic"), (CapitalAfterToolEnv, "calculator")]:
        check_environment_task(resolve_environment(env), task)  # no error
    check_environment_task(None, "calculator")  # single-turn: the setup warning's case, not an error


def test_greedy_episode_evaluation(even_stops_model, tmp_path):
    """validate: one greedy episode per held-out row; eval/env_reward, eval/tool_call_rate, eval/turns and the eval
    reward functions are the means over the episodes; eval_samples.csv holds whole episodes."""
    module = key_module(even_stops_model, eval_reward_funcs=["tool_call_format_reward"], eval_samples=3,
                        eval_max_new_tokens=6)
    trajs = []
    engine = module.eval_engine()
    run = engine.run_episodes
    engine.run_episodes = lambda envs, rows, seeds=None, **kw: (trajs.extend(run(envs, rows, seeds, **kw))
                                                                or trajs[-len(rows):])
    assert engine.policy.generation_config.do_sample is False and engine.seed is None
    assert engine.max_turns == module.engine.max_turns == 2
    dm = key_data(tmp_path, num_eval=5, eval_batch_size=3)
    logger = CSVLogger(tmp_path, name="logs")
    trainer(1, root=tmp_path, logger=logger, limit_val_batches=None).validate(module, dm)
    assert len(trajs) == 5 and all(t.turns == 2 and t.tool_calls == 1 for t in trajs)  # greedy turns all stop
    with open(f"{logger.log_dir}/metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    n = len(trajs)
    assert float(row["eval/env_reward"]) == pytest.approx(sum(t.env_reward for t in trajs) / n)
    assert float(row["eval/turns"]) == 2.0 and float(row["eval/tool_call_rate"]) == 1.0
    assert float(row["eval/tool_call_format_reward"]) == 0.0  # no tool is offered: no valid call
    with open(f"{logger.log_dir}/eval_samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert list(samples[0]) == ["step", "sample_id", "prompt", "completion", "reference", "env_reward",
                                "tool_call_format_reward", "turns", "tool_calls", "tool_errors", "reason"]
    assert [s["sample_id"] for s in samples] == [r["sample_id"] for r in dm.eval_rows[:3]]
    for s, t, r in zip(samples, trajs, dm.eval_rows):
        assert s["prompt"] == t.prompt_text(module.tokenizer) == module.tokenizer.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False)
        assert s["prompt"].endswith(f"<|im_start|>user\n{r['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        assert s["completion"] == t.text(module.tokenizer)
        assert (int(s["turns"]), int(s["tool_calls"]), int(s["tool_errors"]), s["reason"]) == (
            t.turns, t.tool_calls, t.tool_errors, t.reason)
        assert int(s["tool_errors"]) == (r["mode"] == "error")  # CapitalAfterToolEnv's failing lookups
        assert float(s["env_reward"]) == round(t.env_reward, 4) and float(s["tool_call_format_reward"]) == 0.0
        assert "\n<|im_start|>tool\nThe code of" in s["completion"]  # special tokens kept: the turns show
        assert s["reference"] == "key=" + next(r["key"] for r in dm.eval_rows if r["sample_id"] == s["sample_id"])


class FailsOnKey(CapitalAfterToolEnv):
    """Raises (an environment bug) on the row whose key is :attr:`bad_key`."""

    bad_key = ""

    def step(self, messages):
        if self.row["key"] == self.bad_key:
            raise RuntimeError("lookup table corrupt")
        return super().step(messages)


def test_greedy_episode_error_names_the_held_out_row(even_stops_model, tmp_path, monkeypatch):
    """An environment failing in evaluation names its held-out row: one greedy episode per row, so episode i of
    the batch is row i (not the training layout of num_generations episodes per prompt)."""
    module = key_module(even_stops_model, environment=FailsOnKey, eval_max_new_tokens=6)
    dm = key_data(tmp_path, num_eval=5, eval_batch_size=5)
    dm.setup("validate")
    batch = collate_prompts(dm.eval_rows)
    i = 3
    monkeypatch.setattr(FailsOnKey, "bad_key", batch["key"][i])
    with pytest.raises(RolloutError, match="FailsOnKey.step raised RuntimeError: lookup table corrupt") as e:
        module.greedy_episodes(batch)
    assert e.value.__notes__[-1] == f"in episode {i} of 5 (prompt {i}, sample_id {batch['sample_id'][i]!r})"


def test_async_rollouts_build_an_episode_engine(stops_model, tmp_path):
    module = key_module(stops_model, rollout_mode="async", max_staleness=2, max_episode_tokens=40)
    rec = Recorder()
    trainer(3, rec, root=tmp_path).fit(module, key_data(tmp_path))
    producer = module.async_rollouts
    assert isinstance(producer.engine, EpisodeEngine) and producer.engine.model is not module.model
    assert producer.engine.episode == module.engine.episode and producer.engine.settings == module.engine.settings
    assert producer.engine.num_policy_calls > 0 and module.engine.num_policy_calls == 0
    assert 1 <= len(rec.steps) <= 3
    for m in rec.steps:
        assert m["train/staleness"] <= 2 and math.isfinite(m["train/loss"])
        assert 1 <= m["train/episodes/turns_mean"] <= 2
        assert m["train/episodes/tool_calls_mean"] == pytest.approx(m["train/episodes/tool_call_rate"])


def test_guess_number_multi_turn_with_user_feedback(stops_model):
    """The built-in game through the module's engine: user feedback turns, reward only on a right guess."""
    module = GRPOModule(stops_model, environment="guess_number", num_generations=2, max_new_tokens=8, max_turns=3)
    rows = GuessNumberEnv.make_rows(3, seed=0)
    rb = module.engine.rollout(collate_prompts(rows), step=0)
    assert rb.num_rows == 6 and max(e["turns"] for e in rb.episodes) > 1
    for i, e in enumerate(rb.episodes):
        if e["turns"] > 1:
            assert "<|im_start|>user\n" in rb.completion[i] and "guess" in rb.completion[i]
        assert e["env_reward"] in (0.0, 1.0) and e["turns"] <= 3
        # the game has max_turns=3 guesses (not its own 7): it ends itself after the third, never cut by max_turns
        assert e["reason"] in ("answer", "max_guesses", "max_new_tokens")
        assert e["reason"] != "max_guesses" or e["turns"] == 3
        if e["turns"] > 1:
            assert "3 guesses left" not in rb.completion[i] and " 2 guesses left." in rb.completion[i]


def test_resume_continues_exactly(stops_model, tmp_path):
    """Checkpoints and resume with episodes: 2 steps + a resumed run of 2 more == 4 uninterrupted steps (rewards,
    episode metrics, weights); episodes one after the other (batching off) are bit-reproducible."""
    def run(steps: int, root, ckpt_path=None):
        seed_everything(0)
        module = key_module(stops_model, batching=False)
        rec = Recorder()
        save = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=2, save_top_k=0)
        fit = trainer(steps, rec, save, root=root, enable_checkpointing=True)
        fit.fit(module, key_data(tmp_path), ckpt_path=ckpt_path)
        return rec.steps, module

    full, full_module = run(4, tmp_path / "full")
    first, _ = run(2, tmp_path / "part")
    rest, part_module = run(4, tmp_path / "part", ckpt_path=str(tmp_path / "part" / "last.ckpt"))
    keys = ("train/reward", "train/episodes/turns_mean", "train/episodes/sampled_tokens_mean", "train/loss")
    assert [[m[k] for k in keys] for m in first + rest] == [[m[k] for k in keys] for m in full]
    a, b = full_module.state_dict(), part_module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the class given in Python is saved as its import path (plain data: Lightning resumes with weights_only)
    hparams = torch.load(tmp_path / "part" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert hparams["environment"] == "episode_models:CapitalAfterToolEnv"


def test_environment_hparam():
    assert environment_hparam("calculator") == "calculator"
    assert environment_hparam(GuessNumberEnv) == "lit_llm.rollouts.envs.guess_number:GuessNumberEnv"
    spec = {"class_path": CalculatorEnv, "init_args": {"tool_timeout": 2.0}}
    assert environment_hparam(spec) == {"class_path": "lit_llm.rollouts.envs.calculator:CalculatorEnv",
                                        "init_args": {"tool_timeout": 2.0}}

    class Local(CalculatorEnv):
        pass
    assert environment_hparam(Local) is Local  # not importable: kept
