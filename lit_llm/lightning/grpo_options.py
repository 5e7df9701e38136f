"""The components :class:`~lit_llm.lightning.grpo.GRPOModule` is wired from, each built from its flat options (TRL's
names, the YAML / CLI surface) and validated once: the rollout and episode settings
(:class:`~lit_llm.rollouts.settings.RolloutSettings`, :class:`~lit_llm.rollouts.settings.EpisodeSettings`), the
reward functions (:func:`build_rewards`) and the columns they read (:func:`check_prompt_columns`), the GRPO objective
(:func:`build_objective`: a built-in ``loss_type``, or a user's objective class by import path), the old-log-prob
source (:func:`check_old_log_probs`) and the colocated vLLM engine (:func:`build_vllm`).

Every error names the module's option: :func:`owner_errors` prefixes ``"GRPOModule: "`` to the components' own
messages (the CLI's hint looks the option up by name).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_llm.imports import load_target, split_import_path
from lit_llm.lightning.environment_option import user_code_unresolved
from lit_llm.lightning.episode_metrics import EPISODE_EVAL_METRICS
from lit_llm.objectives.grpo import GRPOObjective
from lit_llm.objectives.loss_types import Cispo
from lit_llm.policy.vllm_engine import check_vllm_installed
from lit_llm.rewards import RewardError, RewardFunctions, resolve_reward
from lit_llm.rollouts.engine import RESERVED_KEYS
from lit_llm.rollouts.settings import DEFAULT_ENV_TIMEOUT, EpisodeSettings, RolloutSettings, check_timeout
from lit_llm.rollouts.vllm_colocate import VLLMRollouts, VLLMSettings, check_vllm_sampling

__all__ = ["DEFAULT_REWARDS", "build_objective", "build_rewards", "build_vllm", "check_old_log_probs",
           "check_prompt_columns", "episode_settings", "owner_errors"]

#: Shaped arithmetic reward (the base model rarely answers with just the number: format + answer).
DEFAULT_REWARDS = ("lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward",
                   "lit_llm.rewards:strict_number_format_reward")

RewardSpec = str | Callable[..., Any]


@contextlib.contextmanager
def owner_errors(owner: str) -> Iterator[None]:
    """Re-raise a ``ValueError`` (same class) with ``"<owner>: "`` before its message, unless it starts so."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith(f"{owner}: "):
            raise
        try:
            err = type(e)(f"{owner}: {e}")
        except TypeError:  # a subclass with another constructor: keep it
            raise e from None
        raise err from e


def check_old_log_probs(old_log_probs: str, rollout_correction: str, rollout_mode: str) -> None:
    """Check the old-log-prob source against the rollout correction and the rollout mode.

    Raises:
        ValueError: ``old_log_probs`` not ``rollout`` / ``recompute``; a ``rollout_correction`` without
            ``old_log_probs: recompute`` (its weight is recomputed-old over generation-time probability); in async
            mode, ``recompute`` without a correction (the ratio would start at 1 and hide the rollout's staleness).
    """
    if old_log_probs not in ("rollout", "recompute"):
        raise ValueError(f"GRPOModule: old_log_probs must be 'rollout' (generation-time) or 'recompute' (the "
                         f"training forward under no-grad), got {old_log_probs!r}.")
    if rollout_correction != "none" and old_log_probs != "recompute":
        raise ValueError(f"GRPOModule: rollout_correction={rollout_correction!r} weighs tokens by recomputed-old over "
                         f"generation-time probability; set old_log_probs: recompute (or rollout_correction: none).")
    if rollout_mode == "async" and old_log_probs == "recompute" and rollout_correction == "none":
        raise ValueError("GRPOModule: rollout_mode async with old_log_probs: recompute and no rollout_correction "
                         "would hide the rollouts' staleness (the ratio starts at 1 on the trainer's weights); set "
                         "rollout_correction (e.g. token_truncate) or old_log_probs: rollout.")


def episode_settings(env_factory: Callable[[], Any] | None, **options: Any) -> EpisodeSettings | None:
    """The :class:`~lit_llm.rollouts.settings.EpisodeSettings` of an environment (``None`` without one).

    Args:
        env_factory: the environment factory (``None``: single-turn GRPO).
        **options: the episode options (``max_turns``, ``max_tool_calling_iterations``, ``max_episode_tokens``,
            ``tool_timeout``, ``env_reward_weight``, ``env_timeout``).

    Raises:
        ValueError: episode options without an environment (named, with the fix); an invalid option.
    """
    if env_factory is None:
        defaults = {"env_reward_weight": 1.0, "env_timeout": DEFAULT_ENV_TIMEOUT}  # options not None by default
        given = [k for k, v in options.items() if v is not None and k not in defaults]
        given += [k for k, v in defaults.items() if options.get(k, v) != v]
        if given:
            raise ValueError(f"GRPOModule: {given} apply to multi-turn episodes only, but no environment is set. "
                             f"Set --model.init_args.environment (e.g. calculator), or drop them.")
        return None
    return EpisodeSettings(env_factory=env_factory, **options)


def build_rewards(reward_funcs: Sequence[RewardSpec] | None, reward_weights: list[float] | None,
                  eval_reward_funcs: Sequence[RewardSpec] | None, reward_timeout: float | None = None, *,
                  with_environment: bool) -> tuple[RewardFunctions | None, RewardFunctions | None]:
    """``(rewards, eval_rewards)``: the training reward functions (``None``: the environment's reward alone) and the
    evaluation ones (default: the training ones; ``None``: none), both with ``reward_timeout`` (seconds per call,
    :class:`~lit_llm.rewards.RewardFunctions`' ``timeout``).

    ``reward_funcs`` ``None`` means :data:`DEFAULT_REWARDS` without an environment, none with one.

    Raises:
        RewardError: a spec that does not resolve (checked first); ``reward_weights`` of another length than
            ``reward_funcs``.
        ValueError: ``reward_weights`` without ``reward_funcs`` with an environment; an evaluation function named as
            an episode evaluation metric; a ``reward_timeout`` that is not a number > 0 or ``None``.
    """
    with owner_errors("GRPOModule"):
        check_timeout("reward_timeout", reward_timeout)
    if reward_funcs is None:
        reward_funcs = [] if with_environment else DEFAULT_REWARDS
    null_weights = ("a config that sets reward_weights keeps them when reward_funcs is changed on the command "
                    "line: pass --model.init_args.reward_weights null too (all weights 1), or one weight per "
                    "function")
    funcs = [resolve_reward(f) for f in reward_funcs]  # an unknown name is told before a weights mismatch
    if reward_weights is not None and funcs and len(reward_weights) != len(funcs):
        raise RewardError(f"GRPOModule: reward_weights {list(reward_weights)} has {len(reward_weights)} entries "
                          f"but reward_funcs {list(reward_funcs)} has {len(reward_funcs)}; {null_weights}.")
    if not with_environment or list(reward_funcs):
        rewards: RewardFunctions | None = RewardFunctions(funcs, reward_weights, timeout=reward_timeout)
    else:  # the environment's reward alone
        if reward_weights:
            raise ValueError(f"GRPOModule: reward_weights {reward_weights} given without reward_funcs (the "
                             f"environment's reward is weighted by env_reward_weight); {null_weights}.")
        rewards = None
    evals = list(eval_reward_funcs or reward_funcs)
    eval_rewards = RewardFunctions(evals, timeout=reward_timeout) if evals else None
    eval_names = [] if eval_rewards is None else eval_rewards.names
    clash = sorted(set(eval_names) & set(EPISODE_EVAL_METRICS)) if with_environment else []
    if clash:
        raise ValueError(f"GRPOModule: eval reward function(s) {clash} have the names of the episode evaluation "
                         f"metrics eval/{clash[0]}; rename them.")
    return rewards, eval_rewards


def _load_objective(spec: str) -> Any:
    """The object an ``objective`` import path names (see :func:`build_objective`)."""
    target, name, is_file = split_import_path(str(spec).strip())
    if not target or not name:
        raise ValueError(f"GRPOModule: objective {spec!r} is not an import path; give 'my_loss:MyObjective' (a module "
                         f"importable or in the current directory) or 'path/to/my_loss.py:MyObjective'.")
    module = load_target(target, spec, is_file, what="objective", entry=" (model.init_args.objective)",
                         error=ValueError)
    if not hasattr(module, name):
        raise ValueError(f"GRPOModule: objective {spec!r}: module {target!r} has no {name!r}.")
    return getattr(module, name)


def build_objective(objective: str | None, *, loss_type: str | None, with_environment: bool,
                    **knobs: Any) -> GRPOObjective:
    """The GRPO objective of the module: :class:`~lit_llm.objectives.GRPOObjective` of a built-in ``loss_type``
    (:mod:`lit_llm.objectives.loss_types`), or the user's objective class named by ``objective``.

    A user's objective is an import path (``"my_loss:MyObjective"``, a module importable or in the current
    directory, ``"my_loss.MyObjective"``, or ``"path/to/my_loss.py:MyObjective"``) of a
    :class:`~lit_llm.objectives.GRPOObjective` subclass (a frozen dataclass: override :meth:`GRPOObjective.__call__`,
    :meth:`~GRPOObjective.local_count` or its loss type's strategy); it is built with the same knobs (``epsilon``,
    ``beta``, ...), and its own ``loss_type`` field (default ``"dapo"``) says which step count it uses.

    Args:
        objective: the import path, or ``None`` (the built-in ``loss_type``).
        loss_type: the ``loss_type`` option (``None``: ``"dapo"``, or the objective class's own).
        with_environment: episodes (``dr_grpo``'s constant is then ``max_episode_tokens``).
        **knobs: :class:`GRPOObjective`'s other fields (``max_completion_length`` included).

    Raises:
        ValueError: ``objective`` together with a ``loss_type`` its class does not use (both named); an objective
            that does not import or is not a :class:`GRPOObjective` subclass; invalid knobs; ``dr_grpo`` without a
            completion length.
    """
    cls: type[GRPOObjective] = GRPOObjective
    if objective is not None and user_code_unresolved():  # weights only (export, chat): the built-in objective
        objective = None
    if objective is not None:
        cls = _load_objective(objective)
        if not (isinstance(cls, type) and issubclass(cls, GRPOObjective)):
            raise ValueError(f"GRPOModule: objective {objective!r} is {cls!r:.80}, not a subclass of "
                             f"lit_llm.objectives.GRPOObjective; subclass it (a frozen dataclass) and override "
                             f"__call__ / local_count.")
        own = next(f.default for f in dataclasses.fields(cls) if f.name == "loss_type")
        if loss_type is not None and loss_type != own:
            raise ValueError(f"GRPOModule: objective {objective!r} uses loss_type {own!r} (its class's), but "
                             f"loss_type: {loss_type!r} is set too; drop one: --model.init_args.loss_type null keeps "
                             f"the objective's, or set the objective's loss_type field to {loss_type!r}.")
        loss_type = own
    loss_type = loss_type or "dapo"
    if loss_type == "dr_grpo" and with_environment and knobs.get("max_completion_length") is None:
        raise ValueError("GRPOModule: loss_type='dr_grpo' divides by a constant completion length, which with an "
                         "environment is max_episode_tokens (the budget of an episode's completion, sampled + "
                         "environment ids); set max_episode_tokens, or choose another loss_type.")
    if loss_type == "cispo" and (advice := Cispo.advice(knobs.get("epsilon_high"))):
        rank_zero_warn(f"GRPOModule: {advice}")
    return cls(loss_type=loss_type, **knobs)


def check_prompt_columns(datamodule: Any, stage: str, *, rewards: RewardFunctions | None,
                         eval_rewards: RewardFunctions | None, engine: Any = None) -> None:
    """Check, before the first rollout, that the prompts hold every column the reward functions need
    (``reward_funcs`` against the training prompts when fitting, ``eval_reward_funcs`` against the held-out
    prompts when they exist), and with an ``environment`` every column its ``reset`` needs (its
    ``required_columns``, :meth:`~lit_llm.rollouts.EpisodeEngine.check_columns`; the reward functions then also
    get the engine's ``tools`` column). The columns are ``datamodule.columns`` when it has them, else the keys of
    its first ``train_rows`` / ``eval_rows`` row other than ``prompt``, ``prompt_ids`` and ``sample_id``.
    Nothing to check without a data module (dataloaders passed to ``fit``).

    Args:
        datamodule: the trainer's data module (or ``None``).
        stage: Lightning's stage (``"fit"``, ``"validate"``, ...).
        rewards, eval_rewards: the training / evaluation reward functions (``None``: none).
        engine: with an environment, the :class:`~lit_llm.rollouts.EpisodeEngine` (``None``: single-turn).

    Raises:
        lit_llm.rewards.RewardError: naming the function, the missing column and the prompts' columns.
        lit_llm.rollouts.RolloutError: naming the environment, the missing column and the prompts' columns.
    """
    if datamodule is None:
        return
    declared = getattr(datamodule, "columns", None)
    checks = [(rewards, "train_rows", "the training prompts")] if stage == "fit" else []
    if stage in ("fit", "validate"):
        checks.append((eval_rewards, "eval_rows", "the evaluation prompts"))
    for functions, attr, source in checks:
        rows = getattr(datamodule, attr, None)
        if rows is not None and len(rows) == 0:
            continue  # no such prompts: nothing will be scored
        if declared is not None:
            columns = list(declared)
        elif rows:
            columns = [k for k in rows[0] if k not in RESERVED_KEYS]
        else:
            continue
        source = f"{source} of {type(datamodule).__name__}"
        if engine is not None:
            engine.check_columns(columns, source=source)
            columns = [*columns, "tools"]
        if functions is not None:
            functions.check_columns(columns, source=source)


def build_vllm(use_vllm: bool, model: str, settings: RolloutSettings, old_log_probs: str,
               **options: Any) -> VLLMRollouts | None:
    """The colocated vLLM engine of ``use_vllm`` (built at ``setup``), or ``None``.

    Args:
        use_vllm: the option; ``False`` returns ``None`` (``vllm_*`` options other than their defaults warn: unused).
        model: the trained model's name or folder (the engine loads the same).
        settings: the rollout settings (``top_p`` / ``top_k``, ``seed``).
        old_log_probs: ``rollout`` or ``recompute``.
        **options: :class:`~lit_llm.rollouts.vllm_colocate.VLLMSettings` fields (the ``vllm_*`` options without the
            prefix).

    Raises:
        lit_llm.rollouts.RolloutError: an option out of range; ``top_p`` / ``top_k`` without ``old_log_probs:
            recompute`` (:func:`~lit_llm.rollouts.vllm_colocate.check_vllm_sampling`).
        ValueError: vLLM is not installed (names ``make setup-vllm``; checked without importing it).
    """
    vllm_settings = VLLMSettings(**options)
    if not use_vllm:
        changed = [f"vllm_{f.name}" for f in dataclasses.fields(VLLMSettings)
                   if getattr(vllm_settings, f.name) != f.default]
        if changed:
            rank_zero_warn(f"GRPOModule: {', '.join(changed)} set but use_vllm is false: unused (rollouts sample from "
                           f"the trained model). Set --model.init_args.use_vllm true to use them.")
        return None
    check_vllm_sampling(settings, old_log_probs)
    check_vllm_installed("use_vllm")
    return VLLMRollouts(model, vllm_settings, seed=settings.seed)
