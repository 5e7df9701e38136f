"""Rollout engine: layout, ids kept exactly, old log-probs = teacher-forced log-probs, advantages, seeding, errors,
asynchronous producer (weights copy, sync, staleness, failures)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.rollout import AsyncRollouts, RolloutEngine, RolloutError, tokenize_prompts
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardError, RewardFunctions

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
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=gen,
                                 batching=kw.pop("batching", None))
    rewards = kw.pop("rewards", RewardFunctions([even_reward, answer_len_reward], [1.0, 0.5]))
    return RolloutEngine(policy, tokenizer=tokenizer, reward_fn=rewards, num_generations=g, seed=seed, **kw)


def test_rollout_layout_ids_masks_rewards_advantages(tiny, tokenizer):
    # eos = every id divisible by 5: about 20% of the steps stop a row, so some rows stop and some are truncated.
    eos = list(range(0, len(tokenizer), 5))
    engine = make_engine(tiny, tokenizer, eos=eos)
    td = engine.rollout(PROMPTS, step=3, version=7)
    n, g = 12, 4
    assert td.batch_size == torch.Size([n])
    prompt_ids = tokenize_prompts(PROMPTS["prompt"], tokenizer)
    full, attn = td["tokens", "full"], td["masks", "all_attention_mask"]
    cmask = td["masks", "completion_mask"]
    assert full.dtype == torch.long and attn.dtype == torch.bool and cmask.dtype == torch.bool
    for i in range(n):
        row = full[i][attn[i]]
        p = prompt_ids[i // g]
        plen, clen = int(td["prompt_length"][i]), int(td["completion_length"][i])
        assert plen == p.numel() and row.numel() == plen + clen
        assert torch.equal(row[:plen], p)  # tokens.full = prompt ⊕ response, prompt exactly as rendered
        # left padding: the completion mask is the last clen positions, exactly
        assert cmask[i].sum() == clen and cmask[i, -clen:].all() and not (cmask[i] & ~attn[i]).any()
        response = row[plen:]
        stopped = int(response[-1]) % 5 == 0
        assert bool(td["truncated"][i]) == (not stopped)
        if not stopped:
            assert clen == 6
        assert not any(int(t) % 5 == 0 for t in response[:-1])  # the first stop id ends the response
        assert td["completion"][i] == tokenizer.decode(response.tolist(), skip_special_tokens=True)
        lp = td["log_probs", "full"][i]
        assert (lp[~cmask[i]] == 0).all() and (lp[cmask[i]] < 0).all()
        assert td["sample_id"][i] == PROMPTS["sample_id"][i // g]
    assert 0 < int(td["truncated"].sum()) < n, "the test needs both stopped and truncated rows"
    assert td["group"].tolist() == [k for k in range(3) for _ in range(g)]
    assert (td["policy_version"] == 7).all()
    # rewards: per function, weighted total, advantages by hand (unbiased std, eps 1e-4)
    ev = torch.tensor([sum(int(t) % 2 == 0 for t in full[i][cmask[i]]) / int(cmask[i].sum()) for i in range(n)])
    assert torch.allclose(td["rewards", "even_reward"], ev)
    texts = list(td["completion"])
    al = torch.tensor([float(len(texts[i]) > len(PROMPTS["answer"][i // g])) for i in range(n)])
    assert torch.equal(td["rewards", "answer_len_reward"], al)
    total = ev + 0.5 * al
    assert torch.allclose(td["reward"], total)
    groups = total.view(3, g)
    std = groups.std(dim=1, keepdim=True)
    adv = torch.where(std.isclose(torch.zeros(())), 0.0, (groups - groups.mean(1, keepdim=True)) / (std + 1e-4))
    assert torch.allclose(td["advantage"], adv.reshape(-1), atol=1e-5)
    frac_zero = float(std.isclose(torch.zeros(())).float().mean())
    assert td.get_non_tensor("frac_reward_zero_std") == pytest.approx(frac_zero)
    assert td.get_non_tensor("generation_time") > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_old_log_probs_equal_teacher_forced(tiny, tokenizer, temperature):
    engine = make_engine(tiny, tokenizer, temperature=temperature)
    td = engine.rollout(PROMPTS, step=0)
    tf = model_token_log_probs(tiny, td["tokens", "full"], td["masks", "all_attention_mask"],
                               temperature=temperature)
    m = td["masks", "completion_mask"]
    assert torch.allclose(tf[m], td["log_probs", "full"][m], atol=1e-4, rtol=0)


def test_sync_rollouts_bit_reproducible_and_rng_untouched(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer)
    torch.manual_seed(123)
    a = engine.rollout(PROMPTS, step=5)
    after_a = torch.rand(3)
    torch.manual_seed(123)
    b = engine.rollout(PROMPTS, step=5)
    after_b = torch.rand(3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    assert torch.equal(a["tokens", "full"], b["tokens", "full"])
    assert torch.equal(a["log_probs", "full"], b["log_probs", "full"])
    assert torch.equal(after_a, expected) and torch.equal(after_b, expected)  # caller's RNG stream untouched
    c = engine.rollout(PROMPTS, step=6)
    assert not torch.equal(c["tokens", "full"], a["tokens", "full"])


def test_rollout_errors(tiny, tokenizer):
    with pytest.raises(RolloutError, match="num_generations must be an int >= 2"):
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


def test_workers_through_batcher_match_layout(tiny, tokenizer):
    engine = make_engine(tiny, tokenizer, num_workers=3, batching=True, seed=None)
    engine.policy._min_batch_size = 1
    td = engine.rollout(PROMPTS)
    state = engine.policy.get_batching_state()
    engine.policy.cleanup_batching(flush=True)
    assert td.batch_size == torch.Size([12]) and state["batching_enabled"] and state["rows_run"] == 12
    prompt_ids = tokenize_prompts(PROMPTS["prompt"], tokenizer)
    for i in range(12):
        row = td["tokens", "full"][i][td["masks", "all_attention_mask"][i]]
        assert torch.equal(row[: prompt_ids[i // 4].numel()], prompt_ids[i // 4])


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
    assert first.batch_size == torch.Size([4]) and int(first["policy_version"][0]) == 0
    with torch.no_grad():  # "train": change the weights, then sync them as version 1
        for p in trained.parameters():
            p.add_(0.01)
    producer.sync_weights(trained, 1)
    versions = []
    for td in it:
        versions.append(int(td["policy_version"][0]))
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
