"""Rollouts layer: the GRPO rollout layout (:class:`RolloutBatch`), the engine that samples completions with the
policy's generate version and rewards them (:class:`RolloutEngine`), multi-turn episodes with an environment
(:class:`EpisodeEngine`, token-in / token-out :class:`Trajectory`) and the asynchronous producer
(:class:`AsyncRollouts`). Uses policy, objectives and rewards; never Lightning."""

from lit_llm.rollouts.batch import RolloutBatch
from lit_llm.rollouts.engine import RolloutEngine, RolloutError, policy_responses, row_seeds
from lit_llm.rollouts.episodes import EpisodeEngine, EpisodeRenderer, Trajectory, run_episode, turn_seed
from lit_llm.rollouts.producer import AsyncRollouts

__all__ = ["AsyncRollouts", "EpisodeEngine", "EpisodeRenderer", "RolloutBatch", "RolloutEngine", "RolloutError",
           "Trajectory", "policy_responses", "row_seeds", "run_episode", "turn_seed"]
