"""``PolicyVersionSwitch``: the one callback that owns the policy's generate and log-prob versions during training.

A training module (:class:`~lit_llm.lightning.module.PolicyModule`) wraps its causal LM once as a TorchRL-style
:class:`~lit_llm.policy.TransformersWrapper` and hands the **generate version** to this callback, which derives the
**log-prob version** with ``get_new_version(generate=False)`` (same weights, teacher-forced, scores at the sampling
temperature). The module adds the callback itself in ``configure_callbacks()``, so ``--trainer.callbacks`` can never
drop it. It is the only place where:

* the model switches to generation: :meth:`PolicyVersionSwitch.generating` (eval mode, no grad, KV cache) and back
  to training mode;
* rollouts are produced (GRPO): in synchronous mode at ``on_train_batch_start`` by the rollout engine over the
  generate version (rollout workers served by the threaded batcher), in asynchronous mode by a background producer
  over a copy of the weights that this callback owns (under sharded training a plain model holding the gathered full
  weights, :func:`~lit_llm.rollouts.model_copy.unsharded_copy`), syncs every ``sync_every`` optimizer steps (with
  LoRA: the adapter weights only; sharded: gathered on every rank at the same step) and bounds in staleness
  (``max_staleness``: older rollouts are dropped, jointly on every rank); either way the rollout is handed to the
  module's loss, which scores it with :attr:`PolicyVersionSwitch.log_prob_version`'s masked distribution;
* the KL reference is scored (``beta`` / ``kl_coef > 0``): a frozen copy, or with LoRA the trained model with its
  adapters disabled (:attr:`PolicyVersionSwitch.reference_version`);
* greedy answers are generated (evaluation, :class:`~lit_llm.lightning.callbacks.ValidationSamples`): through
  ``get_new_version(greedy settings)`` of the sampler (:attr:`PolicyVersionSwitch.sampler`);
* with a colocated vLLM engine (GRPO's ``use_vllm``, :class:`~lit_llm.rollouts.vllm_colocate.VLLMRollouts`): the
  engine is built at ``setup`` and the rollout engine, the greedy evaluation and the asynchronous producer sample from
  its :class:`~lit_llm.policy.vLLMWrapper` (the log-prob version stays the trained model's); the trained weights are
  pushed into it at ``fit`` start (after a checkpoint is restored), before any generation whose weights changed
  since the last push (sync: after every optimizer step, at the next rollout; ``validate``: after the restore) and,
  async, every ``sync_every`` steps between two of the producer's rollouts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from lit_llm.lightning.loader_resume import StatefulAsyncRollouts, restore_train_loader, resume_train_loader
from lit_llm.policy.frozen_weights import MIXED_COMPUTE_DTYPES
from lit_llm.policy.sharding import gathered, is_meta, reshard_root
from lit_llm.rewards import TrainerState
from lit_llm.rollouts import RolloutBatch, RolloutEngine, policy_responses
from lit_llm.rollouts.dynamic_sampling import SamplingCap, informative_groups, select_groups
from lit_llm.rollouts.settings import RolloutSettings
from lit_llm.rollouts.vllm_colocate import VLLMRollouts

__all__ = ["PolicyVersionSwitch", "StatefulAsyncRollouts", "restore_train_loader", "resume_train_loader"]


class PolicyVersionSwitch(Callback):
    """Owns the generate and log-prob versions of the trained policy (see the module docstring).

    Args:
        generate_version: the generate version (``TransformersWrapper(..., generate=True)``) over the trained model.
        engine: GRPO's :class:`~lit_llm.rollouts.RolloutEngine` (or its multi-turn subclass
            :class:`~lit_llm.rollouts.EpisodeEngine`) over ``generate_version`` (``None``: no rollouts, e.g. SFT); the
            asynchronous producer builds a twin of it over its copy of the weights. Its
            :class:`~lit_llm.rollouts.settings.RolloutSettings` say the mode: ``rollout_mode`` (``"sync"``: rollouts
            from the trained weights, produced at each batch start; ``"async"``: a background producer over a copy
            of the weights, synced every ``sync_every`` optimizer steps, rollouts older than ``max_staleness``
            dropped) and ``dynamic_sampling`` / ``max_sampling_rounds`` (sync: the step's batch refilled with the
            informative groups of extra prompt batches, DAPO, :mod:`lit_llm.rollouts.dynamic_sampling`; the loader
            handed to :meth:`wrap_train_loader` must have ``next_batch()``).
        log_prob_kwargs: extra ``get_new_version`` arguments of the log-prob version (e.g. ``share_prompts``).
        reference_model: a frozen reference model (KL term); its log-prob version is :attr:`reference_version`. With
            LoRA, the trained ``PeftModel`` itself: the reference version is then the log-prob version with its
            adapters disabled (``get_new_version(disable_adapter=True)``: the base model, no second copy).
        vllm: a colocated vLLM engine to sample with (:class:`~lit_llm.rollouts.vllm_colocate.VLLMRollouts`; built
            at :meth:`setup`, which then swaps ``engine`` for a twin over its generate version); ``None``: the trained
            model samples.

    Attributes:
        generate_version, log_prob_version, reference_version (or ``None``), engine, async_rollouts (or ``None``),
        vllm (or ``None``). num_rollouts, num_greedy_calls, num_dropped, num_syncs: counters.

    Raises:
        ValueError: ``generate_version`` is not a generate version.
    """

    def __init__(self, generate_version: Any, *, engine: RolloutEngine | None = None,
                 log_prob_kwargs: dict[str, Any] | None = None,
                 reference_model: torch.nn.Module | None = None, vllm: VLLMRollouts | None = None) -> None:
        if not getattr(generate_version, "generate", False):
            raise ValueError("PolicyVersionSwitch: generate_version must be a generate version (generate=True).")
        self.generate_version = generate_version
        self.log_prob_version = generate_version.get_new_version(generate=False, batching=False,
                                                                 **(log_prob_kwargs or {}))
        self.reference_version = None
        if reference_model is generate_version.model:  # LoRA: the trained PeftModel with its adapters disabled
            if not callable(getattr(reference_model, "disable_adapter", None)):
                raise ValueError("PolicyVersionSwitch: reference_model is the trained model itself, which is only a "
                                 "reference with its peft adapters disabled; pass a frozen copy for a plain model.")
            self.reference_version = self.log_prob_version.get_new_version(disable_adapter=True)
        elif reference_model is not None:
            self.reference_version = type(self.log_prob_version)(reference_model, **{
                **self.log_prob_version._settings(), **self.log_prob_version._batching_settings()})
        self.engine = engine
        self.vllm = vllm
        self._run = 0  # bumped where the trained weights may have been restored (the engine's push key)
        self.settings = engine.settings if engine is not None else RolloutSettings()
        if engine is not None:  # the reward functions' trainer_state is this callback's view of the trainer
            engine.trainer_state_fn = self.trainer_state
        self._prompt_loader: Any = None
        self.last_sampling_rounds = 1
        self.last_generated_tokens = 0  # dynamic sampling: completion tokens of every round of the last rollout
        self.sampling_cap = SamplingCap()  # dynamic sampling: steps that stopped short of informative groups
        self.async_rollouts: StatefulAsyncRollouts | None = None
        self._greedy: dict[int, Any] = {}
        self._pending: tuple[RolloutBatch | None, int, float] | None = None
        self.num_rollouts = self.num_greedy_calls = self.num_dropped = self.num_syncs = 0
        self._trainer: Trainer | None = None
        self._max_steps: int | None = None
        self._loader_states: list[dict[str, Any]] = []  # the restored checkpoint's train-loader state

    # the mode, read from the engine's settings
    rollout_mode = property(lambda self: self.settings.rollout_mode, doc="``sync`` or ``async``.")
    sync_every = property(lambda self: self.settings.sync_every, doc="Async: steps between weight copies.")
    max_staleness = property(lambda self: self.settings.max_staleness, doc="Async: oldest accepted rollout.")
    dynamic_sampling = property(lambda self: self.settings.dynamic_sampling, doc="DAPO's dynamic sampling.")
    max_sampling_rounds = property(lambda self: self.settings.max_sampling_rounds, doc="Its rollouts per step.")

    # ------------------------------------------------------------------------------------------------ switching
    @property
    def model(self) -> torch.nn.Module:
        """The trained model (shared by both versions)."""
        return self.generate_version.model

    @property
    def is_peft(self) -> bool:
        """Whether the trained model is a ``peft`` ``PeftModel`` (LoRA)."""
        return callable(getattr(self.model, "get_base_model", None))

    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the trainer's autocast computes matmuls in, where frozen copies are cast to it (``bf16-mixed``:
        ``torch.bfloat16``, :data:`~lit_llm.policy.frozen_weights.MIXED_COMPUTE_DTYPES`), else ``None``."""
        return None if self._trainer is None else MIXED_COMPUTE_DTYPES.get(str(self._trainer.precision))

    def precision_context(self) -> AbstractContextManager:
        """The trainer's precision context (autocast under ``bf16-mixed``), as Lightning enters it around
        ``training_step``; a no-op before the callback is attached to a trainer. Rollouts are produced in a hook,
        outside ``training_step``, so they enter it here (the batcher carries it to its worker thread)."""
        trainer = self._trainer
        if trainer is None:
            return nullcontext()
        return trainer.precision_plugin.forward_context()

    @property
    def sampler(self) -> Any:
        """What samples: the rollout engine's policy (the generate version, or with ``vllm`` the engine's
        :class:`~lit_llm.policy.vLLMWrapper`), else the generate version."""
        return self.engine.policy if self.engine is not None else self.generate_version

    @contextmanager
    def generating(self) -> Iterator[Any]:
        """Switch the trained model to generation (eval mode, no grad, the trainer's precision) and back to its
        previous mode on exit. With ``vllm``: the engine is taken for the block (from an asynchronous producer: after
        its rollout in flight), woken and given the trained weights if they changed since the last push; it sleeps
        again on exit (sleep mode). A sharded (FSDP2) model is gathered whole for the block
        (:func:`~lit_llm.policy.sharding.gathered`: ranks generate different numbers of tokens, with no collective).

        Yields:
            The generate version.
        """
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with ExitStack() as stack:
                if self.vllm is not None:
                    if self.async_rollouts is not None:  # after the producer's rollout in flight
                        stack.enter_context(self.async_rollouts.generation_turn())
                    self.vllm.wake_up()
                    stack.callback(self.vllm.sleep)
                    self.push_weights(only_if_changed=True)
                stack.enter_context(torch.no_grad())
                stack.enter_context(gathered(model))  # sharded (FSDP2): gathered once, no collective per step
                stack.enter_context(self.precision_context())
                yield self.generate_version
        finally:
            model.train(was_training)

    def weights_key(self) -> tuple[int, int]:
        """What the trained weights are: ``(run, global_step)``; ``run`` counts the fits / validations that may have
        restored a checkpoint."""
        trainer = self._trainer
        return self._run, int(trainer.global_step) if trainer is not None else 0

    def push_weights(self, *, only_if_changed: bool = False) -> None:
        """Push the trained weights into the vLLM engine (:meth:`VLLMRollouts.push`), from the asynchronous
        producer's thread-safe point when it runs (:meth:`~lit_llm.rollouts.producer.AsyncRollouts.between_rollouts`,
        which also marks its engine's version). No-op without ``vllm`` or, with ``only_if_changed``, when the engine
        already holds these weights."""
        vllm = self.vllm
        key = self.weights_key()
        if vllm is None or (only_if_changed and vllm.pushed_at == key):
            return
        if self.async_rollouts is not None:
            self.async_rollouts.between_rollouts(lambda: vllm.push(self.model, key), key[1])
        else:
            vllm.push(self.model, key)

    def engine_metrics(self) -> dict[str, float]:
        """With ``vllm``: ``time/weight_push`` (seconds of the last push into the engine) and
        ``rollout/weight_pushes`` (pushes so far); empty without."""
        if self.vllm is None:
            return {}
        return {"time/weight_push": self.vllm.last_push_time, "rollout/weight_pushes": float(self.vllm.num_pushes)}

    def greedy_version(self, max_new_tokens: int) -> Any:
        """:attr:`sampler`'s ``get_new_version`` with greedy decoding and ``max_new_tokens`` (built once per budget,
        batching off)."""
        version = self._greedy.get(max_new_tokens)
        if version is None:
            version = self.sampler.get_new_version(
                generate_kwargs={"max_new_tokens": int(max_new_tokens), "do_sample": False}, batching=False)
            self._greedy[max_new_tokens] = version
        return version

    def greedy(self, prompts: list[Tensor], max_new_tokens: int) -> list[Tensor]:
        """Greedy response ids (ending with the stop token unless truncated) of ``prompts`` (1-D long ids), on the
        CPU, generated in eval mode without grad through :meth:`greedy_version`."""
        self.num_greedy_calls += 1
        with self.generating():
            resp, _, _ = policy_responses(self.greedy_version(max_new_tokens), [torch.as_tensor(p) for p in prompts])
        return [r.cpu() for r in resp]

    # ------------------------------------------------------------------------------------------------ rollouts
    def trainer_state(self) -> TrainerState:
        """The :class:`~lit_llm.rewards.TrainerState` the reward functions receive (TRL's ``trainer_state``), read
        from the trainer now: ``global_step`` (the step a synchronous rollout is for; the step the asynchronous
        producer generates at), ``epoch`` (epochs done: ``current_epoch + batches completed in it /
        num_training_batches``, as transformers counts it; with ``dynamic_sampling``, whose extra rounds use up the
        epoch's batches faster than the steps count them, the prompt loader's own count: ``epoch + batches handed
        out before the one being rolled out / batches per epoch``) and ``max_steps`` (``trainer.max_steps``, else
        ``estimated_stepping_batches``, which counts prompt batches; -1 if unbounded). Plain numbers, safe to read
        from the producer thread; ``TrainerState()`` before the callback is attached to a trainer."""
        trainer = self._trainer
        if trainer is None:
            return TrainerState()
        epoch = float(trainer.current_epoch)
        batches = trainer.num_training_batches
        loader = self._prompt_loader
        if loader is not None and len(loader) > 0:  # position counts the batch being rolled out, handed out already
            epoch = loader.epoch + max(loader.position - 1, 0) / len(loader)
        elif isinstance(batches, int) and batches > 0:
            epoch += trainer.fit_loop.epoch_loop.batch_progress.current.completed / batches
        max_steps = self._max_steps if self._max_steps is not None else int(trainer.max_steps)
        return TrainerState(global_step=int(trainer.global_step), epoch=epoch, max_steps=max_steps)

    def rollout(self, batch: Any, step: int) -> RolloutBatch:
        """Synchronous rollout of a prompt batch at ``step``, from the trained weights (eval mode, no grad).

        With ``dynamic_sampling``: while fewer groups than the batch's have unequal rewards, further prompt batches
        of the epoch are drawn from the prompt loader (``next_batch``) and rolled out for the same step, at most
        ``max_sampling_rounds`` rounds in all; under DDP every rank draws as long as any rank needs more (the same
        number of rounds everywhere, so the loaders stay in step). The trained batch is then
        :func:`~lit_llm.rollouts.dynamic_sampling.select_groups`' (same size; :attr:`last_sampling_rounds` counts the
        rounds; a step left short of informative groups is counted and warned about by :attr:`sampling_cap`).

        Raises:
            RuntimeError: no rollout engine; ``dynamic_sampling`` without a prompt loader (never wrapped).
        """
        if self.engine is None:
            raise RuntimeError("PolicyVersionSwitch.rollout: no rollout engine (this module does not do rollouts).")
        with self.generating():
            rollout = self.engine.rollout(batch, step=step, version=step)
        self.num_rollouts += 1
        self.last_sampling_rounds = 1
        if not self.dynamic_sampling:
            return rollout
        if self._prompt_loader is None:
            raise RuntimeError("dynamic_sampling is on, but no prompt loader was handed to "
                               "PolicyVersionSwitch.wrap_train_loader (GRPODataModule.train_dataloader does it through "
                               "the module's wrap_train_loader); use GRPODataModule, call it from your datamodule, or "
                               "set dynamic_sampling: false.")
        g = self.engine.num_generations
        num_groups = rollout.num_rows // g
        rollouts = [rollout]
        found = int(informative_groups(rollout.reward, g).sum())
        while len(rollouts) < self.max_sampling_rounds and self._any_rank(found < num_groups):
            extra = self._prompt_loader.next_batch()
            if extra is None:  # the epoch's prompts are used up: train what was found
                break
            with self.generating():
                more = self.engine.rollout(extra, step=step, version=step, sampling_round=len(rollouts))
            rollouts.append(more)
            found += int(informative_groups(more.reward, g).sum())
        self.last_sampling_rounds = len(rollouts)
        self.last_generated_tokens = sum(int(r.completion_lengths.sum()) for r in rollouts)
        self.sampling_cap.update(found=found, num_groups=num_groups, rounds=len(rollouts),
                                 max_rounds=self.max_sampling_rounds, step=step)
        return select_groups(rollouts, num_groups, g, scale_rewards=self.engine.scale_rewards,
                             advantage_estimator=self.engine.advantage_estimator)

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` or-ed over the ranks (one collective under DDP, called by every rank in the same order)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return flag
        t = torch.tensor(float(flag), device=trainer.strategy.root_device)
        return bool(trainer.strategy.reduce(t, reduce_op="sum") > 0)

    def wrap_train_loader(self, loader: Any, *, version: int, distributed: bool) -> Any:
        """The prompt loader itself (sync), or an asynchronous producer over it and a copy of the weights.

        The copy is built here, on the trainer's thread (after a checkpoint restore): under sharded training
        (FSDP2) it gathers the full weights (:meth:`~lit_llm.rollouts.producer.AsyncRollouts.from_policy`), a
        collective that every rank runs here together (Lightning builds the train dataloader on every rank).
        Under DDP the producer drops nothing itself (each rank's thread timing differs, so ranks would drop different
        batches and fall out of step); :meth:`on_train_batch_start` drops stale batches on all ranks together.
        """
        if self.rollout_mode == "sync" or self.engine is None:
            if self.dynamic_sampling and self.engine is not None:
                if not callable(getattr(loader, "next_batch", None)):
                    raise ValueError(f"dynamic_sampling draws extra prompt batches with the prompt loader's "
                                     f"next_batch(); {type(loader).__name__} has none (use GRPODataModule's "
                                     f"PromptBatchLoader, or set dynamic_sampling: false).")
                self._prompt_loader = loader
            return loader
        if self.async_rollouts is not None:
            self.async_rollouts.close()
        self.async_rollouts = StatefulAsyncRollouts.from_engine(
            self.engine, loader, max_staleness=2**62 if distributed else self.max_staleness, version=version,
            rollout_context=self.precision_context, trainer_state_fn=self.trainer_state,
            copy_weights=self.vllm is None, compute_dtype=self.compute_dtype())
        return self.async_rollouts

    def take_rollout(self, batch: Any, step: int) -> tuple[RolloutBatch | None, int, float]:
        """The rollout of this training batch, as prepared by :meth:`on_train_batch_start` (or now, when the hook did
        not run): ``(rollout or None when dropped as stale, staleness, seconds spent getting it)``."""
        pending, self._pending = self._pending, None
        if pending is not None:
            return pending
        return self._prepare(None, batch, step)

    def _prepare(self, trainer: Trainer | None, batch: Any, step: int) -> tuple[RolloutBatch | None, int, float]:
        t0 = time.perf_counter()
        if not isinstance(batch, RolloutBatch):
            return self.rollout(batch, step), 0, time.perf_counter() - t0
        staleness = step - int(batch.policy_version.max())
        stale = staleness > self.max_staleness
        if trainer is not None and trainer.world_size > 1:  # one decision for all ranks
            flag = torch.tensor(float(stale), device=trainer.strategy.root_device)
            stale = bool(trainer.strategy.reduce(flag, reduce_op="sum") > 0)
        if stale:
            self.num_dropped += 1
            return None, staleness, time.perf_counter() - t0
        return batch, staleness, time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        if self.vllm is not None and self.engine is not None and self.engine.policy is self.generate_version:
            self.vllm.check_setup(device=trainer.strategy.root_device, world_size=trainer.world_size,
                                  rollout_mode=self.rollout_mode, trained=self.model)
            policy = self.vllm.build(precision=trainer.precision, device=trainer.strategy.root_device,
                                     trained=self.model, tokenizer=self.generate_version.tokenizer,
                                     generate_kwargs=self.settings.generate_kwargs())
            self.engine = type(self.engine)(policy, **self.engine.twin_kwargs(), version=self.engine.version)
            self._greedy.clear()
            data = trainer.datamodule
            self.vllm.check_context([
                (getattr(data, "train_rows", None) or [], self.settings.max_new_tokens, "training prompt"),
                (getattr(data, "eval_rows", None) or [], getattr(pl_module, "eval_max_new_tokens", 0) or 0,
                 "evaluation prompt")])
        if self.engine is not None:
            self.engine.rank = trainer.global_rank  # every rank samples from its own stream
        if self.reference_version is not None and not is_meta(self.reference_version.model):  # meta: configure_model
            self.reference_version.model.to(trainer.strategy.root_device)  # the module is moved there after setup

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Keep the checkpoint's train-loader state for :meth:`on_train_start` (and let Lightning resume inside an
        epoch ``max_steps`` stopped): :func:`resume_train_loader`."""
        self._loader_states = resume_train_loader(checkpoint)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._run += 1  # a checkpoint, if any, is restored by now: the engine starts from these weights
        self.push_weights()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.training and trainer.state.fn == "validate":
            self._run += 1  # `validate --ckpt_path`: restored before this hook; pushed before the first generation

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Also continues the train loader's plan (GRPO's prompts, SFT's steps) where the restored checkpoint left it,
        where Lightning did not load the loader's state (an epoch that counts as finished, ``max_steps == -1``),
        before the first batch is drawn."""
        states, self._loader_states = self._loader_states, []
        restore_train_loader(trainer.train_dataloader, states)
        total = trainer.max_steps if trainer.max_steps >= 0 else trainer.estimated_stepping_batches
        self._max_steps = int(total) if total != float("inf") else -1

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.engine is not None:
            self._pending = self._prepare(trainer, batch, trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Async: every ``sync_every`` optimizer steps stage the trained weights for the producer
        (:meth:`~lit_llm.rollouts.producer.AsyncRollouts.sync_weights`; with ``vllm``: push them into the engine).
        Runs on every rank after every training batch with the same ``global_step`` (a stale batch is dropped on all
        ranks together, :meth:`take_rollout`), so the sync of sharded weights, a collective, happens at the same
        steps on every rank, on the trainer's thread."""
        producer = self.async_rollouts
        if producer is None:
            return
        step = trainer.global_step
        if step % self.sync_every == 0 and self.vllm is not None:  # pushed between two of the producer's rollouts
            self.push_weights()
            self.num_syncs += 1
        elif step % self.sync_every == 0:  # with LoRA, the adapter weights only (the copy's base is frozen)
            producer.sync_weights(self.model, step, trainable_only=self.is_peft)
            self.num_syncs += 1
        else:
            producer.set_trainer_version(step)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """Sharded (FSDP2): free the gathered root units of the trained model and the reference
        (:func:`~lit_llm.policy.sharding.reshard_root`): the step updates the shards, a gathered copy would go stale."""
        reshard_root(self.model)
        if self.reference_version is not None:
            reshard_root(self.reference_version.model)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()
