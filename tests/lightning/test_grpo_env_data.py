"""GRPODataModule tasks of the built-in environments (calculator, guess_number: their make_rows, train/eval splits, no
file) and a user environment's rows from a file (task null + path)."""

from __future__ import annotations

import pytest
from episode_models import CapitalAfterToolEnv, key_rows, write_rows

from lit_llm.lightning.grpo_data import ENVIRONMENT_TASKS, GRPODataModule, environment_rows
from lit_llm.rollouts import EpisodeEngine
from lit_llm.rollouts.envs import CalculatorEnv, GuessNumberEnv


def strip(rows):
    return [{k: v for k, v in r.items() if k != "prompt_ids"} for r in rows]


@pytest.mark.parametrize(("task", "cls", "columns"), [("calculator", CalculatorEnv, ["answer", "expression"]),
                                                      ("guess_number", GuessNumberEnv, ["secret", "max_value"])])
def test_environment_tasks_are_the_envs_rows(task, cls, columns):
    dm = GRPODataModule(task, num_train=12, num_eval=5, seed=3, tokenizer="tiny")
    dm.setup("fit")
    assert strip(dm.train_rows) == cls.make_rows(12, 3, split="train")
    assert strip(dm.eval_rows) == cls.make_rows(5, 3, split="eval")
    assert dm.columns == columns
    assert all(r["prompt_ids"].dtype.is_floating_point is False and r["prompt_ids"].numel() > 0 for r in dm.train_rows)
    if task == "calculator":  # disjoint problems
        assert not {r["expression"] for r in dm.train_rows} & {r["expression"] for r in dm.eval_rows}
    batch = next(iter(dm.train_dataloader()))
    assert sorted(batch) == sorted(["prompt", *columns, "sample_id", "prompt_ids"]) and len(batch["prompt"]) == 8


def test_environment_task_options():
    assert ENVIRONMENT_TASKS == ("calculator", "guess_number")
    dm = GRPODataModule("calculator", num_train=2, num_eval=0, system_prompt="Be exact.", tokenizer="tiny")
    dm.setup("fit")
    assert dm.train_rows[0]["prompt"][0] == {"role": "system", "content": "Be exact."} and dm.eval_rows == []
    with pytest.raises(ValueError, match="task='calculator' is a synthetic task and reads no file"):
        GRPODataModule("calculator", path="rows.jsonl")
    with pytest.raises(ValueError, match="unknown task 'calculater'.*'calculator', 'guess_number'"):
        GRPODataModule("calculater")
    with pytest.raises(ValueError, match="unknown task"):
        environment_rows("arithmetic", 3)


def test_user_environment_rows_from_a_file(tmp_path, tokenizer):
    """task null + path: the file's columns reach the environment's reset; its required columns check passes."""
    path = write_rows(tmp_path / "keys.jsonl", key_rows(10))
    dm = GRPODataModule(path=path, num_eval=2, batch_size=2, tokenizer="tiny")
    dm.setup("fit")
    assert dm.task is None and dm.columns == ["key", "mode"]
    assert len(dm.train_rows) == 8 and len(dm.eval_rows) == 2
    from lit_llm.models import tiny_model
    from lit_llm.policy.transformers_wrapper import TransformersWrapper

    policy = TransformersWrapper(tiny_model(tokenizer), tokenizer=tokenizer, input_mode="tokens",
                                 generate_kwargs={"max_new_tokens": 2, "temperature": 1.0})
    engine = EpisodeEngine(policy, tokenizer=tokenizer, env_factory=CapitalAfterToolEnv, num_generations=2)
    engine.check_columns(dm.columns)
    rb = engine.rollout(next(iter(dm.train_dataloader())), step=0)
    assert rb.num_rows == 4 and rb.sample_id[0].startswith(path)
