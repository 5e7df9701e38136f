"""Stress tests of the threaded batcher (issue 4): 32 threads x 10 calls, random batch sizes 1-4 and lengths.

Each test has a hard ``pytest-timeout`` limit, so a deadlock fails instead of hanging CI. Every result must equal the
unbatched result for the same input, and every call must return within ``batching_timeout`` plus the forward passes
that ran while it waited.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from test_batching import FakePolicy, margin_model, prompt_td, token_prompts

pytestmark = pytest.mark.slow

N_THREADS, N_CALLS = 32, 10


def _hammer(call_fn, n_threads: int = N_THREADS, n_calls: int = N_CALLS, seed: int = 0) -> list[tuple]:
    """Run ``call_fn(rng) -> (input, output, t_start, t_end)`` n_calls times on each of n_threads threads."""
    records: list[tuple] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n_threads)

    def worker(k):
        rng = random.Random(seed * 1000 + k)
        barrier.wait()
        for _ in range(n_calls):
            try:
                rec = call_fn(rng)
            except BaseException as exc:  # noqa: BLE001
                with lock:
                    errors.append(exc)
                return
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(records) == n_threads * n_calls
    return records


def _check_latency(records, spans, timeout: float, slack: float = 0.5) -> None:
    """Each call waited at most ``timeout`` + the fn time that overlapped its wait (+ scheduling slack)."""
    for rec in records:
        t0, t1 = rec[-2], rec[-1]
        busy = sum(min(e, t1) - max(s, t0) for s, e in spans if e > t0 and s < t1)
        assert t1 - t0 <= timeout + busy + slack, (t1 - t0, busy)


class TimedFake(FakePolicy):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.spans: list[tuple[float, float]] = []

    def _forward(self, td, **kw):
        t0 = time.monotonic()
        try:
            return super()._forward(td, **kw)
        finally:
            self.spans.append((t0, time.monotonic()))


@pytest.mark.timeout(60)
def test_stress_fake_policy():
    timeout = 0.1
    p = TimedFake(delay=0.002, min_batch_size=4, max_batch_size=8, batching_timeout=timeout)

    def call(rng):
        xs = [tuple(rng.randrange(100) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        single = len(xs) == 1 and rng.random() < 0.5
        td = TensorDict(x=torch.tensor(xs[0])) if single else lazy_stack([TensorDict(x=torch.tensor(x)) for x in xs])
        t0 = time.monotonic()
        out = p(td)
        return xs, single, out, t0, time.monotonic()

    records = _hammer(call)
    for xs, single, out, *_ in records:
        got = [out["y"].tolist()] if single else [y.tolist() for y in out.get("y", as_list=True)]
        assert got == [[2 * v for v in x] for x in xs]
    assert max(p.batch_sizes) <= 8 and p.max_active == 1
    assert sum(p.batch_sizes) == sum(len(r[0]) for r in records)
    _check_latency(records, p.spans, timeout)
    p.cleanup_batching()


@pytest.mark.timeout(300)
def test_stress_tiny_transformers_generate_and_log_probs(tokenizer):
    from lit_llm.policy.transformers_wrapper import TransformersWrapper

    class Timed(TransformersWrapper):
        spans: list = []

        def _forward_dispatch(self, td, **kw):
            t0 = time.monotonic()
            try:
                return super()._forward_dispatch(td, **kw)
            finally:
                Timed.spans.append((t0, time.monotonic()))

    plain = TransformersWrapper(margin_model(tokenizer), tokenizer=tokenizer, input_mode="tokens",
                                generate_kwargs=dict(max_new_tokens=4, do_sample=False))
    pool = token_prompts(24, seed=7, lengths=(2, 24))
    alone = [plain(prompt_td([p])) for p in pool]
    scorer = plain.get_new_version(generate=False)
    ref_lp = [scorer(a.select("tokens").copy())["log_probs", "full"] for a in alone]

    timeout = 0.2
    gen = Timed(plain.model, tokenizer=tokenizer, input_mode="tokens", inplace=False,
                generate_kwargs=dict(max_new_tokens=4, do_sample=False), min_batch_size=6, max_batch_size=12,
                batching_timeout=timeout)
    lp = gen.get_new_version(generate=False)
    lp._adopt_batching_state(gen)  # both versions on one worker: never two forwards at once on the shared model

    def call(rng):
        idx = [rng.randrange(len(pool)) for _ in range(rng.randint(1, 4))]
        score = rng.random() < 0.5
        if score:
            tds = [alone[k].select("tokens").copy() for k in idx]
            td = tds[0] if len(idx) == 1 else lazy_stack(tds)
        else:
            td = prompt_td([pool[k] for k in idx])
        t0 = time.monotonic()
        out = (lp if score else gen)(td)
        return idx, score, out, t0, time.monotonic()

    records = _hammer(call, seed=1)
    for idx, score, out, *_ in records:
        rows = [out] if len(idx) == 1 else list(out.unbind(0))
        for k, r in zip(idx, rows):
            if score:
                torch.testing.assert_close(r["log_probs", "full"], ref_lp[k], atol=1e-4, rtol=1e-4)
            else:
                assert r["tokens", "response"].tolist() == alone[k]["tokens", "response"].tolist()
                torch.testing.assert_close(r["log_probs", "response"], alone[k]["log_probs", "response"],
                                           atol=1e-4, rtol=1e-4)
    state = gen.get_batching_state()
    assert state["rows_run"] == sum(len(r[0]) for r in records) and state["queue_size"] == 0
    _check_latency(records, Timed.spans, timeout)
    gen.cleanup_batching()
