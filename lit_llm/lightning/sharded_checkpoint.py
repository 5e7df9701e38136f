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
from typing import Any

from lit_llm.cli_errors import CLIConfigError

__all__ = ["DamagedCheckpointError", "check_distributed_checkpoint", "check_strategy_reads_it", "checkpoint_file",
           "checkpoint_meta", "consolidate_checkpoint", "is_distributed_checkpoint",
           "looks_like_distributed_checkpoint"]

#: The files of a distributed checkpoint folder besides the ``.distcp`` shards (Lightning's ``_METADATA_FILENAME``
#: and ``torch.distributed.checkpoint``'s index).
META, INDEX = "meta.pt", ".metadata"


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a distributed checkpoint folder (``meta.pt`` and ``torch.distributed.checkpoint``'s
    ``.metadata`` in it)."""
    p = Path(path)
    return p.is_dir() and (p / META).is_file() and (p / INDEX).is_file()


class DamagedCheckpointError(CLIConfigError):
    """A damaged distributed checkpoint folder (:func:`check_distributed_checkpoint`; one line, a ``ValueError``)."""


def looks_like_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` is meant as a distributed checkpoint, whole or damaged: it holds ``meta.pt``,
    ``.metadata`` or a ``.distcp`` file, or its name ends in ``.ckpt`` (``last.ckpt/``, an emptied or unfinished
    save) and it holds no ``.ckpt`` file nor a ``checkpoints/`` (a run folder's) or ``checkpoint/`` (DeepSpeed's)
    sub-folder."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / META).exists() or (p / INDEX).exists() or any(p.glob("*.distcp")):
        return True
    return p.name.endswith(".ckpt") and not any(p.glob("*.ckpt")) and not any(
        (p / sub).is_dir() for sub in ("checkpoints", "checkpoint"))


def checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's ``meta.pt``: the checkpoint without its tensors (``hyper_parameters``,
    ``datamodule_hyper_parameters``, ``global_step``, loops, callbacks); ``torch.load(mmap=True)`` of its zip
    archive, no shard read."""
    import zipfile

    import torch

    meta = Path(path) / META
    return torch.load(meta, map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(meta))


def _another_checkpoint(folder: Path, option: str) -> str:
    """The fix's example: the newest other checkpoint (file or folder ending in ``.ckpt``, not hidden: a save's
    temporary) beside ``folder``."""
    others = sorted((f for f in folder.parent.glob("*.ckpt") if f.name != folder.name and not f.name.startswith(".")),
                    key=lambda f: -f.stat().st_mtime) if folder.parent.is_dir() else []
    return f" (e.g. {option} {others[0]})" if others else " (none is beside it: start a new run)"


def check_distributed_checkpoint(path: str | os.PathLike, *,
                                 option: str = "--ckpt_path") -> tuple[dict[str, Any], bool]:
    """Check a distributed checkpoint folder cheaply before anything reads its shards, so that a damaged one is one
    line naming the file: ``meta.pt`` and ``.metadata`` present, ``.metadata`` readable, every ``.distcp`` file it
    names present and at least as long as the bytes it indexes in it (sizes only: no shard is read), ``meta.pt``
    loadable (``torch.load(mmap=True)``) as a dict.

    Args:
        path: the folder (named in the message as given).
        option: the option named in the message.

    Returns:
        ``(meta, optimizer_saved)``: ``meta.pt``'s contents (:func:`checkpoint_meta`) and whether ``.metadata``
        indexes optimizer state (``optimizer_<i>`` entries; none: written with ``checkpoint.save_weights_only``).

    Raises:
        DamagedCheckpointError: one line, ``"<option> <path>: a damaged sharded checkpoint folder: <file> is
            missing | cannot be read | is truncated (...). Fix: give another checkpoint (e.g. <option> <the newest
            other .ckpt beside it>) ..."``.
    """
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(path).expanduser()

    def damaged(what: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(
            f"{option} {path}: a damaged sharded checkpoint folder: {what}. Fix: give another checkpoint"
            f"{_another_checkpoint(folder, option)}; this folder cannot be read (a save that did not finish, "
            f"or a copy that lost files).")

    shards = sorted(f.name for f in folder.glob("*.distcp"))
    if not (folder / META).exists() and not (folder / INDEX).exists() and not shards:
        raise damaged("it holds none of meta.pt, .metadata and the __<rank>_0.distcp shards"
                      + (" (it is empty)" if not any(folder.iterdir()) else ""))
    if not (folder / INDEX).is_file():
        raise damaged(".metadata is missing (torch.distributed.checkpoint's index of the .distcp shards)")
    try:
        index = FileSystemReader(str(folder)).read_metadata()
        needed: dict[str, int] = {}
        for info in index.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as e:  # noqa: BLE001  (any unpickling failure is a damaged index)
        raise damaged(f".metadata cannot be read ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
    for name, size in sorted(needed.items()):
        shard = folder / name
        if not shard.is_file():
            raise damaged(f"{name} is missing (.metadata names {len(needed)} shard file"
                          f"{'s' if len(needed) != 1 else ''}: {', '.join(sorted(needed))})")
        if shard.stat().st_size < size:
            raise damaged(f"{name} is truncated ({shard.stat().st_size} bytes; .metadata indexes {size})")
    if not (folder / META).is_file():
        raise damaged("meta.pt is missing (the step, loops and hyper-parameters, written by rank 0 after the shards)")
    try:
        meta = checkpoint_meta(folder)
    except Exception as e:  # noqa: BLE001
        raise damaged(f"meta.pt cannot be read ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(meta, dict):
        raise damaged(f"meta.pt holds a {type(meta).__name__}, not a checkpoint's dict")
    return meta, any(k.startswith("optimizer_") for k in index.state_dict_metadata)


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
        DamagedCheckpointError: a damaged folder (:func:`check_distributed_checkpoint`).
        ValueError: one line naming the folder, the strategy options to give (the world size that wrote it: one
            ``.distcp`` file per process; another one also reads it: ``torch.distributed.checkpoint`` reshards on
            load) and ``lit-llm export`` (weights only: a new run, not a resume).
    """
    if sharded or not looks_like_distributed_checkpoint(path):
        return
    check_distributed_checkpoint(path)  # a damaged folder: that line first (the strategy would not read it either)
    n = len(list(Path(path).glob("*.distcp")))
    then = "--model.init_args.model DIR (its weights in a new run, not a resume)" if subcommand == "fit" else (
        "--model.init_args.model DIR")
    other = ("another count also resumes, but with other batches per step and the generator states not restored"
             if subcommand == "fit" else "another count reads it too")
    raise ValueError(f"--ckpt_path {path}: a sharded checkpoint (a distributed checkpoint folder written by "
                     f"{n} process{'es' if n != 1 else ''} under --trainer.strategy ModelParallelStrategy), which "
                     f"{subcommand} reads only under that strategy. Fix: {subcommand} under it (--trainer.strategy "
                     f"ModelParallelStrategy --trainer.strategy.data_parallel_size {n} "
                     f"--trainer.strategy.tensor_parallel_size 1 --trainer.devices {n}: the processes that wrote it; "
                     f"{other}), or `lit-llm export --ckpt_path {path} --out DIR` first and {subcommand} {then}.")


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
