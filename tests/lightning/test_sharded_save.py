"""Sharded checkpoint folders replaced whole (``lit_llm.lightning.sharded_save``, ``StepCheckpoint``): a save killed at
any point leaves a complete checkpoint that ``--ckpt_path last`` finds, and a normal save replaces the previous one
with nothing left behind. Real ``torch.distributed.checkpoint`` folders on a one-process gloo group, read back with
``consolidate_checkpoint``; a fake strategy records the collectives; a kill is an exception raised before the N-th
file-system change, for every N."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

from lit_llm.lightning import sharded_save
from lit_llm.lightning.callbacks import StepCheckpoint
from lit_llm.lightning.cli import last_checkpoint
from lit_llm.lightning.graceful_stop import GracefulStop, stop_exit_code
from lit_llm.lightning.sharded_checkpoint import consolidate_checkpoint
from lit_llm.lightning.sharded_save import (
    remove_checkpoint,
    remove_leftovers,
    replaced_path,
    save_replacing,
    staging_path,
    swaps,
)

PREPARE = "lit_llm.sharded_save.prepare"


class Killed(BaseException):
    """A simulated ``SIGKILL``: nothing after it runs (not an ``OSError``, so nothing catches it)."""


class FakeStrategy:
    """Rank 0 of one process: records the collectives :func:`save_replacing` makes."""

    is_global_zero = True

    def __init__(self) -> None:
        self.calls: list = []

    def broadcast(self, obj):
        self.calls.append("broadcast")
        return obj

    def barrier(self, name=None):
        self.calls.append(name)

    def reduce_boolean_decision(self, decision, all=True):
        self.calls.append(("decision", decision, all))
        return decision


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def writer(version: int):
    """``save(path)`` as ``ModelParallelStrategy`` writes a checkpoint folder: the shards (``.metadata``,
    ``__0_0.distcp``), then ``meta.pt``; weights all ``version``."""
    def save(path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        dcp.save({"state_dict": {"w": torch.full((3,), float(version))}}, checkpoint_id=path)
        torch.save({"global_step": version}, Path(path) / "meta.pt")
    return save


def version_of(path: str | Path, tmp_path: Path) -> int:
    """The version a checkpoint folder holds, read as ``lit-llm export`` reads it (fails on a partial folder)."""
    out = consolidate_checkpoint(path, tmp_path / "read.ckpt")
    state = torch.load(out, weights_only=False)
    out.unlink()
    assert torch.equal(state["state_dict"]["w"], torch.full((3,), float(state["global_step"])))
    return state["global_step"]


def test_a_save_writes_beside_and_replaces_the_previous_folder(group, tmp_path):
    ckpts = tmp_path / "checkpoints"
    target = ckpts / "last.ckpt"
    strategy = FakeStrategy()
    assert save_replacing(strategy, str(target), writer(1)) == target
    assert strategy.calls == ["broadcast", PREPARE, ("decision", True, True)]
    assert version_of(target, tmp_path) == 1
    seen = []
    save_replacing(FakeStrategy(), target, lambda p: (seen.append(sorted(os.listdir(ckpts))), writer(2)(p)))
    assert seen == [["last.ckpt"]]  # written beside last.ckpt, which stays complete meanwhile
    assert version_of(target, tmp_path) == 2
    assert sorted(os.listdir(ckpts)) == ["last.ckpt"]  # the previous one removed, no staging folder left
    assert sorted(p.name for p in target.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_a_save_killed_at_any_point_leaves_a_complete_last_checkpoint(group, tmp_path, monkeypatch, exchange):
    """Every file-system change of a save (the writer, each rename, removal, exchange) in turn is where the process
    dies: ``--ckpt_path last`` then finds version 1 or 2, complete; the next save cleans up and replaces it."""
    ckpts = tmp_path / "checkpoints"
    target = ckpts / "last.ckpt"
    counter = {"left": None}

    def die_at_zero():
        if counter["left"] is not None:
            if counter["left"] == 0:
                raise Killed
            counter["left"] -= 1

    real_remove, real_exchange, real_rename = sharded_save._remove, sharded_save._exchange, os.rename

    def remove(path):
        die_at_zero()
        real_remove(path)

    def exchange_(a, b):
        die_at_zero()
        return real_exchange(a, b) if exchange else False

    def rename(src, dst, **kw):
        if Path(src).parent == ckpts:  # ours, not torch's .metadata.tmp inside the folder
            die_at_zero()
        return real_rename(src, dst, **kw)

    def dying_writer(version):
        def save(path):
            Path(path).mkdir(parents=True)
            (Path(path) / "__0_0.distcp").write_bytes(b"")  # the state of a killed write: empty shards
            die_at_zero()
            writer(version)(path)
        return save

    monkeypatch.setattr(sharded_save, "_remove", remove)
    monkeypatch.setattr(sharded_save, "_exchange", exchange_)
    monkeypatch.setattr(os, "rename", rename)
    outcomes = []
    for n in range(20):
        if ckpts.exists():
            real_remove(ckpts)
        save_replacing(FakeStrategy(), target, writer(1))
        counter["left"] = n
        try:
            save_replacing(FakeStrategy(), target, dying_writer(2))
            outcomes.append("finished")
        except Killed:
            pass
        counter["left"] = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = last_checkpoint(ckpts)
        assert found is not None, (n, os.listdir(ckpts))
        assert len(caught) == (Path(found).name == ".last.ckpt.replaced")  # resuming from it is said in one line
        outcomes.append((Path(found).name, version_of(found, tmp_path)))
        if outcomes[-2:-1] == ["finished"]:
            break
        save_replacing(FakeStrategy(), target, writer(3))  # the next save cleans up after the killed one
        assert sorted(os.listdir(ckpts)) == ["last.ckpt"] and version_of(target, tmp_path) == 3, n
    old, new, aside = ("last.ckpt", 1), ("last.ckpt", 2), (".last.ckpt.replaced", 1)
    if exchange:  # killed before: the stale staging folder's removal, the writer's end, the exchange, the removal of
        # the previous folder (now under the staging name); then a whole save
        assert outcomes == [old, old, old, new, "finished", new]
    else:  # ... the writer's end, the exchange (not possible here), the stale .replaced's removal, the first rename,
        # the second one (only .last.ckpt.replaced is complete: resumed from), the removal of the previous folder
        assert outcomes == [old, old, old, old, old, aside, new, "finished", new]


def test_leftovers_of_killed_saves_are_swept_and_never_last(group, tmp_path):
    ckpts = tmp_path / "checkpoints"
    save_replacing(FakeStrategy(), ckpts / "last.ckpt", writer(1))
    for name in (".last.ckpt.saving", ".step=2.ckpt.saving", ".last.ckpt.replaced", ".step=4.ckpt.replaced"):
        writer(9)(str(ckpts / name))  # complete-looking folders under the hidden names
    (ckpts / "notes.saving").write_text("not ours")
    assert last_checkpoint(ckpts) == str(ckpts / "last.ckpt")  # never a hidden one while last.ckpt is in place
    save_replacing(FakeStrategy(), ckpts / "last.ckpt", writer(2))
    # .step=4.ckpt.replaced is the only copy of step=4.ckpt (its swap was killed between the renames): kept
    assert sorted(os.listdir(ckpts)) == [".step=4.ckpt.replaced", "last.ckpt", "notes.saving"]
    assert version_of(ckpts / "last.ckpt", tmp_path) == 2
    writer(4)(str(ckpts / "step=4.ckpt"))
    assert remove_leftovers(ckpts) == [ckpts / ".step=4.ckpt.replaced"]


def test_last_resumes_from_the_replaced_folder_when_a_swap_died_between_its_renames(group, tmp_path):
    ckpts = tmp_path / "checkpoints"
    save_replacing(FakeStrategy(), ckpts / "last.ckpt", writer(1))
    os.rename(ckpts / "last.ckpt", replaced_path(ckpts / "last.ckpt"))  # the first rename done, the second not
    writer(2)(str(staging_path(ckpts / "last.ckpt")))
    with pytest.warns(UserWarning) as record:
        found = last_checkpoint(ckpts)
    assert found == str(ckpts / ".last.ckpt.replaced") and version_of(found, tmp_path) == 1
    assert [str(w.message) for w in record] == [
        f"--ckpt_path last: {ckpts / 'last.ckpt'} is missing (a process was killed while swapping a new checkpoint "
        f"in); resuming from {found}, the complete checkpoint it replaced. The run's next save of last.ckpt removes "
        f"it."]
    save_replacing(FakeStrategy(), ckpts / "last.ckpt", writer(3))
    assert sorted(os.listdir(ckpts)) == ["last.ckpt"] and version_of(ckpts / "last.ckpt", tmp_path) == 3


def test_a_failed_swap_is_an_error_on_every_rank_and_leaves_the_previous_folder(group, tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    save_replacing(FakeStrategy(), ckpts / "last.ckpt", writer(1))
    monkeypatch.setattr(sharded_save, "_exchange", lambda a, b: (_ for _ in ()).throw(PermissionError(13, "denied")))
    strategy = FakeStrategy()
    with pytest.raises(PermissionError):
        save_replacing(strategy, ckpts / "last.ckpt", writer(2))
    assert strategy.calls[-1] == ("decision", False, True)  # the other ranks learn of it (and raise) instead of waiting
    assert version_of(ckpts / "last.ckpt", tmp_path) == 1
    other = FakeStrategy()  # rank 1: its decision is True, rank 0's False
    other.is_global_zero, other.reduce_boolean_decision = False, lambda decision, all=True: False
    with pytest.raises(OSError) as e:
        save_replacing(other, ckpts / "last.ckpt", lambda path: None)
    assert str(e.value) == (f"{ckpts / 'last.ckpt'}: global rank 0 could not swap the new checkpoint in from "
                            f"{ckpts / '.last.ckpt.saving'} (its error is in rank 0's output); the last complete "
                            f"checkpoint is {ckpts / 'last.ckpt'}, or {ckpts / '.last.ckpt.replaced'} where that is "
                            f"missing.")


def test_remove_checkpoint_renames_away_first(tmp_path, monkeypatch):
    folder = tmp_path / "step=2.ckpt"
    folder.mkdir()
    (folder / "meta.pt").write_bytes(b"x")

    def killed(path):
        raise Killed

    monkeypatch.setattr(sharded_save, "_remove", lambda p: None if not p.exists() else killed(p))
    with pytest.raises(Killed):
        remove_checkpoint(folder)
    assert sorted(os.listdir(tmp_path)) == [".step=2.ckpt.saving"]  # never a part of it under its own name
    monkeypatch.undo()
    remove_checkpoint(tmp_path / "step=2.ckpt")  # absent: nothing to do
    assert remove_leftovers(tmp_path) == [tmp_path / ".step=2.ckpt.saving"] and os.listdir(tmp_path) == []


def test_swaps_under_model_parallel_on_local_paths_only(tmp_path):
    assert swaps(ModelParallelStrategy(), tmp_path / "last.ckpt")
    assert not swaps(ModelParallelStrategy(), "s3://bucket/last.ckpt")
    assert not swaps(DDPStrategy(), tmp_path / "last.ckpt")


class _Sharded(LightningModule):
    """One FSDP2-sharded ``Linear`` trained with SGD on random rows; ``sigterm_at``: the step whose training step
    sends this process ``SIGTERM``."""

    def __init__(self, sigterm_at: int | None = None) -> None:
        super().__init__()
        self.layer, self.sigterm_at = torch.nn.Linear(4, 4), sigterm_at

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 == self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def _fit(root: Path, max_steps: int, ckpt_path: str | None = None, sigterm_at: int | None = None) -> Trainer:
    """``fit`` under a one-process ``ModelParallelStrategy`` with a ``StepCheckpoint`` saving every step (top 1 and
    ``last.ckpt``) and the modules' ``GracefulStop``."""
    checkpoint = StepCheckpoint(dirpath=root / "checkpoints", filename="{step}", every_n_train_steps=1, save_last=True)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(1, 1), max_steps=max_steps,
                      callbacks=[checkpoint, GracefulStop()], logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=root)
    try:
        trainer.fit(_Sharded(sigterm_at), ckpt_path=ckpt_path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return trainer


@pytest.fixture
def swapped(monkeypatch):
    """The ``(target name, global_step in its meta.pt)`` of each swap :class:`StepCheckpoint` makes; ``kill_at``:
    the index of the swap that raises :class:`Killed` instead (the staging folder then written, not swapped)."""
    record, real = SimpleNamespace(calls=[], kill_at=None), sharded_save.swap_in

    def swap_in(staging, target):
        record.calls.append((Path(target).name, _step_of(Path(staging))))
        if len(record.calls) - 1 == record.kill_at:
            raise Killed
        real(staging, target)

    monkeypatch.setattr(sharded_save, "swap_in", swap_in)
    return record


def _step_of(folder: Path) -> int:
    return torch.load(folder / "meta.pt", weights_only=False)["global_step"]


def test_step_checkpoint_swaps_every_save_of_a_model_parallel_fit(tmp_path, swapped):
    ckpts = tmp_path / "checkpoints"
    trainer = _fit(tmp_path, 3)
    assert swapped.calls == [("step=1.ckpt", 1), ("last.ckpt", 1), ("step=2.ckpt", 2), ("last.ckpt", 2),
                       ("step=3.ckpt", 3), ("last.ckpt", 3)]
    # the top-1 step=N.ckpt folders before the last one removed (renamed away first), no staging folder left
    assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=3.ckpt"]
    assert trainer.checkpoint_callback.last_model_path == str(ckpts / "last.ckpt")
    for name in ("last.ckpt", "step=3.ckpt"):
        assert sorted(p.name for p in (ckpts / name).iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
        assert _step_of(ckpts / name) == 3


def test_a_fit_killed_while_swapping_last_in_resumes_from_the_previous_one(tmp_path, swapped):
    ckpts = tmp_path / "checkpoints"
    swapped.kill_at = 5  # step 3's last.ckpt
    with pytest.raises(Killed):
        _fit(tmp_path, 3)
    assert sorted(os.listdir(ckpts)) == [".last.ckpt.saving", "last.ckpt", "step=3.ckpt"]
    assert last_checkpoint(ckpts) == str(ckpts / "last.ckpt") and _step_of(ckpts / "last.ckpt") == 2
    swapped.kill_at = None
    trainer = _fit(tmp_path, 4, ckpt_path=last_checkpoint(ckpts))
    assert trainer.global_step == 4
    # step 3 again (Lightning names it step=3-v1.ckpt beside the killed run's step=3.ckpt, which it keeps: not its own)
    assert swapped.calls[6:] == [("step=3-v1.ckpt", 3), ("last.ckpt", 3), ("step=4.ckpt", 4), ("last.ckpt", 4)]
    assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=3.ckpt", "step=4.ckpt"]  # the staging folder swept


def test_a_graceful_stop_swaps_its_last_checkpoint_in(tmp_path, swapped):
    trainer = _fit(tmp_path, 4, sigterm_at=2)
    assert stop_exit_code(trainer) == 143 and trainer.global_step == 2
    # GracefulStop's save at step 2 replaced the every-step one's step-1 last.ckpt (the step's own save then skipped)
    assert swapped.calls == [("step=1.ckpt", 1), ("last.ckpt", 1), ("last.ckpt", 2)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["last.ckpt", "step=1.ckpt"]
    assert _step_of(tmp_path / "checkpoints" / "last.ckpt") == 2
