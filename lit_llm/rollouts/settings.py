"""Rollout settings: the options of GRPO rollouts as frozen dataclasses that validate themselves once.

:class:`RolloutSettings` (sampling, groups, advantages, seeds, batching, sync / async mode, dynamic sampling) is
taken whole by :class:`~lit_llm.rollouts.engine.RolloutEngine`, :class:`~lit_llm.rollouts.episodes.EpisodeEngine`,
:class:`~lit_llm.rollouts.producer.AsyncRollouts` and :class:`~lit_llm.lightning.versions.PolicyVersionSwitch`;
:class:`EpisodeSettings` adds the options of multi-turn episodes. The YAML / CLI surface keeps TRL's flat names on
:class:`~lit_llm.lightning.grpo.GRPOModule`, which builds these objects; every rule on these options is defined
here (the group size's in :func:`~lit_llm.objectives.advantages.check_num_generations`).

Errors are :class:`RolloutError` (a ``ValueError``) whose message starts with the option's name; callers prefix
their own name (``"GRPOModule: ..."``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from lit_llm.imports import check_timeout as timeout_rule
from lit_llm.objectives.advantages import check_advantage_settings
from lit_llm.policy.generation_config import validate_generate_kwargs

__all__ = ["DEFAULT_ENV_TIMEOUT", "DEFAULT_MAX_TURNS", "EPISODE_BATCHING_TIMEOUT", "EpisodeSettings", "RolloutError",
           "RolloutSettings", "check_count", "check_timeout"]

#: Model turns per episode when neither ``max_turns`` nor ``max_tool_calling_iterations`` is given.
DEFAULT_MAX_TURNS = 8
#: Seconds an environment's ``reset`` / ``step`` may take (``env_timeout``): a ``step`` slower than that ends its
#: episode (reason ``"env_timeout"``), a ``reset`` slower than that is an error (there is no episode yet). The engine's
#: own guard against an environment that hangs (tools have their own ``tool_timeout`` inside the environment).
DEFAULT_ENV_TIMEOUT = 300.0
#: Seconds a queued turn waits for the turns of other episodes before its batch runs anyway (the batcher's
#: ``batching_timeout``). A round's batch normally runs when every live episode has queued its turn
#: (:meth:`EpisodeEngine.run_episodes` keeps ``min_batch_size`` at the episodes still running), so the timeout is only
#: reached when an environment step (a tool, a user simulator) or the first render of a round takes longer than it;
#: then the round splits, and each split costs a whole extra turn of generation. Measured (issue 16, SmolLM2-135M,
#: calculator episodes, 32 per step, 2-core CPU, bf16-mixed): with the earlier fixed ``min_batch_size`` = 32 and a
#: 50 ms timeout, the 32 first renders did not all queue within 50 ms and first rounds split (24 + 8, 11 + 21 rows),
#: 5-6 batches and 28-46 s of generation per step where 3 batches of the same episodes need ~14 s; the batch
#: composition, hence the bf16 rounding and the trajectory, then depended on thread timing. 1 s covers the first
#: renders and fast tools with room to spare; a slower tool holds its round at most this long (raise it for tools
#: that are slower than a turn of generation, lower it for tools that are slow and rare).
EPISODE_BATCHING_TIMEOUT = 1.0


class RolloutError(ValueError):
    """A prompt batch or a rollout setting is unusable; the message names the key and the fix."""


def check_count(name: str, value: Any, low: int, *, optional: bool = False) -> None:
    """``value`` is an ``int >= low`` (or ``None`` when ``optional``).

    Raises:
        RolloutError: ``"<name> must be an integer >= <low>, got <value>."``
    """
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RolloutError(f"{name} must be an integer >= {low}, got {value!r}.")


def check_timeout(name: str, value: Any) -> None:
    """:func:`lit_llm.imports.check_timeout` raising :class:`RolloutError`."""
    timeout_rule(name, value, RolloutError)


def _check_number(name: str, value: Any, *, minimum: float, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        raise RolloutError(f"{name} must be a number >= {minimum}{' or None' if optional else ''}, got {value!r}.")


@dataclass(frozen=True)
class RolloutSettings:
    """GRPO rollout options (TRL's names where TRL has them).

    Attributes:
        num_generations: completions per prompt ``G`` (>= 2).
        max_new_tokens: completion budget in tokens (TRL ``max_completion_length``; one turn of an episode).
        temperature: sampling temperature (> 0); the log-prob version scores at the same one.
        top_p: nucleus sampling (``None``: off; log-probs stay those of the full tempered distribution).
        top_k: top-k sampling (``None``: off).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (:func:`~lit_llm.objectives.compute_advantages`).
        advantage_estimator: ``"grpo"``, ``"rloo"`` or ``"reinforce_plus_plus"``.
        seed: base seed of the per-row sampling generators (``None``: the global RNG).
        chat_template: template of chat prompts without ``prompt_ids`` (``None``: the tokenizer's).
        chat_template_kwargs: template variables of those renders.
        batching: serve the rollout workers through the threaded batcher.
        num_workers: rollout worker threads (``None``: one per prompt group).
        rollout_mode: ``"sync"`` (on-policy) or ``"async"`` (background producer over a copy of the weights).
        sync_every: async: optimizer steps between weight copies (>= 1).
        max_staleness: async: drop rollouts more than this many optimizer steps old (>= 0).
        dynamic_sampling: DAPO's dynamic sampling (sync only).
        max_sampling_rounds: rollouts per step at most with dynamic sampling (>= 1; >= 2 when it is on).

    Raises:
        RolloutError: any option out of its range, or two that contradict each other (named, with the fix).
    """

    num_generations: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    scale_rewards: Literal["group", "batch", "none"] = "group"
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    seed: int | None = 0
    chat_template: Any = field(default=None, hash=False)
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    batching: bool = True
    num_workers: int | None = None
    rollout_mode: Literal["sync", "async"] = "sync"
    sync_every: int = 1
    max_staleness: int = 1
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 3

    def __post_init__(self) -> None:
        try:  # the group size and the estimator's rules (e.g. reinforce_plus_plus with scale_rewards: group)
            check_advantage_settings(self.num_generations, self.scale_rewards, self.advantage_estimator)
        except ValueError as e:
            raise RolloutError(str(e)) from e
        check_count("max_new_tokens", self.max_new_tokens, 1)
        check_count("sync_every", self.sync_every, 1)
        check_count("max_staleness", self.max_staleness, 0)
        check_count("max_sampling_rounds", self.max_sampling_rounds, 1)
        check_count("rollout_workers", self.num_workers, 1, optional=True)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not t > 0:
            raise RolloutError(f"temperature must be > 0 and finite (GRPO samples), got {self.temperature}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RolloutError(f"rollout_seed must be an integer or null (the global RNG), got {self.seed!r}.")
        try:  # the generate version's own rules on the sampling settings (top_p in (0, 1], top_k >= 1, ...)
            validate_generate_kwargs(self.generate_kwargs())
        except ValueError as e:
            raise RolloutError(str(e)) from e
        if self.rollout_mode not in ("sync", "async"):
            raise RolloutError(f"rollout_mode must be 'sync' or 'async', got {self.rollout_mode!r}.")
        if not isinstance(self.dynamic_sampling, bool):
            raise RolloutError(f"dynamic_sampling must be true or false, got {self.dynamic_sampling!r}.")
        if self.dynamic_sampling and self.max_sampling_rounds == 1:
            raise RolloutError("dynamic_sampling with max_sampling_rounds 1 draws no extra prompt batch (the same as "
                               "dynamic_sampling: false); set max_sampling_rounds >= 2, e.g. 3.")
        if self.dynamic_sampling and self.rollout_mode != "sync":
            raise RolloutError("dynamic_sampling needs rollout_mode 'sync' (it draws extra prompt batches for the step "
                               "being trained); set rollout_mode: sync or dynamic_sampling: false.")
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs or {}))
        object.__setattr__(self, "batching", bool(self.batching))

    def generate_kwargs(self) -> dict[str, Any]:
        """The generate version's ``generate_kwargs`` (TorchRL's standardised names): ``max_new_tokens``,
        ``do_sample=True``, ``temperature`` and, when set, ``top_p`` / ``top_k``."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": True,
                               "temperature": self.temperature}
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.top_k is not None:
            out["top_k"] = self.top_k
        return out


@dataclass(frozen=True)
class EpisodeSettings:
    """Options of multi-turn, tool-using episodes (:class:`~lit_llm.rollouts.episodes.EpisodeEngine`).

    Attributes:
        env_factory: returns a fresh environment per episode (e.g.
            :func:`~lit_llm.rollouts.envs.resolve_environment`'s result).
        env_reward_weight: weight of the environment's reward in the total (finite).
        max_turns: model turns per episode at most (``None``: from ``max_tool_calling_iterations``, else
            :data:`DEFAULT_MAX_TURNS`).
        max_tool_calling_iterations: TRL's name: environment replies at most (``max_turns = iterations + 1``).
        max_episode_tokens: completion ids per episode at most (sampled + environment; ``None``: the context).
        tool_timeout: seconds per tool call overriding the environment's own (``None``: the environment's).
        env_timeout: seconds an environment's ``reset`` / ``step`` may take (``None``: no limit). The call runs on a
            daemon thread that is abandoned when it times out (Python cannot stop a thread: it keeps running, its
            result is dropped, its environment is never closed): a ``step`` ends its episode (reason
            ``"env_timeout"``, truncated, the step's reward 0), a ``reset`` is a :class:`RolloutError` naming the
            environment and the row (no episode exists to truncate).
        batching_timeout: seconds the batcher waits for more turns before a shared forward pass.
        max_batch_size: rows per shared forward pass at most (``None``: no limit).
        tools_prompt: renders the tool schemas as a system message for templates without ``tools`` support.

    Raises:
        RolloutError: an option out of its range; ``max_turns`` and ``max_tool_calling_iterations`` that disagree;
            an ``env_factory`` that is not callable.
    """

    env_factory: Callable[[], Any]
    env_reward_weight: float = 1.0
    max_turns: int | None = None
    max_tool_calling_iterations: int | None = None
    max_episode_tokens: int | None = None
    tool_timeout: float | None = None
    env_timeout: float | None = DEFAULT_ENV_TIMEOUT
    batching_timeout: float = EPISODE_BATCHING_TIMEOUT
    max_batch_size: int | None = None
    tools_prompt: Callable[[list], str] | None = None

    def __post_init__(self) -> None:
        if not callable(self.env_factory):
            raise RolloutError(f"env_factory must be a callable returning a fresh environment per episode (e.g. "
                               f"resolve_environment('calculator') or the class itself), got "
                               f"{self.env_factory!r:.80}.")
        check_count("max_turns", self.max_turns, 1, optional=True)
        check_count("max_tool_calling_iterations", self.max_tool_calling_iterations, 0, optional=True)
        k, turns = self.max_tool_calling_iterations, self.max_turns
        if k is not None and turns is not None and turns != k + 1:
            raise RolloutError(
                f"max_turns={turns} and max_tool_calling_iterations={k} disagree (max_turns = iterations + 1: the "
                f"model answers once more after the last environment reply); set only one. A config that sets one "
                f"keeps it when the other is given on the command line: pass it as null, e.g. "
                f"--model.init_args.max_tool_calling_iterations {k} --model.init_args.max_turns null, or "
                f"--model.init_args.max_turns {turns} --model.init_args.max_tool_calling_iterations null.")
        check_count("max_episode_tokens", self.max_episode_tokens, 1, optional=True)
        _check_number("tool_timeout", self.tool_timeout, minimum=1e-9)
        check_timeout("env_timeout", self.env_timeout)
        _check_number("batching_timeout", self.batching_timeout, minimum=1e-9, optional=False)
        check_count("max_batch_size", self.max_batch_size, 1, optional=True)
        w = self.env_reward_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise RolloutError(f"env_reward_weight must be a finite number, got {w!r}.")

    @property
    def turns(self) -> int:
        """Model turns per episode at most: ``max_turns``, else ``max_tool_calling_iterations + 1``, else
        :data:`DEFAULT_MAX_TURNS`."""
        if self.max_turns is not None:
            return int(self.max_turns)
        if self.max_tool_calling_iterations is not None:
            return int(self.max_tool_calling_iterations) + 1
        return DEFAULT_MAX_TURNS
