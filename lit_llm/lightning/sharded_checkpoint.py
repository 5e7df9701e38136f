"""A distributed checkpoint folder, as Lightning's ``ModelParallelStrategy`` writes it (sharded training,
``save_distributed_checkpoint: true``, its default), read as one Lightning checkpoint file: ``lit-llm export``,
``evaluate`` / ``predict`` / ``chat`` of a ``.ckpt`` folder (:func:`~lit_llm.lightning.export.load_checkpoint_module`).

The folder holds ``meta.pt`` (everything but the tensors: hyper-parameters, loops, callbacks, ``global_step``),
``.metadata`` and one ``__<rank>_0.distcp`` file per rank (``torch.distributed.checkpoint``: the ``state_dict`` and
``optimizer_<i>`` entries, sharded). Lightning's own ``python -m lightning.pytorch.utilities.consolidate_checkpoint``
expects ``FSDPStrategy``'s ``model`` entry and fails on ``ModelParallelStrategy``'s ``state_dict``; this reads both.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["check_strategy_reads_it", "checkpoint_file", "consolidate_checkpoint", "is_distributed_checkpoint"]


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a distributed checkpoint folder (``meta.pt`` and ``torch.distributed.checkpoint``'s
    ``.metadata`` in it)."""
    p = Path(path)
    return p.is_dir() and (p / "meta.pt").is_file() and (p / ".metadata").is_file()


def check_strategy_reads_it(path: str | os.PathLike, *, sharded: bool, subcommand: str) -> None:
    """Refuse a distributed checkpoint folder given as ``--ckpt_path`` to ``lit-llm fit`` / ``validate`` without
    ``--trainer.strategy ModelParallelStrategy``: only that strategy reads it (another one opens the folder as a file
    and fails with ``IsADirectoryError``). ``export``, ``chat``, ``evaluate`` and ``predict`` read it through
    :func:`checkpoint_file`. No-op for a file, or when ``sharded``.

    Args:
        path: the ``--ckpt_path`` value (``last`` already resolved).
        sharded: the run's ``trainer.strategy`` is ``ModelParallelStrategy``.
        subcommand: ``fit`` or ``validate``, named in the message.

    Raises:
        ValueError: one line naming the folder, the strategy options to give (its world size: one ``.distcp`` file
            per process) and ``lit-llm export`` (weights only: a new run, not a resume).
    """
    if sharded or not is_distributed_checkpoint(path):
        return
    n = len(list(Path(path).glob("*.distcp")))
    then = "--model.init_args.model DIR (its weights in a new run, not a resume)" if subcommand == "fit" else (
        "--model.init_args.model DIR")
    raise ValueError(f"--ckpt_path {path}: a sharded checkpoint (a distributed checkpoint folder written by "
                     f"{n} process{'es' if n != 1 else ''} under --trainer.strategy ModelParallelStrategy), which "
                     f"{subcommand} reads only under that strategy. Fix: {subcommand} with the options it was written "
                     f"with (--trainer.strategy ModelParallelStrategy --trainer.strategy.data_parallel_size {n} "
                     f"--trainer.strategy.tensor_parallel_size 1 --trainer.devices {n}), or `lit-llm export "
                     f"--ckpt_path {path} --out DIR` first and {subcommand} {then}.")


def consolidate_checkpoint(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the distributed checkpoint ``folder`` as one Lightning checkpoint file ``out``: ``meta.pt``'s entries,
    ``state_dict`` (whole, plain CPU tensors, the same keys as a single-device run's) and ``optimizer_states`` (the
    ``optimizer_<i>`` entries in order, keyed by parameter name as ``torch.distributed.checkpoint.state_dict`` writes
    them: for inspection, not to resume a single-device run). One process, no process group; the whole model and
    optimizer state are held in host memory while writing.

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: ``folder`` is not a distributed checkpoint folder (:func:`is_distributed_checkpoint`), or it
            holds neither a ``state_dict`` nor a ``model`` entry.
    """
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder, out = Path(folder), Path(out)
    if not is_distributed_checkpoint(folder):
        raise ValueError(f"{folder}: not a distributed checkpoint folder (no meta.pt and .metadata in it).")
    with tempfile.TemporaryDirectory(prefix=".consolidating-", dir=out.parent) as tmp:
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(folder), str(flat))
        state = torch.load(flat, map_location="cpu", weights_only=False)
    checkpoint = torch.load(folder / "meta.pt", map_location="cpu", weights_only=False)
    weights = state.pop("state_dict", None)
    if weights is None:
        weights = state.pop("model", None)  # FSDPStrategy's name
    if weights is None:
        raise ValueError(f"{folder}: the distributed checkpoint holds no 'state_dict' (nor 'model') entry, only "
                         f"{sorted(state)}; it was not written by lit-llm fit.")
    checkpoint["state_dict"] = weights
    names = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.rpartition("_")[2]))
    checkpoint["optimizer_states"] = [state[k] for k in names]
    torch.save(checkpoint, out)
    return out


@contextmanager
def checkpoint_file(path: str | os.PathLike) -> Iterator[Path]:
    """``path`` itself, or for a distributed checkpoint folder (:func:`is_distributed_checkpoint`) its
    :func:`consolidate_checkpoint` in a temporary folder (the system's temporary directory; deleted on exit)."""
    path = Path(path)
    if not is_distributed_checkpoint(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="lit-llm-consolidated-") as tmp:
        yield consolidate_checkpoint(path, Path(tmp) / f"{path.name}.ckpt")
