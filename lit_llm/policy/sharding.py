"""FSDP2 (``torch.distributed.fsdp.fully_shard``) of a policy model: what is sharded, and how our own forward passes
(the backbone called directly, the LM head read by the chunked kernel, KV-cached generation) run over it.

* :func:`shard_model`: each decoder layer (the classes the HF model names in ``_no_split_modules``) is one FSDP unit,
  the causal LM itself the root unit (embeddings, final norm, LM head: tied weights stay in one unit). A ``peft``
  ``PeftModel`` is sharded through its base causal LM (:func:`~lit_llm.policy.logprobs.base_causal_lm`): the adapters
  sit in their layer's unit next to the frozen base weights (FSDP2 shards per parameter, so a unit may mix frozen and
  trained parameters).
* The log-prob versions call the **backbone** (``model.model``) and then read ``lm_head.weight`` in the chunked kernel
  (:mod:`lit_llm.policy.kernel`), outside any forward of the root. A forward pre-hook on the backbone therefore
  all-gathers the root unit (:meth:`FSDPModule.unshard`) before every backbone call, so the embedding and the kernel
  see plain, whole tensors. With grad enabled, FSDP2's end-of-backward callback reduce-scatters the root unit's
  gradients and reshards it (it runs ``post_backward`` for every unit still unsharded); under no grad it stays
  gathered until :func:`reshard_root` (called before every optimizer step, so an optimizer step never leaves a stale
  gathered copy behind).
* Generation (:func:`gathered`): ranks generate different numbers of tokens, so per-layer all-gathers at each decode
  step would deadlock; the whole model is gathered once (one all-gather per unit, in the same order on every rank),
  generation runs with no collective, and every unit is resharded after. The full weights are held during generation.

* Meta-device construction (:func:`fill_from_rank0`): ranks other than global rank 0 may build the model on the
  meta device (no weight memory); after :func:`shard_model` their shards are materialised (``to_empty``) and filled
  from rank 0's full weights (``set_model_state_dict`` with ``broadcast_from_rank0``), and the non-persistent buffers
  (rotary ``inv_freq``: not in the state dict) are broadcast from rank 0.

Every rank must run the same FSDP forwards in the same order (see :func:`check_same_count`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lit_llm.cli_errors import EveryRankError
from lit_llm.policy.logprobs import _backbone_and_head, base_causal_lm

__all__ = ["check_same_count", "decoder_layers", "fill_from_rank0", "fsdp_units", "full_tensor", "gathered", "is_meta",
           "is_sharded", "non_persistent_buffers", "rank0_weights", "reshard_root", "shard_model"]


def _fsdp() -> Any:
    from torch.distributed import fsdp

    return fsdp


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal LM (a ``PeftModel``: of its base model): the modules whose class is named in
    the model's ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``), in ``modules()`` order.

    Raises:
        ValueError: the model names no such class, or none of its modules is one (names the model class and the fix).
    """
    base = base_causal_lm(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"shard_model: {type(base).__name__} has no decoder layer to shard (its _no_split_modules "
                         f"is {sorted(names)}); sharded training needs an HF causal LM whose _no_split_modules names "
                         f"its decoder layer class. Fix: use such a model, or train without "
                         f"--trainer.strategy ModelParallelStrategy.")
    return layers


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Whether ``model``'s causal LM (a ``PeftModel``: its base) is an FSDP2 root (:func:`shard_model` ran); ``None``:
    ``False``."""
    return model is not None and isinstance(base_causal_lm(model), _fsdp().FSDPModule)


def fsdp_units(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 units of a sharded model: its decoder layers, then the root (the causal LM); ``[]`` if not sharded."""
    if not is_sharded(model):
        return []
    base = base_causal_lm(model)
    fsdp_module = _fsdp().FSDPModule
    return [m for m in base.modules() if isinstance(m, fsdp_module) and m is not base] + [base]


def _gather_root(root: Any) -> None:
    # FSDP2 makes the first unit whose forward runs the root (``FSDPState._lazy_init``, torch's
    # distributed/fsdp/_fully_shard/_fsdp_state.py); our code runs the backbone, so the first forward would be a decoder
    # layer's: make the causal LM the root first (a no-op once done; there is no public call for it).
    root._get_fsdp_state()._lazy_init()
    root.unshard()


def shard_model(model: torch.nn.Module, mesh: Any, **fully_shard_kwargs: Any) -> list[Any]:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (a 1-D data-parallel ``DeviceMesh``): every decoder layer
    (:func:`decoder_layers`), then the causal LM as the root unit, and a forward pre-hook on its backbone that gathers
    the root unit (see the module docstring). Parameters become ``DTensor`` shards (``Shard(0)`` on ``mesh``); a
    second call on a sharded model does nothing.

    Args:
        model: an HF causal LM or a ``peft`` ``PeftModel`` (sharded through its base causal LM).
        mesh: the data-parallel device mesh (Lightning's ``ModelParallelStrategy``: ``device_mesh["data_parallel"]``).
        fully_shard_kwargs: passed to every ``fully_shard`` call (e.g. ``mp_policy``).

    Returns:
        The FSDP units (:func:`fsdp_units`): the decoder layers, then the root.

    Raises:
        ValueError: no decoder layer found (:func:`decoder_layers`); the head/backbone checks of
            :func:`~lit_llm.policy.logprobs.lm_head`.
    """
    if is_sharded(model):
        return fsdp_units(model)
    fully_shard = _fsdp().fully_shard
    base = base_causal_lm(model)
    backbone, _ = _backbone_and_head(model, "shard_model")
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(base, mesh=mesh, **fully_shard_kwargs)
    backbone.register_forward_pre_hook(lambda module, args: _gather_root(base))
    return fsdp_units(model)


def reshard_root(model: torch.nn.Module | None) -> None:
    """Free the gathered root unit of a sharded ``model`` (its shards stay); a no-op when it is sharded already or the
    model is not sharded. Called before every optimizer step: the optimizer updates the shards, so a gathered copy
    kept across the step would be stale."""
    if model is not None and is_sharded(model):
        base_causal_lm(model).reshard()


@contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP unit of a sharded ``model`` gathered for the block and kept so (no reshard after each forward): the
    forwards inside issue no collective, so ranks may run different numbers of them (generation: different
    completion lengths). Every unit is resharded on exit, the layers' reshard-after-forward restored (the root keeps
    its own: gathered for the whole forward). The full weights are held for the block. A no-op when not sharded.

    Every rank must enter and leave the block together (one all-gather per unit on entry, in the same order)."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    _gather_root(units[-1])
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for unit in units[:-1]:
            unit.set_reshard_after_forward(True, recurse=False)


def full_tensor(x: Tensor) -> Tensor:
    """A ``DTensor`` as the plain tensor it stands for (``x.full_tensor()``: e.g. the global gradient norm that
    ``clip_grad_norm_`` returns over sharded gradients, ``Replicate`` placement); any other tensor as it is."""
    to_full = getattr(x, "full_tensor", None)
    return to_full() if callable(to_full) else x


def check_same_count(count: int, all_sum: Any, world: int, *, what: str, fix: str, device: Any = "cpu") -> None:
    """Refuse a step whose ``count`` (e.g. micro-batches: FSDP2 forward passes) differs between ranks: a rank with
    fewer forward passes would leave the others waiting in an all-gather forever. One all-reduce of ``[n, n^2]`` and
    one host read: all counts are equal iff ``world * sum(n^2) == sum(n)^2``, the same decision on every rank.

    Args:
        count: this rank's count.
        all_sum: sums a float tensor over the ranks (the module's ``_all_sum``).
        world: the number of ranks (1: nothing to check).
        what, fix: named in the error.
        device: where the reduced tensor lives (the strategy's root device: NCCL reduces GPU tensors).

    Raises:
        EveryRankError: (a ``ValueError``) the counts differ (this rank's count, ``what`` and ``fix`` named); every
            rank raises it (the same decision), so ``lit-llm`` prints rank 0's.
    """
    if world <= 1:
        return
    total, squares = all_sum(torch.tensor([float(count), float(count) ** 2], device=device)).tolist()
    if world * squares != total * total:
        raise EveryRankError(f"Sharded training: the ranks have different numbers of {what} in this step (this rank: "
                         f"{count}, mean {total / world:g}); FSDP2 needs the same forward passes on every rank. "
                         f"Fix: {fix}")


def is_meta(model: torch.nn.Module | None) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built without weights); ``None``:
    ``False``."""
    return model is not None and any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def non_persistent_buffers(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, buffer)`` of ``model``'s buffers that its ``state_dict`` leaves out (registered ``persistent=False``,
    e.g. a Llama's rotary ``inv_freq`` / ``original_inv_freq``), in ``named_buffers()`` order (deduplicated)."""
    modules = dict(model.named_modules())
    out = []
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in modules[owner]._non_persistent_buffers_set:
            out.append((name, buf))
    return out


def _mesh_device(mesh: Any) -> torch.device:
    # the device FSDP2 shards onto (torch's fully_shard: the mesh's device type, the current device of that type)
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def rank0_weights(model: torch.nn.Module) -> dict[str, Tensor]:
    """What global rank 0 passes to :func:`fill_from_rank0`: ``model.state_dict()`` (before :func:`shard_model`:
    plain, whole tensors, sharing the model's storage: no copy) plus its non-persistent buffers
    (:func:`non_persistent_buffers`), by name."""
    return {**model.state_dict(), **dict(non_persistent_buffers(model))}


def _signature(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, global shape, dtype)`` of every state-dict tensor and non-persistent buffer (a DTensor: its global
    shape; meta or not)."""
    tensors = [*model.state_dict().items(), *non_persistent_buffers(model)]
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]


def _check_fill(model: torch.nn.Module, has_weights: bool) -> None:
    """One ``all_gather_object`` (default group) of every rank's (weights given?, signature); every rank takes the
    same decision, so a refusal stops all ranks before the broadcast (none is left waiting in it)."""
    import torch.distributed as dist

    mine = (has_weights, _signature(model))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if not everyone[0][0]:
        raise ValueError("Sharded init: global rank 0 has no weights to broadcast (it built its model on the meta "
                         "device: its launch environment said it was not rank 0, one of RANK, LOCAL_RANK, NODE_RANK, "
                         "GROUP_RANK or SLURM_PROCID above 0). Fix: launch so that rank 0 has none of them above 0, or "
                         "build the module outside sharded_init() (lit_llm.lightning.policy_setup).")
    reference = everyone[0][1]
    for rank, (_, theirs) in enumerate(everyone[1:], start=1):
        if theirs != reference:
            diff = next(((a, b) for a, b in zip(theirs, reference) if a != b), None)
            what = (f"{_describe(diff[0])} vs rank 0's {_describe(diff[1])}" if diff else
                    f"{len(theirs)} tensors vs rank 0's {len(reference)}")
            raise ValueError(f"Sharded init: rank {rank} built a different model from rank 0's ({what}), so rank 0's "
                             f"weights cannot fill it. Fix: give every rank the same model options (e.g. an explicit "
                             f"--model.init_args.dtype instead of auto).")


def _describe(entry: tuple[str, tuple[int, ...], str]) -> str:
    name, shape, dtype = entry
    return f"{name} {list(shape)} {dtype}"


def fill_from_rank0(model: torch.nn.Module, weights: dict[str, Tensor] | None, mesh: Any) -> int:
    """Fill a sharded ``model`` (:func:`shard_model` ran) on every rank from global rank 0's full weights: a rank whose
    model is on the meta device materialises its shards first (``model.to_empty(device=...)`` on the mesh's device:
    uninitialised memory, its ``1/world`` share of each parameter, whole buffers); then
    ``torch.distributed.checkpoint.state_dict.set_model_state_dict(model, state_dict,
    options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))`` broadcasts every state-dict tensor
    from rank 0, one at a time, and each rank copies its shard of it; the non-persistent buffers
    (:func:`non_persistent_buffers`: not in the state dict, e.g. rotary ``inv_freq``) are set on rank 0 from
    ``weights`` and broadcast from it. Collective over the default process group (a data-parallel mesh is the whole
    world): every rank calls it with the same model structure, after the same :func:`shard_model`.

    Args:
        model: the sharded model (an HF causal LM or a ``PeftModel``), on the meta device or not.
        weights: on global rank 0, :func:`rank0_weights` of the model taken **before** :func:`shard_model` (whole
            tensors, the values every rank gets; a meta model there may take another model's); ignored on the other
            ranks (``None`` there).
        mesh: the data-parallel ``DeviceMesh`` the model was sharded over (its device type picks the device).

    Returns:
        The number of tensors filled (state-dict entries, tied weights counted per name, + non-persistent buffers).

    Raises:
        ValueError: rank 0 passed no ``weights``, or another rank's model differs from rank 0's in a tensor's name,
            shape or dtype: the same one line on every rank, before any weight is broadcast.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank0 = dist.get_rank() == 0
    _check_fill(model, weights is not None)
    if is_meta(model):
        model.to_empty(device=_mesh_device(mesh))
    buffers = non_persistent_buffers(model)
    names = {name for name, _ in buffers}
    state = {k: v for k, v in weights.items() if k not in names} if rank0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    with torch.no_grad():
        for name, buf in buffers:
            if rank0:
                buf.copy_(weights[name])
            dist.broadcast(buf, src=0)
    return len(model.state_dict()) + len(buffers)
