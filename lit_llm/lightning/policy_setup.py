"""What a policy module checks and loads before training: the model and tokenizer of the model options
(:func:`load_policy_model`), the weights' dtype against ``trainer.precision`` (:func:`check_weights_precision`) and
the Trainer options that manual optimisation does not use (:func:`check_manual_optimization_options`); under
``ModelParallelStrategy`` the FSDP2 sharding of the model (:func:`shard_policy`, ``configure_model``) and the equal
micro-batch counts it needs, at the start (:func:`check_sharded_step_plan`) and per step
(:func:`check_sharded_micro_batches`); and the opt-in meta-device construction of sharded runs (:func:`sharded_init`:
ranks other than global rank 0 hold no weights until ``configure_model``)."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

import torch

from lit_llm.cli_errors import EveryRankError
from lit_llm.models import ModelConfig

__all__ = ["MICRO_BATCH_FIX", "check_lora_targets", "check_manual_optimization_options",
           "check_sharded_micro_batches", "check_sharded_step_plan", "check_weights_precision", "in_sharded_init",
           "launch_is_global_rank_zero", "linear_module_names", "load_policy_model", "shard_policy", "sharded_init",
           "sharded_init_for_trainer"]

_SHARDED_INIT: ContextVar[bool] = ContextVar("lit_llm_sharded_init", default=False)

#: The launch variables that say a process is not global rank 0 when one of them is above 0: torchrun's ``RANK`` /
#: ``LOCAL_RANK`` / ``GROUP_RANK``, Lightning's own launcher's ``LOCAL_RANK`` / ``NODE_RANK`` (set for the processes it
#: starts), and SLURM's ``SLURM_PROCID`` where Lightning uses SLURM (``SLURM_NTASKS`` set, job name not ``bash`` /
#: ``interactive``: Lightning's ``SLURMEnvironment.detect`` rule).
LAUNCH_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")


def launch_is_global_rank_zero(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is global rank 0 as its launch environment says, before ``torch.distributed`` starts:
    ``False`` when one of :data:`LAUNCH_RANK_VARIABLES` (or, under SLURM, ``SLURM_PROCID``) is above 0, ``True``
    otherwise (a plain ``lit-llm fit``: the process Lightning's launcher starts the others from).

    Args:
        environ: the environment to read (default ``os.environ``).

    Raises:
        ValueError: one of those variables is not an integer (names it).
    """
    env = os.environ if environ is None else environ
    names = list(LAUNCH_RANK_VARIABLES)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        names.append("SLURM_PROCID")
    for name in names:
        value = env.get(name, "").strip()
        if not value:
            continue
        try:
            rank = int(value)
        except ValueError:
            raise ValueError(f"The environment variable {name}={value!r} is not an integer rank. Fix: unset it or "
                             f"give the process's rank.") from None
        if rank != 0:
            return False
    return True


@contextmanager
def sharded_init(enabled: bool = True) -> Iterator[None]:
    """Policy modules constructed inside this block are built for sharded training (``ModelParallelStrategy``): on
    the process that is global rank 0 (:func:`launch_is_global_rank_zero`) the model is loaded as usual; on every
    other process it is built on the meta device (:func:`load_policy_model` with ``empty=True``: shapes and dtypes
    only, no weight memory, no file read), and so is its KL reference copy. ``configure_model``
    (:func:`shard_policy`) then shards the models, materialises the other ranks' shards and fills them from rank 0
    (:func:`~lit_llm.policy.sharding.fill_from_rank0`), on every rank, whatever the rank. ``lit-llm`` enters it
    when ``trainer.strategy`` is ``ModelParallelStrategy`` (:func:`sharded_init_for_trainer`); Python code that
    builds a module itself opts in with ``with sharded_init(): module = SFTModule(...)`` on **every** rank (the fill
    is collective), and must then train it under ``ModelParallelStrategy``: a meta model without a device mesh is
    refused in ``configure_model``. The tokenizer and chat template are loaded on every rank as before.

    Args:
        enabled: ``False``: a no-op block (today's behaviour: every rank loads the full weights).
    """
    token = _SHARDED_INIT.set(bool(enabled))
    try:
        yield
    finally:
        _SHARDED_INIT.reset(token)


def in_sharded_init() -> bool:
    """Whether the caller runs inside :func:`sharded_init` (read by ``PolicyModule.__init__``)."""
    return _SHARDED_INIT.get()


def sharded_init_for_trainer(trainer_config: Any) -> AbstractContextManager:
    """:func:`sharded_init` when the parsed ``trainer`` options' ``strategy`` is Lightning's
    ``ModelParallelStrategy`` (the name, a ``class_path`` of it or a subclass, or an instance), else a no-op block.
    ``lit-llm`` wraps the building of the run's classes in it
    (:meth:`lit_llm.lightning.cli.LitLLMCLI.instantiate_classes`).
    """
    strategy = trainer_config.get("strategy") if trainer_config is not None else None
    from lit_llm.lightning.sharded_options import is_model_parallel

    return sharded_init() if strategy is not None and is_model_parallel(strategy) else nullcontext()


def _empty_model(config: ModelConfig) -> tuple[Any, Any]:
    """``(model, tokenizer)`` like :func:`~lit_llm.models.load_model` / :func:`~lit_llm.models.tiny_model`, the model
    built on the meta device: transformers' ``from_config`` (what its ``from_pretrained`` builds before reading the
    weights) with the folder's ``config.json``, then its generation config as ``from_pretrained`` reads it; no weight
    file is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_llm.models import load_tokenizer, resolve_dtype, resolve_model_path, tiny_model

    if config.model_name_or_path == "tiny":
        tokenizer = load_tokenizer()
        with torch.device("meta"):
            model = tiny_model(tokenizer, dtype=config.dtype, attn_implementation=config.attn_implementation)
        return model, tokenizer
    path = resolve_model_path(config.model_name_or_path)
    tokenizer = load_tokenizer(path)
    hf_config = AutoConfig.from_pretrained(path)
    hf_config.name_or_path = path
    dtype = resolve_dtype(config.dtype)
    kwargs: dict[str, Any] = {"dtype": hf_config.dtype if dtype == "auto" else dtype}
    if config.attn_implementation is not None:
        kwargs["attn_implementation"] = config.attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    if model.can_generate() and hasattr(model, "adjust_generation_fn"):  # what from_pretrained does after loading:
        # generation_config.json, or a generation config read from config.json when there is none
        model.adjust_generation_fn(None, from_auto_class=True, from_pipeline=None, pretrained_model_name_or_path=path,
                                   cache_dir=None, force_download=False, proxies=None, local_files_only=False,
                                   token=None, revision="main", subfolder="", trust_remote_code=False)
    model.eval()
    return model, tokenizer


def load_policy_model(config: ModelConfig | str, *, empty: bool = False) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for the model options: ``"smollm2-135m-instruct"`` (embedded default), ``"tiny"`` (a
    random tiny Llama over SmolLM2's tokenizer, for tests), a local HF folder or a Hub id, loaded with the options'
    ``dtype`` and ``attn_implementation``; a ``chat_template`` override is resolved (text, ``.jinja`` path or template
    name) and set on the tokenizer, so every render without an explicit template and every export use it. With
    ``use_peft`` the model is a ``peft`` ``PeftModel`` (``get_peft_model`` with
    :func:`~lit_llm.models.get_peft_config`): LoRA adapters on ``lora_target_modules``, every base weight frozen.

    Args:
        config: the :class:`~lit_llm.models.ModelConfig`, or a model name (all other options at their defaults).
        empty: build the model on the meta device (every parameter and buffer, the LoRA adapters too): the same
            modules, names, shapes, dtypes and generation config, no weight memory and no weight file read; its values
            (all of them, the non-persistent rotary buffers included) must be filled later
            (:func:`~lit_llm.policy.sharding.fill_from_rank0`; :func:`sharded_init`). It draws the same numbers from
            the global random generator as a full load (none, but the LoRA adapters' init), so a rank's later random
            stream (dropout) is the one it had before. The tokenizer is loaded as usual.

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
    if empty:
        model, tokenizer = _empty_model(config)
    elif config.model_name_or_path == "tiny":
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
        # empty: peft initialises the (small) adapters on the CPU, drawing the same random numbers as a full load, then
        # moves them to their base layer's device, the meta device (their values come from rank 0 too)
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

    A module built inside :func:`sharded_init` (``module.sharded_init``; on ranks other than global rank 0 its models
    are on the meta device) has each model filled after it is sharded, on every rank
    (:func:`~lit_llm.policy.sharding.fill_from_rank0`: the other ranks' shards materialised on the rank's device and
    filled from rank 0's full weights, the non-persistent buffers broadcast), one model at a time (rank 0 holds a
    model's full weights until its fill ends); each rank other than 0 then prints one line saying so.

    Raises:
        ValueError: ``tensor_parallel_size > 1``, given or ``auto`` (only data-parallel FSDP2 is supported;
            ``lit-llm`` refuses it before launching, :mod:`~lit_llm.lightning.sharded_options`) or ``use_vllm`` (as
            under DDP: the colocated engine runs in one process and initialises its own ``torch.distributed`` group,
            beside the strategy's): one line each, naming the option and the fix; a model on the meta device without
            a device mesh (the run is not sharded after all: its weights would be empty);
            :func:`~lit_llm.policy.sharding.fill_from_rank0`'s refusals.
    """
    from lit_llm.policy.sharding import fill_from_rank0, is_meta, rank0_weights, shard_model

    mesh = getattr(module, "device_mesh", None)
    if mesh is None:
        _refuse_meta_without_mesh(module)
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
    reference = versions.reference_version
    models = [module.model] + ([reference.model] if reference is not None and reference.model is not module.model
                               else [])
    fill = bool(getattr(module, "sharded_init", False))
    if not fill and any(is_meta(m) for m in models):
        raise ValueError("The policy model is on the meta device but the module was not built inside "
                         "lit_llm.lightning.policy_setup.sharded_init(), so nothing would fill it. Fix: build the "
                         "module inside sharded_init() on every rank, or with its weights.")
    built_on_meta, filled = is_meta(module.model), 0
    for model in models:
        full = None if not fill or is_meta(model) else rank0_weights(model)  # rank 0's values, before sharding
        shard_model(model, dp_mesh)
        if fill:
            filled += fill_from_rank0(model, full, dp_mesh)
        del full  # rank 0: the full tensors are freed here (the model holds its shards)
    if built_on_meta:
        import torch.distributed as dist

        what = "model and its KL reference were" if len(models) > 1 else "model was"
        print(f"[rank {dist.get_rank()}] lit-llm: the policy {what} built on the meta device (no weights in host "
              f"memory before configure_model); shards filled from rank 0 ({filled} tensors).", flush=True)


def _refuse_meta_without_mesh(module: Any) -> None:
    from lit_llm.policy.sharding import is_meta

    reference = getattr(getattr(module, "versions", None), "reference_version", None)
    if not (is_meta(module.model) or (reference is not None and is_meta(reference.model))):
        return
    trainer = getattr(module, "_trainer", None)
    strategy = type(trainer.strategy).__name__ if trainer is not None else "none (no Trainer)"
    raise ValueError(f"This process built its policy model on the meta device for sharded training (sharded_init, "
                     f"global rank > 0), but the run is not sharded (trainer.strategy: {strategy}), so it would train "
                     f"on empty weights. Fix: run with --trainer.strategy ModelParallelStrategy, or build the module "
                     f"outside lit_llm.lightning.policy_setup.sharded_init().")


#: The fix named by :func:`check_sharded_micro_batches` and :func:`check_sharded_step_plan`.
MICRO_BATCH_FIX = ("give every rank the same number of micro-batches per step: a dataset size that is a multiple of "
                   "devices x data.batch_size (no short step), or data.micro_batch_size equal to "
                   "data.batch_size.")


def check_sharded_micro_batches(module: Any, count: int) -> None:
    """Under sharding (:func:`shard_policy` ran), refuse a step whose number of micro-batches differs between ranks
    (FSDP2 all-gathers at every forward: a rank with fewer would leave the others waiting;
    :func:`~lit_llm.policy.sharding.check_same_count`: one all-reduce and one host read per step). No-op otherwise.

    Raises:
        EveryRankError: (a ``ValueError``, raised on every rank) the counts differ (names ``data.batch_size`` /
            ``data.micro_batch_size`` and the fix).
    """
    from lit_llm.policy.sharding import check_same_count, is_sharded

    if is_sharded(module.model):
        check_same_count(count, module._all_sum, module.trainer.world_size, what="micro-batches", device=module.device,
                         fix=MICRO_BATCH_FIX)


def check_sharded_step_plan(module: Any, loader: Any) -> None:
    """At the start of training under sharding (:func:`shard_policy` ran), refuse a step loader whose epoch would give
    the ranks different numbers of micro-batches in some step (the short step of
    :class:`~lit_llm.lightning.datamodules.StepBatchLoader`, which the shuffled step order puts anywhere): its
    ``epoch_plan`` for every rank, no collective. Loaders without an ``epoch_plan`` and a ``micro_batch_size`` (GRPO's
    prompts: equal counts by construction) are left to the per-step :func:`check_sharded_micro_batches`.

    Raises:
        EveryRankError: (a ``ValueError``; every rank raises it alike: ``lit-llm`` prints it once) one line with the
            counts per rank, the step's size, and the fix of :func:`check_sharded_micro_batches`.
    """
    from lit_llm.policy.sharding import is_sharded

    if (not is_sharded(module.model) or not callable(getattr(loader, "epoch_plan", None))
            or getattr(loader, "micro_batch_size", None) is None):  # GRPO: prompts, no micro-batches
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
            raise EveryRankError(
                f"Sharded training: one step of every epoch would give the ranks different numbers of micro-batches "
                f"({shown}: {len(loader.samples)} training samples leave a step of {sum(map(len, steps))} for "
                f"{world} ranks x data.batch_size {loader.batch_size}, data.micro_batch_size {m}); FSDP2 needs the "
                f"same forward passes on every rank. Fix: {MICRO_BATCH_FIX}")
