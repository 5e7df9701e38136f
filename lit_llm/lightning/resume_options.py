"""What a resume does with an option that differs from the checkpoint's (issue 30 item 4): the user's value wins,
either **applied** (resuming with it is sound: the restored weights, optimizer moments, loop and data position stay
valid, and the run keeps optimising the same objective) or **refused** (one line naming the option, the checkpoint's
value and the fix) -- never silently replaced by the checkpoint's.

:data:`RESUME_OPTIONS` is the one table; :func:`check_resume_options` reads it for the module's options
(``model.init_args.*``, compared with the checkpoint's ``hyper_parameters`` by ``lit-llm fit/validate --ckpt_path``,
:meth:`lit_llm.lightning.cli.LitLLMCLI._parse_ckpt_path`), and
:meth:`~lit_llm.lightning.checkpointing.CheckpointHooks.on_train_start` applies the ``optimizer`` / ``lr_scheduler``
rows (a new ``lr`` reaches the restored optimizer). The ``trainer.*`` rows are Lightning's own behaviour (the
checkpoint does not hold them), listed so that the table is the whole answer. An option of the module that the table
does not list is refused (never silently replaced; add it to the table).

Options the user did not give (neither in ``--config`` nor on the command line) take the checkpoint's value.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from lit_llm.cli_errors import CLIConfigError

__all__ = ["APPLIED", "REFUSED", "RESUME_OPTIONS", "ResumeOptionError", "check_resume_options", "check_run_options",
           "resume_policy", "saved_run_options"]

APPLIED: Literal["applied"] = "applied"
REFUSED: Literal["refused"] = "refused"

_OBJECTIVE = "the objective the run optimises"
_SAME_NUMBERS = "how it is computed, not what (same numbers up to float rounding)"

#: ``option -> (APPLIED | REFUSED, why)``. Keys are the module's options (``model.init_args.<key>``) and, with a
#: section prefix, the optimizer, scheduler and Trainer options.
RESUME_OPTIONS: dict[str, tuple[Literal["applied", "refused"], str]] = {
    # -- the model and its weights
    "model": (REFUSED, "the base weights and tokenizer the checkpoint's weights (or LoRA adapters) were trained on"),
    "dtype": (REFUSED, "the weights' dtype and the optimizer state's"),
    "attn_implementation": (APPLIED, f"the attention kernel: {_SAME_NUMBERS}"),
    "chat_template": (REFUSED, "how every conversation is rendered into the trained tokens"),
    "chat_template_kwargs": (REFUSED, "how every conversation is rendered into the trained tokens"),
    "use_peft": (REFUSED, "full weights vs LoRA adapters: what the checkpoint holds"),
    "lora_r": (REFUSED, "the adapters' shapes"),
    "lora_alpha": (REFUSED, "the adapters' scale (the trained update would change meaning)"),
    "lora_target_modules": (REFUSED, "which layers have adapters"),
    "lora_dropout": (APPLIED, "a regularisation knob of the adapters' input"),
    "gradient_checkpointing": (APPLIED, f"activation recomputation: {_SAME_NUMBERS}"),
    "chunk_size": (APPLIED, f"the log-prob kernel's chunking: {_SAME_NUMBERS}"),
    "lm_head_matmul_dtype": (APPLIED, "the LM-head matmul dtype of the log-prob kernel: a precision knob (log-probs "
                                      "within bf16 rounding), nothing checkpointed depends on it"),
    # -- SFT objective
    "loss": (REFUSED, f"the loss head: {_OBJECTIVE}"),
    "normalization": (REFUSED, f"the loss's denominator: {_OBJECTIVE}"),
    "kl_coef": (REFUSED, f"the KL term and its reference model (built from the initial weights): {_OBJECTIVE}"),
    "token_accuracy": (APPLIED, "a logged metric"),
    # -- optimisation
    "grad_clip": (APPLIED, "an optimisation knob"),
    "on_nonfinite": (APPLIED, "what a NaN/inf step does"),
    "optimizer": (REFUSED, "the optimizer class: its restored state belongs to the class (checked at fit start)"),
    "optimizer.init_args": (APPLIED, "optimizer knobs (lr, betas, weight_decay, ...): set on the restored "
                                     "optimizer's param groups; a new lr also rescales the scheduler's base lrs"),
    "lr_scheduler.init_args": (APPLIED, "scheduler knobs: set on the restored scheduler (its step count kept)"),
    # -- GRPO objective and rollouts
    "reward_funcs": (REFUSED, f"the rewards: {_OBJECTIVE}"),
    "reward_weights": (REFUSED, f"the rewards' weights: {_OBJECTIVE}"),
    "env_reward_weight": (REFUSED, f"the environment reward's weight: {_OBJECTIVE}"),
    "num_generations": (REFUSED, "the group size: the batch of prompts per step and the advantages' groups"),
    "max_new_tokens": (REFUSED, f"the completion budget (what is truncated): {_OBJECTIVE}"),
    "temperature": (REFUSED, f"the sampling and scoring temperature of the policy: {_OBJECTIVE}"),
    "top_p": (REFUSED, f"the sampling distribution: {_OBJECTIVE}"),
    "top_k": (REFUSED, f"the sampling distribution: {_OBJECTIVE}"),
    "loss_type": (REFUSED, f"the loss's reduction: {_OBJECTIVE}"),
    "objective": (REFUSED, f"the loss: {_OBJECTIVE}"),
    "epsilon": (REFUSED, f"the clip range: {_OBJECTIVE}"),
    "epsilon_high": (REFUSED, f"the clip range: {_OBJECTIVE}"),
    "beta": (REFUSED, f"the KL term and its reference model (built from the initial weights): {_OBJECTIVE}"),
    "scale_rewards": (REFUSED, f"the advantages' scaling: {_OBJECTIVE}"),
    "advantage_estimator": (REFUSED, f"the advantages: {_OBJECTIVE}"),
    "importance_sampling_level": (REFUSED, f"the policy ratio (token / sequence): {_OBJECTIVE}"),
    "entropy_coef": (REFUSED, f"the entropy bonus: {_OBJECTIVE}"),
    "mask_truncated_completions": (REFUSED, f"which completions are trained: {_OBJECTIVE}"),
    "rollout_correction": (REFUSED, f"the importance weights: {_OBJECTIVE}"),
    "rollout_correction_clip_max": (REFUSED, f"the importance weights: {_OBJECTIVE}"),
    "rollout_correction_clip_min": (REFUSED, f"the importance weights: {_OBJECTIVE}"),
    "num_iterations": (REFUSED, "optimizer steps per rollout batch: the loop's step and data accounting"),
    "environment": (REFUSED, f"the task (episodes, tools, reward): {_OBJECTIVE}"),
    "max_turns": (REFUSED, f"the episodes' length: {_OBJECTIVE}"),
    "max_tool_calling_iterations": (REFUSED, f"the episodes' length: {_OBJECTIVE}"),
    "max_episode_tokens": (REFUSED, f"the episodes' token budget: {_OBJECTIVE}"),
    "dynamic_sampling": (APPLIED, "which zero-signal groups are resampled (their loss is zero either way)"),
    "max_sampling_rounds": (APPLIED, "the cap of dynamic sampling's resampling rounds"),
    "tool_timeout": (APPLIED, "a time limit on tool calls"),
    "reward_timeout": (APPLIED, "a runtime safety limit on reward-function calls (a row that hits it scores None, "
                                "counted); nothing of it is checkpointed"),
    "env_timeout": (APPLIED, "a runtime safety limit on an environment's reset / step (a step that hits it ends its "
                             "episode, a reset is an error); nothing of it is checkpointed"),
    "old_log_probs": (APPLIED, f"the ratio's denominator, rollout vs recomputed: {_SAME_NUMBERS}"),
    "micro_batch_size": (APPLIED, f"rows per forward/backward: {_SAME_NUMBERS} (the step's normaliser is global)"),
    "share_prompts": (APPLIED, f"prompt sharing in the forward pass: {_SAME_NUMBERS}"),
    "batching": (APPLIED, f"rollout workers sharing forward passes: {_SAME_NUMBERS}"),
    "rollout_workers": (APPLIED, "rollout threads"),
    "rollout_mode": (APPLIED, "when rollouts are produced (sync / async); nothing of it is checkpointed"),
    "sync_every": (APPLIED, "async: steps between weight copies"),
    "max_staleness": (APPLIED, "async: the oldest rollout used"),
    "rollout_seed": (APPLIED, "the sampling seeds of the rollouts after the resume (they then differ from an "
                              "uninterrupted run's)"),
    "use_vllm": (APPLIED, "which engine samples the rollouts (vLLM or the trained model; the engine gets the restored "
                          "weights at fit start); nothing of it is checkpointed"),
    **{f"vllm_{name}": (APPLIED, "a setting of the vLLM engine (built at setup, given the restored weights); nothing "
                                 "of it is checkpointed")
       for name in ("mode", "gpu_memory_utilization", "max_model_length", "tensor_parallel_size", "enable_sleep_mode",
                    "enforce_eager", "kv_cache_gib")},
    # -- evaluation and logging
    "eval_reward_funcs": (APPLIED, "evaluation"),
    "eval_max_new_tokens": (APPLIED, "evaluation"),
    "eval_samples": (APPLIED, "evaluation"),
    "log_samples_every": (APPLIED, "logging"),
    "num_logged_samples": (APPLIED, "logging"),
    # -- data (``data.init_args.*``, compared with the checkpoint's ``datamodule_hyper_parameters`` by ``fit``).
    # The restored data position is a count of the current epoch's steps, and each epoch's plan (which rows, in
    # which order, cut into which steps) is a function of these options: any of them changed would make the resumed
    # epoch skip or repeat rows (or train other ones), so they are refused. A new ``batch_size`` would be sound only
    # if the position were kept in rows and the row order did not depend on it (SFT groups rows by length in windows
    # of batch_size x length_group_steps); it also changes what one optimizer step means (lr, normaliser).
    **dict.fromkeys([f"data.{k}" for k in (
        "path", "format", "task", "limit", "num_samples", "num_train", "low", "high", "ops", "template",
        "rename_columns", "string_prompts", "on_bad_row", "seed", "group_by_length", "length_group_steps",
        "eval_path", "eval_fraction", "eval_limit", "num_eval", "val_path", "val_fraction", "val_limit",
        "tokenizer")], (REFUSED, "which rows are trained and in which order: the restored data position counts "
                                 "steps of the checkpoint's epoch plan")),
    **dict.fromkeys([f"data.{k}" for k in ("system_prompt", "chat_template", "max_length", "max_prompt_length",
                                           "loss_head")],
                    (REFUSED, f"how the rows are rendered, cut or dropped: {_OBJECTIVE}")),
    "data.batch_size": (REFUSED, "the rows per optimizer step: the restored data position counts steps of this "
                                 "size (a new size would skip or repeat rows of the epoch) and an optimizer step "
                                 "would mean another amount of data"),
    "data.micro_batch_size": (APPLIED, f"rows per forward/backward: {_SAME_NUMBERS} (the step's normaliser is "
                                       f"global)"),
    "data.packing": (APPLIED, f"rows packed into one sequence per micro-batch: {_SAME_NUMBERS}"),
    "data.eval_batch_size": (APPLIED, "evaluation"),
    "data.num_workers": (APPLIED, "data-loading processes"),
    "seed_everything": (REFUSED, "the seed of the run's random generators; a resume restores the checkpoint's "
                                 "generator states (exact resume), so a new seed would not take effect"),
    # -- Trainer options (not in the checkpoint: Lightning applies them)
    "trainer.max_steps": (APPLIED, "the run continues to the new max_steps (a value <= the checkpoint's step ends "
                                   "it at once)"),
    "trainer.val_check_interval": (APPLIED, "evaluation cadence"),
    "trainer.log_every_n_steps": (APPLIED, "logging"),
    "trainer.default_root_dir": (APPLIED, "where logs and new checkpoints go"),
}


def resume_policy(option: str) -> tuple[Literal["applied", "refused"], str]:
    """``(APPLIED | REFUSED, why)`` for a module option (``model.init_args.<option>``; a ``section.key`` for the
    others); an option the table does not list is refused."""
    return RESUME_OPTIONS.get(option, (REFUSED, "not classified for resuming (lit_llm.lightning.resume_options."
                                                "RESUME_OPTIONS does not list it)"))


class ResumeOptionError(CLIConfigError):
    """An option given for a resume that differs from the checkpoint's and cannot be applied (one line; a
    ``ValueError``)."""


def _plain(value: Any) -> Any:
    """Config values as plain Python for comparison (jsonargparse Namespaces as dicts, tuples as lists)."""
    if hasattr(value, "as_dict") and callable(value.as_dict):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_resume_options(saved: Mapping[str, Any], given: Mapping[str, Any], *, ckpt_path: Any,
                         prefix: str = "model.init_args.", table: str = "") -> tuple[dict[str, Any], list[str]]:
    """Compare the options a resumed run was given with the checkpoint's (:data:`RESUME_OPTIONS`).

    Args:
        saved: the checkpoint's ``hyper_parameters`` (keys starting with ``_`` are Lightning's and skipped).
        given: the module options the user set (config file or command line; not the defaults).
        ckpt_path: the checkpoint, named in the message.
        prefix: how the options are written in the message.
        table: how they are written in :data:`RESUME_OPTIONS` (``"data."`` for the data options).

    Returns:
        ``(kept, applied)``: ``kept`` are the checkpoint's values of the options not given (the run uses them, as
        LightningCLI does); ``applied`` one line per given option that differs and is applied
        (``"model.init_args.X: NEW (the checkpoint's: OLD)"``).

    Raises:
        ResumeOptionError: a given option differs from the checkpoint's and is :data:`REFUSED` (the first such one, in
            the checkpoint's order): ``"--ckpt_path P: model.init_args.X NEW differs from the checkpoint's OLD; X is
            <why>, so the run cannot resume with a new value. Fix: ..."``.
    """
    kept: dict[str, Any] = {}
    applied: list[str] = []
    for key, old in saved.items():
        if key.startswith("_"):
            continue
        if key not in given:
            kept[key] = old
            continue
        new = given[key]
        if _plain(new) == _plain(old):
            continue
        policy, why = resume_policy(table + key)
        if policy == APPLIED:
            applied.append(f"{prefix}{key}: {_show(_plain(new))} (the checkpoint's: {_show(_plain(old))})")
            continue
        raise ResumeOptionError(
            f"--ckpt_path {ckpt_path}: {prefix}{key} {_show(_plain(new))} differs from the checkpoint's "
            f"{_show(_plain(old))}; {key} is {why}, so the run cannot resume with a new value. Fix: resume with "
            f"{key}: {_show(_plain(old))} (or give it nowhere), or start a new run from the checkpoint's weights: "
            f"lit-llm export --ckpt_path {ckpt_path} --out DIR, then --model.init_args.model DIR without --ckpt_path.")
    return kept, applied


def saved_run_options(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """What a ``lit-llm fit`` checkpoint records of the run besides the module's options: ``{"data": the data
    module's hyper-parameters, "seed_everything": the global seed}`` (each left out when the checkpoint lacks it:
    written by a plain Trainer, or before the seed was recorded by :class:`~lit_llm.lightning.cli.LitLLMSaveConfig`).
    Read with ``torch.load(mmap=True)`` (no tensor data is read); of a sharded checkpoint folder, its ``meta.pt``
    (:func:`~lit_llm.lightning.sharded_checkpoint.checkpoint_meta`: no shard read)."""
    import zipfile

    import torch

    from lit_llm.lightning.sharded_checkpoint import checkpoint_meta

    if os.path.isdir(ckpt_path):
        ckpt = checkpoint_meta(ckpt_path) if os.path.isfile(os.path.join(ckpt_path, "meta.pt")) else {}
    else:
        ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=False, mmap=zipfile.is_zipfile(ckpt_path))
    out: dict[str, Any] = {}
    if ckpt.get("datamodule_hyper_parameters"):
        out["data"] = dict(ckpt["datamodule_hyper_parameters"])
    seed = (ckpt.get("callbacks") or {}).get("LitLLMSaveConfig", {}).get("seed_everything")
    if isinstance(seed, int) and not isinstance(seed, bool):
        out["seed_everything"] = seed
    return out


#: SFTDataModule's deprecated aliases (its hyper-parameters hold the value under the new name).
_DATA_ALIASES = {"val_path": "eval_path", "val_fraction": "eval_fraction", "val_limit": "eval_limit"}


def check_run_options(ckpt_path: str | os.PathLike, given: Mapping[str, Any]) -> list[str]:
    """:func:`check_resume_options` for the options of a ``fit`` resume outside the module: ``given`` holds the
    user's ``"data"`` options (``data.init_args.*``; a data module of another class is not compared) and
    ``"seed_everything"`` (compared when both are integers: ``true``, a new random seed each run, is not a value).

    Returns:
        One line per applied option (``"data.init_args.X: NEW (the checkpoint's: OLD)"``).

    Raises:
        ResumeOptionError: a refused option differs (see :data:`RESUME_OPTIONS`).
    """
    saved = saved_run_options(ckpt_path)
    seed = given.get("seed_everything")
    if "seed_everything" in saved and isinstance(seed, int) and not isinstance(seed, bool):
        check_resume_options({"seed_everything": saved["seed_everything"]}, {"seed_everything": seed},
                             ckpt_path=ckpt_path, prefix="")
    data, old = given.get("data") or {}, saved.get("data") or {}
    same_class = str(old.get("_class_path", "")).rpartition(".")[2] == str(data.get("class_path", "")).rpartition(
        ".")[2]
    init = dict(data.get("init_args") or {})
    for alias, name in _DATA_ALIASES.items():  # a deprecated alias is saved under its new name
        if init.get(alias) is not None and name not in init:
            init[name] = init.pop(alias)
    if not old or not same_class or not init:
        return []
    return check_resume_options(old, init, ckpt_path=ckpt_path, prefix="data.init_args.", table="data.")[1]
