"""What a policy module checks and loads before training: the model and tokenizer of the model options
(:func:`load_policy_model`), the weights' dtype against ``trainer.precision`` (:func:`check_weights_precision`) and
the Trainer options that manual optimisation does not use (:func:`check_manual_optimization_options`); under
``ModelParallelStrategy`` the FSDP2 sharding of the model (:func:`shard_policy`, ``configure_model``) and the equal
micro-batch counts it needs, at the start (:func:`check_sharded_step_plan`) and per step
(:func:`check_sharded_micro_batches`)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from lit_llm.models import ModelConfig

__all__ = ["MICRO_BATCH_FIX", "check_lora_targets", "check_manual_optimization_options",
           "check_sharded_micro_batches", "check_sharded_step_plan", "check_weights_precision", "shard_policy",
           "linear_module_names", "load_policy_model"]


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
            (:class:`~lit_llm.data.errors.ChatTemplateError`); a ``lora_target_modules`` entry that matches no module
            of the model (:func:`check_lora_targets`) or that puts an adapter on the output head.
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

        check_lora_targets(model, config.lora_target_modules)
        model = get_peft_model(model, get_peft_config(config))
        lm_head(model)  # a regex target that caught the output head is refused here (the kernel reads its weight)
    return model, tokenizer


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The short (leaf) names of the model's linear layers, deduplicated and sorted, the output head left out (it
    never takes an adapter): e.g. ``["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]``
    for a Llama. GPT-2's ``Conv1D`` layers count as linear (peft adapts them the same way)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear | Conv1D) and m is not head and name})


def check_lora_targets(model: torch.nn.Module, targets: list[str] | None) -> None:
    """Refuse ``lora_target_modules`` entries that match no module of ``model``. peft matches each entry as a module
    name or a suffix after a ``.`` (``q_proj``, ``self_attn.q_proj``) and raises only when no entry matches anything,
    so a misspelled entry next to a valid one (``["q_proj", "vproj"]``) would train without its adapters.

    Args:
        model: the base model, before ``get_peft_model``.
        targets: the ``lora_target_modules`` option (``None`` and ``["all-linear"]``: peft's choice, not checked).

    Raises:
        ValueError: names the entries that match nothing and lists :func:`linear_module_names`, with the fix.
    """
    if targets is None or list(targets) == ["all-linear"]:
        return
    names = [name for name, _ in model.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise ValueError(
            f"--model.init_args.lora_target_modules: {', '.join(repr(t) for t in missing)} "
            f"match{'es' if len(missing) == 1 else ''} no module of the model, so "
            f"{'it' if len(missing) == 1 else 'they'} would get no adapter. The model's linear layers are: "
            f"{', '.join(linear_module_names(model))}. Fix: name some of these, or use [all-linear].")


def check_weights_precision(model: torch.nn.Module, precision: str, dtype_option: str) -> None:
    """Refuse half precision trained weights unless ``trainer.precision`` is the matching ``*-true`` one: under a
    mixed precision (``bf16-mixed``, ``16-mixed``: fp32 master weights with half precision compute) and under
    ``32-true`` / ``64-true`` (the run says full precision) the optimizer would update half precision weights (and
    keep its AdamW state in that dtype), losing updates below their resolution while the run reports another
    precision. Frozen parameters (a LoRA base) are not updated and may be half precision: under ``bf16-mixed`` a
    bf16 base computes what autocast computes from an fp32 one (issue 28).

    Args:
        model: the trained model (the dtype of its floating parameters that require grad is checked, so ``"auto"``
            is covered).
        precision: ``trainer.precision`` as a string.
        dtype_option: the ``model.dtype`` option, named in the message.

    Raises:
        ValueError: names ``model.dtype``, ``trainer.precision`` and both fixes (``model.dtype float32``, or the
            explicit ``trainer.precision bf16-true`` / ``16-true``).
    """
    half = {p.dtype for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)}
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


def shard_policy(module: Any) -> None:
    """``PolicyModule.configure_model``: under Lightning's ``ModelParallelStrategy`` (the module's ``device_mesh``
    is set) shard the trained model and, when it is a separate copy, the frozen KL reference with FSDP2 over the
    ``data_parallel`` mesh (:func:`~lit_llm.policy.sharding.shard_model`; with LoRA the reference is the trained model
    with its adapters disabled: nothing more to shard). Without a device mesh (single device, DDP) nothing happens.
    ``rollout_mode: async`` needs nothing here: its producer is built later (at the train dataloader) over a plain
    copy of the full weights (:func:`~lit_llm.rollouts.model_copy.unsharded_copy`, no deep copy of the shards).

    Raises:
        ValueError: ``tensor_parallel_size > 1``, given or ``auto`` (only data-parallel FSDP2 is supported;
            ``lit-llm`` refuses it before launching, :mod:`~lit_llm.lightning.sharded_options`) or ``use_vllm`` (as
            under DDP: the colocated engine runs in one process and initialises its own ``torch.distributed`` group,
            beside the strategy's): one line each, naming the option and the fix.
    """
    from lit_llm.policy.sharding import shard_model

    mesh = getattr(module, "device_mesh", None)
    if mesh is None:
        return
    names = mesh.mesh_dim_names or ()
    if "tensor_parallel" in names and (tp := mesh["tensor_parallel"].size()) > 1:
        raise ValueError(f"--trainer.strategy.tensor_parallel_size: the device mesh is tensor parallel over {tp} "
                         f"devices (`auto`, the default, means the devices per node); lit-llm shards with "
                         f"data-parallel FSDP2 only. Fix: --trainer.strategy.data_parallel_size "
                         f"{tp * mesh['data_parallel'].size()} --trainer.strategy.tensor_parallel_size 1.")
    versions = module.versions
    if versions.vllm is not None:
        raise ValueError("--model.init_args.use_vllm true is not supported with --trainer.strategy "
                         "ModelParallelStrategy (as under DDP: the colocated engine runs in one process and "
                         "initialises its own torch.distributed group, beside the strategy's). Fix: use_vllm false "
                         "(rollouts on the sharded model), or train on one device without this strategy.")
    dp_mesh = mesh["data_parallel"] if "data_parallel" in names else mesh
    shard_model(module.model, dp_mesh)
    reference = versions.reference_version
    if reference is not None and reference.model is not module.model:
        shard_model(reference.model, dp_mesh)


#: The fix named by :func:`check_sharded_micro_batches` and :func:`check_sharded_step_plan`.
MICRO_BATCH_FIX = ("give every rank the same number of micro-batches per step: a dataset size that is a multiple of "
                   "devices x data.batch_size (no short step), or data.micro_batch_size equal to "
                   "data.batch_size.")


def check_sharded_micro_batches(module: Any, count: int) -> None:
    """Under sharding (:func:`shard_policy` ran), refuse a step whose number of micro-batches differs between ranks
    (FSDP2 all-gathers at every forward: a rank with fewer would leave the others waiting;
    :func:`~lit_llm.policy.sharding.check_same_count`: one all-reduce and one host read per step). No-op otherwise.

    Raises:
        ValueError: the counts differ (names ``data.batch_size`` / ``data.micro_batch_size`` and the fix).
    """
    from lit_llm.policy.sharding import check_same_count, is_sharded

    if is_sharded(module.model):
        check_same_count(count, module._all_sum, module.trainer.world_size, what="micro-batches", device=module.device,
                         fix=MICRO_BATCH_FIX)


def check_sharded_step_plan(module: Any, loader: Any) -> None:
    """At the start of training under sharding (:func:`shard_policy` ran), refuse a step loader whose epoch would give
    the ranks different numbers of micro-batches in some step (the short step of
    :class:`~lit_llm.lightning.datamodules.StepBatchLoader`, which the shuffled step order puts anywhere): its
    ``epoch_plan`` for every rank, no collective. Loaders without an ``epoch_plan`` (GRPO's prompts: equal counts by
    construction) are left to the per-step :func:`check_sharded_micro_batches`.

    Raises:
        ValueError: one line with the counts per rank, the step's size, and the fix of
            :func:`check_sharded_micro_batches`.
    """
    from lit_llm.policy.sharding import is_sharded

    if not is_sharded(module.model) or not callable(getattr(loader, "epoch_plan", None)):
        return
    m, world = loader.micro_batch_size, loader.world_size
    plans = []
    for rank in range(world):
        mine = copy.copy(loader)  # this rank's copy, the loader itself unchanged
        mine.rank = rank
        plans.append(mine.epoch_plan(loader.epoch))
    for steps in zip(*plans):
        counts = [-(-len(s) // m) for s in steps]
        if len(set(counts)) > 1:
            shown = ", ".join(f"rank {k}: {c}" for k, c in enumerate(counts))
            raise ValueError(
                f"Sharded training: one step of every epoch would give the ranks different numbers of micro-batches "
                f"({shown}: {len(loader.samples)} training samples leave a step of {sum(map(len, steps))} for "
                f"{world} ranks x data.batch_size {loader.batch_size}, data.micro_batch_size {m}); FSDP2 needs the "
                f"same forward passes on every rank. Fix: {MICRO_BATCH_FIX}")
