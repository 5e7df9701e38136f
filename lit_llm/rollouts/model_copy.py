"""A plain (unsharded) frozen copy of a sharded (FSDP2) policy model, for the asynchronous producer (issue 28).

``copy.deepcopy`` of an FSDP2 model would copy its shards, hooks and process-group state (a second sharded model
the producer thread could only run with collectives). Instead, :func:`unsharded_copy` builds an empty model of the
same architecture on the meta device (the HF class from its config; a ``peft`` ``PeftModel`` re-wrapped with its
adapter configs) and assigns it the trained model's **full** weights (:func:`full_weights`: every ``DTensor``
gathered with ``full_tensor()``) and its non-persistent buffers (the rotary ``inv_freq``, not in the state dict). The
copy is an ordinary model on this rank's device: the producer generates with it with no collective. Memory: one full
copy of the weights per rank, as under DDP.

Gathering is a collective: every rank must call :func:`full_weights` / :func:`unsharded_copy` together, on the thread
that trains (never the producer's), with the same model, so the all-gathers run in the same order everywhere.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from lit_llm.policy.logprobs import base_causal_lm
from lit_llm.policy.sharding import non_persistent_buffers

__all__ = ["full_weights", "unsharded_copy"]


def _owned(t: Tensor) -> Tensor:
    """A detached tensor in memory of its own: a ``DTensor`` gathered whole (``full_tensor()``; cloned when that
    returned the local shard itself, as it does on a one-rank mesh or for a replicated tensor), any other tensor
    cloned."""
    if not callable(getattr(t, "full_tensor", None)):
        return t.detach().clone()
    full = t.full_tensor().detach()
    local = t.to_local()
    if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
        full = full.clone()
    return full


def full_weights(source: torch.nn.Module | dict[str, Tensor], *, trainable_only: bool = False) -> dict[str, Tensor]:
    """A copy of ``source``'s state dict with every tensor whole and owned: a ``DTensor`` (FSDP2 shard) is gathered
    with ``full_tensor()``, any other tensor cloned, so training may go on while the copy is read. Tied weights (the
    same parameter under two names) are gathered once and share one tensor in the result.

    Args:
        source: a model (sharded or not) or a state dict.
        trainable_only: only the parameters that require grad (``source`` must be a module), e.g. LoRA adapters.

    Returns:
        ``{name: tensor}`` in ``state_dict()`` (or ``named_parameters()``) order, on the tensors' device, same dtypes.

    Raises:
        TypeError: ``trainable_only`` with a state dict.

    Note:
        With ``DTensor`` values this is a collective (one all-gather per distinct tensor, in this order): every rank
        calls it at the same point with the same model, on the thread that trains.
    """
    if trainable_only:
        if not isinstance(source, torch.nn.Module):
            raise TypeError("full_weights: trainable_only needs a module (a state dict says nothing of requires_grad).")
        state = {k: p for k, p in source.named_parameters() if p.requires_grad}
    else:
        state = source.state_dict(keep_vars=True) if isinstance(source, torch.nn.Module) else source
    gathered: dict[int, Tensor] = {}
    out = {}
    for name, t in state.items():
        if id(t) not in gathered:
            gathered[id(t)] = _owned(t)
        out[name] = gathered[id(t)]
    return out


def _empty_like_model(trained: torch.nn.Module) -> torch.nn.Module:
    """A model of ``trained``'s architecture on the meta device (no memory): the HF class of its causal LM built from
    a copy of its config, re-wrapped with the same ``peft`` adapter configs when ``trained`` is a ``PeftModel``."""
    base = base_causal_lm(trained)
    with torch.device("meta"):
        empty = type(base)(copy.deepcopy(base.config))
        peft_config = getattr(trained, "peft_config", None)
        if base is not trained and peft_config:
            from peft import get_peft_model

            names = list(peft_config)
            empty = get_peft_model(empty, copy.deepcopy(peft_config[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                empty.add_adapter(name, copy.deepcopy(peft_config[name]))
            empty.set_adapter(trained.active_adapter)
    return empty


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen (eval mode, no grad), plain copy of ``model`` holding its full weights, built without
    ``copy.deepcopy`` (see the module docstring): parameters and persistent buffers from :func:`full_weights`,
    non-persistent buffers (e.g. rotary ``inv_freq``) cloned from ``model``'s own, tied weights tied again, the
    generation config copied.

    Args:
        model: an HF causal LM or a ``peft`` ``PeftModel`` over one, sharded with FSDP2 or not (its class must build
            from its ``config``: ``type(model)(config)``).

    Returns:
        The copy, on the device of ``model``'s full tensors (this rank's), with ``model``'s dtypes.

    Raises:
        RuntimeError: the copy's state dict does not match ``model``'s (``load_state_dict``), or a tensor of the copy
            was left on the meta device (named, with the fix).

    Note:
        A collective under sharding (:func:`full_weights`): every rank calls it together, on the thread that trains.
    """
    empty = _empty_like_model(model)
    empty.load_state_dict(full_weights(model), strict=True, assign=True)
    for name, buf in non_persistent_buffers(model):
        owner, _, attr = name.rpartition(".")
        setattr(empty.get_submodule(owner), attr, _owned(buf))
    copy_base, base = base_causal_lm(empty), base_causal_lm(model)
    if callable(getattr(copy_base, "tie_weights", None)):
        copy_base.tie_weights()  # assign=True replaced each tied parameter by its own Parameter object
    if getattr(base, "generation_config", None) is not None:
        copy_base.generation_config = copy.deepcopy(base.generation_config)
    left = [n for n, t in [*empty.named_parameters(), *empty.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"unsharded_copy: {left[0]} of the copy of {type(base).__name__} was not loaded (it is "
                           f"neither in the trained model's state dict nor one of its buffers); fix: use an HF model "
                           f"whose tensors are all parameters or buffers, or rollout_mode sync.")
    return empty.eval().requires_grad_(False)

