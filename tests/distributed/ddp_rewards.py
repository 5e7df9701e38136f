"""Test-only reward for the DDP dynamic-sampling run: informative on rank 0 only (``file.py:function`` spec)."""

from __future__ import annotations

import torch.distributed as dist


def rank0_parity_reward(prompts, completions, completion_ids, **kwargs):
    """Rank 0: the parity of the completion's id sum (groups mostly differ); other ranks: 0.0 for every completion
    (every group zero-std, so that rank always wants another sampling round and rank 0 must keep drawing with it)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if rank != 0:
        return [0.0] * len(completion_ids)
    return [float(sum(c) % 2) for c in completion_ids]
