"""Host syncs of the decoding loop, counted on CPU tensors (issue 28; tests/sync_counter.py says what counts).

On a GPU each of these reads makes the host wait for the device, so the decoding loop reads nothing per step except
the "is every row done?" check, every ``done_check_every`` steps (``None``: every step on the CPU, where a read is
free and a step past the end costs a forward pass; every ``DONE_CHECK_EVERY`` = 8 steps on an accelerator). The
outputs are the same for every check interval.
"""

from __future__ import annotations

import pytest
import torch
from sync_counter import count_syncs

from lit_llm.policy.generation import (
    DONE_CHECK_EVERY,
    generate_tokens,
    resolve_generation_config,
    rows_to_device,
)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
#: Reads made once per ``generate_tokens`` call, whatever the number of steps or rows: the vocabulary check of every
#: prompt id at once (``check_token_ids``: one ``bool``), the host copy of the padded prompts that finds identical
#: ones (``unique_rows``: ``cpu`` + ``numpy``; a no-op copy when the prompts are on the host, as here) and the rows'
#: lengths at the end (one ``tolist``).
PER_CALL = {("bool", "generation.py:check_token_ids"): 1, ("cpu", "generation.py:unique_rows"): 1,
            ("numpy", "generation.py:unique_rows"): 1, ("tolist", "generation.py:generate_tokens"): 1}


def prompts() -> list[torch.Tensor]:
    return [torch.tensor(r) for r in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [14])]


def generate(model, tokenizer, *, forwards: list | None = None, **kwargs):
    gen = {k: kwargs.pop(k) for k in ("min_new_tokens", "eos_token_id", "stop_sequences") if k in kwargs}
    config = resolve_generation_config({"max_new_tokens": STEPS, "temperature": 1.0, **gen}, model, tokenizer)
    handle = None if forwards is None else model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        with count_syncs() as counter:
            out = generate_tokens(model, prompts(), config, seeds=[1, 2, 3, 4], tokenizer=tokenizer, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    return out, counter


def same_output(a, b) -> bool:
    return (all(torch.equal(x, y) for x, y in zip(a.response_ids, b.response_ids))
            and all(torch.equal(x, y) for x, y in zip(a.response_log_probs, b.response_log_probs))
            and torch.equal(a.truncated, b.truncated))


@pytest.mark.parametrize(("every", "checks"), [(None, STEPS - 1), (1, STEPS - 1), (4, 1), (DONE_CHECK_EVERY, 0)])
def test_decode_steps_read_only_the_done_check(tiny, tokenizer, every, checks):
    """No row can stop (``min_new_tokens`` = the budget): ``STEPS`` decode steps. The done check runs after steps
    ``k-1, 2k-1, ...`` except the last (the loop ends there anyway): ``STEPS - 1`` reads every step, 1 every 4th
    (after step 3), none every 8th; nothing else is read per step and nothing is copied per row."""
    out, counter = generate(tiny, tokenizer, min_new_tokens=STEPS, done_check_every=every)
    assert [len(r) for r in out.response_ids] == [STEPS] * 4
    expected = dict(PER_CALL)
    if checks:
        expected[("bool", "generation.py:generate_tokens")] = checks
    assert dict(counter.sites) == expected


def test_check_interval_changes_the_work_after_the_last_stop_not_the_output(tiny, tokenizer):
    """Rows stopping early (eos = every id divisible by 3): the same ids, log-probs and truncation flags for every
    interval; with an interval of 4 at most 3 decode steps (forward passes) run after the last row stopped."""
    eos = list(range(0, len(tokenizer), 3))
    runs = {}
    for every in (1, 4, DONE_CHECK_EVERY):
        forwards: list[int] = []
        runs[every] = (*generate(tiny, tokenizer, eos_token_id=eos, done_check_every=every, forwards=forwards),
                       len(forwards))
    base, _, base_forwards = runs[1]
    assert max(len(r) for r in base.response_ids) < STEPS  # every row stopped early: the check had work to do
    for every, (out, _, n_forwards) in runs.items():
        assert same_output(out, base), every
        assert base_forwards <= n_forwards <= base_forwards + every - 1


def test_stop_strings_read_the_sampled_ids_once_per_step(tiny, tokenizer):
    """With stop strings the host decodes each step's ids (one ``tolist`` per step, the only read of the step) and
    knows from them when every row is done: no separate done check."""
    out, counter = generate(tiny, tokenizer, min_new_tokens=STEPS, stop_sequences=["\x00never"])
    assert [len(r) for r in out.response_ids] == [STEPS] * 4
    assert dict(counter.sites) == {**PER_CALL, ("tolist", "generation.py:generate_tokens"): STEPS + 1}


def test_rows_to_device_copies_once_per_source_device_and_dtype():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([[4, 5]]), torch.tensor([0.5]), torch.tensor([6])]
    with count_syncs() as counter:
        moved = rows_to_device(rows, "meta")  # a device other than the rows': one copy for the two dtypes each
    assert counter.count("to_device") == 2
    assert [(m.device.type, m.shape, m.dtype) for m in moved] == [("meta", r.shape, r.dtype) for r in rows]
    with count_syncs() as counter:
        same = rows_to_device(rows, "cpu")  # already there: nothing copied, the rows themselves
    assert counter.total() == 0 and all(a is b for a, b in zip(same, rows))


@pytest.mark.parametrize("every", [0, 2.0, True])
def test_done_check_every_must_be_a_positive_integer(tiny, tokenizer, every):
    config = resolve_generation_config({"max_new_tokens": 2}, tiny, tokenizer)
    with pytest.raises(ValueError, match=rf"^generate: done_check_every must be an integer >= 1 \(or None: by "
                                         rf"device\), got {every!r}\.$"):
        generate_tokens(tiny, prompts(), config, done_check_every=every)
