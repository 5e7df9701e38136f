"""GRPO, written out: what ``lit-llm fit --config configs/grpo_arithmetic.yaml`` does, in plain Python.

    python recipes/grpo.py --out runs/recipe_grpo                                  # SmolLM2 on "What is a + b?"
    python recipes/grpo.py --model tiny --max-steps 4 --precision 32-true --no-wandb --out runs/recipe_grpo_tiny

Every default below is the config's value (``tests/recipes/test_recipes_match_configs.py`` checks that, key by key,
without training). Three steps, in :func:`build`: the policy and its GRPO settings (rewards, group size, sampling,
loss), the prompts (synthetic arithmetic with disjoint held-out problems), and the Lightning ``Trainer``'s settings,
which run a greedy evaluation before training (sanity check) and every ``--eval-every`` steps; :func:`main` then
trains. Every training step: the generate version of the policy samples ``num_generations`` completions per prompt,
the reward functions score them, group-relative advantages are formed, and the log-prob version trains on the
sampled ids with the clipped surrogate (old log-probs = the generation-time ones).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything

from lit_llm.lightning.callbacks import StepCheckpoint
from lit_llm.lightning.cli import default_loggers
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.lightning.precision import PRECISION_VALUES, explain_precision
from lit_llm.lightning.progress import StepProgressBar

REWARDS = ["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:bare_number_closeness_curriculum_reward"]
EVAL_REWARDS = ["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model, 'tiny', or a local HF folder")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--loss-type", default="dapo", choices=["dapo", "grpo", "dr_grpo", "bnpo"])
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    p.add_argument("--rollout-mode", default="sync", choices=["sync", "async"])
    p.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="DAPO dynamic sampling (sync rollouts only: pass --no-dynamic-sampling with --rollout-mode "
                        "async)")
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--max-steps", type=int, default=50)
    p.add_argument("--max-time", default="00:01:00:00", help="wall-clock cap, dd:hh:mm:ss")
    p.add_argument("--eval-every", type=int, default=10, help="optimizer steps between greedy evaluations")
    p.add_argument("--checkpoint-every", type=int, default=25, help="optimizer steps between checkpoints")
    p.add_argument("--num-eval", type=int, default=200, help="held-out problems for greedy evaluation")
    p.add_argument("--precision", default="32-true", choices=list(dict.fromkeys(map(str, PRECISION_VALUES))),
                   metavar="PRECISION",
                   help="32-true (the recipe's seed sweep ran in fp32); auto: bf16-mixed where bf16 matmuls are native "
                        "(GPU with bf16, CPU with AVX512-BF16 or AMX), else 32-true; or bf16-mixed, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=True,
                   help="add an offline WandbLogger next to the CSV one")
    p.add_argument("--out", default="runs/recipe_grpo", help="run folder: csv/ and checkpoints/")
    return p.parse_args(argv)


def build(argv: Sequence[str] | None = None) -> tuple[GRPOModule, GRPODataModule, dict[str, Any]]:
    """The module, the data module and the ``Trainer`` keyword arguments of the job, without training."""
    args = parse_args(argv)
    seed_everything(args.seed)
    out = Path(args.out)

    # 1. The policy and GRPO's knobs (TRL names). The rewards: the exact answer, and a bare integer's closeness to it
    #    in a window that narrows from 100% to 10% of the answer over 20 steps. Advantages are group-centred but
    #    scaled by the batch std ("batch"). Dynamic sampling (DAPO) replaces groups whose rewards are all equal by
    #    informative groups of the next prompt batches (3 rollouts per step at most).
    module = GRPOModule(
        args.model, reward_funcs=REWARDS, reward_weights=[1.0, 1.0], num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, loss_type=args.loss_type,
        epsilon=0.2, epsilon_high=0.28, beta=args.beta, scale_rewards="batch", mask_truncated_completions=False,
        num_iterations=1, micro_batch_size=16, share_prompts=True, rollout_mode=args.rollout_mode,
        batching=True, rollout_workers=None, rollout_seed=args.seed, dynamic_sampling=args.dynamic_sampling,
        max_sampling_rounds=3,
        eval_reward_funcs=EVAL_REWARDS, eval_max_new_tokens=args.max_new_tokens, eval_samples=8,
        log_samples_every=5, grad_clip=1.0, optimizer=partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0),
    )

    # 2. The prompts: seeded synthetic "a + b" problems (10..99); the held-out ones never appear in training.
    data = GRPODataModule("arithmetic", batch_size=args.prompts_per_step, num_train=2000, num_eval=args.num_eval,
                          eval_batch_size=50, low=10, high=99, ops=["+"], seed=args.seed)

    # 3. The Trainer: one batch = one optimizer step; greedy evaluation before training and every eval_every steps;
    #    CSV (+ W&B) logs and a checkpoint every checkpoint_every steps plus last.ckpt, as the CLI writes them. No
    #    ValidationSamples callback: the evaluation logs its own samples (the config's samples.num_samples is 0).
    #    Precision: 32-true by default; "auto" resolves as the CLI's does (bf16-mixed where bf16 is native).
    precision, line = explain_precision(args.precision, accelerator="auto")
    print(line)
    trainer_kwargs: dict[str, Any] = dict(
        default_root_dir=str(out), accelerator="auto", devices=1, precision=precision,
        max_steps=args.max_steps, max_time=args.max_time, log_every_n_steps=1,
        val_check_interval=args.eval_every, check_val_every_n_epoch=None, num_sanity_val_steps=-1,
        enable_progress_bar=True, logger=default_loggers(str(out), wandb=args.wandb),
        callbacks=[StepCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0,
                                  every_n_train_steps=args.checkpoint_every), StepProgressBar()],
    )
    return module, data, trainer_kwargs


def main(argv: Sequence[str] | None = None) -> Trainer:
    """Train; returns the fitted ``Trainer`` (metrics in ``<out>/csv/version_N/metrics.csv``)."""
    module, data, trainer_kwargs = build(argv)
    trainer = Trainer(**trainer_kwargs)
    trainer.fit(module, data)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("eval/", "train/r"))})
    return trainer


if __name__ == "__main__":
    main()
