"""Random-number-generator states in checkpoints, so that ``--ckpt_path last`` resumes with the generators where the
uninterrupted run had them.

Lightning's checkpoints hold weights, optimizer and loop state but no generator state, so anything drawn from the
global generators after a resume is drawn anew: LoRA's dropout masks (``torch``'s global CPU / CUDA generator) are
the ones this project's training uses (rollouts draw from their own per-row generators, greedy evaluation draws
nothing). :class:`~lit_llm.lightning.module.PolicyModule` saves every rank's ``torch`` (CPU and CUDA), ``random``
and NumPy states (plain lists and tensors, readable by a ``weights_only`` load) under
``checkpoint["lit_llm_rng_states"]`` (a list indexed by global rank) and restores its own rank's at
``on_train_start``, after Lightning's restore and data-loader set-up and right before the first resumed step.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["collect_rng_states", "gather_rng_states", "restore_rng_states"]


def collect_rng_states() -> dict[str, Any]:
    """This process's generator states: ``torch`` (CPU ``ByteTensor``), ``cuda`` (one ``ByteTensor`` per visible
    device, or ``None`` when CUDA is not initialised), ``python`` (:func:`random.getstate`) and ``numpy``
    (:func:`numpy.random.get_state`)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (name, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian))  # plain: weights_only loads
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(), "numpy": numpy_state}


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`collect_rng_states`, indexed by global rank (one entry without ``torch.distributed``).

    A collective under DDP: every rank must call it (Lightning calls ``on_save_checkpoint`` on every rank)."""
    mine = collect_rng_states()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def restore_rng_states(states: list[dict[str, Any]] | None, rank: int, world_size: int) -> bool:
    """Set this process's generators to ``states[rank]``; ``False`` (nothing set) when ``states`` is ``None`` (a
    checkpoint written before the states were saved) or was saved by another number of processes (no rank's stream
    continues then)."""
    if not states or len(states) != world_size:
        return False
    state = states[rank]
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    return True
