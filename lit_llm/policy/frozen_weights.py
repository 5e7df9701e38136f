"""Frozen copies of a model with their matmul weights in the compute dtype of a mixed precision (issue 28).

Under ``bf16-mixed`` autocast casts each ``Linear`` weight to bf16 when it is used, and its cast cache keeps only
weights that require grad: a frozen fp32 copy (the KL reference) is re-cast at every forward pass. Casting its
``Linear`` layers to bf16 once gives the same numbers bit for bit (autocast would round the same fp32 values to
the same bf16 values) without the casts, and halves their memory. Norms, embeddings and the LM head stay as they are:
autocast keeps norms and embedding lookups in fp32, and the log-prob kernel reads the head's weight itself (its
``matmul_dtype``). Tested on the CPU (casts counted, values compared: tests/policy/test_frozen_weights.py); not run on a
GPU.
"""

from __future__ import annotations

import torch

__all__ = ["MIXED_COMPUTE_DTYPES", "cast_frozen_matmul_weights"]

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
