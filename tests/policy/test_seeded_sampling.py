"""Per-row seeded sampling: ``row_seed``, the inverse-CDF sampler, ``generate_tokens(seeds=...)``, the wrapper's
``"sampling_seed"`` key, and bit-reproducible rollouts from several threads through the batcher (``batch_order``).

The RNG is exactly per row (the sampler tests and the wrapper's ``num_samples`` test compare bits). The model's
logits for a row are not bit-exact across batch layouts: another position in the batch (matmul blocking over rows)
or other padding shifts them by fp32 noise (~1e-6), far below the gaps between CDF boundaries the fixed seeds hit, so
across layouts ids are compared exactly and log-probs to 1e-5. Where the batch is the same (the threaded test: one
batch identical to the unbatched call) everything is compared bit for bit.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack

from lit_llm.policy.generation import (
    generate_tokens,
    resolve_generation_config,
    row_seed,
    sample_from_probs,
)
from lit_llm.policy.sampling import splitmix64

PROBS = torch.tensor([0.1, 0.0, 0.25, 0.0, 0.05, 0.6, 0.0])


# ----------------------------------------------------------------------------------------------------- row_seed
def test_splitmix64_matches_the_reference_stream():
    # SplitMix64 seeded with 0 (Vigna's reference splitmix64.c): first two outputs.
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_row_seed_pinned_in_range_and_distinct():
    assert row_seed(0, 0) == 6017775124710473527  # pinned: changing the mix changes every seeded rollout
    assert row_seed(-1, 3) == row_seed(2**64 - 1, 3)  # an int64's bit pattern
    seeds = {row_seed(b, k) for b in range(-50, 50) for k in range(16)}
    assert len(seeds) == 100 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    assert row_seed(torch.tensor(7).item(), 2) == row_seed(7, 2)


@pytest.mark.parametrize("base, k", [(1.5, 0), (True, 0), (0, -1), (0, 2.0), (2**64, 0), (-(2**63) - 1, 0)])
def test_row_seed_rejects_bad_input(base, k):
    with pytest.raises(ValueError, match="row_seed"):
        row_seed(base, k)


# ---------------------------------------------------------------------------------------------- the sampler
def test_quantile_grid_reproduces_the_probabilities_exactly():
    """Evenly spaced uniforms are the quantiles: each id gets N * p of them (+-1), zero-prob ids none."""
    n = 100_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for weights in (PROBS, PROBS * 3.0):  # rows need not be normalised
        ids = sample_from_probs(weights.expand(n, -1), u)
        counts = torch.bincount(ids, minlength=PROBS.numel())
        assert (counts - n * PROBS.double()).abs().max() <= 1
        assert counts[PROBS == 0].sum() == 0


def test_sampler_matches_the_distribution_chi_square():
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    ids = sample_from_probs(PROBS.expand(n, -1), u)
    counts = torch.bincount(ids, minlength=PROBS.numel()).double()
    assert counts[PROBS == 0].sum() == 0  # zero-probability tokens are never drawn
    expected = n * PROBS.double()
    nz = PROBS > 0
    chi2 = float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001 (fixed seed: not flaky)


def test_sampler_float_edges_never_pick_a_zero_probability_token():
    probs = torch.tensor([
        [0.0, 0.3, 0.0, 0.7, 0.0, 0.0],  # zeros at both ends
        [0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
        [0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 2.5],
    ])
    below_one = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    u = torch.tensor([0.0, 1.0, float(below_one), 1.0, 0.0], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [1, 3, 3, 0, 5]
    # fp32 rows with 1e-9 mass after a big one: u * total may round up to total -> clamped to a positive token
    tiny = torch.zeros(3, 50_000)
    tiny[:, 7] = 1.0
    tiny[:, 49_000] = 1e-30
    ids = sample_from_probs(tiny, torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64))
    assert all(tiny[i, j] > 0 for i, j in enumerate(ids.tolist()))


def test_sampler_rows_are_independent():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, 1000, generator=gen) * 3, -1)
    u = torch.rand(16, generator=gen, dtype=torch.float64)
    batched = sample_from_probs(probs, u)
    alone = torch.cat([sample_from_probs(probs[i:i + 1], u[i:i + 1]) for i in range(16)])
    assert torch.equal(batched, alone)
    perm = torch.randperm(16, generator=gen)
    assert torch.equal(sample_from_probs(probs[perm], u[perm]), batched[perm])


def test_sampler_shape_errors():
    with pytest.raises(ValueError, match="sample_from_probs"):
        sample_from_probs(PROBS, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="sample_from_probs"):
        sample_from_probs(PROBS[None], torch.tensor([0.5, 0.5]))


# --------------------------------------------------------------------------------------------- generate_tokens
def prompts_of(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 5000, (n,), generator=gen) for n in lengths]


@pytest.fixture(scope="module")
def sample_config(tiny):
    return resolve_generation_config({"max_new_tokens": 8, "temperature": 1.0}, tiny)


def assert_rows_equal(a, i, b, j, *, exact: bool = True) -> None:
    assert torch.equal(a.response_ids[i], b.response_ids[j])
    assert bool(a.truncated[i]) == bool(b.truncated[j])
    if exact:
        assert torch.equal(a.response_log_probs[i], b.response_log_probs[j])
    else:
        torch.testing.assert_close(a.response_log_probs[i], b.response_log_probs[j], atol=1e-5, rtol=1e-5)


def test_row_sample_does_not_depend_on_batch_position_or_companions(tiny, sample_config):
    prompts, seeds = prompts_of((3, 11, 7, 5)), [11, 22, 33, 44]
    batch = generate_tokens(tiny, prompts, sample_config, seeds=seeds)
    assert len({tuple(r.tolist()) for r in batch.response_ids}) == 4
    perm = [2, 0, 3, 1]  # other positions
    permuted = generate_tokens(tiny, [prompts[i] for i in perm], sample_config, seeds=[seeds[i] for i in perm])
    for j, i in enumerate(perm):
        assert_rows_equal(batch, i, permuted, j, exact=False)
        # alone: no padding, no companions
        alone = generate_tokens(tiny, [prompts[i]], sample_config, seeds=[seeds[i]])
        assert_rows_equal(batch, i, alone, 0, exact=False)


def test_identical_prompts_take_their_sample_from_their_own_seed(tiny, sample_config):
    """One prompt repeated (a GRPO group) with seeds in two different orders: each seed's sample follows it."""
    p, q = prompts_of((6, 9), seed=3)
    seeds = [5, 6, 7, 8]
    first = generate_tokens(tiny, [p, p, q, p], sample_config, seeds=seeds)
    assert len({tuple(first.response_ids[i].tolist()) for i in (0, 1, 3)}) == 3  # distinct seeds, distinct samples
    second = generate_tokens(tiny, [p, q, p, p], sample_config, seeds=[8, 7, 5, 6])
    for i, j in ((0, 2), (1, 3), (2, 1), (3, 0)):
        assert_rows_equal(first, i, second, j, exact=False)
    same = generate_tokens(tiny, [p, p], sample_config, seeds=[5, 5])
    assert_rows_equal(same, 0, same, 1)
    assert_rows_equal(same, 0, first, 0, exact=False)


def test_seeded_sampling_ignores_and_keeps_the_global_rng(tiny, sample_config):
    prompts, seeds = prompts_of((4, 8)), torch.tensor([1, 2])
    torch.manual_seed(0)
    state = torch.get_rng_state()
    a = generate_tokens(tiny, prompts, sample_config, seeds=seeds)
    assert torch.equal(torch.get_rng_state(), state)  # the global stream was not consumed
    torch.manual_seed(999)
    b = generate_tokens(tiny, prompts, sample_config, seeds=[1, 2])  # list or tensor: same seeds
    for i in range(2):
        assert_rows_equal(a, i, b, i)


def test_unseeded_sampling_still_uses_the_global_rng(tiny, sample_config):
    prompts = prompts_of((4, 8))
    torch.manual_seed(3)
    a = generate_tokens(tiny, prompts, sample_config)
    torch.manual_seed(3)
    b = generate_tokens(tiny, prompts, sample_config)
    c = generate_tokens(tiny, prompts, sample_config)
    assert all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
    assert any(not torch.equal(x, y) for x, y in zip(b.response_ids, c.response_ids))


def test_greedy_ignores_seeds(tiny):
    config = resolve_generation_config({"max_new_tokens": 6, "do_sample": False}, tiny)
    prompts = prompts_of((4, 8))
    plain = generate_tokens(tiny, prompts, config)
    seeded = generate_tokens(tiny, prompts, config, seeds=[1, 2])
    for i in range(2):
        assert_rows_equal(plain, i, seeded, i)


@pytest.mark.parametrize("seeds, match", [
    ([1], "1 entries for 2"),
    ([1, 2, 3], "3 entries for 2"),
    ([1, 2.0], r"seeds\[1\]"),
    ([True, 2], r"seeds\[0\]"),
    ([1, 2**64], r"seeds\[1\]"),
    (torch.tensor([1.0, 2.0]), "dtype"),
    (torch.tensor([True, False]), "dtype"),
    (torch.tensor([[1, 2]]), "1-D"),
    ("12", "sequence"),
    (7, "sequence"),
])
def test_bad_seeds_raise_naming_seeds(tiny, sample_config, seeds, match):
    with pytest.raises(ValueError, match="seeds") as info:
        generate_tokens(tiny, prompts_of((3, 4)), sample_config, seeds=seeds)
    assert info.match(match)


# ------------------------------------------------------------------------------------------- wrapper + batcher
@pytest.fixture(scope="module")
def sampler(tiny, tokenizer):
    from lit_llm.policy.transformers_wrapper import TransformersWrapper

    return TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens",
                               generate_kwargs={"max_new_tokens": 8, "temperature": 1.0})


def seeded_rows(prompts: list[torch.Tensor], seeds: list[int]):
    from lit_llm.data.containers import Tokens

    return lazy_stack([TensorDict({"tokens": Tokens(prompt=p), "sampling_seed": torch.tensor(s)})
                       for p, s in zip(prompts, seeds)])


def test_wrapper_sampling_seed_with_num_samples_uses_row_seed(sampler, sample_config, tiny):
    prompts, bases = prompts_of((5, 9)), [10, 2**62]
    policy = sampler.get_new_version(num_samples=3)
    out = policy(seeded_rows(prompts, bases))
    assert out.batch_size == (2, 3)
    rep = [p for p in prompts for _ in range(3)]
    ref = generate_tokens(tiny, rep, sample_config, seeds=[row_seed(b, k) for b in bases for k in range(3)])
    for b in range(2):
        for k in range(3):
            assert torch.equal(out[b, k]["tokens", "response"], ref.response_ids[3 * b + k])
            assert torch.equal(out[b, k]["log_probs", "response"], ref.response_log_probs[3 * b + k])
    again = policy(seeded_rows(prompts, bases))
    assert all(torch.equal(out[b, k]["tokens", "response"], again[b, k]["tokens", "response"])
               for b in range(2) for k in range(3))
    assert len({tuple(out[b, k]["tokens", "response"].tolist()) for b in range(2) for k in range(3)}) == 6


def test_wrapper_sampling_seed_dense_and_single_row(sampler, tiny, sample_config):
    from lit_llm.data.containers import Tokens

    p = prompts_of((6,), seed=4)[0]
    ref = generate_tokens(tiny, [p], sample_config, seeds=[row_seed(77, 0)])
    single = sampler(TensorDict({"tokens": Tokens(prompt=p), "sampling_seed": torch.tensor(77)}))
    dense = sampler(TensorDict({"tokens": Tokens(prompt=p[None], batch_size=[1]),
                                "sampling_seed": torch.tensor([77])}, batch_size=[1]))
    for got in (single["tokens", "response"], dense.get(("tokens", "response"), as_list=True)[0]):
        assert torch.equal(got, ref.response_ids[0])


@pytest.mark.parametrize("value", [torch.tensor(1.5), torch.tensor(True)])
def test_wrapper_rejects_non_integer_sampling_seed(sampler, value):
    from lit_llm.data.containers import Tokens

    td = lazy_stack([TensorDict({"tokens": Tokens(prompt=torch.tensor([5, 6])), "sampling_seed": value})])
    with pytest.raises(ValueError, match="sampling_seed"):
        sampler(td)


def test_threaded_rollouts_bit_identical_to_one_unbatched_call(sampler):
    """K workers, one batched forward per step: rows sorted by batch_order, per-row seeds -> the same bits as one
    unbatched call with the rows in worker order, whatever order the workers arrive in, run after run."""
    k_workers, sizes = 4, (1, 2, 1, 3)
    all_prompts = prompts_of((3, 12, 5, 9, 2, 7, 4), seed=8)
    all_seeds = [101, 102, 103, 104, 105, 106, 107]
    bounds = [sum(sizes[:k]) for k in range(k_workers + 1)]
    work = [(all_prompts[a:b], all_seeds[a:b]) for a, b in zip(bounds, bounds[1:])]
    reference = sampler(seeded_rows(all_prompts, all_seeds))
    policy = sampler.get_new_version(batching=True, min_batch_size=len(all_prompts), batching_timeout=60.0)

    def step(arrival: list[int]) -> list:
        out: list = [None] * k_workers
        go = [threading.Event() for _ in range(k_workers)]

        def worker(k: int) -> None:
            go[k].wait()
            out[k] = policy(seeded_rows(*work[k]), batch_order=k)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(k_workers)]
        for t in threads:
            t.start()
        queued = 0
        for k in arrival:  # release the workers one by one in the given arrival order
            go[k].set()
            queued += sizes[k]
            end = time.monotonic() + 10
            while policy.get_batching_state()["queue_size"] < queued and queued < len(all_prompts):
                assert time.monotonic() < end
                time.sleep(0.002)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        return [row for o in out for row in o.unbind(0)]

    for run, arrival in enumerate(([3, 1, 0, 2], [2, 0, 3, 1])):
        rows = step(arrival)
        assert policy.get_batching_state()["batches_run"] == run + 1  # ONE forward batch per step
        for i, row in enumerate(rows):
            assert torch.equal(row["tokens", "prompt"], all_prompts[i])
            assert torch.equal(row["tokens", "response"], reference[i]["tokens", "response"])
            assert torch.equal(row["log_probs", "response"], reference[i]["log_probs", "response"])
            assert torch.equal(row["tokens", "full"], reference[i]["tokens", "full"])
    policy.cleanup_batching()
