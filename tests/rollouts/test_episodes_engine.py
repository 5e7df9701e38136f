"""EpisodeEngine with a scripted generate version: the RolloutBatch of episodes (ids, loss mask, log-probs 0.0 on
environment ids, rewards "env" + reward functions over whole episodes, group advantages, per-episode statistics),
per-turn seeds, settings and errors."""

from __future__ import annotations

import threading

import pytest
import torch
from episode_doubles import ScriptedEnv, ScriptedPolicy, Step, fake_log_probs

from lit_llm.rewards import RewardFunctions
from lit_llm.rollouts import EpisodeEngine, RolloutBatch, RolloutError
from lit_llm.rollouts.engine import row_seeds
from lit_llm.rollouts.envs import GuessNumberEnv
from lit_llm.rollouts.episodes import EPISODE_STAT_KEYS, turn_seed

CHATML_USER = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
BATCH = {"prompt": ["Guess A", "Guess B"], "answer": ["42", "7"], "sample_id": ["a", "b"]}
G, SEED, STEP = 2, 3, 5


class GuessEnv(ScriptedEnv):
    """Prompt A: two "higher" replies, then done; prompt B: one. Reward 1.0 when the last reply holds the answer."""

    required_columns = ("answer",)

    def __init__(self):
        super().__init__([])
        self.rows = []

    def reset(self, row):
        self.rows.append(dict(row))
        return super().reset(row)

    def step(self, messages):
        self.seen.append(messages)
        n = 2 if self.rows[0]["prompt"] == "Guess A" else 1
        if len(self.seen) <= n:
            return Step([{"role": "user", "content": "higher"}], info={"tool_calls": 1, "tool_time": 0.25})
        hit = self.rows[0]["answer"] in messages[-1]["content"]
        return Step([], reward=1.0 if hit else 0.0, done=True, info={"reason": "answer"})


def reply_text(k: int, g: int, t: int) -> str:
    last = (2 if k == 0 else 1) == t
    return f"p{k} g{g} t{t}" + (f" {BATCH['answer'][k]}" if last and g == 0 else "")


def scripted(tokenizer):
    """Replies keyed by the per-turn seeds: episode (k, g), turn t."""
    base = row_seeds(SEED, STEP, 0, 2, G).tolist()
    by_seed = {turn_seed(base[k * G + g], t): (k, g, t) for k in range(2) for g in range(G) for t in range(4)}
    assert len(by_seed) == 2 * G * 4

    def reply(ids, seed):
        k, g, t = by_seed[seed]
        return tokenizer(reply_text(k, g, t) + "<|im_end|>", add_special_tokens=False)["input_ids"], False
    return ScriptedPolicy(reply, pad_token_id=tokenizer.pad_token_id)


def turns_reward(prompts, completions, completion_ids, answer, **kwargs):
    """Checks the TRL signature over episodes: 0.1 per assistant turn."""
    for p, c, ids in zip(prompts, completions, completion_ids):
        assert p[-1]["role"] == "user" and c[0]["role"] == "assistant" and isinstance(ids[0], int)
    return [0.1 * sum(m["role"] == "assistant" for m in c) for c in completions]


def make(tokenizer, **kw):
    envs = []

    def factory():
        envs.append(GuessEnv())
        return envs[-1]
    kw.setdefault("reward_fn", RewardFunctions([turns_reward]))
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=factory, num_generations=G,
                           seed=SEED, **kw)
    return engine, envs


@pytest.mark.parametrize("batching", [False, True])
def test_rollout_batch_of_episodes(tokenizer, batching):
    engine, envs = make(tokenizer, batching=batching, env_reward_weight=2.0)
    rb = engine.rollout(BATCH, step=STEP, version=4)
    assert isinstance(rb, RolloutBatch) and rb.num_rows == 4
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    env_ids = enc(CHATML_USER.format("higher"))
    for i in range(4):
        k, g = divmod(i, G)
        n = 3 if k == 0 else 2
        replies = [enc(reply_text(k, g, t) + "<|im_end|>") for t in range(n)]
        ids, mask, lps = [], [], []
        for t, r in enumerate(replies):
            ids += r + (env_ids if t < n - 1 else [])
            mask += [True] * len(r) + ([False] * len(env_ids) if t < n - 1 else [])
            lps += fake_log_probs(r).tolist() + ([0.0] * len(env_ids) if t < n - 1 else [])
        c = int(rb.completion_lengths[i])
        assert rb.completion_ids[i, :c].tolist() == ids and rb.loss_mask[i, :c].tolist() == mask
        assert not rb.loss_mask[i, c:].any()
        assert torch.equal(rb.old_log_probs[i, :c], torch.tensor(lps)) and torch.equal(rb.rollout_log_probs[i, :c],
                                                                                       torch.tensor(lps))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": BATCH["prompt"][k]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        assert rb.full_rows()[i].tolist() == [*list(prompt), *ids]
        stats = rb.episodes[i]
        assert tuple(stats) == EPISODE_STAT_KEYS
        assert (stats["turns"], stats["tool_calls"], stats["truncated"], stats["reason"]) == (n, n - 1, False,
                                                                                            "answer")
        assert stats["tool_time"] == pytest.approx(0.25 * (n - 1)) and stats["env_reward"] == float(g == 0)
        assert stats["sampled_tokens"] == sum(mask) and stats["env_tokens"] == len(ids) - sum(mask)
        assert stats["text"] == rb.completion[i] == tokenizer.decode(ids, skip_special_tokens=False)
        assert stats["prompt"] == tokenizer.decode(prompt, skip_special_tokens=False)
        assert stats["prompt"].endswith(f"<|im_start|>user\n{BATCH['prompt'][k]}<|im_end|>\n<|im_start|>assistant\n")
        assert rb.sample_id[i] == BATCH["sample_id"][k]
    assert rb.prompt_index.tolist() == [0, 0, 1, 1] and rb.group.tolist() == [0, 0, 1, 1]
    assert not rb.truncated.any() and (rb.policy_version == 4).all()
    env_r = torch.tensor([1.0, 0.0, 1.0, 0.0])
    turns_r = torch.tensor([0.3, 0.3, 0.2, 0.2])
    assert torch.equal(rb.rewards["env"], env_r) and torch.allclose(rb.rewards["turns_reward"], turns_r)
    total = 2.0 * env_r + turns_r
    assert torch.allclose(rb.reward, total)
    grp = total.view(2, G)
    adv = (grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)
    assert torch.allclose(rb.advantage, adv.reshape(-1), atol=1e-6)
    # every environment got its row (prompt, sample id, columns) and was closed
    rows = sorted((e.rows[0]["prompt"], e.rows[0]["sample_id"], e.rows[0]["answer"]) for e in envs)
    assert rows == [("Guess A", "a", "42")] * 2 + [("Guess B", "b", "7")] * 2 and all(e.closed for e in envs)
    assert engine.num_policy_calls == 10
    seeds = sorted(s for _, s in engine.policy.calls)
    base = row_seeds(SEED, STEP, 0, 2, G).tolist()
    assert seeds == sorted(turn_seed(base[i], t) for i in range(4) for t in range(3 if i < 2 else 2))
    # cutting keeps the statistics with their rows
    mb = rb.select_rows([3, 0])
    assert mb.episodes == [rb.episodes[3], rb.episodes[0]] and torch.equal(mb.loss_mask[0, :4], rb.loss_mask[3, :4])
    assert sum(len(m.episodes) for m in rb.micro_batches(3)) == 4


def test_env_reward_only_and_max_turns_alias(tokenizer):
    engine, _ = make(tokenizer, reward_fn=None, max_tool_calling_iterations=1, batching=False)
    assert engine.max_turns == 2
    rb = engine.rollout(BATCH, step=STEP)
    assert list(rb.rewards.keys()) == ["env"]
    # prompt A needs 3 turns: cut by max_turns (truncated, the last reply dropped); prompt B ends at turn 2
    assert [e["reason"] for e in rb.episodes] == ["max_turns", "max_turns", "answer", "answer"]
    assert rb.truncated.tolist() == [True, True, False, False]
    assert torch.equal(rb.reward, torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_settings_and_errors_name_the_fix(tokenizer):
    with pytest.raises(RolloutError, match=r"max_turns=3 and max_tool_calling_iterations=1 disagree"):
        make(tokenizer, max_turns=3, max_tool_calling_iterations=1)
    with pytest.raises(RolloutError, match=r"env_factory must be a callable"):
        EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory="calculator", num_generations=2)
    for key, value in (("max_episode_tokens", 0), ("max_turns", 0), ("batching_timeout", 0.0),
                       ("env_timeout", -1.0)):
        with pytest.raises(RolloutError, match=key):
            make(tokenizer, **{key: value})
    with pytest.raises(RolloutError, match=r"num_generations must be an integer >= 2"):
        EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=GuessEnv, num_generations=1)
    engine, _ = make(tokenizer)
    with pytest.raises(RolloutError, match=r"GuessEnv needs the column\(s\) \['answer'\], but the prompt batch has "
                                           r"only \['prompt', 'sample_id'\]"):
        engine.rollout({"prompt": ["Guess A"]})

    def named_env(prompts, completions, **kw):
        return [0.0] * len(completions)
    named_env.__name__ = "env"
    engine, _ = make(tokenizer, reward_fn=RewardFunctions([named_env]), batching=False)
    with pytest.raises(RolloutError, match=r"named 'env'"):
        engine.rollout(BATCH, step=STEP)

    def broken():
        raise OSError("no such env")
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=broken, num_generations=2)
    with pytest.raises(RolloutError, match=r"raised OSError: no such env"):
        engine.rollout(BATCH)


def test_tool_timeout_is_set_on_environments_that_have_one(tokenizer):
    class WithTimeout(GuessEnv):
        tool_timeout = 10.0
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=WithTimeout, num_generations=2,
                           tool_timeout=0.5)
    with pytest.warns(UserWarning, match=r"tool_timeout=0.5 .* overrides .* own tool_timeout=10.0"):
        assert engine.make_env().tool_timeout == 0.5 and WithTimeout.tool_timeout == 10.0
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=GuessEnv, num_generations=2,
                           tool_timeout=0.5)
    assert not hasattr(engine.make_env(), "tool_timeout")  # an environment without the setting gets none


def test_engine_tool_timeout_overrides_the_environments_with_one_warning(tokenizer):
    """A set engine value wins over the environment's own and warns once naming both; None keeps the env's."""
    class WithTimeout(GuessEnv):
        def __init__(self):
            super().__init__()
            self.tool_timeout = 2.0  # as from the environment's init_args
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=WithTimeout, num_generations=2,
                           tool_timeout=5.0)
    with pytest.warns(UserWarning) as record:
        assert [engine.make_env().tool_timeout for _ in range(3)] == [5.0, 5.0, 5.0]
    assert [str(w.message) for w in record] == [
        "tool_timeout=5.0 (the GRPO module's / engine's) overrides the environment WithTimeout's own "
        "tool_timeout=2.0; set the module's tool_timeout to null to keep the environment's value."]
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=WithTimeout, num_generations=2)
    assert engine.tool_timeout is None and engine.make_env().tool_timeout == 2.0


def test_a_failing_episode_stops_the_others_and_names_itself(tokenizer):
    """An environment that raises (a bug) fails the rollout loudly with the episode named; the other episodes stop
    at their next turn and nothing hangs."""
    release = threading.Event()

    class FailsOnB(GuessEnv):
        def step(self, messages):
            if self.rows[0]["prompt"] == "Guess B":
                raise ValueError("broken env")
            release.wait(5)  # episodes of prompt A are mid-episode when B fails
            return super().step(messages)

    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=FailsOnB, num_generations=G,
                           seed=SEED)
    box = {}

    def run():
        try:
            engine.rollout(BATCH, step=STEP)
        except Exception as e:  # noqa: BLE001
            box["err"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(1.0)
    release.set()
    t.join(30)
    assert not t.is_alive(), "the rollout hung"
    err = box["err"]
    assert isinstance(err, RolloutError) and "FailsOnB.step raised ValueError: broken env" in str(err)
    # prompt B's episodes are 2 and 3 of the 4 (G = 2 per prompt); either may fail first
    assert err.__notes__[-1] in [f"in episode {2 + g} of 4 (prompt 1, generation {g}, sample_id 'b')" for g in (0, 1)]
    assert engine.num_policy_calls < 10  # prompt A's episodes did not run to their end


def test_check_columns_closes_the_environment_it_builds(tokenizer):
    made = []

    def factory():
        made.append(GuessEnv())
        return made[-1]
    engine = EpisodeEngine(scripted(tokenizer), tokenizer=tokenizer, env_factory=factory, num_generations=2)
    engine.check_columns(["answer"])
    with pytest.raises(RolloutError, match=r"needs the column\(s\) \['answer'\]"):
        engine.check_columns([])
    assert [env.closed for env in made] == [True, True]
    given = GuessEnv()
    engine.check_columns(["answer"], env=given)
    assert given.closed is False  # a caller's environment stays open


def test_guess_number_feedback_counts_the_engines_turns(tokenizer):
    """max_turns=3 below GuessNumberEnv's 7 guesses: the engine hands the budget to each fresh environment, so the
    feedback counts down from the 3 turns the episode really has and the game itself ends after the third guess."""
    def reply(ids, seed):
        return tokenizer("10<|im_end|>", add_special_tokens=False)["input_ids"], False
    policy = ScriptedPolicy(reply, pad_token_id=tokenizer.pad_token_id)
    engine = EpisodeEngine(policy, tokenizer=tokenizer, env_factory=GuessNumberEnv, num_generations=2, max_turns=3,
                           batching=False)
    assert engine.make_env().max_turns == 3
    rows = {"prompt": ["Guess!"], "secret": [50], "sample_id": ["g"]}
    rb = engine.rollout(rows, step=0)
    for i, e in enumerate(rb.episodes):
        assert (e["turns"], e["reason"], e["truncated"], e["env_reward"]) == (3, "max_guesses", False, 0.0)
        feedback = [part.split("<|im_end|>")[0] for part in rb.completion[i].split("<|im_start|>user\n")[1:]]
        assert feedback == ["Higher. 2 guesses left.", "Higher. 1 guess left."]
    # an environment's own smaller budget is kept; one without the attribute gets none
    class TwoTurns(GuessNumberEnv):
        max_turns = 2
    assert EpisodeEngine(policy, tokenizer=tokenizer, env_factory=TwoTurns, num_generations=2,
                         max_turns=3).make_env().max_turns == 2
    assert not hasattr(EpisodeEngine(policy, tokenizer=tokenizer, env_factory=GuessEnv, num_generations=2,
                                     max_turns=3).make_env(), "max_turns")


def test_check_environment_names_the_method_to_write(tokenizer):
    """An Environment without step, or a ToolEnv without score, fails before any turn (a tiny model's turns may never
    end, so the environment would never be stepped); the environment built for the check is closed."""
    from lit_llm.rollouts.envs import Environment, ToolEnv

    closed = []

    class NoStep(Environment):
        def close(self):
            closed.append(type(self).__name__)

    class NoScore(ToolEnv):
        def close(self):
            closed.append(type(self).__name__)

    expected = {
        NoStep: "environment NoStep does not implement step(messages) -> EnvStep, the environment's reply to each "
                "model turn; it inherits Environment.step, which raises NotImplementedError. Write "
                "NoStep.step(messages).",
        NoScore: "environment NoScore does not implement score(answer, row) -> float, the reward of the final answer "
                 "(a turn without tool calls); it inherits ToolEnv.score, which raises NotImplementedError. Write "
                 "NoScore.score(answer, row).",
    }
    for cls, message in expected.items():
        policy = scripted(tokenizer)
        engine = EpisodeEngine(policy, tokenizer=tokenizer, env_factory=cls, num_generations=G, seed=SEED)
        with pytest.raises(RolloutError) as e:
            engine.check_environment()
        assert str(e.value) == message
        with pytest.raises(RolloutError) as e:
            engine.rollout(BATCH, step=STEP)
        assert str(e.value) == message
        assert engine.num_policy_calls == 0
    assert closed == ["NoStep", "NoStep", "NoScore", "NoScore"]
    engine, _ = make(tokenizer)
    engine.check_environment()  # a duck-typed environment (not a subclass) with its own step: fine

    class StepOnly(ToolEnv):  # a ToolEnv with its own step needs no score
        def step(self, messages):
            return Step([], done=True)
    engine.check_environment(StepOnly())
