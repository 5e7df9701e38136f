"""Multi-turn episodes as GRPO rollouts: token-in / token-out trajectories with provenance (DESIGN.md property 9).

An **episode** is one conversation between the policy and an environment (``reset(row) -> messages``,
``step(messages) -> EnvStep(messages, reward, done, info)``; the interface of :mod:`lit_llm.rollouts.envs`, used here
by duck typing). Its **trajectory** is the ids the model saw, in order:

* ``prompt_ids``: the first render of the initial messages with the generation prompt (``tools=`` passed to the
  template when it reads them, else the tools described by a system message);
* then segments: each sampled turn's ids **exactly as generated** (stop token included; never decoded and
  re-tokenised), and after each environment reply the ids of a **suffix render** of only the new messages plus the
  next generation prompt (:class:`EpisodeRenderer`, from :func:`lit_llm.data.chat_template.render_continuation`),
  starting right after the sampled stop token (ChatML's ``"\\n"`` after ``<|im_end|>`` belongs to the suffix). The
  history is never re-rendered, so templates that rewrite earlier turns (Qwen3 drops old reasoning) cannot make the
  trained context differ from the sampled one.

The completion of a row is everything after ``prompt_ids``; its ``loss_mask`` is provenance: 1 on sampled ids, 0 on
environment ids (attended to, never trained); generation-time log-probs on sampled ids, 0.0 on environment ids.

:class:`EpisodeEngine` runs ``P`` prompts x ``num_generations`` episodes, each in its own worker thread; every model
turn calls the generate version through the wrapper's threaded batcher, so turns of different episodes share forward
passes in lock-step rounds: ``min_batch_size`` follows the number of episodes still running, so each round is one
batch of every live episode's turn whatever the threads' timing, and ``batching_timeout``
(:data:`EPISODE_BATCHING_TIMEOUT`, measured) only bounds the wait for an environment step slower than it.

Modules, one job each (every name is importable from here too): :mod:`~lit_llm.rollouts.episode_renderer` (the
renders), :mod:`~lit_llm.rollouts.trajectory` (:class:`Segment`, :class:`Trajectory`),
:mod:`~lit_llm.rollouts.episode_loop` (:func:`run_episode`, :func:`turn_seed`, the limits) and this one (the engine).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from lit_llm.objectives.advantages import compute_advantages
from lit_llm.policy.batching import caller_context, in_context
from lit_llm.rewards import TrainerState
from lit_llm.rollouts.batch import RolloutBatch, host_lists
from lit_llm.rollouts.engine import (
    RolloutEngine,
    RolloutError,
    distinct_prompts,
    policy_responses,
    read_prompt_batch,
    row_seeds,
)
from lit_llm.rollouts.envs.base import unimplemented_method
from lit_llm.rollouts.envs.tools import tool_schemas
from lit_llm.rollouts.episode_loop import (
    ENGINE_REASONS,
    Generate,
    _env_name,
    run_episode,
    turn_seed,
)
from lit_llm.rollouts.episode_renderer import EpisodeRenderer
from lit_llm.rollouts.settings import (
    DEFAULT_ENV_TIMEOUT,
    DEFAULT_MAX_TURNS,
    EPISODE_BATCHING_TIMEOUT,
    EpisodeSettings,
    RolloutSettings,
)
from lit_llm.rollouts.trajectory import EPISODE_STAT_KEYS, Segment, Trajectory

__all__ = ["DEFAULT_ENV_TIMEOUT", "DEFAULT_MAX_TURNS", "ENGINE_REASONS", "EPISODE_BATCHING_TIMEOUT",
           "EPISODE_STAT_KEYS", "EpisodeEngine", "EpisodeRenderer", "Segment", "Trajectory", "run_episode", "turn_seed"]



def _episode_note(i: int, n: int, row: Any, num_generations: int) -> str:
    """Where episode ``i`` of ``n`` comes from: its prompt (and generation) index and the row's sample id."""
    g = max(int(num_generations), 1)
    where = f"prompt {i // g}, generation {i % g}" if g > 1 else f"prompt {i}"
    sample_id = row.get("sample_id") if isinstance(row, Mapping) else None
    return f"in episode {i} of {n} ({where}" + (f", sample_id {sample_id!r})" if sample_id is not None else ")")


class EpisodeEngine(RolloutEngine):
    """Multi-turn GRPO rollouts: ``num_generations`` episodes per prompt with an environment, token-in / token-out.

    Same public surface as :class:`~lit_llm.rollouts.engine.RolloutEngine` (:meth:`rollout`, :meth:`load_weights`,
    :attr:`version`, :attr:`model`, :attr:`num_policy_calls`, :attr:`seed`, :attr:`rank`), so the GRPO module, the
    version switch and :class:`~lit_llm.rollouts.producer.AsyncRollouts` drive it unchanged.

    Rewards: the episode's environment reward (sum of its steps' rewards) is the reward named ``"env"``; with
    ``reward_fn`` (TRL signature: ``prompts`` = each episode's prompt messages, ``completions`` = its messages after
    the prompt, ``completion_ids`` = its completion ids, sampled and environment), its functions are added: ``total =
    env_reward_weight * env + reward_fn total``. Besides the batch's columns, ``reward_fn`` gets a ``tools`` column
    (each episode's tool schemas, ``[]`` for an environment without tools; what
    :func:`lit_llm.rewards.tool_call_format_reward` reads) unless the batch has a ``tools`` column itself.
    Advantages are group-relative over the ``num_generations`` episodes of a prompt
    (:func:`~lit_llm.objectives.compute_advantages`, every option).

    Args:
        policy: the generate version (tokens mode, log-probs), as for :class:`RolloutEngine`.
        tokenizer: the policy's fast tokenizer.
        env_factory: ``fn() -> Environment``, called once per episode (e.g. from
            :func:`lit_llm.rollouts.envs.resolve_environment`; a class works too); the ``env_factory`` of
            ``episode`` when that is given.
        reward_fn: optional extra reward functions over whole episodes (e.g. :class:`lit_llm.rewards.
            RewardFunctions`).
        settings: the :class:`~lit_llm.rollouts.settings.RolloutSettings` (``num_generations`` = episodes per
            prompt; ``batching``: the episodes run concurrently, one thread each, served by the batcher, ``False``:
            one after the other with direct calls; ``num_workers``: episode threads at most), as for
            :class:`RolloutEngine`.
        episode: the :class:`~lit_llm.rollouts.settings.EpisodeSettings` (turn and token budgets, timeouts, the
            environment reward's weight; ``tool_timeout`` is set as the ``tool_timeout`` attribute of each
            environment that has one, overriding the environment's own value, with a one-time ``UserWarning`` naming
            both when they differ; ``max_episode_tokens`` is also :attr:`max_completion_length`, ``dr_grpo``'s
            constant).
        version, rank, trainer_state_fn: as :class:`RolloutEngine`.
        **options: fields of :class:`RolloutSettings` and :class:`EpisodeSettings`, when those are not given.

    Raises:
        RolloutError: a setting out of range, ``max_turns`` and ``max_tool_calling_iterations`` that disagree, an
            ``env_factory`` that is not callable, a policy that is not a tokens-mode generate version.
    """

    def __init__(self, policy: Any, *, tokenizer: Any, env_factory: Callable[[], Any] | None = None,
                 reward_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]] | None = None,
                 settings: RolloutSettings | None = None, episode: EpisodeSettings | None = None, version: int = 0,
                 rank: int = 0, trainer_state_fn: Callable[[], TrainerState] | None = None, **options: Any) -> None:
        fields = {f.name for f in dataclasses.fields(EpisodeSettings)}
        episode_options = {k: options.pop(k) for k in list(options) if k in fields}
        if env_factory is not None:
            episode_options["env_factory"] = env_factory
        if episode is not None and episode_options:
            raise RolloutError(f"give either episode or its fields, not both (options: {sorted(episode_options)}).")
        super().__init__(policy, tokenizer=tokenizer, reward_fn=reward_fn, settings=settings, version=version,
                         rank=rank, trainer_state_fn=trainer_state_fn, **options)
        if episode is None:
            try:
                episode = EpisodeSettings(**episode_options)
            except TypeError as e:
                raise RolloutError(f"EpisodeEngine needs env_factory (a callable returning a fresh environment per "
                                   f"episode): {e}") from e
        self.episode = episode
        self.env_factory = episode.env_factory
        self.env_reward_weight = float(episode.env_reward_weight)
        self.max_turns = episode.turns
        self.max_episode_tokens = episode.max_episode_tokens
        self.tool_timeout, self.env_timeout = episode.tool_timeout, episode.env_timeout
        self._warned_tool_timeout = False
        self.batching_timeout, self.max_batch_size = float(episode.batching_timeout), episode.max_batch_size
        self.renderer = EpisodeRenderer(tokenizer, chat_template=self.chat_template,
                                        chat_template_kwargs=self.chat_template_kwargs,
                                        tools_prompt=episode.tools_prompt)
        context = getattr(getattr(getattr(policy, "model", None), "config", None), "max_position_embeddings", None)
        self.max_input_length = None if context is None else int(context) - self.max_new_tokens

    def twin_kwargs(self) -> dict[str, Any]:
        """:meth:`RolloutEngine.twin_kwargs` plus the episode settings (whole)."""
        return {**super().twin_kwargs(), "episode": self.episode}

    @property
    def max_completion_length(self) -> int | None:
        """The longest completion of an episode (``max_episode_tokens``): ``dr_grpo``'s constant denominator."""
        return self.max_episode_tokens

    # ------------------------------------------------------------------------------------------------ setup
    def make_env(self) -> Any:
        """A fresh environment from :attr:`env_factory`, with :attr:`tool_timeout` set when it has that attribute
        and :attr:`tool_timeout` is not ``None`` (the engine's value wins; the first environment whose own value
        differs gets a ``UserWarning`` naming both, once per engine), and its ``max_turns`` attribute, when it has
        one (:attr:`lit_llm.rollouts.envs.Environment.max_turns`), set to the turns an episode really gets:
        :attr:`max_turns`, or the environment's own value when that is smaller.

        Raises:
            RolloutError: the factory raised.
        """
        try:
            env = self.env_factory()
        except Exception as e:
            raise RolloutError(f"env_factory {self.env_factory!r:.80} raised {type(e).__name__}: {e}") from e
        if hasattr(env, "max_turns"):
            own = env.max_turns
            env.max_turns = self.max_turns if own is None else min(int(own), self.max_turns)
        if self.tool_timeout is not None and hasattr(env, "tool_timeout"):
            own = env.tool_timeout
            if own != self.tool_timeout and not self._warned_tool_timeout:
                self._warned_tool_timeout = True
                warnings.warn(f"tool_timeout={self.tool_timeout} (the GRPO module's / engine's) overrides the "
                              f"environment {_env_name(env)}'s own tool_timeout={own}; set the module's "
                              f"tool_timeout to null to keep the environment's value.", UserWarning, stacklevel=2)
            env.tool_timeout = self.tool_timeout
        return env

    def _with_fresh_env(self, check: Callable[[Any], None]) -> None:
        """Run ``check`` on a fresh environment from :meth:`make_env`, closed (``close()``, when it has one) after."""
        env = self.make_env()
        try:
            check(env)
        finally:
            if callable(getattr(env, "close", None)):
                env.close()

    def check_environment(self, env: Any = None) -> None:
        """Check that the environment's class implements what episodes call
        (:func:`~lit_llm.rollouts.envs.base.unimplemented_method`): ``step`` for an
        :class:`~lit_llm.rollouts.envs.Environment` subclass, ``score`` for a
        :class:`~lit_llm.rollouts.envs.ToolEnv` one. Without this check a run whose turns never end (a tiny model's
        hit ``max_new_tokens``) would never step the environment and train without an error.

        ``env``: the environment to ask; ``None``: a fresh one from :meth:`make_env`, closed after the check.

        Raises:
            RolloutError: naming the class and the method to write.
        """
        if env is None:
            return self._with_fresh_env(self.check_environment)
        method = unimplemented_method(env)
        if method is not None:
            name, base = _env_name(env), "ToolEnv" if method.startswith("score") else "Environment"
            what = ("the reward of the final answer (a turn without tool calls)" if base == "ToolEnv"
                    else "the environment's reply to each model turn")
            raise RolloutError(f"environment {name} does not implement {method}, {what}; it inherits {base}."
                               f"{method.partition('(')[0]}, which raises NotImplementedError. Write "
                               f"{name}.{method.partition(' ->')[0]}.")

    def check_columns(self, columns: Sequence[str], *, source: str = "the dataset", env: Any = None) -> None:
        """Check that the prompt rows hold every column the environment's ``reset`` needs (``required_columns``).

        ``env``: the environment to ask; ``None``: a fresh one from :meth:`make_env`, closed (``close()``, when it
        has one) after the check.

        Raises:
            RolloutError: naming the environment, the missing columns and ``source``'s columns.
        """
        if env is None:
            return self._with_fresh_env(lambda e: self.check_columns(columns, source=source, env=e))
        have = {"prompt", "sample_id", *columns}
        missing = [c for c in getattr(env, "required_columns", ()) or () if c not in have]
        if missing:
            raise RolloutError(f"environment {_env_name(env)} needs the column(s) {missing}, but {source} has only "
                               f"{sorted(have)}. Add them to the dataset or rename a column (data.rename_columns).")

    # ---------------------------------------------------------------------------------------------- episodes
    def _generator(self, policy: Any, order: int | None) -> Generate:
        def generate(ids: Tensor, seed: int | None) -> tuple[Tensor, Tensor, bool]:
            with self._lock:
                self.num_policy_calls += 1
            seeds = None if seed is None else torch.tensor([seed], dtype=torch.long, device="cpu")
            resp, lps, cut = policy_responses(policy, [ids], seeds=seeds, batch_order=order)
            return resp[0], lps[0], cut[0]
        return generate

    def run_episodes(self, envs: Sequence[Any], rows: Sequence[Mapping[str, Any]],
                     seeds: Sequence[int] | None = None, *, num_generations: int | None = None) -> list[Trajectory]:
        """Run episode ``i`` of ``envs[i]`` on ``rows[i]`` (seed ``seeds[i]``) for every ``i``.

        With :attr:`batching`, one thread per episode (at most :attr:`num_workers`), every turn through the batching
        version of the policy in **lock-step rounds**: its ``min_batch_size`` is the number of episodes still running
        (at most the threads; lowered as episodes end, :meth:`~lit_llm.policy.batching.BatchingMixin.
        set_min_batch_size`), so a batch runs once every live episode has queued its turn, ordered by ``batch_order``
        = the episode index; ``batching_timeout`` = :attr:`batching_timeout` only bounds the wait for an episode
        whose environment step is slower than it. Each round's batch is then the same whatever the threads' timing,
        so rollouts are reproducible (seeded sampling, no timeout reached, ``max_batch_size`` unset or at least the
        episodes running: a smaller one splits rounds by arrival). One ``run_episodes`` at a time per engine (its
        batching version's count is shared). Without batching, one episode after the other with direct calls.

        Args:
            envs, rows, seeds: one entry per episode.
            num_generations: consecutive episodes per prompt, for the error note (``None``: :attr:`num_generations`,
                as :meth:`rollout` lays them out; the greedy evaluation runs one episode per row: 1).

        Raises:
            The first error of an episode (the others then end at their next turn, reason ``"aborted"``), with a
            note naming the episode: ``"in episode i of n (prompt p, generation k, sample_id '...')"`` (``p = i //
            num_generations``, ``k = i % num_generations``; ``"(prompt p, sample_id ...)"`` when
            ``num_generations`` is 1; the sample id when the row has one).
        """
        n = len(envs)
        workers = min(self.num_workers or n, n)
        batched = self.batching and workers > 1
        policy = self.policy
        if batched:
            size = workers if self.max_batch_size is None else min(workers, self.max_batch_size)
            policy = self.batched_policy(size, timeout=self.batching_timeout, max_batch_size=self.max_batch_size)
        device_type = policy.device.type
        context = caller_context(device_type)
        stop = threading.Event()
        errors: list[tuple[int, BaseException]] = []
        remaining, count_lock = [n], threading.Lock()
        # lock-step rounds: a batch runs once every episode still running has queued its turn (a policy without
        # set_min_batch_size keeps min_batch_size = the threads: later rounds then wait for the timeout)
        set_min = getattr(policy, "set_min_batch_size", None) if batched else None
        if set_min is not None:
            set_min(size)

        def finished() -> None:
            if set_min is None:
                return
            with count_lock:  # in order: a later, smaller count never gets overwritten by an earlier one
                remaining[0] -= 1
                running = min(workers, remaining[0])
                if running >= 1:
                    set_min(min(running, size))

        def one(i: int) -> Trajectory | None:
            try:
                if stop.is_set():
                    return None
                with in_context(context, device_type):
                    return run_episode(envs[i], rows[i], renderer=self.renderer,
                                       generate=self._generator(policy, i if batched else None),
                                       max_turns=self.max_turns, max_episode_tokens=self.max_episode_tokens,
                                       max_input_length=self.max_input_length,
                                       seed=None if seeds is None else int(seeds[i]), env_timeout=self.env_timeout,
                                       stop=stop)
            except BaseException as e:  # noqa: BLE001 - raised below, after the other episodes stop
                stop.set()
                errors.append((i, e))
                return None
            finally:
                finished()

        if batched:
            try:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lit_llm-episode") as pool:
                    results = list(pool.map(one, range(n)))
            finally:
                if set_min is not None:
                    set_min(size)  # back to the configured size between rollouts
        else:
            results = [one(i) for i in range(n)]
        if errors:
            i, err = errors[0]
            if not getattr(err, "names_its_row", False):  # a reset timeout names its row in its message
                err.add_note(_episode_note(i, n, rows[i], num_generations or self.num_generations))
            raise err
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------- rollouts
    def rollout(self, batch: Mapping[str, Any], *, step: int = 0, version: int | None = None,
                trainer_state: TrainerState | None = None, sampling_round: int = 0) -> RolloutBatch:
        """Run ``P * num_generations`` episodes and build their :class:`RolloutBatch`.

        Args:
            batch: the prompt batch: ``"prompt"`` (``P`` entries), optional ``"sample_id"`` and dataset columns
                (lists of ``P``); each episode's ``env.reset`` gets the row ``{"prompt": ..., "sample_id": ...,
                **columns}``. ``"prompt_ids"`` is ignored (the environment's first messages are rendered).
            step: the training step (mixed into the per-row seeds). version, trainer_state, sampling_round: as
                :meth:`RolloutEngine.rollout`.

        Returns:
            A :class:`RolloutBatch` (``N = P * G`` rows): ``prompt_ids`` the first renders, ``completion_ids`` the
            rest of each trajectory, ``loss_mask`` the sampled ids, ``old_log_probs`` / ``rollout_log_probs``
            generation-time log-probs (0.0 on environment ids), ``truncated`` the engine's endings, ``rewards``
            ``"env"`` plus ``reward_fn``'s, ``completion`` the episode text (special tokens kept),
            ``generation_time`` the wall time of the episodes, ``episodes`` the per-episode statistics
            (:data:`EPISODE_STAT_KEYS`).

        Raises:
            RolloutError: a bad prompt batch, an environment missing columns, a method
                (:meth:`check_environment`) or failing (names it), a reward function named ``"env"``.
            lit_llm.rewards.RewardError: a reward function raised or returned NaN / the wrong length.
        """
        prompts, sample_ids, columns = read_prompt_batch(batch)
        n_prompts, g = len(prompts), self.num_generations
        if trainer_state is None:
            trainer_state = self.current_trainer_state(step)
        rows = [{"prompt": prompts[k], "sample_id": sample_ids[k], **{c: v[k] for c, v in columns.items()}}
                for k in range(n_prompts)]
        first = self.make_env()
        try:
            self.check_environment(first)
            self.check_columns(list(columns), source="the prompt batch", env=first)
        except RolloutError:
            if callable(getattr(first, "close", None)):
                first.close()
            raise
        envs = [first, *(self.make_env() for _ in range(n_prompts * g - 1))]
        seeds = (None if self.seed is None
                 else row_seeds(self.seed, step, self.rank, n_prompts, g, sampling_round).tolist())

        t0 = time.perf_counter()
        trajs = self.run_episodes(envs, [rows[i // g] for i in range(len(envs))], seeds)
        gen_time = time.perf_counter() - t0

        t1 = time.perf_counter()
        env_reward = torch.tensor([t.env_reward for t in trajs], dtype=torch.float32, device="cpu")
        per_fn = {"env": env_reward}
        total = self.env_reward_weight * env_reward
        if self.reward_fn is not None:
            rep_columns = {k: [v for v in col for _ in range(g)] for k, col in columns.items()}
            if "tools" not in rep_columns:  # each episode's tool schemas (tool_call_format_reward reads them)
                rep_columns["tools"] = [tool_schemas(getattr(env, "tools", None)) for env in envs]
            fn_total, fn_rewards = self.reward_fn(
                prompts=[t.messages[:t.num_prompt_messages] for t in trajs],
                completions=[t.completion_messages for t in trajs],
                completion_ids=host_lists([t.completion_ids for t in trajs]), trainer_state=trainer_state,
                **rep_columns)
            if "env" in fn_rewards:
                raise RolloutError("a reward function is named 'env', the name of the environment's reward; rename "
                                   "it.")
            per_fn.update(fn_rewards)
            total = total + torch.as_tensor(fn_total, dtype=torch.float32, device="cpu").reshape(-1)
        advantages, stats = compute_advantages(total, g, scale_rewards=self.scale_rewards,
                                               advantage_estimator=self.advantage_estimator)
        reward_time = time.perf_counter() - t1

        unique, prompt_index = distinct_prompts([t.prompt_ids for t in trajs])
        return RolloutBatch.from_rows(
            prompts=unique, prompt_index=prompt_index, completions=[t.completion_ids for t in trajs],
            old_log_probs=[t.log_probs for t in trajs], loss_masks=[t.loss_mask for t in trajs], reward=total,
            advantage=advantages, truncated=[t.truncated for t in trajs],
            group=torch.arange(n_prompts, device="cpu").repeat_interleave(g),
            policy_version=self.version if version is None else version, pad_token_id=self.pad_token_id,
            rewards=per_fn, sample_id=[s for s in sample_ids for _ in range(g)],
            completion=[t.text(self.tokenizer) for t in trajs], generation_time=gen_time, reward_time=reward_time,
            frac_reward_zero_std=float(stats["frac_reward_zero_std"]),
            episodes=[t.stats(self.tokenizer) for t in trajs])
