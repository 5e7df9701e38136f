"""Checkpoint hooks of the policy modules (:class:`CheckpointHooks`, a mixin of
:class:`~lit_llm.lightning.module.PolicyModule`): what a checkpoint records besides the weights (optimizer classes,
every rank's generator states, the LoRA record with the frozen base weights left out), the checks a resume makes
against it (LoRA base and settings, optimizer class), the configured optimizer / scheduler knobs applied over the
restored ones and the restore of the generator states before the first resumed step; and
:func:`check_checkpoint_file`, the one-line check of a ``--ckpt_path`` file (empty, truncated, not a checkpoint,
weights-only for ``fit``, another module's) made before Lightning reads it. What a resume does with an option that
differs from the checkpoint's is :mod:`lit_llm.lightning.resume_options`."""

from __future__ import annotations

import copy
import importlib
import inspect
import math
import os
import zipfile
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_llm.cli_errors import CLIConfigError
from lit_llm.lightning.rng_state import gather_rng_states, restore_rng_states
from lit_llm.models import base_model_identity
from lit_llm.policy.sharding import is_sharded

__all__ = ["CheckpointFileError", "CheckpointHooks", "check_checkpoint_file", "check_not_a_plain_folder"]


class CheckpointHooks:
    """Checkpoint hooks of a policy module (reads its ``model``, ``model_config``, ``trainer``, ``global_rank``)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the optimizer classes (``"lit_llm_optimizers"``), so that a resume can name a changed one, and every
        rank's generator states (``"lit_llm_rng_states"``, :mod:`lit_llm.lightning.rng_state`: LoRA's dropout masks
        continue as in the uninterrupted run).

        With ``use_peft``: drop the frozen base weights from ``checkpoint["state_dict"]`` (the adapters, which are the
        only trained weights, and the module's counters stay; the optimizer state covers the adapters only; a sharded
        run keeps them: ``ModelParallelStrategy``'s resume reads every weight from the folder) and
        record ``"lit_llm_peft"``: the base model's identity (:func:`~lit_llm.models.base_model_identity`: the
        ``model`` option and its config hash), the LoRA options and the names of the trained weights. A resume,
        ``validate``, ``lit-llm export`` and :func:`~lit_llm.lightning.export.load_checkpoint_module` reload
        the base from the ``model`` option (:meth:`on_load_checkpoint`)."""
        opts = self.trainer.optimizers if self._trainer is not None else []
        checkpoint["lit_llm_optimizers"] = [f"{type(o).__module__}.{type(o).__qualname__}" for o in opts]
        checkpoint["lit_llm_rng_states"] = gather_rng_states()
        if not self.model_config.use_peft:
            return
        trainable = self._trainable_keys()
        state = checkpoint["state_dict"]
        # sharded (ModelParallelStrategy): kept, its resume reads the whole module's state from the folder
        for key in [k for k in state if k.startswith("model.") and k not in trainable and not is_sharded(self.model)]:
            del state[key]
        c = self.model_config
        checkpoint["lit_llm_peft"] = {
            "base_model": base_model_identity(c.model_name_or_path, self.model),
            "lora": {"lora_r": c.lora_r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                     "lora_target_modules": c.lora_target_modules},
            "trainable": sorted(trainable)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep what :meth:`on_train_start` compares with the optimizer this run configured and the checkpoint's
        step (:attr:`eval_step`); for a LoRA checkpoint,
        check the base model and put this module's (frozen, just loaded) base weights back into
        ``checkpoint["state_dict"]`` so that the strict ``load_state_dict`` that follows restores the adapters.

        Raises:
            ValueError: a LoRA checkpoint loaded into a module without ``use_peft`` or the reverse (both named, with the
                fix); a LoRA checkpoint over another base model (path or config hash differ: both identities named);
                other LoRA settings (rank, alpha or target modules).
        """
        self._resumed_optimizers = (checkpoint.get("lit_llm_optimizers"),
                                    [o.get("param_groups", []) for o in checkpoint.get("optimizer_states", [])])
        self._checkpoint_step = int(checkpoint.get("global_step", 0))
        self._resumed_rng_states = checkpoint.get("lit_llm_rng_states")
        record = checkpoint.get("lit_llm_peft")
        if record is None and not self.model_config.use_peft:
            return
        self._check_peft_checkpoint(record)
        if "state_dict" not in checkpoint:  # a distributed checkpoint (sharded): the strategy loaded the adapters
            return
        state, trainable = checkpoint["state_dict"], self._trainable_keys()
        for key, value in self.state_dict().items():
            if key.startswith("model.") and key not in trainable and key not in state:
                state[key] = value

    def _trainable_keys(self) -> set[str]:
        """State-dict keys (``model.<name>``) of the model's trainable parameters (the LoRA adapters)."""
        return {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}

    def _check_peft_checkpoint(self, record: dict[str, Any] | None) -> None:
        """See :meth:`on_load_checkpoint`."""
        c = self.model_config
        if record is None:
            raise ValueError(
                "model.use_peft is true but the checkpoint holds full weights (written with use_peft false): it has "
                "no LoRA adapters to restore. Resume with use_peft false, or start LoRA from those weights: lit-llm "
                "export the checkpoint and set model: <exported folder> (without --ckpt_path).")
        saved = record["base_model"]
        if not c.use_peft:
            raise ValueError(
                f"The checkpoint holds LoRA adapters over {saved['model_name_or_path']!r} (written with use_peft "
                f"true), but this module has use_peft false. Resume with the checkpoint's model options (use_peft: "
                f"true, {record['lora']}), or merge it with lit-llm export and start a new run from the folder.")
        mine = base_model_identity(c.model_name_or_path, self.model)
        if mine["config_sha256"] != saved["config_sha256"] or not _same_model_path(mine["model_name_or_path"],
                                                                                      saved["model_name_or_path"]):
            raise ValueError(
                f"The LoRA checkpoint was trained on base model {saved['model_name_or_path']!r} (config sha256 "
                f"{saved['config_sha256'][:12]}), but this module loads {mine['model_name_or_path']!r} (config sha256 "
                f"{mine['config_sha256'][:12]}); adapters only make sense over the base they were trained on. Set "
                f"model: {saved['model_name_or_path']} (the same folder, unchanged), or start a new run.")
        theirs, ours = set(record["trainable"]), self._trainable_keys()
        saved_lora = record["lora"]
        if theirs != ours or saved_lora["lora_r"] != c.lora_r or saved_lora["lora_alpha"] != c.lora_alpha:
            now = {"lora_r": c.lora_r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
                   "lora_target_modules": c.lora_target_modules}
            diff = sorted(theirs ^ ours)
            raise ValueError(
                f"The LoRA checkpoint's adapters ({saved_lora}) do not match this module's ({now})"
                + (f": {len(diff)} adapter weights differ, e.g. {diff[:3]}" if diff else "")
                + ". Resume with the checkpoint's lora_r, lora_alpha and lora_target_modules.")

    def on_train_start(self) -> None:
        """After a resume: restore this rank's generator states (:mod:`lit_llm.lightning.rng_state`; last, right
        before the first resumed step), refuse another optimizer class and apply this run's optimizer and scheduler
        knobs over the restored ones (:data:`~lit_llm.lightning.resume_options.RESUME_OPTIONS`:
        ``optimizer.init_args``, ``lr_scheduler.init_args``).

        Lightning restores the checkpoint's optimizer state, param groups included, into the optimizer this run
        built (another class then fails at its first step, e.g. ``KeyError: 'momentum'``), and the scheduler's state
        (its knobs included), replacing what this run configured. So each configured optimizer argument that
        differs from the restored param groups' is set on them -- a new ``lr`` rescales the group's current lr by
        ``new / old`` base lr and sets the scheduler's ``base_lrs`` (a warm-up or decay continues from the same step
        with the new peak) -- and each configured scheduler attribute that differs is set on the scheduler (its step
        count kept); one line says each applied value and the checkpoint's.

        Raises:
            ValueError: the checkpoint was written with another optimizer class (both named) or with param groups
                that lack this optimizer's hyperparameters.
        """
        rng_states, self._resumed_rng_states = getattr(self, "_resumed_rng_states", None), None
        if rng_states and not restore_rng_states(rng_states, self.global_rank, self.trainer.world_size):
            rank_zero_warn(f"The checkpoint's random generator states were saved by {len(rng_states)} process(es), "
                           f"this run has {self.trainer.world_size}: they are not restored, so anything drawn from "
                           f"the global generators (LoRA dropout masks) differs from the uninterrupted run.")
        saved = getattr(self, "_resumed_optimizers", None)
        if saved is None:
            return
        self._resumed_optimizers = None
        names, groups = saved
        for i, opt in enumerate(self.trainer.optimizers):
            mine = f"{type(opt).__module__}.{type(opt).__qualname__}"
            theirs = names[i] if names and i < len(names) else None
            missing = sorted(set(opt.defaults) - set(groups[i][0])) if i < len(groups) and groups[i] else []
            if (theirs is not None and theirs != mine) or missing:
                was = theirs or f"an optimizer whose param groups lack {missing}"
                raise ValueError(
                    f"Resuming with optimizer {mine}, but the checkpoint was written by {was}; its optimizer state "
                    f"cannot be restored into {mine}. Resume with the checkpoint's optimizer "
                    f"(model.init_args.optimizer), or start a new run from the weights "
                    f"(lit-llm export, then model: <exported folder>).")
            schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs if c.scheduler.optimizer is opt]
            for line in _apply_optimizer_knobs(opt, schedulers):
                rank_zero_info(f"Resuming with {line}")
        configured = getattr(self, "_configured_scheduler_states", [])
        for config, state in zip(self.trainer.lr_scheduler_configs, configured):
            for line in _apply_scheduler_knobs(config.scheduler, state):
                rank_zero_info(f"Resuming with {line}")


#: Optimizer arguments that are implementation flags, not knobs (never compared on resume).
_NOT_KNOBS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
#: Scheduler state that is progress (kept from the checkpoint), not a knob.
_SCHEDULER_PROGRESS = frozenset({"last_epoch", "_step_count", "_last_lr", "base_lrs", "_get_lr_called_within_step",
                                 "_is_initial", "verbose", "lr_lambdas", "_schedulers", "optimizer"})


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b)


def _apply_optimizer_knobs(opt: Any, schedulers: list[Any]) -> list[str]:
    """Set the configured arguments of ``opt`` (``opt.defaults``) on its restored param groups where they differ;
    a new ``lr`` rescales each group's current lr and sets ``initial_lr`` and the schedulers' ``base_lrs``. Returns
    one line per applied knob."""
    lines: list[str] = []
    for key, value in opt.defaults.items():
        if key in _NOT_KNOBS:
            continue
        for j, group in enumerate(opt.param_groups):
            old = group.get("initial_lr", group.get(key)) if key == "lr" else group.get(key)
            if old is None or not _differs(value, old):
                continue
            if key == "lr":
                scale = float(value) / float(old) if float(old) else None
                group["lr"] = group["lr"] * scale if scale is not None else value
                if "initial_lr" in group:
                    group["initial_lr"] = value
                for scheduler in schedulers:
                    if hasattr(scheduler, "base_lrs") and j < len(scheduler.base_lrs):
                        scheduler.base_lrs[j] = value
                    if getattr(scheduler, "_last_lr", None) and j < len(scheduler._last_lr):
                        scheduler._last_lr[j] = group["lr"]
            else:
                group[key] = value
            if j == 0:
                lines.append(f"optimizer {key}={value!r} (the checkpoint's: {old!r}; now applied to the restored "
                             f"optimizer{', current lr ' + repr(group['lr']) if key == 'lr' else ''})")
    return lines


def _apply_scheduler_knobs(scheduler: Any, configured: dict[str, Any]) -> list[str]:
    """Set the configured scheduler attributes (from its ``state_dict()`` before the restore) that differ from the
    restored ones, keeping its progress (step count, last lrs, base lrs). Returns one line per applied knob."""
    lines: list[str] = []
    restored = scheduler.state_dict()
    for key, value in configured.items():
        if key in _SCHEDULER_PROGRESS or key not in restored or not _differs(value, restored[key]):
            continue
        setattr(scheduler, key, copy.deepcopy(value))
        lines.append(f"lr_scheduler {key}={value!r} (the checkpoint's: {restored[key]!r})")
    return lines


def _same_model_path(a: str, b: str) -> bool:
    """Two ``model`` options name the same base: equal strings, or two paths of one existing folder."""
    from pathlib import Path

    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


class CheckpointFileError(CLIConfigError):
    """A ``--ckpt_path`` file that cannot be used; ``str()`` is one line: ``"--ckpt_path PATH: what is wrong. Fix."``
    (a ``ValueError``)."""


#: The first bytes of the files ``torch.save`` writes: a zip archive (the default since torch 1.6) or the legacy
#: pickle (protocol 2 header).
_ZIP_MAGIC, _PICKLE_MAGIC = b"PK\x03\x04", b"\x80\x02"


def _what_it_is(head: bytes, path: Path) -> str:
    """A guess at what a file that is not a torch checkpoint is, from its first bytes and its name."""
    if path.suffix == ".safetensors" or (len(head) > 9 and head[8:10] == b'{"'):
        return ("a safetensors file (model weights, not a Lightning checkpoint); to start a run from a Hugging Face "
                "model give its folder as --model.init_args.model FOLDER, without --ckpt_path")
    fix = "; give a .ckpt written by lit-llm fit (<run dir>/checkpoints/last.ckpt)"
    if head.lstrip()[:1] in (b"{", b"["):
        return "a JSON/text file, not a checkpoint" + fix
    return f"not a checkpoint written by torch.save (it starts with {head[:8]!r})" + fix


def _expected_class(expected_module: str | type | None) -> type | None:
    if expected_module is None or isinstance(expected_module, type):
        return expected_module
    module_name, _, name = str(expected_module).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


def _same_class(saved: str, expected: type | None, expected_name: str) -> bool:
    """Whether the class path ``saved`` names ``expected`` or a subclass of it (two import paths of one class count as
    the same)."""
    if saved == expected_name:
        return True
    found = _expected_class(saved)
    return expected is not None and isinstance(found, type) and issubclass(found, expected)


def check_checkpoint_file(path: str | os.PathLike, expected_module: str | type | None = None, *,
                          resumable: bool = False, option: str = "--ckpt_path") -> dict[str, Any]:
    """Check a checkpoint file cheaply before Lightning loads it, so that a bad file is one line naming it.

    Reads the first bytes (the ``torch.save`` zip or legacy pickle header), the zip's central directory (a truncated
    file has none) and the checkpoint's top-level keys with ``torch.load(mmap=True)`` (no tensor data is read).

    Args:
        path: the ``--ckpt_path`` file. A distributed checkpoint folder (``ModelParallelStrategy`` / FSDP: one
            that :func:`~lit_llm.lightning.sharded_checkpoint.looks_like_distributed_checkpoint`) is checked by
            :func:`~lit_llm.lightning.sharded_checkpoint.check_distributed_checkpoint` (files present and whole,
            no shard read) and its ``meta.pt``'s hyper-parameters checked and returned as a file's are; a DeepSpeed
            folder (a ``checkpoint/`` sub-folder) is returned as ``{}`` unchecked; any other folder is refused
            (:func:`check_not_a_plain_folder`).
        expected_module: the run's module (a class or its class path, e.g. ``model.class_path``); a checkpoint
            written by another module class is refused. Checkpoints without a recorded class (written outside
            ``lit-llm fit``) are refused when their hyperparameters are not options of ``expected_module`` (or of one
            of its subclasses).
        resumable: ``fit`` resumes from it: a weights-only checkpoint (no ``optimizer_states``) is refused.
        option: the option named in the messages.

    Returns:
        The checkpoint's ``hyper_parameters`` (``{}`` when it has none).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointFileError: a folder that is not a sharded checkpoint (the ``.ckpt`` in it named), a damaged
            distributed checkpoint folder (the file named), an empty file,
            a truncated one, a file that is not a torch checkpoint (a safetensors file is named as such), a torch
            file that is not a Lightning checkpoint (no ``state_dict``), a weights-only checkpoint with
            ``resumable``, another module's checkpoint. The message is one line:
            ``"<option> <path>: <what is wrong>. <the fix>"``.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        from lightning.fabric.strategies.deepspeed import _is_deepspeed_checkpoint

        from lit_llm.lightning.sharded_checkpoint import (
            DamagedCheckpointError,
            check_distributed_checkpoint,
            looks_like_distributed_checkpoint,
        )

        if _is_deepspeed_checkpoint(p):
            return {}
        if not looks_like_distributed_checkpoint(p):
            check_not_a_plain_folder(p, option, str(path))
            return {}
        try:
            meta, optimizer_saved = check_distributed_checkpoint(path, option=option)
        except DamagedCheckpointError as e:
            raise CheckpointFileError(str(e)) from None
        hparams = dict(meta.get("hyper_parameters") or {})
        if expected_module is not None:
            _check_module(path, hparams, expected_module, option)
        if resumable and not optimizer_saved:
            raise CheckpointFileError(_weights_only_message(option, path))
        return hparams
    if not p.exists():
        raise FileNotFoundError(f"{option} {path}: no such file; give a .ckpt written by lit-llm fit (e.g. "
                                f"<run dir>/checkpoints/last.ckpt) or {option} last.")
    size = p.stat().st_size
    if size == 0:
        raise CheckpointFileError(f"{option} {path}: the file is empty (0 bytes), e.g. a copy or a save that did not "
                                  f"finish; give another checkpoint (<run dir>/checkpoints/ keeps last.ckpt).")
    with p.open("rb") as f:
        head = f.read(16)
    if not (head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC)):
        raise CheckpointFileError(f"{option} {path}: {_what_it_is(head, p)}.")
    import torch

    zipped = head.startswith(_ZIP_MAGIC)
    if zipped:
        try:
            with zipfile.ZipFile(p) as z:
                if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()):
                    raise CheckpointFileError(f"{option} {path}: a zip archive but not a torch checkpoint (no "
                                              f"data.pkl inside).")
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointFileError(
                f"{option} {path}: the file is truncated or damaged ({size} bytes; {e}), e.g. a save interrupted "
                f"or a copy that did not finish; give another checkpoint (<run dir>/checkpoints/ keeps last.ckpt)."
            ) from None
    try:
        ckpt = torch.load(str(p), map_location="cpu", weights_only=False, mmap=zipped)
    except Exception as e:  # noqa: BLE001  (any unpickling failure is a damaged file)
        raise CheckpointFileError(f"{option} {path}: the file cannot be read as a checkpoint "
                                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            what = ("a bare state_dict (torch.save(model.state_dict())), not a Lightning checkpoint; to start from "
                    "these weights, load them into a Hugging Face folder and give it as --model.init_args.model")
        else:
            keys = sorted(map(str, ckpt))[:6] if isinstance(ckpt, dict) else type(ckpt).__name__
            what = f"a torch file but not a Lightning checkpoint (no 'state_dict'; it holds {keys})"
        raise CheckpointFileError(f"{option} {path}: {what}.")
    hparams = dict(ckpt.get("hyper_parameters") or {})
    if expected_module is not None:
        _check_module(path, hparams, expected_module, option)
    if resumable and "optimizer_states" not in ckpt:
        raise CheckpointFileError(_weights_only_message(option, path))
    return hparams


def _weights_only_message(option: str, path: Any) -> str:
    """The one line refusing to ``fit``-resume from a checkpoint without optimizer state."""
    return (f"{option} {path}: this is a weights-only checkpoint (written with checkpoint.save_weights_only true): it "
            f"has no optimizer state, so fit cannot resume from it. Resume from a full checkpoint "
            f"(checkpoint.save_weights_only false, the default), or start a new run from these weights: lit-llm "
            f"export --ckpt_path {path} --out DIR, then fit with --model.init_args.model DIR.")


def check_not_a_plain_folder(folder: Path, option: str = "--ckpt_path", shown: str | None = None) -> None:
    """Refuse a folder given where a checkpoint file belongs, unless it is a sharded checkpoint that Lightning's
    strategies read (FSDP / ``ModelParallelStrategy``: a ``meta.pt`` file; DeepSpeed: a ``checkpoint/`` sub-folder).

    Raises:
        CheckpointFileError: one line naming the folder (as ``shown``, default ``folder``) and, when it (or its
            ``checkpoints/`` sub-folder, a run folder's) holds ``last.ckpt`` or other ``.ckpt`` files, the file to
            give instead (``last.ckpt`` first, else the newest).
    """
    from lightning.fabric.strategies.deepspeed import _is_deepspeed_checkpoint
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    if _is_sharded_checkpoint(folder) or _is_deepspeed_checkpoint(folder):
        return
    shown = str(folder) if shown is None else shown
    for where in (folder, folder / "checkpoints"):
        found = sorted(where.glob("*.ckpt"), key=lambda f: (f.name != "last.ckpt", -f.stat().st_mtime)) \
            if where.is_dir() else []
        if found:
            rel = os.path.join(shown, os.path.relpath(found[0], folder))
            raise CheckpointFileError(f"{option} {shown}: a folder, not a checkpoint file; give the file, e.g. "
                                      f"{option} {rel}.")
    raise CheckpointFileError(f"{option} {shown}: a folder, not a checkpoint file (nor a sharded FSDP / DeepSpeed "
                              f"checkpoint folder), and it holds no .ckpt file; give a .ckpt written by lit-llm fit "
                              f"(<run dir>/checkpoints/last.ckpt) or {option} last.")


def _check_module(path: Any, hparams: dict[str, Any], expected_module: str | type, option: str) -> None:
    """See :func:`check_checkpoint_file` (``expected_module``)."""
    expected = _expected_class(expected_module)
    name = expected_module if isinstance(expected_module, str) else \
        f"{expected_module.__module__}.{expected_module.__qualname__}"
    saved = hparams.get("_class_path")
    if saved is not None:
        if _same_class(saved, expected, name):
            return
        theirs = saved
    else:
        if expected is None:
            return
        options = sorted(k for k in hparams if not k.startswith("_"))
        classes, alien = [expected], options
        while classes:  # the expected class or one of its subclasses takes every saved option
            cls = classes.pop()
            params = set(inspect.signature(cls.__init__).parameters)
            if not [k for k in options if k not in params]:
                return
            if cls is expected:
                alien = [k for k in options if k not in params]
            classes.extend(cls.__subclasses__())
        theirs = f"another module (its options {alien[:4]} are not {expected.__name__}'s)"
    raise CheckpointFileError(
        f"{option} {path}: a checkpoint of {theirs}, but this run's model is {name}: its weights and training "
        f"state cannot be restored into another module. Use the checkpoint's own config (model.class_path "
        f"{saved or '<its module>'}), or start this module from its weights: lit-llm export --ckpt_path {path} "
        f"--out DIR, then --model.init_args.model DIR without {option}.")
