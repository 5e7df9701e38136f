"""LightningDataModule for supervised fine-tuning, and the resumable loader that yields one optimizer step per batch.

Normalisation design (DESIGN.md property 6): the training loader yields, per **optimizer step**, a dict
``{"micro_batches": [mb_1, ..., mb_k]}``: ``batch_size`` samples per rank cut into micro-batches of
``micro_batch_size`` samples (gradient accumulation lives here, not in ``Trainer(accumulate_grad_batches)``). The
module (manual optimisation) counts the trained tokens of the whole step over all micro-batches, all-reduces the count
over ranks and divides every micro-batch's token sum by it, so 2 micro-batches of different token counts give the
same gradient as one batch.

The loader is stateful (``state_dict`` / ``load_state_dict``, which Lightning saves in checkpoints), so a run resumed
from a mid-epoch checkpoint continues with exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_deprecation, rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lit_llm.data.chat_template import check_template_kwargs, resolve_template
from lit_llm.data.datasets import (
    DataFormatError,
    Example,
    RowFormat,
    TokenizedExample,
    arithmetic_examples,
    collate,
    examples_from_rows,
    read_examples,
    tokenize_example,
)
from lit_llm.data.packing import collate_packed
from lit_llm.data.rows import Skipped
from lit_llm.objectives.sft import loss_mask

__all__ = ["SYNTHETIC_FORMATS", "SFTDataModule", "StepBatchLoader", "calculator_examples", "deprecated_alias",
           "model_context", "module_attr", "resolve_tokenizer", "template_options"]

Head = Literal["sft", "rlhf", "generic"]
SYNTHETIC_FORMATS = ("arithmetic", "calculator")
"""``SFTDataModule`` formats that generate their rows (no ``path``)."""


def resolve_tokenizer(name: str | None) -> Any:
    """The tokenizer of a model name: ``None``, ``"tiny"`` and the embedded default use SmolLM2's; else a path."""
    from lit_llm.models import DEFAULT_MODEL, load_tokenizer

    return load_tokenizer(DEFAULT_MODEL if name in (None, "tiny") else name)


def module_attr(datamodule: LightningDataModule, name: str) -> Any:
    """Attribute ``name`` of the LightningModule attached to ``datamodule``'s trainer (``None`` without a trainer,
    a module or the attribute): how the data modules borrow the module's ``tokenizer``, ``loss``,
    ``chat_template``, ``chat_template_kwargs`` and ``wrap_train_loader``."""
    trainer = getattr(datamodule, "trainer", None)
    module = getattr(trainer, "lightning_module", None) if trainer is not None else None
    return getattr(module, name, None)


def model_context(datamodule: LightningDataModule) -> int | None:
    """The attached module's model context (``model.config.max_position_embeddings``), ``None`` when unknown."""
    context = getattr(getattr(module_attr(datamodule, "model"), "config", None), "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def template_options(datamodule: Any) -> tuple[Any, dict[str, Any]]:
    """``(chat_template, chat_template_kwargs)`` a data module renders with: its own ``chat_template`` when set, else
    the attached module's; always the module's ``chat_template_kwargs`` (``{}`` without one).

    Raises:
        ChatTemplateError: a ``chat_template_kwargs`` key that template never reads (with the data module's
            ``tokenizer`` set: :func:`~lit_llm.data.chat_template.check_template_kwargs`).
    """
    own = getattr(datamodule, "chat_template", None)
    template = own if own is not None else module_attr(datamodule, "chat_template")
    kwargs = module_attr(datamodule, "chat_template_kwargs") or {}
    tokenizer = getattr(datamodule, "tokenizer", None)
    if kwargs and tokenizer is not None:
        text, name = resolve_template(tokenizer, template)
        check_template_kwargs(text, kwargs, template_name=name)
    return template, kwargs


def deprecated_alias(owner: str, new: str, new_value: Any, new_default: Any, old: str, old_value: Any) -> Any:
    """The value of option ``new`` given that ``old`` is its deprecated alias (``old_value is None`` = not given).

    Warns (``rank_zero_deprecation``) when ``old`` is used.

    Raises:
        ValueError: both ``old`` and ``new`` were given (``new`` differs from its default), naming both.
    """
    if old_value is None:
        return new_value
    if new_value != new_default:
        raise ValueError(f"{owner}: both --data.{old} (deprecated) and --data.{new} are set; keep only "
                         f"--data.{new}.")
    rank_zero_deprecation(f"{owner}: --data.{old} is deprecated; use --data.{new} (same meaning).")
    return old_value


def trainable_tokens(sample: TokenizedExample, head: Head) -> int:
    """Number of positions of ``sample`` that the loss ``head`` trains on (see ``lit_llm.objectives.sft.loss_mask``)."""
    t = len(sample)
    mask = loss_mask(head, attention_mask=torch.ones(1, t, dtype=torch.bool),
                     assistant_mask=sample.assistant_mask[None], response_mask=sample.response_mask[None])
    return int(mask.sum())


class StepBatchLoader:
    """Iterable of optimizer-step batches for one rank, with length grouping and an exact-resume state.

    Each epoch draws a permutation of the samples from ``seed + epoch``; with ``group_by_length`` the permutation is
    cut into windows of ``length_group_steps`` global steps, each window is sorted by length (so a step holds
    samples of similar length and padding is small) and the order of the steps is shuffled. A global step of
    ``batch_size * world_size`` samples is dealt to the ranks round-robin; each rank's share is sorted by length and
    cut into micro-batches of ``micro_batch_size``. A final global step with fewer samples than ranks is dropped.

    With ``packing`` each micro-batch's rows are packed into sequences of at most ``pack_length`` tokens
    (:func:`~lit_llm.data.packing.collate_packed`: the packs that put the fewest positions through the model, never
    more than unpacked; rows never split): a step holds exactly the
    rows it holds without packing (same plan, same resume state), only with less padding.

    Yields:
        ``{"micro_batches": [collate(...), ...]}``; each micro-batch holds ``input_ids`` ``[b, T]`` long (right
        padding), ``attention_mask`` ``[b, T]`` long, ``assistant_mask`` / ``response_mask`` ``[b, T]`` bool and
        ``sample_ids`` (``"file:line"`` strings); with ``packing``, ``b`` packs plus ``position_ids``,
        ``row_index``, ``unpack_index`` and ``row_lengths`` (see :func:`~lit_llm.data.packing.collate_packed`).
    """

    def __init__(self, samples: list[TokenizedExample], *, batch_size: int, micro_batch_size: int, pad_token_id: int,
                 seed: int = 0, group_by_length: bool = True, length_group_steps: int = 16, rank: int = 0,
                 world_size: int = 1, packing: bool = False, pack_length: int | None = None) -> None:
        if not samples:
            raise ValueError("StepBatchLoader: no training samples.")
        if batch_size < 1 or micro_batch_size < 1:
            raise ValueError(f"batch_size and micro_batch_size must be >= 1, got {batch_size}, {micro_batch_size}.")
        if packing and (pack_length is None or pack_length < max(len(s) for s in samples)):
            raise ValueError(f"StepBatchLoader: packing needs pack_length >= the longest sample "
                             f"({max(len(s) for s in samples)} tokens), got {pack_length}.")
        self.packing, self.pack_length = packing, pack_length
        self.samples, self.batch_size, self.micro_batch_size = samples, batch_size, micro_batch_size
        self.pad_token_id, self.seed, self.group_by_length = pad_token_id, seed, group_by_length
        self.length_group_steps, self.rank, self.world_size = length_group_steps, rank, world_size
        self.epoch, self.position = 0, 0
        n, g = len(samples), batch_size * world_size
        self._num_steps = n // g + (1 if n % g >= world_size else 0)
        if self._num_steps == 0:
            raise ValueError(f"StepBatchLoader: {n} samples cannot give every one of {world_size} ranks a sample.")

    def __len__(self) -> int:
        return self._num_steps

    def epoch_plan(self, epoch: int) -> list[list[int]]:
        """The sample indices of this rank's steps in ``epoch`` (deterministic in ``seed``, ``epoch``)."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.samples)))
        rng.shuffle(order)
        g = self.batch_size * self.world_size
        if self.group_by_length:
            w = g * self.length_group_steps
            order = [i for s in range(0, len(order), w)
                     for i in sorted(order[s:s + w], key=lambda i: -len(self.samples[i]))]
        steps = [order[s:s + g] for s in range(0, len(order), g)][: self._num_steps]
        if self.group_by_length:
            rng.shuffle(steps)
        return [sorted(step[self.rank::self.world_size], key=lambda i: -len(self.samples[i])) for step in steps]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.position >= self._num_steps:  # the previous epoch was consumed: start the next one
            self.epoch, self.position = self.epoch + 1, 0
        plan = self.epoch_plan(self.epoch)
        while self.position < self._num_steps:
            step = plan[self.position]
            self.position += 1  # counted when handed out: a checkpoint taken after this step resumes after it
            m = self.micro_batch_size
            yield {"micro_batches": [self._collate([self.samples[i] for i in step[s:s + m]])
                                     for s in range(0, len(step), m)]}

    def _collate(self, rows: list[TokenizedExample]) -> dict[str, Any]:
        if self.packing:
            return collate_packed(rows, pad_token_id=self.pad_token_id, max_length=int(self.pack_length))
        return collate(rows, pad_token_id=self.pad_token_id)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the epoch and the number of its steps already handed out."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (Lightning calls it when resuming from a checkpoint)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def calculator_examples(num: int, num_val: int, *, seed: int, tools_in_system: bool,
                        system_prompt: str | None = None) -> tuple[list[Example], list[Example]]:
    """The synthetic calculator tool traces (:meth:`lit_llm.rollouts.envs.CalculatorEnv.make_sft_rows`) as chat
    examples: ``num`` training and ``num_val`` validation traces (the calculator task's disjoint train / eval
    problems). Each: [system,] user question, assistant ``<tool_call>``, tool result, assistant final answer; the
    prompt is every message before the final answer (the chat format), ``reference`` the final answer.

    Raises:
        ValueError: ``num < 1`` (from ``make_sft_rows``).
    """
    from lit_llm.rollouts.envs import CalculatorEnv

    def examples(n: int, split: str) -> list[Example]:
        rows = CalculatorEnv.make_sft_rows(n, seed, split=split, tools_in_system=tools_in_system,
                                           system_prompt=system_prompt)
        return examples_from_rows([(r["sample_id"], {"messages": r["messages"]}) for r in rows], fmt="chat")

    return examples(num, "train"), (examples(num_val, "eval") if num_val else [])


class SFTDataModule(LightningDataModule):
    """Chat / prompt-completion / GSM8K / plain-text rows (a JSONL, Parquet, CSV or JSON file, or a Hub dataset when
    online), or a synthetic task (arithmetic; calculator tool traces), tokenised for SFT.

    Every row is rendered once with the chat template (masks from the full render, DESIGN.md property 3), truncated
    to ``max_length`` tokens keeping the start; a row still longer than the attached model's context
    (``max_position_embeddings``) is a bad row (named at setup); rows left with no token for the loss head are
    dropped and counted
    (``num_dropped_no_tokens``); bad rows stop the run naming file and line, or are skipped and counted
    (``num_skipped_rows``) with ``on_bad_row="skip"``. The tokenizer and loss head default to the attached
    LightningModule's (``model.tokenizer``, ``model.loss``, ``model.chat_template``, ``model.chat_template_kwargs``),
    so the CLI needs no duplicate settings.

    Args:
        path: training data: a ``.jsonl`` / ``.parquet`` / ``.csv`` / ``.tsv`` / ``.json`` file, or a Hub dataset
            ``NAME[:CONFIG]:SPLIT`` when online (see :mod:`lit_llm.data.sources`). Must be ``None`` with
            ``format="arithmetic"`` or ``"calculator"`` (the synthetic tasks read no file: giving both is an error
            naming the fix).
        format: row format: ``"auto"`` (from the first row's keys), ``"chat"`` (``messages``),
            ``"prompt_completion"`` (``prompt``/``completion``: strings or message lists), ``"gsm8k"``
            (``question``/``answer``, answer kept verbatim), ``"text"`` (``text``: plain language modelling, needs
            the ``generic`` loss head), ``"arithmetic"`` (synthetic "a + b", no file) or ``"calculator"``
            (synthetic tool traces of the calculator task, no file: question, ``<tool_call>`` turn, tool result,
            final answer; :meth:`~lit_llm.rollouts.envs.CalculatorEnv.make_sft_rows`). The calculator tool reaches
            the template as the episode engine gives it: its schema through ``tools=`` when the chat template
            renders ``tools=`` (:func:`~lit_llm.rollouts.envs.template_supports_tools`), else described by a system
            message (SmolLM2), so a warmed-up model sees in RL the prompt it was trained on. Train it with the
            ``rlhf`` loss head (every assistant turn: the call and the answer; never the prompt or the tool result);
            the ``sft`` head trains the final answer only (a warning says so).
        eval_path: evaluation (validation) data, same format and sources as ``path`` (a Hub spec without a split
            reads ``test``); ``None`` = hold out ``eval_fraction`` of the training rows.
        eval_fraction: fraction of the training rows held out for validation when ``eval_path`` is ``None``
            (seeded); 0 = no validation unless ``eval_path``.
        limit: use only the first ``limit`` training rows (``None`` = all).
        eval_limit: use only the first ``eval_limit`` validation rows (``None`` = all).
        num_samples: number of synthetic problems (``format="arithmetic"`` / ``"calculator"``); validation draws
            ``eval_limit or 64`` others.
        system_prompt: system message prepended to every prompt that does not begin with one (GSM8K rows, string
            prompts, message lists, synthetic problems (after the calculator tool's description); never ``text``
            rows). ``None`` = none (the template may add its default).
        chat_template: Jinja string or ``.jinja`` path (``None`` = the attached module's ``chat_template``, else the
            tokenizer's own). Template variables come from the module's ``chat_template_kwargs``.
        max_length: tokens kept per conversation (the start is kept).
        batch_size: samples per optimizer step per rank.
        micro_batch_size: samples per forward/backward pass (``None`` = ``batch_size``); ``batch_size /
            micro_batch_size`` micro-batches are accumulated per step. Use this, not
            ``trainer.accumulate_grad_batches``.
        group_by_length: sort samples of similar length into the same step to cut padding.
        packing: pack each training micro-batch's rows into sequences of at most ``max_length`` tokens (TRL's
            ``packing=True``; the packs with the least padding, :mod:`lit_llm.data.packing`): position ids restart
            at 0 for each
            row and rows never attend to each other (the backbone runs with no attention mask and
            ``use_cache=False``, see :func:`lit_llm.policy.logprobs.token_hidden_states`). The step's rows, the loss
            and its token / sequence counts are exactly those of the unpacked run; only padding goes
            (``train/pad_fraction``). Validation batches stay unpacked. On GPU, flash-attention 2 reads the same
            position ids as varlen boundaries (``--model.attn_implementation flash_attention_2``; not tested here).
        length_group_steps: steps per length-sorting window (larger = less padding, less randomness).
        on_bad_row: ``"raise"`` (stop with file, line and fix) or ``"skip"`` (skip, count, warn).
        seed: seed of the validation split and of the per-epoch shuffles.
        tokenizer: model name or path whose tokenizer to use; ``None`` = the attached module's tokenizer.
        loss_head: loss head deciding which rows have trainable tokens; ``None`` = the attached module's ``loss``.
        num_workers: DataLoader workers for validation (training collates in the main process; data is
            tokenised once in ``setup``).
        val_path, val_fraction, val_limit: deprecated aliases of ``eval_path``, ``eval_fraction``, ``eval_limit``.

    Raises:
        ValueError: no ``path`` (unless a synthetic ``format``), ``path`` with a synthetic ``format``, bad sizes,
            or an alias given together with its new name (in ``__init__``). Data errors come from :meth:`setup`.
    """

    def __init__(self, path: str | None = None, *, format: RowFormat | Literal["arithmetic", "calculator"] = "auto",
                 eval_path: str | None = None, eval_fraction: float = 0.0, limit: int | None = None,
                 eval_limit: int | None = None, num_samples: int = 256, system_prompt: str | None = None,
                 chat_template: str | None = None, max_length: int = 1024, batch_size: int = 8,
                 micro_batch_size: int | None = None, group_by_length: bool = True, length_group_steps: int = 16,
                 packing: bool = False, on_bad_row: Literal["raise", "skip"] = "raise", seed: int = 0,
                 tokenizer: str | None = None, loss_head: Head | None = None, num_workers: int = 0,
                 val_path: str | None = None,
                 val_fraction: float | None = None, val_limit: int | None = None) -> None:
        super().__init__()
        name = "SFTDataModule"
        eval_path = deprecated_alias(name, "eval_path", eval_path, None, "val_path", val_path)
        eval_fraction = deprecated_alias(name, "eval_fraction", eval_fraction, 0.0, "val_fraction", val_fraction)
        eval_limit = deprecated_alias(name, "eval_limit", eval_limit, None, "val_limit", val_limit)
        if format in SYNTHETIC_FORMATS and (path or eval_path):
            raise ValueError(f"SFTDataModule: --data.format is {format!r} (the synthetic task reads no file) but "
                             f"--data.{'path' if path else 'eval_path'} is set. Fix: set --data.format auto (or chat, "
                             f"prompt_completion, gsm8k, text) to train on the file, or drop the path.")
        if format not in SYNTHETIC_FORMATS and not path:
            raise ValueError("SFTDataModule: --data.path is required (a JSONL / Parquet / CSV / JSON file of chats, "
                             "prompt/completion pairs, GSM8K or text rows), unless --data.format arithmetic or "
                             "calculator.")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"SFTDataModule: eval_fraction must be in [0, 1), got {eval_fraction}.")
        if max_length < 2:
            raise ValueError(f"SFTDataModule: max_length must be >= 2 tokens, got {max_length}.")
        micro = micro_batch_size or batch_size
        if batch_size < 1 or micro < 1 or batch_size % micro:
            raise ValueError(f"SFTDataModule: batch_size ({batch_size}) must be a positive multiple of "
                             f"micro_batch_size ({micro}).")
        self.save_hyperparameters()
        # the aliases resolved: checkpoints and the recipes/configs comparison see only the new names
        self.hparams.update(eval_path=eval_path, eval_fraction=eval_fraction, eval_limit=eval_limit, val_path=None,
                            val_fraction=None, val_limit=None)
        self.path, self.format, self.eval_path, self.eval_fraction = path, format, eval_path, eval_fraction
        self.limit, self.eval_limit, self.num_samples = limit, eval_limit, num_samples
        self.system_prompt, self.chat_template, self.max_length = system_prompt, chat_template, max_length
        self.batch_size, self.micro_batch_size = batch_size, micro
        self.group_by_length, self.length_group_steps = group_by_length, length_group_steps
        self.packing = packing
        self.on_bad_row, self.seed, self.num_workers = on_bad_row, seed, num_workers
        self.tokenizer_name, self.loss_head = tokenizer, loss_head
        self.tokenizer: Any = None
        self.tools: list[dict[str, Any]] | None = None  # tools= of every render (the calculator task's schema)
        self.train_samples: list[TokenizedExample] = []
        self.val_samples: list[TokenizedExample] = []
        self.num_skipped_rows = 0
        self.num_dropped_no_tokens = 0
        self.num_truncated = 0
        self._train_loader: StepBatchLoader | None = None
        self._loader_state: dict[str, int] | None = None

    # ------------------------------------------------------------------------------------------------------- setup
    def _head(self) -> Head:
        return self.loss_head or module_attr(self, "loss") or "sft"

    def setup(self, stage: str | None = None) -> None:
        """Read, tokenise, truncate and filter the data (once). Logs the skipped / dropped counts.

        Raises:
            FileNotFoundError, DataFormatError: missing file, bad row (``on_bad_row="raise"``), empty dataset,
                ``text`` rows with a loss head other than ``generic``, or no sample left with trainable tokens.
            HubOfflineError: a Hub dataset name while offline.
        """
        if self.tokenizer is None:
            self.tokenizer = (resolve_tokenizer(self.tokenizer_name) if self.tokenizer_name is not None
                              else module_attr(self, "tokenizer") or resolve_tokenizer(None))
        if self.train_samples or self.val_samples:
            return
        skipped = Skipped()
        if self.format == "arithmetic":
            train, val = arithmetic_examples(self.num_samples, self.eval_limit or 64, seed=self.seed,
                                             system_prompt=self.system_prompt)
        elif self.format == "calculator":
            train, val = self._calculator_examples()
        else:
            train = read_examples(self.path, fmt=self.format, system_prompt=self.system_prompt,
                                  on_bad_row=self.on_bad_row, limit=self.limit, skipped=skipped)
            val = []
            if self.eval_path:
                val = read_examples(self.eval_path, fmt=self.format, system_prompt=self.system_prompt,
                                    on_bad_row=self.on_bad_row, limit=self.eval_limit, skipped=skipped,
                                    option="--data.eval_path", split="test")
            elif self.eval_fraction > 0:
                order = list(range(len(train)))
                random.Random(self.seed).shuffle(order)
                k = max(1, round(self.eval_fraction * len(train)))
                held = set(order[:k])
                val = [e for i, e in enumerate(train) if i in held][: self.eval_limit]
                train = [e for i, e in enumerate(train) if i not in held]
            self._check_text_head(train + val)
        self.train_samples = self._tokenize(train, skipped, "training")
        self.val_samples = self._tokenize(val, skipped, "validation") if val else []
        self.num_skipped_rows = skipped.count
        if skipped.count:
            shown = "; ".join(why for _, why in skipped.first)
            rank_zero_warn(f"SFTDataModule: skipped {skipped.count} bad row(s) (on_bad_row='skip'). First: {shown}")
        rank_zero_info(f"SFTDataModule: {len(self.train_samples)} training / {len(self.val_samples)} validation "
                       f"samples; {self.num_truncated} truncated to max_length={self.max_length}, "
                       f"{self.num_dropped_no_tokens} dropped with no trainable token (head {self._head()!r}), "
                       f"{self.num_skipped_rows} bad rows skipped.")

    def _calculator_examples(self) -> tuple[list[Example], list[Example]]:
        """The calculator traces, with the tool given as the episode engine gives it (``tools=`` or a system
        message); warns when the loss head leaves the tool-call turn untrained."""
        from lit_llm.rollouts.envs import CalculatorEnv, prompt_with_tools, template_supports_tools

        template, template_kwargs = template_options(self)
        takes_tools = template_supports_tools(self.tokenizer, template, **template_kwargs)
        _, self.tools = prompt_with_tools([], CalculatorEnv.tools, template_takes_tools=takes_tools)
        head = self._head()
        if head != "rlhf":
            what = ("trained together with the prompt and the tool result" if head == "generic"
                    else "not trained (only the final answer is)")
            rank_zero_warn(f"SFTDataModule: format 'calculator' with loss head {head!r}: the tool-call turn is "
                           f"{what}; set --model.loss rlhf to train every assistant turn and nothing else.")
        return calculator_examples(self.num_samples, self.eval_limit or 64, seed=self.seed,
                                   tools_in_system=not takes_tools, system_prompt=self.system_prompt)

    def _check_text_head(self, examples: list[Example]) -> None:
        head = self._head()
        text = next((e for e in examples if e.text is not None), None)
        if text is not None and head != "generic":
            raise DataFormatError(
                f"{text.sample_id}: 'text' rows (plain language modelling) have no prompt or assistant turn, so the "
                f"{head!r} loss head has nothing to train on. Fix: set --model.loss generic (trains on every token), "
                f"or give 'messages' / 'prompt' + 'completion' rows.")

    def _tokenize(self, examples: list[Example], skipped: Skipped, split: str) -> list[TokenizedExample]:
        out, head = [], self._head()
        template, template_kwargs = template_options(self)
        if self.tools is not None:
            template_kwargs = {**template_kwargs, "tools": self.tools}
        context = model_context(self)
        for ex in examples:
            try:
                s = tokenize_example(ex, self.tokenizer, chat_template=template, max_length=self.max_length,
                                     chat_template_kwargs=template_kwargs)
                self._check_context(s, ex.sample_id, context)
            except DataFormatError as e:
                if self.on_bad_row == "raise":
                    raise DataFormatError(f"{e} Fix the row, or set --data.on_bad_row skip.") from e
                skipped.count += 1
                if len(skipped.first) < 5:
                    skipped.first.append((ex.sample_id, str(e)))
                continue
            self.num_truncated += int(s.truncated)
            if trainable_tokens(s, head) == 0:
                self.num_dropped_no_tokens += 1
                continue
            out.append(s)
        if not out and split == "training":
            raise DataFormatError(
                f"SFTDataModule: no {split} sample left with a trainable token for loss head {head!r} (of "
                f"{len(examples)} rows; {self.num_dropped_no_tokens} emptied by max_length={self.max_length}). "
                f"Raise --data.max_length or check the data.")
        return out

    def _check_context(self, sample: TokenizedExample, sample_id: str, context: int | None) -> None:
        """Refuse a sample longer than the model's context (``max_length`` above it), naming its row at setup
        rather than when a step draws it.

        Raises:
            DataFormatError: names the row, its length, the context and the ``max_length`` fix.
        """
        if context is None or len(sample) <= context:
            return
        cut = f" (cut to --data.max_length {self.max_length})" if sample.truncated else ""
        raise DataFormatError(f"{sample_id}: {len(sample)} tokens{cut}, more than the model's context of {context} "
                              f"tokens: set --data.max_length {context} (or lower) to truncate such rows, keeping "
                              f"the start.")

    def _log_counts(self) -> None:
        """Log the ``data/*`` counts of :meth:`setup` at step 0, once, from :meth:`train_dataloader` (called after a
        resumed fit restored its ``global_step``), and only in a fit that starts at step 0: a resumed fit, or a
        ``validate`` / ``test`` run, would put a step-0 row in its new CSV version, which reads as a run starting
        over (:mod:`lit_llm.plot`). :meth:`setup` prints the counts in every run."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or getattr(self, "_counts_logged", False) or trainer.global_step != 0:
            return
        self._counts_logged = True
        for logger in getattr(trainer, "loggers", None) or []:
            logger.log_metrics({"data/skipped_rows": float(self.num_skipped_rows),
                                "data/dropped_no_trainable_tokens": float(self.num_dropped_no_tokens),
                                "data/truncated": float(self.num_truncated),
                                "data/train_samples": float(len(self.train_samples))}, step=0)

    # -------------------------------------------------------------------------------------------------- loaders
    def train_dataloader(self) -> StepBatchLoader:
        """The resumable per-optimizer-step loader (see :class:`StepBatchLoader`); logs the data counts in a fresh
        fit (:meth:`_log_counts`)."""
        trainer = self.trainer
        self._log_counts()
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        loader = StepBatchLoader(self.train_samples, batch_size=self.batch_size,
                                 micro_batch_size=self.micro_batch_size, pad_token_id=self._pad_id(), seed=self.seed,
                                 group_by_length=self.group_by_length, length_group_steps=self.length_group_steps,
                                 rank=rank, world_size=world, packing=self.packing, pack_length=self.max_length)
        self._train_loader = loader
        return loader

    def val_dataloader(self) -> DataLoader | list:
        """Micro-batches of ``micro_batch_size`` validation samples sorted by length (no shuffling); ``[]`` if none."""
        if not self.val_samples:
            return []
        ordered = sorted(self.val_samples, key=len, reverse=True)
        pad = self._pad_id()
        return DataLoader(ordered, batch_size=self.micro_batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=lambda s: collate(s, pad_token_id=pad))

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)
