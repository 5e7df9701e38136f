"""The shared policy/optimizer plumbing of the training modules (:class:`PolicyModule`; its subclasses are
:class:`~lit_llm.lightning.sft.SFTModule` and :class:`~lit_llm.lightning.grpo.GRPOModule`).

Optimisation is **manual** (``automatic_optimization = False``): one training batch is one optimizer step made of
micro-batches (see :mod:`lit_llm.lightning.datamodules`). The step's denominator (trained tokens, or sequences) is
counted over all micro-batches and all-reduced over ranks *before* any backward pass, then each micro-batch's loss
``sum / normalizer`` is back-propagated (DDP gradient sync only on the last micro-batch; FSDP2 under
``ModelParallelStrategy`` reduce-scatters after every micro-batch; the loss scaled by ``world_size`` because both
average gradients over ranks). The sum of the micro-batch losses is therefore exactly the token mean
of the whole step (DESIGN.md property 6). Consequences: set the accumulation with ``data.micro_batch_size``, clip with
``model.grad_clip`` (``trainer.accumulate_grad_batches`` and ``trainer.gradient_clip_val`` must stay at their
defaults; Lightning refuses them with manual optimisation). Tested precisions: ``32-true`` and ``bf16-mixed`` (CPU or
GPU; ``trainer.precision: auto`` picks between them, :mod:`lit_llm.lightning.precision`); ``16-mixed``'s loss scaling
with a stand-in plugin on the CPU (:mod:`lit_llm.lightning.grad_scaling`).

The policy's two versions live in a :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` callback (``versions``,
added by ``configure_callbacks``): the loss heads take their log-probs, entropies and token accuracy from the
**log-prob version**'s masked distributions (``get_sft_dist`` / ``get_rlhf_dist`` / ``get_generic_dist``: one backbone
pass, the chunked LM-head kernel on the masked positions only, no ``[B, T, V]`` logits); greedy answers come from the
**generate version**. The loss maths (reductions, step counts, KL) are :mod:`lit_llm.objectives.sft`'s.
"""

from __future__ import annotations

import copy
import inspect
import time
from contextlib import nullcontext
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor

from lit_llm.lightning.checkpointing import CheckpointHooks
from lit_llm.lightning.graceful_stop import GracefulStop
from lit_llm.lightning.grad_scaling import plugin_unscale_skipped, unscale_gradients
from lit_llm.lightning.host_memory import (
    host_peak_rss_bytes,
    host_rss_bytes,
    keep_freed_pages,
    limit_malloc_arenas,
    trim_host_memory,
)
from lit_llm.lightning.policy_setup import (
    check_manual_optimization_options,
    check_sharded_micro_batches,
    check_sharded_step_plan,
    check_weights_precision,
    in_sharded_init,
    launch_is_global_rank_zero,
    load_policy_model,
    shard_policy,
)
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.models import DEFAULT_MODEL, DType, ModelConfig
from lit_llm.objectives.reduction import deferred_checks
from lit_llm.objectives.sft import NonFiniteLossError, check_finite
from lit_llm.policy.frozen_weights import (
    MIXED_COMPUTE_DTYPES,
    cast_frozen_base_weights,
    cast_frozen_matmul_weights,
    restore_dtype,
)
from lit_llm.policy.sharding import full_tensor, is_sharded

__all__ = ["PolicyModule", "check_manual_optimization_options", "check_weights_precision", "load_policy_model"]

_HEAD_DTYPES: dict[str, torch.dtype | None] = {"float32": None, "bfloat16": torch.bfloat16}


class PolicyModule(CheckpointHooks, LightningModule):
    """Shared plumbing of the training modules: the causal LM, optimizer/scheduler, one manual optimizer step with
    step-level normalisation, gradient clipping, non-finite guard and throughput metrics. Subclasses set
    :attr:`versions` (the :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` over their policy) and implement
    :meth:`step_denominator` and :meth:`micro_batch_loss`.

    Args:
        model, dtype, attn_implementation, chat_template, chat_template_kwargs, use_peft, lora_r, lora_alpha,
        lora_dropout, lora_target_modules: the model options, gathered in
            :attr:`model_config` (a :class:`~lit_llm.models.ModelConfig`, TRL names; ``model`` is its
            ``model_name_or_path``): ``"smollm2-135m-instruct"`` (the embedded SmolLM2-135M-Instruct), ``"tiny"``
            (random tiny model, for tests), a local HF folder or a Hub id (through the HF cache); the parameter dtype
            (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"``; half precision weights and a ``*-mixed``
            ``trainer.precision`` are refused at fit start); the attention kernel; a chat template override (Jinja
            text, ``.jinja`` path or template name, set on the tokenizer); the template variables of every render
            (e.g. ``{"enable_thinking": False}``); LoRA through ``peft`` (TRL's names: ``use_peft`` trains adapters
            of rank ``lora_r`` scaled by ``lora_alpha / lora_r`` on ``lora_target_modules``, base frozen; see
            :meth:`reference_model` and :meth:`on_save_checkpoint`). The data modules read :attr:`tokenizer`,
            :attr:`chat_template` and :attr:`chat_template_kwargs` from the module.
        optimizer: optimizer factory over the model's parameters (e.g. ``torch.optim.AdamW`` with ``lr`` in the
            config).
        lr_scheduler: optional scheduler factory, stepped once per optimizer step.
        grad_clip: clip the global gradient norm to this value (``None`` = no clipping; the norm is logged anyway).
        on_nonfinite: a NaN/inf loss or gradient norm either stops the run (``"raise"``, naming the step and the
            sample ids) or skips the step (``"skip"``: gradients dropped, weights untouched, counted in
            ``train/skipped_steps``).
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% slower).
        chunk_size: positions per LM-head chunk in the log-prob kernel.
        lm_head_matmul_dtype: dtype of the LM-head matmuls in the log-prob kernel (the trained log-probs, the KL
            reference's and GRPO's recomputed old log-probs; :attr:`head_matmul_dtype`): ``"float32"`` (default:
            the head's weight and the hidden states in fp32) or ``"bfloat16"`` (both rounded to bf16, as the
            sampler's own head matmul is under ``bf16-mixed``; ~4x faster where bf16 is native); softmax, log-sum-exp
            and reductions are fp32 either way. Measured on GRPO's ``train/mismatch/*`` (benchmarks/README.md): a
            bf16 head does not bring the trainer closer to the sampler, it adds rounding (k3 1.2e-3 -> 1.6e-3 under
            ``bf16-mixed``); keep ``float32`` unless the head's speed matters more.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: DType = "float32", attn_implementation: str | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 use_peft: bool = False, lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
                 grad_clip: float | None = 1.0, on_nonfinite: Literal["raise", "skip"] = "raise",
                 gradient_checkpointing: bool = False, chunk_size: int = 1024,
                 lm_head_matmul_dtype: Literal["float32", "bfloat16"] = "float32") -> None:
        super().__init__()
        if lm_head_matmul_dtype not in _HEAD_DTYPES:
            raise ValueError(f"model.lm_head_matmul_dtype={lm_head_matmul_dtype!r}: use float32 (default) or "
                             f"bfloat16.")
        #: the ``matmul_dtype`` of the policy's log-prob versions (``None``: fp32)
        self.head_matmul_dtype: torch.dtype | None = _HEAD_DTYPES[lm_head_matmul_dtype]
        self.automatic_optimization = False
        self.model_config = ModelConfig(model, dtype=dtype, attn_implementation=attn_implementation,
                                        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {},
                                        use_peft=use_peft, lora_r=lora_r, lora_alpha=lora_alpha,
                                        lora_dropout=lora_dropout, lora_target_modules=lora_target_modules)
        self.model_name = self.model_config.model_name_or_path
        # Plain attributes read by the data modules (their own chat_template wins when set).
        self.chat_template: str | None = self.model_config.chat_template
        self.chat_template_kwargs: dict[str, Any] = self.model_config.chat_template_kwargs
        #: built inside :func:`~lit_llm.lightning.policy_setup.sharded_init` (``lit-llm fit`` under
        #: ``ModelParallelStrategy``): on ranks other than global rank 0 the model (and its KL reference) is on the meta
        #: device until :meth:`configure_model` fills its shards from rank 0
        self.sharded_init = in_sharded_init()
        empty = self.sharded_init and not launch_is_global_rank_zero()
        self.model, self.tokenizer = load_policy_model(self.model_config, empty=empty)
        self.model.train()  # load_model returns eval mode; Lightning keeps submodule modes as they are
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            if use_peft:  # frozen embeddings: the checkpointed blocks' inputs must require grad for the adapters'
                self.model.enable_input_require_grads()
        self.optimizer_factory, self.lr_scheduler_factory = optimizer, lr_scheduler
        self.grad_clip, self.on_nonfinite, self.chunk_size = grad_clip, on_nonfinite, chunk_size
        # Persistent counters (saved in checkpoints, so resumed runs continue the curves).
        self.register_buffer("trained_tokens", torch.zeros((), dtype=torch.float64))
        self.register_buffer("skipped_steps", torch.zeros((), dtype=torch.long))
        self._step_start: float | None = None
        self._trimmed_at: dict[str, int] = {}  # per call site: the mark of release_host_memory

    @classmethod
    def options_of(cls, values: dict[str, Any]) -> dict[str, Any]:
        """:class:`PolicyModule`'s own arguments (the model and optimisation options) picked from a subclass
        ``__init__``'s ``locals()``: what the subclass passes on to ``super().__init__`` (the flat options stay typed
        parameters of the subclass, as the CLI needs them)."""
        names = [p for p in inspect.signature(PolicyModule.__init__).parameters if p != "self"]
        return {name: values[name] for name in names}

    # ----------------------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        """The optimizer over the trainable parameters of ``self.model`` and, if configured, a per-step scheduler (its
        configured state is kept: a resume applies its knobs over the checkpoint's,
        :meth:`~lit_llm.lightning.checkpointing.CheckpointHooks.on_train_start`)."""
        opt = self.optimizer_factory([p for p in self.model.parameters() if p.requires_grad])
        if self.lr_scheduler_factory is None:
            self._configured_scheduler_states: list[dict[str, Any]] = []
            return opt
        scheduler = self.lr_scheduler_factory(opt)
        # the knobs this run configured, before a resume restores the checkpoint's (applied in on_train_start)
        self._configured_scheduler_states = [copy.deepcopy(scheduler.state_dict())]
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_model(self) -> None:
        """Under ``--trainer.strategy ModelParallelStrategy``: the model (and a separate KL reference) sharded with
        FSDP2 and, when built inside :func:`~lit_llm.lightning.policy_setup.sharded_init` (``lit-llm fit`` does),
        the shards of the ranks that built it on the meta device materialised and filled from global rank 0
        (:func:`~lit_llm.lightning.policy_setup.shard_policy`, docs/distributed.md); otherwise nothing (a model on the
        meta device without a device mesh is refused: ``ValueError``, one line)."""
        shard_policy(self)

    def on_fit_start(self) -> None:
        """Reject Trainer options that do not apply to manual optimisation (with the replacement to use), half
        precision weights (``model.dtype``) under a ``*-mixed`` ``trainer.precision`` and two different chat template
        settings on the model and the data (see :meth:`_share_template_options`). Under ``bf16-mixed`` the frozen KL
        reference copy's ``Linear`` weights (not its norms, embeddings or LM head) are cast to bf16 once: the same
        numbers as autocast's cast at every forward, which its cache does not keep for frozen weights
        (:func:`~lit_llm.policy.frozen_weights.cast_frozen_matmul_weights`); with ``use_peft``, likewise the trained
        model's frozen base ``Linear`` weights, in place until :meth:`on_fit_end` (the adapters stay fp32;
        checkpoints and ``lit-llm export`` never hold the base; see
        :func:`~lit_llm.policy.frozen_weights.cast_frozen_base_weights`). On the CPU, first, glibc's malloc arenas
        are capped at :attr:`host_malloc_arenas` (before any rollout thread starts) and, with
        :attr:`host_malloc_keep_freed_pages`, malloc keeps freed pages for reuse; the release marks of an earlier
        fit are dropped (:meth:`release_host_memory`)."""
        t = self.trainer
        self._trimmed_at.clear()
        if self.device.type == "cpu" and self.host_malloc_arenas is not None:  # before any rollout thread starts
            limit_malloc_arenas(self.host_malloc_arenas)
        if self.device.type == "cpu" and self.host_malloc_keep_freed_pages:
            keep_freed_pages()
        check_manual_optimization_options(t)
        check_weights_precision(self.model, str(t.precision), self.model_config.dtype)
        self._share_template_options(t.datamodule)
        compute = MIXED_COMPUTE_DTYPES.get(str(t.precision))
        reference = self.versions.reference_version
        if compute is not None and reference is not None and reference.model is not self.model:  # not LoRA's base
            cast_frozen_matmul_weights(reference.model, compute)
        if compute is not None and self.model_config.use_peft and not is_sharded(self.model):  # LoRA's frozen base
            # for the fit (on_fit_end); not under FSDP2, whose sharded parameters keep the dtype they were sharded in
            self._cast_base = cast_frozen_base_weights(self.model, compute)

    def on_train_start(self) -> None:
        """Under sharding, the step plan's micro-batch counts checked on every rank before the first step
        (:func:`~lit_llm.lightning.policy_setup.check_sharded_step_plan`); then the resume hooks' own."""
        check_sharded_step_plan(self, self.trainer.train_dataloader)
        super().on_train_start()

    def on_fit_end(self) -> None:
        """A LoRA base cast for the fit (:meth:`on_fit_start`) back to fp32 (its values stay the bf16-rounded ones)."""
        restore_dtype(self.model, getattr(self, "_cast_base", []))
        self._cast_base = []

    def reference_model(self) -> torch.nn.Module:
        """The frozen KL reference (``beta`` / ``kl_coef > 0``): with ``use_peft`` the trained ``PeftModel`` itself (the
        :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` scores it with the adapters disabled, i.e. the base
        model: no second copy of the weights); else a frozen deep copy of the initial model (eval mode, no grad): on
        the meta device when the model is (:func:`~lit_llm.lightning.policy_setup.sharded_init` on a rank other than
        0), filled from rank 0's copy in :meth:`configure_model`."""
        if self.model_config.use_peft:
            return self.model
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    @property
    def eval_step(self) -> int:
        """The optimizer step that evaluation output is labelled with: ``global_step`` while fitting; in
        ``validate`` / ``test`` (where Lightning's ``global_step`` is 0) the step of the loaded ``--ckpt_path``."""
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == "fit"
        return self.global_step if fitting else getattr(self, "_checkpoint_step", self.global_step)

    def _share_template_options(self, datamodule: Any) -> None:
        """The data module renders with this module's ``chat_template`` / ``chat_template_kwargs`` when it leaves its
        own unset: record that in its logged hyper-parameters (Lightning refuses to log a key the two modules both
        have with different values), and refuse two different settings (the data would be rendered with one template
        and the rollouts, evaluation and exported tokenizer with another).

        Raises:
            ValueError: ``model.<key>`` and ``data.<key>`` both set, to different values (names both and the fix).
        """
        initial = getattr(datamodule, "_hparams_initial", None)  # what Lightning logs (hparams_initial is a copy)
        if not initial:
            return
        for key in ("chat_template", "chat_template_kwargs"):
            if key not in initial or key not in self.hparams_initial:
                continue
            mine, theirs = self.hparams_initial[key], initial[key]
            if theirs is None or theirs == {}:
                initial[key] = mine
            elif mine not in (None, {}) and mine != theirs:
                raise ValueError(f"model.{key}={mine!r} and data.{key}={theirs!r} differ: the data would be rendered "
                                 f"with one and the rollouts, evaluation and exported tokenizer with the other. Fix: "
                                 f"set {key} once, on the model (the data module uses it), or make them equal.")

    versions: PolicyVersionSwitch

    def configure_callbacks(self) -> list[Any]:
        """The :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` that owns the policy's versions and a
        :class:`~lit_llm.lightning.graceful_stop.GracefulStop` (SIGTERM / SIGINT stop at the next step with a
        ``last.ckpt``), added here so that ``--trainer.callbacks`` cannot drop them."""
        return [self.versions, GracefulStop()]

    # ---------------------------------------------------------------------------------------------- subclass API
    def micro_batch_ids(self, mb: Any) -> list[str]:
        """Sample ids of a micro-batch (named when its loss is not finite)."""
        return list(mb["sample_ids"])

    def micro_batch_real_tokens(self, mb: Any) -> Tensor | None:
        """Non-padding tokens that went through the model for this micro-batch (``None``: unknown)."""
        return mb["attention_mask"].sum().float() if "attention_mask" in mb else None

    def step_denominator(self, micro_batches: list[dict[str, Any]]) -> Tensor:
        """This rank's count (tokens or sequences) of the whole step; summed over ranks by :meth:`training_step`."""
        raise NotImplementedError

    def micro_batch_loss(self, mb: dict[str, Any], normalizer: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, stats)`` of one micro-batch: ``loss = sum / normalizer``; ``stats`` are detached sums to add."""
        raise NotImplementedError

    # -------------------------------------------------------------------------------------------------- training
    @property
    def world_size(self) -> int:
        """Number of ranks (1 when not attached to a Trainer)."""
        return self._trainer.world_size if self._trainer is not None else 1

    def _all_sum(self, x: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(x, reduce_op="sum") if self.trainer.world_size > 1 else x

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        """One optimizer step over ``batch["micro_batches"]`` (see the module docstring).

        Host syncs: one per step when nothing fails (issue 28). The micro-batches' losses are checked for NaN/inf and
        the losses' value checks (:func:`~lit_llm.objectives.reduction.deferred_checks`) are kept on the device until
        every backward pass has run; then one all-reduced flag tensor (a non-finite loss, a non-finite gradient
        norm, a failed check, on any rank) is read once, before the optimizer step. A failure raises (or skips, with
        ``on_nonfinite="skip"``) then, with the weights not updated and the gradients cleared. Under ``16-mixed`` the
        gradients are unscaled before clipping and the check, and a non-finite gradient norm is the GradScaler's
        overflow: its step is skipped and its scale lowered, no error (:mod:`lit_llm.lightning.grad_scaling`)."""
        opt = self.optimizers()
        mbs = batch["micro_batches"]
        step = self.global_step
        check_sharded_micro_batches(self, len(mbs))  # FSDP2: the same forward passes on every rank
        world = self.trainer.world_size
        totals: dict[str, Tensor] = {}
        losses: list[Tensor] = []  # detached, one per micro-batch: read on the host once, with the step's flags
        with deferred_checks() as checks:
            normalizer = self._all_sum(self.step_denominator(mbs).float())  # its input checks deferred too
            for i, mb in enumerate(mbs):
                sync = i == len(mbs) - 1
                block = getattr(self.trainer.strategy, "block_backward_sync", None)
                with nullcontext() if sync or block is None else block():
                    loss, stats = self.micro_batch_loss(mb, normalizer)
                    losses.append(loss.detach().float().reshape(()))
                    self.manual_backward(loss * world)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0) + v
        real = [self.micro_batch_real_tokens(mb) for mb in mbs]
        if all(r is not None for r in real):  # every non-padding token that went through the model
            totals["real_tokens"] = sum(real).float()
        nonfinite = ~torch.isfinite(torch.stack(losses))
        on = nonfinite.device
        scaler = unscale_gradients(self.trainer, opt.optimizer)  # 16-mixed: clip and check the true gradients
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf")) if params else \
            torch.zeros((), device=on)
        grad_norm = full_tensor(grad_norm)  # FSDP2 (sharded gradients): the global norm, a plain tensor
        failed = checks.failed()
        overflow = ~torch.isfinite(grad_norm.detach()).reshape(())  # under a scaler: its overflow, its skip
        local = torch.stack([nonfinite.any(), overflow if scaler is None else torch.zeros_like(overflow),
                             failed if failed is not None else torch.zeros((), dtype=torch.bool, device=on)])
        # Every rank takes the same decision (a rank that raised alone would leave the others waiting).
        flags = self._all_sum(local.float()).tolist()  # the step's one host read
        if any(f > 0 for f in flags):
            opt.zero_grad(set_to_none=True)
            if scaler is not None:  # this step's unscale_ recorded: ready for the next one
                scaler.update()
            checks.verify()  # this rank's failed check raises its own error
            if flags[2] > 0:
                raise ValueError(f"A loss input check failed on another rank at step {step} (its error names the "
                                 f"input); the weights were not updated.")
            bad = [(loss, self.micro_batch_ids(mb)) for loss, mb, b in zip(losses, mbs, nonfinite.tolist()) if b]
            if self.on_nonfinite == "raise":
                if bad:
                    check_finite(bad[0][0], step=step, sample_ids=bad[0][1])
                ids = [s for mb in mbs for s in self.micro_batch_ids(mb)]
                where = "on another rank" if flags[0] > 0 else f"(gradient norm {float(grad_norm)})"
                raise NonFiniteLossError(
                    f"Non-finite loss or gradient {where} at step {step}; this rank's sample ids: {ids[:32]}. The "
                    f"weights were not updated. Fix: inspect those rows, lower the learning rate, or set "
                    f"model.on_nonfinite skip.")
            self.skipped_steps += 1
            self.log("train/skipped_steps", self.skipped_steps.float(), on_step=True, batch_size=1)
            return torch.full((), float("nan"), device=self.device)
        with plugin_unscale_skipped(scaler, opt.optimizer):
            opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self._log_step(totals, grad_norm, opt)
        return totals.get("loss", torch.zeros((), device=self.device))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Log the step's metrics at ``global_step`` (the optimizer steps done, as progress lines and
        ``eval_samples.csv`` count them): Lightning's default x value for manual optimization is the batches stepped
        *before* this one, one less (the first step would share step 0 with the pre-training evaluation)."""
        memory = self.release_host_memory()
        self.log_dict({"step": float(self.global_step), "epoch": float(self.current_epoch), **memory}, on_step=True,
                      on_epoch=False, batch_size=1, logger=True)

    def on_validation_end(self) -> None:
        """Give the evaluation's freed host memory back (:meth:`release_host_memory`, always)."""
        self.release_host_memory(force=True, site="validation")

    #: Least growth of the resident set since a call site's mark (its first call, then just before its last
    #: host-memory release; a fraction of the resident bytes) for that site to release. A release costs ~0.4 s per
    #: ~4 GB freed and the pages it frees are faulted in (zeroed) again by the next allocations: on a run whose memory
    #: is steady (the single-turn demo, SFT) the next step reuses them, and releasing after every step cost ~850k
    #: extra page faults and ~2.5 s of system time per SmolLM2 GRPO step (issue 31, benchmarks/README.md); a run
    #: whose free-but-held memory grows keeps releasing whenever it has grown this much. 0.2: the GRPO benchmark's
    #: steady resident set moves by up to 15% from step to step (rollouts of different lengths).
    host_memory_release_growth: float = 0.20

    #: On the CPU, glibc's malloc arenas for the rest of the process from :meth:`on_fit_start` on
    #: (:func:`~lit_llm.lightning.host_memory.limit_malloc_arenas`; ``None``: glibc's default, ``8 x cores``). With
    #: one, the loss (the main thread) reuses the blocks the rollout's generation threads freed instead of faulting in
    #: new pages for its activations, and the rollout reuses the loss's (issue 31, benchmarks/README.md).
    host_malloc_arenas: int | None = 1

    #: On the CPU, from :meth:`on_fit_start` on, glibc's malloc keeps the pages of freed blocks of every size for
    #: reuse until a release (:func:`~lit_llm.lightning.host_memory.keep_freed_pages`): each step reuses the last
    #: step's activation blocks instead of mapping and zeroing fresh pages for the large ones (issue 31). Like the
    #: arena cap, process-wide and not undone after the fit.
    host_malloc_keep_freed_pages: bool = True

    def release_host_memory(self, *, force: bool = False, site: str = "step") -> dict[str, float]:
        """On the CPU, return glibc's free heap pages to the operating system
        (:func:`~lit_llm.lightning.host_memory.trim_host_memory`: without it a run's resident memory grows with the
        arenas' free blocks: a 14.5 GiB peak for the calculator agent config, 8.3 GiB with the releases) when due:
        always with ``force``, else when this process's resident set is at least ``1 + host_memory_release_growth``
        times the mark of this call site ``site``: the resident set at its first call (which only sets it: the first
        step's memory is the working set the next steps reuse), then just before its last release (a steady run does
        not release, a growing one releases as it grows). Then read the figures logged each step:
        ``memory/host_rss_gib`` (this process's resident set, GiB) and ``memory/host_peak_rss_gib`` (its peak so far,
        ``getrusage`` ``ru_maxrss``, GiB); on CUDA also ``memory/cuda_allocated_gib`` and ``memory/cuda_peak_gib``
        (the caching allocator's live tensors on this rank's device and their peak since the start,
        ``torch.cuda.memory_allocated`` / ``max_memory_allocated``: host-side counters, no device sync; not logged on
        the CPU).

        Call sites: ``"step"`` after every optimizer step (:meth:`on_train_batch_end`), ``"rollout"`` after
        :class:`~lit_llm.lightning.grpo.GRPOModule` takes each rollout, before the loss, where the mark is instead the
        resident set at the end of the last step (after its release, if any): it releases only when the rollout
        itself grew the process by ``host_memory_release_growth`` (multi-turn episodes), not the free blocks the
        last step's loss left for the next one to reuse (with :attr:`host_malloc_arenas` the rollout reuses them
        too; releasing them there made every loss fault them in again, issue 31); ``"validation"`` (forced) after
        every validation loop. Without procfs the host figures are left out; on a GPU nothing is
        released (the activations are not in host memory) and the figures are still returned."""
        rss = host_rss_bytes()
        if self.device.type == "cpu":
            mark = self._trimmed_at.get(site)
            due = force or rss is None or (mark is not None and rss >= mark * (1 + self.host_memory_release_growth))
            if due or mark is None:
                self._trimmed_at[site] = rss or 0
            if due:
                trim_host_memory()
                rss = host_rss_bytes()  # after the release: the figures and the rollout's mark
            if site == "step":  # the rollout site measures the rollout's own growth
                self._trimmed_at["rollout"] = rss or 0
        figures = {}
        if self.device.type == "cuda":
            figures = {"memory/cuda_allocated_gib": torch.cuda.memory_allocated(self.device) / 2**30,
                       "memory/cuda_peak_gib": torch.cuda.max_memory_allocated(self.device) / 2**30}
        peak = host_peak_rss_bytes()
        if rss is None or peak is None:
            return figures
        return {"memory/host_rss_gib": rss / 2**30, "memory/host_peak_rss_gib": max(peak, rss) / 2**30, **figures}

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        keys = sorted(totals)
        summed = dict(zip(keys, self._all_sum(torch.stack([totals[k].float() for k in keys])).unbind()))
        tokens = summed["num_tokens"]
        self.trained_tokens += tokens.double()
        now = time.perf_counter()
        elapsed = now - (self._step_start or now)
        self._step_start = now
        n = tokens.clamp(min=1.0)  # no host read: the same float32 division as by float(tokens)
        log = {
            "train/loss": summed["loss"],
            "train/nll": summed["nll_sum"] / n,
            "train/ppl": torch.exp(summed["nll_sum"] / n),
            "train/entropy": summed["entropy_sum"] / n,
            "train/token_accuracy": summed["hits"] / n,
            "train/tokens": self.trained_tokens.float(),
            "train/step_tokens": tokens,
            "train/grad_norm": grad_norm.detach().float(),
            "train/lr": torch.tensor(float(opt.param_groups[0]["lr"]), device="cpu"),  # a host number
        }
        if "kl" in summed:
            log["train/kl"] = summed["kl"]
        if elapsed > 0:  # trained (loss-masked) tokens and all non-padding tokens per second of wall time
            log["train/tokens_per_sec"] = (tokens.double() / elapsed).float()
            if "real_tokens" in summed:
                log["train/real_tokens_per_sec"] = (summed["real_tokens"].double() / elapsed).float()
        self.log_dict(log, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
        self.log("loss", summed["loss"], prog_bar=True, on_step=True, on_epoch=False, batch_size=1, logger=False)

    # ------------------------------------------------------------------------------------------------ policy API
    def policy(self, *, generate: bool = False, **kwargs: Any) -> Any:
        """The trained policy as a TorchRL-style :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`:
        the callback's log-prob version (``generate=False``, with ``get_dist`` and the masked-distribution heads) or
        generate version -- the objects training runs -- or, with ``kwargs``, ``get_new_version(**kwargs)`` of it
        (same weights, never copied).
        """
        base = self.versions.generate_version if generate else self.versions.log_prob_version
        return base.get_new_version(**kwargs) if kwargs else base

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, prompts: list[Tensor], *, max_new_tokens: int = 64) -> list[Tensor]:
        """Greedy completions of ``prompts`` (``B`` 1-D long id tensors, no padding), stopping at every EOS id, from
        the greedy version of the policy's generate version (:meth:`PolicyVersionSwitch.greedy`).

        Returns:
            ``B`` 1-D long tensors on the CPU: the generated ids, ending with the stop token unless truncated.
        """
        return self.versions.greedy(prompts, max_new_tokens)
