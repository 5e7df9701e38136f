"""Export a training checkpoint as a Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` loadable), and
load a checkpoint's module (full weights or LoRA adapters) or a model name's policy for inference (``lit-llm chat``,
``lit-llm evaluate``)."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXPORT_FILES", "InferencePolicy", "check_export_target", "check_writable_folder", "export_checkpoint",
           "export_contents", "load_checkpoint_module", "load_inference_policy", "run_folder"]


#: Names of the files ``lit-llm export`` writes (``save_pretrained`` of the model with safetensors, and of the
#: tokenizer): a folder holding only these (plus weight shards ``model-NNNNN-of-NNNNN.safetensors`` and an
#: ``additional_chat_templates/`` folder of ``.jinja`` files) is a previous export (:func:`export_contents`).
EXPORT_FILES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",  # model
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",  # tokenizer
})
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
_TEMPLATES_DIR = "additional_chat_templates"


def run_folder(ckpt_path: str | os.PathLike) -> Path:
    """The run folder of a checkpoint: the folder that holds ``checkpoints/`` (``RUN`` for
    ``RUN/checkpoints/last.ckpt``: the checkpoint's parent's parent when the parent is named ``checkpoints``), else
    the checkpoint's own folder. Absolute, symlinks resolved."""
    parent = Path(ckpt_path).expanduser().resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def export_contents(folder: str | os.PathLike) -> tuple[bool, list[str]]:
    """Whether ``folder`` holds a previous export, and the entries that are not an export's.

    The rule: every entry is a regular file named in :data:`EXPORT_FILES` or a weight shard
    (``model-00001-of-00002.safetensors``), or the ``additional_chat_templates/`` folder holding only ``.jinja``
    files; and ``config.json``, ``tokenizer_config.json`` and at least one weights file (``model.safetensors`` or a
    shard) are there. An empty folder is not an export (nothing is foreign in it either).

    Returns:
        ``(is_export, foreign)``: ``foreign`` lists the other entries (sorted names, a ``/`` after folders).
    """
    root = Path(folder)
    names, foreign = set(), []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.is_file() and not entry.is_symlink() and (entry.name in EXPORT_FILES or _SHARD.fullmatch(entry.name)):
            names.add(entry.name)
        elif entry.name == _TEMPLATES_DIR and entry.is_dir() and not entry.is_symlink() and all(
                f.is_file() and f.suffix == ".jinja" for f in entry.iterdir()):
            continue
        else:
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    weights = "model.safetensors" in names or any(_SHARD.fullmatch(n) for n in names)
    return (not foreign and weights and {"config.json", "tokenizer_config.json"} <= names), foreign


def check_writable_folder(path: str | os.PathLike, option: str, who: str | None = None) -> None:
    """Refuse a folder to be created under a regular file (``--out file.txt/hf``, ``--trainer.default_root_dir
    notes.md/run``) before anything is loaded or written.

    Args:
        path: the folder (it need not exist).
        option: the option that gave it (``--out``, ``--trainer.default_root_dir``), named in the message.
        who: the command prefixed to the message (``"lit-llm export"``); ``None``: no prefix (the LightningCLI
            commands print ``lit-llm: error:`` before it).

    Raises:
        NotADirectoryError: ``path`` or one of its parents is an existing file that is not a folder (the message
            names ``option``, the path and the file).
    """
    target = Path(path).expanduser().absolute()
    for folder in (target, *target.parents):
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                where = "is a file" if folder == target else f"is under {str(folder)!r}, which is a file"
                raise NotADirectoryError(f"{who + ': ' if who else ''}{option} {str(target)!r} {where}, not a "
                                         f"folder; choose a folder path (or move the file).")
            return


def check_export_target(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """The rules an export ``--out`` must satisfy before anything is loaded, so that an export never destroys:

    * ``out`` neither is nor contains the checkpoint's run folder (:func:`run_folder`), nor lies inside its
      ``checkpoints/`` folder, even with ``overwrite`` (a new folder inside the run, ``RUN/hf``, is fine);
    * no parent of ``out`` is a regular file;
    * an existing ``out`` is replaced only with ``overwrite`` and only when it holds a previous export
      (:func:`export_contents`) or is empty.

    Raises:
        ValueError: ``out`` is or contains the run folder, or lies in its ``checkpoints/`` folder (both paths
            named); ``out`` exists and is not a previous export (its foreign entries, or the export files it lacks,
            named).
        FileExistsError: ``out`` holds a previous export (or is empty) and ``overwrite`` is False.
        NotADirectoryError: ``out`` is, or is under, a regular file.
        OSError: no folder can be created where ``out`` goes (``/proc/x``, a read-only mount): ``--out`` named.
    """
    who = "lit-llm export"
    ckpt = Path(ckpt_path).expanduser()
    target, run = Path(out).expanduser().resolve(), run_folder(ckpt)
    shown, ckpt_shown = str(Path(out).expanduser().absolute()), str(ckpt.absolute())
    fix = f"choose an --out outside it, e.g. {str(run / 'hf')!r} or {str(run.parent / (run.name + '-hf'))!r}"
    if run == target or run.is_relative_to(target):
        raise ValueError(f"{who}: --out {shown!r} {'is' if run == target else 'contains'} the run folder "
                         f"{str(run)!r} of --ckpt_path {ckpt_shown!r}; writing there would replace the run's "
                         f"checkpoints and logs, so it is refused even with --overwrite. Fix: {fix}.")
    ckpt_dir = run / "checkpoints"
    if ckpt.expanduser().resolve().parent == ckpt_dir and target.is_relative_to(ckpt_dir):
        raise ValueError(f"{who}: --out {shown!r} is inside the checkpoint folder {str(ckpt_dir)!r} of --ckpt_path "
                         f"{ckpt_shown!r}; refused even with --overwrite. Fix: {fix}.")
    check_writable_folder(target, "--out", who)
    _probe_writable(target, shown, who)
    if not target.exists():
        return
    is_export, foreign = export_contents(target)
    empty = not any(target.iterdir())
    if not is_export and not empty:
        if foreign:
            reason = "it holds " + ", ".join(repr(f) for f in foreign[:5]) + (
                f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        else:
            names = {e.name for e in target.iterdir()}
            lacks = [n for n in ("config.json", "tokenizer_config.json") if n not in names]
            if not any(n == "model.safetensors" or _SHARD.fullmatch(n) for n in names):
                lacks.append("model.safetensors")
            reason = "it lacks " + ", ".join(repr(n) for n in lacks)
        raise ValueError(f"{who}: --out {shown!r} exists and is not a previous export: {reason}; "
                         f"--overwrite replaces only a folder written by lit-llm export (config.json, model "
                         f"safetensors, tokenizer files, nothing else). Fix: choose another --out, or move those "
                         f"files away yourself.")
    if not overwrite:
        held = "exists (empty)" if empty else "holds a previous export"
        raise FileExistsError(f"{who}: --out {shown!r} {held}; choose another --out or pass --overwrite true to "
                              f"replace it.")


def _probe_writable(target: Path, shown: str, who: str) -> None:
    """Make and remove an empty folder where the export's temporary sibling will go (the nearest existing folder
    above ``target``), so that a place nobody can write (``/proc``, a read-only mount, another user's folder) is
    named as ``--out`` before the checkpoint is loaded, not as the hidden temporary path.

    Raises:
        OSError: the folder cannot be written (the message names ``--out``, the folder and the reason).
    """
    base = next(p for p in (target.parent, *target.parent.parents) if p.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=base))
    except OSError as e:
        raise OSError(f"{who}: --out {shown!r}: cannot create a folder in {str(base)!r} ({e.strerror or e}); "
                      f"choose an --out you can write to.") from None


def export_checkpoint(ckpt_path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write the policy model and tokenizer of a Lightning checkpoint as an HF folder.

    A LoRA checkpoint (``use_peft``) is merged: the adapters are folded into the base weights (``peft``'s
    ``merge_and_unload``, ``W + (lora_alpha / lora_r) * B A``), so the folder is a plain HF model (no ``peft`` needed
    to load it) with the adapted model's outputs.

    The module is rebuilt by :func:`load_checkpoint_module`. ``out`` is checked first (:func:`check_export_target`:
    never the run folder or around it, an existing folder replaced only when it holds a previous export and
    ``overwrite`` is set). The folder is written to a temporary sibling (``.<name>.tmp-*``) and moved into place only
    when complete; a previous export is first renamed aside (``.<name>.old-*``) and deleted once the new one is in
    place, so an error at any point leaves the previous export (or nothing), never a half-written folder. Its folders
    get mode ``0o777 & ~umask`` and its files ``0o666 & ~umask`` (0755 / 0644 under the usual umask 022), so that
    another user (a server) can read it.

    Args:
        ckpt_path: a ``.ckpt`` file written by ``lit-llm fit`` (e.g. ``runs/x/checkpoints/last.ckpt``).
        out: the folder to create (``config.json``, ``model.safetensors``, ``generation_config.json``, tokenizer
            files).
        overwrite: replace ``out`` if it holds a previous export.

    Returns:
        ``out`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``ckpt_path`` does not exist.
        CheckpointFileError: ``ckpt_path`` is a folder (named, with the ``.ckpt`` in it to give instead) or a bad
            file (:func:`~lit_llm.lightning.checkpointing.check_checkpoint_file`).
        FileExistsError: ``out`` holds a previous export (or is an empty folder) and ``overwrite`` is False.
        NotADirectoryError: ``out`` is, or is under, a regular file.
        OSError: ``out``'s place cannot be written, or writing the export failed (disk full): ``--out`` named.
        ValueError: ``out`` is, contains or sits in the checkpoint folder of the checkpoint's run folder; ``out``
            exists and is not a previous export; the checkpoint's module class is not a ``PolicyModule``; a LoRA
            checkpoint whose base model changed since training (see :func:`load_checkpoint_module`).
    """

    ckpt, target = Path(ckpt_path).expanduser(), Path(out).expanduser()
    _check_checkpoint_file(ckpt, "lit-llm export", "--ckpt_path")
    check_export_target(ckpt, target, overwrite=overwrite)
    module = load_checkpoint_module(ckpt)
    model = module.model
    if callable(getattr(model, "merge_and_unload", None)):  # LoRA: a plain HF model with the adapters folded in
        model = model.merge_and_unload()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        model.save_pretrained(tmp, safe_serialization=True)
        module.tokenizer.save_pretrained(tmp)
        _umask_permissions(tmp)
        check_export_target(ckpt, target, overwrite=overwrite)  # nothing foreign arrived meanwhile
        _move_into_place(tmp, target)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not str(e).startswith("lit-llm export: "):  # the user's --out, not the tmp
            raise OSError(f"lit-llm export: --out {str(target.absolute())!r}: writing the export failed "
                          f"({e.strerror or e}); nothing was left there (a previous export is kept). Fix: free "
                          f"space or choose an --out you can write to.") from e
        raise
    return target


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename the complete folder ``tmp`` to ``target``; a previous ``target`` is renamed aside first, restored if
    the rename fails, and deleted only once ``target`` is the new folder."""
    if not target.exists():
        tmp.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()  # a free name beside target
    target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _check_checkpoint_file(ckpt: Path, who: str, option: str) -> None:
    from lit_llm.lightning.checkpointing import CheckpointFileError, check_checkpoint_file, check_not_a_plain_folder
    from lit_llm.lightning.sharded_checkpoint import looks_like_distributed_checkpoint

    if ckpt.is_dir():  # one line naming the folder (and the .ckpt in it), not "not found"
        if looks_like_distributed_checkpoint(ckpt):  # sharded training's folder: checked here (a damaged one is one
            check_checkpoint_file(ckpt, "lit_llm.lightning.module.PolicyModule", option=option)  # line), then
            return  # consolidated where it is loaded
        check_not_a_plain_folder(ckpt, option)
        raise CheckpointFileError(f"{option} {ckpt}: a DeepSpeed checkpoint folder; {who} reads one .ckpt file: "
                                  f"consolidate it first (DeepSpeed's zero_to_fp32.py).")
    if not ckpt.is_file():
        raise FileNotFoundError(f"{who}: checkpoint {str(ckpt)!r} not found; pass {option} "
                                f"<run dir>/checkpoints/last.ckpt (or another .ckpt written by lit-llm fit).")
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
    :func:`export_checkpoint` does). A ``GRPOModule`` trained with ``use_vllm`` is loaded with ``use_vllm: false``
    (inference samples with the module's own model; vLLM need not be installed).

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
    from lit_llm.lightning.sharded_checkpoint import checkpoint_file

    with checkpoint_file(ckpt) as file:  # a distributed checkpoint folder (sharded training): consolidated first
        cls = _module_class(file)
        # a run trained with use_vllm loads without vLLM: inference here samples with the trained model itself
        params = inspect.signature(cls.__init__).parameters  # (and its vllm_* options at their defaults: unused)
        overrides = {k: False if k == "use_vllm" else p.default for k, p in params.items()
                     if k.startswith(("use_vllm", "vllm_"))}
        with contextlib.nullcontext() if resolve_environment else environment_unresolved():
            module = cls.load_from_checkpoint(str(file), map_location=map_location, weights_only=False, **overrides)
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
        FileNotFoundError: a missing checkpoint, a path-like name that does not exist (``runs/nope``: "no such
            folder", not a Hub download hint) or an unknown model (the message names ``option``).
        ValueError: a checkpoint not written by a ``PolicyModule``.
    """
    if str(name_or_path).endswith(".ckpt"):
        module = load_checkpoint_module(name_or_path, who=who, option=option)
        policy = InferencePolicy(module.model, module.tokenizer, dict(module.chat_template_kwargs or {}))
    else:
        from lit_llm.lightning.module import load_policy_model

        _check_path_like(str(name_or_path), who, option)
        policy = InferencePolicy(*load_policy_model(str(name_or_path)))
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    policy.model.to(device).eval()
    return policy


def _check_path_like(name: str, who: str, option: str) -> None:
    """Refuse a model given as a path that does not exist (``runs/nope``, ``./hf``, ``/abs/x``, ``~/m``), before
    :func:`~lit_llm.models.load_model` would take it for a Hub id ("not in the HF cache, `hf download runs/nope`").
    Path-like: absolute, starting with ``.`` or ``~``, two or more ``/``, or a first component that is a folder here
    (``runs/`` exists); ``org/name`` with no local ``org/`` stays a Hub id.

    Raises:
        FileNotFoundError: the path does not exist (the message names it, the nearest existing folder and the fix).
    """
    path = Path(name).expanduser()
    parts = Path(name).parts
    path_like = (path.is_absolute() or name.startswith((".", "~")) or name.count("/") >= 2 or os.sep != "/"
                 and os.sep in name or (len(parts) > 1 and Path(parts[0]).is_dir()))
    if not path_like or path.exists():
        return
    base = next((p for p in path.absolute().parents if p.is_dir()), None)
    raise FileNotFoundError(f"{who}: {option} {name!r}: no such folder ({str(path.absolute())!r} does not exist; "
                            f"{str(base)!r} does). Give a folder written by lit-llm export, a .ckpt written by "
                            f"lit-llm fit, or a model name / Hub id.")


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
