"""A GRPO run on a prompt dataset: the file's extra columns reach the reward functions as keyword lists aligned with
the completions (one entry per completion: each prompt's value repeated num_generations times), in training and in
the greedy evaluation."""

from __future__ import annotations

import json

import torch
from lightning.pytorch import Trainer

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule

SEEN: list[dict] = []


def columns_reward(prompts, completions, completion_ids, answer, tests, **kwargs):
    """Records what it receives; 1.0 when the completion is non-empty (any value: only the plumbing is tested)."""
    SEEN.append({"prompts": list(prompts), "answer": list(answer), "tests": list(tests), "extra": sorted(kwargs)})
    return [1.0 if c else 0.0 for c in completions]


def test_dataset_columns_reach_reward_functions(tmp_path, one_thread):
    rows = [{"prompt": f"Count to {i}:", "answer": str(i), "tests": [f"t{i}a", f"t{i}b"]} for i in range(6)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    SEEN.clear()
    module = GRPOModule("tiny", reward_funcs=[columns_reward], num_generations=2, max_new_tokens=3,
                        micro_batch_size=8, log_samples_every=0, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    dm = GRPODataModule(path=str(path), batch_size=2, num_eval=2, eval_batch_size=2)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=1, limit_val_batches=1, val_check_interval=1, check_val_every_n_epoch=None)
    trainer.fit(module, dm)
    assert dm.columns == ["answer", "tests"]
    by_prompt = {r["prompt"]: r for r in rows}
    train_calls = [c for c in SEEN if len(c["prompts"]) == 4]  # 2 prompts x 2 generations
    eval_calls = [c for c in SEEN if len(c["prompts"]) == 2]  # greedy: one completion per held-out prompt
    assert train_calls and eval_calls
    for call in SEEN:
        assert call["extra"] == ["trainer_state"]  # nothing else than the dataset's columns and TRL's arguments
        for prompt, answer, tests in zip(call["prompts"], call["answer"], call["tests"]):
            assert answer == by_prompt[prompt]["answer"] and tests == by_prompt[prompt]["tests"]
    first = train_calls[0]["prompts"]
    assert first[0] == first[1] and first[2] == first[3]  # each prompt's columns repeated per generation
