"""Supervised datasets: row readers (chat / prompt-completion / GSM8K / plain text) over JSONL, Parquet, CSV, JSON
files and Hub datasets (:mod:`lit_llm.data.sources`), a synthetic arithmetic task, tokenising collate.

Every row becomes an :class:`Example` (a conversation plus how many of its messages form the prompt) and then,
through :meth:`History.apply_chat_template` (one render of the full conversation, DESIGN.md property 3), a
:class:`TokenizedExample` with aligned ``[T]`` ids and masks. :func:`collate` right-pads a list of them into ``[B, T]``
model inputs. This module never imports the policy or loss layers: choosing which mask trains (the loss head) and
dropping rows left with nothing to train is the data module's job (``lit_llm.lightning.datamodules``).

Row formats (TRL's dataset columns; ``format="auto"`` picks by the first row's keys, in this order):

* ``chat``: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}``;
  the prompt is every message before the last assistant message.
* ``prompt_completion``: ``{"prompt": str | messages, "completion": str | messages}``; a string prompt is one user
  message, a string completion one assistant message.
* ``gsm8k``: ``{"question": str, "answer": str}``: the question as the user message and the answer, verbatim
  (reasoning and ``#### N`` line), as the assistant message.
* ``text``: ``{"text": str}``: plain text (language modelling), no chat template; the text's ids (special-token
  strings in it stay text, DESIGN.md property 8) plus the EOS id, as TRL's SFT does. It has no prompt or assistant
  turn, so only the ``generic`` loss head (every token) trains on it.

The optional system prompt is prepended, as a system message, to every prompt that does not begin with one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from lit_llm.data.containers import template_display_name
from lit_llm.data.errors import check_prefix
from lit_llm.data.rows import DataFormatError, Skipped, note_skip, read_jsonl, to_messages
from lit_llm.data.sources import read_rows

__all__ = [
    "DataFormatError",
    "Example",
    "RowFormat",
    "Skipped",
    "TokenizedExample",
    "arithmetic_examples",
    "collate",
    "detect_format",
    "examples_from_rows",
    "read_examples",
    "read_jsonl",
    "row_to_example",
    "to_messages",
    "tokenize_example",
    "with_system_prompt",
]

RowFormat = Literal["auto", "chat", "prompt_completion", "gsm8k", "text"]
_Format = Literal["chat", "prompt_completion", "gsm8k", "text"]
_KEYS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"), "gsm8k": ("question", "answer"),
         "text": ("text",)}


@dataclass
class Example:
    """One conversation to train on.

    Attributes:
        messages: the conversation, ``[{"role": ..., "content": ...}, ...]``.
        num_prompt_messages: how many leading messages form the prompt; the rest is the completion (the ``sft`` head
            trains on the completion's tokens only).
        sample_id: where the row comes from, ``"file:line"`` (1-based line), ``"file:row N"`` or
            ``"arithmetic:i"``; named in errors.
        reference: the completion text (the GSM8K answer, the arithmetic result), shown beside generated samples.
        text: a plain-text row (``format="text"``): tokenised as it is, no chat template; ``messages`` is then empty.
    """

    messages: list[dict[str, Any]]
    num_prompt_messages: int
    sample_id: str
    reference: str = ""
    text: str | None = None


@dataclass
class TokenizedExample:
    """An :class:`Example` tokenised with its chat template. All tensors are 1-D and aligned: ``[T]``.

    Attributes:
        input_ids: ``[T]`` long, the full conversation's ids (one render, truncated to ``max_length``).
        assistant_mask: ``[T]`` bool, every assistant token of every turn (DESIGN.md property 3).
        response_mask: ``[T]`` bool, the completion: from the end of the prompt (rendered with the generation
            prompt) through the last assistant token (its stop token); a separator the template renders after it
            is excluded.
        prompt_ids: ``[P]`` long, the prompt rendered with the generation prompt (an exact prefix of the full ids
            before truncation, property 2); what the model sees when it generates the completion.
        sample_id: see :class:`Example`.
        reference: see :class:`Example`.
        truncated: True when ``max_length`` cut the conversation.
    """

    input_ids: torch.Tensor
    assistant_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_ids: torch.Tensor
    sample_id: str
    reference: str = ""
    truncated: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.numel())


# ---------------------------------------------------------------------------------------------------------- reading
def detect_format(row: dict[str, Any], *, where: str = "<row>") -> _Format:
    """The first row format whose keys ``row`` has (``messages`` / ``prompt`` + ``completion`` / ``question`` +
    ``answer`` / ``text``).

    Raises:
        DataFormatError: no format matches; names ``where``, the keys found and the keys expected.
    """
    for name, keys in _KEYS.items():
        if all(k in row for k in keys):
            return name  # type: ignore[return-value]
    raise DataFormatError(
        f"{where}: cannot tell the row format from its keys {sorted(row)}. Expected 'messages' (chat), 'prompt' + "
        f"'completion', 'question' + 'answer' (GSM8K) or 'text'; rename the columns or set --data.format."
    )


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``{"role": "system", "content": system_prompt}`` prepended, unless ``system_prompt`` is
    empty/``None`` or the first message is already a system message (the row's own system prompt wins)."""
    if not system_prompt or (messages and messages[0].get("role") == "system"):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def row_to_example(row: dict[str, Any], fmt: _Format, *, sample_id: str,
                   system_prompt: str | None = None) -> Example:
    """Convert one row to an :class:`Example`.

    Args:
        row: the row (column -> value).
        fmt: ``"chat"``, ``"prompt_completion"``, ``"gsm8k"`` or ``"text"`` (see the module docstring).
        sample_id: ``"file:line"`` / ``"file:row N"``, named in errors.
        system_prompt: prepended as a system message to every prompt that does not begin with one (see
            :func:`with_system_prompt`); never to ``text`` rows (they have no template).

    Raises:
        DataFormatError: a required key is missing or has the wrong type, or the conversation has no assistant
            message; the message names ``sample_id``, the key and the fix.
    """
    missing = [k for k in _KEYS[fmt] if k not in row]
    if missing:
        raise DataFormatError(f"{sample_id}: missing key(s) {missing} for format {fmt!r} (row keys: {sorted(row)}). "
                              f"Fix the row, or choose the right --data.format.")
    if fmt == "text":
        if not isinstance(row["text"], str) or not row["text"].strip():
            raise DataFormatError(f"{sample_id}: 'text' must be a non-empty string. Fix the row.")
        return Example([], 0, sample_id, row["text"], text=row["text"])
    if fmt == "chat":
        if isinstance(row["messages"], str):
            raise DataFormatError(f"{sample_id}: 'messages' must be a list of messages, got a string. Fix the row.")
        messages = to_messages(row["messages"], "user", "messages", sample_id)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise DataFormatError(f"{sample_id}: the conversation has no assistant message, so nothing to train on. "
                                  f"Add an assistant turn or drop the row (--data.on_bad_row skip).")
        messages = with_system_prompt(messages, system_prompt)
        last += len(messages) - len(row["messages"])
        return Example(messages, last, sample_id, messages[last]["content"])
    if fmt == "gsm8k":
        for k in ("question", "answer"):
            if not isinstance(row[k], str) or not row[k].strip():
                raise DataFormatError(f"{sample_id}: {k!r} must be a non-empty string. Fix the row.")
        prompt = with_system_prompt([{"role": "user", "content": row["question"]}], system_prompt)
        return Example(prompt + [{"role": "assistant", "content": row["answer"]}], len(prompt), sample_id,
                       row["answer"])
    prompt = with_system_prompt(to_messages(row["prompt"], "user", "prompt", sample_id), system_prompt)
    completion = to_messages(row["completion"], "assistant", "completion", sample_id)
    if not any(m["role"] == "assistant" for m in completion):
        raise DataFormatError(f"{sample_id}: 'completion' has no assistant message, so nothing to train on. Fix the "
                              f"row or drop it (--data.on_bad_row skip).")
    reference = "".join(m["content"] for m in completion if m["role"] == "assistant")
    return Example(prompt + completion, len(prompt), sample_id, reference)


def examples_from_rows(rows: Iterable[tuple[str, dict[str, Any]]], *, fmt: RowFormat = "auto",
                       system_prompt: str | None = None, on_bad_row: Literal["raise", "skip"] = "raise",
                       skipped: Skipped | None = None) -> list[Example]:
    """Convert ``[(sample_id, row), ...]`` to examples; ``fmt="auto"`` detects the format from the first row.

    Raises:
        DataFormatError: a bad row with ``on_bad_row="raise"`` (see :func:`row_to_example`).
    """
    out: list[Example] = []
    for sample_id, row in rows:
        try:
            if fmt == "auto":
                fmt = detect_format(row, where=sample_id)
            out.append(row_to_example(row, fmt, sample_id=sample_id, system_prompt=system_prompt))
        except DataFormatError as e:
            if on_bad_row == "raise":
                raise
            note_skip(skipped, sample_id, str(e))
    return out


def read_examples(path: str | os.PathLike, *, fmt: RowFormat = "auto", system_prompt: str | None = None,
                  on_bad_row: Literal["raise", "skip"] = "raise", limit: int | None = None,
                  skipped: Skipped | None = None, option: str = "--data.path", split: str = "train") -> list[Example]:
    """Read a file or Hub dataset into :class:`Example`s (sample ids ``"file:line"`` for JSONL, ``"file:row N"``
    for Parquet / CSV / JSON, ``"name:split:row N"`` for the Hub; see :func:`lit_llm.data.sources.read_rows`).

    Args:
        path: a ``.jsonl`` / ``.parquet`` / ``.csv`` / ``.tsv`` / ``.json`` file, or a Hub dataset spec.
        fmt: the row format, or ``"auto"``.
        system_prompt: see :func:`row_to_example`.
        on_bad_row: ``"raise"`` (stop, naming the line) or ``"skip"`` (count in ``skipped``).
        limit: keep only the first ``limit`` rows (``None`` = all).
        skipped: collects skipped rows.
        option: the CLI option that holds ``path``, named when the file is missing.
        split: the Hub split when ``path`` names none.

    Raises:
        FileNotFoundError, DataFormatError: see :func:`lit_llm.data.sources.read_rows` and :func:`row_to_example`;
            also when every row was skipped.
    """
    rows = read_rows(path, split=split, option=option, on_bad_row=on_bad_row, skipped=skipped, limit=limit)
    examples = examples_from_rows(rows, fmt=fmt, system_prompt=system_prompt, on_bad_row=on_bad_row,
                                  skipped=skipped)
    if not examples:
        raise DataFormatError(f"{path}: every row was skipped as bad (see the warnings); fix the file.")
    return examples


def arithmetic_examples(num: int, num_val: int = 0, *, seed: int = 0, low: int = 10, high: int = 99,
                        ops: Sequence[str] = ("+",), system_prompt: str | None = None
                        ) -> tuple[list[Example], list[Example]]:
    """The synthetic arithmetic task (no download) as SFT examples: ``"What is 47 + 38? Reply with just the number."``
    -> ``"85"``, drawn by :func:`lit_llm.data.arithmetic.arithmetic_split` (the same problems GRPO uses).

    Args:
        num: number of training problems (>= 1).
        num_val: number of validation problems, disjoint from the training ones (0 = none).
        seed: the problems are a deterministic function of ``seed`` and the other arguments.
        low, high: operand range, inclusive.
        ops: operators drawn uniformly, from ``"+"``, ``"-"``, ``"*"``.
        system_prompt: optional system message.

    Returns:
        ``(train, val)`` examples (prompt = the question, completion = the result as text; ``sample_id`` =
        ``"arithmetic-<split>:i"``; ``reference`` = the result).

    Raises:
        ValueError: ``num < 1``, a bad range or operator, or fewer distinct problems than asked for.
    """
    from lit_llm.data.arithmetic import arithmetic_split

    train_rows, val_rows = arithmetic_split(num, max(num_val, 1), seed=seed, low=low, high=high, ops=ops,
                                            system_prompt=system_prompt)

    def to_example(row: dict[str, Any]) -> Example:
        completion = [{"role": "assistant", "content": row["answer"]}]
        return Example(row["prompt"] + completion, len(row["prompt"]), row["sample_id"], row["answer"])

    return [to_example(r) for r in train_rows], [to_example(r) for r in val_rows[:num_val]]


# ------------------------------------------------------------------------------------------------------- tokenising
def tokenize_example(example: Example, tokenizer: Any, *, chat_template: str | os.PathLike | None = None,
                     max_length: int | None = None,
                     chat_template_kwargs: dict[str, Any] | None = None) -> TokenizedExample:
    """Tokenise one example: one render of the full conversation (ids + assistant mask) and one of the prompt.

    Args:
        example: the conversation.
        tokenizer: an HF tokenizer.
        chat_template: a Jinja string or ``.jinja`` path; ``None`` = the tokenizer's own.
        max_length: keep the first ``max_length`` tokens (the start of the conversation); ``None`` = no limit.
        chat_template_kwargs: extra template variables for both renders (e.g. ``{"enable_thinking": False}``).

    Returns:
        The :class:`TokenizedExample` (``[T]`` tensors, ``T <= max_length``).

    Raises:
        DataFormatError: the conversation is invalid (unknown role, special-token text in content, no assistant
            tokens, prompt not a prefix of the full render); wraps the data layer's error with ``sample_id``.
    """
    from lit_llm.data.history import History

    if example.text is not None:
        return _tokenize_text(example, tokenizer, max_length)
    kw = dict(chat_template_kwargs or {})
    try:
        full = History.from_chats(example.messages).apply_chat_template(
            tokenizer, chat_template=chat_template, add_generation_prompt=False, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, **kw)
        prompt_ids = History.from_chats(example.messages[: example.num_prompt_messages]).apply_chat_template(
            tokenizer, chat_template=chat_template, add_generation_prompt=True, tokenize=True, return_dict=False,
            **kw).long()
        ids, assistant = full["input_ids"].long(), full["assistant_masks"].bool()
        check_prefix(prompt_ids, ids, template_name=template_display_name(chat_template))
    except (ValueError, TypeError, KeyError) as e:
        raise DataFormatError(f"{example.sample_id}: {type(e).__name__}: {e}") from e
    positions = torch.arange(ids.numel())
    last = int(assistant.nonzero().max()) if assistant.any() else -1
    response = (positions >= prompt_ids.numel()) & (positions <= last)
    truncated = max_length is not None and ids.numel() > max_length
    if truncated:
        ids, assistant, response = ids[:max_length], assistant[:max_length], response[:max_length]
    return TokenizedExample(ids, assistant, response, prompt_ids, example.sample_id, example.reference, truncated)


def _tokenize_text(example: Example, tokenizer: Any, max_length: int | None) -> TokenizedExample:
    """A ``text`` row: its ids with special-token strings kept as text (``split_special_tokens``), plus the EOS id
    when the ids do not already end with it (TRL's SFT appends EOS to language-modelling rows). Both masks are all
    False (no prompt, no assistant turn: only the ``generic`` head trains on it); ``prompt_ids`` is the first token,
    the prefix the validation-samples callback continues."""
    ids = list(tokenizer(example.text, add_special_tokens=True, split_special_tokens=True)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(int(eos))
    t = torch.tensor(ids, dtype=torch.long)
    truncated = max_length is not None and t.numel() > max_length
    if truncated:
        t = t[:max_length]
    none = torch.zeros(t.numel(), dtype=torch.bool)
    return TokenizedExample(t, none, none.clone(), t[:1].clone(), example.sample_id, example.reference, truncated)


def collate(samples: Sequence[TokenizedExample], *, pad_token_id: int) -> dict[str, Any]:
    """Right-pad tokenised examples into model inputs.

    Args:
        samples: ``B >= 1`` examples.
        pad_token_id: id written at padding (``tokenizer.pad_token_id``; padding is read from ``attention_mask``
            only, never from ids, since SmolLM2's pad id is its end-of-turn id).

    Returns:
        ``{"input_ids": [B, T] long, "attention_mask": [B, T] long (0 at padding), "assistant_mask": [B, T] bool,
        "response_mask": [B, T] bool, "sample_ids": list[str]}`` with ``T`` the longest sample; padding on the
        right, masks False there.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("collate: got an empty list of samples.")
    b, t = len(samples), max(len(s) for s in samples)
    ids = torch.full((b, t), int(pad_token_id), dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    assistant = torch.zeros((b, t), dtype=torch.bool)
    response = torch.zeros((b, t), dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s)
        ids[i, :n], attn[i, :n] = s.input_ids, 1
        assistant[i, :n], response[i, :n] = s.assistant_mask, s.response_mask
    return {"input_ids": ids, "attention_mask": attn, "assistant_mask": assistant, "response_mask": response,
            "sample_ids": [s.sample_id for s in samples]}


_messages = to_messages  # the older private name
_note_skip = note_skip
