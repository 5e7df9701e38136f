"""Generator states in checkpoints (:mod:`lit_llm.lightning.rng_state`): a round trip continues every stream."""

from __future__ import annotations

import random

import numpy as np
import torch

from lit_llm.lightning.rng_state import collect_rng_states, gather_rng_states, restore_rng_states


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), np.random.rand()


def test_restore_continues_torch_python_and_numpy_streams():
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    _draws()
    states = gather_rng_states()  # one process: [this process's states]
    assert len(states) == 1
    expected = _draws()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    assert restore_rng_states(states, rank=0, world_size=1) is True
    assert _draws() == expected


def test_restore_refuses_states_of_another_world_size_and_old_checkpoints():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    two_ranks = [collect_rng_states(), collect_rng_states()]
    torch.manual_seed(4)
    after = torch.get_rng_state()
    assert restore_rng_states(two_ranks, rank=0, world_size=1) is False  # saved by 2 processes, resumed by 1
    assert restore_rng_states(None, rank=0, world_size=1) is False  # a checkpoint without the states
    assert torch.equal(torch.get_rng_state(), after) and not torch.equal(before, after)


def test_states_survive_a_weights_only_load(tmp_path):
    path = tmp_path / "states.pt"
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    torch.save({"s": gather_rng_states()}, path)
    expected = _draws()
    loaded = torch.load(path, weights_only=True)["s"]  # Lightning's resume loads checkpoints weights_only
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    assert restore_rng_states(loaded, rank=0, world_size=1)
    assert _draws() == expected
