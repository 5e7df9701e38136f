"""Episodes through the real threaded batcher with the tiny model: 32 episodes of different lengths share forward
passes and each gets its own results (its own feedback, log-probs that are its own trajectory's); a tool that raises
or hangs ends or penalises only its episode and nothing hangs; the log-prob version's distribution reads the loss
mask (environment ids 0.0)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from episode_doubles import Step

from lit_llm.policy.generation import pad_rows
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rollouts import EpisodeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

RELEASE = threading.Event()  # set at the end of the module: frees the environment steps that hang on purpose


@pytest.fixture(scope="module", autouse=True)
def _release_hung_steps():
    yield
    RELEASE.set()


class CountEnv:
    """Feedback "<prompt> again <k>" until the row's number of turns, then done with reward = turns / 6.

    Rows with ``"mode"``: ``"raise"``: every step's tool raises -> a tool message with the error, counted in
    ``tool_errors``, the episode goes on (a ``ToolEnv`` with ``on_tool_error="continue"``); ``"slow"``: the tool
    exceeds its ``tool_timeout`` -> the episode ends with a penalty (``on_tool_error="end"``); ``"hang"``: ``step``
    itself never returns (the engine's ``env_timeout`` ends the episode)."""

    tool_timeout = 10.0

    def reset(self, row):
        self.row, self.k = dict(row), 0
        return [{"role": "user", "content": row["prompt"]}]

    def _tool(self):
        mode = self.row.get("mode", "")
        if mode == "raise":
            raise ZeroDivisionError("division by zero")
        if mode == "slow":
            time.sleep(self.tool_timeout * 4)
        return "ok"

    def step(self, messages):
        assert messages[0]["content"] == self.row["prompt"], "an episode was shown another episode's conversation"
        self.k += 1
        mode = self.row.get("mode", "")
        if mode == "hang":
            RELEASE.wait()
        if self.k >= self.row["turns"]:
            return Step([], reward=self.row["turns"] / 6, done=True, info={"reason": "answer"})
        box, t0 = {}, time.perf_counter()
        worker = threading.Thread(target=lambda: box.setdefault("out", self._safe_tool(box)), daemon=True)
        worker.start()
        worker.join(self.tool_timeout)
        info = {"tool_calls": 1, "tool_time": time.perf_counter() - t0}
        if worker.is_alive():
            return Step([], reward=-0.5, done=True, info={**info, "tool_errors": 1, "reason": "tool_timeout"})
        if "error" in box:
            return Step([{"role": "user", "content": f"{self.row['prompt']} error {box['error']}"}],
                        info={**info, "tool_errors": 1})
        return Step([{"role": "user", "content": f"{self.row['prompt']} again {self.k}"}], info=info)

    def _safe_tool(self, box):
        try:
            return self._tool()
        except Exception as e:  # noqa: BLE001
            box["error"] = repr(e)


def tiny_engine(tiny, tokenizer, **kw):
    # every even id stops a turn: turns of 1-16 sampled ids, almost never cut by max_new_tokens
    gen = {"max_new_tokens": 16, "temperature": 1.0, "eos_token_id": list(range(0, len(tokenizer), 2))}
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=gen)
    return EpisodeEngine(policy, tokenizer=tokenizer, env_factory=CountEnv, num_generations=2, seed=0, **kw)


def settled_state(policy, seconds=30.0, **at_least):
    """The batcher's state once its counters reach ``at_least`` (e.g. ``batches_run=6``; the worker counts a batch
    just after waking its callers, so a caller may read the state a moment before)."""
    deadline = time.monotonic() + seconds
    state = policy.get_batching_state()
    while any(state[k] < v for k, v in at_least.items()) and time.monotonic() < deadline:
        time.sleep(0.01)
        state = policy.get_batching_state()
    return state


def run_with_deadline(fn, seconds):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the rollout did not return within {seconds} s"
    return box["out"]


def test_32_episodes_share_batches_and_each_gets_its_own_results(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer)
    batch = {"prompt": [f"Episode {k}" for k in range(16)], "turns": [1 + k % 6 for k in range(16)]}
    rb = run_with_deadline(lambda: engine.rollout(batch, step=1), 120)
    assert rb.num_rows == 32
    turns = [e["turns"] for e in rb.episodes]
    assert turns == [1 + (i // 2) % 6 for i in range(32)], [e["reason"] for e in rb.episodes]
    assert all(e["reason"] == "answer" and not e["truncated"] for e in rb.episodes)
    assert torch.allclose(rb.rewards["env"], torch.tensor(turns, dtype=torch.float32) / 6)
    for i in range(32):  # the feedback in row i's trajectory is its own episode's, and only that
        k = i // 2
        text = rb.completion[i]
        assert [f"Episode {k} again {j}" in text for j in range(1, 6)] == [j < turns[i] for j in range(1, 6)]
        assert f"Episode {(k + 1) % 16} again" not in text
        assert rb.episodes[i]["env_tokens"] > 0 or turns[i] == 1
    # shared forward passes: far fewer batches than turns (every turn is one row)
    state = settled_state(engine.batched_policy(32, timeout=engine.batching_timeout), rows_run=sum(turns))
    assert engine.num_policy_calls == sum(turns) == state["rows_run"]
    assert state["batches_run"] <= sum(turns) // 4, state
    # each row's generation-time log-probs are the teacher-forced log-probs of its own trajectory
    rows = rb.full_rows()
    ids = pad_rows(rows, 0)
    attn = pad_rows([torch.ones(r.numel(), dtype=torch.bool) for r in rows], False)
    tf = model_token_log_probs(tiny, ids, attn)
    for i in range(32):
        c = int(rb.completion_lengths[i])
        m = rb.loss_mask[i, :c]
        assert torch.allclose(tf[i, -c:][m], rb.old_log_probs[i, :c][m], atol=1e-4, rtol=0)
        assert (rb.old_log_probs[i, :c][~m] == 0).all()
    # the log-prob version's masked distribution on the rollout layout: the loss mask is its mask
    logprob = engine.policy.get_new_version(generate=False)
    with torch.no_grad():
        dist = logprob.get_dist(rb.policy_inputs())
        lp = dist.log_prob(rb.completion_ids)
    assert torch.equal(dist.mask, rb.loss_mask & rb.completion_mask)
    assert torch.allclose(lp, rb.old_log_probs, atol=1e-4, rtol=0) and (lp[~rb.loss_mask] == 0).all()
    engine.batched_policy(32, timeout=engine.batching_timeout).cleanup_batching(flush=True)


def test_lock_step_rounds_one_batch_per_round_and_reproducible(tiny, tokenizer):
    # min_batch_size follows the episodes still running: each round of turns is ONE forward batch of every live
    # episode (32, 26, 20, 14, 8, 4 rows for turns 1-6), whatever the threads' timing, so two rollouts with the same
    # seeds are identical (the timeout, far away here, is never what starts a batch)
    engine = tiny_engine(tiny, tokenizer, batching_timeout=60.0)
    batch = {"prompt": [f"Episode {k}" for k in range(16)], "turns": [1 + k % 6 for k in range(16)]}
    a = run_with_deadline(lambda: engine.rollout(batch, step=3), 120)
    policy = engine.batched_policy(32, timeout=60.0)
    assert [e["turns"] for e in a.episodes] == [1 + (i // 2) % 6 for i in range(32)]
    state = settled_state(policy, batches_run=6)
    assert state["batches_run"] == 6 and state["rows_run"] == 32 + 26 + 20 + 14 + 8 + 4, state
    assert state["min_batch_size"] == 32  # restored between rollouts
    b = run_with_deadline(lambda: engine.rollout(batch, step=3), 120)
    assert settled_state(policy, batches_run=12)["batches_run"] == 12
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.old_log_probs, b.old_log_probs)
    policy.cleanup_batching(flush=True)


def test_sequential_episodes_are_bit_reproducible(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer, batching=False)
    batch = {"prompt": [f"Episode {k}" for k in range(3)], "turns": [3, 1, 2]}
    a, b = engine.rollout(batch, step=4), engine.rollout(batch, step=4)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.old_log_probs, b.old_log_probs)
    c = engine.rollout(batch, step=5)
    assert not torch.equal(a.completion_ids[:, :3], c.completion_ids[:, :3])


def test_raising_and_hanging_tools_end_only_their_episode(tiny, tokenizer):
    engine = tiny_engine(tiny, tokenizer, env_timeout=1.0, tool_timeout=0.2)
    modes = ["", "raise", "slow", "hang", "", "raise", "", ""]
    batch = {"prompt": [f"Episode {k}" for k in range(8)], "turns": [3] * 8, "mode": modes}
    t0 = time.perf_counter()
    rb = run_with_deadline(lambda: engine.rollout(batch, step=0), 60)
    assert time.perf_counter() - t0 < 30
    reasons = [e["reason"] for e in rb.episodes]
    expect = {"": "answer", "raise": "answer", "slow": "tool_timeout", "hang": "env_timeout"}
    assert reasons == [expect[m] for m in modes for _ in range(2)]
    for i, e in enumerate(rb.episodes):
        mode = modes[i // 2]
        assert e["truncated"] == (mode == "hang")
        assert e["tool_errors"] == {"": 0, "raise": 2, "slow": 1, "hang": 0}[mode]
        assert e["turns"] == {"": 3, "raise": 3, "slow": 1, "hang": 1}[mode]
        assert float(rb.rewards["env"][i]) == pytest.approx({"": 0.5, "raise": 0.5, "slow": -0.5, "hang": 0.0}[mode])
        if mode == "raise":
            assert "error ZeroDivisionError('division by zero')" in rb.completion[i]
    assert all(e["tool_time"] < 1.0 for e in rb.episodes)  # the slow tool was abandoned at its 0.2 s timeout
    engine.batched_policy(16, timeout=engine.batching_timeout).cleanup_batching(flush=True)
