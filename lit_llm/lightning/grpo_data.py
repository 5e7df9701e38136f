"""Prompt datamodules of GRPO: the synthetic arithmetic task (no download) and GSM8K prompts from a JSONL file.

A GRPO training batch is the set of **prompts of one optimizer step** (per rank): the module expands each prompt to
``num_generations`` completions (:class:`lit_llm.rollouts.RolloutEngine`) and cuts the rollouts into
micro-batches itself. A prompt batch is a dict (TRL's prompt-dataset columns)::

    {"prompt": [P message lists], "prompt_ids": [P 1-D long tensors], "sample_id": [P str], "answer": [P str]}

``prompt_ids`` are the prompts rendered once with the chat template and the generation prompt (the ids the model
continues); ``answer`` and any other column reach the reward functions as keyword arguments.

The training loader is stateful (``state_dict``/``load_state_dict``, saved by Lightning in checkpoints) so a resumed
run sees the same prompts as an uninterrupted one; in DDP each rank takes its own share of every step's prompts. The
validation loader holds the held-out prompts used for greedy evaluation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_llm.data.arithmetic import DEFAULT_TEMPLATE, arithmetic_prompts, arithmetic_split
from lit_llm.data.datasets import DataFormatError, read_jsonl
from lit_llm.data.prompts import tokenize_prompts

__all__ = ["GRPODataModule", "PromptBatchLoader", "collate_prompts", "gsm8k_prompts"]


def gsm8k_prompts(path: str, *, option: str = "--data.path", system_prompt: str | None = None,
                  limit: int | None = None,
                  on_bad_row: Literal["raise", "skip"] = "raise") -> list[dict[str, Any]]:
    """GSM8K rows (``{"question", "answer"}`` JSONL) as prompt rows.

    Args:
        path: the JSONL file (e.g. ``gsm8k/train.jsonl``).
        option: the CLI option that holds ``path``, named when the file is missing.
        system_prompt: optional system message before the question.
        limit: keep the first ``limit`` rows.
        on_bad_row: ``"raise"`` stops at a bad row naming file and line; ``"skip"`` drops it.

    Returns:
        Rows ``{"prompt": [messages], "answer": str (verbatim, with its "#### n" line), "sample_id": "file:line"}``.

    Raises:
        FileNotFoundError: no such file. DataFormatError: a row without a non-empty string ``question``/``answer``,
            or no row left.
    """
    rows = read_jsonl(path, on_bad_row=on_bad_row, option=option)
    if limit is not None:
        rows = rows[:limit]
    out = []
    for line, row in rows:
        where = f"{Path(path).expanduser()}:{line}"
        bad = [k for k in ("question", "answer") if not isinstance(row.get(k), str) or not row[k].strip()]
        if bad:
            if on_bad_row == "raise":
                raise DataFormatError(f"{where}: missing or empty key(s) {bad} (row keys: {sorted(row)}); GSM8K rows "
                                      f"need 'question' and 'answer' strings. Fix the row or set --data.on_bad_row "
                                      f"skip.")
            continue
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": row["question"]})
        out.append({"prompt": messages, "answer": row["answer"], "sample_id": where})
    if not out:
        raise DataFormatError(f"{path}: no usable GSM8K row.")
    return out


def collate_prompts(rows: Sequence[dict[str, Any]]) -> dict[str, list]:
    """Column-wise prompt batch: ``{key: [row[key] for row in rows]}`` (``prompt_ids`` stay a list of tensors).

    Raises:
        ValueError: no rows, or rows with different keys.
    """
    if not rows:
        raise ValueError("collate_prompts: empty batch.")
    keys = list(rows[0])
    for r in rows[1:]:
        if list(r) != keys:
            raise ValueError(f"collate_prompts: rows have different keys ({keys} vs {list(r)}).")
    return {k: [r[k] for r in rows] for k in keys}


class PromptBatchLoader:
    """Resumable iterable of prompt batches for one rank (one batch = the prompts of one optimizer step).

    Each epoch shuffles the rows with ``seed + epoch``; a global step takes ``batch_size * world_size`` rows, dealt to
    the ranks round-robin; a final incomplete step is dropped (so every step has the same number of prompts).

    Args:
        rows: prompt rows (with ``prompt_ids``).
        batch_size: prompts per step per rank.
        seed: shuffling seed.
        shuffle: shuffle every epoch.
        rank, world_size: this rank and the number of ranks.

    Raises:
        ValueError: ``batch_size < 1`` or fewer rows than one global step needs.
    """

    def __init__(self, rows: list[dict[str, Any]], *, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size (prompts per step) must be >= 1, got {batch_size}.")
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._num_steps = len(rows) // (batch_size * world_size)
        if self._num_steps == 0:
            raise ValueError(f"{len(rows)} prompts cannot fill one step of batch_size={batch_size} x "
                             f"{world_size} rank(s); add prompts or lower data.batch_size.")

    def __len__(self) -> int:
        return self._num_steps

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """This rank's row indices of every step of ``epoch`` (deterministic in ``seed`` and ``epoch``)."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        g = self.batch_size * self.world_size
        return [order[s * g:(s + 1) * g][self.rank::self.world_size] for s in range(self._num_steps)]

    def __iter__(self) -> Iterator[dict[str, list]]:
        if self.position >= self._num_steps:
            self.epoch, self.position = self.epoch + 1, 0
        plan = self.epoch_plan(self.epoch)
        while self.position < self._num_steps:
            step = plan[self.position]
            self.position += 1  # counted when handed out: a checkpoint after this step resumes after it
            yield collate_prompts([self.rows[i] for i in step])

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the epoch and the number of its steps already handed out."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (Lightning calls it when resuming from a checkpoint)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class GRPODataModule(LightningDataModule):
    """Prompts for GRPO: the synthetic arithmetic task or GSM8K questions, with held-out evaluation prompts.

    Args:
        task: ``"arithmetic"`` (synthetic ``"What is a + b? Reply with just the number."``, seeded, train/eval
            disjoint) or ``"gsm8k"`` (``question``/``answer`` JSONL at ``path``).
        path: GSM8K training JSONL (``task="gsm8k"``).
        eval_path: GSM8K evaluation JSONL (``None``: hold out ``num_eval`` rows of ``path``, seeded).
        batch_size: prompts per optimizer step per rank (each becomes ``num_generations`` completions).
        eval_batch_size: prompts per greedy-evaluation batch.
        num_train: arithmetic training problems (GSM8K: row limit of ``path``, ``None`` = all).
        num_eval: held-out evaluation prompts.
        low, high: arithmetic operand range (inclusive).
        ops: arithmetic operators among ``"+"``, ``"-"``, ``"*"``.
        template: arithmetic question template with ``{a}``, ``{op}``, ``{b}``.
        system_prompt: optional system message of every prompt.
        chat_template: Jinja string or ``.jinja`` path (``None`` = the tokenizer's own).
        max_prompt_length: drop (and count) prompts with more tokens (``None`` = keep all).
        on_bad_row: GSM8K rows: ``"raise"`` or ``"skip"``.
        seed: problem generation, evaluation hold-out and per-epoch shuffling.
        tokenizer: model name or path whose tokenizer renders the prompts; ``None`` = the attached module's.

    Raises:
        ValueError: an unknown task, ``task="gsm8k"`` without ``path``, bad sizes (checked in ``__init__``);
            data errors in :meth:`setup`.
    """

    def __init__(self, task: Literal["arithmetic", "gsm8k"] = "arithmetic", *, path: str | None = None,
                 eval_path: str | None = None, batch_size: int = 8, eval_batch_size: int = 32,
                 num_train: int | None = 1000, num_eval: int = 200, low: int = 10, high: int = 99,
                 ops: list[str] | None = None, template: str = DEFAULT_TEMPLATE, system_prompt: str | None = None,
                 chat_template: str | None = None, max_prompt_length: int | None = None,
                 on_bad_row: Literal["raise", "skip"] = "raise", seed: int = 0, tokenizer: str | None = None) -> None:
        super().__init__()
        if task not in ("arithmetic", "gsm8k"):
            raise ValueError(f"GRPODataModule: unknown task {task!r}; choose 'arithmetic' or 'gsm8k'.")
        if task == "gsm8k" and not path:
            raise ValueError("GRPODataModule: task='gsm8k' needs --data.path (a JSONL file of 'question'/'answer' "
                             "rows, e.g. gsm8k/train.jsonl).")
        if batch_size < 1 or eval_batch_size < 1 or num_eval < 0:
            raise ValueError(f"GRPODataModule: batch_size and eval_batch_size must be >= 1 and num_eval >= 0, got "
                             f"{batch_size}, {eval_batch_size}, {num_eval}.")
        self.save_hyperparameters()
        self.task, self.path, self.eval_path = task, path, eval_path
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_train, self.num_eval, self.low, self.high = num_train, num_eval, low, high
        self.ops = list(ops or ["+"])
        self.template, self.system_prompt, self.chat_template = template, system_prompt, chat_template
        self.max_prompt_length, self.on_bad_row, self.seed = max_prompt_length, on_bad_row, seed
        self.tokenizer_name = tokenizer
        self.tokenizer: Any = None
        self.train_rows: list[dict[str, Any]] = []
        self.eval_rows: list[dict[str, Any]] = []
        self.num_dropped_long = 0

    def _module_attr(self, name: str) -> Any:
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return getattr(module, name, None)

    def setup(self, stage: str | None = None) -> None:
        """Build (arithmetic) or read (GSM8K) the prompts and render them once (``prompt_ids``)."""
        if self.tokenizer is None:
            from lit_llm.lightning.datamodules import resolve_tokenizer

            self.tokenizer = (resolve_tokenizer(self.tokenizer_name) if self.tokenizer_name is not None
                              else self._module_attr("tokenizer") or resolve_tokenizer(None))
        if self.train_rows:
            return
        if self.task == "arithmetic":
            kw = dict(seed=self.seed, low=self.low, high=self.high, ops=self.ops, template=self.template,
                      system_prompt=self.system_prompt)
            if self.num_eval:
                train, held = arithmetic_split(self.num_train or 1000, self.num_eval, **kw)
            else:
                train, held = arithmetic_prompts(self.num_train or 1000, **kw), []
        else:
            train = gsm8k_prompts(self.path, system_prompt=self.system_prompt, limit=self.num_train,
                                  on_bad_row=self.on_bad_row)
            if self.eval_path:
                held = gsm8k_prompts(self.eval_path, option="--data.eval_path", system_prompt=self.system_prompt,
                                     limit=self.num_eval, on_bad_row=self.on_bad_row) if self.num_eval else []
            else:
                order = list(range(len(train)))
                random.Random(self.seed).shuffle(order)
                k = min(self.num_eval, len(train) - 1)
                out = set(order[:k])
                held = [r for i, r in enumerate(train) if i in out]
                train = [r for i, r in enumerate(train) if i not in out]
        self.train_rows = self._render(train)
        self.eval_rows = self._render(held)
        rank_zero_info(f"GRPODataModule({self.task}): {len(self.train_rows)} training / {len(self.eval_rows)} "
                       f"evaluation prompts; {self.num_dropped_long} dropped (longer than "
                       f"max_prompt_length={self.max_prompt_length}).")
        if not self.train_rows:
            raise DataFormatError(f"GRPODataModule: no training prompt left (max_prompt_length="
                                  f"{self.max_prompt_length} dropped {self.num_dropped_long}); raise it.")

    def _render(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not rows:
            return []
        ids = tokenize_prompts([r["prompt"] for r in rows], self.tokenizer, chat_template=self.chat_template)
        out = []
        for r, p in zip(rows, ids):
            if self.max_prompt_length is not None and p.numel() > self.max_prompt_length:
                self.num_dropped_long += 1
                continue
            out.append({**r, "prompt_ids": p})
        return out

    def train_dataloader(self) -> Any:
        """The resumable :class:`PromptBatchLoader`; an asynchronous module wraps it into its rollout producer
        (``module.wrap_train_loader``)."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        loader = PromptBatchLoader(self.train_rows, batch_size=self.batch_size, seed=self.seed, rank=rank,
                                   world_size=world)
        wrap = self._module_attr("wrap_train_loader")
        return wrap(loader) if callable(wrap) else loader

    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in fixed order, ``eval_batch_size`` per batch; ``[]`` when there are none."""
        if not self.eval_rows:
            return []
        return DataLoader(self.eval_rows, batch_size=self.eval_batch_size, shuffle=False, collate_fn=collate_prompts)

