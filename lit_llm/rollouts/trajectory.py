"""The trajectory of an episode: the ids the model saw, where each came from (:class:`Segment`: sampled or
environment ids) and what happened (:class:`Trajectory`). The completion of a rollout row is everything after
``prompt_ids``; its ``loss_mask`` is provenance: 1 on sampled ids, 0 on environment ids (attended to, never trained);
generation-time log-probs on sampled ids, 0.0 on environment ids (DESIGN.md property 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lit_llm.rollouts.episode_renderer import EpisodeRenderer

__all__ = ["EPISODE_STAT_KEYS", "Segment", "Trajectory"]

#: Keys of each row's dict in :attr:`RolloutBatch.episodes <lit_llm.rollouts.batch.RolloutBatch.episodes>`.
EPISODE_STAT_KEYS = ("turns", "tool_calls", "tool_errors", "tool_time", "env_time", "generation_time", "truncated",
                     "reason", "env_reward", "sampled_tokens", "env_tokens", "prompt", "text")


class Segment(NamedTuple):
    """One part of a trajectory's completion: ``source`` ``"model"`` (sampled ids, with their generation-time
    log-probs) or ``"env"`` (a suffix render; log-probs 0.0). ``ids`` ``[L]`` long, ``log_probs`` ``[L]`` float32."""

    source: Literal["model", "env"]
    ids: Tensor
    log_probs: Tensor


@dataclass
class Trajectory:
    """One episode: the ids the model saw, where each came from, and what happened.

    Attributes:
        prompt_ids: ``[Lp]`` long, the first render (initial messages + generation prompt).
        messages: the conversation: the prompt messages (as the model saw them, tool description included), then
            each assistant turn (``{"role": "assistant", "content": decoded text}``) and each environment message.
        num_prompt_messages: how many of ``messages`` are the prompt.
        segments: the completion, in order (:class:`Segment`).
        env_reward: sum of the environment's step rewards.
        turns: model turns sampled. tool_calls, tool_errors: summed from ``EnvStep.info``.
        tool_time: seconds in tools (``EnvStep.info["tool_time"]`` summed). env_time: seconds in ``env.step``.
        generation_time: seconds this episode waited for its model turns (queueing in the batcher included).
        done: the environment ended the episode. truncated: the engine ended it (``reason`` says why: one of
            :data:`~lit_llm.rollouts.episode_loop.ENGINE_REASONS`). reason: why it ended (the environment's
            ``info["reason"]``, default ``"done"``, or the engine's).
    """

    prompt_ids: Tensor
    messages: list[dict]
    num_prompt_messages: int
    segments: list[Segment] = field(default_factory=list)
    env_reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time: float = 0.0
    env_time: float = 0.0
    generation_time: float = 0.0
    done: bool = False
    truncated: bool = False
    reason: str = ""

    def _cat(self, parts: list[Tensor], dtype: torch.dtype) -> Tensor:
        return torch.cat([p.to(dtype) for p in parts]) if parts else torch.zeros(0, dtype=dtype, device="cpu")

    @property
    def completion_ids(self) -> Tensor:
        """``[Lc]`` long: every id after the prompt (sampled and environment ids, in order)."""
        return self._cat([s.ids for s in self.segments], torch.long)

    @property
    def loss_mask(self) -> Tensor:
        """``[Lc]`` bool: True exactly on sampled ids (provenance)."""
        return self._cat([torch.full((len(s.ids),), s.source == "model", device=s.ids.device) for s in self.segments],
                         torch.bool)

    @property
    def log_probs(self) -> Tensor:
        """``[Lc]`` float32: generation-time log-probs on sampled ids, 0.0 on environment ids."""
        return self._cat([s.log_probs for s in self.segments], torch.float32)

    @property
    def full_ids(self) -> Tensor:
        """``[Lp + Lc]`` long: the whole trajectory as the model saw it."""
        return torch.cat([self.prompt_ids, self.completion_ids])

    @property
    def completion_messages(self) -> list[dict]:
        """The messages after the prompt (assistant turns and environment replies)."""
        return self.messages[self.num_prompt_messages:]

    @property
    def num_sampled_tokens(self) -> int:
        """Ids the model sampled in this episode (the ``"model"`` segments; ``loss_mask.sum()``), over all turns."""
        return sum(len(s.ids) for s in self.segments if s.source == "model")

    @property
    def num_env_tokens(self) -> int:
        """Ids of the environment's replies in the completion (the ``"env"`` suffix renders: tool results, user
        feedback and the chat template's markup around them and the next generation prompt); the prompt's ids are
        not counted. ``num_sampled_tokens + num_env_tokens == completion_ids.numel()``."""
        return sum(len(s.ids) for s in self.segments if s.source == "env")

    def text(self, tokenizer: Any) -> str:
        """The completion as the model saw it (special tokens kept, so turns stay visible); ``tokenizer`` is a
        tokenizer or an :class:`EpisodeRenderer`."""
        return _decode(tokenizer, self.completion_ids)

    def prompt_text(self, tokenizer: Any) -> str:
        """The first render as the model saw it (system message with any tool description, the user question, the
        generation prompt; special tokens kept), decoded from :attr:`prompt_ids`; ``tokenizer`` as :meth:`text`."""
        return _decode(tokenizer, self.prompt_ids)

    def stats(self, tokenizer: Any) -> dict[str, Any]:
        """The per-episode statistics (:data:`EPISODE_STAT_KEYS`) of :attr:`RolloutBatch.episodes`: the counts and
        times of the attributes, ``sampled_tokens`` / ``env_tokens`` (:attr:`num_sampled_tokens`,
        :attr:`num_env_tokens`), ``prompt`` (:meth:`prompt_text`) and ``text`` (:meth:`text`)."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_time": self.tool_time, "env_time": self.env_time, "generation_time": self.generation_time,
                "truncated": self.truncated, "reason": self.reason, "env_reward": self.env_reward,
                "sampled_tokens": self.num_sampled_tokens, "env_tokens": self.num_env_tokens,
                "prompt": self.prompt_text(tokenizer), "text": self.text(tokenizer)}


def _decode(tokenizer: Any, ids: Tensor) -> str:
    """``ids`` decoded with special tokens kept, by an :class:`EpisodeRenderer` (thread-safe) or a tokenizer."""
    if isinstance(tokenizer, EpisodeRenderer):
        return tokenizer.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids.tolist(), skip_special_tokens=False)
