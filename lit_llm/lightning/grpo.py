"""GRPO as a LightningModule: wiring of the policy's two versions, the rollout engine and the GRPO objective.

One training batch = the prompts of one optimizer step (:mod:`lit_llm.lightning.grpo_data`). Each step, hop by hop:

1. **Rollouts** (:class:`~lit_llm.lightning.versions.PolicyVersionSwitch`, added by :meth:`GRPOModule.
   configure_callbacks`): at ``on_train_batch_start`` the callback switches the model to generation and the
   :class:`~lit_llm.rollouts.RolloutEngine` samples ``num_generations`` completions per prompt with the **generate
   version** (rollout workers, one per prompt group, served by the threaded batcher; per-row generators seeded from
   ``(rollout_seed, step, rank, prompt, generation)``: bit-reproducible), rewards them and builds the group
   advantages, as one :class:`~lit_llm.rollouts.RolloutBatch` (prompt/completion layout). Asynchronous mode
   (``rollout_mode="async"``): the batch *is* a rollout produced ahead of time from a copy of the weights that the
   callback syncs every ``sync_every`` optimizer steps; a rollout more than ``max_staleness`` steps old is dropped
   (counted, no step).
2. **Loss**: the rollout is cut into micro-batches (:meth:`RolloutBatch.micro_batches`, groups kept together); the
   **log-prob version**'s ``get_dist`` on each gives the masked distribution over its completion tokens (each
   distinct prompt through the backbone once with ``share_prompts``, the chunked LM-head kernel, no ``[B, T, V]``
   logits); its ``log_prob_and_entropy`` feeds :class:`~lit_llm.objectives.GRPOObjective` (old log-probs = the
   generation-time ones, or with ``old_log_probs: recompute`` the log-prob version's no-grad forward before the first
   iteration; the generation-time ones stay as ``rollout_log_probs`` for the mismatch metrics and the correction).
   :class:`~lit_llm.lightning.module.PolicyModule` runs one manual optimizer step over the
   micro-batches with the step count of the objective all-reduced over ranks before any backward pass.
   ``beta > 0`` adds the k3 KL to a frozen reference copy (built only then). ``num_iterations`` (μ) repeats the
   optimizer step μ times on the same rollouts (``global_step`` advances μ per batch).
3. **Metrics** (per training batch, CSV/wandb): ``train/reward`` (+ ``_std``, per function ``train/rewards/<fn>/
   mean|std|timeouts``), ``train/frac_reward_zero_std``, ``train/completions/{mean,min,max}_length``,
   ``train/completions/clipped_ratio`` (truncated fraction), ``train/loss``, ``train/kl`` (with a reference),
   ``train/entropy``, ``train/clip_ratio/{low,high,region}_mean``, ``train/ratio_mean`` (and this rank's
   ``train/ratio_{min,max}``), ``train/staleness``, ``train/dropped_rollouts``, ``time/{generation,rollout_wait,
   training,step}`` (s), ``train/tokens_per_sec`` (prompt + completion tokens of the trained rows / training time),
   ``rollout/tokens_per_sec`` (generated tokens / generation time), ``train/grad_norm``, ``train/lr``; with
   ``use_vllm`` ``time/weight_push`` (s) and ``rollout/weight_pushes``. Sampler/trainer
   mismatch at the first iteration of each batch: ``train/mismatch/kl`` (k3 of generation-time vs trainer log-probs on
   the same ids), this rank's ``train/mismatch/ratio_{min,max}`` (trainer / sampler probability),
   ``train/first_iteration/ratio_{min,max}`` and ``train/first_iteration/clip_ratio`` (the GRPO ratio and its clipped
   fraction: 1 and 0 with ``old_log_probs: recompute``), with a correction ``train/rollout_correction/
   {corrected_fraction,weight_mean}``, with ``recompute`` ``time/recompute`` (s). Every
   ``log_samples_every`` steps a table of sampled completions with their rewards (``rollout_samples.csv`` in the
   log folder, and a wandb table). Under DDP the reward, per-function reward, ``frac_reward_zero_std`` and
   completion metrics cover every rank's completions (one ``all_gather`` per step); times,
   ``rollout/tokens_per_sec`` and the ratio min/max are rank 0's (docs/distributed.md).

Validation = greedy evaluation on the held-out prompts (:class:`~lit_llm.lightning.grpo_eval.GreedyEvaluation`).

**Multi-turn, tool-using episodes** (``environment`` set, issue 16): the engine is an
:class:`~lit_llm.rollouts.EpisodeEngine` (sync and async: the producer builds one over its copy of the weights), a
rollout row is a whole episode (the completion = every id after the first render, ``loss_mask`` = the sampled ids),
the reward ``env_reward_weight * env`` plus the optional ``reward_funcs`` (which also get a ``tools`` column); every
option above applies per episode. Extra per-step metrics (:mod:`lit_llm.lightning.episode_metrics`):
``train/episodes/*`` (turns, tool calls and success rate, truncation by reason, sampled / environment tokens),
``train/reward_by_turns/<k>``, ``time/tools``, ``time/env``, ``time/episode_generation``; the samples table shows
whole episodes (prompt and completion, with the evaluation table's columns); validation runs greedy episodes
(``eval/env_reward``, ``eval/tool_call_rate``, ``eval/turns``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from lit_llm.lightning.environment_option import (
    EnvironmentConfig,
    EnvironmentSpec,
    check_environment_task,
    environment_factory,
    environment_hparam,
    environment_unresolved,
)
from lit_llm.lightning.episode_metrics import EPISODE_EVAL_METRICS
from lit_llm.lightning.grpo_data import ENVIRONMENT_TASKS
from lit_llm.lightning.grpo_eval import GreedyEvaluation
from lit_llm.lightning.grpo_metrics import GRPOStepStats, rollout_metrics, sample_table
from lit_llm.lightning.grpo_options import (
    DEFAULT_REWARDS,
    RewardSpec,
    build_objective,
    build_rewards,
    build_vllm,
    check_old_log_probs,
    check_prompt_columns,
    episode_settings,
    owner_errors,
)
from lit_llm.lightning.module import PolicyModule
from lit_llm.lightning.tables import append_csv, log_table
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.models import DEFAULT_MODEL, DType
from lit_llm.objectives.correction import RolloutCorrection
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rollouts import EpisodeEngine, RolloutBatch, RolloutEngine
from lit_llm.rollouts.engine import mix_seed
from lit_llm.rollouts.settings import DEFAULT_ENV_TIMEOUT, RolloutSettings, check_count

__all__ = ["DEFAULT_REWARDS", "EnvironmentConfig", "GRPOModule", "check_environment_task", "check_old_log_probs",
           "environment_hparam", "environment_unresolved"]

class GRPOModule(GreedyEvaluation, PolicyModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) with TRL's knobs (see module docstring).

    Args:
        model, dtype, attn_implementation, chat_template, chat_template_kwargs, use_peft, lora_r, lora_alpha,
        lora_dropout, lora_target_modules: the model options (see :class:`~lit_llm.lightning.module.PolicyModule` and
            :class:`~lit_llm.models.ModelConfig`): the model (``"smollm2-135m-instruct"``, ``"tiny"`` for tests, a
            local HF folder or a Hub id), its load dtype and attention kernel, the chat template of prompts without
            ``prompt_ids`` (Jinja text, ``.jinja`` path or name), the template variables of every prompt render
            (rollouts and greedy evaluation) and LoRA (``peft``; the ``beta > 0`` reference is then the same model
            with its adapters disabled, and async rollouts sync the adapter weights only).
        reward_funcs: reward functions (TRL signature, :mod:`lit_llm.rewards`): callables or specs, i.e. a
            built-in's name, ``"module:function"`` (importable, or a module in the current directory) or
            ``"path/to/rewards.py:function"`` (:func:`~lit_llm.rewards.resolve_reward`). Each receives the prompts,
            completions, completion ids, ``trainer_state`` (:class:`~lit_llm.rewards.TrainerState`) and the
            dataset's columns; the columns it needs (:func:`~lit_llm.rewards.required_columns`) are checked against
            the data module's prompts at ``setup``, before the first rollout. ``None`` (default): the shaped
            arithmetic rewards (:data:`DEFAULT_REWARDS`) without an ``environment``, none with one (the
            environment's reward alone). With an ``environment`` the list may be empty; a function then scores whole
            episodes (``prompts`` = each episode's prompt messages, ``completions`` = its messages after the prompt)
            and receives, besides the dataset's columns, a ``tools`` column: each episode's tool schemas (added by
            the :class:`~lit_llm.rollouts.EpisodeEngine` unless the dataset has one; what
            :func:`~lit_llm.rewards.tool_call_format_reward` reads), so it must take ``**kwargs`` (TRL's rule).
        reward_weights: one weight per reward function (``None`` = all 1).
        num_generations: completions per prompt ``G`` (>= 2).
        max_new_tokens: generation budget per completion (TRL ``max_completion_length``).
        temperature: sampling temperature (> 0); the log-prob version scores at the same temperature.
        top_p, top_k: optional nucleus / top-k sampling (log-probs stay those of the full tempered distribution).
        loss_type: ``"dapo"`` (``None``, the default: ``"dapo"``, or the ``objective`` class's own; the global
            token count of the step), ``"grpo"``, ``"dr_grpo"``, ``"bnpo"``, ``"cispo"``
            (:mod:`lit_llm.objectives.loss_types`).
        objective: a user's GRPO objective by import path (``"my_loss:MyObjective"``: a module importable or in the
            current directory, or ``"path/to/my_loss.py:MyObjective"``): a subclass of
            :class:`~lit_llm.objectives.GRPOObjective` built with this module's objective knobs
            (:func:`~lit_llm.lightning.grpo_options.build_objective`); ``None``: the built-in ``loss_type``. A
            ``loss_type`` other than the class's own is an error naming both.
        epsilon, epsilon_high: clip range ``[1 - epsilon, 1 + epsilon_high]`` (``None`` = ``epsilon``); with
            ``loss_type="cispo"`` ``epsilon_high`` is the absolute importance-weight cap (TRL recommends 5.0; a
            value <= 1 caps every token's weight and warns).
        beta: k3 KL coefficient to a frozen reference copy of the initial policy (0 = no reference built).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        mask_truncated_completions: exclude completions that hit ``max_new_tokens`` from the loss (DAPO).
        num_iterations: optimizer steps per batch of rollouts (μ; ratios depart from 1 from the second on).
        micro_batch_size: rollout rows per forward/backward pass.
        rollout_mode: ``"sync"`` (on-policy, bit-reproducible) or ``"async"`` (background producer, copy of weights).
        sync_every: async: optimizer steps between weight copies to the producer.
        max_staleness: async: drop rollouts generated more than this many optimizer steps ago.
        rollout_workers: rollout worker threads calling the generate version through the batcher (``None``: one per
            prompt group); unused with ``batching=False`` (one direct call).
        batching: serve the rollout workers through the threaded batcher (default; bit-reproducible: the batcher
            waits for every row of the step and orders them by worker). ``False``: one direct call per rollout.
        rollout_seed: seed of the per-row sampling generators, mixed with the step, rank, prompt and generation
            index (``None``: the global RNG).
        eval_reward_funcs: functions averaged over the greedy completions of the held-out prompts (default:
            ``reward_funcs``), logged as ``eval/<name>``; their columns are checked against the held-out prompts.
        eval_max_new_tokens: greedy budget (default ``max_new_tokens``).
        eval_samples: evaluation completions written to ``eval_samples.csv`` per evaluation.
        log_samples_every: optimizer steps between sampled-completion tables (0 = never).
        num_logged_samples: rows per table.
        optimizer, lr_scheduler, grad_clip, on_nonfinite, gradient_checkpointing, chunk_size, lm_head_matmul_dtype:
            see :class:`~lit_llm.lightning.module.PolicyModule`.
        share_prompts: in training, run each distinct prompt of a micro-batch through the backbone once and its
            completions on top of the shared KV cache (the log-prob version's ``get_dist`` on a
            :class:`~lit_llm.rollouts.RolloutBatch`, :func:`~lit_llm.policy.logprobs.completion_hidden_states`): the
            same log-probs and gradients for about ``P * prompt + N * completion`` instead of
            ``N * (prompt + completion)`` backbone tokens. Turned off under ``gradient_checkpointing`` (which turns
            the cache off).
        advantage_estimator: ``"grpo"`` (default), ``"rloo"`` (leave-one-out baseline) or ``"reinforce_plus_plus"``
            (group baseline + batch normalisation; needs ``scale_rewards`` ``batch`` or ``none``); see
            :func:`~lit_llm.objectives.compute_advantages` for how each combines with ``scale_rewards``.
        importance_sampling_level: ``"token"`` (GRPO) or ``"sequence"`` (GSPO's length-normalised sequence ratio;
            the paper clips it at ``epsilon: 3e-4``, ``epsilon_high: 4e-4``, which are not the defaults).
        entropy_coef: entropy bonus ``- entropy_coef * H_t`` per loss token (0 = none; the entropy is then only logged).
        old_log_probs: the ratio's denominator: ``"rollout"`` (generation-time log-probs; their agreement with the
            teacher-forced ones is the fp32 1e-4 contract) or ``"recompute"`` (the training forward under no-grad
            before the step's first iteration, so the first on-policy ratio is exactly 1 in bf16 too; one extra
            forward per step, ``time/recompute``).
        rollout_correction: ``"none"``, ``"token_truncate"``, ``"token_mask"``, ``"sequence_truncate"`` or
            ``"sequence_mask"``: sampler/trainer importance weights (TIS / MIS, :mod:`lit_llm.objectives.correction`,
            with the mapping to TRL's ``vllm_importance_sampling_*`` and verl's rollout IS); needs ``old_log_probs:
            recompute``. In async mode ``recompute`` without a correction is an error (it would hide staleness).
        rollout_correction_clip_max: the weight cap ``C`` (TRL's ``vllm_importance_sampling_cap``).
        rollout_correction_clip_min: lower bound of the mask modes (``None``: ``1 / C``; 0: none).
        environment: multi-turn, tool-using episodes instead of single completions (issue 16): ``None`` (default,
            single-turn GRPO), a built-in name (``"calculator"``, ``"guess_number"``), an import path
            (``"my_agent:MyEnv"``, a module importable or in the current directory, or ``"path/to/env.py:MyEnv"``)
            or ``{"class_path": ..., "init_args": {...}}`` (:func:`~lit_llm.rollouts.envs.resolve_environment`).
            Rollouts are then the :class:`~lit_llm.rollouts.EpisodeEngine`'s (sync and async): ``num_generations``
            episodes per prompt, each sampled turn's ids kept and each environment reply appended as a suffix
            render, the loss on the sampled ids only (DESIGN.md property 9); ``max_new_tokens`` is the budget of one
            turn; the reward is ``env_reward_weight * env`` plus the ``reward_funcs``. Validation runs greedy
            episodes (``eval/env_reward``, ``eval/tool_call_rate``, ``eval/turns``). The environment's
            ``required_columns`` are checked against the prompts at ``setup``.
        max_turns: model turns per episode at most (default 8); ``max_tool_calling_iterations`` is TRL's name for
            the environment replies at most (``max_turns = iterations + 1``); give one.
        max_episode_tokens: completion ids per episode at most (sampled + environment ids; ``None``: the context
            bounds it). ``dr_grpo``'s constant denominator with an environment, so required by it.
        tool_timeout: seconds per tool call, overriding the environment's own ``tool_timeout`` (its ``init_args``
            or class default; a one-time warning names both values when they differ); ``None`` (recommended): the
            environment's own.
        env_reward_weight: weight of the environment's reward (logged as ``train/rewards/env/mean``) in the total.
        reward_timeout, env_timeout: seconds a reward-function call / an environment's ``reset`` or ``step`` may take
            (``None``: no limit); a slower reward call scores ``None`` (warned, ``train/rewards/<name>/timeouts``), a
            slower ``step`` ends its episode (reason ``env_timeout``), a slower ``reset`` is an error.
        dynamic_sampling: DAPO's dynamic sampling (arXiv:2503.14476, verl's ``filter_groups``; sync rollouts): a
            prompt group whose ``num_generations`` rewards are all equal has advantage 0 and only dilutes the step;
            while fewer than ``data.batch_size`` groups of the step differ, the next prompt batches of the epoch are
            rolled out too (``max_sampling_rounds`` rollouts per step at most), the informative groups are kept
            (then zero-std ones if the rounds run out: the batch keeps its size) and the advantages recomputed over
            the kept rows (:mod:`lit_llm.rollouts.dynamic_sampling`). Logged: ``train/sampling_rounds``,
            ``train/sampling_cap_reached`` (steps left short of informative groups so far, warned about);
            ``train/frac_reward_zero_std`` stays the fraction over every group drawn, ``train/reward`` and the
            reward means are the trained batch's. Costs generation time (each round is a rollout) and uses up the
            epoch's prompts faster.
        max_sampling_rounds: dynamic sampling: rollouts per step at most, the step's own included (>= 1; >= 2 with
            ``dynamic_sampling``, or no extra batch is ever drawn).
        use_vllm: sample rollouts, episodes and greedy evaluations with a vLLM engine colocated in this process
            (``make setup-vllm``; :mod:`lit_llm.rollouts.vllm_colocate`), built at ``setup`` in the trainer's
            precision, the trained weights pushed into it after every optimizer step (LoRA merged); the loss still
            scores with the trained model. One device only; ``top_p`` / ``top_k`` need ``old_log_probs: recompute``.
        vllm_mode, vllm_gpu_memory_utilization, vllm_max_model_length, vllm_tensor_parallel_size,
        vllm_enable_sleep_mode, vllm_enforce_eager, vllm_kv_cache_gib: the engine's options
            (:class:`~lit_llm.rollouts.vllm_colocate.VLLMSettings`; TRL's names, the last two ours).

    Raises:
        ValueError: invalid settings (named in the message), e.g. an episode option without ``environment`` or
            ``dr_grpo`` with an environment but no ``max_episode_tokens``; an environment spec that does not
            resolve (:class:`~lit_llm.rollouts.envs.EnvironmentSpecError`); reward-function errors
            (:class:`lit_llm.rewards.RewardError`): an unknown name (listing the built-ins), a spec that does not
            import, no function without an environment; at ``setup``, a column a reward function or the
            environment needs that the prompts lack, or a built-in environment with another built-in ``data.task``
            (:func:`check_environment_task`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: DType = "float32", attn_implementation: str | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 use_peft: bool = False, lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None, reward_funcs: Sequence[RewardSpec] | None = None,
                 reward_weights: list[float] | None = None, num_generations: int = 8, max_new_tokens: int = 32,
                 temperature: float = 1.0, top_p: float | None = None, top_k: int | None = None,
                 loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo", "cispo"] | None = None,
                 objective: str | None = None, epsilon: float = 0.2,
                 epsilon_high: float | None = None, beta: float = 0.0,
                 scale_rewards: Literal["group", "batch", "none"] = "group",
                 mask_truncated_completions: bool = False, num_iterations: int = 1, micro_batch_size: int = 16,
                 rollout_mode: Literal["sync", "async"] = "sync", sync_every: int = 1, max_staleness: int = 1,
                 rollout_workers: int | None = None, batching: bool = True, rollout_seed: int | None = 0,
                 eval_reward_funcs: Sequence[RewardSpec] | None = None, eval_max_new_tokens: int | None = None,
                 eval_samples: int = 4, log_samples_every: int = 10, num_logged_samples: int = 4,
                 optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, grad_clip: float | None = 1.0,
                 on_nonfinite: Literal["raise", "skip"] = "raise", gradient_checkpointing: bool = False,
                 chunk_size: int = 1024, lm_head_matmul_dtype: Literal["float32", "bfloat16"] = "float32",
                 share_prompts: bool = True,
                 advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo",
                 importance_sampling_level: Literal["token", "sequence"] = "token", entropy_coef: float = 0.0,
                 old_log_probs: Literal["rollout", "recompute"] = "rollout",
                 rollout_correction: RolloutCorrection = "none", rollout_correction_clip_max: float = 2.0,
                 rollout_correction_clip_min: float | None = None,
                 environment: EnvironmentConfig | EnvironmentSpec | None = None,
                 max_turns: int | None = None, max_tool_calling_iterations: int | None = None,
                 max_episode_tokens: int | None = None, tool_timeout: float | None = None,
                 env_reward_weight: float = 1.0, dynamic_sampling: bool = False, max_sampling_rounds: int = 3,
                 reward_timeout: float | None = 60.0, env_timeout: float | None = DEFAULT_ENV_TIMEOUT,
                 use_vllm: bool = False, vllm_mode: Literal["colocate"] = "colocate",
                 vllm_gpu_memory_utilization: float = 0.3, vllm_max_model_length: int | None = None,
                 vllm_tensor_parallel_size: int = 1, vllm_enable_sleep_mode: bool = False,
                 vllm_enforce_eager: bool = True, vllm_kv_cache_gib: float | None = None) -> None:
        super().__init__(**PolicyModule.options_of(locals()))
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.environment, self.env_factory = environment_factory(environment)
        if self.environment is not None:  # checkpoints hold an import path, not a class (resume loads weights_only)
            self.hparams["environment"] = environment_hparam(self.environment)
        with owner_errors("GRPOModule"):
            check_count("num_iterations", num_iterations, 1)
            check_count("micro_batch_size", micro_batch_size, 1)
            self.rollout_settings = RolloutSettings(
                num_generations=num_generations, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                top_k=top_k, scale_rewards=scale_rewards, advantage_estimator=advantage_estimator,
                seed=rollout_seed, chat_template=chat_template, chat_template_kwargs=self.chat_template_kwargs,
                batching=batching, num_workers=rollout_workers, rollout_mode=rollout_mode, sync_every=sync_every,
                max_staleness=max_staleness, dynamic_sampling=dynamic_sampling,
                max_sampling_rounds=max_sampling_rounds)
            self.episode_settings = episode_settings(self.env_factory, env_timeout=env_timeout, max_turns=max_turns,
                max_tool_calling_iterations=max_tool_calling_iterations, max_episode_tokens=max_episode_tokens,
                tool_timeout=tool_timeout, env_reward_weight=env_reward_weight)
            check_old_log_probs(old_log_probs, rollout_correction, rollout_mode)
            self.vllm = build_vllm(
                use_vllm, model, self.rollout_settings, old_log_probs, mode=vllm_mode,
                gpu_memory_utilization=vllm_gpu_memory_utilization, max_model_length=vllm_max_model_length,
                tensor_parallel_size=vllm_tensor_parallel_size, enable_sleep_mode=vllm_enable_sleep_mode,
                enforce_eager=vllm_enforce_eager, kv_cache_gib=vllm_kv_cache_gib)
            self.objective = build_objective(
                objective, loss_type=loss_type, with_environment=self.env_factory is not None, epsilon=epsilon,
                epsilon_high=epsilon_high, beta=beta, mask_truncated_completions=mask_truncated_completions,
                max_completion_length=max_new_tokens if self.env_factory is None else max_episode_tokens,
                importance_sampling_level=importance_sampling_level, entropy_coef=entropy_coef,
                rollout_correction=rollout_correction, rollout_correction_clip_max=rollout_correction_clip_max,
                rollout_correction_clip_min=rollout_correction_clip_min)
        # reward-function errors name the spec and the entry themselves (no owner prefix, as the CLI shows them)
        self.rewards, self.eval_rewards = build_rewards(reward_funcs, reward_weights, eval_reward_funcs, reward_timeout,
                                                        with_environment=self.env_factory is not None)
        if micro_batch_size % num_generations:
            rank_zero_warn(f"GRPOModule: micro_batch_size={micro_batch_size} is not a multiple of num_generations="
                           f"{num_generations}: some prompt groups straddle two micro-batches and their prompt runs "
                           f"through the backbone twice (same numbers, more compute).")
        self.num_generations, self.max_new_tokens, self.temperature = num_generations, max_new_tokens, temperature
        self.loss_type, self.beta, self.old_log_probs = self.objective.loss_type, beta, old_log_probs
        self.num_iterations, self.micro_batch_size = num_iterations, micro_batch_size
        self.share_prompts = share_prompts and not gradient_checkpointing
        self.log_samples_every, self.num_logged_samples = log_samples_every, num_logged_samples
        self.eval_samples, self.eval_max_new_tokens = eval_samples, eval_max_new_tokens or max_new_tokens
        self.register_buffer("dropped_rollouts", torch.zeros((), dtype=torch.long))
        eval_names = [*(EPISODE_EVAL_METRICS if self.env_factory is not None else ()),
                      *([] if self.eval_rewards is None else self.eval_rewards.names)]
        self.eval_metrics = torch.nn.ModuleDict({n: MeanMetric(nan_strategy="ignore") for n in eval_names})
        self._eval_engines: dict[int, EpisodeEngine] = {}
        self._eval_rows: list[list[Any]] = []
        self.stats = GRPOStepStats()
        self.versions = self.build_versions()

    def build_versions(self) -> PolicyVersionSwitch:
        """The :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` over the trained model: the generate version
        (sampling settings from :attr:`rollout_settings`), the rollout engine (an
        :class:`~lit_llm.rollouts.EpisodeEngine` with an environment) taking the settings whole, and, with ``beta >
        0``, the frozen reference (:meth:`reference_model`). The callback is a plain attribute (not an
        ``nn.Module``): checkpoints hold the weights once; the reference is neither trained, checkpointed nor
        exported."""
        settings = self.rollout_settings
        policy = TransformersWrapper(self.model, tokenizer=self.tokenizer, input_mode="tokens",
                                     generate_kwargs=settings.generate_kwargs(), chunk_size=self.chunk_size,
                                     matmul_dtype=self.head_matmul_dtype)
        if self.episode_settings is None:
            engine: RolloutEngine = RolloutEngine(policy, tokenizer=self.tokenizer, reward_fn=self.rewards,
                                                  settings=settings)
        else:
            engine = EpisodeEngine(policy, tokenizer=self.tokenizer, reward_fn=self.rewards, settings=settings,
                                   episode=self.episode_settings)
        return PolicyVersionSwitch(policy, engine=engine, log_prob_kwargs={"share_prompts": self.share_prompts},
                                   reference_model=self.reference_model() if self.beta > 0 else None, vllm=self.vllm)

    @property
    def engine(self) -> RolloutEngine:
        """The synchronous rollout engine (over the generate version of the trained weights)."""
        return self.versions.engine

    @property
    def async_rollouts(self) -> Any:
        """The asynchronous producer (``None`` in synchronous mode or before fit)."""
        return self.versions.async_rollouts

    def setup(self, stage: str) -> None:
        """Under DDP, ranks > 0 reseed the global RNG from ``(initial seed, rank)`` (used with ``rollout_seed:
        null``; ``seed_everything`` gives every rank the same one); the engine mixes the rank into its per-row seeds
        (set by the callback). Weights are unaffected: DDP broadcasts rank 0's at wrap time. Then the reward functions'
        columns are checked against the data module's prompts (:meth:`check_reward_columns`). A built-in
        ``environment`` with another built-in ``task`` is an error (:func:`check_environment_task`); a data module whose
        ``task`` is an environment's (``calculator``, ``guess_number``) without an ``environment`` warns (its prompts
        are then single completions). The environment's class must implement ``step`` (a ToolEnv ``score``),
        checked here since a run whose turns never end may never step it.

        Raises:
            ValueError: a built-in environment with another built-in task (names both options and the fix).
            lit_llm.rollouts.RolloutError: an environment class that does not implement ``step`` (or, a ToolEnv,
                ``score``): :meth:`~lit_llm.rollouts.EpisodeEngine.check_environment`.
        """
        if self.trainer.world_size > 1 and self.global_rank > 0:
            torch.manual_seed(mix_seed(torch.initial_seed(), 0, self.global_rank))
        datamodule = getattr(self.trainer, "datamodule", None)
        task = getattr(datamodule, "task", None)
        check_environment_task(self.env_factory, task)
        if self.env_factory is not None:  # before any rollout: a tiny model's turns may never step it
            self.engine.check_environment()
        if self.env_factory is None and task in ENVIRONMENT_TASKS:
            rank_zero_warn(f"GRPOModule: data.task={task!r} holds the prompts of the {task!r} environment, but "
                           f"model.environment is not set: they are trained as single completions. Set "
                           f"--model.init_args.environment {task} for episodes.")
        self.check_reward_columns(datamodule, stage)

    def check_reward_columns(self, datamodule: Any, stage: str) -> None:
        """:func:`~lit_llm.lightning.grpo_options.check_prompt_columns` of this module's reward functions and
        environment (before the first rollout)."""
        check_prompt_columns(datamodule, stage, rewards=self.rewards, eval_rewards=self.eval_rewards,
                             engine=self.engine if self.env_factory is not None else None)

    # ------------------------------------------------------------------------------------------------- rollouts
    def wrap_train_loader(self, loader: Any) -> Any:
        """Called by :class:`~lit_llm.lightning.grpo_data.GRPODataModule`: the prompt loader itself (sync), or the
        callback's asynchronous producer over it and a copy of the weights (async)."""
        trainer = self._trainer
        return self.versions.wrap_train_loader(loader, version=self.global_step,
                                               distributed=trainer is not None and trainer.world_size > 1)

    def micro_batches(self, rollout: RolloutBatch) -> list[RolloutBatch]:
        """``rollout`` cut into micro-batches of ``micro_batch_size`` rows (groups together, longest first, see
        :meth:`RolloutBatch.micro_batches`), on the module's device."""
        return [mb.to(self.device) for mb in rollout.micro_batches(self.micro_batch_size)]

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """The callback's rollout of this batch, then ``num_iterations`` optimizer steps on it."""
        t_start = time.perf_counter()
        rollout, staleness, wait_time = self.versions.take_rollout(batch, self.global_step)
        if rollout is None:  # stale (async): dropped on every rank together
            self.dropped_rollouts += 1
            self.log("train/dropped_rollouts", self.dropped_rollouts.float(), on_step=True, batch_size=1)
            return None
        # released only when the rollout itself grew the process (multi-turn episodes): what it freed, not the last
        # loss's free blocks that this loss reuses (release_host_memory)
        self.release_host_memory(site="rollout")
        mbs = self.micro_batches(rollout)
        self.stats.reset(len(mbs))
        t_train = time.perf_counter()
        if self.old_log_probs == "recompute":
            mbs = [mb.with_old_log_probs(self.recompute_old_log_probs(mb)) for mb in mbs]
        self.stats.recompute_time = time.perf_counter() - t_train
        loss = None
        for iteration in range(self.num_iterations):
            self.stats.iteration = iteration
            loss = super().training_step({"micro_batches": mbs}, batch_idx)
        train_time = time.perf_counter() - t_train
        # the step: getting the rollout (the callback's sync generation + rewards, or the async wait) + training
        self._log_rollout(rollout, staleness, wait_time, train_time, wait_time + time.perf_counter() - t_start)
        return loss

    # --------------------------------------------------------------------------------------------------- loss
    def micro_batch_ids(self, mb: RolloutBatch) -> list[str]:
        """``"<sample id>#<row>"`` of each row (named when a loss is not finite)."""
        return [f"{s}#{i}" for i, s in enumerate(mb.sample_id)]

    def micro_batch_real_tokens(self, mb: RolloutBatch) -> Tensor:
        """Prompt + completion tokens of the micro-batch's rows (as if each row ran on its own)."""
        return (mb.prompt_lengths + mb.completion_lengths).sum().float()

    def step_denominator(self, micro_batches: list[RolloutBatch]) -> Tensor:
        """This rank's share of the objective's step count (:meth:`GRPOObjective.local_count`)."""
        return sum(self.objective.local_count(mb.loss_mask, mb.truncated, mb.old_log_probs, mb.rollout_log_probs)
                   for mb in micro_batches)

    @torch.no_grad()
    def recompute_old_log_probs(self, mb: RolloutBatch) -> Tensor:
        """``[N, Lc]`` float32 log-probs of ``mb``'s completions from the training forward under no-grad: the
        log-prob version's ``get_dist`` in the same mode, precision context and kernel as :meth:`micro_batch_loss`,
        so that the first on-policy iteration's ratio is exactly 1 (``old_log_probs: recompute``)."""
        return self.versions.log_prob_version.get_dist(mb.policy_inputs()).log_prob(mb.completion_ids)

    def micro_batch_loss(self, mb: RolloutBatch, normalizer: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The objective on the log-prob version's masked distribution of ``mb``'s completions."""
        inputs = mb.policy_inputs()
        dist = self.versions.log_prob_version.get_dist(inputs)
        log_probs, entropy = dist.log_prob_and_entropy(mb.completion_ids)
        if self.objective.entropy_coef == 0:
            entropy = entropy.detach()  # logged only
        ref = None
        if self.versions.reference_version is not None:
            with torch.no_grad():
                ref = self.versions.reference_version.get_dist(inputs).log_prob(mb.completion_ids)
        loss, m = self.objective(log_probs, mb.old_log_probs, mb.advantage, mb.loss_mask, step_count=normalizer,
                                 num_micro_batches=self.stats.num_micro_batches, world_size=self.world_size,
                                 ref_log_probs=ref, entropy=entropy, truncated=mb.truncated,
                                 rollout_log_probs=mb.rollout_log_probs)
        return loss, self.stats.add(m, self.micro_batch_real_tokens(mb))

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        """Collect one optimizer step's sums (logged once per batch by :meth:`_log_rollout`)."""
        keys = sorted(totals)
        vals = torch.stack([totals[k].float().reshape(()) for k in keys])
        summed = dict(zip(keys, self._all_sum(vals).unbind()))
        self.trained_tokens += summed["num_real_tokens"].double()
        summed["grad_norm"] = grad_norm.detach().float()
        summed["lr"] = torch.tensor(float(opt.param_groups[0]["lr"]))
        self.stats.end_step(summed)

    def _log_rollout(self, rollout: RolloutBatch, staleness: int, wait_time: float, train_time: float,
                     step_time: float) -> None:
        """Log the batch's metrics (:mod:`lit_llm.lightning.grpo_metrics`) and, every ``log_samples_every`` steps,
        the table of sampled completions (``rollout_samples.csv``, wandb)."""
        log = rollout_metrics(self, rollout, staleness=staleness, wait_time=wait_time, train_time=train_time,
                              step_time=step_time)
        log.update(self.stats.metrics(train_time, self.trained_tokens, self.old_log_probs == "recompute"))
        log.update(self.versions.engine_metrics())
        self.log_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in log.items()}, on_step=True,
                      on_epoch=False, batch_size=1)
        self.log("reward", torch.as_tensor(log["train/reward"]), prog_bar=True, on_step=True, batch_size=1,
                 logger=False)
        every, k = self.log_samples_every, min(self.num_logged_samples, rollout.num_rows)
        if every and k and self.trainer.is_global_zero and (self.global_step - self.num_iterations) % every == 0:
            columns, rows = sample_table(rollout, self.global_step, k)
            append_csv(self.trainer, "rollout_samples.csv", columns, rows)
            log_table(self.trainer, "train/samples", columns, rows)
