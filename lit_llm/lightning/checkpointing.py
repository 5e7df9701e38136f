"""Checkpoint hooks of the policy modules (:class:`CheckpointHooks`, a mixin of
:class:`~lit_llm.lightning.module.PolicyModule`): what a checkpoint records besides the weights (optimizer classes,
every rank's generator states, the LoRA record with the frozen base weights left out), the checks a resume makes
against it (LoRA base and settings, optimizer class, a configured lr the checkpoint overrides) and the restore of the
generator states before the first resumed step."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_llm.lightning.rng_state import gather_rng_states, restore_rng_states
from lit_llm.models import base_model_identity

__all__ = ["CheckpointHooks"]


class CheckpointHooks:
    """Checkpoint hooks of a policy module (reads its ``model``, ``model_config``, ``trainer``, ``global_rank``)."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the optimizer classes (``"lit_llm_optimizers"``), so that a resume can name a changed one, and every
        rank's generator states (``"lit_llm_rng_states"``, :mod:`lit_llm.lightning.rng_state`: LoRA's dropout masks
        continue as in the uninterrupted run).

        With ``use_peft``: drop the frozen base weights from ``checkpoint["state_dict"]`` (the adapters, which are the
        only trained weights, and the module's counters stay; the optimizer state covers the adapters only) and
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
        for key in [k for k in state if k.startswith("model.") and k not in trainable]:
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
        before the first resumed step), refuse another optimizer class, warn about a configured lr that the
        checkpoint overrides.

        Lightning restores the checkpoint's optimizer state, param groups included, into the optimizer this run
        built; another class then fails at its first step (e.g. ``KeyError: 'momentum'``) and a changed ``lr`` is
        silently replaced by the saved one.

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
            configured = opt.defaults.get("lr")
            for g in opt.param_groups:
                restored = g.get("initial_lr", g.get("lr"))
                if configured is not None and restored is not None and not math.isclose(
                        float(configured), float(restored), rel_tol=1e-9, abs_tol=0.0):
                    rank_zero_warn(
                        f"The configured learning rate {configured} is ignored on resume: Lightning restored the "
                        f"checkpoint's optimizer state, whose lr is {restored}. To train on with another lr, start a "
                        f"new run from the exported weights, or use an lr_scheduler.")
                    break


def _same_model_path(a: str, b: str) -> bool:
    """Two ``model`` options name the same base: equal strings, or two paths of one existing folder."""
    from pathlib import Path

    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()
