"""GRPO as a LightningModule: rollouts from the generate version, the clipped surrogate on the log-prob version.

One training batch = the prompts of one optimizer step (:mod:`lit_llm.lightning.grpo_data`). :meth:`GRPOModule.
training_step`:

1. **Rollouts.** Synchronous mode (default): the :class:`~lit_llm.policy.rollout.RolloutEngine` expands every prompt
   to ``num_generations`` completions with the generate version of the *trained* model (a ``TransformersWrapper``
   over the same weights), rewards them and builds the group advantages; sampling is seeded from
   ``(rollout_seed, global_step)``, so runs (and resumed runs) are bit-reproducible. Asynchronous mode
   (``rollout_mode="async"``): the batch *is* a rollout produced ahead of time on a background thread from a copy
   of the weights (:class:`~lit_llm.policy.rollout.AsyncRollouts`, wired in by the datamodule through
   :meth:`GRPOModule.wrap_train_loader`), refreshed every ``sync_every`` optimizer steps by
   :class:`RolloutWeightSync`; a rollout more than ``max_staleness`` steps old is dropped (counted, no step).
2. **Loss.** The rollouts are cut into micro-batches of ``micro_batch_size`` rows, groups kept together (longest
   group first), in the prompt/completion layout of :func:`~lit_llm.policy.logprobs.completion_log_probs`: with
   ``share_prompts`` (default) each distinct prompt runs through the backbone once per micro-batch and its
   completions on top of its KV cache. :class:`~lit_llm.lightning.module.PolicyModule` runs one manual optimizer
   step over
   them: the denominator of the step (``dapo``: completion tokens after truncation masking; ``grpo``/``dr_grpo``:
   sequences) is counted over every micro-batch and all-reduced over ranks before any backward pass; each
   micro-batch's new log-probs come from the chunked kernel at the sampling temperature (no ``[B, T, V]`` logits) and
   :func:`lit_llm.objectives.grpo_loss` (old log-probs = the generation-time ones) gives its share of the loss.
   ``bnpo`` keeps its local micro-batch mean (averaged over micro-batches and ranks). ``beta > 0`` adds the k3 KL to
   a frozen reference copy (built only then). ``num_iterations`` (μ) repeats the optimizer step μ times on the same
   rollouts (``global_step`` advances μ per batch; ``trainer.max_steps`` counts optimizer steps).
3. **Metrics** (per training batch, CSV/wandb): ``train/reward`` (+ ``_std``, per function
   ``train/rewards/<fn>/mean|std``), ``train/frac_reward_zero_std``, ``train/completions/{mean,min,max}_length``,
   ``train/completions/clipped_ratio`` (truncated fraction), ``train/loss``, ``train/kl`` (with a reference),
   ``train/entropy``, ``train/clip_ratio/{low,high,region}_mean``, ``train/ratio_mean`` (and this rank's
   ``train/ratio_{min,max}``), ``train/staleness``, ``train/dropped_rollouts``, ``time/{generation,training,step}`` (s),
   ``train/tokens_per_sec`` (prompt + completion tokens of the trained rows / training time),
   ``rollout/tokens_per_sec`` (generated tokens / generation time), ``train/grad_norm``, ``train/lr``. Every
   ``log_samples_every`` steps a table of sampled completions with their rewards (``rollout_samples.csv`` in the
   log folder, and a wandb table). Under DDP the reward, per-function reward, ``frac_reward_zero_std`` and
   completion metrics cover every rank's completions (one ``all_gather`` per step); times,
   ``rollout/tokens_per_sec`` and the ratio min/max are rank 0's (docs/distributed.md).

Validation = greedy evaluation on the held-out prompts (``trainer.val_check_interval`` = every N steps): each
``eval_reward_funcs`` function's mean is logged as ``eval/<fn>`` (torchmetrics, synced over ranks); with
``trainer.num_sanity_val_steps: -1`` the full evaluation also runs before training and is logged at step 0
(the "before" number). The first completions go to ``eval_samples.csv``.
"""

from __future__ import annotations

import copy
import csv
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from tensordict import TensorDictBase
from torch import Tensor
from torchmetrics import MeanMetric

from lit_llm.lightning.module import PolicyModule
from lit_llm.models import DEFAULT_MODEL
from lit_llm.objectives.grpo import effective_completion_mask, grpo_loss
from lit_llm.policy.generation import pad_rows, unique_rows
from lit_llm.policy.logprobs import completion_log_probs
from lit_llm.policy.rollout import AsyncRollouts, RolloutEngine, _mix_seed, policy_responses, tokenize_prompts
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardFunctions

__all__ = ["DEFAULT_REWARDS", "GRPOModule", "RolloutWeightSync", "append_csv"]

#: Shaped arithmetic reward (the base model rarely answers with just the number: format + answer).
DEFAULT_REWARDS = ("lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward",
                   "lit_llm.rewards:strict_number_format_reward")

RewardSpec = str | Callable[..., Any]


def append_csv(trainer: Trainer, name: str, columns: list[str], rows: list[list[Any]]) -> Path:
    """Append ``rows`` to ``<first logger's log_dir>/<name>`` (header written once); returns the path."""
    log_dir = trainer.loggers[0].log_dir if trainer.loggers and trainer.loggers[0].log_dir else \
        trainer.default_root_dir
    path = Path(log_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if new:
            w.writerow(columns)
        w.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    return path


def _log_table(trainer: Trainer, key: str, columns: list[str], rows: list[list[Any]]) -> None:
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.log_text(key=key, columns=columns, data=rows, step=trainer.global_step)


class RolloutWeightSync(Callback):
    """Asynchronous rollouts: after every optimizer step, report the trained version to the rollout producer and,
    every ``sync_every`` steps, stage a copy of the trained weights for it (:meth:`AsyncRollouts.sync_weights`).

    Added by :meth:`GRPOModule.configure_callbacks` when ``rollout_mode="async"``.

    Args:
        sync_every: optimizer steps between weight copies (>= 1).
    """

    def __init__(self, sync_every: int = 1) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}.")
        self.sync_every = sync_every
        self.num_syncs = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        producer = getattr(pl_module, "async_rollouts", None)
        if producer is None:
            return
        step = trainer.global_step
        if step % self.sync_every == 0:
            producer.sync_weights(pl_module.model, step)
            self.num_syncs += 1
        else:
            producer.set_trainer_version(step)


class GRPOModule(PolicyModule):
    """Group Relative Policy Optimization (DeepSeekMath, arXiv:2402.03300) with TRL's knobs (see module docstring).

    Args:
        model: ``"smollm2-135m-instruct"`` (embedded default), ``"tiny"`` (tests) or a local HF folder.
        reward_funcs: reward functions (TRL signature), callables or import paths ``"package.module:function"``.
        reward_weights: one weight per reward function (``None`` = all 1).
        num_generations: completions per prompt ``G`` (>= 2).
        max_new_tokens: generation budget per completion (TRL ``max_completion_length``).
        temperature: sampling temperature (> 0); the log-prob version scores at the same temperature.
        top_p, top_k: optional nucleus / top-k sampling (log-probs stay those of the full tempered distribution).
        loss_type: ``"dapo"`` (default, global token count of the step), ``"grpo"``, ``"dr_grpo"``, ``"bnpo"``.
        epsilon, epsilon_high: clip range ``[1 - epsilon, 1 + epsilon_high]`` (``None`` = ``epsilon``).
        beta: k3 KL coefficient to a frozen reference copy of the initial policy (0 = no reference built).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.
        mask_truncated_completions: exclude completions that hit ``max_new_tokens`` from the loss (DAPO).
        num_iterations: optimizer steps per batch of rollouts (μ; ratios depart from 1 from the second on).
        micro_batch_size: rollout rows per forward/backward pass.
        rollout_mode: ``"sync"`` (on-policy, bit-reproducible) or ``"async"`` (background producer, copy of weights).
        sync_every: async: optimizer steps between weight copies to the producer.
        max_staleness: async: drop rollouts generated more than this many optimizer steps ago.
        rollout_workers: threads calling the generate version concurrently per rollout (use with ``batching``).
        batching: serve the generate version through the threaded batcher (issue 4).
        rollout_seed: seed of the synchronous sampling stream (``None``: the global RNG).
        eval_reward_funcs: functions averaged over the greedy completions of the held-out prompts (default:
            ``reward_funcs``), logged as ``eval/<name>``.
        eval_max_new_tokens: greedy budget (default ``max_new_tokens``).
        eval_samples: evaluation completions written to ``eval_samples.csv`` per evaluation.
        log_samples_every: optimizer steps between sampled-completion tables (0 = never).
        num_logged_samples: rows per table.
        chat_template: Jinja string or ``.jinja`` path for prompts without ``prompt_ids``.
        optimizer, lr_scheduler, grad_clip, on_nonfinite, gradient_checkpointing, chunk_size: see
            :class:`~lit_llm.lightning.module.PolicyModule`.
        share_prompts: in training, run each distinct prompt of a micro-batch through the backbone once and its
            completions on top of the shared KV cache (:func:`~lit_llm.policy.logprobs.completion_log_probs`): the
            same log-probs and gradients for about ``P * prompt + N * completion`` instead of
            ``N * (prompt + completion)`` backbone tokens. Turned off under ``gradient_checkpointing`` (which turns
            the cache off).

    Raises:
        ValueError: invalid settings (named in the message); reward-function import errors
            (:class:`lit_llm.rewards.RewardError`).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, reward_funcs: Sequence[RewardSpec] = DEFAULT_REWARDS,
                 reward_weights: list[float] | None = None, num_generations: int = 8, max_new_tokens: int = 32,
                 temperature: float = 1.0, top_p: float | None = None, top_k: int | None = None,
                 loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo", epsilon: float = 0.2,
                 epsilon_high: float | None = None, beta: float = 0.0,
                 scale_rewards: Literal["group", "batch", "none"] = "group",
                 mask_truncated_completions: bool = False, num_iterations: int = 1, micro_batch_size: int = 16,
                 rollout_mode: Literal["sync", "async"] = "sync", sync_every: int = 1, max_staleness: int = 1,
                 rollout_workers: int = 1, batching: bool = False, rollout_seed: int | None = 0,
                 eval_reward_funcs: Sequence[RewardSpec] | None = None, eval_max_new_tokens: int | None = None,
                 eval_samples: int = 4, log_samples_every: int = 10, num_logged_samples: int = 4,
                 chat_template: str | None = None, optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, grad_clip: float | None = 1.0,
                 on_nonfinite: Literal["raise", "skip"] = "raise", gradient_checkpointing: bool = False,
                 chunk_size: int = 1024, share_prompts: bool = True) -> None:
        super().__init__(model, optimizer=optimizer, lr_scheduler=lr_scheduler, grad_clip=grad_clip,
                         on_nonfinite=on_nonfinite, gradient_checkpointing=gradient_checkpointing,
                         chunk_size=chunk_size)
        checks = {"num_generations": (num_generations, 2), "max_new_tokens": (max_new_tokens, 1),
                  "num_iterations": (num_iterations, 1), "micro_batch_size": (micro_batch_size, 1),
                  "sync_every": (sync_every, 1), "max_staleness": (max_staleness, 0),
                  "rollout_workers": (rollout_workers, 1)}
        for name, (value, low) in checks.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"GRPOModule: {name} must be an integer >= {low}, got {value!r}.")
        if not temperature > 0:
            raise ValueError(f"GRPOModule: temperature must be > 0 (GRPO samples), got {temperature}.")
        if loss_type not in ("dapo", "grpo", "dr_grpo", "bnpo"):
            raise ValueError(f"GRPOModule: unknown loss_type {loss_type!r}; choose dapo, grpo, dr_grpo or bnpo.")
        if rollout_mode not in ("sync", "async"):
            raise ValueError(f"GRPOModule: rollout_mode must be 'sync' or 'async', got {rollout_mode!r}.")
        if beta < 0:
            raise ValueError(f"GRPOModule: beta must be >= 0, got {beta}.")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.num_generations, self.max_new_tokens, self.temperature = num_generations, max_new_tokens, temperature
        self.loss_type, self.epsilon, self.epsilon_high, self.beta = loss_type, epsilon, epsilon_high, beta
        self.scale_rewards, self.mask_truncated_completions = scale_rewards, mask_truncated_completions
        self.num_iterations, self.micro_batch_size = num_iterations, micro_batch_size
        self.share_prompts = share_prompts and not gradient_checkpointing
        self.rollout_mode, self.sync_every, self.max_staleness = rollout_mode, sync_every, max_staleness
        self.log_samples_every, self.num_logged_samples, self.eval_samples = (log_samples_every, num_logged_samples,
                                                                              eval_samples)
        self.chat_template = chat_template
        self.rewards = RewardFunctions(list(reward_funcs), reward_weights)
        self.eval_rewards = RewardFunctions(list(eval_reward_funcs or reward_funcs))
        gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": True,
                                      "temperature": temperature}
        if top_p is not None:
            gen_kwargs["top_p"] = top_p
        if top_k is not None:
            gen_kwargs["top_k"] = top_k
        # Plain attributes (RolloutEngine is not an nn.Module): the wrappers share self.model, never duplicated in
        # the state dict.
        policy = TransformersWrapper(self.model, tokenizer=self.tokenizer, input_mode="tokens",
                                     generate_kwargs=gen_kwargs, batching=batching, chunk_size=chunk_size)
        self._engine_kwargs = dict(tokenizer=self.tokenizer, reward_fn=self.rewards, num_generations=num_generations,
                                   scale_rewards=scale_rewards, chat_template=chat_template,
                                   num_workers=rollout_workers)
        self.engine = RolloutEngine(policy, seed=rollout_seed, **self._engine_kwargs)
        self._greedy = (policy.get_new_version(  # a tuple: the wrapper shares self.model, keep it out of state_dict
            generate_kwargs={"max_new_tokens": eval_max_new_tokens or max_new_tokens, "do_sample": False},
            batching=False),)
        self.async_rollouts: AsyncRollouts | None = None
        self._reference: tuple[Any, ...] = ()
        if beta > 0:  # a tuple: not a submodule, so not trained, checkpointed or exported
            self._reference = (copy.deepcopy(self.model).eval().requires_grad_(False),)
        self.register_buffer("dropped_rollouts", torch.zeros((), dtype=torch.long))
        self.eval_metrics = torch.nn.ModuleDict({n: MeanMetric(nan_strategy="ignore") for n in self.eval_rewards.names})
        self._eval_rows: list[list[Any]] = []
        self._num_mbs = 1
        self._iter_stats: list[dict[str, Tensor]] = []
        self._ratio_range = (float("inf"), float("-inf"))  # this rank's ratio min / max over the batch's steps

    def setup(self, stage: str) -> None:
        """Under DDP, every rank samples from its own stream: the synchronous engine mixes the rank into its seed,
        and ranks > 0 reseed the global RNG from ``(initial seed, rank)`` (used by the asynchronous producer and by
        ``rollout_seed: null``; ``seed_everything`` gives every rank the same one). Weights are unaffected: DDP
        broadcasts rank 0's at wrap time."""
        self.engine.rank = self.global_rank
        if self.trainer.world_size > 1 and self.global_rank > 0:
            torch.manual_seed(_mix_seed(torch.initial_seed(), 0, self.global_rank))

    # ------------------------------------------------------------------------------------------------- rollouts
    def wrap_train_loader(self, loader: Any) -> Any:
        """Called by :class:`~lit_llm.lightning.grpo_data.GRPODataModule`: the prompt loader itself (sync), or an
        :class:`AsyncRollouts` producer over it and a copy of the weights (async)."""
        if self.rollout_mode == "sync":
            return loader
        if self.async_rollouts is not None:
            self.async_rollouts.close()
        # Under DDP the producer drops nothing itself (each rank's thread timing differs, so ranks would drop
        # different batches and fall out of step); training_step drops stale batches on all ranks together.
        trainer = self._trainer
        distributed = trainer is not None and trainer.world_size > 1
        self.async_rollouts = _StatefulAsyncRollouts.from_policy(
            self.engine.policy, loader, max_staleness=2**62 if distributed else self.max_staleness,
            version=self.global_step, **self._engine_kwargs)
        return self.async_rollouts

    def configure_callbacks(self) -> list[Callback]:
        """:class:`RolloutWeightSync` in asynchronous mode."""
        return [RolloutWeightSync(self.sync_every)] if self.rollout_mode == "async" else []

    def on_train_end(self) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def micro_batches(self, rollout: TensorDictBase) -> list[dict[str, Any]]:
        """Cut a rollout batch into micro-batches of ``micro_batch_size`` rows in the prompt/completion layout of
        :func:`~lit_llm.policy.logprobs.completion_log_probs`, on the module's device.

        Rows of one group (the rollout's ``group`` ids) stay together: groups ordered by their longest row, longest
        first, rows within a group by completion length. A micro-batch thus holds few distinct prompts and, with
        ``share_prompts``, each one goes through the backbone once. Within a micro-batch prompts are deduplicated by
        content (equal ids and length), so group ids only decide the order; a rollout without ``group`` is ordered
        row by row (correct, but prompts shared less).

        Returns:
            Dicts with ``prompt_ids`` / ``prompt_mask`` ``[P, Lp]`` (left-padded, ``P`` distinct prompts),
            ``completion_ids`` / ``completion_mask`` ``[b, Lc]`` (right-padded), ``prompt_index`` ``[b]`` long,
            ``old_log_probs`` ``[b, Lc]`` float32 (generation-time, 0.0 at padding), ``advantages`` ``[b]``,
            ``truncated`` ``[b]`` bool, ``num_real_tokens`` (prompt + completion tokens of the ``b`` rows, a 0-dim
            tensor) and ``sample_ids``.
        """
        full, old = rollout["tokens", "full"].cpu(), rollout["log_probs", "full"].cpu()
        width = full.shape[1]
        p_len, c_len = rollout["prompt_length"].cpu(), rollout["completion_length"].cpu()
        group = rollout["group"].cpu() if "group" in rollout.keys() else torch.arange(full.shape[0])
        group_len = torch.zeros(int(group.max()) + 1, dtype=torch.long).scatter_reduce(0, group, p_len + c_len, "amax")
        # sort key: longest group first, then group id, then longest completion first (stable)
        key = (-group_len[group] * (group.max() + 1) + group) * (width + 1) - c_len
        order = torch.argsort(key, stable=True)
        sample_ids = list(rollout["sample_id"]) if "sample_id" in rollout.keys() else [""] * len(order)
        out = []
        for s in range(0, len(order), self.micro_batch_size):
            idx = order[s:s + self.micro_batch_size].tolist()
            prompts = [full[i, width - int(c_len[i]) - int(p_len[i]):width - int(c_len[i])] for i in idx]
            comps = [full[i, width - int(c_len[i]):] for i in idx]
            p_ids = pad_rows(prompts, self.engine.pad_token_id)
            p_lens = torch.tensor([p.numel() for p in prompts])
            p_mask = torch.arange(p_ids.shape[1])[None] >= p_ids.shape[1] - p_lens[:, None]  # left padding
            unique, inverse = unique_rows(p_ids, p_lens.tolist())
            index = torch.arange(len(idx)) if inverse is None else inverse
            p_ids, p_mask = p_ids[unique], p_mask[unique]
            dev = self.device
            out.append({
                "prompt_ids": p_ids.to(dev), "prompt_mask": p_mask.to(dev),
                "completion_ids": pad_rows(comps, self.engine.pad_token_id, side="right").to(dev),
                "completion_mask": pad_rows([torch.ones(c.numel(), dtype=torch.bool) for c in comps], False,
                                            side="right").to(dev),
                "prompt_index": index.to(dev),
                "old_log_probs": pad_rows([old[i, width - int(c_len[i]):] for i in idx], 0.0, side="right").to(dev),
                "advantages": rollout["advantage"][idx].to(dev),
                "truncated": rollout["truncated"][idx].to(dev),
                "num_real_tokens": (p_len[idx] + c_len[idx]).sum().float().to(dev),
                "sample_ids": [f"{sample_ids[i]}#{i}" for i in idx],
            })
        return out

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """Rollouts (or the async producer's batch), then ``num_iterations`` optimizer steps on them."""
        t_start = time.perf_counter()
        if isinstance(batch, TensorDictBase):
            rollout = batch
            staleness = self.global_step - int(rollout["policy_version"].max())
            stale = staleness > self.max_staleness
            if self.trainer.world_size > 1:  # one decision for all ranks: a lone skip would leave the others waiting
                stale = bool(self._all_sum(torch.tensor(float(stale), device=self.device)) > 0)
            if stale:
                self.dropped_rollouts += 1
                self.log("train/dropped_rollouts", self.dropped_rollouts.float(), on_step=True, batch_size=1)
                return None
        else:
            rollout = self.engine.rollout(batch, step=self.global_step, version=self.global_step)
            staleness = 0
        wait_time = time.perf_counter() - t_start
        mbs = self.micro_batches(rollout)
        self._num_mbs = len(mbs)
        self._iter_stats = []
        self._ratio_range = (float("inf"), float("-inf"))
        t_train = time.perf_counter()
        loss = None
        for _ in range(self.num_iterations):
            loss = super().training_step({"micro_batches": mbs}, batch_idx)
        train_time = time.perf_counter() - t_train
        self._log_rollout(rollout, staleness, wait_time, train_time, time.perf_counter() - t_start, mbs)
        return loss

    # --------------------------------------------------------------------------------------------------- loss
    def _mask(self, mb: dict[str, Any]) -> Tensor:
        return effective_completion_mask(mb["completion_mask"], mb["truncated"], self.mask_truncated_completions)

    def step_denominator(self, micro_batches: list[dict[str, Any]]) -> Tensor:
        """Completion tokens after truncation masking (``dapo``/``bnpo``) or sequences (``grpo``/``dr_grpo``) of this
        rank's micro-batches."""
        if self.loss_type in ("grpo", "dr_grpo"):
            return torch.tensor(sum(mb["completion_ids"].shape[0] for mb in micro_batches), device=self.device)
        return sum(self._mask(mb).sum() for mb in micro_batches)

    def micro_batch_loss(self, mb: dict[str, Any], normalizer: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """:func:`~lit_llm.objectives.grpo_loss` of one micro-batch with the step-level ``normalizer``."""
        args = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"], mb["prompt_index"])
        kwargs = dict(share_prompts=self.share_prompts, temperature=self.temperature, chunk_size=self.chunk_size)
        log_probs, entropy = completion_log_probs(self.model, *args, return_entropy=True, **kwargs)
        ref = None
        if self._reference:
            reference = self._reference[0].to(self.device)
            with torch.no_grad():
                ref = completion_log_probs(reference, *args, **kwargs)
        step_count = {"num_items_in_batch": normalizer} if self.loss_type == "dapo" else \
            {"num_sequences_in_batch": normalizer} if self.loss_type in ("grpo", "dr_grpo") else {}
        loss, m = grpo_loss(
            log_probs, mb["old_log_probs"], mb["advantages"], mb["completion_mask"], loss_type=self.loss_type,
            epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta, ref_log_probs=ref,
            entropy=entropy.detach(), truncated=mb["truncated"],
            mask_truncated_completions=self.mask_truncated_completions, max_completion_length=self.max_new_tokens,
            **step_count)
        if self.loss_type == "bnpo":  # a local mean: average over the step's micro-batches and ranks
            loss = loss / (self._num_mbs * self.trainer.world_size)
        n = m["num_tokens"]
        stats = {"loss": loss.detach().float(), "num_tokens": n, "num_real_tokens": mb["num_real_tokens"],
                 "clip_low": m["clip_ratio/low_mean"] * n, "clip_high": m["clip_ratio/high_mean"] * n,
                 "clip_region": m["clip_ratio/region_mean"] * n, "ratio_sum": m["ratio_mean"] * n,
                 "entropy_sum": m["entropy"] * n}
        self._ratio_range = (min(self._ratio_range[0], float(m["ratio_min"])),
                             max(self._ratio_range[1], float(m["ratio_max"])))
        if "kl" in m:
            stats["kl_sum"] = m["kl"] * n
        return loss, stats

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        """Collect one optimizer step's sums (logged once per batch by :meth:`_log_rollout`)."""
        keys = sorted(totals)
        vals = torch.stack([totals[k].float().reshape(()) for k in keys])
        summed = dict(zip(keys, self._all_sum(vals).unbind()))
        self.trained_tokens += summed["num_real_tokens"].double()
        summed["grad_norm"] = grad_norm.detach().float()
        summed["lr"] = torch.tensor(float(opt.param_groups[0]["lr"]))
        self._iter_stats.append(summed)

    def _log_rollout(self, rollout: TensorDictBase, staleness: int, wait_time: float, train_time: float,
                     step_time: float, mbs: list[dict[str, Any]]) -> None:
        # Rollout statistics over every rank's rows (one all_gather, called by every rank in the same order): the
        # ranks hold different prompts, so rank 0's rows alone would misreport rewards and lengths under DDP.
        names = list(rollout["rewards"].keys())
        cols = torch.stack([rollout["reward"].float(), rollout["completion_length"].float(),
                            rollout["truncated"].float(), *[rollout["rewards", n].float() for n in names],
                            torch.full_like(rollout["reward"], float(rollout.get_non_tensor("frac_reward_zero_std")),
                                            dtype=torch.float32)], 1).to(self.device)
        if self.trainer.world_size > 1:
            cols = self.all_gather(cols).reshape(-1, cols.shape[1])
        rewards, lengths, truncated = cols[:, 0], cols[:, 1], cols[:, 2]
        log: dict[str, Tensor | float] = {
            "train/reward": rewards.mean(), "train/reward_std": rewards.std() if rewards.numel() > 1 else 0.0,
            "train/frac_reward_zero_std": cols[:, -1].mean(),  # every rank holds the same number of groups
            "train/completions/mean_length": lengths.mean(), "train/completions/min_length": lengths.min(),
            "train/completions/max_length": lengths.max(),
            "train/completions/clipped_ratio": truncated.mean(),
            "train/staleness": float(staleness), "train/dropped_rollouts": self.dropped_rollouts.float(),
            "time/generation": float(rollout.get_non_tensor("generation_time")),
            "time/rollout_wait": wait_time, "time/training": train_time, "time/step": step_time,
        }
        gen_time = float(rollout.get_non_tensor("generation_time"))
        if gen_time > 0:  # this rank's generation throughput
            log["rollout/tokens_per_sec"] = rollout["completion_length"].float().sum() / gen_time
        for j, name in enumerate(names):
            values = cols[:, 3 + j]
            log[f"train/rewards/{name}/mean"] = values.nanmean()
            finite = values[~values.isnan()]
            log[f"train/rewards/{name}/std"] = finite.std() if finite.numel() > 1 else 0.0
        if self._iter_stats:
            it = self._iter_stats
            n = sum(s["num_tokens"] for s in it).clamp(min=1)
            log.update({
                "train/loss": it[-1]["loss"], "train/grad_norm": it[-1]["grad_norm"], "train/lr": it[-1]["lr"],
                "train/clip_ratio/low_mean": sum(s["clip_low"] for s in it) / n,
                "train/clip_ratio/high_mean": sum(s["clip_high"] for s in it) / n,
                "train/clip_ratio/region_mean": sum(s["clip_region"] for s in it) / n,
                "train/ratio_mean": sum(s["ratio_sum"] for s in it) / n,
                "train/ratio_min": self._ratio_range[0], "train/ratio_max": self._ratio_range[1],
                "train/entropy": sum(s["entropy_sum"] for s in it) / n,
                "train/tokens": self.trained_tokens.float(),
                "train/step_tokens": it[-1]["num_tokens"],
            })
            if "kl_sum" in it[0]:
                log["train/kl"] = sum(s["kl_sum"] for s in it) / n
            if train_time > 0:
                log["train/tokens_per_sec"] = sum(s["num_real_tokens"] for s in it) / train_time
        self.log_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in log.items()}, on_step=True,
                      on_epoch=False, batch_size=1)
        self.log("reward", torch.as_tensor(log["train/reward"]), prog_bar=True, on_step=True, batch_size=1,
                 logger=False)
        every = self.log_samples_every
        if every and self.trainer.is_global_zero and (self.global_step - self.num_iterations) % every == 0:
            self._sample_table(rollout)

    def _sample_table(self, rollout: TensorDictBase) -> None:
        k = min(self.num_logged_samples, rollout.batch_size[0])
        if k == 0:
            return
        names = list(rollout["rewards"].keys())
        columns = ["step", "sample_id", "completion", "reward", "advantage", *names]
        rows = [[self.global_step, rollout["sample_id"][i], rollout["completion"][i],
                 round(float(rollout["reward"][i]), 4), round(float(rollout["advantage"][i]), 4),
                 *[round(float(rollout["rewards", n][i]), 4) for n in names]] for i in range(k)]
        append_csv(self.trainer, "rollout_samples.csv", columns, rows)
        _log_table(self.trainer, "train/samples", columns, rows)

    # ------------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def greedy_responses(self, batch: dict[str, Any]) -> list[Tensor]:
        """Greedy response ids (``eval_max_new_tokens``, ending with the stop token unless truncated) of a prompt
        batch's ``prompt_ids`` (or its ``prompt``, rendered with the chat template)."""
        ids = batch.get("prompt_ids") or tokenize_prompts(batch["prompt"], self.tokenizer,
                                                          chat_template=self.chat_template)
        was_training = self.model.training
        self.model.eval()
        try:
            resp, _, _ = policy_responses(self._greedy[0], [torch.as_tensor(p) for p in ids])
        finally:
            self.model.train(was_training)
        return [r.cpu() for r in resp]

    def complete(self, batch: dict[str, Any]) -> list[str]:
        """Greedy completions of a prompt batch, decoded without special tokens (see :meth:`greedy_responses`)."""
        return [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in self.greedy_responses(batch)]

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Greedy completions of held-out prompts, scored by ``eval_reward_funcs`` (accumulated per function)."""
        resp = self.greedy_responses(batch)
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in resp]
        prompts = list(batch["prompt"])
        completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                       for p, t in zip(prompts, texts)]
        columns = {k: list(v) for k, v in batch.items() if k not in ("prompt", "prompt_ids", "sample_id")}
        _, per_fn = self.eval_rewards(prompts=prompts, completions=completions,
                                      completion_ids=[r.tolist() for r in resp], **columns)
        for name, values in per_fn.items():
            self.eval_metrics[name].update(values.to(self.device))
        room = self.eval_samples - len(self._eval_rows)
        answers = columns.get("answer", [""] * len(texts))
        for i in range(max(0, min(room, len(texts)))):
            self._eval_rows.append([self.global_step, batch.get("sample_id", [""] * len(texts))[i], texts[i],
                                    str(answers[i])[-40:], *[round(float(per_fn[n][i]), 4) for n in per_fn]])

    def on_validation_epoch_end(self) -> None:
        """Log ``eval/<fn>`` means; during the sanity check (``num_sanity_val_steps: -1``) they go straight to the
        loggers at step 0, as the before-training numbers."""
        values = {f"eval/{n}": m.compute() for n, m in self.eval_metrics.items() if m.update_count > 0}
        for m in self.eval_metrics.values():
            m.reset()
        rows, self._eval_rows = self._eval_rows, []
        if not values:
            return
        if self.trainer.sanity_checking:
            if self.trainer.is_global_zero:
                for logger in self.trainer.loggers:
                    logger.log_metrics({k: float(v) for k, v in values.items()}, step=self.global_step)
        else:
            self.log_dict(values, batch_size=1)
        if self.trainer.is_global_zero:
            rank_zero_info(f"[step {self.global_step}] greedy eval: " +
                           ", ".join(f"{k}={float(v):.3f}" for k, v in values.items()))
            if rows:
                columns = ["step", "sample_id", "completion", "reference", *self.eval_rewards.names]
                append_csv(self.trainer, "eval_samples.csv", columns, rows)
                _log_table(self.trainer, "eval/samples", columns, rows)


class _StatefulAsyncRollouts(AsyncRollouts):
    """:class:`AsyncRollouts` forwarding ``state_dict``/``load_state_dict`` to the prompt loader (the producer runs a
    few batches ahead, so a resumed asynchronous run skips the prompts that were in flight)."""

    def state_dict(self) -> dict[str, int]:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.prompts.load_state_dict(state)
