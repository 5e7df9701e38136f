"""Every thread that runs the model takes its caller's CUDA device (issue 28), as it takes grad mode and autocast.

No GPU here: ``torch.cuda``'s availability, ``current_device`` and ``set_device`` are replaced by a fake that keeps
one current device per thread (as CUDA does; a new thread starts on device 0) and records each ``set_device``. The
caller's thread is put on device 3; a forward pre-hook on the (CPU) model records the fake current device of the
thread each forward pass runs on. Without the fix every forward on another thread would see device 0.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

from lit_llm.policy.thread_context import caller_context, current_device_index, in_context
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardFunctions
from lit_llm.rollouts import AsyncRollouts, EpisodeEngine, RolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = 3


class FakeCuda:
    """Per-thread current device (0 in a new thread), ``set_device`` calls as ``(thread name, index)``."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.set_calls: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def current_device(self) -> int:
        return getattr(self.local, "index", 0)

    def set_device(self, index: int) -> None:
        with self.lock:
            self.set_calls.append((threading.current_thread().name, index))
        self.local.index = index


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", fake.current_device)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    fake.set_device(DEVICE)  # the caller (a rank's main thread, where Lightning set it)
    fake.set_calls.clear()
    return fake


@pytest.fixture
def forwards(tiny):
    """``(thread name, fake current device)`` of every forward pass of the tiny model."""
    seen: list[tuple[str, int]] = []
    handle = tiny.register_forward_pre_hook(
        lambda module, args: seen.append((threading.current_thread().name, torch.cuda.current_device())))
    yield seen
    handle.remove()


def even_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(c) % 2 == 0) for c in completion_ids]


def generate_version(model, tokenizer, **kw):
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens",
                               generate_kwargs={"max_new_tokens": 2, "temperature": 1.0}, **kw)


def test_caller_context_records_the_current_device_only_when_cuda_is_initialised(cuda, monkeypatch):
    assert caller_context("cpu") == (torch.is_grad_enabled(), None, DEVICE)
    assert caller_context("cpu").device_index == DEVICE == current_device_index()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # nothing chose a device yet: not read
    assert caller_context("cpu").device_index is None
    done = []
    thread = threading.Thread(target=lambda: done.append(in_context(caller_context("cpu"), "cpu").__enter__()))
    thread.start()
    thread.join()
    assert cuda.set_calls == []  # no device recorded: none set


def test_in_context_sets_the_device_only_when_it_differs(cuda):
    context = caller_context("cpu")
    with in_context(context, "cpu"):  # the caller's own thread: already on it
        pass
    assert cuda.set_calls == []
    inside: list[int] = []

    def work() -> None:
        with in_context(context, "cpu"):
            inside.append(torch.cuda.current_device())

    thread = threading.Thread(target=work, name="worker")
    thread.start()
    thread.join()
    assert cuda.set_calls == [("worker", DEVICE)] and inside == [DEVICE]
    with in_context((True, None), "cpu"):  # the two-field form of before: no device, none set
        pass
    assert len(cuda.set_calls) == 1


def test_batcher_worker_runs_on_the_callers_device(cuda, forwards, tiny, tokenizer):
    policy = generate_version(tiny, tokenizer, batching=True, min_batch_size=1)
    try:
        policy(_prompt_td([[5, 6, 7]]))
    finally:
        policy.cleanup_batching(flush=True)
    assert forwards and {name for name, _ in forwards} == {"lit_llm-batching-worker"}
    assert {index for _, index in forwards} == {DEVICE}
    assert ("lit_llm-batching-worker", DEVICE) in cuda.set_calls


def _prompt_td(rows: list[list[int]]):
    from tensordict import TensorDict, lazy_stack

    return lazy_stack([TensorDict({("tokens", "prompt"): torch.tensor(r)}, batch_size=[]) for r in rows])


def test_rollout_workers_and_batcher_run_on_the_callers_device(cuda, forwards, tiny, tokenizer):
    engine = RolloutEngine(generate_version(tiny, tokenizer), tokenizer=tokenizer,
                           reward_fn=RewardFunctions([even_reward]), num_generations=2, seed=0, batching=True)
    try:
        engine.rollout({"prompt": ["Count:", "Say:"]}, step=0)
    finally:
        engine.batched_policy(2, group_size=2).cleanup_batching(flush=True)
    assert forwards and {index for _, index in forwards} == {DEVICE}
    workers = {name for name, _ in cuda.set_calls}
    assert {"lit_llm-rollout-worker_0", "lit_llm-rollout-worker_1", "lit_llm-batching-worker"} <= workers
    assert {index for _, index in cuda.set_calls} == {DEVICE}


class TwoTurnEnv:
    """The first turn gets "again", the second ends the episode with reward 1."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        from types import SimpleNamespace

        self.turns += 1
        return SimpleNamespace(messages=[{"role": "user", "content": "again"}], reward=float(self.turns == 2),
                               done=self.turns == 2, info={})


def test_episode_threads_run_on_the_callers_device(cuda, forwards, tiny, tokenizer):
    engine = EpisodeEngine(generate_version(tiny, tokenizer), tokenizer=tokenizer, env_factory=TwoTurnEnv,
                           num_generations=2, seed=0, batching=True, max_turns=2)
    try:
        engine.rollout({"prompt": ["Hi", "Yo"]}, step=0)
    finally:
        engine.batched_policy(4, timeout=engine.batching_timeout).cleanup_batching(flush=True)
    assert forwards and {index for _, index in forwards} == {DEVICE}
    names = {re.sub(r"_\d+$", "", name) for name, _ in cuda.set_calls}  # pool threads end in _<k>
    assert {"lit_llm-episode", "lit_llm-batching-worker"} <= names
    assert {index for _, index in cuda.set_calls} == {DEVICE}


def test_async_producer_runs_on_the_callers_device(cuda, forwards, tiny, tokenizer):
    producer = AsyncRollouts.from_policy(generate_version(tiny, tokenizer), [{"prompt": ["Count:"]}],
                                         tokenizer=tokenizer, reward_fn=RewardFunctions([even_reward]),
                                         num_generations=2, batching=False)
    producer.engine.model.register_forward_pre_hook(  # the producer's own copy of the weights
        lambda module, args: forwards.append((threading.current_thread().name, torch.cuda.current_device())))
    batches = list(producer)
    producer.close()
    assert len(batches) == 1 and forwards
    assert {name for name, _ in forwards} == {"lit_llm-async-rollouts"}
    assert {index for _, index in forwards} == {DEVICE}
    assert cuda.set_calls == [("lit_llm-async-rollouts", DEVICE)]
