"""Helpers of the typed containers (``lit_llm.data.containers``): batch handling, prefix errors, padding."""

from __future__ import annotations

import os
from typing import Any

import torch
from tensordict import TensorClass, lazy_stack

from lit_llm.data.errors import PrefixMismatchError
from lit_llm.data.padding import pad_rows

__all__ = ["template_display_name"]


def template_display_name(chat_template: str | os.PathLike | None) -> str:
    """A short name for a chat template, used in error messages (as ``History.apply_chat_template`` names it).

    Args:
        chat_template: a path to a ``.jinja`` file (-> its file name), a Jinja string (-> ``"<inline template>"``)
            or ``None`` (-> ``"tokenizer default"``).

    Returns:
        The name.
    """
    if chat_template is None:
        return "tokenizer default"
    if isinstance(chat_template, os.PathLike) or ("{" not in chat_template and chat_template.endswith(".jinja")):
        return os.path.basename(os.fspath(chat_template))
    if "{" not in chat_template:
        return chat_template  # a named template of the tokenizer
    return "<inline template>"


def _is_batched(obj: TensorClass) -> bool:
    return obj.batch_dims > 0


def _unbatched_field(obj: TensorClass, name: str, value: Any) -> Any:
    """A field of an unbatched (``batch_size=[]``) container as one item: a batch of one (a ``[1, n]`` History, a
    ``[1, T]`` tensor, a one-element list) is taken as its only row; a larger batch is an error.

    Raises:
        ValueError: the field holds a batch of more than one row (names the field and the fix).
    """
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        n = len(value)
        one = value[0] if n == 1 else None
    elif isinstance(value, torch.Tensor):
        if value.dim() < 2:
            return value
        n, one = value.shape[0], value[0] if value.shape[0] == 1 else None
    elif callable(getattr(value, "apply_chat_template", None)):  # a History: one item is [n_messages]
        if value.batch_dims < 2:
            return value
        n, one = value.batch_size[0], value[0] if value.batch_size[0] == 1 else None
    else:
        return value
    if n == 1:
        return one
    raise ValueError(
        f"{type(obj).__name__}.{name}: this container is unbatched (batch_size=[]) but {name!r} holds {n} rows; "
        f"build it with batch_size=[{n}] (one row per item) or pass one row."
    )


def _one_item(obj: TensorClass) -> TensorClass:
    """``obj`` (unbatched) with every field reduced to one item (see :func:`_unbatched_field`)."""
    fields = {k: _unbatched_field(obj, k, getattr(obj, k)) for k in ("prompt", "response", "full")}
    changed = any(fields[k] is not getattr(obj, k) for k in fields)
    if not changed:
        return obj
    extra = {"padded": obj.padded} if hasattr(obj, "padded") else {}
    return type(obj)(**fields, **extra)


def _holds_one_row(obj: TensorClass) -> bool:
    """Whether an unbatched container's fields hold a batch of one row (``[1, n]`` History, ``[1, T]`` ids, a
    one-element list) rather than one item."""
    return not _is_batched(obj) and _one_item(obj) is not obj


def _as_one_row(out: TensorClass) -> TensorClass:
    """An unbatched conversion result with each field given back its leading batch of one (TorchRL's shapes: a
    one-element list of ``str``, ``[1, T]`` ids, a ``[1, n]`` History), so an input ``[1, ...]`` gives ``[1, ...]``."""
    def one(value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if isinstance(value, torch.Tensor):
            return value.unsqueeze(0)
        return lazy_stack([value])  # a History [n] -> [1, n]

    fields = {k: one(getattr(out, k)) for k in ("prompt", "response", "full")}
    extra = {"padded": out.padded} if hasattr(out, "padded") else {}
    return type(out)(**fields, **extra)


def _split_at_last_assistant(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(prompt, response)``: the response is the last assistant message and what follows it (TorchRL's split of
    a full conversation); no assistant message -> ``(messages, [])``."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        return messages, []
    return messages[:last], messages[last:]


def _require_history(value: Any, field: str, what: str) -> None:
    if value is not None and not callable(getattr(value, "apply_chat_template", None)):
        raise TypeError(f"{what}: {field!r} must be a History (lit_llm.data.history.History), got "
                        f"{type(value).__name__}. Build it with History.from_chats(...).")


def _rows(obj: TensorClass) -> list:
    """The rows along the first batch dimension (each converted on its own; a ``[B, n]`` batch gives ``[n]`` rows,
    converted recursively, so the result keeps the batch shape)."""
    return list(obj.unbind(0))


_TEXT_FIX = "Build the full text as prompt + response, or pass the response instead of the full text."
_TEMPLATE_FIX = (
    "The template renders the conversation differently once a reply follows; use a template whose generation "
    "prompt is a prefix of the rendered reply, or masks from the full render (assistant mask) instead of slicing."
)


def _text_prefix_error(prompt: str, full: str, what: str, fix: str = _TEXT_FIX) -> PrefixMismatchError:
    n = min(len(prompt), len(full))
    pos = next((i for i in range(n) if prompt[i] != full[i]), n)
    return PrefixMismatchError(
        f"{what}: the prompt text is not a prefix of the full text; first difference at character position {pos} "
        f"(prompt {prompt[pos:pos + 20]!r} vs full {full[pos:pos + 20]!r}). {fix}"
    )


def _as_long_1d(ids: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(ids)
    if t.dim() != 1:
        raise ValueError(f"Tokens.{name}: expected a 1-D id tensor per item, got shape {list(t.shape)}.")
    return t.to(torch.long)


def _as_list(value: Any) -> list:
    return list(value) if not isinstance(value, str) else [value]


def _template_arg(chat_template: Any, chat_template_name: str | None, what: str) -> Any:
    """The template to render with: ``chat_template``, or the name (resolved by ``History.apply_chat_template``)."""
    if chat_template_name is None:
        return chat_template
    if chat_template is not None:
        raise ValueError(f"{what}: pass chat_template or chat_template_name, not both (got {chat_template!r} and "
                         f"{chat_template_name!r}).")
    return chat_template_name


def _encode(tokenizer: Any, text: str, **kwargs: Any) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.long)


def _padded_tokens(rows: list, tokenizer: Any, what: str) -> Any:
    """Rows of :class:`Tokens` as one ``[B]`` instance of ``[B, T]`` tensors (prompt left-, response right-, full
    left-padded with the tokenizer's pad id)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise ValueError(f"{what}: padding=True needs tokenizer.pad_token_id; set tokenizer.pad_token.")
    sides = {"prompt": "left", "response": "right", "full": "left"}
    fields = {}
    for name, side in sides.items():
        values = [getattr(r, name) for r in rows]
        if all(v is not None for v in values):
            fields[name] = pad_rows(values, pad, side=side)
    return type(rows[0])(**fields, padded=True, batch_size=[len(rows)])
