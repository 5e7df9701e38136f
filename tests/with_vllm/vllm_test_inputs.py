"""Inputs of the vLLM suite's tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch
from tensordict import TensorDict, lazy_stack

#: Engine settings of the suite: fp32, eager, a 256 MiB KV cache (the machine is shared), a 1024-token context.
ENGINE_KWARGS = {"dtype": "float32", "kv_cache_gib": 0.25, "max_model_len": 1024, "seed": 0}


def tokens_td(prompts: list[torch.Tensor], seeds: list | None = None) -> TensorDict:
    """A ``[B]`` tokens-mode input (``tokens.prompt`` rows), with a ``sampling_seed`` per row when given."""
    from lit_llm.data.containers import Tokens

    rows = []
    for i, p in enumerate(prompts):
        td = TensorDict(tokens=Tokens(prompt=p))
        if seeds is not None:
            td["sampling_seed"] = torch.as_tensor(seeds[i], dtype=torch.int64)
        rows.append(td)
    return lazy_stack(rows)


def token_prompts(n: int, seed: int = 0, lengths: tuple[int, int] = (3, 40)) -> list[torch.Tensor]:
    """``n`` random id rows of random lengths in ``lengths`` (ids in [100, 5000))."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 5000, (int(k),), generator=gen) for k in torch.randint(*lengths, (n,), generator=gen)]


def rows(td, key) -> list[torch.Tensor]:
    """The per-row tensors at ``key`` (ragged outputs)."""
    return td.get(key, as_list=True)
