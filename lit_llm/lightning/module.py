"""LightningModules: the shared policy/optimizer plumbing (:class:`PolicyModule`) and supervised fine-tuning
(:class:`SFTModule`).

Optimisation is **manual** (``automatic_optimization = False``): one training batch is one optimizer step made of
micro-batches (see :mod:`lit_llm.lightning.datamodules`). The step's denominator (trained tokens, or sequences) is
counted over all micro-batches and all-reduced over ranks *before* any backward pass, then each micro-batch's loss
``sum / normalizer`` is back-propagated (DDP gradient sync only on the last micro-batch, the loss scaled by
``world_size`` because DDP averages gradients). The sum of the micro-batch losses is therefore exactly the token mean
of the whole step (DESIGN.md property 6). Consequences: set the accumulation with ``data.micro_batch_size``, clip with
``model.grad_clip`` (``trainer.accumulate_grad_batches`` and ``trainer.gradient_clip_val`` must stay at their
defaults; Lightning refuses them with manual optimisation). Tested precisions: ``32-true`` and ``bf16-mixed`` (CPU or
GPU; ``trainer.precision: auto`` picks between them, :mod:`lit_llm.lightning.precision`).

The policy's two versions live in a :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` callback (``versions``,
added by ``configure_callbacks``): the loss heads take their log-probs, entropies and token accuracy from the
**log-prob version**'s masked distributions (``get_sft_dist`` / ``get_rlhf_dist`` / ``get_generic_dist``: one backbone
pass, the chunked LM-head kernel on the masked positions only, no ``[B, T, V]`` logits); greedy answers come from the
**generate version**. The loss maths (reductions, step counts, KL) are :mod:`lit_llm.objectives.sft`'s.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import nullcontext
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from tensordict import TensorDict
from torch import Tensor
from torchmetrics import SumMetric

from lit_llm.data.packing import is_packed, unpack_rows
from lit_llm.lightning.host_memory import host_peak_rss_bytes, host_rss_bytes, trim_host_memory
from lit_llm.lightning.rng_state import gather_rng_states, restore_rng_states
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.models import DEFAULT_MODEL, DType, ModelConfig, base_model_identity
from lit_llm.objectives.sft import NonFiniteLossError, check_finite, sft_loss, sft_step_count
from lit_llm.policy.transformers_wrapper import TransformersWrapper

__all__ = ["PolicyModule", "SFTModule", "check_manual_optimization_options", "check_weights_precision",
           "load_policy_model"]


def load_policy_model(config: ModelConfig | str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for the model options: ``"smollm2-135m-instruct"`` (embedded default), ``"tiny"`` (a
    random tiny Llama over SmolLM2's tokenizer, for tests), a local HF folder or a Hub id, loaded with the options'
    ``dtype`` and ``attn_implementation``; a ``chat_template`` override is resolved (text, ``.jinja`` path or template
    name) and set on the tokenizer, so every render without an explicit template and every export use it. With
    ``use_peft`` the model is a ``peft`` ``PeftModel`` (``get_peft_model`` with
    :func:`~lit_llm.models.get_peft_config`): LoRA adapters on ``lora_target_modules``, every base weight frozen.

    Args:
        config: the :class:`~lit_llm.models.ModelConfig`, or a model name (all other options at their defaults).

    Raises:
        FileNotFoundError: unknown name / path, a Hub id not cached while ``HF_HUB_OFFLINE`` is set (see
            :func:`lit_llm.models.load_model`).
        ValueError: an invalid option (:class:`~lit_llm.models.ModelConfig`); a chat template that does not resolve
            (:class:`~lit_llm.data.errors.ChatTemplateError`); ``lora_target_modules`` that match no layer of the
            model (peft's message) or that put an adapter on the output head.
    """
    from lit_llm.data.chat_template import set_chat_template
    from lit_llm.models import get_peft_config, load_model, load_tokenizer, tiny_model

    config = config if isinstance(config, ModelConfig) else ModelConfig(str(config))
    if config.model_name_or_path == "tiny":
        tokenizer = load_tokenizer()
        model = tiny_model(tokenizer, dtype=config.dtype, attn_implementation=config.attn_implementation)
    else:
        model, tokenizer = load_model(config.model_name_or_path, dtype=config.dtype,
                                      attn_implementation=config.attn_implementation)
    if config.chat_template is not None:
        set_chat_template(tokenizer, config.chat_template)
    if config.use_peft:
        from peft import get_peft_model

        from lit_llm.policy.logprobs import lm_head

        model = get_peft_model(model, get_peft_config(config))
        lm_head(model)  # a regex target that caught the output head is refused here (the kernel reads its weight)
    return model, tokenizer


def check_weights_precision(model: torch.nn.Module, precision: str, dtype_option: str) -> None:
    """Refuse half precision weights unless ``trainer.precision`` is the matching ``*-true`` one: under a mixed
    precision (``bf16-mixed``, ``16-mixed``: fp32 master weights with half precision compute) and under ``32-true`` /
    ``64-true`` (the run says full precision) the optimizer would update half precision weights (and keep its AdamW
    state in that dtype), losing updates below their resolution while the run reports another precision.

    Args:
        model: the trained model (the dtype of its floating parameters is checked, so ``"auto"`` is covered).
        precision: ``trainer.precision`` as a string.
        dtype_option: the ``model.dtype`` option, named in the message.

    Raises:
        ValueError: names ``model.dtype``, ``trainer.precision`` and both fixes (``model.dtype float32``, or the
            explicit ``trainer.precision bf16-true`` / ``16-true``).
    """
    half = {p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)}
    if not half:
        return
    name = str(sorted(half, key=str)[0]).removeprefix("torch.")
    true = "bf16-true" if name == "bfloat16" else "16-true"
    if precision == true:
        return
    if precision.endswith("-mixed"):
        what = "is mixed precision (fp32 master weights, half precision compute)"
    else:
        what = "is not half precision training"
    raise ValueError(
        f"model.dtype={dtype_option!r} loads the weights in {name}, but trainer.precision={precision!r} {what}: the "
        f"optimizer would update {name} weights (and keep its state in {name}) while the run reports "
        f"{precision}. Fix: set model.dtype float32 to keep {precision}, or keep model.dtype {dtype_option} with "
        f"trainer.precision {true} given explicitly (weights and compute in {name})."
    )


def check_manual_optimization_options(trainer: Any) -> None:
    """Refuse the Trainer options that manual optimisation does not use, naming the module's replacement. Lightning
    refuses them too, but inside ``trainer.fit`` with advice that does not apply ("switch to automatic
    optimization"); ``lit-llm fit`` calls this first (:meth:`lit_llm.lightning.cli.LitLLMCLI.before_fit`).

    Args:
        trainer: a ``Trainer`` (its ``accumulate_grad_batches`` and ``gradient_clip_val`` are read).

    Raises:
        ValueError: ``accumulate_grad_batches != 1`` (use ``data.batch_size`` / ``data.micro_batch_size``) or a
            ``gradient_clip_val`` (use ``model.grad_clip``).
    """
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(f"--trainer.accumulate_grad_batches {trainer.accumulate_grad_batches} is not used: one "
                         f"training batch is one optimizer step. Remove it and set --data.init_args.batch_size "
                         f"(samples per optimizer step) and data.micro_batch_size (samples per forward pass; GRPO: "
                         f"model.micro_batch_size) instead.")
    if trainer.gradient_clip_val:
        raise ValueError(f"--trainer.gradient_clip_val {trainer.gradient_clip_val} is not used with manual "
                         f"optimisation: remove it and set --model.init_args.grad_clip {trainer.gradient_clip_val} "
                         f"instead.")


class PolicyModule(LightningModule):
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
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: DType = "float32", attn_implementation: str | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 use_peft: bool = False, lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None,
                 optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
                 grad_clip: float | None = 1.0, on_nonfinite: Literal["raise", "skip"] = "raise",
                 gradient_checkpointing: bool = False, chunk_size: int = 1024) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model_config = ModelConfig(model, dtype=dtype, attn_implementation=attn_implementation,
                                        chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {},
                                        use_peft=use_peft, lora_r=lora_r, lora_alpha=lora_alpha,
                                        lora_dropout=lora_dropout, lora_target_modules=lora_target_modules)
        self.model_name = self.model_config.model_name_or_path
        # Plain attributes read by the data modules (their own chat_template wins when set).
        self.chat_template: str | None = self.model_config.chat_template
        self.chat_template_kwargs: dict[str, Any] = self.model_config.chat_template_kwargs
        self.model, self.tokenizer = load_policy_model(self.model_config)
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
        self._last_trim: dict[str, float] = {}  # perf_counter of the last host-memory release, per call site

    # ----------------------------------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        """The optimizer over the trainable parameters of ``self.model`` and, if configured, a per-step scheduler."""
        opt = self.optimizer_factory([p for p in self.model.parameters() if p.requires_grad])
        if self.lr_scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.lr_scheduler_factory(opt), "interval": "step"}}

    def on_fit_start(self) -> None:
        """Reject Trainer options that do not apply to manual optimisation (with the replacement to use), half
        precision weights (``model.dtype``) under a ``*-mixed`` ``trainer.precision`` and two different chat template
        settings on the model and the data (see :meth:`_share_template_options`)."""
        t = self.trainer
        check_manual_optimization_options(t)
        check_weights_precision(self.model, str(t.precision), self.model_config.dtype)
        self._share_template_options(t.datamodule)

    # ------------------------------------------------------------------------------------------------ resuming
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the optimizer classes (``"lit_llm_optimizers"``), so that a resume can name a changed one, and every
        rank's generator states (``"lit_llm_rng_states"``, :mod:`lit_llm.lightning.rng_state`: LoRA's dropout masks
        continue as in the uninterrupted run).

        With ``use_peft``: drop the frozen base weights from ``checkpoint["state_dict"]`` (the adapters, which are the
        only trained weights, and the module's counters stay; the optimizer state covers the adapters only) and
        record ``"lit_llm_peft"``: the base model's identity (:func:`~lit_llm.models.base_model_identity`: the
        ``model`` option and its config hash), the LoRA options and the names of the trained weights. A resume,
        ``validate``, ``lit-llm export`` and :func:`~lit_llm.lightning.export.load_checkpoint_module` reload
        the base from the ``model`` option (:meth:`on_load_checkpoint`)."""
        opts = self.trainer.optimizers if self._trainer is not None else []
        checkpoint["lit_llm_optimizers"] = [f"{type(o).__module__}.{type(o).__qualname__}" for o in opts]
        checkpoint["lit_llm_rng_states"] = gather_rng_states()
        if not self.model_config.use_peft:
            return
        trainable = self._trainable_keys()
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith("model.") and k not in trainable]:
            del state[key]
        c = self.model_config
        checkpoint["lit_llm_peft"] = {
            "base_model": base_model_identity(c.model_name_or_path, self.model),
            "lora": {"lora_r": c.lora_r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                     "lora_target_modules": c.lora_target_modules},
            "trainable": sorted(trainable)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep what :meth:`on_train_start` compares with the optimizer this run configured and the checkpoint's
        step (:attr:`eval_step`); for a LoRA checkpoint,
        check the base model and put this module's (frozen, just loaded) base weights back into
        ``checkpoint["state_dict"]`` so that the strict ``load_state_dict`` that follows restores the adapters.

        Raises:
            ValueError: a LoRA checkpoint loaded into a module without ``use_peft`` or the reverse (both named, with the
                fix); a LoRA checkpoint over another base model (path or config hash differ: both identities named);
                other LoRA settings (rank, alpha or target modules).
        """
        self._resumed_optimizers = (checkpoint.get("lit_llm_optimizers"),
                                    [o.get("param_groups", []) for o in checkpoint.get("optimizer_states", [])])
        self._checkpoint_step = int(checkpoint.get("global_step", 0))
        self._resumed_rng_states = checkpoint.get("lit_llm_rng_states")
        record = checkpoint.get("lit_llm_peft")
        if record is None and not self.model_config.use_peft:
            return
        self._check_peft_checkpoint(record)
        state, trainable = checkpoint["state_dict"], self._trainable_keys()
        for key, value in self.state_dict().items():
            if key.startswith("model.") and key not in trainable and key not in state:
                state[key] = value

    def _trainable_keys(self) -> set[str]:
        """State-dict keys (``model.<name>``) of the model's trainable parameters (the LoRA adapters)."""
        return {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}

    def _check_peft_checkpoint(self, record: dict[str, Any] | None) -> None:
        """See :meth:`on_load_checkpoint`."""
        c = self.model_config
        if record is None:
            raise ValueError(
                "model.use_peft is true but the checkpoint holds full weights (written with use_peft false): it has "
                "no LoRA adapters to restore. Resume with use_peft false, or start LoRA from those weights: lit-llm "
                "export the checkpoint and set model: <exported folder> (without --ckpt_path).")
        saved = record["base_model"]
        if not c.use_peft:
            raise ValueError(
                f"The checkpoint holds LoRA adapters over {saved['model_name_or_path']!r} (written with use_peft "
                f"true), but this module has use_peft false. Resume with the checkpoint's model options (use_peft: "
                f"true, {record['lora']}), or merge it with lit-llm export and start a new run from the folder.")
        mine = base_model_identity(c.model_name_or_path, self.model)
        if mine["config_sha256"] != saved["config_sha256"] or not _same_model_path(mine["model_name_or_path"],
                                                                                      saved["model_name_or_path"]):
            raise ValueError(
                f"The LoRA checkpoint was trained on base model {saved['model_name_or_path']!r} (config sha256 "
                f"{saved['config_sha256'][:12]}), but this module loads {mine['model_name_or_path']!r} (config sha256 "
                f"{mine['config_sha256'][:12]}); adapters only make sense over the base they were trained on. Set "
                f"model: {saved['model_name_or_path']} (the same folder, unchanged), or start a new run.")
        theirs, ours = set(record["trainable"]), self._trainable_keys()
        saved_lora = record["lora"]
        if theirs != ours or saved_lora["lora_r"] != c.lora_r or saved_lora["lora_alpha"] != c.lora_alpha:
            now = {"lora_r": c.lora_r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                   "lora_target_modules": c.lora_target_modules}
            diff = sorted(theirs ^ ours)
            raise ValueError(
                f"The LoRA checkpoint's adapters ({saved_lora}) do not match this module's ({now})"
                + (f": {len(diff)} adapter weights differ, e.g. {diff[:3]}" if diff else "")
                + ". Resume with the checkpoint's lora_r, lora_alpha and lora_target_modules.")

    def reference_model(self) -> torch.nn.Module:
        """The frozen KL reference (``beta`` / ``kl_coef > 0``): with ``use_peft`` the trained ``PeftModel`` itself (the
        :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` scores it with the adapters disabled, i.e. the base
        model: no second copy of the weights); else a frozen deep copy of the initial model (eval mode, no grad)."""
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

    def on_train_start(self) -> None:
        """After a resume: restore this rank's generator states (:mod:`lit_llm.lightning.rng_state`; last, right
        before the first resumed step), refuse another optimizer class, warn about a configured lr that the
        checkpoint overrides.

        Lightning restores the checkpoint's optimizer state, param groups included, into the optimizer this run
        built; another class then fails at its first step (e.g. ``KeyError: 'momentum'``) and a changed ``lr`` is
        silently replaced by the saved one.

        Raises:
            ValueError: the checkpoint was written with another optimizer class (both named) or with param groups
                that lack this optimizer's hyperparameters.
        """
        rng_states, self._resumed_rng_states = getattr(self, "_resumed_rng_states", None), None
        if rng_states and not restore_rng_states(rng_states, self.global_rank, self.trainer.world_size):
            rank_zero_warn(f"The checkpoint's random generator states were saved by {len(rng_states)} process(es), "
                           f"this run has {self.trainer.world_size}: they are not restored, so anything drawn from "
                           f"the global generators (LoRA dropout masks) differs from the uninterrupted run.")
        saved = getattr(self, "_resumed_optimizers", None)
        if saved is None:
            return
        self._resumed_optimizers = None
        names, groups = saved
        for i, opt in enumerate(self.trainer.optimizers):
            mine = f"{type(opt).__module__}.{type(opt).__qualname__}"
            theirs = names[i] if names and i < len(names) else None
            missing = sorted(set(opt.defaults) - set(groups[i][0])) if i < len(groups) and groups[i] else []
            if (theirs is not None and theirs != mine) or missing:
                was = theirs or f"an optimizer whose param groups lack {missing}"
                raise ValueError(
                    f"Resuming with optimizer {mine}, but the checkpoint was written by {was}; its optimizer state "
                    f"cannot be restored into {mine}. Resume with the checkpoint's optimizer "
                    f"(model.init_args.optimizer), or start a new run from the weights "
                    f"(lit-llm export, then model: <exported folder>).")
            configured = opt.defaults.get("lr")
            for g in opt.param_groups:
                restored = g.get("initial_lr", g.get("lr"))
                if configured is not None and restored is not None and not math.isclose(
                        float(configured), float(restored), rel_tol=1e-9, abs_tol=0.0):
                    rank_zero_warn(
                        f"The configured learning rate {configured} is ignored on resume: Lightning restored the "
                        f"checkpoint's optimizer state, whose lr is {restored}. To train on with another lr, start a "
                        f"new run from the exported weights, or use an lr_scheduler.")
                    break
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
        """The :class:`~lit_llm.lightning.versions.PolicyVersionSwitch` that owns the policy's versions (added here so
        that ``--trainer.callbacks`` cannot drop it)."""
        return [self.versions]

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
        """One optimizer step over ``batch["micro_batches"]`` (see the module docstring)."""
        opt = self.optimizers()
        mbs = batch["micro_batches"]
        step = self.global_step
        normalizer = self._all_sum(self.step_denominator(mbs).float())
        world = self.trainer.world_size
        totals: dict[str, Tensor] = {}
        bad: list[tuple[Tensor, list[str]]] = []  # (loss, sample ids) of micro-batches with a NaN/inf loss
        for i, mb in enumerate(mbs):
            sync = i == len(mbs) - 1
            block = getattr(self.trainer.strategy, "block_backward_sync", None)
            with nullcontext() if sync or block is None else block():
                loss, stats = self.micro_batch_loss(mb, normalizer)
                if not math.isfinite(float(loss.detach())):
                    bad.append((loss.detach(), self.micro_batch_ids(mb)))
                    if world == 1 and self.on_nonfinite == "raise":
                        check_finite(loss.detach(), step=step, sample_ids=bad[-1][1])  # raises before backward
                self.manual_backward(loss * world)
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + v
        real = [self.micro_batch_real_tokens(mb) for mb in mbs]
        if all(r is not None for r in real):  # every non-padding token that went through the model
            totals["real_tokens"] = sum(real).float()
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip or float("inf"))
        # Every rank takes the same decision (a rank that raised alone would leave the others waiting).
        flags = self._all_sum(torch.tensor([float(bool(bad)), float(not math.isfinite(float(grad_norm)))],
                                           device=self.device))
        if flags.sum().item() > 0:
            if self.on_nonfinite == "raise":
                if bad:
                    check_finite(bad[0][0], step=step, sample_ids=bad[0][1])
                ids = [s for mb in mbs for s in self.micro_batch_ids(mb)]
                where = "on another rank" if flags[0].item() > 0 else f"(gradient norm {float(grad_norm)})"
                raise NonFiniteLossError(
                    f"Non-finite loss or gradient {where} at step {step}; this rank's sample ids: {ids[:32]}. The "
                    f"weights were not updated. Fix: inspect those rows, lower the learning rate, or set "
                    f"model.on_nonfinite skip.")
            opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self.log("train/skipped_steps", self.skipped_steps.float(), on_step=True, batch_size=1)
            return torch.tensor(float("nan"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self._log_step(totals, grad_norm, opt)
        return totals.get("loss", torch.zeros(()))

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

    #: Least time between two host-memory releases at one call site (seconds): bounds their cost (the release plus
    #: faulting the pages in again, ~0.3-0.6 s per ~4 GB) to a few percent of the wall time on short steps.
    host_memory_release_interval: float = 30.0

    def release_host_memory(self, *, force: bool = False, site: str = "step") -> dict[str, float]:
        """On the CPU, return glibc's free heap pages to the operating system
        (:func:`~lit_llm.lightning.host_memory.trim_host_memory`: without it a run's resident memory grows with the
        arenas' free blocks: a 14.5 GiB peak for the calculator agent config, 8.3 GiB with the releases) when due:
        always with ``force``, else when the last release at this call site ``site`` is at least
        :attr:`host_memory_release_interval` seconds old (each site has its own clock, so on long steps every site
        releases every step). Then read the figures
        logged each step: ``memory/host_rss_gib`` (this process's resident set, GiB) and
        ``memory/host_peak_rss_gib`` (its peak so far, ``getrusage`` ``ru_maxrss``, GiB).

        Call sites: ``"step"`` after every optimizer step (:meth:`on_train_batch_end`), ``"rollout"`` after
        :class:`~lit_llm.lightning.grpo.GRPOModule` takes each rollout (before the loss: the rollout's tensors were
        freed in the generation threads' arenas, which the loss's allocations cannot reuse), ``"validation"``
        (forced) after every validation loop. Returns ``{}`` without procfs; on a GPU nothing is released (the
        activations are not in host memory) and the figures are still returned."""
        now = time.perf_counter()
        last = self._last_trim.get(site)
        if self.device.type == "cpu" and (force or last is None or now - last >= self.host_memory_release_interval):
            trim_host_memory()
            self._last_trim[site] = now
        rss, peak = host_rss_bytes(), host_peak_rss_bytes()
        if rss is None or peak is None:
            return {}
        return {"memory/host_rss_gib": rss / 2**30, "memory/host_peak_rss_gib": max(peak, rss) / 2**30}

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        keys = sorted(totals)
        summed = dict(zip(keys, self._all_sum(torch.stack([totals[k].float() for k in keys])).unbind()))
        tokens = summed["num_tokens"]
        self.trained_tokens += tokens.double()
        now = time.perf_counter()
        elapsed = now - (self._step_start or now)
        self._step_start = now
        n = max(float(tokens), 1.0)
        log = {
            "train/loss": summed["loss"],
            "train/nll": summed["nll_sum"] / n,
            "train/ppl": torch.exp(summed["nll_sum"] / n),
            "train/entropy": summed["entropy_sum"] / n,
            "train/token_accuracy": summed["hits"] / n,
            "train/tokens": self.trained_tokens.float(),
            "train/step_tokens": tokens,
            "train/grad_norm": grad_norm.detach().float(),
            "train/lr": torch.tensor(float(opt.param_groups[0]["lr"])),
        }
        if "kl" in summed:
            log["train/kl"] = summed["kl"]
        if elapsed > 0:  # trained (loss-masked) tokens and all non-padding tokens per second of wall time
            log["train/tokens_per_sec"] = torch.tensor(float(tokens) / elapsed)
            if "real_tokens" in summed:
                log["train/real_tokens_per_sec"] = torch.tensor(float(summed["real_tokens"]) / elapsed)
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


class SFTModule(PolicyModule):
    """Supervised fine-tuning with a choice of loss head and an optional KL term to a frozen reference copy.

    Heads (the log-prob version's masked distributions): ``"sft"`` trains on the completion (prompt-masked,
    ``get_sft_dist``), ``"rlhf"`` on every assistant turn (assistant-masked, ``get_rlhf_dist``), ``"generic"`` on every
    real token (attention-masked, ``get_generic_dist``).

    Args:
        model, dtype, attn_implementation, chat_template, chat_template_kwargs, use_peft, lora_r, lora_alpha,
        lora_dropout, lora_target_modules: the model options (see :class:`PolicyModule` and
            :class:`~lit_llm.models.ModelConfig`).
        loss: the loss head, ``"sft"``, ``"rlhf"`` or ``"generic"``.
        normalization: ``"token"`` = mean over the trained tokens of the whole optimizer step (all micro-batches,
            all ranks); ``"sequence"`` = each sequence's token mean, averaged over the step's sequences.
        kl_coef: weight of the k3 KL-to-reference term (``> 0`` keeps a frozen copy of the initial model, not
            saved in checkpoints; with ``use_peft`` the reference is the same model with its adapters disabled).
        token_accuracy: log the mean token accuracy (argmax hits from the log-prob kernel's chunks: no extra
            LM-head pass).
        optimizer, lr_scheduler, grad_clip, on_nonfinite, gradient_checkpointing, chunk_size: see
            :class:`PolicyModule`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: DType = "float32", attn_implementation: str | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 use_peft: bool = False, lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None, loss: Literal["sft", "rlhf", "generic"] = "sft",
                 normalization: Literal["token", "sequence"] = "token",
                 kl_coef: float = 0.0, token_accuracy: bool = True, optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, grad_clip: float | None = 1.0,
                 on_nonfinite: Literal["raise", "skip"] = "raise", gradient_checkpointing: bool = False,
                 chunk_size: int = 1024) -> None:
        super().__init__(model, dtype=dtype, attn_implementation=attn_implementation, chat_template=chat_template,
                         chat_template_kwargs=chat_template_kwargs, use_peft=use_peft, lora_r=lora_r,
                         lora_alpha=lora_alpha, lora_dropout=lora_dropout, lora_target_modules=lora_target_modules,
                         optimizer=optimizer, lr_scheduler=lr_scheduler, grad_clip=grad_clip,
                         on_nonfinite=on_nonfinite, gradient_checkpointing=gradient_checkpointing,
                         chunk_size=chunk_size)
        if loss not in ("sft", "rlhf", "generic"):
            raise ValueError(f"SFTModule: loss must be 'sft', 'rlhf' or 'generic', got {loss!r}.")
        if normalization not in ("token", "sequence"):
            raise ValueError(f"SFTModule: normalization must be 'token' or 'sequence', got {normalization!r}.")
        if kl_coef < 0:
            raise ValueError(f"SFTModule: kl_coef must be >= 0, got {kl_coef}.")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.loss, self.normalization, self.kl_coef, self.token_accuracy = loss, normalization, kl_coef, token_accuracy
        # The generate version answers greedily (ValidationSamples); its log-prob version scores at temperature 1.
        policy = TransformersWrapper(self.model, tokenizer=self.tokenizer, input_mode="tokens",
                                     generate_kwargs={"max_new_tokens": 64, "do_sample": False}, chunk_size=chunk_size)
        # the reference (kl_coef > 0) lives in the callback: not trained, not checkpointed, not exported (with LoRA:
        # the trained model with its adapters disabled)
        self.versions = PolicyVersionSwitch(policy, reference_model=self.reference_model() if kl_coef > 0 else None)
        self.val_sums = torch.nn.ModuleDict({k: SumMetric() for k in ("nll_sum", "num_tokens", "hits", "entropy_sum")})

    @property
    def reduction(self) -> Literal["token_mean", "sequence_mean"]:
        """The :func:`~lit_llm.objectives.sft.sft_loss` reduction of :attr:`normalization`."""
        return "token_mean" if self.normalization == "token" else "sequence_mean"

    @staticmethod
    def policy_inputs(mb: dict[str, Any]) -> TensorDict:
        """The log-prob version's input for a collated micro-batch (same tensors, no copy, no re-padding):
        ``tokens.full`` ``[B, T]`` long, ``masks.all_attention_mask`` and ``masks.all_assistant_mask`` ``[B, T]``
        bool (right-padded, as :func:`~lit_llm.data.datasets.collate` writes them); for a packed micro-batch
        (:func:`~lit_llm.data.packing.collate_packed`) ``B`` packs and their ``position_ids`` ``[B, T]`` (the
        log-prob version's packed layout: rows never attend to each other)."""
        ids = mb["input_ids"]
        entries = {("tokens", "full"): ids, ("masks", "all_attention_mask"): mb["attention_mask"].bool(),
                   ("masks", "all_assistant_mask"): mb["assistant_mask"]}
        if is_packed(mb):
            entries["position_ids"] = mb["position_ids"]
        return TensorDict(entries, batch_size=ids.shape[:1])

    @staticmethod
    def _rows(mb: dict[str, Any], packed: Tensor, fill: float | bool = 0) -> Tensor:
        """A packed micro-batch's ``[P, L]`` tensor in its rows' ``[N, T]`` layout (as returned for unpacked ones)."""
        return unpack_rows(packed, mb["unpack_index"], mb["row_lengths"], fill=fill) if is_packed(mb) else packed

    def mask(self, mb: dict[str, Any]) -> Tensor:
        """``[N, T]`` bool loss mask of a micro-batch's ``N`` rows for the configured head: the mask of the log-prob
        version's ``get_<head>_dist`` (:meth:`~lit_llm.policy.LLMWrapperBase.head_mask`), without a forward pass;
        for a packed micro-batch, gathered back to the rows (:func:`~lit_llm.data.packing.unpack_rows`), so token
        and sequence counts are those of the same rows unpacked."""
        return self._rows(mb, self.versions.log_prob_version.head_mask(self.policy_inputs(mb), self.loss), False)

    def step_denominator(self, micro_batches: list[dict[str, Any]]) -> Tensor:
        """Trained tokens (``normalization="token"``) or sequences with >= 1 trained token, over the micro-batches."""
        return sum(sft_step_count(self.mask(mb), self.reduction) for mb in micro_batches)

    def forward_stats(self, mb: dict[str, Any], *, normalizer: Tensor | None,
                      reduction: str) -> tuple[Tensor, dict[str, Tensor]]:
        """Score one micro-batch with the log-prob version's masked distribution of the configured head (one backbone
        pass; log-probs, entropies and argmax hits from one pass of the chunked kernel over the masked positions):
        ``(loss, stats)`` with detached sums (``loss``, ``nll_sum``, ``num_tokens``, ``entropy_sum``, ``hits`` and
        ``kl`` with a reference)."""
        inputs = self.policy_inputs(mb)
        dist = getattr(self.versions.log_prob_version, f"get_{self.loss}_dist")(inputs)
        log_probs, entropy, hits = dist.log_prob_and_entropy(dist.tokens, return_hits=True)  # hits: ~free
        mask = dist.mask
        ref = None
        if self.versions.reference_version is not None:
            with torch.no_grad():
                ref = self._rows(mb, self.versions.reference_version.get_dist(inputs, mask=mask).log_prob(dist.tokens))
        # packed micro-batch: back to the rows, so the loss and its counts are the unpacked batch's
        log_probs, entropy = self._rows(mb, log_probs), self._rows(mb, entropy)
        hits, mask = self._rows(mb, hits, False), self._rows(mb, mask, False)
        loss, metrics = sft_loss(log_probs, mask, normalizer=normalizer, reduction=reduction, ref_log_probs=ref,
                                 kl_coef=self.kl_coef)
        stats = {"loss": metrics["loss"], "nll_sum": metrics["nll_sum"], "num_tokens": metrics["num_tokens"],
                 "entropy_sum": (entropy.detach() * mask).sum().float(),
                 "hits": (hits & mask).sum().float() if self.token_accuracy else torch.zeros((), device=mask.device)}
        if "kl" in metrics:
            stats["kl"] = metrics["kl"]
        return loss, stats

    def micro_batch_loss(self, mb: dict[str, Any], normalizer: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``sft_loss`` of one micro-batch normalised by the step-level ``normalizer``; its stats also count the
        token slots that went through the model (``input_slots``: ``input_ids.numel()``, padding included)."""
        loss, stats = self.forward_stats(mb, normalizer=normalizer, reduction=self.reduction)
        stats["input_slots"] = torch.tensor(float(mb["input_ids"].numel()), device=loss.device)
        return loss, stats

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        """:meth:`PolicyModule._log_step`, plus ``train/pad_fraction``: padding positions over all positions that went
        through the model in the step (all micro-batches, all ranks; 0 = no padding)."""
        slots = totals.pop("input_slots", None)
        super()._log_step(totals, grad_norm, opt)
        if slots is not None and "real_tokens" in totals:
            real, slots = self._all_sum(torch.stack([totals["real_tokens"].float(), slots.float()])).unbind()
            self.log("train/pad_fraction", 1 - real / slots.clamp(min=1), on_step=True, on_epoch=False,
                     batch_size=1)

    # ------------------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulate the NLL sum, token count, argmax hits and entropy sum of the validation set."""
        _, stats = self.forward_stats(batch, normalizer=None, reduction="token_mean")
        for k, metric in self.val_sums.items():
            metric.update(stats[k])

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` (token-mean NLL of the whole validation set), ``val/ppl``, ``val/token_accuracy``,
        ``val/entropy``."""
        sums = {k: m.compute() for k, m in self.val_sums.items()}
        for m in self.val_sums.values():
            m.reset()
        n = sums["num_tokens"].clamp(min=1)
        nll = sums["nll_sum"] / n
        self.log_dict({"val/loss": nll, "val/ppl": torch.exp(nll), "val/token_accuracy": sums["hits"] / n,
                       "val/entropy": sums["entropy_sum"] / n, "val/tokens": sums["num_tokens"],
                       "step": float(self.eval_step)},  # x value: the checkpoint's step in validate
                      prog_bar=False, batch_size=1, sync_dist=False)


def _same_model_path(a: str, b: str) -> bool:
    """Two ``model`` options name the same base: equal strings, or two paths of one existing folder."""
    from pathlib import Path

    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()
