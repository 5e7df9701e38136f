"""Export a training checkpoint as a Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` loadable), and
load a checkpoint's module (full weights or LoRA adapters) for commands that use it (``chat``, evaluation)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["export_checkpoint", "load_module_from_checkpoint"]


def load_module_from_checkpoint(ckpt_path: str | os.PathLike, *, map_location: str = "cpu") -> Any:
    """The :class:`~lit_llm.lightning.module.PolicyModule` (e.g. ``SFTModule``, ``GRPOModule``) of a ``lit-llm fit``
    checkpoint, with its weights, in eval mode.

    The class and its arguments come from the checkpoint's hyper-parameters (``_class_path``). A LoRA checkpoint
    (``use_peft``) holds only the adapter weights: the base model is loaded from its ``model`` option and checked
    against the recorded identity (path and config hash) by :meth:`PolicyModule.on_load_checkpoint`, then the adapters
    are restored; ``module.model`` is the ``PeftModel`` with its adapters enabled (merge it with
    ``merge_and_unload()`` for a plain model, as :func:`export_checkpoint` does).

    Args:
        ckpt_path: a ``.ckpt`` file written by ``lit-llm fit``.
        map_location: where the tensors go (``torch.load``'s argument).

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist; the base model of a LoRA checkpoint cannot be loaded.
        ValueError: the checkpoint's module class is not a ``PolicyModule``; a LoRA checkpoint whose base model
            changed (both identities named).
    """
    ckpt = Path(ckpt_path).expanduser()
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint {str(ckpt)!r} not found; pass <run dir>/checkpoints/last.ckpt (or "
                                f"another .ckpt written by lit-llm fit).")
    module = _module_class(ckpt).load_from_checkpoint(str(ckpt), map_location=map_location, weights_only=False)
    module.eval()
    return module


def export_checkpoint(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the policy model and tokenizer of a Lightning checkpoint as an HF folder.

    A LoRA checkpoint (``use_peft``) is merged: the adapters are folded into the base weights (``peft``'s
    ``merge_and_unload``, ``W + (lora_alpha / lora_r) * B A``), so the folder is a plain HF model (no ``peft`` needed
    to load it) with the adapted model's outputs.

    The module class (``_class_path`` of the checkpoint's hyper-parameters, written by ``lit-llm fit``: any
    :class:`~lit_llm.lightning.module.PolicyModule` subclass, e.g. ``SFTModule`` or ``GRPOModule``) and its arguments
    are read from the checkpoint's hyper-parameters, the weights from its state dict. The folder is written
    to a temporary sibling and renamed at the end, so a failure never leaves a half-written export.

    Args:
        ckpt_path: a ``.ckpt`` file written by ``lit-llm fit`` (e.g. ``runs/x/checkpoints/last.ckpt``).
        out: the folder to create (``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer
            files).
        overwrite: replace ``out`` if it exists.

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
        ValueError: the checkpoint's module class is not a ``PolicyModule``; a LoRA checkpoint whose base model
            changed since training (see :func:`load_module_from_checkpoint`).
    """

    ckpt, target = Path(ckpt_path).expanduser(), Path(out).expanduser()
    if not ckpt.is_file():
        raise FileNotFoundError(f"lit-llm export: checkpoint {str(ckpt)!r} not found; pass --ckpt_path "
                                f"<run dir>/checkpoints/last.ckpt (or another .ckpt written by lit-llm fit).")
    if target.exists() and not overwrite:
        raise FileExistsError(f"lit-llm export: {str(target)!r} already exists; choose another --out or pass "
                              f"--overwrite true.")
    module = load_module_from_checkpoint(ckpt)
    model = module.model
    if callable(getattr(model, "merge_and_unload", None)):  # LoRA: a plain HF model with the adapters folded in
        model = model.merge_and_unload()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        module.tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _module_class(ckpt: Path) -> type:
    """The LightningModule class a ``lit-llm fit`` checkpoint was written by (``PolicyModule`` when unnamed)."""
    import importlib

    import torch

    from lit_llm.lightning.module import PolicyModule

    hparams = torch.load(str(ckpt), map_location="cpu", weights_only=False, mmap=True).get("hyper_parameters") or {}
    class_path = hparams.get("_class_path", "lit_llm.lightning.module.PolicyModule")
    module_name, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module_name), name, None)
    if not (isinstance(cls, type) and issubclass(cls, PolicyModule)):
        raise ValueError(f"lit-llm export: checkpoint {str(ckpt)!r} was written by {class_path!r}, which is not a "
                         f"lit_llm PolicyModule; export only supports checkpoints of lit-llm fit.")
    return cls
