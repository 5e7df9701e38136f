"""``model.objective``: a user's GRPO objective by import path, from a file in the working directory (no edit of the
module), through the module in Python and through the CLI; a conflicting ``loss_type`` is an error naming both."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from test_grpo_module_objectives import fit  # tests/lightning (pytest puts its folder on sys.path)

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.objectives import GRPOObjective

pytestmark = pytest.mark.usefixtures("one_thread")

USER_LOSS = textwrap.dedent('''
    """A user's objective: DAPO's loss, doubled, counting its calls."""
    from dataclasses import dataclass

    from lit_llm.objectives import GRPOObjective

    CALLS = []


    @dataclass(frozen=True)
    class DoubledObjective(GRPOObjective):
        def __call__(self, *args, **kwargs):
            CALLS.append(kwargs["step_count"])
            loss, metrics = super().__call__(*args, **kwargs)
            return 2 * loss, {**metrics, "loss": 2 * metrics["loss"]}


    @dataclass(frozen=True)
    class SequenceObjective(GRPOObjective):
        loss_type: str = "grpo"
''')


@pytest.fixture
def user_loss(tmp_path, monkeypatch):
    """``my_grpo_loss.py`` in a fresh working directory (imported from there, as a user's file is)."""
    (tmp_path / "my_grpo_loss.py").write_text(USER_LOSS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_grpo_loss", raising=False)
    yield tmp_path
    sys.modules.pop("my_grpo_loss", None)


def test_user_objective_from_the_working_directory_is_the_loss_that_runs(user_loss):
    base, base_steps = fit(1)
    module, steps = fit(1, objective="my_grpo_loss:DoubledObjective")
    user = sys.modules["my_grpo_loss"]
    assert type(module.objective) is user.DoubledObjective and module.loss_type == "dapo"
    assert module.objective.epsilon == base.objective.epsilon  # built with the module's knobs
    assert len(user.CALLS) == 2  # 8 rows, micro_batch_size 4: one call per micro-batch
    # the same rollouts (same seeds): the logged loss is exactly twice the built-in objective's
    assert steps[0]["train/reward"] == base_steps[0]["train/reward"]
    assert steps[0]["train/loss"] == pytest.approx(2 * base_steps[0]["train/loss"], rel=1e-6, abs=1e-9)


def test_user_objective_by_file_path_and_its_own_loss_type(user_loss):
    module = GRPOModule("tiny", num_generations=2, objective=str(user_loss / "my_grpo_loss.py") + ":SequenceObjective")
    assert module.loss_type == "grpo" and module.objective.rule.counts == "sequences"
    assert isinstance(module.objective, GRPOObjective)


def test_objective_with_a_conflicting_loss_type_names_both(user_loss):
    with pytest.raises(ValueError) as e:
        GRPOModule("tiny", num_generations=2, objective="my_grpo_loss:SequenceObjective", loss_type="dapo")
    assert str(e.value).startswith("GRPOModule: objective 'my_grpo_loss:SequenceObjective' uses loss_type 'grpo' "
                                   "(its class's), but loss_type: 'dapo' is set too")


@pytest.mark.parametrize(("spec", "match"), [
    ("my_grpo_loss:Missing", "module 'my_grpo_loss' has no 'Missing'"),
    ("my_grpo_loss:CALLS", "not a subclass of lit_llm.objectives.GRPOObjective"),
    ("nowhere_module:Loss", "no module 'nowhere_module'"),
    ("justaname", "is not an import path"),
])
def test_bad_objective_specs_are_named(user_loss, spec, match):
    with pytest.raises(ValueError, match=match):
        GRPOModule("tiny", num_generations=2, objective=spec)


@pytest.mark.slow
def test_cli_objective_from_a_file_in_the_working_directory(user_loss):
    """``lit-llm fit --config configs/grpo_tiny.yaml --model.init_args.objective my_grpo_loss:DoubledObjective``
    from the folder that holds the file: the run trains with it (its calls are counted in a marker file)."""
    (user_loss / "my_grpo_loss.py").write_text(USER_LOSS.replace(
        "CALLS.append(kwargs[\"step_count\"])",
        "CALLS.append(kwargs[\"step_count\"]); open('calls.txt', 'a').write('x')"))
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "lit_llm.cli_entry", "fit", "--config", str(root / "configs/grpo_tiny.yaml"),
           "--model.init_args.objective", "my_grpo_loss:DoubledObjective", "--trainer.max_steps", "2",
           "--trainer.default_root_dir", str(user_loss / "run"), "--trainer.enable_progress_bar", "false",
           "--trainer.num_sanity_val_steps", "0", "--trainer.val_check_interval", "null"]
    out = subprocess.run(cmd, cwd=user_loss, capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len((user_loss / "calls.txt").read_text()) >= 2  # every micro-batch of both steps
    assert torch.load(user_loss / "run/checkpoints/last.ckpt", weights_only=False)["hyper_parameters"][
        "objective"] == "my_grpo_loss:DoubledObjective"


def test_objective_settings_are_checked_at_construction():
    """The rollout-correction settings are the objective's own rules, checked when it is built (not at the first
    step)."""
    with pytest.raises(ValueError, match="rollout_correction"):
        GRPOObjective(rollout_correction="bogus")
    with pytest.raises(ValueError):
        GRPOObjective(rollout_correction="token_truncate", rollout_correction_clip_max=-5.0)


def test_objective_metrics_without_grpo_loss_keys_are_named(user_loss):
    (user_loss / "plain_loss.py").write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from lit_llm.objectives import GRPOObjective

        @dataclass(frozen=True)
        class Plain(GRPOObjective):
            def __call__(self, *args, **kwargs):
                loss, _ = super().__call__(*args, **kwargs)
                return loss, {"loss": loss.detach()}
    '''))
    with pytest.raises(ValueError, match=r"GRPOModule: the objective's metrics lack \['num_tokens'"):
        fit(1, objective="plain_loss:Plain")


def test_weights_only_loading_skips_the_users_objective(user_loss, tmp_path_factory, monkeypatch):
    """Inside environment_unresolved (lit-llm export / chat / evaluate load a checkpoint for its weights), a user's
    objective is not imported: a checkpoint exports from a folder where its file is not."""
    from lit_llm.lightning.grpo import environment_unresolved

    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    with environment_unresolved():
        module = GRPOModule("tiny", num_generations=2, objective="my_grpo_loss:SequenceObjective")
    assert type(module.objective) is GRPOObjective and module.hparams["objective"] == "my_grpo_loss:SequenceObjective"
