"""A bad ``--ckpt_path`` file is one line naming the path and what is wrong with it, before Lightning reads it (issue 30
item 6): :func:`~lit_llm.lightning.checkpointing.check_checkpoint_file` on small synthetic files (default suite), then
``lit-llm fit`` / ``validate`` / ``export`` in a subprocess on the tiny configs (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_llm.lightning.checkpointing import CheckpointFileError, check_checkpoint_file

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs/sft_tiny.yaml")
GRPO = str(ROOT / "configs/grpo_tiny.yaml")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
ENV.pop("LIT_LLM_DEBUG", None)
SFT_HPARAMS = {"_class_path": "lit_llm.lightning.SFTModule", "model": "tiny", "loss": "sft", "normalization": "token"}


def _ckpt(path: Path, **extra) -> Path:
    """A small file shaped as ``lit-llm fit`` writes them (a Lightning checkpoint of an SFTModule)."""
    torch.save({"state_dict": {"trained_tokens": torch.zeros(())}, "global_step": 2, "optimizer_states": [{}],
                "hyper_parameters": dict(SFT_HPARAMS), **extra}, path)
    return path


def test_a_good_checkpoint_returns_its_hyperparameters(tmp_path):
    assert check_checkpoint_file(_ckpt(tmp_path / "ok.ckpt"), "lit_llm.lightning.sft.SFTModule",
                                 resumable=True) == SFT_HPARAMS


def test_empty_file(tmp_path):
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(path)
    assert str(e.value) == (f"--ckpt_path {path}: the file is empty (0 bytes), e.g. a copy or a save that did not "
                            f"finish; give another checkpoint (<run dir>/checkpoints/ keeps last.ckpt).")


def test_truncated_file(tmp_path):
    good = _ckpt(tmp_path / "ok.ckpt")
    path = tmp_path / "cut.ckpt"
    path.write_bytes(good.read_bytes()[:300])
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(path)
    assert str(e.value) == (f"--ckpt_path {path}: the file is truncated or damaged (300 bytes; File is not a zip "
                            f"file), e.g. a save interrupted or a copy that did not finish; give another checkpoint "
                            f"(<run dir>/checkpoints/ keeps last.ckpt).")


@pytest.mark.parametrize(("name", "content", "what"), [
    ("notes.ckpt", b"model: tiny\n", "not a checkpoint written by torch.save (it starts with b'model: t'); give a "
                                     ".ckpt written by lit-llm fit (<run dir>/checkpoints/last.ckpt)"),
    ("cfg.ckpt", b'{"model": "tiny"}', "a JSON/text file, not a checkpoint; give a .ckpt written by lit-llm fit "
                                       "(<run dir>/checkpoints/last.ckpt)"),
    ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\":{}}",
     "a safetensors file (model weights, not a Lightning checkpoint); to start a run from a Hugging Face model give "
     "its folder as --model.init_args.model FOLDER, without --ckpt_path"),
])
def test_not_a_checkpoint(tmp_path, name, content, what):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(path)
    assert str(e.value) == f"--ckpt_path {path}: {what}."


def test_torch_files_that_are_not_lightning_checkpoints(tmp_path):
    bare, other = tmp_path / "bare.pt", tmp_path / "list.pt"
    torch.save({"weight": torch.zeros(2)}, bare)
    torch.save([1, 2], other)
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(bare)
    assert str(e.value) == (f"--ckpt_path {bare}: a bare state_dict (torch.save(model.state_dict())), not a Lightning "
                            f"checkpoint; to start from these weights, load them into a Hugging Face folder and give "
                            f"it as --model.init_args.model.")
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(other, option="--model")
    assert str(e.value) == (f"--model {other}: a torch file but not a Lightning checkpoint (no 'state_dict'; it holds "
                            f"list).")


def test_another_modules_checkpoint(tmp_path):
    path = _ckpt(tmp_path / "sft.ckpt")
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(path, "lit_llm.lightning.grpo.GRPOModule")
    assert str(e.value) == (
        f"--ckpt_path {path}: a checkpoint of lit_llm.lightning.SFTModule, but this run's model is "
        f"lit_llm.lightning.grpo.GRPOModule: its weights and training state cannot be restored into another module. "
        f"Use the checkpoint's own config (model.class_path lit_llm.lightning.SFTModule), or start this module from "
        f"its weights: lit-llm export --ckpt_path {path} --out DIR, then --model.init_args.model DIR without "
        f"--ckpt_path.")
    # the same class under another import path, and a base class (export loads any PolicyModule), are accepted
    check_checkpoint_file(path, "lit_llm.lightning.sft.SFTModule")
    check_checkpoint_file(path, "lit_llm.lightning.module.PolicyModule")


def test_a_checkpoint_without_a_class_path_is_told_by_its_options(tmp_path):
    path = tmp_path / "plain.ckpt"  # written by a plain Trainer: no _class_path
    torch.save({"state_dict": {}, "hyper_parameters": {"model": "tiny", "loss": "sft", "kl_coef": 0.0}}, path)
    with pytest.raises(CheckpointFileError, match=r"a checkpoint of another module \(its options \['kl_coef', 'loss'\] "
                                                   r"are not GRPOModule's\), but this run's model is "):
        check_checkpoint_file(path, "lit_llm.lightning.grpo.GRPOModule")
    assert check_checkpoint_file(path, "lit_llm.lightning.sft.SFTModule")["loss"] == "sft"


def test_weights_only_checkpoint_is_refused_only_for_resuming(tmp_path):
    path = tmp_path / "w.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": dict(SFT_HPARAMS)}, path)
    assert check_checkpoint_file(path)["loss"] == "sft"  # validate / export read the weights only
    with pytest.raises(CheckpointFileError, match=rf"^--ckpt_path {path}: this is a weights-only checkpoint \(written "
                                                   r"with checkpoint.save_weights_only true\)"):
        check_checkpoint_file(path, resumable=True)


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        check_checkpoint_file(tmp_path / "nope.ckpt")
    assert str(e.value) == (f"--ckpt_path {tmp_path / 'nope.ckpt'}: no such file; give a .ckpt written by lit-llm fit "
                            f"(e.g. <run dir>/checkpoints/last.ckpt) or --ckpt_path last.")


def test_a_folder_names_the_ckpt_file_in_it(tmp_path):
    """A folder is one line naming it and the file to give: its ``last.ckpt`` (before newer files), else its newest
    ``.ckpt``, or a run folder's ``checkpoints/last.ckpt``; a folder without any is told so."""
    ckpts, run, empty = tmp_path / "checkpoints", tmp_path / "run", tmp_path / "empty"
    for folder in (ckpts, run / "checkpoints", empty):
        folder.mkdir(parents=True)
    _ckpt(ckpts / "last.ckpt")
    _ckpt(ckpts / "epoch=0-step=5.ckpt")
    _ckpt(run / "checkpoints" / "epoch=0-step=5.ckpt")
    os.utime(run / "checkpoints" / "epoch=0-step=5.ckpt", (1, 1))
    _ckpt(run / "checkpoints" / "epoch=0-step=10.ckpt")
    for folder, given in ((ckpts, "checkpoints/last.ckpt"), (run, "run/checkpoints/epoch=0-step=10.ckpt")):
        for check in (check_checkpoint_file, _export_check):
            with pytest.raises(CheckpointFileError) as e:
                check(folder)
            assert str(e.value) == (f"--ckpt_path {folder}: a folder, not a checkpoint file; give the file, e.g. "
                                    f"--ckpt_path {tmp_path / given}.")
    with pytest.raises(CheckpointFileError) as e:
        check_checkpoint_file(empty, resumable=True)
    assert str(e.value) == (f"--ckpt_path {empty}: a folder, not a checkpoint file (nor a sharded FSDP / DeepSpeed "
                            f"checkpoint folder), and it holds no .ckpt file; give a .ckpt written by lit-llm fit "
                            f"(<run dir>/checkpoints/last.ckpt) or --ckpt_path last.")


def test_deepspeed_folders_pass_to_lightning_but_not_to_export(tmp_path):
    """A DeepSpeed folder (Lightning's mark: a ``checkpoint/`` sub-folder) is left to the strategy; export refuses it.
    A distributed checkpoint folder (``meta.pt``) is checked: tests/lightning/test_sharded_folder_checks.py."""
    deepspeed = tmp_path / "ds.ckpt"
    (deepspeed / "checkpoint").mkdir(parents=True)
    assert check_checkpoint_file(deepspeed) == {}
    with pytest.raises(CheckpointFileError) as e:
        _export_check(deepspeed)
    assert str(e.value) == (f"--ckpt_path {deepspeed}: a DeepSpeed checkpoint folder; lit-llm export reads one .ckpt "
                            f"file: consolidate it first (DeepSpeed's zero_to_fp32.py).")


def _export_check(path: Path) -> None:
    from lit_llm.lightning.export import _check_checkpoint_file

    _check_checkpoint_file(path, "lit-llm export", "--ckpt_path")


# ------------------------------------------------------------------------------------------- from the command line
def _first_error(proc: subprocess.CompletedProcess) -> str:
    """The ``lit-llm: error:`` line; checks exit status 2 and no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("lit-llm")]
    return line


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize(("command", "kind"), [("fit", "empty"), ("validate", "cut"), ("export", "cut"),
                                              ("validate", "folder"), ("export", "folder")])
def test_bad_files_from_the_command_line(tmp_path, command, kind):
    path = tmp_path / f"{kind}.ckpt"
    if kind == "folder":  # a run's checkpoints/ folder given for its last.ckpt
        path = tmp_path / "checkpoints"
        path.mkdir()
        _ckpt(path / "last.ckpt")
        what = f"a folder, not a checkpoint file; give the file, e.g. --ckpt_path {path / 'last.ckpt'}."
    elif kind == "empty":
        path.write_bytes(b"")
        what = "the file is empty (0 bytes), e.g. a copy or a save that did not finish"
    else:
        path.write_bytes(_ckpt(tmp_path / "ok.ckpt").read_bytes()[:300])
        what = "the file is truncated or damaged (300 bytes; File is not a zip file), e.g. a save interrupted"
    if command == "export":
        args, prefix = ["export", "--ckpt_path", str(path), "--out", str(tmp_path / "hf")], "lit-llm export: error:"
    else:
        args = [command, "--config", SFT, "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path", str(path)]
        prefix = "lit-llm: error:"
    line = _first_error(_cli(*args, cwd=tmp_path))
    assert line.startswith(f"{prefix} --ckpt_path {path}: {what}"), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "hf").exists()  # refused before anything was written


@pytest.mark.slow
def test_an_sft_checkpoint_resumed_with_a_grpo_config(tmp_path):
    run = tmp_path / "sft"
    proc = _cli("fit", "--config", SFT, "--trainer.default_root_dir", str(run), "--trainer.max_steps", "1",
                "--trainer.val_check_interval", "1", "--samples.num_samples", "0", "--trainer.enable_progress_bar",
                "false", "--trainer.precision", "32-true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    for command in ("fit", "validate"):
        line = _first_error(_cli(command, "--config", GRPO, "--trainer.default_root_dir", str(tmp_path / "grpo"),
                                 "--ckpt_path", str(ckpt), cwd=tmp_path))
        assert line == (
            f"lit-llm: error: --ckpt_path {ckpt}: a checkpoint of lit_llm.lightning.SFTModule, but this run's model "
            f"is lit_llm.lightning.grpo.GRPOModule: its weights and training state cannot be restored into another "
            f"module. Use the checkpoint's own config (model.class_path lit_llm.lightning.SFTModule), or start this "
            f"module from its weights: lit-llm export --ckpt_path {ckpt} --out DIR, then --model.init_args.model DIR "
            f"without --ckpt_path."), line
    assert not (tmp_path / "grpo").exists()


def test_a_base_class_accepts_its_subclasses_checkpoints_without_a_class_path(tmp_path):
    path = tmp_path / "plain.ckpt"  # export / chat load any PolicyModule: an SFT checkpoint of a plain Trainer is one
    torch.save({"state_dict": {}, "hyper_parameters": {"model": "tiny", "loss": "sft", "kl_coef": 0.0}}, path)
    assert check_checkpoint_file(path, "lit_llm.lightning.module.PolicyModule")["loss"] == "sft"
    torch.save({"state_dict": {}, "hyper_parameters": {"model": "tiny", "no_such_option": 1}}, path)
    with pytest.raises(CheckpointFileError, match=r"its options \['no_such_option'\] are not PolicyModule's"):
        check_checkpoint_file(path, "lit_llm.lightning.module.PolicyModule")
