"""``lit-llm export`` never destroys (issue 30, item 1): an ``--out`` that is or contains the checkpoint's run folder,
or lies in its ``checkpoints/`` folder, is refused even with ``--overwrite`` (both paths named); ``--overwrite``
replaces only a previous export (config.json + weights + tokenizer files, nothing else); the new export is moved into
place only when complete (a save that raises leaves the previous export, or nothing).

The path rules are unit tests (no model); one tiny checkpoint (a ``SFTModule("tiny")`` state dict) backs the
atomicity tests; the console script runs in a subprocess in the slow tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lit_llm.lightning.export import (
    check_export_target,
    check_writable_folder,
    export_checkpoint,
    export_contents,
    run_folder,
)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
ENV.pop("LIT_LLM_DEBUG", None)
EXPORT = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json"]


def make_run(root: Path) -> Path:
    """A run folder as ``lit-llm fit`` leaves it: ``checkpoints/last.ckpt``, ``csv/``, ``config.yaml``."""
    (root / "checkpoints").mkdir(parents=True)
    (root / "csv" / "version_0").mkdir(parents=True)
    (root / "csv" / "version_0" / "metrics.csv").write_text("step,loss\n")
    (root / "config.yaml").write_text("seed_everything: 0\n")
    ckpt = root / "checkpoints" / "last.ckpt"
    ckpt.write_bytes(b"not loaded by the path rules")
    return ckpt


def fake_export(folder: Path, names=EXPORT) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text("previous")
    return folder


# ------------------------------------------------------------------------------------------------- path rules
def test_run_folder_is_the_parent_of_checkpoints_else_the_checkpoint_folder(tmp_path):
    assert run_folder(tmp_path / "run" / "checkpoints" / "last.ckpt") == tmp_path / "run"
    assert run_folder(tmp_path / "run" / "step4.ckpt") == tmp_path / "run"
    os.symlink(tmp_path / "run", tmp_path / "link")
    assert run_folder(tmp_path / "link" / "checkpoints" / "last.ckpt") == (tmp_path / "run").resolve()


@pytest.mark.parametrize("out", ["run", ".", "run/checkpoints", "run/checkpoints/hf"])
def test_out_around_or_in_the_checkpoint_folder_is_refused_even_with_overwrite(tmp_path, out):
    ckpt = make_run(tmp_path / "run")
    target = tmp_path / out
    run = tmp_path / "run"
    fix = f"Fix: choose an --out outside it, e.g. '{run}/hf' or '{tmp_path}/run-hf'."
    with pytest.raises(ValueError) as exc:
        check_export_target(ckpt, target, overwrite=True)
    shown = str(target.absolute())
    if out == "run":
        assert str(exc.value) == (f"lit-llm export: --out '{shown}' is the run folder '{run}' of --ckpt_path "
                                  f"'{ckpt}'; writing there would replace the run's checkpoints and logs, so it is "
                                  f"refused even with --overwrite. {fix}")
    elif out == ".":
        assert str(exc.value).startswith(f"lit-llm export: --out '{shown}' contains the run folder '{run}' of "
                                         f"--ckpt_path '{ckpt}';")
    else:
        assert str(exc.value) == (f"lit-llm export: --out '{shown}' is inside the checkpoint folder "
                                  f"'{run}/checkpoints' of --ckpt_path '{ckpt}'; refused even with --overwrite. {fix}")
    assert ckpt.read_bytes() == b"not loaded by the path rules"


def test_a_new_folder_inside_the_run_is_allowed(tmp_path):
    """``RUN/hf`` is the documented layout (configs/grpo_calculator.yaml reads runs/sft_calculator_tools/hf)."""
    ckpt = make_run(tmp_path / "run")
    check_export_target(ckpt, tmp_path / "run" / "hf")
    check_export_target(ckpt, tmp_path / "elsewhere" / "hf")
    check_export_target(tmp_path / "loose.ckpt", tmp_path / "hf")  # a checkpoint outside checkpoints/: its folder


def test_overwrite_replaces_only_a_previous_export(tmp_path):
    ckpt = make_run(tmp_path / "run")
    previous = fake_export(tmp_path / "prev")
    assert export_contents(previous) == (True, [])
    check_export_target(ckpt, previous, overwrite=True)
    with pytest.raises(FileExistsError) as exc:
        check_export_target(ckpt, previous)
    assert str(exc.value) == (f"lit-llm export: --out '{previous}' holds a previous export; choose another --out or "
                              f"pass --overwrite true to replace it.")
    # a user's folder: notes and a sub-folder beside HF-looking files
    mine = fake_export(tmp_path / "mine", ["config.json", "model.safetensors", "notes.txt"])
    (mine / "data").mkdir()
    assert export_contents(mine) == (False, ["data/", "notes.txt"])
    for overwrite in (True, False):
        with pytest.raises(ValueError) as exc:
            check_export_target(ckpt, mine, overwrite=overwrite)
        assert str(exc.value) == (f"lit-llm export: --out '{mine}' exists and is not a previous export: it holds "
                                  f"'data/', 'notes.txt'; --overwrite replaces only a folder written by lit-llm "
                                  f"export (config.json, model safetensors, tokenizer files, nothing else). Fix: "
                                  f"choose another --out, or move those files away yourself.")
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "data", "model.safetensors", "notes.txt"]
    # only export-named files, but not a whole export (a user's tokenizer folder with a config): kept too
    partial = fake_export(tmp_path / "partial", ["config.json", "tokenizer.json"])
    with pytest.raises(ValueError) as exc:
        check_export_target(ckpt, partial, overwrite=True)
    assert str(exc.value).startswith(f"lit-llm export: --out '{partial}' exists and is not a previous export: it "
                                     f"lacks 'tokenizer_config.json', 'model.safetensors'; --overwrite replaces only ")


@pytest.mark.parametrize(("names", "expected"), [
    (EXPORT, (True, [])),
    (["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json", "tokenizer_config.json", "tokenizer.json"], (True, [])),
    (["config.json", "tokenizer_config.json"], (False, [])),  # no weights
    (["model.safetensors", "tokenizer_config.json"], (False, [])),  # no config.json
    (["config.json", "model.safetensors"], (False, [])),  # no tokenizer
    ([*EXPORT, "pytorch_model.bin"], (False, ["pytorch_model.bin"])),  # not what lit-llm export writes
    ([], (False, [])),
])
def test_what_counts_as_a_previous_export(tmp_path, names, expected):
    assert export_contents(fake_export(tmp_path / "x", names)) == expected


def test_extra_chat_templates_folder_is_part_of_an_export(tmp_path):
    folder = fake_export(tmp_path / "x")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    assert export_contents(folder) == (True, [])
    (folder / "additional_chat_templates" / "notes.txt").write_text("mine")
    assert export_contents(folder) == (False, ["additional_chat_templates/"])


def test_empty_folder_needs_overwrite_and_a_file_is_refused(tmp_path):
    ckpt = make_run(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileExistsError, match=r"--out '.*/empty' exists \(empty\); choose another --out or pass "):
        check_export_target(ckpt, tmp_path / "empty")
    check_export_target(ckpt, tmp_path / "empty", overwrite=True)
    (tmp_path / "notes.md").write_text("mine")
    with pytest.raises(NotADirectoryError) as exc:
        check_export_target(ckpt, tmp_path / "notes.md" / "hf", overwrite=True)
    assert str(exc.value) == (f"lit-llm export: --out '{tmp_path}/notes.md/hf' is under '{tmp_path}/notes.md', "
                              f"which is a file, not a folder; choose a folder path (or move the file).")
    with pytest.raises(NotADirectoryError, match=r"--out '.*/notes.md' is a file, not a folder"):
        check_export_target(ckpt, tmp_path / "notes.md", overwrite=True)


def test_check_writable_folder_names_the_option(tmp_path):
    (tmp_path / "f").write_text("")
    check_writable_folder(tmp_path / "new" / "deeper", "--trainer.default_root_dir")
    with pytest.raises(NotADirectoryError) as exc:
        check_writable_folder(tmp_path / "f" / "run", "--trainer.default_root_dir")
    assert str(exc.value) == (f"--trainer.default_root_dir '{tmp_path}/f/run' is under '{tmp_path}/f', "
                              f"which is a file, not a folder; choose a folder path (or move the file).")


def test_an_out_where_nothing_can_be_written_names_the_out(tmp_path):
    """Checked before the checkpoint is loaded; the message names --out, not the hidden temporary sibling."""
    ckpt = make_run(tmp_path / "run")
    with pytest.raises(OSError) as exc:
        check_export_target(ckpt, "/proc/foo")
    assert str(exc.value) == ("lit-llm export: --out '/proc/foo': cannot create a folder in '/proc' (No such file or "
                              "directory); choose an --out you can write to.")
    assert not [p for p in Path("/proc").iterdir() if p.name.startswith(".foo.")]


def test_a_model_path_that_does_not_exist_is_no_such_folder(tmp_path, monkeypatch):
    """``chat`` / ``evaluate`` / ``predict --model runs/nope``: the folder, not a Hub download hint; ``org/name``
    without a local ``org/`` is still a Hub id."""
    from lit_llm.lightning.export import load_inference_policy

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for name in ("runs/nope", "./nope", str(tmp_path / "a" / "b")):
        with pytest.raises(FileNotFoundError) as exc:
            load_inference_policy(name, who="lit-llm chat")
        path = (tmp_path / name).absolute() if not name.startswith("/") else Path(name)
        base = tmp_path / "runs" if name.startswith("runs") else tmp_path
        assert str(exc.value) == (f"lit-llm chat: --model {name!r}: no such folder ('{os.path.normpath(path)}' does "
                                  f"not exist; '{base}' does). Give a folder written by lit-llm export, a .ckpt "
                                  f"written by lit-llm fit, or a model name / Hub id.")
    with pytest.raises(FileNotFoundError, match=r"^load_model: 'org/nope' is neither the embedded default"):
        load_inference_policy("org/nope", who="lit-llm chat")


# ------------------------------------------------------------------------------------ atomic replacement
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    import lightning
    import torch

    from lit_llm.lightning.sft import SFTModule

    module = SFTModule("tiny")
    path = tmp_path_factory.mktemp("run") / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__,
                "hyper_parameters": {**module.hparams, "_class_path": "lit_llm.lightning.sft.SFTModule"}}, path)
    return path


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir())


def test_a_save_that_raises_leaves_the_previous_export_or_nothing(tiny_ckpt, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    def broken(self, *args, **kwargs):  # the model's files are written by then: a half-written export
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", broken)
    previous = fake_export(tmp_path / "prev" / "hf")
    with pytest.raises(OSError) as exc:
        export_checkpoint(tiny_ckpt, previous, overwrite=True)
    assert str(exc.value) == (f"lit-llm export: --out '{previous}': writing the export failed (disk full "
                              f"(simulated)); nothing was left there (a previous export is kept). Fix: free space or "
                              f"choose an --out you can write to.")
    assert siblings(previous) == ["hf"]  # no .hf.tmp-* / .hf.old-* left
    assert {p.name: p.read_text() for p in previous.iterdir()} == {n: "previous" for n in EXPORT}
    fresh = tmp_path / "new" / "hf"
    with pytest.raises(OSError, match="disk full"):
        export_checkpoint(tiny_ckpt, fresh)
    assert siblings(fresh) == []  # the successful replacement: test_cli_export_overwrites_a_previous_export_only


# ------------------------------------------------------------------------------------------ the console script
def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_cli_export_into_the_run_folder_is_refused_and_the_run_is_kept(tiny_ckpt, tmp_path):
    run = tiny_ckpt.parent.parent
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = run_cli(["export", "--ckpt_path", str(tiny_ckpt), "--out", str(run), "--overwrite", "true"], tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"lit-llm export: error: --out '{run}' is the run folder '{run}' of --ckpt_path '{tiny_ckpt}'; writing there "
        f"would replace the run's checkpoints and logs, so it is refused even with --overwrite. Fix: choose an --out "
        f"outside it, e.g. '{run}/hf' or '{run}-hf'.", "  (LIT_LLM_DEBUG=1 shows the traceback)"]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


@pytest.mark.slow
def test_cli_export_overwrites_a_previous_export_only(tiny_ckpt, tmp_path):
    out = tmp_path / "hf"
    assert run_cli(["export", "--ckpt_path", str(tiny_ckpt), "--out", str(out)], tmp_path).returncode == 0
    assert sorted(p.name for p in out.iterdir()) == EXPORT
    again = run_cli(["export", "--ckpt_path", str(tiny_ckpt), "--out", str(out)], tmp_path)
    assert again.returncode == 2 and again.stderr.splitlines()[0] == (
        f"lit-llm export: error: --out '{out}' holds a previous export; choose another --out or pass --overwrite "
        f"true to replace it.")
    (out / "config.json").write_text("previous")
    proc = run_cli(["export", "--ckpt_path", str(tiny_ckpt), "--out", str(out), "--overwrite", "true"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"exported {tiny_ckpt} -> {out}", proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no .hf.tmp-* / .hf.old-* left
    assert sorted(p.name for p in out.iterdir()) == EXPORT
    assert '"model_type": "llama"' in (out / "config.json").read_text()
    (out / "my_notes.txt").write_text("keep me")
    refused = run_cli(["export", "--ckpt_path", str(tiny_ckpt), "--out", str(out), "--overwrite", "true"], tmp_path)
    assert refused.returncode == 2 and refused.stderr.splitlines()[0].startswith(
        f"lit-llm export: error: --out '{out}' exists and is not a previous export: it holds 'my_notes.txt';")
    assert (out / "my_notes.txt").read_text() == "keep me"
