"""Helpers of the GRPO-with-an-environment tests: a tiny model folder whose turns end early, scripted environments and
prompt files.

The tiny random model almost never samples ``<|im_end|>`` among SmolLM2's 49k ids, so its turns always hit
``max_new_tokens`` and an episode ends after one turn. :func:`save_tiny_with_stops` saves it with every id divisible
by ``every`` as a stop id as well (``generation_config.eos_token_id``, read by the generate version as for any model
folder): turns of a few ids, so episodes really have several turns.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lit_llm.rollouts.envs import Environment, EnvStep


def save_tiny_with_stops(folder: Path, every: int = 4) -> str:
    """The tiny random model (seed 0) and SmolLM2's tokenizer saved to ``folder``, ``<|im_end|>`` and every id
    divisible by ``every`` stopping a turn. Returns the folder (a ``model`` option)."""
    from lit_llm.models import load_tokenizer, tiny_model

    tokenizer = load_tokenizer()
    model = tiny_model(tokenizer)
    model.generation_config.eos_token_id = sorted({tokenizer.eos_token_id, *range(0, len(tokenizer), every)})
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def lookup(key: str) -> str:
    """Look up the code of a key.

    Args:
        key: the key.
    """
    return f"The code of {key} is 7."


class CapitalAfterToolEnv(Environment):
    """Two turns: whatever the model says first, the environment looks the row's key up and returns the result as a
    tool message (one tool call, counted; rows with ``mode == "error"`` count it as a failed call); the reply to that
    result ends the episode (reason ``"answer"``) with reward = the fraction of its words that start with a capital
    letter (0.0 without a word). The learning test's environment: about a fifth of the tiny model's words at first."""

    required_columns = ("key",)

    def reset(self, row):
        self.row, self.turn = row, 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        self.turn += 1
        if self.turn == 1:
            t0 = time.perf_counter()
            result = lookup(self.row["key"])
            info = {"tool_calls": 1, "tool_errors": int(self.row.get("mode") == "error"),
                    "tool_time": time.perf_counter() - t0}
            return EnvStep([{"role": "tool", "name": "lookup", "content": result}], info=info)
        words = messages[-1]["content"].split()
        reward = sum(w[0].isupper() for w in words) / len(words) if words else 0.0
        return EnvStep([], reward=reward, done=True, info={"reason": "answer"})


def write_rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def key_rows(n: int) -> list[dict]:
    """``n`` prompt rows of :class:`CapitalAfterToolEnv` (every third with a failing lookup)."""
    return [{"prompt": f"Find the code of key {k}, then answer.", "key": f"k{k}",
             "mode": "error" if k % 3 == 2 else "ok"} for k in range(n)]
