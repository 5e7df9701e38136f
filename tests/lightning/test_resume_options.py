"""Nothing silently ignored (issue 13 item 5): LightningCLI's top-level --optimizer beside the module's optimizer, and a
resume with another optimizer class or another learning rate. What the user typed wins on resume (issue 30 item 4):
the table of applied / refused options (:data:`~lit_llm.lightning.resume_options.RESUME_OPTIONS`), optimizer and
scheduler knobs applied over the restored ones, and ``lit-llm fit --ckpt_path`` in a subprocess (slow)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from cli_runs import first_error
from lightning.pytorch import Trainer

from lit_llm.lightning.cli import main
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule

ROOT = Path(__file__).resolve().parents[2]


def _fit(tmp_path: Path, optimizer, *, max_steps: int, ckpt_path: str | None = None) -> Trainer:
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=optimizer, grad_clip=None)
    dm = SFTDataModule(format="arithmetic", num_samples=16, eval_limit=4, batch_size=4, max_length=48)
    trainer = Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, accelerator="cpu", devices=1, default_root_dir=tmp_path,
                      precision="32-true")
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture
def adamw_ckpt(tmp_path):
    trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=1e-3), max_steps=1)
    path = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["lit_llm_optimizers"] == ["torch.optim.adamw.AdamW"]
    return path


def test_resume_with_another_optimizer_names_both(tmp_path, adamw_ckpt):
    with pytest.raises(ValueError) as e:
        _fit(tmp_path, partial(torch.optim.SGD, lr=1e-3, momentum=0.9), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert "torch.optim.sgd.SGD" in str(e.value) and "torch.optim.adamw.AdamW" in str(e.value)


def test_resume_with_another_lr_applies_it(tmp_path, adamw_ckpt, caplog):
    with caplog.at_level(logging.INFO):
        trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=5e-3), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert trainer.optimizers[0].param_groups[0]["lr"] == 5e-3
    assert "Resuming with optimizer lr=0.005 (the checkpoint's: 0.001; now applied to the restored optimizer, " \
           "current lr 0.005)" in caplog.text
    # the AdamW moments were restored (not a fresh optimizer): step count continued from the checkpoint's 1
    assert all(int(s["step"]) == 2 for s in trainer.optimizers[0].state.values())


def test_resume_with_the_same_optimizer_is_quiet(tmp_path, adamw_ckpt):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, partial(torch.optim.AdamW, lr=1e-3), max_steps=2, ckpt_path=str(adamw_ckpt))
    assert trainer.global_step == 2
    assert not [w for w in caught if "learning rate" in str(w.message)]


def test_top_level_optimizer_beside_the_config_one_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"--optimizer torch.optim.SGD \(lr=0.1\) and model.init_args.optimizer "
                                         r"torch.optim.AdamW \(lr=0.003\)"):
        main(["fit", "--config", str(ROOT / "configs/sft_tiny.yaml"), "--optimizer", "torch.optim.SGD",
              "--optimizer.lr", "0.1", "--trainer.default_root_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before anything was built or written


def test_top_level_optimizer_alone_is_moved_into_the_module(tmp_path):
    cli = main(["fit", "--model", "lit_llm.lightning.SFTModule", "--model.model", "tiny", "--data",
                "lit_llm.lightning.SFTDataModule", "--data.format", "arithmetic", "--data.num_samples", "16",
                "--data.batch_size", "8", "--data.max_length", "48", "--optimizer", "torch.optim.SGD",
                "--optimizer.lr", "0.1", "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
                "--trainer.enable_progress_bar", "false", "--wandb", "false"])
    opt = cli.trainer.optimizers[0]
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["lr"] == 0.1
    assert cli.trainer.global_step == 1
    import yaml

    cfg = yaml.safe_load((tmp_path / "csv" / "version_0" / "config.yaml").read_text())
    assert cfg["model"]["init_args"]["optimizer"]["class_path"] == "torch.optim.SGD"
    assert cfg.get("optimizer") is None


# ----------------------------------------------------------------------------------- the table (issue 30 item 4)
def test_every_module_option_is_classified():
    import inspect

    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.resume_options import RESUME_OPTIONS

    for cls in (SFTModule, GRPOModule):
        options = set(inspect.signature(cls.__init__).parameters) - {"self", "optimizer", "lr_scheduler"}
        assert sorted(options - set(RESUME_OPTIONS)) == [], cls.__name__
    from lit_llm.lightning.grpo_data import GRPODataModule

    for cls in (SFTDataModule, GRPODataModule):  # the data options too (item 8)
        options = {f"data.{k}" for k in inspect.signature(cls.__init__).parameters} - {"data.self"}
        assert sorted(options - set(RESUME_OPTIONS)) == [], cls.__name__
    assert {k for k, (policy, _) in RESUME_OPTIONS.items() if policy == "refused"} >= {
        "model", "loss", "num_generations", "loss_type", "use_peft", "lora_r", "lora_alpha", "lora_target_modules"}
    assert {k for k, (policy, _) in RESUME_OPTIONS.items() if policy == "applied"} >= {
        "optimizer.init_args", "trainer.max_steps", "trainer.val_check_interval", "eval_samples", "log_samples_every"}


def test_check_resume_options_keeps_applies_and_refuses():
    from lit_llm.lightning.resume_options import ResumeOptionError, check_resume_options, resume_policy

    saved = {"_class_path": "x.SFTModule", "model": "tiny", "loss": "sft", "chunk_size": 1024, "grad_clip": 1.0,
             "chat_template_kwargs": {"enable_thinking": False}}
    kept, applied = check_resume_options(saved, {"model": "tiny", "chunk_size": 512,
                                                 "chat_template_kwargs": {"enable_thinking": False}}, ckpt_path="c")
    assert kept == {"loss": "sft", "grad_clip": 1.0}  # not given: the checkpoint's values
    assert applied == ["model.init_args.chunk_size: 512 (the checkpoint's: 1024)"]
    with pytest.raises(ResumeOptionError) as e:
        check_resume_options(saved, {"loss": "rlhf", "chunk_size": 512}, ckpt_path="runs/x/last.ckpt")
    assert str(e.value) == (
        "--ckpt_path runs/x/last.ckpt: model.init_args.loss 'rlhf' differs from the checkpoint's 'sft'; loss is the "
        "loss head: the objective the run optimises, so the run cannot resume with a new value. Fix: resume with "
        "loss: 'sft' (or give it nowhere), or start a new run from the checkpoint's weights: lit-llm export "
        "--ckpt_path runs/x/last.ckpt --out DIR, then --model.init_args.model DIR without --ckpt_path.")
    assert resume_policy("an_option_added_later")[0] == "refused"  # never silently replaced
    with pytest.raises(ResumeOptionError, match=r"an_option_added_later 2 differs from the checkpoint's 1; "
                                                r"an_option_added_later is not classified for resuming"):
        check_resume_options({"an_option_added_later": 1}, {"an_option_added_later": 2}, ckpt_path="c")


def test_a_new_lr_rescales_the_restored_schedule_and_other_knobs_apply():
    from lit_llm.lightning.checkpointing import _apply_optimizer_knobs, _apply_scheduler_knobs

    def build(lr: float, weight_decay: float, total_iters: int):
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.AdamW([w], lr=lr, weight_decay=weight_decay)
        return w, opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=total_iters)

    w, opt, sched = build(1e-3, 0.01, 10)
    for _ in range(3):
        w.grad = torch.ones(2)
        opt.step()
        sched.step()
    factor = 0.1 + 0.9 * 3 / 10  # LinearLR after 3 steps
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * factor)
    _, opt2, sched2 = build(2e-3, 0.1, 20)  # the resumed run's configuration
    configured = sched2.state_dict()
    opt2.load_state_dict(opt.state_dict())  # what Lightning's restore does
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(1e-3 * factor) and sched2.total_iters == 10
    lines = _apply_optimizer_knobs(opt2, [sched2]) + _apply_scheduler_knobs(sched2, configured)
    group = opt2.param_groups[0]
    assert group["lr"] == pytest.approx(2e-3 * factor) and group["initial_lr"] == 2e-3
    assert sched2.base_lrs == [2e-3] and group["weight_decay"] == 0.1
    assert sched2.total_iters == 20 and sched2.last_epoch == 3  # the knob applied, the progress kept
    assert [line.split(" (")[0] for line in lines] == ["optimizer lr=0.002", "optimizer weight_decay=0.1",
                                                       "lr_scheduler total_iters=20"]
    sched2.step()
    # LinearLR's next step (chainable: lr *= 1 + (end - start) / (total_iters * start + (t - 1) (end - start)), t = 4)
    # from the rescaled lr with the new total_iters
    assert group["lr"] == pytest.approx(2e-3 * factor * (1 + 0.9 / (20 * 0.1 + 3 * 0.9)))


# ----------------------------------------------------------------------------- --ckpt_path last (issue 30 item 1)
def test_last_checkpoint_follows_lightnings_names(tmp_path):
    from lit_llm.lightning.cli import last_checkpoint

    assert last_checkpoint(tmp_path / "nope") is None
    for i, name in enumerate(["last.ckpt", "last-v1.ckpt", "step=3-last.ckpt", "blast.ckpt", "last.ckpt.tmp"]):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (i, i))
    assert last_checkpoint(tmp_path) == str(tmp_path / "last-v1.ckpt")  # the newest of Lightning's names only
    os.utime(tmp_path / "last.ckpt", (9, 9))
    assert last_checkpoint(tmp_path) == str(tmp_path / "last.ckpt")


def _tiny_args(root: Path, *extra: str) -> list[str]:
    return ["--model", "lit_llm.lightning.SFTModule", "--model.model", "tiny", "--data",
            "lit_llm.lightning.SFTDataModule", "--data.format", "arithmetic", "--data.num_samples", "8",
            "--data.batch_size", "4", "--data.max_length", "48", "--trainer.default_root_dir", str(root),
            "--trainer.enable_progress_bar", "false", "--wandb", "false", "--samples.num_samples", "0",
            "--trainer.precision", "32-true", *extra]


def test_validate_ckpt_path_last_without_a_checkpoint(tmp_path):
    root = tmp_path / "run"
    with pytest.raises(FileNotFoundError) as e:
        main(["validate", *_tiny_args(root, "--ckpt_path", "last")])
    assert str(e.value) == (f"--ckpt_path last: no last.ckpt in {root / 'checkpoints'}, so there is no checkpoint to "
                            f"validate; give --ckpt_path FILE, or the --trainer.default_root_dir of the run that wrote "
                            f"it.")
    assert not root.exists()


@pytest.mark.slow
def test_fit_ckpt_path_last_without_a_checkpoint(tmp_path):
    """One warning that a new run starts from step 0 (Lightning's rule, so that a requeued job can pass ``last``
    from its first run), and the config saved says no checkpoint; the next ``last`` resumes the file it checked."""
    root = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["fit", *_tiny_args(root, "--ckpt_path", "last", "--trainer.max_steps", "1")])
    assert cli.trainer.global_step == 1
    ours = [str(w.message) for w in caught if str(w.message).startswith("--ckpt_path")]
    assert ours == [f"--ckpt_path last: no last.ckpt in {root / 'checkpoints'}, so this fit starts a new run from "
                    f"step 0 (to resume another run give its --trainer.default_root_dir or --ckpt_path FILE)"]
    assert "ckpt_path: null" in (root / "csv" / "version_0" / "config.yaml").read_text()
    cli = main(["fit", *_tiny_args(root, "--ckpt_path", "last", "--trainer.max_steps", "2")])
    assert cli.config["fit"]["ckpt_path"] == str(root / "checkpoints" / "last.ckpt")  # the file checked is what runs
    assert cli.trainer.global_step == 2


# ------------------------------------------------------------------ data options and the seed (issue 30 item 8)
def _run_ckpt(path: Path, **data) -> Path:
    """The parts of an SFT ``lit-llm fit`` checkpoint the resume checks read (they refuse before the weights)."""
    torch.save({"state_dict": {}, "optimizer_states": [{}], "global_step": 2,
                "hyper_parameters": {"_class_path": "lit_llm.lightning.SFTModule", "model": "tiny"},
                "datamodule_hyper_parameters": {"_class_path": "lit_llm.lightning.SFTDataModule",
                                                "format": "arithmetic", "num_samples": 8, "batch_size": 4,
                                                "max_length": 48, "micro_batch_size": None, **data},
                "callbacks": {"LitLLMSaveConfig": {"seed_everything": 0}}}, path)
    return path


@pytest.mark.parametrize(("extra", "message"), [
    (["--data.batch_size", "2"],
     "data.init_args.batch_size 2 differs from the checkpoint's 4; batch_size is the rows per optimizer step: the "
     "restored data position counts steps of this size (a new size would skip or repeat rows of the epoch) and an "
     "optimizer step would mean another amount of data, so the run cannot resume with a new value. Fix: resume with "
     "batch_size: 4 (or give it nowhere)"),
    (["--seed_everything", "5"],
     "seed_everything 5 differs from the checkpoint's 0; seed_everything is the seed of the run's random generators; "
     "a resume restores the checkpoint's generator states (exact resume), so a new seed would not take effect, so "
     "the run cannot resume with a new value. Fix: resume with seed_everything: 0 (or give it nowhere)"),
])
def test_resume_refuses_a_new_data_batch_size_or_seed(tmp_path, extra, message):
    from lit_llm.lightning.resume_options import ResumeOptionError

    ckpt = _run_ckpt(tmp_path / "last.ckpt")
    with pytest.raises(ResumeOptionError) as e:
        main(["fit", *_tiny_args(tmp_path / "run", "--ckpt_path", str(ckpt), *extra)])
    assert str(e.value).startswith(f"--ckpt_path {ckpt}: {message}, or start a new run"), str(e.value)
    assert not (tmp_path / "run").exists()


def test_run_options_applied_not_given_or_of_another_class(tmp_path):
    from lit_llm.lightning.resume_options import check_run_options, saved_run_options

    ckpt = _run_ckpt(tmp_path / "last.ckpt")
    assert saved_run_options(ckpt)["seed_everything"] == 0
    data = {"class_path": "lit_llm.lightning.SFTDataModule", "init_args": {"batch_size": 4, "micro_batch_size": 2}}
    assert check_run_options(ckpt, {"data": data, "seed_everything": True}) == [  # true: a random seed, not compared
        "data.init_args.micro_batch_size: 2 (the checkpoint's: None)"]
    alias = {"class_path": "lit_llm.lightning.SFTDataModule", "init_args": {"val_limit": 2}}  # deprecated name
    ckpt = _run_ckpt(tmp_path / "eval.ckpt", eval_limit=2, val_limit=None)
    assert check_run_options(ckpt, {"data": alias}) == []
    other = {"class_path": "my.DataModule", "init_args": {"batch_size": 2}}
    assert check_run_options(ckpt, {"data": other, "seed_everything": None}) == []


# ----------------------------------------------------------------------------------------- from the command line
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
ENV.pop("LIT_LLM_DEBUG", None)
SFT = str(ROOT / "configs/sft_tiny.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true", "--samples.num_samples", "0"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory) -> Path:
    """``lit-llm fit --config configs/sft_tiny.yaml`` for 2 steps (lr 0.003): its folder."""
    run = tmp_path_factory.mktemp("sft_resume") / "run"
    proc = _cli("fit", "--config", SFT, "--trainer.default_root_dir", str(run), "--trainer.max_steps", "2",
                "--trainer.val_check_interval", "2", "--checkpoint.every_n_train_steps", "2", *QUIET, cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_resume_applies_a_new_lr_and_an_applied_option(sft_run, tmp_path):
    import csv

    import yaml

    ckpt = sft_run / "checkpoints" / "last.ckpt"
    proc = _cli("fit", "--config", SFT, "--trainer.default_root_dir", str(tmp_path), "--ckpt_path", str(ckpt),
                "--trainer.max_steps", "3", "--model.init_args.optimizer.init_args.lr", "0.01",
                "--model.init_args.chunk_size", "512", *QUIET, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resuming from {ckpt} with model.init_args.chunk_size: 512 (the checkpoint's: 1024)" in proc.stdout
    assert "Resuming with optimizer lr=0.01 (the checkpoint's: 0.003" in proc.stdout + proc.stderr
    rows = list(csv.DictReader((tmp_path / "csv" / "version_0" / "metrics.csv").open()))
    assert [(r["step"], float(r["train/lr"])) for r in rows if r.get("train/lr")] == [("3", pytest.approx(0.01))]
    cfg = yaml.safe_load((tmp_path / "csv" / "version_0" / "config.yaml").read_text())
    init = cfg["model"]["init_args"]
    assert init["chunk_size"] == 512 and init["optimizer"]["init_args"]["lr"] == 0.01 and init["loss"] == "sft"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["file", "last"])
def test_resume_refuses_another_loss_head(sft_run, tmp_path, how):
    ckpt = sft_run / "checkpoints" / "last.ckpt"
    root = sft_run if how == "last" else tmp_path
    before = sorted(p.name for p in (sft_run / "checkpoints").iterdir())
    line = first_error(_cli("fit", "--config", SFT, "--trainer.default_root_dir", str(root), "--ckpt_path",
                             str(ckpt) if how == "file" else "last", "--trainer.max_steps", "3",
                             "--model.init_args.loss", "rlhf", *QUIET, cwd=tmp_path))
    assert line == (
        f"lit-llm: error: --ckpt_path {ckpt}: model.init_args.loss 'rlhf' differs from the checkpoint's 'sft'; loss is "
        f"the loss head: the objective the run optimises, so the run cannot resume with a new value. Fix: resume with "
        f"loss: 'sft' (or give it nowhere), or start a new run from the checkpoint's weights: lit-llm export "
        f"--ckpt_path {ckpt} --out DIR, then --model.init_args.model DIR without --ckpt_path.")
    assert sorted(p.name for p in (sft_run / "checkpoints").iterdir()) == before
    assert how == "last" or not any(tmp_path.glob("csv"))


@pytest.mark.slow
def test_grpo_resume_refuses_another_num_generations(tmp_path):
    ckpt = tmp_path / "grpo.ckpt"  # the parts of a GRPO checkpoint the check reads (it refuses before the weights)
    torch.save({"state_dict": {}, "optimizer_states": [{}], "global_step": 3,
                "hyper_parameters": {"_class_path": "lit_llm.lightning.grpo.GRPOModule", "model": "tiny",
                                     "num_generations": 4, "loss_type": "dapo"}}, ckpt)
    line = first_error(_cli("fit", "--config", str(ROOT / "configs/grpo_tiny.yaml"), "--trainer.default_root_dir",
                             str(tmp_path / "run"), "--ckpt_path", str(ckpt), "--model.init_args.num_generations", "2",
                             cwd=tmp_path))
    assert line.startswith(f"lit-llm: error: --ckpt_path {ckpt}: model.init_args.num_generations 2 differs from the "
                           f"checkpoint's 4; num_generations is the group size: "), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_options_not_given_take_the_checkpoints_values(sft_run, tmp_path):
    """``validate --ckpt_path`` without a config: the module options left out come from the checkpoint (as
    LightningCLI's own resume does), the ones given are compared."""
    saved = torch.load(sft_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    saved["hyper_parameters"].update(grad_clip=0.5, chunk_size=256)
    ckpt = tmp_path / "changed.ckpt"
    torch.save(saved, ckpt)
    cli = main(["validate", "--model", "lit_llm.lightning.SFTModule", "--model.model", "tiny", "--model.chunk_size",
                "512", "--data", "lit_llm.lightning.SFTDataModule", "--data.format", "arithmetic", "--data.num_samples",
                "8", "--data.eval_limit", "2", "--data.max_length", "48", "--ckpt_path", str(ckpt),
                "--trainer.default_root_dir", str(tmp_path / "v"), "--wandb", "false", "--samples.num_samples", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true"])
    assert cli.model.grad_clip == 0.5 and cli.model.hparams["loss"] == "sft"  # left out: the checkpoint's
    assert cli.model.chunk_size == 512  # given: applied
