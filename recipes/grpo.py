"""GRPO, written out: what ``lit-llm fit --config configs/grpo_arithmetic.yaml`` does, in plain Python.

    python recipes/grpo.py --max-steps 60 --out runs/recipe_grpo                 # SmolLM2 on "What is a + b?"
    python recipes/grpo.py --model tiny --max-steps 4 --out runs/recipe_grpo_tiny  # seconds, plumbing only

Three steps: the policy and its GRPO settings (rewards, group size, sampling, loss), the prompts (synthetic
arithmetic with disjoint held-out problems), and the Lightning ``Trainer``, which runs a greedy evaluation before
training (sanity check) and every ``--eval-every`` steps. Every training step: the generate version of the policy
samples ``num_generations`` completions per prompt, the reward functions score them, group-relative advantages are
formed, and the log-prob version trains on the sampled ids with the clipped surrogate (old log-probs = the
generation-time ones).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule

REWARDS = ["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward",
           "lit_llm.rewards:strict_number_format_reward"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model, 'tiny', or a local HF folder")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8, help="completions per prompt (group size)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--loss-type", default="dapo", choices=["dapo", "grpo", "dr_grpo", "bnpo"])
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    p.add_argument("--rollout-mode", default="sync", choices=["sync", "async"])
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--num-eval", type=int, default=200, help="held-out problems for greedy evaluation")
    p.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/recipe_grpo", help="run folder: csv/ and checkpoints/")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Trainer:
    """Train; returns the fitted ``Trainer`` (metrics in ``<out>/csv/version_N/metrics.csv``)."""
    args = parse_args(argv)
    seed_everything(args.seed)
    out = Path(args.out)

    # 1. The policy and GRPO's knobs (TRL names). The rewards are shaped: exact answer, lenient answer, format.
    module = GRPOModule(
        args.model, reward_funcs=REWARDS, reward_weights=[1.0, 0.5, 0.25], num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, loss_type=args.loss_type, beta=args.beta,
        epsilon=0.2, epsilon_high=0.28, rollout_mode=args.rollout_mode, micro_batch_size=16,
        eval_reward_funcs=REWARDS[:2], optimizer=partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0),
    )

    # 2. The prompts: seeded synthetic problems; the held-out ones never appear in training.
    data = GRPODataModule("arithmetic", batch_size=args.prompts_per_step, num_train=2000, num_eval=args.num_eval,
                          eval_batch_size=50, seed=args.seed)

    # 3. The Trainer: one batch = one optimizer step; greedy evaluation before training and every eval_every steps.
    trainer = Trainer(
        default_root_dir=str(out), max_steps=args.max_steps, precision=args.precision, accelerator="auto",
        devices=1, logger=CSVLogger(str(out), name="csv"), log_every_n_steps=1,
        val_check_interval=args.eval_every, check_val_every_n_epoch=None, num_sanity_val_steps=-1,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=args.eval_every)],
    )
    trainer.fit(module, data)
    print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items() if k.startswith(("eval/", "train/r"))})
    return trainer


if __name__ == "__main__":
    main()
