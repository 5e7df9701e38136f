"""Rollout engine: RolloutBatch layout, ids kept exactly, old log-probs = teacher-forced log-probs, advantages,
per-row seeding (bit-reproducible with the batcher on), errors, asynchronous producer (weights copy, sync, staleness,
failures)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

import lit_llm.policy.generate_version as generate_version
from lit_llm.data.prompts import tokenize_prompts
from lit_llm.policy.generation import pad_rows
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardError, RewardFunctions
from lit_llm.rollouts import AsyncRollouts, RolloutBatch, RolloutEngine, RolloutError

pytestmark = pytest.mark.usefixtures("one_thread")


def even_reward(prompts, completions, completion_ids, **kwargs):
    """Fraction of even token ids in the completion."""
    return [sum(i % 2 == 0 for i in c) / len(c) for c in completion_ids]


def answer_len_reward(prompts, completions, completion_ids, answer, **kwargs):
    """Uses a dataset column: 1.0 when the completion has more characters than the answer."""
    return [float(len(c if isinstance(c, str) else c[-1]["content"]) > len(a)) for c, a in zip(completions, answer)]


PROMPTS = {
    "prompt": [[{"role": "user", "content": "What is 12 + 30?"}], "Say something:",
               [{"role": "user", "content": "Hi"}]],
    "answer": ["42", "x", "yy"],
    "sample_id": ["a", "b", "c"],
}


def make_engine(model, tokenizer, *, g=4, max_new_tokens=6, temperature=1.0, seed=0, eos=None, **kw):
    gen = {"max_new_tokens": max_new_tokens, "temperature": temperature}
    if eos is not None:
        gen["eos_token_id"] = eos
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=gen)
    kw.setdefault("batching", False)
    rewards = kw.pop("rewards", RewardFunctions([even_reward, answer_len_reward], [1.0, 0.5]))
    return RolloutEngine(policy, tokenizer=tokenizer, reward_fn=rewards, num_generations=g, seed=seed, **kw)


def test_rollout_layout_ids_masks_rewards_advantages(tiny, tokenizer):
    # eos = every id divisible by 5: about 20% of the steps stop a row, so some rows stop and some are truncated.
    eos = list(range(0, len(tokenizer), 5))
    engine = make_engine(tiny, tokenizer, eos=eos)
    rb = engine.rollout(PROMPTS, step=3, version=7)
    n, g = 12, 4
    assert isinstance(rb, RolloutBatch) and rb.num_rows == n
    prompt_ids = tokenize_prompts(PROMPTS["prompt"], tokenizer)
    # distinct prompts, left-padded, each exactly as rendered
    assert rb.prompt_ids.shape[0] == 3 and rb.prompt_mask.dtype == torch.bool
    for k, p in enumerate(prompt_ids):
        assert torch.equal(rb.prompt_ids[k][rb.prompt_mask[k]], p) and rb.prompt_mask[k, -p.numel():].all()
    assert rb.prompt_index.tolist() == [k for k in range(3) for _ in range(g)]
    cmask, comp = rb.completion_mask, rb.completion_ids
    assert comp.dtype == torch.long and cmask.dtype == torch.bool and torch.equal(rb.loss_mask, cmask)
    full = rb.full_rows()
    for i in range(n):
        clen = int(cmask[i].sum())
        assert cmask[i, :clen].all() and not cmask[i, clen:].any()  # right padding
        response = comp[i, :clen]
        assert torch.equal(full[i], torch.cat([prompt_ids[i // g], response]))  # prompt ⊕ response, as sampled
        stopped = int(response[-1]) % 5 == 0
        assert bool(rb.truncated[i]) == (not stopped)
        if not stopped:
            assert clen == 6
        assert not any(int(t) % 5 == 0 for t in response[:-1])  # the first stop id ends the response
        assert rb.completion[i] == tokenizer.decode(response.tolist(), skip_special_tokens=True)
        lp = rb.old_log_probs[i]
        assert (lp[~cmask[i]] == 0).all() and (lp[cmask[i]] < 0).all()
        assert rb.sample_id[i] == PROMPTS["sample_id"][i // g]
    assert 0 < int(rb.truncated.sum()) < n, "the test needs both stopped and truncated rows"
    assert rb.group.tolist() == [k for k in range(3) for _ in range(g)]
    assert (rb.policy_version == 7).all()
    # rewards: per function, weighted total, advantages by hand (unbiased std, eps 1e-4)
    ev = torch.tensor([sum(int(t) % 2 == 0 for t in comp[i][cmask[i]]) / int(cmask[i].sum()) for i in range(n)])
    assert torch.allclose(rb.rewards["even_reward"], ev)
    texts = list(rb.completion)
    al = torch.tensor([float(len(texts[i]) > len(PROMPTS["answer"][i // g])) for i in range(n)])
    assert torch.equal(rb.rewards["answer_len_reward"], al)
    total = ev + 0.5 * al
    assert torch.allclose(rb.reward, total)
    groups = total.view(3, g)
    std = groups.std(dim=1, keepdim=True)
    adv = torch.where(std.isclose(torch.zeros(())), 0.0, (groups - groups.mean(1, keepdim=True)) / (std + 1e-4))
    assert torch.allclose(rb.advantage, adv.reshape(-1), atol=1e-5)
    frac_zero = float(std.isclose(torch.zeros(())).float().mean())
    assert rb.frac_reward_zero_std == pytest.approx(frac_zero)
    assert rb.generation_time > 0


def test_identical_prompts_share_one_prompt_row(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer, g=2, max_new_tokens=2, rewards=RewardFunctions([even_reward]))
    rb = engine.rollout({"prompt": ["Same:", "Other:", "Same:"]})
    assert rb.prompt_ids.shape[0] == 2 and rb.prompt_index.tolist() == [0, 0, 1, 1, 0, 0]
    assert rb.group.tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_log_probs_equal_teacher_forced(tiny, tokenizer, temperature):
    engine = make_engine(tiny, tokenizer, temperature=temperature)
    rb = engine.rollout(PROMPTS, step=0)
    rows = rb.full_rows()
    ids, attn = pad_rows(rows, 0), pad_rows([torch.ones(r.numel(), dtype=torch.bool) for r in rows], False)
    tf = model_token_log_probs(tiny, ids, attn, temperature=temperature)
    for i in range(len(rows)):
        c = int(rb.completion_lengths[i])
        assert torch.allclose(tf[i, -c:], rb.old_log_probs[i, :c], atol=1e-4, rtol=0)


def _same(a: RolloutBatch, b: RolloutBatch) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in
               ("prompt_ids", "completion_ids", "completion_mask", "old_log_probs", "reward", "advantage"))


def test_sync_rollouts_bit_reproducible_and_rng_untouched(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    torch.manual_seed(123)
    a = engine.rollout(PROMPTS, step=5)
    after_a = torch.rand(3)
    torch.manual_seed(321)  # another global stream: per-row generators never read it
    b = engine.rollout(PROMPTS, step=5)
    torch.manual_seed(123)
    expected = torch.rand(3)
    assert _same(a, b)
    assert torch.equal(after_a, expected)  # caller's RNG stream untouched
    c = engine.rollout(PROMPTS, step=6)
    assert not torch.equal(c.completion_ids, a.completion_ids)


def test_batcher_workers_are_bit_identical_to_one_call(tiny, tokenizer):
    """One worker thread per prompt group, served by the batcher: one shared forward batch per rollout, and the
    rollout equals the direct (unbatched) call bit for bit, run after run."""
    direct = make_engine(tiny, tokenizer, batching=False).rollout(PROMPTS, step=2)
    engine = make_engine(tiny, tokenizer, batching=True)
    runs = [engine.rollout(PROMPTS, step=2) for _ in range(2)]
    version = engine.batched_policy(3, group_size=4)  # the batcher's rows: each prompt once, with its group size
    state = version.get_batching_state()
    assert state["batching_enabled"] and state["batches_run"] == 2 and state["rows_run"] == 6
    assert engine.num_policy_calls == 6  # 3 workers (one per group) x 2 rollouts
    assert _same(runs[0], runs[1]) and _same(runs[0], direct)
    version.cleanup_batching(flush=True)


def test_generate_version_gets_each_prompt_once_with_the_group_size(tiny, tokenizer, monkeypatch):
    """The engine hands the generate version the distinct prompts of its groups and the group size (TorchRL's
    ``num_samples``); generation prefills each prompt once without re-discovering the groups from the ids
    (``unique_rows`` is never called), and the rows come back prompt-major, ``G`` per prompt."""
    import lit_llm.policy.generation as generation

    calls = []
    real = generation.generate_tokens

    def spy(model, prompts, config, **kw):
        calls.append((len(prompts), kw.get("num_samples")))
        return real(model, prompts, config, **kw)

    def no_dedup(*args, **kwargs):
        raise AssertionError("grouped prompts were de-duplicated again")

    monkeypatch.setattr("lit_llm.policy.generate_version.generate_tokens", spy)
    monkeypatch.setattr(generation, "unique_rows", no_dedup)
    for batching in (False, True):
        calls.clear()
        out = make_engine(tiny, tokenizer, batching=batching).rollout(PROMPTS, step=2)
        assert calls == [(3, 4)]  # 3 prompts, 4 samples each, one forward batch
        assert out.num_rows == 12 and out.prompt_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_rollout_errors(tiny, tokenizer):
    with pytest.raises(RolloutError, match="num_generations must be an integer >= 2"):
        make_engine(tiny, tokenizer, g=1)
    logprob_version = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    with pytest.raises(RolloutError, match="generate version"):
        RolloutEngine(logprob_version, tokenizer=tokenizer, reward_fn=RewardFunctions([even_reward]),
                      num_generations=2)
    engine = make_engine(tiny, tokenizer, g=2, max_new_tokens=2)
    with pytest.raises(RolloutError, match="no 'prompt' key"):
        engine.rollout({"answer": ["1"]})
    with pytest.raises(RolloutError, match="column 'answer' must be a list with one entry per prompt"):
        engine.rollout({"prompt": ["a", "b"], "answer": ["1"]})
    with pytest.raises(RolloutError, match="prompt 0: expected a string or a non-empty list"):
        engine.rollout({"prompt": [3]})

    def nan_reward(prompts, completions, completion_ids, **kw):
        return [float("nan")] * len(completions)

    bad = make_engine(tiny, tokenizer, g=2, max_new_tokens=2, rewards=RewardFunctions([nan_reward]))
    with pytest.raises(RewardError, match="'nan_reward' returned nan for sample 0"):
        bad.rollout({"prompt": ["a"]})


def test_fewer_workers_than_groups(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer, batching=True, num_workers=2)
    rb = engine.rollout(PROMPTS, step=1)
    assert engine.num_policy_calls == 2 and _same(rb, make_engine(tiny, tokenizer).rollout(PROMPTS, step=1))
    engine.batched_policy(3, group_size=4).cleanup_batching(flush=True)


def _batches(k):
    return [{"prompt": [f"Count {i}:", f"Say {i}:"], "sample_id": [f"p{i}a", f"p{i}b"]} for i in range(k)]


def test_async_producer_copy_sync_and_staleness(tiny, tokenizer):
    trained = copy.deepcopy(tiny)
    policy = TransformersWrapper(trained, tokenizer=tokenizer, input_mode="tokens",
                                 generate_kwargs={"max_new_tokens": 3, "temperature": 1.0})
    producer = AsyncRollouts.from_policy(policy, _batches(6), max_staleness=1, tokenizer=tokenizer,
                                         reward_fn=RewardFunctions([even_reward]), num_generations=2)
    assert producer.engine.model is not trained  # a separate copy of the weights
    it = iter(producer)
    first = next(it)
    assert first.num_rows == 4 and int(first.policy_version[0]) == 0
    with torch.no_grad():  # "train": change the weights, then sync them as version 1
        for p in trained.parameters():
            p.add_(0.01)
    producer.sync_weights(trained, 1)
    versions = []
    for td in it:
        versions.append(int(td.policy_version[0]))
        producer.set_trainer_version(1)
    assert producer.num_produced == 6
    assert versions and versions[-1] == 1  # later batches come from the synced weights
    copy_params = dict(producer.engine.model.named_parameters())
    assert all(torch.equal(copy_params[n], p) for n, p in trained.named_parameters())
    assert len(versions) + 1 + producer.num_dropped == 6

    # staleness: the trainer is 5 versions ahead of every rollout -> all dropped and counted
    stale = AsyncRollouts.from_policy(policy, _batches(3), max_staleness=2, tokenizer=tokenizer,
                                      reward_fn=RewardFunctions([even_reward]), num_generations=2)
    stale.set_trainer_version(5)
    assert list(stale) == [] and stale.num_dropped == 3


def test_async_producer_error_and_close(tiny, tokenizer):
    def boom(prompts, completions, completion_ids, **kw):
        raise RuntimeError("kaboom")

    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens",
                                 generate_kwargs={"max_new_tokens": 2, "temperature": 1.0})
    producer = AsyncRollouts.from_policy(policy, _batches(2), tokenizer=tokenizer,
                                         reward_fn=RewardFunctions([boom]), num_generations=2)
    with pytest.raises(RewardError, match="'boom' raised RuntimeError: kaboom"):
        next(iter(producer))
    ok = AsyncRollouts.from_policy(policy, _batches(50), tokenizer=tokenizer,
                                   reward_fn=RewardFunctions([even_reward]), num_generations=2, queue_size=1)
    it = iter(ok)
    next(it)
    t0 = time.perf_counter()
    ok.close()
    assert ok._thread is None and time.perf_counter() - t0 < 10
    assert ok.num_produced < 50
    with pytest.raises(RolloutError, match="max_staleness must be >= 0"):
        AsyncRollouts(ok.engine, [], max_staleness=-1)


def test_episode_turns_sample_once_each(tiny, tokenizer, monkeypatch):
    """Episodes share the engine's batcher but queue one row per turn: every generation call of an episode rollout
    samples one response per row (``num_samples`` is the single-turn rollouts' grouping only)."""
    from lit_llm.rollouts import EpisodeEngine
    from lit_llm.rollouts.envs import GuessNumberEnv

    calls = []
    real = generate_version.generate_tokens

    def spy(model, prompts, config, **kw):
        calls.append(kw.get("num_samples"))
        return real(model, prompts, config, **kw)

    monkeypatch.setattr(generate_version, "generate_tokens", spy)
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 3})
    engine = EpisodeEngine(policy, tokenizer=tokenizer, env_factory=GuessNumberEnv, num_generations=2, max_turns=2)
    rb = engine.rollout({"prompt": ["Guess!"], "secret": [50], "sample_id": ["g"]}, step=0)
    assert rb.num_rows == 2 and calls and set(calls) == {1}
