"""The environment interface of multi-turn episodes (TorchRL ``ChatEnv``-like names: ``reset`` / ``step`` ->
:class:`EnvStep`) and what a subclass must still write (:func:`unimplemented_method`); :func:`call_with_timeout` is
re-exported (it lives in :mod:`lit_llm.rollouts.envs.timeout`, shared with the tools). Config entries become
environments in :mod:`lit_llm.rollouts.envs.registry`.

One :class:`Environment` instance serves ONE episode: the episode engine builds a fresh one per episode from the
factory, calls :meth:`Environment.reset` with the dataset row, then alternates model turns and
:meth:`Environment.step` until a step is ``done`` (or the engine's own limits stop the episode), then
:meth:`Environment.close`. Instances are used from one worker thread and may hold per-episode state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lit_llm.rollouts.envs.timeout import call_with_timeout

if TYPE_CHECKING:
    from lit_llm.rollouts.envs.tools import Tool

__all__ = ["EnvStep", "Environment", "call_with_timeout", "prompt_messages", "unimplemented_method"]


@dataclass
class EnvStep:
    """What an environment returns for one model turn.

    Attributes:
        messages: new messages to append: tool results ``{"role": "tool", "name": ..., "content": ...}`` or user
            feedback ``{"role": "user", "content": ...}``; ``[]`` when ``done``.
        reward: this step's reward (the episode's reward is the SUM over its steps).
        done: the episode is over.
        info: statistics the episode engine aggregates, all optional: ``"tool_calls"`` (int), ``"tool_errors"``
            (int), ``"tool_time"`` (seconds, float), ``"reason"`` (str: why the episode ended, e.g. ``"answer"``,
            ``"tool_error"``, ``"parse_error"``, ``"tool_timeout"``, ``"max_turns"``); environments may add more.
    """

    messages: list[dict[str, Any]]
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The initial messages of a dataset row: its ``"prompt"`` as a message list (copied), a string prompt as one
    user message.

    Raises:
        ValueError: ``row`` has no ``"prompt"``, or it is neither a str nor a list of message dicts.
    """
    if not isinstance(row, Mapping) or "prompt" not in row:
        keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
        raise ValueError(f"Environment.reset: the dataset row needs a 'prompt' column (a str or a list of messages), "
                         f"got {keys}.")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, Mapping) for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"Environment.reset: the row's 'prompt' must be a str or a non-empty list of message dicts, got "
                     f"{prompt!r:.120}.")


def _last_assistant(messages: Sequence[Mapping[str, Any]]) -> str:
    """The content of the last message, which must be the model's assistant turn (else a ValueError)."""
    last = messages[-1] if messages else None
    if not isinstance(last, Mapping) or last.get("role") != "assistant":
        got = last.get("role") if isinstance(last, Mapping) else last
        raise ValueError(f"Environment.step: the conversation must end with the model's assistant message, got "
                         f"{got!r:.80} last.")
    content = last.get("content")
    if not isinstance(content, str):
        raise ValueError(f"Environment.step: the last assistant message's content must be a str (the decoded turn), "
                         f"got {type(content).__name__}.")
    return content


class Environment:
    """A multi-turn environment: one instance per EPISODE (the engine builds a fresh one from a factory for each
    episode; instances may hold per-episode state and are used from one worker thread).

    Subclasses implement :meth:`step` (and :meth:`reset` when the initial messages are not the row's prompt).

    Attributes:
        tools: tools offered to the model (:class:`~lit_llm.rollouts.envs.tools.Tool`; may be empty). Passed to the
            chat template's ``tools=`` (their schemas) or described in a system message.
        required_columns: dataset columns :meth:`reset` / the environment needs (checked at setup with a clear
            error).
        max_turns: the model turns the episode may have, ``None`` when unknown. The episode engine sets it on each
            fresh instance to its own ``max_turns`` (the smaller of the two when the instance already has a value),
            so an environment that tells the model how many turns are left (:class:`~lit_llm.rollouts.envs.
            GuessNumberEnv`) tells the truth.
    """

    tools: list[Tool] = []  # a read-only default: subclasses assign their own list
    required_columns: tuple[str, ...] = ()
    max_turns: int | None = None

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The initial messages of the episode of dataset row ``row`` (a dict with ``"prompt"`` and the dataset's
        other columns), e.g. ``[{"role": "user", "content": ...}]``, optionally a system message first.

        Default: the row's prompt (:func:`prompt_messages`).
        """
        return prompt_messages(row)

    def step(self, messages: list[dict[str, Any]]) -> EnvStep:
        """React to the conversation so far; its last message is the model's latest assistant turn
        (``{"role": "assistant", "content": <decoded text of the sampled ids, skip_special_tokens=True>}``).

        Must not raise for anything the model wrote (bad markup, wrong answers): turn it into messages / rewards.

        Returns:
            An :class:`EnvStep`: the new messages (roles ``"system"``, ``"user"`` or ``"tool"``, ``str`` content;
            rendered after the turn, then the model answers) or ``[]`` with ``done=True``; the step's ``reward``
            (a finite number; the episode's reward is the sum over its steps); ``done``; and ``info`` (optional
            statistics and the ``"reason"`` the episode ended).

        Raises:
            NotImplementedError: not overridden (the episode engine's setup reports it first:
                :meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement step(messages) -> EnvStep.")

    def close(self) -> None:
        """Release per-episode resources (default: nothing)."""

    def _unwritten_method(self) -> str | None:
        """What this instance's class must still write (:func:`unimplemented_method`): :meth:`step`, when it is not
        overridden. Subclasses that add a method to write (:class:`~lit_llm.rollouts.envs.ToolEnv`) extend it."""
        return "step(messages) -> EnvStep" if type(self).step is Environment.step else None


def unimplemented_method(env: Any) -> str | None:
    """What an environment instance's class must still write, or ``None``: ``"step(messages) -> EnvStep"`` for an
    :class:`Environment` subclass that does not override :meth:`Environment.step`, ``"score(answer, row) -> float"``
    for a :class:`~lit_llm.rollouts.envs.ToolEnv` subclass that does not override its ``score``. Duck-typed
    environments (not subclasses) are not checked. The check of the episode engine's setup
    (:meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`): a tiny model's turns may never end, so the
    environment may never be stepped before a real model trains."""
    return env._unwritten_method() if isinstance(env, Environment) else None
