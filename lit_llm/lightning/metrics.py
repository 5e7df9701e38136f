"""Training metrics that need the model's hidden states: mean token accuracy without ``[B, T, V]`` logits.

The token log-prob kernel (:func:`lit_llm.policy.logprobs.model_token_log_probs`) never materialises full logits, so
the argmax needed by a token accuracy is recomputed here from the backbone's last hidden states (captured by a
forward hook during the same forward pass), in chunks of positions, without gradient, over the trained positions
only. The cost is one extra LM-head matmul over the trained tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["HiddenCapture", "argmax_hits", "capture_last_hidden"]


class HiddenCapture:
    """Holder filled by :func:`capture_last_hidden`: ``hidden`` is the backbone's ``[B, T, H]`` output (detached)."""

    hidden: Tensor | None = None


@contextmanager
def capture_last_hidden(model: Any) -> Iterator[HiddenCapture]:
    """Record the last hidden states of an HF causal LM's backbone (``model.model``) during the ``with`` block.

    Args:
        model: an HF ``*ForCausalLM`` with a ``model`` (or ``get_decoder()``) backbone.

    Yields:
        A :class:`HiddenCapture` whose ``hidden`` is the last forward's ``[B, T, H]`` hidden states (detached).
    """
    backbone = getattr(model, "model", None) or model.get_decoder()
    cap = HiddenCapture()

    def hook(_module: Any, _inputs: Any, output: Any) -> None:
        h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        cap.hidden = h.detach()

    handle = backbone.register_forward_hook(hook)
    try:
        yield cap
    finally:
        handle.remove()


@torch.no_grad()
def argmax_hits(hidden: Tensor, model: Any, input_ids: Tensor, mask: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Count the trained positions where the model's most likely next token is the actual token.

    Position ``t`` (``mask[:, t]`` True, ``t >= 1``) is a hit when ``argmax(lm_head(hidden[:, t - 1])) ==
    input_ids[:, t]``.

    Args:
        hidden: ``[B, T, H]`` last hidden states (any float dtype).
        model: the HF causal LM (its ``get_output_embeddings()`` head is applied).
        input_ids: ``[B, T]`` long.
        mask: ``[B, T]`` bool, the loss mask (never True at a row's first real token).

    Returns:
        0-d long tensor: the number of hits (divide by ``mask.sum()`` for the accuracy).
    """
    head = model.get_output_embeddings()
    sel = mask[:, 1:]
    h = hidden[:, :-1][sel]
    y = input_ids[:, 1:][sel]
    hits = torch.zeros((), dtype=torch.long, device=input_ids.device)
    for s in range(0, h.shape[0], chunk_size):
        logits = head(h[s:s + chunk_size].to(head.weight.dtype))
        hits += (logits.argmax(-1) == y[s:s + chunk_size]).sum()
    return hits
