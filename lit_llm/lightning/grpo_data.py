"""Prompt datamodule of GRPO: the user's prompt dataset (TRL's conventions), GSM8K, or the synthetic arithmetic task.

A prompt dataset (a JSONL / Parquet / CSV / JSON file, or a Hub dataset when online, read by
:func:`lit_llm.data.sources.read_rows`) has a ``prompt`` column, a string or a list of ``{"role", "content"}``
messages, as in TRL's ``GRPOTrainer``; **every other column** (``answer``, ``tests``, ...) is kept and reaches the
reward functions as a keyword list (``reward_fn(prompts, completions, completion_ids, answer=[...], tests=[...])``).
``rename_columns`` maps a file's column names to these (GSM8K is ``{"question": "prompt"}`` on the same loader, its
``answer`` kept verbatim).

A GRPO training batch is the set of **prompts of one optimizer step** (per rank): the module expands each prompt to
``num_generations`` completions (:class:`lit_llm.rollouts.RolloutEngine`) and cuts the rollouts into
micro-batches itself. A prompt batch is a dict of columns::

    {"prompt": [P prompts], "prompt_ids": [P 1-D long tensors], "sample_id": [P str], "answer": [P ...], ...}

``prompt_ids`` are the prompts rendered once (message lists with the chat template and the generation prompt, strings
as they are) -- the ids the model continues; ``prompt``, ``prompt_ids`` and ``sample_id`` are the engine's own keys
(``lit_llm.rollouts.engine.RESERVED_KEYS``), every other key is a reward column.

With an environment (``GRPOModule(environment=...)``) the same rows feed the episodes: each episode's
``env.reset(row)`` gets ``{"prompt", "sample_id", <columns>}``, and the environment's first messages are rendered by
the :class:`~lit_llm.rollouts.EpisodeEngine` (tools included), so ``prompt_ids`` are not used there.
``task: calculator`` / ``guess_number`` give the built-in environments' synthetic rows (no file).

The training loader is stateful (``state_dict``/``load_state_dict``, saved by Lightning in checkpoints) so a resumed
run sees the same prompts as an uninterrupted one (where Lightning does not load the state back, GRPO's
:class:`~lit_llm.lightning.versions.PolicyVersionSwitch` does: :func:`~lit_llm.lightning.versions.
resume_train_loader`); in DDP each rank takes
its own share of every step's prompts. With
``rollout_mode: async`` the checkpoint holds the position of the batches training consumed, not of those the
background producer drew ahead (:class:`~lit_llm.lightning.versions.StatefulAsyncRollouts`). The
validation loader holds the held-out prompts used for greedy evaluation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lit_llm.data.arithmetic import DEFAULT_TEMPLATE, arithmetic_prompts, arithmetic_split
from lit_llm.data.datasets import DataFormatError, with_system_prompt
from lit_llm.data.datasets import to_messages as _messages
from lit_llm.data.prompts import tokenize_prompts
from lit_llm.data.rows import check_renames
from lit_llm.data.sources import read_rows
from lit_llm.lightning.datamodules import model_context, module_attr, template_options
from lit_llm.lightning.prompt_loader import PromptBatchLoader, collate_prompts
from lit_llm.rollouts.engine import RESERVED_KEYS

__all__ = ["BUILTIN_TASKS", "ENVIRONMENT_TASKS", "GRPODataModule", "PromptBatchLoader", "collate_prompts",
           "environment_rows", "gsm8k_prompts", "prompt_rows"]

#: Tasks whose prompts are the synthetic rows of a built-in environment (``make_rows``), for GRPO with
#: ``model.environment`` set to the same name.
ENVIRONMENT_TASKS = ("calculator", "guess_number")

#: Every built-in ``task`` of :class:`GRPODataModule` (``None``, the prompts of a file, is not one).
BUILTIN_TASKS = ("arithmetic", "gsm8k", *ENVIRONMENT_TASKS)

#: Prompt-batch keys that are not dataset columns (the rollout engine's own; a dataset may not use them).
#: GSM8K as a prompt dataset: the question is the prompt; ``answer`` (with its ``#### n`` line) a reward column.
GSM8K_COLUMNS = {"question": "prompt"}


def prompt_rows(source: str, *, rename_columns: Mapping[str, str] | None = None, required: Sequence[str] = (),
                system_prompt: str | None = None, string_prompts: Literal["text", "chat"] = "text",
                limit: int | None = None, on_bad_row: Literal["raise", "skip"] = "raise",
                option: str = "--data.path", split: str = "train",
                rename_origin: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Read a prompt dataset: rows with a ``prompt`` column (after ``rename_columns``) and any other columns.

    Args:
        source: a file or Hub dataset spec (see :mod:`lit_llm.data.sources`).
        rename_columns: ``{file column: column}`` applied first (``{"question": "prompt"}`` for GSM8K).
        required: columns (new names) every row must hold with a non-empty value, besides ``prompt``.
        system_prompt: prepended as a system message to message-list prompts that do not begin with one, and to
            string prompts with ``string_prompts="chat"``.
        string_prompts: ``"text"`` (TRL's standard format: a string prompt is tokenised as it is, no chat template,
            and its completions reach reward functions as strings) or ``"chat"`` (a string prompt becomes one user
            message, rendered with the chat template; completions are message lists).
        limit: keep the first ``limit`` rows.
        on_bad_row: ``"raise"`` stops at a bad row naming its ``file:line`` / ``file:row N``; ``"skip"`` drops it.
        option: the CLI option that holds ``source``, named in errors.
        split: the Hub split when ``source`` names none.
        rename_origin: ``{file column: the option that renames it}``, named in errors (``--data.rename_columns``).

    Returns:
        Rows ``{"prompt": str | [messages], <other columns>..., "sample_id": "file:line"}``, every row with the same
        keys in the same order.

    Raises:
        FileNotFoundError, HubOfflineError: see :func:`lit_llm.data.sources.read_rows`.
        DataFormatError: a bad ``rename_columns`` entry (:func:`~lit_llm.data.rows.check_renames`), no ``prompt``
            column (the message lists the columns and the ``rename_columns`` fix), a column named ``prompt_ids`` /
            ``sample_id``, a system prompt for text prompts, or (``on_bad_row="raise"``) a row with a missing/empty
            required value, a bad prompt or other columns than the first row; also when no row is left.
    """
    rename = dict(rename_columns or {})
    original = {new: old for old, new in rename.items()}
    raw = read_rows(source, split=split, option=option, on_bad_row=on_bad_row, limit=limit)
    where0 = raw[0][0]
    check_renames(rename, list(raw[0][1]), where0, rename_origin)
    first = [rename.get(k, k) for k in raw[0][1]]
    if "prompt" not in first:
        raise DataFormatError(f"{where0}: no 'prompt' column (columns: {sorted(raw[0][1])}). Fix: name the prompt "
                              f"column 'prompt', or map it with --data.rename_columns '{{\"<column>\": \"prompt\"}}'.")
    clash = [c for c in first if c in RESERVED_KEYS - {"prompt"}]
    if clash:
        raise DataFormatError(f"{where0}: column(s) {clash} are the prompt batch's own keys. Fix: rename them with "
                              f"--data.rename_columns.")
    columns = ["prompt", *(c for c in first if c != "prompt")]
    out = []
    for where, row in raw:
        try:
            out.append(_prompt_row(row, rename, original, columns, required, where, system_prompt, string_prompts))
        except DataFormatError:
            if on_bad_row == "raise":
                raise
    if not out:
        raise DataFormatError(f"{source}: no usable prompt row (every row was skipped as bad).")
    return out


def _empty(value: Any) -> bool:
    """``None``, a blank string or an empty list/dict."""
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, list | dict) and not value)


def _prompt_row(row: dict[str, Any], rename: dict[str, str], original: dict[str, str], columns: list[str],
                required: Sequence[str], where: str, system_prompt: str | None,
                string_prompts: Literal["text", "chat"]) -> dict[str, Any]:
    r = {rename.get(k, k): v for k, v in row.items()}
    bad = [original.get(k, k) for k in ("prompt", *required) if _empty(r.get(k))]
    if bad:
        raise DataFormatError(f"{where}: missing or empty key(s) {bad} (row keys: {sorted(row)}). Fix the row or set "
                              f"--data.on_bad_row skip.")
    if set(r) != set(columns):
        raise DataFormatError(f"{where}: columns {sorted(r)} differ from the first row's {sorted(columns)}; every "
                              f"row of a prompt dataset has the same columns. Fix the row or set --data.on_bad_row "
                              f"skip.")
    prompt = r["prompt"]
    if isinstance(prompt, str) and string_prompts == "chat":
        prompt = with_system_prompt([{"role": "user", "content": prompt}], system_prompt)
    elif isinstance(prompt, str):
        if system_prompt:
            raise DataFormatError(f"{where}: --data.system_prompt needs chat prompts, but this prompt is text "
                                  f"(string_prompts='text', TRL's standard format: no chat template). Fix: set "
                                  f"--data.string_prompts chat, or drop the system prompt.")
    else:
        prompt = with_system_prompt(_messages(prompt, "user", original.get("prompt", "prompt"), where), system_prompt)
    return {"prompt": prompt, **{c: r[c] for c in columns[1:]}, "sample_id": where}


def gsm8k_prompts(path: str, *, option: str = "--data.path", system_prompt: str | None = None,
                  limit: int | None = None, on_bad_row: Literal["raise", "skip"] = "raise",
                  split: str = "train") -> list[dict[str, Any]]:
    """GSM8K rows (``question``/``answer``) as chat prompt rows: :func:`prompt_rows` with ``question`` -> ``prompt``
    (one user message after the optional system prompt) and a required ``answer``, kept verbatim.

    Returns:
        Rows ``{"prompt": [messages], "answer": str (with its "#### n" line), ..., "sample_id": "file:line"}``.

    Raises:
        FileNotFoundError: no such file. DataFormatError: a row without a non-empty ``question``/``answer``, or no
            row left.
    """
    return prompt_rows(path, rename_columns=GSM8K_COLUMNS, required=("answer",), system_prompt=system_prompt,
                       string_prompts="chat", limit=limit, on_bad_row=on_bad_row, option=option, split=split,
                       rename_origin={k: "--data.task gsm8k" for k in GSM8K_COLUMNS})


def environment_rows(task: str, n: int, *, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """``n`` synthetic prompt rows of a built-in environment's task (its ``make_rows``): the calculator's problems
    (columns ``answer``, ``expression``) or guess-the-number games (``secret``, ``max_value``), message-list prompts,
    train and eval splits disjoint (see :meth:`lit_llm.rollouts.envs.CalculatorEnv.make_rows`,
    :meth:`lit_llm.rollouts.envs.GuessNumberEnv.make_rows`).

    Raises:
        ValueError: an unknown task (listing :data:`ENVIRONMENT_TASKS`), ``n < 1``, an unknown split.
    """
    from lit_llm.rollouts.envs import builtin_environments

    if task not in ENVIRONMENT_TASKS:
        raise ValueError(f"environment_rows: unknown task {task!r}; choose one of {list(ENVIRONMENT_TASKS)}.")
    return builtin_environments()[task].make_rows(n, seed, split=split)


class GRPODataModule(LightningDataModule):
    """Prompts for GRPO: the user's prompt dataset, GSM8K questions, or the synthetic arithmetic task, with held-out
    evaluation prompts.

    Args:
        task: ``None`` (the prompt dataset at ``path``: a ``prompt`` column and reward columns, TRL's conventions;
            without ``path``, the arithmetic task), ``"gsm8k"`` (the dataset at ``path`` with ``question`` ->
            ``prompt``, chat prompts, ``answer`` verbatim), ``"arithmetic"`` (synthetic ``"What is a + b? Reply with
            just the number."``, seeded, train/eval disjoint; reads no file, so ``path`` with it is an error), or a
            built-in environment's synthetic rows (:func:`environment_rows`, for ``model.environment`` of the same
            name; no file either): ``"calculator"`` (multi-digit arithmetic to solve with the calculator tool,
            columns ``answer``, ``expression``) or ``"guess_number"`` (games with a ``secret`` in ``[1, 100]``).
            Rows of your own environment: ``task: null`` and ``path`` (a ``prompt`` column plus the columns the
            environment's ``reset`` / ``score`` read, e.g. ``answer``).
        path: training prompts: a ``.jsonl`` / ``.parquet`` / ``.csv`` / ``.tsv`` / ``.json`` file, or a Hub
            dataset ``NAME[:CONFIG]:SPLIT`` when online (see :mod:`lit_llm.data.sources`).
        eval_path: evaluation prompts, same sources (a Hub spec without a split reads ``test``); ``None``: hold out
            ``num_eval`` rows of ``path`` (seeded).
        rename_columns: ``{file column: column}`` applied to every row before anything else (e.g.
            ``{"question": "prompt", "solution": "answer"}``); ``task="gsm8k"`` adds ``{"question": "prompt"}``.
        string_prompts: how a string ``prompt`` is used: ``"text"`` (TRL's standard format: tokenised as it is, no
            chat template; completions reach reward functions as strings) or ``"chat"`` (one user message after the
            system prompt, rendered with the chat template; completions are message lists). ``None`` = ``"chat"``
            for ``task="gsm8k"``, else ``"text"``. Message-list prompts always use the chat template.
        batch_size: prompts per optimizer step per rank (each becomes ``num_generations`` completions).
        eval_batch_size: prompts per greedy-evaluation batch.
        num_train: training prompts: the number of synthetic problems (``None`` = 1000), or the row limit of
            ``path`` (``None`` = all rows).
        num_eval: evaluation prompts (held out of ``path``, the row limit of ``eval_path``, or the synthetic task's
            evaluation problems). Holding out so many rows of ``path`` that fewer than ``batch_size`` remain is a
            :class:`DataFormatError` naming it.
        low, high: arithmetic operand range (inclusive).
        ops: arithmetic operators among ``"+"``, ``"-"``, ``"*"``.
        template: arithmetic question template with ``{a}``, ``{op}``, ``{b}``.
        system_prompt: system message prepended to every chat prompt that does not begin with one (an error with
            text prompts).
        chat_template: Jinja string or ``.jinja`` path (``None`` = the attached module's ``chat_template``, else the
            tokenizer's own). Template variables come from the module's ``chat_template_kwargs``.
        max_prompt_length: drop (and count) prompts with more tokens (``None`` = keep all).
        on_bad_row: rows of ``path`` / ``eval_path``: ``"raise"`` (stop naming file and line) or ``"skip"``; also
            a prompt that overflows the model's context with the module's ``(eval_)max_new_tokens`` (setup checks).
        seed: problem generation, evaluation hold-out and per-epoch shuffling.
        tokenizer: model name or path whose tokenizer renders the prompts; ``None`` = the attached module's.

    Attributes:
        columns: the reward-visible column names of the dataset (every prompt-batch key but ``prompt``,
            ``prompt_ids`` and ``sample_id``), e.g. ``["answer"]``; known at ``__init__`` for the arithmetic task,
            after :meth:`setup` for a file or an environment task (``None`` before).

    Raises:
        ValueError: an unknown task, ``path`` with a synthetic task (``arithmetic``, ``calculator``,
            ``guess_number``), ``task="gsm8k"`` without ``path``, bad sizes (checked in ``__init__``); data errors in
            :meth:`setup`.
    """

    def __init__(self, task: Literal["arithmetic", "gsm8k", "calculator", "guess_number"] | None = None, *,
                 path: str | None = None,
                 eval_path: str | None = None, rename_columns: dict[str, str] | None = None,
                 string_prompts: Literal["text", "chat"] | None = None, batch_size: int = 8,
                 eval_batch_size: int = 32, num_train: int | None = None, num_eval: int = 200, low: int = 10,
                 high: int = 99, ops: list[str] | None = None, template: str = DEFAULT_TEMPLATE,
                 system_prompt: str | None = None, chat_template: str | None = None,
                 max_prompt_length: int | None = None, on_bad_row: Literal["raise", "skip"] = "raise", seed: int = 0,
                 tokenizer: str | None = None) -> None:
        super().__init__()
        if task not in (None, "arithmetic", "gsm8k", *ENVIRONMENT_TASKS):
            raise ValueError(f"GRPODataModule: unknown task {task!r}; choose 'arithmetic', 'gsm8k', "
                             f"{', '.join(repr(t) for t in ENVIRONMENT_TASKS)}, or null for the prompt dataset at "
                             f"--data.path.")
        if task in ("arithmetic", *ENVIRONMENT_TASKS) and (path or eval_path):
            raise ValueError(f"GRPODataModule: task={task!r} is a synthetic task and reads no file, but "
                             f"--data.{'path' if path else 'eval_path'} is set. Fix: set --data.task null to train on "
                             f"the prompts at --data.path (a 'prompt' column), or drop the path.")
        if task == "gsm8k" and not path:
            raise ValueError("GRPODataModule: task='gsm8k' needs --data.path (a file of 'question'/'answer' rows, "
                             "e.g. gsm8k/train.jsonl).")
        if task is None and eval_path and not path:
            raise ValueError("GRPODataModule: --data.eval_path is set without --data.path; give the training prompts "
                             "too (or set --data.task arithmetic and drop eval_path).")
        if string_prompts not in (None, "text", "chat"):
            raise ValueError(f"GRPODataModule: string_prompts must be 'text' or 'chat', got {string_prompts!r}.")
        if batch_size < 1 or eval_batch_size < 1 or num_eval < 0:
            raise ValueError(f"GRPODataModule: batch_size and eval_batch_size must be >= 1 and num_eval >= 0, got "
                             f"{batch_size}, {eval_batch_size}, {num_eval}.")
        self.save_hyperparameters()
        self.task: str | None = "arithmetic" if task is None and not path else task
        self.path, self.eval_path = path, eval_path
        self.rename_columns = {**(GSM8K_COLUMNS if task == "gsm8k" else {}), **(rename_columns or {})}
        self._rename_origin = {k: "--data.task gsm8k" for k in self.rename_columns if k not in (rename_columns or {})}
        self.string_prompts = string_prompts or ("chat" if task == "gsm8k" else "text")
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.num_train, self.num_eval, self.low, self.high = num_train, num_eval, low, high
        self.ops = list(ops or ["+"])
        self.template, self.system_prompt, self.chat_template = template, system_prompt, chat_template
        self.max_prompt_length, self.on_bad_row, self.seed = max_prompt_length, on_bad_row, seed
        self.tokenizer_name = tokenizer
        self.tokenizer: Any = None
        self.train_rows: list[dict[str, Any]] = []
        self.eval_rows: list[dict[str, Any]] = []
        self.columns: list[str] | None = ["answer"] if self.task == "arithmetic" else None
        self.num_dropped_long = 0
        self.num_skipped_long = 0  # prompts over the context with max_new_tokens, skipped (on_bad_row="skip")

    def _read(self, source: str, *, option: str, limit: int | None, split: str) -> list[dict[str, Any]]:
        return prompt_rows(source, rename_columns=self.rename_columns,
                           required=("answer",) if self.task == "gsm8k" else (), system_prompt=self.system_prompt,
                           string_prompts=self.string_prompts, limit=limit, on_bad_row=self.on_bad_row,
                           option=option, split=split, rename_origin=self._rename_origin)

    def setup(self, stage: str | None = None) -> None:
        """Build (arithmetic) or read (a prompt dataset, GSM8K) the prompts, render them once (``prompt_ids``) and
        set :attr:`columns`.

        Raises:
            FileNotFoundError, HubOfflineError, DataFormatError: see :func:`prompt_rows`; also evaluation rows
                without a training column, a prompt over the model's context with ``max_new_tokens`` (names its
                ``file:line``), or no training prompt left after ``max_prompt_length``.
        """
        if self.tokenizer is None:
            from lit_llm.lightning.datamodules import resolve_tokenizer

            self.tokenizer = (resolve_tokenizer(self.tokenizer_name) if self.tokenizer_name is not None
                              else module_attr(self, "tokenizer") or resolve_tokenizer(None))
        if self.train_rows:
            return
        if self.task == "arithmetic":
            kw = dict(seed=self.seed, low=self.low, high=self.high, ops=self.ops, template=self.template,
                      system_prompt=self.system_prompt)
            if self.num_eval:
                train, held = arithmetic_split(self.num_train or 1000, self.num_eval, **kw)
            else:
                train, held = arithmetic_prompts(self.num_train or 1000, **kw), []
        elif self.task in ENVIRONMENT_TASKS:
            train = environment_rows(self.task, self.num_train or 1000, seed=self.seed, split="train")
            held = environment_rows(self.task, self.num_eval, seed=self.seed, split="eval") if self.num_eval else []
            if self.system_prompt:
                train = [{**r, "prompt": with_system_prompt(r["prompt"], self.system_prompt)} for r in train]
                held = [{**r, "prompt": with_system_prompt(r["prompt"], self.system_prompt)} for r in held]
        else:
            train = self._read(self.path, option="--data.path", limit=self.num_train, split="train")
            if self.eval_path:
                held = self._read(self.eval_path, option="--data.eval_path", limit=self.num_eval,
                                  split="test") if self.num_eval else []
            else:
                order = list(range(len(train)))
                random.Random(self.seed).shuffle(order)
                limited = self.num_train is not None and len(train) >= self.num_train  # num_train cut the file
                read = (f"the {len(train)} rows of --data.path {self.path}" if not limited else
                        f"the {len(train)} rows read from --data.path {self.path} (data.num_train={self.num_train} "
                        f"limits them)")
                if self.num_eval > 0 and len(train) - self.num_eval < self.batch_size:
                    raise DataFormatError(
                        f"GRPODataModule: num_eval={self.num_eval} holds out {min(self.num_eval, len(train))} of "
                        f"{read} for evaluation (no data.eval_path given), leaving "
                        f"{max(len(train) - self.num_eval, 0)} to train on, fewer than one step's "
                        f"batch_size={self.batch_size}. Fix: lower --data.num_eval, give --data.eval_path"
                        + (", raise --data.num_train" if limited else "") + " or lower "
                        "--data.batch_size.")
                out = set(order[:self.num_eval])
                held = [r for i, r in enumerate(train) if i in out]
                train = [r for i, r in enumerate(train) if i not in out]
        self.columns = [k for k in train[0] if k not in RESERVED_KEYS]
        missing = [c for c in self.columns if held and c not in held[0]]
        if missing:
            raise DataFormatError(f"{held[0]['sample_id']}: the evaluation prompts lack the training column(s) "
                                  f"{missing} the reward functions receive. Fix: give --data.eval_path the same "
                                  f"columns as --data.path.")
        self.train_rows = self._render(train, "max_new_tokens")
        self.eval_rows = self._render(held, "eval_max_new_tokens")
        rank_zero_info(f"GRPODataModule({self.task or self.path}): {len(self.train_rows)} training / "
                       f"{len(self.eval_rows)} evaluation prompts, reward columns {self.columns}; "
                       f"{self.num_dropped_long} dropped (longer than max_prompt_length={self.max_prompt_length}), "
                       f"{self.num_skipped_long} skipped (over the model's context with max_new_tokens).")
        if not self.train_rows:
            raise DataFormatError(f"GRPODataModule: no training prompt left (max_prompt_length="
                                  f"{self.max_prompt_length} dropped {self.num_dropped_long}, "
                                  f"{self.num_skipped_long} skipped over the model's context); raise it, or lower "
                                  f"--model.init_args.max_new_tokens.")

    def _too_long(self, sample_id: str, length: int, budget: tuple[int | None, Any], option: str) -> bool:
        """Whether a prompt overflows ``budget = (context, max_new_tokens)`` and is skipped; else DataFormatError."""
        context, new_tokens = budget
        if context is None or not isinstance(new_tokens, int) or length + new_tokens <= context:
            return False
        self.num_skipped_long += self.on_bad_row == "skip"
        if self.on_bad_row == "skip":
            return True
        flag = "--model.init_args.eval_max_new_tokens" if "eval" in option else "--model.init_args.max_new_tokens"
        drop = f"set --data.max_prompt_length {context - new_tokens} (drops longer prompts, counted), " \
            if context > new_tokens else ""
        raise DataFormatError(f"{sample_id}: the prompt has {length} tokens; with {option}={new_tokens} it exceeds "
                              f"the model's context of {context} tokens. Fix: shorten the row, {drop}lower "
                              f"{flag}, or set --data.on_bad_row skip.")

    def _render(self, rows: list[dict[str, Any]], new_tokens_option: str) -> list[dict[str, Any]]:
        if not rows:
            return []
        budget = (model_context(self), module_attr(self, new_tokens_option))
        template, kwargs = template_options(self)
        out = []
        for r in rows:
            try:
                (p,) = tokenize_prompts([r["prompt"]], self.tokenizer, chat_template=template,
                                        chat_template_kwargs=kwargs)
            except ValueError as e:  # the data layer's template errors are ValueErrors: name the row
                raise DataFormatError(f"{r['sample_id']}: the prompt cannot be rendered ({type(e).__name__}: {e})."
                                      ) from e
            if self.max_prompt_length is not None and p.numel() > self.max_prompt_length:
                self.num_dropped_long += 1
                continue
            if self._too_long(r["sample_id"], p.numel(), budget, new_tokens_option):
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
        wrap = module_attr(self, "wrap_train_loader")
        return wrap(loader) if callable(wrap) else loader

    def val_dataloader(self) -> DataLoader | list:
        """Held-out prompts in fixed order, ``eval_batch_size`` per batch; ``[]`` when there are none."""
        if not self.eval_rows:
            return []
        return DataLoader(self.eval_rows, batch_size=self.eval_batch_size, shuffle=False, collate_fn=collate_prompts)
