"""User code is bounded (issue 30 item 2): a reward function slower than ``reward_timeout`` scores ``None`` for the
completions of that call (warned, counted in ``train/rewards/<name>/timeouts``), an environment ``step`` slower than
``env_timeout`` ends its episode (reason ``env_timeout``), a ``reset`` slower than it is an error naming the
environment and the row; functions that raise stay errors naming the function and the sample. Nothing waits for the
abandoned call (its thread keeps running, released here at the end of each test)."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from episode_doubles import ScriptedEnv, Step, fake_log_probs

from lit_llm.lightning.grpo_metrics import rollout_metrics
from lit_llm.lightning.grpo_options import build_rewards, episode_settings
from lit_llm.policy import TransformersWrapper
from lit_llm.rewards import RewardError, RewardFunctions
from lit_llm.rollouts import RolloutEngine
from lit_llm.rollouts.envs import CalculatorEnv
from lit_llm.rollouts.episode_loop import run_episode
from lit_llm.rollouts.episode_renderer import EpisodeRenderer
from lit_llm.rollouts.settings import EpisodeSettings, RolloutError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def release():
    """An event the hanging user code waits on; set after the test so the abandoned threads end."""
    event = threading.Event()
    yield event
    event.set()


def _hanging_reward(release):
    def hang(completions, **kwargs):
        release.wait(60)
        return [1.0] * len(completions)
    return hang


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


# ------------------------------------------------------------------------------------------------ rewards
def test_a_reward_call_past_its_timeout_scores_none_warns_and_is_counted(release):
    rewards = RewardFunctions([_hanging_reward(release), length_reward], [1.0, 0.5], timeout=0.2)
    t0 = time.monotonic()
    with pytest.warns(UserWarning) as caught:
        total, per_fn = rewards(prompts=["What is 1 + 2?", "What is 1 + 2?", "Hi"], completions=["3", "33", "x"])
    assert time.monotonic() - t0 < 5
    assert [str(w.message) for w in caught] == [
        "Reward function 'hang' did not return within reward_timeout=0.2 s on 3 completions (prompt 0: 'What is 1 + "
        "2?'): its scores for them are None (left out of the weighted sum), counted in train/rewards/hang/timeouts; "
        "the call keeps running on an abandoned thread. Make the function faster or raise "
        "--model.init_args.reward_timeout (null: no limit)."]
    assert all(math.isnan(v) for v in per_fn["hang"].tolist())
    assert per_fn["length_reward"].tolist() == [1.0, 2.0, 1.0]
    assert total.tolist() == [0.5, 1.0, 0.5]  # the timed-out function is left out of the weighted sum
    assert rewards.take_timeouts() == {"hang": 1, "length_reward": 0}
    assert rewards.take_timeouts() == {"hang": 0, "length_reward": 0}  # counts since the previous take


def test_every_function_timing_out_totals_zero_without_the_all_none_error(release):
    rewards = RewardFunctions([_hanging_reward(release)], timeout=0.1)
    with pytest.warns(UserWarning, match=r"^Reward function 'hang' did not return within reward_timeout=0.1 s"):
        total, per_fn = rewards(prompts=["p", "p"], completions=["a", "b"])
    assert total.tolist() == [0.0, 0.0] and all(math.isnan(v) for v in per_fn["hang"].tolist())


def test_a_function_that_raises_stays_an_error_naming_it_and_the_sample():
    def picky(completions, **kwargs):
        return [1.0 / (c != "bad") for c in completions]

    rewards = RewardFunctions([picky], timeout=5.0)
    with pytest.raises(RewardError) as err:
        rewards(prompts=["p"] * 3, completions=["ok", "bad", "ok"])
    assert str(err.value) == ("Reward function 'picky' raised ZeroDivisionError: float division by zero on sample 1 "
                              "(completion 'bad'). Fix the function or the dataset columns it needs.")


def test_the_search_for_the_failing_sample_is_bounded_by_the_timeout(release):
    def raises_on_many_hangs_on_one(completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch")
        release.wait(60)
        return [0.0]

    rewards = RewardFunctions([raises_on_many_hangs_on_one], timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"^Reward function 'raises_on_many_hangs_on_one' raised ValueError: batch "
                                          r"on 2 samples\. "):
        rewards(prompts=["p", "p"], completions=["a", "b"])
    assert time.monotonic() - t0 < 5


def test_no_timeout_calls_the_function_in_the_callers_thread():
    seen = []

    def where(completions, **kwargs):
        seen.append(threading.current_thread())
        return [0.0] * len(completions)

    RewardFunctions([where])(prompts=["p"], completions=["c"])
    RewardFunctions([where], timeout=1.0)(prompts=["p"], completions=["c"])
    assert seen[0] is threading.current_thread()
    assert seen[1] is not threading.current_thread() and seen[1].daemon and seen[1].name == "lit_llm-reward-where"


@pytest.mark.parametrize("value", [0, -1.0, float("inf"), True, "60"])
def test_bad_reward_timeout_is_one_line_naming_the_option(value):
    with pytest.raises(ValueError) as err:
        build_rewards(["lit_llm.rewards:strict_arithmetic_reward"], None, None, value, with_environment=False)
    assert str(err.value) == (f"GRPOModule: reward_timeout must be a number of seconds > 0, or null for no limit, "
                              f"got {value!r}.")
    with pytest.raises(RewardError, match=r"^reward_timeout must be a number of seconds > 0, or null for no limit"):
        RewardFunctions([length_reward], timeout=value)


def test_build_rewards_gives_training_and_evaluation_functions_the_timeout():
    rewards, evals = build_rewards(["lit_llm.rewards:strict_arithmetic_reward"], None, None, 7.5,
                                   with_environment=False)
    assert (rewards.timeout, evals.timeout) == (7.5, 7.5)
    rewards, evals = build_rewards(["lit_llm.rewards:strict_arithmetic_reward"], None, None, None,
                                   with_environment=False)
    assert (rewards.timeout, evals.timeout) == (None, None)


def test_rollout_metrics_count_the_timeouts_of_the_step(tiny, tokenizer, release):
    rewards = RewardFunctions([_hanging_reward(release), length_reward], timeout=0.2)
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 3})
    engine = RolloutEngine(policy, tokenizer=tokenizer, reward_fn=rewards, num_generations=2, batching=False)
    with pytest.warns(UserWarning, match="did not return within reward_timeout"):
        rollout = engine.rollout({"prompt": ["What is 1 + 1?", "What is 2 + 2?"]})
    module = SimpleNamespace(rewards=rewards, device=torch.device("cpu"), trainer=SimpleNamespace(world_size=1),
                             dropped_rollouts=torch.zeros((), dtype=torch.long),
                             versions=SimpleNamespace(dynamic_sampling=False))
    log = rollout_metrics(module, rollout, staleness=0, wait_time=0.0, train_time=1.0, step_time=1.0)
    assert (float(log["train/rewards/hang/timeouts"]), float(log["train/rewards/length_reward/timeouts"])) == (1, 0)
    assert math.isnan(float(log["train/rewards/hang/mean"]))
    assert float(log["train/reward"]) == pytest.approx(rollout.rewards["length_reward"].mean().item())
    log = rollout_metrics(module, rollout, staleness=0, wait_time=0.0, train_time=1.0, step_time=1.0)
    assert float(log["train/rewards/hang/timeouts"]) == 0  # counted once, at the step after the call


def test_a_step_whose_every_reward_call_timed_out_logs_no_reward(tiny, tokenizer):
    """Every row unscored (issue 30 leftover 3): ``train/reward`` is NaN, not 0.000 ("all wrong"), and the timeouts
    metric counts the call."""
    def sleepy(completions, **kwargs):
        time.sleep(1.0)
        return [1.0] * len(completions)

    rewards = RewardFunctions([sleepy], timeout=0.1)
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 3})
    engine = RolloutEngine(policy, tokenizer=tokenizer, reward_fn=rewards, num_generations=2, batching=False)
    with pytest.warns(UserWarning, match="^Reward function 'sleepy' did not return within reward_timeout=0.1 s"):
        rollout = engine.rollout({"prompt": ["What is 1 + 1?", "What is 2 + 2?"]})
    assert rollout.reward.tolist() == [0.0] * 4  # what training uses (TRL's rule: advantages 0)
    module = SimpleNamespace(rewards=rewards, device=torch.device("cpu"), trainer=SimpleNamespace(world_size=1),
                             dropped_rollouts=torch.zeros((), dtype=torch.long),
                             versions=SimpleNamespace(dynamic_sampling=False))
    log = rollout_metrics(module, rollout, staleness=0, wait_time=0.0, train_time=1.0, step_time=1.0)
    assert [math.isnan(float(log[k])) for k in ("train/reward", "train/reward_std", "train/rewards/sleepy/mean",
                                                "train/rewards/sleepy/std")] == [True] * 4
    assert float(log["train/rewards/sleepy/timeouts"]) == 1


# ------------------------------------------------------------------------------------------------ environments
def _generate(tokenizer):
    ids = tokenizer("4<|im_end|>", add_special_tokens=False)["input_ids"]

    def generate(prompt, seed):
        return torch.tensor(ids), fake_log_probs(ids), False
    return generate


def test_a_step_past_env_timeout_ends_the_episode_with_its_reason(tokenizer, release):
    class SlowStep(ScriptedEnv):
        def step(self, messages):
            release.wait(60)
            return Step([], reward=1.0, done=True)

    env = SlowStep([])
    t0 = time.monotonic()
    with pytest.warns(UserWarning) as caught:
        traj = run_episode(env, {"prompt": "What is 2 + 2?"}, renderer=EpisodeRenderer(tokenizer),
                           generate=_generate(tokenizer), env_timeout=0.2)
    assert time.monotonic() - t0 < 5
    assert (traj.turns, traj.truncated, traj.reason, traj.done, traj.env_reward) == (1, True, "env_timeout", False,
                                                                                     0.0)
    assert [str(w.message) for w in caught] == [
        "environment SlowStep.step did not return within env_timeout=0.2 s after turn 0 of the episode on the row "
        "with prompt 'What is 2 + 2?': the episode ends (reason env_timeout, counted in "
        "train/episodes/truncated/env_timeout); the step keeps running on an abandoned thread."]
    assert not env.closed  # the abandoned step may still use it


def test_a_reset_past_env_timeout_is_an_error_naming_the_environment_and_the_row(tokenizer, release):
    class SlowReset(ScriptedEnv):
        def reset(self, row):
            release.wait(60)
            return super().reset(row)

    env = SlowReset([])
    t0 = time.monotonic()
    with pytest.raises(RolloutError) as err:
        run_episode(env, {"prompt": "What is 2 + 2?"}, renderer=EpisodeRenderer(tokenizer),
                    generate=_generate(tokenizer), env_timeout=0.2)
    assert time.monotonic() - t0 < 5
    assert str(err.value) == ("environment SlowReset.reset did not return within env_timeout=0.2 s on the row with "
                              "prompt 'What is 2 + 2?' (it keeps running on an abandoned thread). Fix the environment, "
                              "or raise --model.init_args.env_timeout (null: no limit).")
    assert not env.closed


def test_environment_errors_within_the_timeout_still_name_the_method(tokenizer):
    class Broken(ScriptedEnv):
        def reset(self, row):
            raise KeyError("no prompt")

    with pytest.raises(RolloutError, match=r"^environment Broken\.reset raised KeyError: 'no prompt'$"):
        run_episode(Broken([]), {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer), generate=_generate(tokenizer),
                    env_timeout=5.0)


def test_env_timeout_is_validated_and_needs_an_environment():
    assert EpisodeSettings(env_factory=dict).env_timeout == 300.0
    assert EpisodeSettings(env_factory=dict, env_timeout=None).env_timeout is None
    with pytest.raises(RolloutError) as err:
        EpisodeSettings(env_factory=dict, env_timeout=0)
    assert str(err.value) == "env_timeout must be a number of seconds > 0, or null for no limit, got 0."
    assert episode_settings(None, env_timeout=300.0, env_reward_weight=1.0) is None  # the defaults: nothing given
    with pytest.raises(ValueError, match=r"^GRPOModule: \['env_timeout'\] apply to multi-turn episodes only"):
        episode_settings(None, env_timeout=5.0, env_reward_weight=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert episode_settings(dict, env_timeout=5.0).env_timeout == 5.0


# ------------------------------------------------------------------------------------------------ the CLI
def sleepy_reward(completions, **kwargs):
    """Takes 30 s (imported by the CLI subprocess as ``test_user_code_timeouts:sleepy_reward``)."""
    time.sleep(30)
    return [1.0] * len(completions)


class SlowResetCalculator(CalculatorEnv):
    """The calculator environment whose ``reset`` takes 30 s (``test_user_code_timeouts:SlowResetCalculator``)."""

    def reset(self, row):
        time.sleep(30)
        return super().reset(row)


def _cli(tmp: Path, config: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lit_llm.lightning.cli", "fit", "--config", str(ROOT / "configs" / config),
           "--trainer.default_root_dir", str(tmp), "--trainer.enable_progress_bar", "false", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_run_with_a_hanging_reward_function_trains_and_counts_its_timeouts(tmp_path):
    t0 = time.monotonic()
    proc = _cli(tmp_path, "grpo_tiny.yaml", "--model.init_args.reward_funcs",
                '["test_user_code_timeouts:sleepy_reward", "test_user_code_timeouts:length_reward"]',
                "--model.init_args.reward_weights", "null", "--model.init_args.reward_timeout", "0.5",
                "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0", "--trainer.val_check_interval", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - t0 < 300  # never the 30 s of each of the 3 calls (2 steps + 1 evaluation) in a row
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
    assert [float(r["train/rewards/sleepy_reward/timeouts"]) for r in rows] == [1.0, 1.0]
    assert [float(r["train/rewards/length_reward/timeouts"]) for r in rows] == [0.0, 0.0]
    assert all(r["train/rewards/sleepy_reward/mean"] == "nan" for r in rows)
    assert ("UserWarning: Reward function 'sleepy_reward' did not return within reward_timeout=0.5 s on 16 "
            "completions (prompt 0: ") in proc.stderr


@pytest.mark.slow
def test_cli_run_with_an_environment_whose_reset_hangs_ends_with_one_line(tmp_path):
    t0 = time.monotonic()
    proc = _cli(tmp_path, "grpo_tools_tiny.yaml", "--model.init_args.environment",
                "test_user_code_timeouts:SlowResetCalculator", "--model.init_args.env_timeout", "0.5")
    assert time.monotonic() - t0 < 300
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stderr.strip().splitlines()[-2]
    assert re.fullmatch(r"lit-llm: error: environment SlowResetCalculator\.reset did not return within "
                        r"env_timeout=0\.5 s on the row with sample_id '[^']+' and prompt 'What is [^']{1,72}' "
                        r"\(it keeps running on an abandoned thread\)\. Fix the environment, or raise "
                        r"--model\.init_args\.env_timeout \(null: no limit\)\.", first), proc.stderr[-2000:]
