"""Export a training checkpoint as a Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` loadable), and
load a checkpoint's module (full weights or LoRA adapters) or a model name's policy for inference (``lit-llm chat``,
``lit-llm evaluate``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["InferencePolicy", "export_checkpoint", "load_checkpoint_module", "load_inference_policy"]


def export_checkpoint(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the policy model and tokenizer of a Lightning checkpoint as an HF folder.

    A LoRA checkpoint (``use_peft``) is merged: the adapters are folded into the base weights (``peft``'s
    ``merge_and_unload``, ``W + (lora_alpha / lora_r) * B A``), so the folder is a plain HF model (no ``peft`` needed
    to load it) with the adapted model's outputs.

    The module is rebuilt by :func:`load_checkpoint_module`. The folder is written to a temporary sibling and
    renamed at the end, so a failure never leaves a half-written export; its folders get mode ``0o777 & ~umask``
    and its files ``0o666 & ~umask`` (0755 / 0644 under the usual umask 022), so that another user (a server) can
    read it.

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
            changed since training (see :func:`load_checkpoint_module`).
    """

    ckpt, target = Path(ckpt_path).expanduser(), Path(out).expanduser()
    _check_checkpoint_file(ckpt, "lit-llm export", "--ckpt_path")
    if target.exists() and not overwrite:
        raise FileExistsError(f"lit-llm export: {str(target)!r} already exists; choose another --out or pass "
                              f"--overwrite true.")
    module = load_checkpoint_module(ckpt)
    model = module.model
    if callable(getattr(model, "merge_and_unload", None)):  # LoRA: a plain HF model with the adapters folded in
        model = model.merge_and_unload()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        module.tokenizer.save_pretrained(tmp)
        _umask_permissions(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _check_checkpoint_file(ckpt: Path, who: str, option: str) -> None:
    if not ckpt.is_file():
        raise FileNotFoundError(f"{who}: checkpoint {str(ckpt)!r} not found; pass {option} "
                                f"<run dir>/checkpoints/last.ckpt (or another .ckpt written by lit-llm fit).")
    from lit_llm.lightning.checkpointing import check_checkpoint_file  # one line for a bad file (issue 30)

    check_checkpoint_file(ckpt, "lit_llm.lightning.module.PolicyModule", option=option)


def _umask_permissions(root: Path) -> None:
    """Give ``root``, its sub-folders and files the modes a plain ``mkdir`` / ``open`` would (``0o777`` / ``0o666``
    less the process umask): ``tempfile.mkdtemp`` makes 0700 and safetensors may write 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def load_checkpoint_module(ckpt_path: str | os.PathLike, *, who: str = "lit-llm", option: str = "--ckpt_path",
                           map_location: str = "cpu", resolve_environment: bool = False) -> Any:
    """The :class:`~lit_llm.lightning.module.PolicyModule` of a ``lit-llm fit`` checkpoint, in eval mode.

    The module class (``_class_path`` of the checkpoint's hyper-parameters: any ``PolicyModule`` subclass, e.g.
    ``SFTModule`` or ``GRPOModule``) and its arguments are read from the checkpoint's hyper-parameters, the weights
    from its state dict (a weights-only checkpoint is enough). A LoRA checkpoint (``use_peft``) holds only the adapter
    weights: the base model is loaded from its ``model`` option and checked against the recorded identity (path and
    config hash) by :meth:`PolicyModule.on_load_checkpoint`, then the adapters are restored; ``module.model`` is the
    ``PeftModel`` with its adapters enabled (``merge_and_unload()`` gives a plain model, as
    :func:`export_checkpoint` does).

    Args:
        ckpt_path: a ``.ckpt`` file written by ``lit-llm fit``.
        who, option: the command and option named in error messages.
        map_location: where the tensors go (``torch.load``'s argument).
        resolve_environment: import a ``GRPOModule``'s ``environment`` (needed to run episodes). ``False``
            (default): the weights alone, so a checkpoint of an agent run loads from any folder, even where the
            environment's module (e.g. ``my_agent.py`` of the run's folder) is not importable
            (:func:`~lit_llm.lightning.grpo.environment_unresolved`; the saved hyper-parameters are kept as they are).

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist; the base model of a LoRA checkpoint cannot be loaded.
        ValueError: the checkpoint's module class is not a ``PolicyModule``; a LoRA checkpoint whose base model
            changed (both identities named).
    """
    ckpt = Path(ckpt_path).expanduser()
    _check_checkpoint_file(ckpt, who, option)
    from lit_llm.lightning.grpo import environment_unresolved

    cls = _module_class(ckpt)
    with contextlib.nullcontext() if resolve_environment else environment_unresolved():
        module = cls.load_from_checkpoint(str(ckpt), map_location=map_location, weights_only=False)
    module.eval()
    return module


@dataclass
class InferencePolicy:
    """What inference needs from a model or checkpoint (:func:`load_inference_policy`).

    Attributes:
        model: the HF causal LM (eval mode, on the CPU).
        tokenizer: its tokenizer (with the run's chat template, when the run overrode it).
        chat_template_kwargs: the template variables the run rendered with (e.g. ``{"enable_thinking": False}``).
    """

    model: Any
    tokenizer: Any
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def load_inference_policy(name_or_path: str | os.PathLike, *, device: str = "cpu", who: str = "lit-llm",
                          option: str = "--model") -> InferencePolicy:
    """Load a policy for inference from a ``lit-llm fit`` checkpoint (a path ending in ``.ckpt``: the module's
    model, tokenizer and ``chat_template_kwargs``) or from a model name / HF folder / Hub id (as ``model.init_args.
    model`` takes it: ``smollm2-135m-instruct``, ``tiny``, ``lit-llm export``'s folder, ...), in eval mode on
    ``device`` (``"auto"``: CUDA when available, else the CPU).

    Raises:
        FileNotFoundError: a missing checkpoint or an unknown model (the message names ``option``).
        ValueError: a checkpoint not written by a ``PolicyModule``.
    """
    if str(name_or_path).endswith(".ckpt"):
        module = load_checkpoint_module(name_or_path, who=who, option=option)
        policy = InferencePolicy(module.model, module.tokenizer, dict(module.chat_template_kwargs or {}))
    else:
        from lit_llm.lightning.module import load_policy_model

        policy = InferencePolicy(*load_policy_model(str(name_or_path)))
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    policy.model.to(device).eval()
    return policy


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
