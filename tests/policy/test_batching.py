"""Threaded batcher (issue 4): scheduling, exact per-caller results, errors, cleanup, lifecycle.

Most tests use :class:`FakePolicy`, a deterministic ``TensorDictModuleBase`` with the mixin; the last ones run the
real :class:`~lit_llm.policy.TransformersWrapper` on the tiny model.
"""

from __future__ import annotations

import copy
import gc
import threading
import time
import traceback

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict, lazy_stack
from tensordict.nn import TensorDictModuleBase

from lit_llm.policy.batching import BatchingCancelledError, BatchingInputError, BatchingMixin

WORKER = "lit_llm-batching-worker"


class FakePolicy(BatchingMixin, TensorDictModuleBase):
    """Reads ragged ``x`` ([T] long per row), writes ``y = 2 * x + offset (+ sample index)``.

    Records the batch sizes its function saw and the threads it ran on; raises ``ValueError`` for a row whose first
    element is -1; sleeps ``delay`` seconds per call to simulate work; ``num_samples=n`` gives ``[N, n]`` outputs.
    """

    in_keys = ["x"]
    out_keys = ["y"]

    def __init__(self, *, delay: float = 0.0, num_samples: int | None = None, inplace: bool = False,
                 batching: bool | None = None, min_batch_size: int | None = None, max_batch_size: int | None = None,
                 batching_timeout: float = 10.0) -> None:
        super().__init__()
        self.delay, self.num_samples, self.inplace = delay, num_samples, inplace
        self.batch_sizes: list[int] = []
        self.threads: set[str] = set()
        self.active = self.max_active = 0
        self._init_batching(batching, min_batch_size, max_batch_size, batching_timeout)

    def forward(self, tensordict, **kwargs):
        return self._run_maybe_batched(tensordict, self._forward, **kwargs)

    def _forward(self, td, *, offset: int = 0):
        if td.batch_dims == 0:
            return self._forward(lazy_stack([td]), offset=offset)[0]
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            self.batch_sizes.append(td.batch_size[0])
            self.threads.add(threading.current_thread().name)
            time.sleep(self.delay)
            xs = td.get("x", as_list=True)
            for i, x in enumerate(xs):
                if x[0] == -1:
                    raise ValueError(f"bad row {i}")
            if self.inplace:
                td.set("y", [2 * x + offset for x in xs])
                return td
            rows = []
            for x in xs:
                if self.num_samples is None:
                    rows.append(TensorDict(y=2 * x + offset))
                else:
                    rows.append(lazy_stack([TensorDict(y=2 * x + offset + j) for j in range(self.num_samples)]))
            return lazy_stack(rows)
        finally:
            self.active -= 1


def row(*values: int) -> TensorDict:
    return TensorDict(x=torch.tensor(values, dtype=torch.long))


def rows(*seqs: tuple[int, ...]) -> LazyStackedTensorDict:
    return lazy_stack([row(*s) for s in seqs])


def ys(td) -> list[list[int]]:
    return [y.tolist() for y in td.get("y", as_list=True)]


def run_threads(fns, timeout: float = 20.0) -> list:
    """Run callables on threads started together; return results (or raised exceptions) in order."""
    out: list = [None] * len(fns)
    barrier = threading.Barrier(len(fns))

    def target(k):
        barrier.wait()
        try:
            out[k] = fns[k]()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            out[k] = exc

    threads = [threading.Thread(target=target, args=(k,)) for k in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a caller is still blocked (deadlock?)"
    return out


def wait_for(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.005)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER]


# ----------------------------------------------------------------------------------------------------- settings
def test_off_by_default_runs_inline():
    p = FakePolicy()
    assert not p.batching and p.get_batching_state() == {"batching_enabled": False}
    out = p(rows((1, 2), (3,)))
    assert ys(out) == [[2, 4], [6]] and p.batch_sizes == [2]
    assert p.threads == {threading.current_thread().name}


def test_settings_and_state():
    p = FakePolicy(min_batch_size=2, max_batch_size=3, batching_timeout=0.5)
    assert p.batching
    assert p._batching_settings() == dict(batching=True, min_batch_size=2, max_batch_size=3, batching_timeout=0.5)
    assert p.get_batching_state() == {
        "batching_enabled": True, "min_batch_size": 2, "max_batch_size": 3, "batching_timeout": 0.5, "queue_size": 0,
        "pending_requests": 0, "processing": False, "processing_rows": 0, "worker_alive": False, "batches_run": 0,
        "rows_run": 0, "timeout": 0.5, "pending_futures": 0, "lock_state": "unlocked"}  # + TorchRL's names
    q = FakePolicy(batching=True)
    assert q._batching_settings() == dict(batching=True, min_batch_size=1, max_batch_size=None,
                                          batching_timeout=10.0)  # TorchRL stores 1 for batching=True alone
    assert q.get_batching_state()["min_batch_size"] == 1
    off = FakePolicy(batching=False, min_batch_size=4)
    assert not off.batching  # explicit False wins
    assert off._batching_settings() == dict(batching=None, min_batch_size=None, max_batch_size=None,
                                            batching_timeout=10.0)
    assert FakePolicy(**{**off._batching_settings(), "min_batch_size": 8}).batching  # get_new_version(min_batch_size=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(min_batch_size=0), r"min_batch_size must be an integer >= 1 \(or None\), got 0"),
        (dict(max_batch_size=2.5), r"max_batch_size must be an integer >= 1 \(or None\), got 2.5"),
        (dict(min_batch_size=4, max_batch_size=2), r"max_batch_size=2 is smaller than min_batch_size=4"),
        (dict(batching=True, batching_timeout=0), r"batching_timeout must be a positive finite number.*got 0"),
        (dict(batching=True, batching_timeout=float("inf")), r"batching_timeout must be .*got inf"),
        (dict(batching=True, batching_timeout="1"), r"batching_timeout must be .*got '1'"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FakePolicy(**kwargs)


def test_bad_inputs_rejected_for_the_caller():
    p = FakePolicy(batching=True)
    with pytest.raises(BatchingInputError, match=r"batch_size=\[0\] \(no rows\)"):
        p(TensorDict(x=torch.zeros(0, 3), batch_size=[0]))
    mixed = lazy_stack([row(1), TensorDict(x=torch.tensor([2]), z=torch.tensor(1.0))])
    with pytest.raises(BatchingInputError, match=r"rows 0 and 1 cannot be stacked together \(keys \['x'\] vs \['x', "
                                                 r"'z'\]\)"):
        p(mixed)
    dtype = lazy_stack([row(1), TensorDict(x=torch.tensor([2.0]))])
    with pytest.raises(BatchingInputError, match=r"rows 0 and 1 cannot be stacked together \(key 'x': "):
        p(dtype)
    assert p.batch_sizes == [] and ys(p(row(5))) == [10]  # nothing ran for the rejected calls, still usable


# ----------------------------------------------------------------------------------------------------- results
def test_exact_rows_for_batch_dims_0_and_1():
    p = FakePolicy(min_batch_size=3, batching_timeout=5.0)
    a, b = rows((1, 2, 3), (4,)), row(7, 8)
    out = run_threads([lambda: p(a), lambda: p(b)])
    assert p.batch_sizes == [3]  # both callers served in one shared forward
    assert isinstance(out[0], LazyStackedTensorDict) and out[0].batch_size == torch.Size([2])
    assert ys(out[0]) == [[2, 4, 6], [8]]
    assert out[1].batch_size == torch.Size([]) and out[1]["y"].tolist() == [14, 16]
    dense = TensorDict(x=torch.tensor([[1, 1], [2, 2], [3, 3]]), batch_size=[3])
    out = p(dense)  # 3 rows reach min_batch_size alone
    assert ys(out) == [[2, 2], [4, 4], [6, 6]] and "y" not in dense.keys()


def test_min_batch_size_collects_concurrent_callers():
    p = FakePolicy(min_batch_size=4, batching_timeout=10.0)
    out = run_threads([lambda k=k: p(row(k)) for k in range(4)])
    assert p.batch_sizes == [4]
    assert [o["y"].tolist() for o in out] == [[0], [2], [4], [6]]
    assert p.threads == {WORKER}
    assert p.get_batching_state()["batches_run"] == 1 and p.get_batching_state()["rows_run"] == 4


def test_set_min_batch_size_releases_a_waiting_batch_and_is_checked():
    # 2 callers queued under min_batch_size 4 (timeout far away): lowering it to 2 runs them at once, together
    p = FakePolicy(min_batch_size=4, max_batch_size=6, batching_timeout=60.0)
    threads = [threading.Thread(target=lambda k=k: p(row(k))) for k in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while p.get_batching_state()["queue_size"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.batch_sizes == [] and p.get_batching_state()["queue_size"] == 2
    t0 = time.monotonic()
    p.set_min_batch_size(2)
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 10 and p.batch_sizes == [2]
    assert p.get_batching_state()["min_batch_size"] == 2
    assert p._batching_settings()["min_batch_size"] == 4  # a new version still gets the configured size
    for bad, match in ((0, r"min_batch_size must be an integer >= 1 \(or None\), got 0"), (None, r"got 0"),
                       (2.5, r"got 2.5"), (True, r"got True"), (7, r"7 rows exceed max_batch_size=6")):
        with pytest.raises(ValueError, match=match):
            p.set_min_batch_size(bad)
    off = FakePolicy(batching=False)
    with pytest.raises(ValueError, match="set_min_batch_size: batching is off"):
        off.set_min_batch_size(2)


def test_request_larger_than_max_is_split_and_reassembled():
    p = FakePolicy(max_batch_size=4)
    out = p(rows(*[(k, k) for k in range(10)]))
    assert p.batch_sizes == [4, 4, 2]
    assert ys(out) == [[2 * k, 2 * k] for k in range(10)]


def test_max_batch_size_never_exceeded_and_fn_on_one_thread():
    p = FakePolicy(min_batch_size=3, max_batch_size=5, batching_timeout=0.05, delay=0.005)
    calls = [lambda k=k: p(rows(*[(k, j) for j in range(1 + k % 4)])) for k in range(16)]
    out = run_threads(calls)
    for k, o in enumerate(out):
        assert ys(o) == [[2 * k, 2 * j] for j in range(1 + k % 4)]
    assert max(p.batch_sizes) <= 5 and sum(p.batch_sizes) == sum(1 + k % 4 for k in range(16))
    assert p.max_active == 1 and p.threads == {WORKER}


def test_timeout_single_caller_below_min():
    p = FakePolicy(min_batch_size=8, batching_timeout=0.3)
    t0 = time.monotonic()
    out = p(row(3))
    elapsed = time.monotonic() - t0
    assert out["y"].tolist() == [6] and p.batch_sizes == [1]
    assert 0.29 <= elapsed < 0.3 + 0.7, elapsed


def test_num_samples_rows_keep_their_samples():
    p = FakePolicy(num_samples=3, min_batch_size=3, batching_timeout=5.0)
    out = run_threads([lambda: p(rows((1,), (2, 2))), lambda: p(row(5))])
    assert p.batch_sizes == [3]
    assert out[0].batch_size == torch.Size([2, 3])
    assert [[y.tolist() for y in r.get("y", as_list=True)] for r in out[0].unbind(0)] == [
        [[2], [3], [4]], [[4, 4], [5, 5], [6, 6]]]
    assert out[1].batch_size == torch.Size([3]) and [y.tolist() for y in out[1].get("y", as_list=True)] == [
        [10], [11], [12]]


def test_different_kwargs_or_structure_never_share_a_batch():
    p = FakePolicy(min_batch_size=2, batching_timeout=0.2)
    extra = TensorDict(x=torch.tensor([4]), z=torch.tensor(1.0))
    out = run_threads([lambda: p(row(1), offset=1), lambda: p(row(2), offset=2), lambda: p(extra), lambda: p(row(3))])
    assert [o["y"].tolist() for o in out] == [[3], [6], [8], [6]]
    assert sorted(p.batch_sizes) == [1, 1, 1, 1]  # four incompatible kinds: each ran alone after the timeout


def test_inplace_function_updates_callers_objects():
    p = FakePolicy(inplace=True, min_batch_size=3, batching_timeout=5.0)
    a, b = rows((1,), (2, 3)), row(4)
    out = run_threads([lambda: p(a), lambda: p(b)])
    assert out[0] is a and out[1] is b
    assert ys(a) == [[2], [4, 6]] and b["y"].tolist() == [8]


def test_reentrant_call_from_the_function_runs_inline():
    p = FakePolicy(batching=True)
    seen = []

    def fn(td):
        seen.append(ys(p(td)))  # would deadlock if it queued on its own worker
        return td

    p._run_maybe_batched(row(2), fn)
    assert seen == [[[4]]]  # fn sees a [1] stack; the inner call ran inline on the worker


# ----------------------------------------------------------------------------------------------------- errors
def test_error_reaches_only_its_batch_with_traceback_and_recovery():
    p = FakePolicy(min_batch_size=2, max_batch_size=2, batching_timeout=0.2)
    out = run_threads([lambda: p(row(1)), lambda: p(rows((2,), (-1,)))])  # 3 rows -> batches [2] and [1]
    errors = [o for o in out if isinstance(o, BaseException)]
    assert sorted(p.batch_sizes) == [1, 2]
    if p.batch_sizes[0] == 2 and isinstance(out[0], BaseException):
        pass  # row(1) shared the failing batch: both callers fail
    assert isinstance(out[1], ValueError)  # the bad caller always fails
    for e in errors:
        assert isinstance(e, ValueError) and str(e).startswith("bad row")
        assert isinstance(e.__cause__, ValueError) and e.__cause__ is not e
        frames = [f.name for f in traceback.extract_tb(e.__traceback__)]
        assert "_forward" in frames and "_run_maybe_batched" in frames
        assert any("batching worker on a shared batch" in n for n in e.__notes__)
    # other batches unaffected, wrapper still usable
    out = run_threads([lambda: p(row(5)), lambda: p(row(6))])
    assert [o["y"].tolist() for o in out] == [[10], [12]]


def test_error_isolated_from_concurrent_batches():
    p = FakePolicy(max_batch_size=1, delay=0.01)
    out = run_threads([lambda k=k: p(row(-1 if k == 3 else k)) for k in range(6)])
    for k, o in enumerate(out):
        if k == 3:
            assert isinstance(o, ValueError) and str(o) == "bad row 0"
        else:
            assert o["y"].tolist() == [2 * k]


def test_wrong_output_batch_size_is_reported():
    p = FakePolicy(batching=True)
    with pytest.raises(RuntimeError, match=r"returned batch_size=\[1\] for a stacked input of 2 rows"):
        p._run_maybe_batched(rows((1,), (2,)), lambda td: td[:1])
    assert ys(p(rows((1,), (2,)))) == [[2], [4]]


# ----------------------------------------------------------------------------------------------------- lifecycle
def _queue_three(p):
    results: list = [None] * 3

    def call(k):
        try:
            results[k] = p(row(k))
        except BaseException as exc:  # noqa: BLE001
            results[k] = exc

    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: p.get_batching_state()["queue_size"] == 3)
    assert p.get_batching_state()["pending_requests"] == 3
    return threads, results


def test_cleanup_flush_runs_queued_requests():
    p = FakePolicy(min_batch_size=8, batching_timeout=60.0)
    threads, results = _queue_three(p)
    worker = p._batcher._thread
    p.cleanup_batching(flush=True)
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    assert [r["y"].tolist() for r in results] == [[0], [2], [4]] and p.batch_sizes == [3]
    assert p.get_batching_state()["worker_alive"] is False and not worker.is_alive()


def test_cleanup_cancel_fails_waiting_callers_then_recovers():
    p = FakePolicy(min_batch_size=8, batching_timeout=60.0)
    threads, results = _queue_three(p)
    p.cleanup_batching(flush=False)
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    for r in results:
        assert isinstance(r, BatchingCancelledError) and "batching cleaned up" in str(r)
    assert p.batch_sizes == [] and p.get_batching_state()["queue_size"] == 0
    out = p(rows(*[(k,) for k in range(8)]))  # a new worker starts on the next call
    assert ys(out) == [[2 * k] for k in range(8)] and p.batch_sizes == [8]


def test_repeated_enable_disable_leaks_no_thread():
    gc.collect()
    baseline = len(worker_threads())
    p = FakePolicy(min_batch_size=2, batching_timeout=1.0)
    for k in range(20):
        p.batching = True
        out = run_threads([lambda k=k: p(row(k)), lambda k=k: p(row(k + 1))])
        assert [o["y"].tolist() for o in out] == [[2 * k], [2 * k + 2]]
        thread = p._batcher._thread
        p.batching = False
        assert not thread.is_alive() and p.get_batching_state() == {"batching_enabled": False}
        assert len(worker_threads()) <= baseline  # finished workers of earlier tests may still be exiting
        assert p(row(1))["y"].tolist() == [2]
    assert p.batch_sizes.count(2) == 20


def test_garbage_collection_stops_the_worker():
    p = FakePolicy(batching=True)
    assert p(row(1))["y"].tolist() == [2]
    thread = p._batcher._thread
    assert thread.is_alive()
    del p
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_deepcopy_gets_its_own_idle_batcher():
    p = FakePolicy(min_batch_size=2, batching_timeout=0.1)
    p(row(1))
    q = copy.deepcopy(p)
    assert q.batching and q._batcher is not p._batcher
    assert q._batching_settings() == p._batching_settings()
    assert q.get_batching_state()["worker_alive"] is False and q.get_batching_state()["batches_run"] == 0
    assert q(row(2))["y"].tolist() == [4]
    p.cleanup_batching()
    q.cleanup_batching()


def test_share_batching_state_between_versions():
    p = FakePolicy(min_batch_size=2, batching_timeout=0.2)
    q = FakePolicy(**p._batching_settings())
    assert q._batcher is not p._batcher
    q._adopt_batching_state(p)
    assert q._batcher is p._batcher
    out = run_threads([lambda: p(row(1)), lambda: q(row(2)), lambda: p(row(3))])
    assert [o["y"].tolist() for o in out] == [[2], [4], [6]]
    # p's two rows share a batch; q's row (another function) runs after the timeout, on the same worker
    assert p.batch_sizes == [2] and q.batch_sizes == [1] and p.threads == q.threads == {WORKER}
    with pytest.raises(ValueError, match=r"share_batching_state=True needs the same batching settings"):
        FakePolicy(min_batch_size=3)._adopt_batching_state(p)
    with pytest.raises(ValueError, match=r"the source wrapper has batching off"):
        FakePolicy(batching=True)._adopt_batching_state(FakePolicy())
    p.cleanup_batching()


def test_exclusive_call_runs_alone_on_the_worker():
    p = FakePolicy(min_batch_size=2, batching_timeout=0.2)
    seen = []

    def whole(td, *, scale):
        seen.append((threading.current_thread().name, td.batch_size))
        return TensorDict(z=td["x"] * scale, batch_size=td.batch_size)

    dense = TensorDict(x=torch.tensor([[1, 2], [3, 4]]), batch_size=[2])
    out = run_threads([lambda: p._run_exclusive(dense, whole, scale=3), lambda: p(row(1)), lambda: p(row(2))])
    assert out[0]["z"].tolist() == [[3, 6], [9, 12]]
    assert seen == [(WORKER, torch.Size([2]))]  # the caller's own [2] tensordict, never merged
    assert [o["y"].tolist() for o in out[1:]] == [[2], [4]] and p.batch_sizes == [2]
    with pytest.raises(KeyError):
        p._run_exclusive(row(1), lambda td: td["missing"])
    assert FakePolicy()._run_exclusive(dense, whole, scale=1)["z"].tolist() == [[1, 2], [3, 4]]  # off: inline


def test_rows_with_extra_batch_dims_batch_by_shape():
    p = FakePolicy(min_batch_size=4, batching_timeout=0.2)
    sizes = []

    def double(td):
        sizes.append(list(td.batch_size))
        return TensorDict(z=td["x"] * 2, batch_size=td.batch_size)

    a = TensorDict(x=torch.arange(6).reshape(2, 3), batch_size=[2, 3])
    b = TensorDict(x=torch.arange(6, 12).reshape(2, 3), batch_size=[2, 3])
    c = TensorDict(x=torch.arange(4).reshape(2, 2), batch_size=[2, 2])
    out = run_threads([lambda t=t: p._run_maybe_batched(t, double) for t in (a, b, c)])
    assert out[0]["z"].tolist() == (a["x"] * 2).tolist() and out[1]["z"].tolist() == (b["x"] * 2).tolist()
    assert out[2]["z"].tolist() == (c["x"] * 2).tolist()
    assert sorted(sizes) == [[2, 2], [4, 3]]  # a and b shared one [4, 3] call; c's [2]-rows ran alone


# ------------------------------------------------------------------------------------- TransformersWrapper (tiny)
def margin_model(tokenizer, scale: float = 8.0):
    """The tiny model with an untied random LM head scaled up: varied greedy outputs with large top-1 margins, so
    float noise from padding cannot flip a greedy choice (a tied tiny model just echoes the last prompt token)."""
    from lit_llm.models import tiny_model

    model = tiny_model(tokenizer, seed=1)
    gen = torch.Generator().manual_seed(3)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=gen) * scale)
    return model


def token_prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (2, 20)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 5000, (int(k),), generator=gen) for k in torch.randint(*lengths, (n,), generator=gen)]


def prompt_td(prompts: list[torch.Tensor]):
    from lit_llm.data.containers import Tokens

    if len(prompts) == 1:
        return TensorDict(tokens=Tokens(prompt=prompts[0]))
    return lazy_stack([TensorDict(tokens=Tokens(prompt=p)) for p in prompts])


@pytest.fixture(scope="module")
def greedy_policy(tokenizer):
    from lit_llm.policy.transformers_wrapper import TransformersWrapper

    return TransformersWrapper(margin_model(tokenizer), tokenizer=tokenizer, input_mode="tokens",
                               generate_kwargs=dict(max_new_tokens=6, do_sample=False))


def test_tiny_generate_and_log_probs_in_shared_batches_equal_alone(greedy_policy):
    prompts = token_prompts(9)
    alone = [greedy_policy(prompt_td([p])) for p in prompts]
    assert len({tuple(a["tokens", "response"].tolist()) for a in alone}) == 9  # non-degenerate outputs
    gen = greedy_policy.get_new_version(batching=True, min_batch_size=6, max_batch_size=6, batching_timeout=1.0)
    groups = [[0], [1, 2], [3], [4, 5, 6], [7], [8]]  # batch_dims 0 and 1 callers
    out = run_threads([lambda g=g: gen(prompt_td([prompts[k] for k in g])) for g in groups])
    assert gen.get_batching_state()["batches_run"] == 2 and gen.get_batching_state()["rows_run"] == 9
    lp = gen.get_new_version(generate=False)  # batching settings carried over, a fresh queue
    assert lp.batching and lp._batcher is not gen._batcher
    for g, o in zip(groups, out):
        got = [o] if len(g) == 1 else list(o.unbind(0))
        assert len(got) == len(g)
        for k, r in zip(g, got):
            assert r["tokens", "prompt"].tolist() == prompts[k].tolist()
            assert r["tokens", "response"].tolist() == alone[k]["tokens", "response"].tolist()
            assert r["tokens", "full"].tolist() == prompts[k].tolist() + r["tokens", "response"].tolist()
            torch.testing.assert_close(r["log_probs", "response"], alone[k]["log_probs", "response"],
                                       atol=1e-4, rtol=1e-4)  # padding changes fp32 summation order
    # log-prob version: three callers score the generated sequences in one shared batch
    full = [alone[k].select("tokens").copy() for k in range(3)]
    ref = [greedy_policy.get_new_version(generate=False)(f.copy())["log_probs", "full"] for f in full]
    scored = run_threads([lambda f=f: lp(f.copy()) for f in full])
    for r, s in zip(ref, scored):
        torch.testing.assert_close(s["log_probs", "full"], r, atol=1e-4, rtol=1e-4)
    gen.cleanup_batching()
    lp.cleanup_batching()


def test_wrapper_versions_share_one_worker_only_when_asked(greedy_policy):
    gen = greedy_policy.get_new_version(batching=True, min_batch_size=2, max_batch_size=4, batching_timeout=0.5)
    fresh = gen.get_new_version(generate=False)
    shared = gen.get_new_version(generate=False, share_batching_state=True)
    assert fresh._batcher is not gen._batcher
    assert shared._batcher is gen._batcher
    out = gen(prompt_td(token_prompts(2, seed=5)))
    scored = shared(out.select("tokens").copy())
    lps = scored.get(("log_probs", "full"), as_list=True)
    assert [lp.numel() for lp in lps] == [f.numel() for f in out.get(("tokens", "full"), as_list=True)]
    # logits_only is never merged with other callers: it runs alone and keeps this caller's own padding.
    logits = shared(out[:1].select("tokens").copy(), logits_only=True)["logits"]
    assert logits.shape[:2] == (1, out[0]["tokens", "full"].numel())
    for w in (gen, fresh, shared):
        w.cleanup_batching()


# ------------------------------------------------------------------------------------------------ batch_order
class OrderPolicy(FakePolicy):
    """FakePolicy that records the first element of every row of every batch, in batch order."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batches: list[list[int]] = []

    def _forward(self, td, *, offset: int = 0):
        if td.batch_dims:
            self.batches.append([int(x[0]) for x in td.get("x", as_list=True)])
        return super()._forward(td, offset=offset)


def submit_in_order(p: BatchingMixin, calls: list, timeout: float = 20.0) -> list:
    """Start ``calls`` (callables, each queuing ``n`` rows: ``(n, fn)``) one by one: each starts once the previous
    rows are queued, so arrival order is the list order. Returns the results in that order."""
    out: list = [None] * len(calls)
    threads, queued = [], 0

    def target(k, fn):
        try:
            out[k] = fn()
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            out[k] = exc

    for k, (n, fn) in enumerate(calls):
        t = threading.Thread(target=target, args=(k, fn))
        t.start()
        threads.append(t)
        queued += n
        if k < len(calls) - 1:
            wait_for(lambda q=queued: p.get_batching_state()["queue_size"] >= q)
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a caller is still blocked (deadlock?)"
    return out


def test_batch_order_sorts_rows_and_unordered_rows_come_last_in_arrival_order():
    p = OrderPolicy(min_batch_size=7, batching_timeout=30.0)
    calls = [
        (1, lambda: p(row(50))),                               # no order, arrives first
        (2, lambda: p(rows((30,), (31,)), batch_order=3)),
        (1, lambda: p(row(10), batch_order=-1)),
        (1, lambda: p(row(60))),                               # no order, arrives later
        (2, lambda: p(rows((20,), (21,)), batch_order=1)),
    ]
    out = submit_in_order(p, calls)
    assert p.batches == [[10, 20, 21, 30, 31, 50, 60]]  # (order, arrival, row); unordered last, FIFO
    assert p.get_batching_state()["batches_run"] == 1  # different orders share one batch (not a kwarg)
    assert ys(out[1]) == [[60], [62]] and ys(out[4]) == [[40], [42]] and out[0]["y"].tolist() == [100]
    p.cleanup_batching()


def test_without_orders_batches_stay_fifo():
    p = OrderPolicy(min_batch_size=4, batching_timeout=30.0)
    submit_in_order(p, [(1, lambda: p(row(3))), (2, lambda: p(rows((1,), (2,)))), (1, lambda: p(row(0)))])
    assert p.batches == [[3, 1, 2, 0]]
    p.cleanup_batching()


def test_batch_order_with_max_batch_size_takes_the_lowest_orders_first():
    p = OrderPolicy(min_batch_size=2, max_batch_size=2, batching_timeout=30.0)
    release = threading.Event()
    blocker = threading.Thread(target=p._run_exclusive, args=(row(99), lambda td: (release.wait(5), td)[1]))
    blocker.start()  # keeps the worker busy while four rows queue up in reverse order
    wait_for(lambda: p.get_batching_state()["processing"])
    threads = [threading.Thread(target=p, args=(row(k),), kwargs={"batch_order": k}) for k in (3, 2, 1, 0)]
    for n, t in enumerate(threads, start=1):
        t.start()
        wait_for(lambda n=n: p.get_batching_state()["queue_size"] >= n)
    release.set()
    for t in [blocker, *threads]:
        t.join(20)
    assert p.batches == [[0, 1], [2, 3]]
    p.cleanup_batching()


def test_batch_order_never_mixes_kwargs_and_exclusive_calls_still_run():
    p = OrderPolicy(min_batch_size=2, batching_timeout=0.5)
    out = submit_in_order(p, [
        (1, lambda: p(row(1), batch_order=0, offset=100)),
        (1, lambda: p(row(2), batch_order=1)),  # other kwargs: its own batch, despite the order
        (0, lambda: p._run_exclusive(row(9), p._forward)),  # runs at once while the ordered rows wait
    ])
    assert [b.tolist() for b in (out[0]["y"], out[1]["y"], out[2]["y"])] == [[102], [4], [18]]
    assert p.batches == [[9], [1], [2]]  # the two ordered rows ran alone, each after the timeout
    p.cleanup_batching()


def test_batch_order_validation_and_batching_off():
    p = OrderPolicy(min_batch_size=1)
    with pytest.raises(ValueError, match="batch_order"):
        p(row(1), batch_order=1.5)
    with pytest.raises(ValueError, match="batch_order"):
        p(row(1), batch_order=True)
    off = OrderPolicy(batching=False)
    assert off(rows((1,), (2,)), batch_order=5)["y"].tolist() == [[2], [4]]  # accepted and ignored
    p.cleanup_batching()
