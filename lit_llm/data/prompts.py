"""Prompt rendering for generation: the token ids a model continues for a text or chat prompt."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["tokenize_prompts"]


def tokenize_prompts(prompts: Sequence[str | Sequence[Mapping[str, Any]]], tokenizer: Any, *,
                     chat_template: str | None = None,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> list[Tensor]:
    """Token ids the model continues for each prompt.

    Chat prompts (message lists) are rendered with ``add_generation_prompt=True`` through
    :meth:`lit_llm.data.history.History.apply_chat_template` (special-token strings in the content are refused,
    DESIGN.md property 8); text prompts are tokenised as they are (``add_special_tokens=False``).

    Args:
        prompts: ``P`` prompts, each a string or a list of ``{"role", "content"}`` messages.
        tokenizer: a Hugging Face tokenizer.
        chat_template: Jinja string or ``.jinja`` path (``None`` = the tokenizer's own).
        chat_template_kwargs: extra template variables of chat prompts (e.g. ``{"enable_thinking": False}``).

    Returns:
        ``P`` 1-D ``torch.long`` tensors.

    Raises:
        ValueError: a prompt that is neither a string nor a message list, or renders to no token (the message names
            the prompt's index and the fix).
    """
    from lit_llm.data.history import History

    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = torch.as_tensor(tokenizer(p, add_special_tokens=False)["input_ids"], dtype=torch.long)
        elif isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
            ids = History.from_chats([dict(m) for m in p]).apply_chat_template(
                tokenizer, chat_template=chat_template, add_generation_prompt=True, tokenize=True, return_dict=False,
                **dict(chat_template_kwargs or {})).long()
        else:
            raise ValueError(f"prompt {i}: expected a string or a non-empty list of {{'role', 'content'}} messages, "
                             f"got {p!r:.120}. Fix the 'prompt' column of the prompt batch.")
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} renders to no token; give it some content.")
        out.append(ids.reshape(-1))
    return out
