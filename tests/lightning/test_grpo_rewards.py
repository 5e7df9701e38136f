"""GRPOModule and the reward functions: the ``trainer_state`` they receive during a fit (sync and async rollouts,
evaluation) and the setup-time check of the dataset columns they need."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.rewards import RewardError, TrainerState

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _run_folder(tmp_path, monkeypatch):
    """Run in a temporary folder: the evaluation writes eval_samples.csv under the trainer's root (the cwd)."""
    monkeypatch.chdir(tmp_path)


class StateRecorder:
    """A reward function (callable object, TRL signature) that keeps the ``trainer_state`` of every call."""

    __name__ = "state_recorder"

    def __init__(self) -> None:
        self.states: list[TrainerState] = []

    def __call__(self, prompts, completions, completion_ids, trainer_state, **kwargs):
        self.states.append(trainer_state)
        return [float(len(c) % 2) for c in completion_ids]


def make(reward_funcs, *, steps=3, eval_reward_funcs=None, num_eval=0, dm=None, **module_kwargs):
    module = GRPOModule("tiny", reward_funcs=reward_funcs, eval_reward_funcs=eval_reward_funcs, num_generations=2,
                        max_new_tokens=3, micro_batch_size=4, log_samples_every=0, **module_kwargs)
    dm = dm or GRPODataModule(batch_size=2, num_train=20, num_eval=num_eval, eval_batch_size=4)
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=1.0 if num_eval else 0, val_check_interval=2 if num_eval else None,
                      check_val_every_n_epoch=None if num_eval else 1)
    return module, dm, trainer


def test_trainer_state_in_sync_rollouts_and_evaluation():
    """TRL passes ``trainer_state=self.state``: here the step each rollout is for, the epochs done (10 prompt
    batches per epoch: s / 10 before batch s) and max_steps, to the training and the evaluation reward functions."""
    train, evaluate = StateRecorder(), StateRecorder()
    train.__name__, evaluate.__name__ = "train_recorder", "eval_recorder"
    module, dm, trainer = make([train], steps=3, eval_reward_funcs=[evaluate], num_eval=4)
    trainer.fit(module, dm)
    assert train.states == [TrainerState(global_step=s, epoch=s / 10, max_steps=3) for s in range(3)]
    # one evaluation after the second batch (val_check_interval=2): 2 steps and 2 of 10 batches done
    assert evaluate.states == [TrainerState(global_step=2, epoch=0.2, max_steps=3)]


def test_trainer_state_counts_optimizer_steps_with_num_iterations():
    rec = StateRecorder()
    module, dm, trainer = make([rec], steps=4, num_iterations=2)
    trainer.fit(module, dm)
    assert [s.global_step for s in rec.states] == [0, 2]  # mu = 2 optimizer steps per batch of rollouts
    assert [s.epoch for s in rec.states] == [0.0, 0.1] and {s.max_steps for s in rec.states} == {4}


def test_trainer_state_max_steps_from_epochs():
    """Without trainer.max_steps, max_steps is Lightning's estimate of the run's optimizer steps (as TRL derives it
    from num_train_epochs)."""
    rec = StateRecorder()
    module, dm, _ = make([rec])
    trainer = Trainer(max_epochs=1, limit_train_batches=4, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0)
    trainer.fit(module, dm)
    assert rec.states == [TrainerState(global_step=s, epoch=s / 4, max_steps=4) for s in range(4)]


def test_trainer_state_in_async_rollouts_is_the_step_generated_at():
    rec = StateRecorder()
    module, dm, trainer = make([rec], steps=3, rollout_mode="async", max_staleness=3)
    trainer.fit(module, dm)
    steps = [s.global_step for s in rec.states]
    assert steps[0] == 0 and steps == sorted(steps) and steps[-1] <= 3, steps  # ahead of the trainer, never behind
    assert len(steps) >= 3 and {s.max_steps for s in rec.states} == {3}


def needs_difficulty(prompts, completions, completion_ids, difficulty, **kwargs):
    """A reward function reading a column the arithmetic prompts do not have."""
    raise AssertionError("never called: the column check fails at setup")


def test_missing_column_fails_at_setup_naming_it():
    module, dm, trainer = make(["strict_number_format_reward", needs_difficulty])
    with pytest.raises(RewardError, match=r"^reward function 'needs_difficulty' needs the column 'difficulty', but "
                                          r"the training prompts of GRPODataModule has only the columns "
                                          r"\['answer'\]\. Add the column"):
        trainer.fit(module, dm)
    assert module.versions.num_rollouts == 0


def test_missing_eval_column_fails_at_setup():
    module, dm, trainer = make(["strict_number_format_reward"], eval_reward_funcs=[needs_difficulty], num_eval=4)
    with pytest.raises(RewardError, match=r"'needs_difficulty' needs the column 'difficulty', but the evaluation "
                                          r"prompts of GRPODataModule has only the columns \['answer'\]"):
        trainer.fit(module, dm)
    # without held-out prompts the evaluation functions score nothing: no check, training runs
    module, dm, trainer = make(["strict_number_format_reward"], eval_reward_funcs=[needs_difficulty], steps=1)
    trainer.fit(module, dm)
    assert module.global_step == 1


class QuestionsOnly(GRPODataModule):
    """Prompts without an answer; declares its reward-visible columns."""

    def setup(self, stage=None):
        super().setup(stage)
        self.columns = ["question"]
        self.train_rows = [{k: v for k, v in r.items() if k != "answer"} | {"question": "q"} for r in self.train_rows]


def test_builtin_answer_reward_on_a_dataset_without_answers():
    module, dm, trainer = make(["gsm8k_answer_reward"], dm=QuestionsOnly(batch_size=2, num_train=20, num_eval=0))
    with pytest.raises(RewardError, match=r"'gsm8k_answer_reward' needs the column 'answer', but the training prompts "
                                          r"of QuestionsOnly has only the columns \['question'\]"):
        trainer.fit(module, dm)


def test_validate_checks_the_evaluation_functions():
    module, dm, trainer = make(["strict_number_format_reward"], eval_reward_funcs=["strict_arithmetic_reward"],
                               dm=QuestionsOnly(batch_size=2, num_train=20, num_eval=4))
    with pytest.raises(RewardError, match=r"'strict_arithmetic_reward' needs the column 'answer', but the evaluation "
                                          r"prompts of QuestionsOnly has only the columns \['question'\]"):
        trainer.validate(module, dm)
