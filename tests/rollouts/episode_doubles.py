"""Test doubles for episodes: environments implementing the spec's Environment interface by duck typing (reset / step /
tools / close, EnvStep), and a scripted generate version (fixed reply ids and log-probs)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack


@dataclass
class Step:
    """The spec's ``EnvStep``."""

    messages: list
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class ScriptedEnv:
    """``reset``: a user message with the row's prompt (a system message first when given); step ``t`` returns
    ``steps[t]``. Records every conversation it is shown."""

    required_columns: tuple[str, ...] = ()

    def __init__(self, steps: list[Step], *, tools: list | None = None, system: str | None = None):
        self.steps, self.tools, self.system = steps, list(tools or []), system
        self.seen: list[list[dict]] = []
        self.closed = False

    def reset(self, row):
        first = [{"role": "system", "content": self.system}] if self.system else []
        return [*first, {"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        self.seen.append(messages)
        return self.steps[len(self.seen) - 1]

    def close(self):
        self.closed = True


def fake_log_probs(ids: list[int], salt: int = 0) -> torch.Tensor:
    """Distinct, negative, deterministic per-token log-probs (never 0.0, so their place is checkable)."""
    return torch.tensor([-(1 + (7 * t + 3 * j + salt) % 11) / 8 for j, t in enumerate(ids)], dtype=torch.float32)


class ScriptedPolicy:
    """A tokens-mode generate version whose replies come from ``reply(prompt_ids, seed) -> (ids, truncated)``
    (log-probs :func:`fake_log_probs`). Thread-safe; records every ``(prompt ids, seed)`` it is called with.
    ``get_new_version`` returns itself (no batcher: its calls are direct)."""

    generate = True
    input_mode = "tokens"
    return_log_probs = True

    def __init__(self, reply: Callable[[torch.Tensor, Any], tuple[list[int], bool]], *, pad_token_id: int,
                 max_new_tokens: int = 64, context: int | None = None):
        self.reply = reply
        self.generation_config = SimpleNamespace(pad_token_id=pad_token_id, max_new_tokens=max_new_tokens)
        self.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
        self.device = torch.device("cpu")
        self.calls: list[tuple[list[int], Any]] = []
        self._lock = threading.Lock()

    def get_new_version(self, **kwargs):
        return self

    def __call__(self, td, batch_order=None):
        rows = []
        for r in td.unbind(0):
            ids = r["tokens", "prompt"]
            seed = int(r["sampling_seed"]) if "sampling_seed" in r.keys() else None
            with self._lock:
                self.calls.append((ids.tolist(), seed))
            out, cut = self.reply(ids, seed)
            rows.append(TensorDict({("tokens", "response"): torch.tensor(out, dtype=torch.long),
                                    ("log_probs", "response"): fake_log_probs(out),
                                    "truncated": torch.tensor(bool(cut))}, batch_size=[]))
        return lazy_stack(rows)
