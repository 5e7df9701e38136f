"""Sharded checkpoints replaced whole: a distributed checkpoint folder is written beside its place and swapped in.

Lightning's ``ModelParallelStrategy`` writes a checkpoint as a folder (``meta.pt``, ``.metadata``, one
``__<rank>_0.distcp`` per rank) and rewrites an existing one in place, so a process killed while ``last.ckpt/`` is being
rewritten leaves the old ``.metadata`` next to empty ``.distcp`` files, and ``--ckpt_path last`` fails. Here
(:func:`save_replacing`, called by :class:`~lit_llm.lightning.callbacks.StepCheckpoint` for every save and removal
under that strategy):

1. rank 0 removes a stale staging folder ``.<name>.saving`` (a killed save's), then every rank writes the new
   checkpoint there (the same file system, a sibling of ``<name>``), and all wait for each other (a barrier);
2. rank 0 syncs it to disk and swaps it in: one atomic exchange of the two names where the system has it (Linux
   ``renameat2(RENAME_EXCHANGE)``), the old one then removed; elsewhere two renames, ``<name>`` -> ``.<name>.replaced``
   then ``.<name>.saving`` -> ``<name>``, the old one removed after; then it removes the leftovers of killed saves
   in the folder (every ``.*.saving``, and each ``.<X>.replaced`` whose ``<X>`` is in place);
3. every rank waits for the swap (a collective that also carries rank 0's failure to every rank).

A kill at any point leaves ``<name>`` complete (the old or the new checkpoint), except between the two renames of the
fallback: then ``.<name>.replaced`` holds the previous checkpoint, complete, and ``--ckpt_path last`` resumes from it
with a one-line warning (:func:`replaced_checkpoints`). Neither hidden name is ever picked as ``last``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["remove_checkpoint", "remove_leftovers", "replaced_checkpoints", "replaced_path", "save_replacing",
           "staging_path", "swap_in", "swaps", "warn_resuming_from_replaced"]

_STAGING, _REPLACED = ".saving", ".replaced"
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def staging_path(target: str | os.PathLike) -> Path:
    """``<folder>/.<name>.saving``: where the checkpoint ``target`` is written before it is swapped in."""
    target = Path(target)
    return target.with_name(f".{target.name}{_STAGING}")


def replaced_path(target: str | os.PathLike) -> Path:
    """``<folder>/.<name>.replaced``: where the previous ``target`` waits between the two renames of a swap without
    an atomic exchange."""
    target = Path(target)
    return target.with_name(f".{target.name}{_REPLACED}")


def swaps(strategy: Any, filepath: str | os.PathLike) -> bool:
    """Whether a checkpoint at ``filepath`` is saved through :func:`save_replacing`: under Lightning's
    ``ModelParallelStrategy`` (whose distributed checkpoints are folders), on a local file system (renames)."""
    from fsspec.utils import get_protocol
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy) and get_protocol(str(filepath)) == "file"


def save_replacing(strategy: Any, filepath: str | os.PathLike, save: Callable[[str], None]) -> Path:
    """Write a checkpoint with ``save(path)`` (``trainer.save_checkpoint``, a collective) into
    :func:`staging_path` and swap it in at ``filepath`` (see the module docstring). Call on every rank.

    Args:
        strategy: the trainer's strategy (``is_global_zero``, ``barrier``, ``broadcast``, ``reduce_boolean_decision``).
        filepath: the checkpoint's place (rank 0's value is used on every rank); an existing checkpoint (folder or
            file) there is replaced only once the new one is complete.
        save: writes the whole checkpoint at the path it is given, on every rank, and returns once every rank has
            written (Lightning's ``trainer.save_checkpoint`` ends with a barrier).

    Returns:
        ``filepath`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: rank 0 could not swap the checkpoint in (its own error on rank 0; one line naming the paths on
            the other ranks); ``filepath`` then holds the previous or the new checkpoint, complete, or where it is
            missing :func:`replaced_path` holds the previous one.
    """
    target = Path(strategy.broadcast(str(filepath)))
    staging = staging_path(target)
    if strategy.is_global_zero:
        _remove(staging)  # a killed save's partial write
    strategy.barrier("lit_llm.sharded_save.prepare")
    save(str(staging))
    error: OSError | None = None
    if strategy.is_global_zero:
        try:
            swap_in(staging, target)
        except OSError as e:
            error = e
    if not strategy.reduce_boolean_decision(error is None, all=True):
        if error is not None:
            raise error
        raise OSError(f"{target}: global rank 0 could not swap the new checkpoint in from {staging} (its error is "
                      f"in rank 0's output); the last complete checkpoint is {target}, or {replaced_path(target)} "
                      f"where that is missing.")
    return target


def swap_in(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Rank 0's part of :func:`save_replacing`: sync the complete checkpoint ``staging`` to disk, put it at
    ``target`` (atomically where the system exchanges two names, else by two renames) and remove the previous one
    and the leftovers of killed saves in ``target``'s folder (:func:`remove_leftovers`).

    Raises:
        FileNotFoundError: ``staging`` does not exist.
        OSError: a rename failed (``target`` then still holds the previous checkpoint, or ``.<name>.replaced`` does).
    """
    staging, target = Path(staging), Path(target)
    if not os.path.lexists(staging):
        raise FileNotFoundError(f"{staging}: the checkpoint to swap in at {target} was not written.")
    _fsync_tree(staging)
    if os.path.lexists(target) and _exchange(staging, target):
        _remove(staging)  # the previous checkpoint, now under the staging name
    else:
        replaced = replaced_path(target)
        if os.path.lexists(target):
            _remove(replaced)  # a killed swap's, stale: target is complete
            os.rename(target, replaced)
        os.rename(staging, target)
        _remove(replaced)
    _fsync(target.parent)
    remove_leftovers(target.parent, target.suffix)


def remove_checkpoint(filepath: str | os.PathLike) -> None:
    """Remove a checkpoint (folder or file) so that a kill never leaves a part of it under its name: renamed to its
    :func:`staging_path` first (swept by the next save if the removal is killed). Rank 0 only; no-op when absent."""
    filepath = Path(filepath)
    if not os.path.lexists(filepath):
        return
    staging = staging_path(filepath)
    _remove(staging)
    os.rename(filepath, staging)
    _remove(staging)


def remove_leftovers(folder: str | os.PathLike, suffix: str = ".ckpt") -> list[Path]:
    """Remove what killed saves left in ``folder``: every ``.<X>.saving`` (a partial write, or the previous
    checkpoint after an exchange) and each ``.<X>.replaced`` whose ``<X>`` exists (``<X>`` ending in ``suffix``).
    A ``.<X>.replaced`` without its ``<X>`` is the only complete copy and is kept. Returns what was removed."""
    removed = []
    for left, name, kind in _leftovers(folder, suffix):
        if kind == _STAGING or os.path.lexists(Path(folder) / name):
            _remove(left)
            removed.append(left)
    return removed


def replaced_checkpoints(folder: str | os.PathLike, is_name: Callable[[str], Any]) -> list[str]:
    """The ``.<X>.replaced`` checkpoints in ``folder`` whose ``<X>`` is missing and passes ``is_name`` (e.g.
    ``last.ckpt``): a swap killed between its two renames left the previous, complete checkpoint there.
    ``--ckpt_path last`` considers them beside ``<X>`` (``lit_llm.lightning.cli.last_checkpoint``)."""
    return [str(left) for left, name, kind in _leftovers(folder, "")
            if kind == _REPLACED and is_name(name) and not os.path.lexists(Path(folder) / name)]


def warn_resuming_from_replaced(path: str) -> str:
    """``path``, with one warning line when ``--ckpt_path last`` picked a :func:`replaced_checkpoints` entry."""
    match = re.fullmatch(rf"\.(.+){re.escape(_REPLACED)}", os.path.basename(path))
    if match:
        missing = os.path.join(os.path.dirname(path), match.group(1))
        rank_zero_warn(f"--ckpt_path last: {missing} is missing (a process was killed while swapping a new checkpoint "
                       f"in); resuming from {path}, the complete checkpoint it replaced. The run's next save of "
                       f"{match.group(1)} removes it.")
    return path


def _leftovers(folder: str | os.PathLike, suffix: str) -> list[tuple[Path, str, str]]:
    """``(path, <X>, kind)`` of each ``.<X>.saving`` / ``.<X>.replaced`` in ``folder`` with ``<X>`` ending in
    ``suffix``."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    pattern = re.compile(rf"\.(.+{re.escape(suffix)})({re.escape(_STAGING)}|{re.escape(_REPLACED)})")
    return [(folder / n, m.group(1), m.group(2)) for n in sorted(os.listdir(folder)) if (m := pattern.fullmatch(n))]


def _remove(path: Path) -> None:
    """Remove a folder, file or link (a link itself, never what it points to); no-op when absent."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing names atomically (Linux ``renameat2(..., RENAME_EXCHANGE)``). ``False`` where the system,
    its C library or the file system cannot (then nothing was changed).

    Raises:
        OSError: the exchange was possible but failed (permissions, ...).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc < 2.28, musl < 1.2.6)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # not on this kernel / file system
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _fsync_tree(path: Path) -> None:
    """Sync a file, or a folder's files and the folder itself, to disk (``torch.distributed.checkpoint`` syncs its own
    files; Lightning's ``meta.pt`` is not)."""
    if path.is_dir() and not path.is_symlink():
        for child in path.iterdir():
            if child.is_file():
                _fsync(child)
    _fsync(path)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot sync a folder
        pass
    finally:
        os.close(fd)
