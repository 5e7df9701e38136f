"""The ``lit-llm`` command: LightningCLI subcommands (``fit``, ``validate``) plus ``export`` and the other extra
commands (examples: ``lit-llm --help``, :func:`lit_llm.cli_front.top_parser`).

Added to LightningCLI's own arguments:

* ``--checkpoint.*``: a :class:`~lit_llm.lightning.callbacks.StepCheckpoint` (a ``ModelCheckpoint`` whose
  ``last.ckpt`` holds the final step) that is always on (``save_last``), writing to
  ``<trainer.default_root_dir>/checkpoints`` so that ``--ckpt_path last`` finds it from any later run. Checkpoints are
  full (resumable) unless ``checkpoint.save_weights_only: true``; ``fit --ckpt_path`` on a weights-only one is an
  error naming that option (:func:`~lit_llm.lightning.checkpointing.check_checkpoint_file` with ``resumable``).
* ``--ckpt_path FILE`` / ``--ckpt_path last`` (:meth:`LitLLMCLI._parse_ckpt_path`): the file is checked before
  Lightning reads it (one line for an empty, truncated or non-checkpoint file, a folder that is not a sharded
  checkpoint or is one without the sharded strategy, or another module's checkpoint); the module options given
  (config or command line) win over the checkpoint's, applied or refused by
  :data:`lit_llm.lightning.resume_options.RESUME_OPTIONS` (never silently replaced, as LightningCLI's own
  ``ckpt_path`` handling does); options not given take the checkpoint's values.
* ``--samples.*``: :class:`~lit_llm.lightning.callbacks.ValidationSamples` (generated answers after validation).
* ``--trainer.precision auto`` (the default; :mod:`lit_llm.lightning.precision`): resolved before the Trainer is
  built to ``bf16-mixed`` where bf16 matmuls are native (CUDA with bf16, CPUs with AVX512-BF16 or AMX) and to
  ``32-true`` elsewhere; one line says what was chosen and why, the saved ``<log dir>/config.yaml`` holds the resolved
  value and the loggers get it as the ``precision`` hyperparameter. Forcing bf16 where it is not native warns.
* a :class:`~lit_llm.lightning.progress.StepProgressBar` (progress over ``max_steps`` with the run's ETA; plain
  flushed lines when stdout is not a terminal) whenever ``trainer.enable_progress_bar`` is true.
* loggers (:func:`default_loggers`): ``trainer.logger`` keeps Lightning's meaning (a logger or a list of them;
  ``false`` = none at all), and beside it ``--csv true`` (the default) always adds a ``CSVLogger`` (``lit-llm plot``
  reads it) and ``--wandb true`` (the default) a ``WandbLogger`` (offline unless ``WANDB_API_KEY`` is set; options
  ``--wandb_project``, ``--wandb_name``, ``--wandb_tags``), all under ``trainer.default_root_dir``.
* ``--trainer.strategy`` (:mod:`lit_llm.lightning.sharded_options`, before any process is launched): the bare
  ``ModelParallelStrategy`` taken as the class; FSDP1 (``fsdp``) refused; sharded sizes checked against the devices.

Subcommands other than LightningCLI's are dispatched by :func:`main` before LightningCLI parses
(:data:`lit_llm.cli_front.EXTRA_COMMANDS`); the console script (:func:`lit_llm.cli_entry.console_main`) answers
``lit-llm --help`` and their ``--help`` without importing torch, then runs :func:`run_console`.

Errors (:mod:`lit_llm.cli_errors`): a bad option is one ``lit-llm: error:`` message naming the option, the allowed
values and a near match (exit status 2); an error a class raises while the run is built (a module's ``ValueError``)
is its own text first, then the option that set it, without a traceback. Options are never abbreviated.
``LIT_LLM_DEBUG=1`` keeps jsonargparse's full message and the traceback.
"""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any

from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn

import lit_llm.lightning.grpo  # noqa: F401  (registers GRPOModule among PolicyModule's subclasses: --model.help)
from lit_llm.cli_errors import CLIConfigError, OneLineErrors, debug_enabled, explain_config_error
from lit_llm.cli_front import EXTRA_COMMANDS, answer_front, front
from lit_llm.lightning.callbacks import StepCheckpoint, ValidationSamples
from lit_llm.lightning.checkpointing import check_checkpoint_file
from lit_llm.lightning.console_errors import print_user_error
from lit_llm.lightning.graceful_stop import stop_exit_code
from lit_llm.lightning.module import PolicyModule, check_manual_optimization_options
from lit_llm.lightning.policy_setup import sharded_init_for_trainer
from lit_llm.lightning.precision import AutoPrecisionTrainer, explain_precision
from lit_llm.lightning.progress import StepProgressBar
from lit_llm.lightning.resume_options import check_resume_options, check_run_options
from lit_llm.lightning.run_folders import remove_unused_log_dirs
from lit_llm.lightning.sharded_checkpoint import check_strategy_reads_it
from lit_llm.lightning.sharded_options import check_model_parallel_sizes, is_model_parallel, resolve_strategy_config
from lit_llm.lightning.sharded_save import replaced_checkpoints, warn_resuming_from_replaced

__all__ = ["CONFIG_ERRORS", "EXTRA_COMMANDS", "USER_ERRORS", "LitLLMArgumentParser", "LitLLMCLI", "LitLLMSaveConfig",
           "checkpoint_dir", "default_loggers", "last_checkpoint", "main", "route_optimizer_options", "run_console"]

# Manual optimisation is deliberate (see lit_llm.lightning.module); a step-N checkpoint holds the weights after N steps.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def checkpoint_dir(default_root_dir: str | None) -> str:
    """Where checkpoints go: ``<default_root_dir>/checkpoints`` (``./checkpoints`` when unset)."""
    return os.path.join(default_root_dir or ".", "checkpoints")


def default_loggers(root: str | None, *, wandb: bool, csv: bool = True, loggers: Sequence[Any] = (),
                    wandb_project: str = "lit-llm", wandb_name: str | None = None,
                    wandb_tags: Sequence[str] | None = None) -> list[Any]:
    """The run's loggers under ``root`` (default ``"."``): a ``CSVLogger`` first (``csv``; ``lit-llm plot`` and the
    completion tables read its folder), then the user's ``loggers`` (``trainer.logger``), then a ``WandbLogger``
    (``wandb``; offline unless ``WANDB_API_KEY`` is set) with ``wandb_project`` / ``wandb_name`` / ``wandb_tags``.
    A CSV or W&B logger among ``loggers`` is not added twice."""
    from lightning.pytorch.loggers import CSVLogger

    root = root or "."
    user = list(loggers)
    out: list[Any] = []
    if csv and not any(isinstance(lg, CSVLogger) for lg in user):
        out.append(CSVLogger(save_dir=root, name="csv"))
    out.extend(user)
    if wandb and not any(type(lg).__name__ == "WandbLogger" for lg in user):
        from lightning.pytorch.loggers import WandbLogger

        offline = not os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") == "offline"
        out.append(WandbLogger(save_dir=root, project=wandb_project, name=wandb_name,
                               tags=list(wandb_tags) if wandb_tags else None, offline=offline))
    return out


def _is_untouched_default(key: str, value: Any) -> bool:
    """Whether the module's ``optimizer`` / ``lr_scheduler`` value is the class default (AdamW with torch's default
    arguments / no scheduler), i.e. nothing the user set."""
    if value is None:
        return True
    if key != "optimizer":
        return False
    import inspect

    import torch

    if getattr(value, "class_path", None) != "torch.optim.AdamW":
        return False
    defaults = {n: p.default for n, p in inspect.signature(torch.optim.AdamW).parameters.items()
                if p.default is not inspect.Parameter.empty}
    given = dict(vars(value.init_args)) if getattr(value, "init_args", None) is not None else {}
    return all(defaults.get(k, object()) == (tuple(v) if isinstance(v, list) else v) for k, v in given.items())


def _describe(value: Any) -> str:
    init = getattr(value, "init_args", None)
    lr = getattr(init, "lr", None) if init is not None else None
    return f"{getattr(value, 'class_path', value)}" + (f" (lr={lr})" if lr is not None else "")


def route_optimizer_options(config: Any) -> None:
    """LightningCLI's top-level ``--optimizer`` / ``--lr_scheduler`` in a lit_llm run.

    lit_llm modules optimise manually over the policy's trainable parameters with the factories given as
    ``model.init_args.optimizer`` / ``model.init_args.lr_scheduler``; LightningCLI's own options would replace the
    module's ``configure_optimizers`` (all parameters, the module's setting dropped with only a warning). So a
    top-level option is moved into the module when the module's is unset (its default: AdamW with torch's defaults /
    no scheduler), and is an error when both are set.

    Raises:
        ValueError: both ``--optimizer`` and ``model.init_args.optimizer`` (or both ``--lr_scheduler`` and
            ``model.init_args.lr_scheduler``) are set; the message names both values and the option to use.
    """
    model = config.get("model")
    init = model.get("init_args") if model is not None and hasattr(model, "get") else None
    if init is None:
        return
    for key in ("optimizer", "lr_scheduler"):
        top = config.get(key)
        if top is None:
            continue
        mine = init.get(key)
        if not _is_untouched_default(key, mine):
            raise ValueError(
                f"--{key} {_describe(top)} and model.init_args.{key} {_describe(mine)} (from the config) both set "
                f"the {key}; lit_llm modules take it from model.init_args.{key}. Give one of them: e.g. "
                f"--model.init_args.{key} {getattr(top, 'class_path', top)} (and --model.init_args.{key}.lr ...), "
                f"or remove {key} from the config's model section.")
        init[key] = top
        config[key] = None


#: The names ``--ckpt_path last`` resumes from (Lightning's ``CHECKPOINT_NAME_LAST``, its version suffix).
LAST_NAME = re.compile(rf"{re.escape(StepCheckpoint.CHECKPOINT_NAME_LAST)}(-v?\d+)?"
                       rf"{re.escape(StepCheckpoint.FILE_EXTENSION)}")


def last_checkpoint(dirpath: str | os.PathLike) -> str | None:
    """The file ``--ckpt_path last`` resumes from: the newest of ``last.ckpt`` / ``last-vN.ckpt`` / ``last-N.ckpt`` in
    ``dirpath`` (Lightning's names, :data:`LAST_NAME`; not ``step=3-last.ckpt``, ``blast.ckpt``), or a missing one's
    ``.last.ckpt.replaced`` (a sharded save killed mid-swap; warned: :mod:`~.sharded_save`); ``None`` when none."""
    names = os.listdir(dirpath) if os.path.isdir(dirpath) else []
    found = [os.path.join(dirpath, n) for n in names if LAST_NAME.fullmatch(n)]
    found += replaced_checkpoints(dirpath, LAST_NAME.fullmatch)
    return warn_resuming_from_replaced(max(found, key=os.path.getmtime)) if found else None


def _init_args(section: Any) -> dict[str, Any]:
    """A ``model`` / ``data`` section's ``init_args`` as a dict (``{}`` when unset)."""
    init = getattr(section, "init_args", None)
    return {} if init is None else dict(vars(init))


class LitLLMSaveConfig(SaveConfigCallback):
    """LightningCLI's ``config.yaml`` writer that also logs the precision the run uses as the ``precision``
    hyperparameter of every logger (``hparams.yaml``, the W&B config), and records the run's ``seed_everything`` in
    its checkpoints (``state_dict``: a resume with another seed is refused,
    :func:`~lit_llm.lightning.resume_options.check_run_options`)."""

    def state_dict(self) -> dict[str, Any]:
        return {"seed_everything": self.config.get("seed_everything")}

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams({"precision": str(trainer.precision)})


#: Errors raised while the run is built (before the subcommand runs) that are reported as one message
#: (:func:`lit_llm.cli_errors.explain_config_error`): bad values a class rejects, missing files, bad class paths.
CONFIG_ERRORS = (ValueError, TypeError, OSError, ImportError, MisconfigurationException)

#: Errors raised while a subcommand runs (``fit``: data read in ``setup``, rewards resolved, options checked at fit
#: start) that are the user's input, not a bug: reported as one message like :data:`CONFIG_ERRORS`
#: (``ValueError`` covers ``DataFormatError``, ``RewardError``, ``CLIConfigError``). Any other exception keeps its
#: traceback.
USER_ERRORS = (ValueError, FileNotFoundError, MisconfigurationException)


class _HeldLogs(logging.Filter):
    """Holds a logger's records (LightningCLI's "Seed set to N", logged before the classes are built) so that a
    build error is the first line of stderr; :meth:`release` re-emits them (``emit``) and detaches."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.held = logging.getLogger(name), []
        self.logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.held.append(record)
        return False

    def release(self, emit: bool) -> None:
        self.logger.removeFilter(self)
        held, self.held = self.held, []
        for record in held if emit else ():
            self.logger.handle(record)


class LitLLMArgumentParser(OneLineErrors, LightningArgumentParser):
    """LightningCLI's parser with one-message errors (:class:`lit_llm.cli_errors.OneLineErrors`), no abbreviations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class LitLLMCLI(LightningCLI):
    """LightningCLI over any :class:`PolicyModule` and any ``LightningDataModule`` (``class_path`` in the config),
    with the always-on checkpoint and validation-samples callbacks, ``trainer.precision: auto``, the default loggers
    and the one-message errors described above.

    Raises:
        CLIConfigError: a :data:`CONFIG_ERRORS` error while the classes are built (unless ``LIT_LLM_DEBUG`` is set);
            its text is the cause's own message, then the option that set it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", AutoPrecisionTrainer)
        kwargs.setdefault("save_config_callback", LitLLMSaveConfig)
        kwargs.setdefault("parser_class", LitLLMArgumentParser)
        self._held_logs = _HeldLogs("lightning.fabric.utilities.seed")
        try:
            super().__init__(*args, **kwargs)
        finally:
            self._held_logs.release(emit=False)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """LightningCLI's, keeping the command line for :meth:`_given_options`; a bare ``--trainer.strategy
        ModelParallelStrategy`` made the class, FSDP1 refused (:func:`~.sharded_options.resolve_strategy_config`)."""
        self._argv = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else None
        super().parse_arguments(parser, args)
        self.config = resolve_strategy_config(self.config, parser)

    def _given_options(self, subcommand: str) -> Any:
        """The options the user set (in ``--config`` files or on the command line, not the defaults), parsed again
        without defaults; the parsed config (every option counts as given) when that parse fails."""
        config = self.config[subcommand]
        if self._argv is None:
            return config
        root = config.get("trainer", {}).get("default_root_dir")
        argv = [*self._argv, "--trainer.default_root_dir", str(root or ".")]  # a link source must be present
        try:
            with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):  # a failure here is not the user's
                return self.parser.parse_args(argv, defaults=False)[subcommand]
        except (SystemExit, Exception):  # noqa: BLE001
            return config

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's (which re-applies the checkpoint's hyperparameters over the command line).

        ``--ckpt_path FILE`` and ``--ckpt_path last`` (the newest ``last.ckpt`` / ``last-vN.ckpt`` under
        ``checkpoint.dirpath``, :func:`last_checkpoint`, written back into the config: the file that runs is the one
        checked; when there is none, ``fit`` warns in one line that it starts a new run from step 0, as Lightning
        does, and ``validate`` is an error): the file is checked before Lightning reads it (one line for an empty,
        truncated, non-checkpoint or weights-only file (``fit``) or another module's checkpoint:
        :func:`~lit_llm.lightning.checkpointing.check_checkpoint_file`; a sharded checkpoint folder without the
        sharded strategy: :func:`~lit_llm.lightning.sharded_checkpoint.check_strategy_reads_it`); then the module
        options given that differ from the checkpoint's are applied or refused
        (:func:`~lit_llm.lightning.resume_options.check_resume_options`, one line per applied option), the others
        take the checkpoint's values; ``fit`` compares the data options and ``seed_everything`` too
        (:func:`~lit_llm.lightning.resume_options.check_run_options`).

        Raises:
            CheckpointFileError, ResumeOptionError, FileNotFoundError, ValueError: one-line messages naming the path
                / option (``FileNotFoundError``: ``validate --ckpt_path last`` and no ``last.ckpt``).
        """
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        ckpt_path = config.get("ckpt_path")
        if ckpt_path == "last":
            trainer_cfg = config.get("trainer") or {}
            dirpath = (config.get("checkpoint") or {}).get("dirpath") or checkpoint_dir(
                trainer_cfg.get("default_root_dir"))
            ckpt_path = last_checkpoint(dirpath)
            if ckpt_path is None and subcommand != "fit":
                raise FileNotFoundError(f"--ckpt_path last: no last.ckpt in {dirpath}, so there is no checkpoint to "
                                        f"{subcommand}; give --ckpt_path FILE, or the --trainer.default_root_dir of "
                                        f"the run that wrote it.")
            if ckpt_path is None:  # Lightning's rule (a requeued job passes `last` from its first run): fit starts
                rank_zero_warn(f"--ckpt_path last: no last.ckpt in {dirpath}, so this fit starts a new run from step "
                               f"0 (to resume another run give its --trainer.default_root_dir or --ckpt_path FILE)")
            config["ckpt_path"] = ckpt_path  # what runs is the file checked here (None: Lightning's hint not repeated)
        elif ckpt_path in ("best", "hpc", "registry") or (ckpt_path and str(ckpt_path).startswith("registry:")):
            return  # Lightning's own lookups
        if not ckpt_path:
            return
        check_strategy_reads_it(ckpt_path, sharded=is_model_parallel((config.get("trainer") or {}).get("strategy")),
                                subcommand=subcommand)  # a sharded checkpoint folder without the sharded strategy
        model = config.get("model")
        class_path = getattr(model, "class_path", None) if model is not None else None
        saved = check_checkpoint_file(ckpt_path, class_path, resumable=subcommand == "fit")
        if not saved or class_path is None:
            return
        current, given = _init_args(model), self._given_options(subcommand)
        kept, applied = check_resume_options(saved, _init_args(given.get("model")), ckpt_path=ckpt_path)
        kept = {k: v for k, v in kept.items() if k in current and current[k] != v}
        if subcommand == "fit":  # the data position and generator states are restored: data options and the seed
            data = given.get("data")
            applied += check_run_options(ckpt_path, {"seed_everything": given.get("seed_everything"), "data": {
                "class_path": getattr(data, "class_path", None), "init_args": _init_args(data)}})
        if kept:
            self.config = self.parser.parse_object(
                {subcommand: {"model": {"class_path": class_path, "init_args": kept}}}, self.config)
        for line in applied:
            rank_zero_only(print)(f"Resuming from {ckpt_path} with {line}", flush=True)

    def after_instantiate_classes(self) -> None:
        """Emit the log lines held while the classes were built (the seed)."""
        self._held_logs.release(emit=True)
        super().after_instantiate_classes()

    @contextmanager
    def _config_errors(self, errors: tuple[type[BaseException], ...] = CONFIG_ERRORS) -> Iterator[None]:
        try:
            yield
        except errors as e:
            if debug_enabled():
                raise
            if isinstance(e, CLIConfigError) and "LIT_LLM_DEBUG" in str(e):  # already explained
                raise
            config = self.config[self.subcommand] if self.subcommand else self.config
            raise CLIConfigError(explain_config_error(e, config)) from e

    def _run_subcommand(self, subcommand: str) -> None:
        """LightningCLI's, with a :data:`USER_ERRORS` error raised while the subcommand runs (bad data read in
        ``setup``, a reward needing a missing column, a Trainer option the module refuses) reported as
        :class:`CLIConfigError`. A run that fails leaves no log folder it logged nothing into
        (:func:`~lit_llm.lightning.run_folders.remove_unused_log_dirs`: Lightning makes ``csv/version_N`` before the
        data module's ``setup``, where a bad data file is found)."""
        try:
            with self._config_errors(USER_ERRORS):
                super()._run_subcommand(subcommand)
        except BaseException:
            trainer = getattr(self, "trainer", None)
            if trainer is not None and trainer.is_global_zero:
                remove_unused_log_dirs(trainer.loggers, root=trainer.default_root_dir,
                                       root_existed=getattr(self, "_root_existed", True))
            raise

    def instantiate_classes(self) -> None:
        """LightningCLI's, a class's error reported as :class:`CLIConfigError`; under ``ModelParallelStrategy``
        in :func:`~lit_llm.lightning.policy_setup.sharded_init` (ranks other than 0 build on the meta device)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        with self._config_errors(), sharded_init_for_trainer(config.get("trainer")):  # ModelParallelStrategy
            super().instantiate_classes()

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(StepCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1})
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.add_lightning_class_args(ValidationSamples, "samples")
        parser.add_argument("--wandb", type=bool, default=True,
                            help="Add a WandbLogger (offline without WANDB_API_KEY) beside trainer.logger.")
        parser.add_argument("--wandb_project", type=str, default="lit-llm", help="W&B project of the WandbLogger.")
        parser.add_argument("--wandb_name", type=str | None, default=None,
                            help="W&B run name (default: W&B's generated name).")
        parser.add_argument("--wandb_tags", type=list[str] | None, default=None, help="W&B run tags.")
        parser.add_argument("--csv", type=bool, default=True,
                            help="Always add a CSVLogger under trainer.default_root_dir/csv (lit-llm plot reads it).")

    def before_instantiate_classes(self) -> None:
        """Resolve ``trainer.precision`` (``auto``) in the parsed config, so that the Trainer and the saved
        ``config.yaml`` both get the concrete value, and say what was chosen; route LightningCLI's top-level
        ``--optimizer`` / ``--lr_scheduler`` into the module (:func:`route_optimizer_options`); refuse a
        ``--trainer.default_root_dir`` under a regular file (:func:`~lit_llm.lightning.export.check_writable_folder`),
        before anything is built or written."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        with self._config_errors():
            route_optimizer_options(config)
        trainer_cfg = config.get("trainer")
        if trainer_cfg is None:
            return
        from lit_llm.lightning.export import check_writable_folder
        with self._config_errors():
            check_writable_folder(trainer_cfg.get("default_root_dir") or ".", "--trainer.default_root_dir")
        self._root_existed = os.path.exists(trainer_cfg.get("default_root_dir") or ".")
        precision, line = explain_precision(trainer_cfg.get("precision"), trainer_cfg.get("accelerator"))
        trainer_cfg["precision"] = precision
        rank_zero_only(print)(line, flush=True)

    def before_fit(self) -> None:
        """Refuse Trainer options that manual optimisation does not use, before Lightning's own, less helpful check
        (:func:`~lit_llm.lightning.module.check_manual_optimization_options`)."""
        check_manual_optimization_options(self.trainer)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer, with the default loggers (above), a :class:`~.progress.StepProgressBar` unless disabled or
        configured, and the sharded sizes checked (:func:`~.sharded_options.check_model_parallel_sizes`)."""
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        callbacks = trainer_cfg.get("callbacks")
        callbacks = list(callbacks) if isinstance(callbacks, list) else ([] if callbacks is None else [callbacks])
        if trainer_cfg.get("enable_progress_bar") is not False and "callbacks" not in kwargs and not any(
                isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        logger = trainer_cfg.get("logger")
        if logger is not False and "logger" not in kwargs:  # False keeps Lightning's meaning: no logger at all
            user = [] if logger in (None, True) else list(logger) if isinstance(logger, list) else [logger]
            kwargs["logger"] = default_loggers(
                trainer_cfg.get("default_root_dir"), loggers=user, csv=bool(self._get(self.config, "csv", True)),
                wandb=bool(self._get(self.config, "wandb", True)),
                wandb_project=self._get(self.config, "wandb_project", "lit-llm"),
                wandb_name=self._get(self.config, "wandb_name"), wandb_tags=self._get(self.config, "wandb_tags"))
        trainer = super().instantiate_trainer(**kwargs)  # no process launched yet
        check_model_parallel_sizes(trainer, self._get(self.config, "trainer"))
        return trainer


def main(args: Sequence[str] | None = None) -> LitLLMCLI | None:
    """Entry point of ``lit-llm`` (the console script is :func:`lit_llm.cli_entry.console_main`).

    Args:
        args: the command line without the program name (default ``sys.argv[1:]``).

    Returns:
        The :class:`LitLLMCLI` for LightningCLI subcommands, ``None`` for the extra commands (``export``, ``plot``).

    Raises:
        SystemExit: 0 after ``--help``; 2 for a bad option or value (one ``lit-llm: error:`` message on stderr).
        CLIConfigError: an error raised while the run is built (a ``ValueError``; the console script prints its
            text as ``lit-llm: error: ...`` and exits 2).
    """
    argv = list(sys.argv[1:] if args is None else args)
    if front(argv):
        return None
    return LitLLMCLI(PolicyModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                     args=None if args is None else argv, save_config_kwargs={"overwrite": True},
                     parser_kwargs={"prog": "lit-llm", "description": "lit-llm: LLM post-training on Lightning. "
                                    "Extra subcommands: " + "; ".join(f"`lit-llm {k}`: {c.summary}"
                                                                      for k, c in EXTRA_COMMANDS.items())})


def run_console() -> None:
    """:func:`main` for the console script: a :data:`USER_ERRORS` error is printed as one ``lit-llm: error: ...``
    message (:func:`~.console_errors.print_user_error`: no traceback; once for a refusal all ranks raise) and exits
    with status 2 on every rank, unless ``LIT_LLM_DEBUG`` is set (then it is raised); a fit stopped by ``SIGTERM`` /
    ``SIGINT`` (:class:`~lit_llm.lightning.graceful_stop.GracefulStop`) exits with status 143 / 130."""
    try:
        cli = main()
    except USER_ERRORS as e:
        if debug_enabled():
            raise
        print_user_error(e)
        raise SystemExit(2) from None
    except SIGTERMException:  # Lightning's own stop (a SIGTERM before training started): not status 0
        raise SystemExit(128 + signal.SIGTERM) from None
    code = stop_exit_code(cli.trainer if cli is not None else None)
    if code is not None:  # SIGTERM / SIGINT stopped the fit (GracefulStop): 143 / 130, after a clean end
        raise SystemExit(code)


def console_main() -> None:
    """:func:`lit_llm.cli_entry.console_main` (the ``lit-llm`` script), kept for ``python -m lit_llm.lightning.cli``
    and installs whose script still names this function."""
    if answer_front(sys.argv[1:]):
        return
    run_console()


if __name__ == "__main__":
    console_main()
