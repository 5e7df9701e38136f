"""Supervised fine-tuning, written out: what ``lit-llm fit --config configs/sft_gsm8k.yaml`` does, in plain Python.

    python recipes/sft.py --data-path ../shared/data/gsm8k/train.jsonl --val-path ../shared/data/gsm8k/test.jsonl \\
        --format gsm8k --limit 512 --max-steps 64 --out runs/recipe_sft
    python recipes/sft.py --model tiny --format arithmetic --max-steps 20 --out runs/recipe_tiny   # seconds

Four steps: the policy (model, loss head, optimizer), the data (tokenised once with the model's chat template, one
batch = one optimizer step), the Lightning ``Trainer`` (CSV metrics, checkpoints, generated samples), and an export
of the result as a Hugging Face folder.
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

from lit_llm.lightning import SFTDataModule, SFTModule, ValidationSamples
from lit_llm.lightning.export import export_checkpoint


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model, 'tiny', or a local HF folder")
    p.add_argument("--loss", default="sft", choices=["sft", "rlhf", "generic"], help="loss head")
    p.add_argument("--data-path", default=None, help="training JSONL (chat, prompt/completion or GSM8K rows)")
    p.add_argument("--val-path", default=None, help="validation JSONL (default: none)")
    p.add_argument("--format", default="auto", choices=["auto", "chat", "prompt_completion", "gsm8k", "arithmetic"])
    p.add_argument("--limit", type=int, default=None, help="first N training rows")
    p.add_argument("--num-samples", type=int, default=256, help="arithmetic problems (--format arithmetic)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=None, help="samples per forward pass (accumulation)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/recipe_sft", help="run folder: csv/, checkpoints/, hf/")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    """Train, then export; returns the exported HF folder."""
    args = parse_args(argv)
    seed_everything(args.seed)
    out = Path(args.out)

    # 1. The policy: an HF causal LM + its tokenizer, a loss head, an optimizer. Token-mean normalisation over the
    #    whole optimizer step is the default (DESIGN.md property 6).
    module = SFTModule(args.model, loss=args.loss, optimizer=partial(torch.optim.AdamW, lr=args.lr), grad_clip=1.0)

    # 2. The data: rows rendered once with the chat template (exact masks), truncated to max_length, grouped by
    #    length. The tokenizer and loss head come from the module when the Trainer attaches both.
    data = SFTDataModule(args.data_path, format=args.format, val_path=args.val_path, limit=args.limit,
                         val_limit=16, num_samples=args.num_samples, max_length=args.max_length,
                         batch_size=args.batch_size, micro_batch_size=args.micro_batch_size, seed=args.seed)

    # 3. The Trainer: CSV metrics, a checkpoint every 16 steps plus last.ckpt, generated answers after validation.
    checkpoints = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=16)
    trainer = Trainer(
        default_root_dir=out, max_steps=args.max_steps, precision=args.precision, accelerator="auto", devices=1,
        logger=CSVLogger(out, name="csv"), callbacks=[checkpoints, ValidationSamples(num_samples=2)],
        log_every_n_steps=1, val_check_interval=max(1, args.max_steps // 2), check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(out / "checkpoints" / "final.ckpt")

    # 4. Export: a folder that AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained load.
    return export_checkpoint(out / "checkpoints" / "final.ckpt", out / "hf", overwrite=True)


if __name__ == "__main__":
    print(f"exported to {main()}")
