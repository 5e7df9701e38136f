"""Random-number-generator states in checkpoints, so that ``--ckpt_path last`` resumes with the generators where the
uninterrupted run had them.

Lightning's checkpoints hold weights, optimizer and loop state but no generator state, so anything drawn from the
global generators after a resume is drawn anew: LoRA's dropout masks (``torch``'s global CPU / CUDA generator) are
the ones this project's training uses (rollouts draw from their own per-row generators, greedy evaluation draws
nothing). :class:`~lit_llm.lightning.module.PolicyModule` saves every rank's ``torch`` (CPU and CUDA), ``random``
and NumPy states (plain lists, dicts and tensors, readable by a ``weights_only`` load) under
``checkpoint["lit_llm_rng_states"]`` (a list indexed by global rank) and restores its own rank's at
``on_train_start``, after Lightning's restore and data-loader set-up and right before the first resumed step.

CUDA: each rank saves and restores the generator of *its own* current CUDA device (``torch.cuda.current_device()``,
the device Lightning sets per rank), never the other GPUs' (which belong to other ranks). Checkpoints written before
this held every visible device's state (a list); they still load: the entry of the current device is restored when
the device count is the same, else nothing CUDA is restored and a one-line warning says so.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["collect_rng_states", "gather_rng_states", "restore_rng_states"]


def _cuda_state() -> dict[str, Any] | None:
    """``{"device": index, "state": ByteTensor}`` of the current CUDA device's generator, or ``None`` when CUDA is
    not available or not initialised (a CPU run: nothing to save, and reading it would initialise CUDA)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    device = torch.cuda.current_device()
    return {"device": device, "state": torch.cuda.get_rng_state(device)}


def collect_rng_states() -> dict[str, Any]:
    """This process's generator states.

    Returns:
        ``{"torch": ByteTensor (CPU generator), "cuda": {"device": int, "state": ByteTensor} | None (the current
        CUDA device's generator; ``None`` when CUDA is not initialised), "python": random.getstate(), "numpy":
        (name, key list, pos, has_gauss, cached_gaussian)}``: plain values, loadable with ``weights_only=True``.
    """
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (name, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian))  # plain: weights_only loads
    return {"torch": torch.get_rng_state(), "cuda": _cuda_state(), "python": random.getstate(), "numpy": numpy_state}


def gather_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`collect_rng_states`, indexed by global rank (one entry without ``torch.distributed``).

    A collective under DDP: every rank must call it (Lightning calls ``on_save_checkpoint`` on every rank)."""
    mine = collect_rng_states()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states


def _restore_cuda(saved: Any, rank: int) -> None:
    """Set the current CUDA device's generator from a rank's saved ``"cuda"`` entry; a state that does not fit (no
    CUDA now, another device count for the old list format, another state size) is skipped with one warning line."""
    if saved is None:
        return
    skipped = "rank {}: the checkpoint's CUDA generator state was not restored ({}); CUDA random draws (e.g. LoRA " \
              "dropout masks) differ from the uninterrupted run."
    if not torch.cuda.is_available():
        warnings.warn(skipped.format(rank, "saved on a CUDA device, CUDA is not available now"), stacklevel=3)
        return
    device = torch.cuda.current_device()
    if isinstance(saved, dict):
        state = saved["state"]
    else:  # checkpoints written before per-device states: one state per visible device
        count = torch.cuda.device_count()
        if len(saved) != count:
            warnings.warn(skipped.format(rank, f"saved for {len(saved)} visible CUDA devices, this process sees "
                                               f"{count}"), stacklevel=3)
            return
        state = saved[device]
    current = torch.cuda.get_rng_state(device)
    if state.shape != current.shape:
        warnings.warn(skipped.format(rank, f"state of {tuple(state.shape)} bytes, cuda:{device}'s generator has "
                                           f"{tuple(current.shape)}"), stacklevel=3)
        return
    torch.cuda.set_rng_state(state, device)


def restore_rng_states(states: list[dict[str, Any]] | None, rank: int, world_size: int) -> bool:
    """Set this process's generators to ``states[rank]`` (CPU, the current CUDA device's, ``random``, NumPy).

    Args:
        states: the checkpoint's ``lit_llm_rng_states`` (one :func:`collect_rng_states` dict per global rank), or
            ``None``. A ``"cuda"`` entry may be the per-device dict or the old list of every visible device's states.
        rank, world_size: this process's global rank and the run's number of processes.

    Returns:
        ``False`` (nothing set) when ``states`` is ``None`` (a checkpoint written before the states were saved) or was
        saved by another number of processes (no rank's stream continues then); else ``True``. A CUDA state that
        does not fit this process (see the module docstring) is skipped with a one-line ``UserWarning`` naming the
        rank and why; the other generators are restored all the same.
    """
    if not states or len(states) != world_size:
        return False
    state = states[rank]
    torch.set_rng_state(state["torch"])
    _restore_cuda(state.get("cuda"), rank)
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    return True
