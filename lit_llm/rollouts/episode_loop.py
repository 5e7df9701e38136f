"""One episode's loop (:func:`run_episode`): ``reset(row)`` -> first render; then per model turn the generate
version's sampled ids (kept as they are), the turn's text to ``env.step`` and its reply appended as a suffix render,
until the environment says ``done`` or one of the engine's limits (:data:`ENGINE_REASONS`) ends it. Per-turn seeds:
:func:`turn_seed`. The environment interface (:mod:`lit_llm.rollouts.envs`) is used by duck typing.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_llm.imports import call_bounded
from lit_llm.policy.sampling import splitmix64
from lit_llm.rollouts.episode_renderer import EpisodeRenderer
from lit_llm.rollouts.settings import DEFAULT_ENV_TIMEOUT, DEFAULT_MAX_TURNS, RolloutError
from lit_llm.rollouts.trajectory import Segment, Trajectory

__all__ = ["DEFAULT_ENV_TIMEOUT", "DEFAULT_MAX_TURNS", "ENGINE_REASONS", "run_episode", "turn_seed"]


#: Reasons the engine itself ends an episode (an environment gives its own in ``EnvStep.info["reason"]``).
ENGINE_REASONS = ("max_turns", "max_episode_tokens", "max_new_tokens", "max_context", "env_timeout", "aborted")

_ENV_ROLES = ("system", "user", "tool")
_TURN_SALT = 0x5EED_7A5C_0000_0000


def turn_seed(row_seed: int, turn: int) -> int:
    """Sampling seed of model turn ``turn`` of an episode whose row seed is ``row_seed`` (:func:`~lit_llm.rollouts.
    engine.row_seeds`, mixed from ``(seed, step, rank, prompt, generation)``): turn 0 uses the row seed itself (a
    one-turn episode samples exactly as :class:`~lit_llm.rollouts.engine.RolloutEngine`), turn ``t > 0``
    ``splitmix64(row_seed ^ splitmix64(salt + t)) mod 2**63``.

    Returns:
        An int in ``[0, 2**63)``.
    """
    if turn == 0:
        return int(row_seed)
    return splitmix64(int(row_seed) ^ splitmix64(_TURN_SALT + int(turn))) & ((1 << 63) - 1)


Generate = Callable[[Tensor, "int | None"], tuple[Tensor, Tensor, bool]]


class _ResetTimeout(RolloutError):
    """``env.reset`` did not return within ``env_timeout`` (the environment is then not closed)."""

    #: its message names the row itself (:func:`_row_note`): the engine adds no episode note
    #: (:meth:`lit_llm.rollouts.episodes.EpisodeEngine.run_episodes`), which the CLI would append to the line.
    names_its_row = True


def _env_name(env: Any) -> str:
    return type(env).__name__


def _row_note(row: Mapping[str, Any]) -> str:
    """``"the row with [sample_id 'x' and ]prompt '...'"``: the prompt's text (a chat prompt's last message), cut at
    80 characters."""
    prompt = row.get("prompt")
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], Mapping):
        prompt = prompt[-1].get("content")
    text = repr(prompt[:77] + "..." if isinstance(prompt, str) and len(prompt) > 80 else prompt)
    sample_id = row.get("sample_id")
    return f"the row with {f'sample_id {sample_id!r} and ' if sample_id is not None else ''}prompt {text}"


def _check_messages(messages: Any, env: Any, what: str, roles: Sequence[str]) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, Mapping) and m.get("role") in roles and isinstance(m.get("content"), str)
            for m in messages):
        raise RolloutError(f"environment {_env_name(env)}.{what} must return a list of messages "
                           f"{{'role': one of {list(roles)}, 'content': str}}, got {messages!r:.200}.")
    return [dict(m) for m in messages]


def run_episode(env: Any, row: Mapping[str, Any], *, renderer: EpisodeRenderer, generate: Generate,
                max_turns: int = DEFAULT_MAX_TURNS, max_episode_tokens: int | None = None,
                max_input_length: int | None = None, seed: int | None = None,
                env_timeout: float | None = DEFAULT_ENV_TIMEOUT,
                stop: threading.Event | None = None) -> Trajectory:
    """Run one episode of ``env`` on dataset row ``row`` and return its :class:`Trajectory` (token-in / token-out).

    Loop: ``reset(row)`` -> first render; then per model turn: ``generate(trajectory so far, turn seed)`` -> the
    sampled ids are appended as they are; the turn's decoded text (``skip_special_tokens=True``) is appended to the
    conversation as an assistant message and ``env.step(conversation)`` answers; its new messages are appended as a
    suffix render (:meth:`EpisodeRenderer.suffix_ids`). The episode ends when:

    * the environment says ``done`` (its ``info["reason"]``, default ``"done"``; not truncated; messages returned
      with ``done`` are not rendered: no model turn follows);
    * ``max_turns`` model turns were sampled and the last step is not ``done`` (``"max_turns"``). The last allowed
      turn is still stepped (it may be the final answer the environment scores), so tool calls in it *do run*:
      their ``tool_calls`` / ``tool_errors`` / ``tool_time`` and that step's reward count in the trajectory, while
      the step's messages (the tool results) are dropped, since no model turn follows to read them;
    * a turn hit the generate version's ``max_new_tokens`` without a stop token (``"max_new_tokens"``; the
      environment is not stepped: the turn has no end to append a suffix after);
    * the completion would exceed ``max_episode_tokens`` ids (sampled + environment): a turn is cut to the budget
      (a prefix of the sampled ids), a suffix that leaves no room for one more sampled id is dropped
      (``"max_episode_tokens"``);
    * the next turn's input would exceed ``max_input_length`` (``"max_context"``; the suffix is dropped);
    * ``env.step`` did not return within ``env_timeout`` seconds (``"env_timeout"``; reward of that step 0; the
      step keeps running on an abandoned daemon thread);
    * ``stop`` was set (another episode failed; ``"aborted"``).

    So a trajectory always ends with a sampled turn. The engine's reasons set ``truncated`` (the objective's
    ``mask_truncated_completions`` can drop such episodes). ``env.close()`` is called at the end (not after a step
    timeout: the abandoned step may still use the environment).

    Args:
        env: an environment (``reset``, ``step``, optional ``tools`` and ``close``), used from this thread only.
        row: the dataset row (``"prompt"`` and the other columns) passed to ``env.reset``.
        renderer: the chat-template renders.
        generate: ``fn(ids [L] long, seed or None) -> (sampled ids [S] long, log-probs [S] float32, truncated)``
            (one row of the generate version).
        max_turns: model turns at most (>= 1).
        max_episode_tokens: completion ids at most (sampled + environment), ``None``: no budget.
        max_input_length: longest input ``generate`` accepts (the context minus ``max_new_tokens``), ``None``: any.
        seed: the episode's row seed (turn ``t`` samples with :func:`turn_seed`), ``None``: the global RNG.
        env_timeout: seconds ``env.reset`` / ``env.step`` may take, ``None``: no limit.
        stop: ends the episode at its next turn when set.

    Returns:
        The :class:`Trajectory`.

    Raises:
        RolloutError: ``max_turns`` is not an int >= 1 (before ``env.reset``); ``env.reset`` / ``env.step`` raised
            or returned something that is not messages / an EnvStep, a non-finite reward; ``env.reset`` did not
            return within ``env_timeout`` (naming the environment, the row's prompt and the option); a first render that
            leaves no room to generate (the message names the environment and the fix).
        ChatTemplateError: the template cannot render the environment's messages after a turn.
        Exception: whatever ``generate`` raised.
    """
    if isinstance(max_turns, bool) or not isinstance(max_turns, numbers.Integral) or max_turns < 1:
        raise RolloutError(f"run_episode: max_turns must be an int >= 1 (model turns per episode), got "
                           f"{max_turns!r}.")
    timed_out = False
    try:
        traj = _first_render(env, row, renderer, max_input_length, env_timeout)
        prompt, length = traj.prompt_ids, traj.prompt_ids.numel()  # length: of the trajectory so far

        def end(reason: str) -> None:
            traj.truncated, traj.reason = True, reason

        tools = list(getattr(env, "tools", None) or [])
        name = _env_name(env)
        for turn in range(max_turns):
            if stop is not None and stop.is_set():
                end("aborted")
                break
            t0 = time.perf_counter()
            ids, lps, cut = generate(traj.full_ids if traj.segments else prompt,
                                     None if seed is None else turn_seed(seed, turn))
            traj.generation_time += time.perf_counter() - t0
            ids, lps = ids.reshape(-1).long().cpu(), lps.reshape(-1).float().cpu()
            room = None if max_episode_tokens is None else max_episode_tokens - (length - prompt.numel())
            over = room is not None and ids.numel() > room
            if over:
                ids, lps = ids[:room], lps[:room]
            traj.segments.append(Segment("model", ids, lps))
            traj.turns += 1
            length += ids.numel()
            text = renderer.decode(ids)
            traj.messages.append({"role": "assistant", "content": text})
            if over:
                end("max_episode_tokens")
                break
            if cut:
                end("max_new_tokens")
                break
            t1 = time.perf_counter()
            try:
                finished, step = call_bounded(functools.partial(env.step, [dict(m) for m in traj.messages]),
                                              env_timeout, "lit_llm-env-step")
            except Exception as e:
                raise RolloutError(f"environment {name}.step raised {type(e).__name__}: {e} (environments report "
                                   f"tool and model-output errors as messages; an exception is a bug of the "
                                   f"environment)") from e
            traj.env_time += time.perf_counter() - t1
            if not finished:
                timed_out = True
                end("env_timeout")
                warnings.warn(f"environment {name}.step did not return within env_timeout={env_timeout} s after turn "
                              f"{turn} of the episode on {_row_note(row)}: the episode ends "
                              f"(reason env_timeout, counted in train/episodes/truncated/env_timeout); the step keeps "
                              f"running on an abandoned thread.", UserWarning, stacklevel=2)
                break
            _record_step(traj, step, env)
            if step.done:
                traj.done, traj.reason = True, str(step.info.get("reason", "done") if step.info else "done")
                break
            if turn == max_turns - 1:
                end("max_turns")
                break
            new = _check_messages(step.messages, env, "step", _ENV_ROLES)
            suffix = renderer.suffix_ids(new, tools)
            if max_episode_tokens is not None and length - prompt.numel() + suffix.numel() >= max_episode_tokens:
                end("max_episode_tokens")
                break
            if max_input_length is not None and length + suffix.numel() > max_input_length:
                end("max_context")
                break
            traj.messages.extend(new)
            if suffix.numel():  # a template may render nothing (Llama-2 after a turn without a new message)
                traj.segments.append(Segment("env", suffix, torch.zeros(suffix.numel(), dtype=torch.float32,
                                                                        device=suffix.device)))
            length += suffix.numel()
    except _ResetTimeout:
        timed_out = True
        raise
    finally:
        if not timed_out and callable(getattr(env, "close", None)):
            env.close()
    return traj


def _first_render(env: Any, row: Mapping[str, Any], renderer: EpisodeRenderer, max_input_length: int | None,
                  env_timeout: float | None = None) -> Trajectory:
    """``env.reset(row)`` rendered: the trajectory of an episode before its first turn."""
    name = _env_name(env)
    try:
        finished, initial = call_bounded(lambda: env.reset(row), env_timeout, "lit_llm-env-reset")
    except Exception as e:
        raise RolloutError(f"environment {name}.reset raised {type(e).__name__}: {e}") from e
    if not finished:
        raise _ResetTimeout(f"environment {name}.reset did not return within env_timeout={env_timeout} s on "
                            f"{_row_note(row)} (it keeps running on an abandoned thread). Fix the environment, or "
                            f"raise --model.init_args.env_timeout (null: no limit).")
    initial = _check_messages(initial, env, "reset", ("system", "user", "assistant", "tool"))
    if not initial:
        raise RolloutError(f"environment {name}.reset returned no message; return the episode's first messages.")
    tools = list(getattr(env, "tools", None) or [])
    messages = renderer.prompt_messages(initial, tools)
    prompt = renderer.prompt_ids(messages, tools)
    if prompt.numel() == 0 or (max_input_length is not None and prompt.numel() > max_input_length):
        raise RolloutError(f"environment {name}: the first render of the row with prompt {row.get('prompt')!r:.80} "
                           f"has {prompt.numel()} tokens, leaving no room to generate (longest input "
                           f"{max_input_length} = the context minus max_new_tokens). Shorten the prompt or lower "
                           f"max_new_tokens.")
    return Trajectory(prompt_ids=prompt, messages=messages, num_prompt_messages=len(messages))


def _record_step(traj: Trajectory, step: Any, env: Any) -> None:
    if not all(hasattr(step, k) for k in ("messages", "reward", "done")):
        raise RolloutError(f"environment {_env_name(env)}.step must return an EnvStep (messages, reward, done, "
                           f"info), got {step!r:.120}.")
    try:
        reward = float(step.reward)
    except (TypeError, ValueError):
        reward = math.nan
    if not math.isfinite(reward):
        raise RolloutError(f"environment {_env_name(env)}.step returned the reward {step.reward!r}; rewards must be "
                           f"finite numbers.")
    traj.env_reward += reward
    info = getattr(step, "info", None) or {}
    traj.tool_calls += int(info.get("tool_calls", 0))
    traj.tool_errors += int(info.get("tool_errors", 0))
    traj.tool_time += float(info.get("tool_time", 0.0))
