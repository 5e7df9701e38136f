"""A distributed checkpoint folder (sharded training, ``ModelParallelStrategy``) read as a ``.ckpt`` file is: its
``meta.pt``'s hyper-parameters checked on resume (the same one-line refusals as a file's), and a damaged folder one
line naming the file and the fix, wherever a folder is read (``fit`` / ``validate`` resume, ``lit-llm export``, and
``chat`` / ``predict`` / ``evaluate`` through the same loader check). Folders built in process with
``torch.distributed.checkpoint`` (``no_dist``: no process group), as ``ModelParallelStrategy`` lays them out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_llm.lightning.checkpointing import CheckpointFileError, check_checkpoint_file
from lit_llm.lightning.cli import main
from lit_llm.lightning.resume_options import ResumeOptionError, saved_run_options
from lit_llm.lightning.sharded_checkpoint import DamagedCheckpointError, check_strategy_reads_it

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs/sft_tiny.yaml")
HPARAMS = {"_class_path": "lit_llm.lightning.SFTModule", "model": "tiny", "loss": "sft", "use_peft": False,
           "lora_r": 16}
DATA = {"_class_path": "lit_llm.lightning.SFTDataModule", "format": "arithmetic", "num_samples": 32, "eval_limit": 8,
        "max_length": 64, "batch_size": 8, "micro_batch_size": 4, "packing": False, "seed": 0}  # sft_tiny.yaml's
SHARDED = ["--trainer.strategy", "ModelParallelStrategy", "--trainer.strategy.data_parallel_size", "1",
           "--trainer.strategy.tensor_parallel_size", "1"]


def dcp_folder(path: Path, *, optimizer: bool = True) -> Path:
    """``path`` written as ``ModelParallelStrategy`` writes a checkpoint: ``state_dict`` and ``optimizer_0`` by
    ``torch.distributed.checkpoint`` (one ``__0_<i>.distcp`` per entry, ``single_file_per_rank=False``, so that there
    are several shard files), the rest (hyper-parameters, step, callbacks) in ``meta.pt``."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"model.w": torch.arange(6.0).reshape(2, 3), "trained_tokens": torch.tensor(5.0)}}
    if optimizer:
        state["optimizer_0"] = {"state": {"model.w": {"step": torch.tensor(3.0)}},
                                "param_groups": [{"lr": 0.1, "params": ["model.w"]}]}
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, single_file_per_rank=False), no_dist=True)
    torch.save({"global_step": 2, "hyper_parameters": dict(HPARAMS), "datamodule_hyper_parameters": dict(DATA),
                "callbacks": {"LitLLMSaveConfig": {"seed_everything": 0}}}, path / "meta.pt")
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    return dcp_folder(tmp_path / "checkpoints" / "last.ckpt")


def test_a_whole_folder_gives_its_meta_options_without_reading_shards(folder, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    monkeypatch.setattr(fs.FileSystemReader, "read_data", lambda *a: pytest.fail("a shard was read"))
    assert check_checkpoint_file(folder, "lit_llm.lightning.SFTModule", resumable=True) == HPARAMS
    assert saved_run_options(folder) == {"data": DATA, "seed_everything": 0}
    check_strategy_reads_it(folder, sharded=True, subcommand="fit")


def refusal(folder: Path, option: str, new: str, old: str, why: str) -> str:
    """:func:`~lit_llm.lightning.resume_options.check_resume_options`' line, written out."""
    key = option.rpartition(".")[2]
    return (f"--ckpt_path {folder}: {option} {new} differs from the checkpoint's {old}; {key} is {why}, so the run "
            f"cannot resume with a new value. Fix: resume with {key}: {old} (or give it nowhere), or start a new run "
            f"from the checkpoint's weights: lit-llm export --ckpt_path {folder} --out DIR, then "
            f"--model.init_args.model DIR without --ckpt_path.")


@pytest.mark.parametrize(("given", "option", "new", "old", "why"), [
    (["--model.init_args.use_peft", "true"], "model.init_args.use_peft", "True", "False",
     "full weights vs LoRA adapters: what the checkpoint holds"),
    (["--model.init_args.lora_r", "8"], "model.init_args.lora_r", "8", "16", "the adapters' shapes"),
    (["--data.init_args.seed", "3"], "data.init_args.seed", "3", "0", "which rows are trained and in which order: "
     "the restored data position counts steps of the checkpoint's epoch plan"),
    (["--seed_everything", "5"], "seed_everything", "5", "0", "the seed of the run's random generators; a resume "
     "restores the checkpoint's generator states (exact resume), so a new seed would not take effect")])
def test_a_changed_option_on_resume_from_a_folder_is_the_files_one_line(folder, tmp_path, given, option, new, old,
                                                                        why):
    """What a ``.ckpt`` file gets (tests/lightning/test_resume_options.py): refused from ``meta.pt``'s options before
    anything is built, not a size-mismatch / missing-key traceback from the shards."""
    with pytest.raises(ResumeOptionError) as e:
        main(["fit", "--config", SFT, *SHARDED, "--ckpt_path", str(folder), "--trainer.default_root_dir",
              str(tmp_path), *given])
    assert str(e.value) == refusal(folder, option, new, old, why)


def test_validate_of_a_folder_checks_its_options_too(folder, tmp_path):
    with pytest.raises(ResumeOptionError) as e:
        main(["validate", "--config", SFT, *SHARDED, "--ckpt_path", str(folder), "--trainer.default_root_dir",
              str(tmp_path), "--model.init_args.lora_r", "8"])
    assert str(e.value) == refusal(folder, "model.init_args.lora_r", "8", "16", "the adapters' shapes")


def _garble(path: Path) -> None:
    path.write_bytes(b"\x9b" + path.read_bytes()[1:])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


FIX = ("Fix: give another checkpoint (none is beside it: start a new run); this folder cannot be read (a save "
       "that did not finish, or a copy that lost files).")
SHARD_NAMES = ", ".join(f"__0_{i}.distcp" for i in range(5))


@pytest.mark.parametrize(("damage", "what"), [
    (lambda f: (f / "__0_1.distcp").unlink(), f"__0_1.distcp is missing (.metadata names 5 shard files: "
                                              f"{SHARD_NAMES})"),
    (lambda f: _truncate(f / "__0_1.distcp"), "__0_1.distcp is truncated (100 bytes; .metadata indexes {size})"),
    (lambda f: (f / "__0_4.distcp").write_bytes(b""), "__0_4.distcp is truncated (0 bytes; .metadata indexes {size})"),
    (lambda f: (f / ".metadata").unlink(), ".metadata is missing (torch.distributed.checkpoint's index of the "
                                          ".distcp shards)"),
    (lambda f: _truncate(f / ".metadata"), ".metadata cannot be read ({error})"),
    (lambda f: (f / "meta.pt").unlink(), "meta.pt is missing (the step, loops and hyper-parameters, written by rank 0 "
                                         "after the shards)"),
    (lambda f: _garble(f / "meta.pt"), "meta.pt cannot be read ({error})"),
])
def test_a_damaged_folder_is_one_line_wherever_it_is_read(folder, damage, what):
    sizes = {f.name: f.stat().st_size for f in folder.iterdir()}
    damage(folder)
    lines = set()
    from lit_llm.lightning.export import _check_checkpoint_file

    for check in (lambda: check_checkpoint_file(folder, "lit_llm.lightning.SFTModule", resumable=True),
                  lambda: check_strategy_reads_it(folder, sharded=False, subcommand="fit"),
                  lambda: _check_checkpoint_file(folder, "lit-llm export", "--ckpt_path")):  # export, chat, predict,
        with pytest.raises((CheckpointFileError, DamagedCheckpointError)) as e:  # evaluate
            check()
        lines.add(str(e.value))
    (line,) = lines
    head = f"--ckpt_path {folder}: a damaged sharded checkpoint folder: "
    assert line.startswith(head) and line.endswith(f". {FIX}") and "\n" not in line, line
    found = line[len(head):-len(f". {FIX}")]
    if "{error}" in what:  # the reader's own first line, after the exception's class name
        prefix = what.split("{error}")[0]
        assert found.startswith(prefix) and found.endswith(")") and ": " in found[len(prefix):], found
    else:
        name = what.split(" ")[0]
        assert found == what.format(size=sizes.get(name)), found


def test_an_empty_or_unfinished_folder_names_another_checkpoint(tmp_path):
    """An emptied ``last.ckpt/`` (what ``--ckpt_path last`` resolves to) is a damaged checkpoint, not "give a .ckpt
    or --ckpt_path last"; the fix names the newest other checkpoint beside it."""
    ckpts = tmp_path / "checkpoints"
    other = dcp_folder(ckpts / "step=2.ckpt")
    empty = ckpts / "last.ckpt"
    empty.mkdir()
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(empty, resumable=True)
    assert str(e.value) == (
        f"--ckpt_path {empty}: a damaged sharded checkpoint folder: it holds none of meta.pt, .metadata and the "
        f"__<rank>_0.distcp shards (it is empty). Fix: give another checkpoint (e.g. --ckpt_path {other}); this "
        f"folder cannot be read (a save that did not finish, or a copy that lost files).")


def test_a_weights_only_folder_is_refused_only_for_resuming(tmp_path):
    folder = dcp_folder(tmp_path / "w.ckpt", optimizer=False)
    assert check_checkpoint_file(folder)["loss"] == "sft"  # validate / export read the weights only
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(folder, resumable=True)
    assert str(e.value).startswith(f"--ckpt_path {folder}: this is a weights-only checkpoint (written with "
                                   f"checkpoint.save_weights_only true)")
