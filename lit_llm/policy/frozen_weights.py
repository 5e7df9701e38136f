"""Frozen weights with their matmuls in the compute dtype of a mixed precision (issue 28).

Under ``bf16-mixed`` autocast casts each ``Linear`` weight to bf16 when it is used, and its cast cache keeps only
weights that require grad (Lightning's autocast has the cache off altogether): frozen fp32 weights are re-cast at
every forward pass, i.e. at every decode step of a generation. Casting their ``Linear`` layers to bf16 once gives the
same numbers bit for bit (autocast would round the same fp32 values to the same bf16 values) without the casts, and
halves their memory. Norms, embeddings and the LM head stay as they are: autocast keeps norms and embedding lookups in
fp32, and the log-prob kernel reads the head's weight itself (its ``matmul_dtype``).

The frozen weights cast: the KL reference copy (:func:`cast_frozen_matmul_weights`, at fit start), the asynchronous
producer's copy (:meth:`lit_llm.rollouts.AsyncRollouts.from_policy`'s ``compute_dtype``; its synced weights are
rounded by ``load_state_dict``'s copy, as autocast rounds them) and the frozen base under LoRA adapters
(:func:`cast_frozen_base_weights`: the trained model's own frozen ``Linear`` layers, in place for the fit,
:func:`restore_dtype` at its end; the adapters stay fp32). Tested on the CPU (casts counted, values compared:
tests/lightning/test_frozen_reference.py, tests/policy/test_frozen_weights.py); not run on a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["MIXED_COMPUTE_DTYPES", "cast_frozen_base_weights", "cast_frozen_matmul_weights", "restore_dtype"]

#: ``trainer.precision`` -> the dtype autocast computes matmuls in, for the precisions whose frozen copies are cast.
MIXED_COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16}


def cast_frozen_matmul_weights(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast every ``torch.nn.Linear`` of a frozen ``model`` but its output head (``get_output_embeddings()``) to
    ``dtype``, in place.

    Args:
        model: an HF causal LM whose parameters do not require grad (a frozen copy).
        dtype: the compute dtype of the autocast it runs under (``torch.bfloat16`` for ``bf16-mixed``).

    Returns:
        The names of the cast ``Linear`` modules (empty when there are none).

    Raises:
        ValueError: a parameter of ``model`` requires grad (a trained model keeps fp32 master weights).
    """
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    if trained:
        raise ValueError(f"cast_frozen_matmul_weights: {trained[0]} requires grad; only a frozen copy (the KL "
                         f"reference) may hold its weights in {dtype}: the trained model keeps fp32 master weights.")
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    cast = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.to(dtype)
            cast.append(name)
    return cast


def cast_frozen_base_weights(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """Cast, in place, every ``torch.nn.Linear`` of ``model`` whose parameters are all frozen (a LoRA model's base
    layers, ``base_layer``), but its output head, to ``dtype``; a ``Linear`` with a trainable parameter (a LoRA
    adapter's ``lora_A`` / ``lora_B``, every layer of a fully trained model) is left as it is.

    Why this is safe for a trained ``PeftModel``: the base is never updated, so the optimizer keeps no state for it;
    under the autocast of ``dtype`` its forward and backward numbers are those autocast computes from the fp32 base
    (the same rounding, bit for bit); checkpoints leave the base out (``CheckpointHooks.on_save_checkpoint``), so
    ``lit-llm export`` merges the adapters into the fp32 base it loads. What sees the rounded base: an in-process merge
    (the vLLM push of ``hf_weights``, ``merge_and_unload`` on the live model during the fit).

    Args:
        model: any module (for a model without frozen ``Linear`` layers nothing is cast).
        dtype: the autocast compute dtype (``torch.bfloat16`` under ``bf16-mixed``).

    Returns:
        The names of the cast modules (give them to :func:`restore_dtype` to cast them back).
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    cast = []
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if (isinstance(module, torch.nn.Linear) and module is not head and params
                and not any(p.requires_grad for p in params) and module.weight.dtype != dtype):
            module.to(dtype)
            cast.append(name)
    return cast


def restore_dtype(model: torch.nn.Module, names: list[str], dtype: torch.dtype = torch.float32) -> None:
    """Cast the modules ``names`` of ``model`` (from :func:`cast_frozen_base_weights`) back to ``dtype`` (their values
    stay the rounded ones: a later autocast rounds them to the same values again)."""
    for name in names:
        model.get_submodule(name).to(dtype)
