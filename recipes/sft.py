"""Supervised fine-tuning, written out: what ``lit-llm fit --config configs/sft_gsm8k.yaml`` does, in plain Python.

    python recipes/sft.py --out runs/recipe_sft        # GSM8K from the Hub (openai/gsm8k, HF cache)
    python recipes/sft.py --model tiny --format arithmetic --max-steps 20 --eval-every 10 --precision 32-true \\
        --no-wandb --out runs/recipe_tiny                                                              # seconds

Every default below is the config's value (``tests/recipes/test_recipes_match_configs.py`` checks that, key by key,
without training). Four steps: :func:`build` makes the policy (model, loss head, optimizer), the data (tokenised once
with the model's chat template, one batch = one optimizer step) and the Lightning ``Trainer``'s settings (CSV and
W&B metrics, checkpoints, generated samples); :func:`main` trains and exports the result as a Hugging Face folder.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Trainer, seed_everything

from lit_llm.lightning import SFTDataModule, SFTModule, ValidationSamples
from lit_llm.lightning.callbacks import StepCheckpoint
from lit_llm.lightning.cli import default_loggers
from lit_llm.lightning.export import export_checkpoint
from lit_llm.lightning.precision import PRECISION_VALUES, explain_precision
from lit_llm.lightning.progress import StepProgressBar


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model, 'tiny', or a local HF folder")
    p.add_argument("--loss", default="sft", choices=["sft", "rlhf", "generic"], help="loss head")
    p.add_argument("--data-path", default="openai/gsm8k:main:train",
                   help="training rows: a file or Hub NAME:CONFIG:SPLIT (chat, prompt/completion or GSM8K rows; "
                        "ignored for --format arithmetic)")
    p.add_argument("--val-path", default="openai/gsm8k:main:test", help="validation rows ('' for none)")
    p.add_argument("--format", default="gsm8k", choices=["auto", "chat", "prompt_completion", "gsm8k", "arithmetic"])
    p.add_argument("--limit", type=int, default=512, help="first N training rows")
    p.add_argument("--val-limit", type=int, default=100, help="first N validation rows")
    p.add_argument("--num-samples", type=int, default=256, help="arithmetic problems (--format arithmetic)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=8, help="samples per forward pass (accumulation)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--eval-every", type=int, default=32, help="optimizer steps between validations")
    p.add_argument("--precision", default="auto", choices=list(dict.fromkeys(map(str, PRECISION_VALUES))),
                   metavar="PRECISION",
                   help="auto: bf16-mixed where bf16 matmuls are native (GPU with bf16, CPU with AVX512-BF16 or AMX), "
                        "else 32-true; or force 32-true, bf16-mixed, ...")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=True,
                   help="add an offline WandbLogger next to the CSV one")
    p.add_argument("--out", default="runs/recipe_sft", help="run folder: csv/, checkpoints/, hf/")
    return p.parse_args(argv)


def build(argv: Sequence[str] | None = None) -> tuple[SFTModule, SFTDataModule, dict[str, Any]]:
    """The module, the data module and the ``Trainer`` keyword arguments of the job, without training."""
    args = parse_args(argv)
    seed_everything(args.seed)
    out = Path(args.out)

    # 1. The policy: an HF causal LM + its tokenizer, a loss head, an optimizer. Token-mean normalisation over the
    #    whole optimizer step (DESIGN.md property 6); no KL to the initial model.
    module = SFTModule(args.model, loss=args.loss, normalization="token", kl_coef=0.0, grad_clip=1.0,
                       optimizer=partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.0))

    # 2. The data: rows rendered once with the chat template (exact masks), truncated to max_length, grouped by
    #    length. The tokenizer and loss head come from the module when the Trainer attaches both.
    arithmetic = args.format == "arithmetic"  # the synthetic task reads no file
    data = SFTDataModule(None if arithmetic else args.data_path,
                         eval_path=None if arithmetic else args.val_path or None, format=args.format, limit=args.limit,
                         eval_limit=args.val_limit, num_samples=args.num_samples, system_prompt=None,
                         max_length=args.max_length, batch_size=args.batch_size,
                         micro_batch_size=args.micro_batch_size, on_bad_row="raise", seed=args.seed)

    # 3. The Trainer: CSV (+ W&B) metrics, validation on 8 batches every eval_every steps, a checkpoint every 16
    #    steps plus last.ckpt, and 4 generated answers after each validation.
    #    Precision "auto" resolves as the CLI's does: bf16-mixed where bf16 matmuls are native, else 32-true.
    precision, line = explain_precision(args.precision, accelerator="auto")
    print(line)
    trainer_kwargs: dict[str, Any] = dict(
        default_root_dir=str(out), accelerator="auto", devices=1, precision=precision,
        max_steps=args.max_steps, log_every_n_steps=1, val_check_interval=args.eval_every,
        check_val_every_n_epoch=None, limit_val_batches=8, num_sanity_val_steps=0,
        logger=default_loggers(str(out), wandb=args.wandb),
        callbacks=[StepCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0, every_n_train_steps=16),
                   ValidationSamples(num_samples=4, max_new_tokens=128), StepProgressBar()],
    )
    return module, data, trainer_kwargs


def main(argv: Sequence[str] | None = None) -> Path:
    """Train, then export; returns the exported HF folder."""
    module, data, trainer_kwargs = build(argv)
    out = Path(trainer_kwargs["default_root_dir"])
    trainer = Trainer(**trainer_kwargs)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(out / "checkpoints" / "final.ckpt")

    # 4. Export: a folder that AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained load.
    return export_checkpoint(out / "checkpoints" / "final.ckpt", out / "hf", overwrite=True)


if __name__ == "__main__":
    print(f"exported to {main()}")
