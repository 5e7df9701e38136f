"""Threaded batcher overhead (issue 4): throughput on SmolLM2 and per-request latency on the tiny model.

Part 1 (real SmolLM2-135M-Instruct, log-prob version, tokens mode): ``--threads`` callers each ask for the
log-probs of one ``--seq-len``-token sequence, ``--rounds`` times. Compared:

* ``one-at-a-time``: the same calls made sequentially on an unbatched wrapper;
* ``pre-stacked``: one ``[threads]`` batched call per round (the ideal the batcher approaches);
* ``batched``: the callers on threads, served by the batcher (``min_batch_size = max_batch_size = threads``).

Part 2 (tiny model): median latency of one single-row log-prob call through the batcher (``min_batch_size=1``)
minus the same call made directly: the per-request cost of queueing, the worker hand-off and re-assembly.

Run: ``HF_HUB_OFFLINE=1 python benchmarks/batcher_throughput.py [--rounds 3] [--device cpu] [--skip-real]``.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from _memory import machine_line
from tensordict import TensorDict, lazy_stack

from lit_llm.data.containers import Tokens
from lit_llm.models import load_model, load_tokenizer, tiny_model
from lit_llm.policy.transformers_wrapper import TransformersWrapper


def _seqs(n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 20000, (length,), generator=gen) for _ in range(n)]


def _td(seq: torch.Tensor) -> TensorDict:
    return TensorDict(tokens=Tokens(full=seq))


def _threaded(policy, seqs: list[torch.Tensor], rounds: int) -> float:
    barrier = threading.Barrier(len(seqs) + 1)

    def caller(s):
        barrier.wait()
        for _ in range(rounds):
            policy(_td(s))

    threads = [threading.Thread(target=caller, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


@torch.no_grad()
def throughput(model, tokenizer, *, threads: int, seq_len: int, rounds: int) -> dict[str, float]:
    """Sequences per second for the three ways of serving ``threads`` x ``rounds`` requests."""
    seqs = _seqs(threads, seq_len)
    plain = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False)
    batched = plain.get_new_version(min_batch_size=threads, max_batch_size=threads, batching_timeout=30.0)
    plain(lazy_stack([_td(s) for s in seqs[:2]]))  # warm-up
    n = threads * rounds
    t0 = time.perf_counter()
    for _ in range(rounds):
        for s in seqs:
            plain(_td(s))
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(rounds):
        plain(lazy_stack([_td(s) for s in seqs]))
    stacked = time.perf_counter() - t0
    threaded = _threaded(batched, seqs, rounds)
    state = batched.get_batching_state()
    batched.cleanup_batching()
    return {"one-at-a-time": n / one, "pre-stacked": n / stacked, "batched": n / threaded,
            "batches_run": state["batches_run"]}


@torch.no_grad()
def latency_overhead(model, tokenizer, *, calls: int, seq_len: int = 32) -> dict[str, float]:
    """Median seconds of one single-row call, direct vs through the batcher, and the difference in ms."""
    plain = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=False)
    batched = plain.get_new_version(batching=True, min_batch_size=1)
    td = _td(_seqs(1, seq_len)[0])
    out = {}
    for name, policy in (("direct", plain), ("batched", batched), ("direct2", plain), ("batched2", batched)):
        for _ in range(5):
            policy(td.copy())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            policy(td.copy())
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    batched.cleanup_batching()
    direct, via = min(out["direct"], out["direct2"]), min(out["batched"], out["batched2"])
    return {"direct_ms": 1e3 * direct, "batched_ms": 1e3 * via, "overhead_ms": 1e3 * (via - direct)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-real", action="store_true", help="only the tiny-model latency part")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    tokenizer = load_tokenizer()
    print(f"torch threads: {torch.get_num_threads()}, device: {args.device}")
    tiny = tiny_model(tokenizer).to(args.device)
    lat = latency_overhead(tiny, tokenizer, calls=args.latency_calls)
    print(f"tiny model, 1 row x 32 tokens: direct {lat['direct_ms']:.2f} ms, batched {lat['batched_ms']:.2f} ms, "
          f"overhead {lat['overhead_ms']:.2f} ms per request")
    if args.skip_real:
        return
    model, tok = load_model()
    model = model.to(args.device)
    res = throughput(model, tok, threads=args.threads, seq_len=args.seq_len, rounds=args.rounds)
    print(f"SmolLM2, {args.threads} threads x {args.rounds} rounds x 1 seq of {args.seq_len} tokens (log-probs):")
    for k in ("one-at-a-time", "pre-stacked", "batched"):
        print(f"  {k:14s} {res[k]:7.2f} seq/s  ({res[k] / res['pre-stacked']:.2f}x pre-stacked)")
    print(f"  batches run by the batcher: {res['batches_run']}")


if __name__ == "__main__":
    main()
