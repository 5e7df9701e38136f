"""Export a training checkpoint as a Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` loadable)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["export_checkpoint"]


def export_checkpoint(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the policy model and tokenizer of a Lightning checkpoint as an HF folder.

    The module class and its arguments are read from the checkpoint's hyper-parameters (any
    :class:`~lit_llm.lightning.module.PolicyModule` subclass), the weights from its state dict. The folder is written
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
    """
    from lit_llm.lightning.module import PolicyModule

    ckpt, target = Path(ckpt_path).expanduser(), Path(out).expanduser()
    if not ckpt.is_file():
        raise FileNotFoundError(f"lit-llm export: checkpoint {str(ckpt)!r} not found; pass --ckpt_path "
                                f"<run dir>/checkpoints/last.ckpt (or another .ckpt written by lit-llm fit).")
    if target.exists() and not overwrite:
        raise FileExistsError(f"lit-llm export: {str(target)!r} already exists; choose another --out or pass "
                              f"--overwrite true.")
    module = PolicyModule.load_from_checkpoint(str(ckpt), map_location="cpu", weights_only=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        module.model.save_pretrained(tmp, safe_serialization=True)
        module.tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
