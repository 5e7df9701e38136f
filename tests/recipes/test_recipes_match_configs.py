"""recipes/*.py are the configs' jobs written out: every setting the config names (and every one it leaves at its
default) is the same in the recipe. Built with the tiny model, never trained.

For each recipe/config pair, ``recipe.build(["--model", "tiny", "--out", DIR])`` gives ``(module, datamodule,
trainer_kwargs)``, compared with the YAML (``yaml.safe_load``):

* ``model.init_args``: each ``__init__`` argument of the module's class equals the config's value, or the class default
  when the config leaves it out (``reward_funcs`` resolved to the functions); the optimizer (and scheduler) factory
  builds the same class with the same defaults as the config's ``class_path``/``init_args``;
* ``data.init_args``: the same against the data module's ``hparams``;
* ``trainer``: each key equals ``trainer_kwargs[key]`` (``precision`` resolved as the CLI resolves it: ``auto`` is
  ``bf16-mixed`` or ``32-true`` depending on the machine); a key the recipe sets that the config does not must be
  Lightning's default;
* ``seed_everything`` (the global seed ``build`` set), ``wandb`` (a ``WandbLogger`` or not), ``checkpoint.*`` and
  ``samples.*`` (the callbacks the CLI adds, with its defaults).

Every mismatch is reported with the config key it concerns; a config key this test does not know fails too.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAIRS = [("grpo.py", "grpo_arithmetic.yaml"), ("sft.py", "sft_gsm8k.yaml")]

# Config keys a recipe deliberately does not copy, with the reason.
EXEMPT = {
    "model.init_args.model": "the test builds the tiny model (--model tiny)",
    "trainer.default_root_dir": "the recipe writes under its --out (runs/recipe_*), next to the CLI's run folder",
}
# Arguments that are not settings of the job (or are compared separately).
NOT_SETTINGS = {"self", "model", "optimizer", "lr_scheduler"}
# What the CLI (lit_llm.lightning.cli.LitLLMCLI) adds to the config's checkpoint section.
CLI_CHECKPOINT_DEFAULTS = {"save_last": True, "save_top_k": 1}
MISSING = object()


def load_recipe(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"recipe_{Path(name).stem}", ROOT / "recipes" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_path(path: str) -> Any:
    """``pkg.mod.Name`` or ``pkg.mod:name`` -> the object."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def normalise(name: str, value: Any) -> Any:
    if name.endswith("reward_funcs") and value is not None:
        return [import_path(v) if isinstance(v, str) else v for v in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def compare_init_args(prefix: str, cls: type, init_args: dict[str, Any], actual: dict[str, Any],
                      problems: list[str]) -> None:
    """Each ``__init__`` argument of ``cls``: ``actual`` (the object's hparams) == config value or class default."""
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for key in init_args:
        if key not in params and key not in NOT_SETTINGS:
            problems.append(f"{prefix}.{key}: in the config, but not an argument of {cls.__name__}")
    for name, param in params.items():
        if name in NOT_SETTINGS:
            continue
        key = f"{prefix}.{name}"
        in_config = name in init_args
        expected = init_args[name] if in_config else param.default
        if key in EXEMPT or expected is inspect.Parameter.empty:
            continue
        got = actual.get(name, MISSING)
        if got is MISSING:
            problems.append(f"{key}: not in {cls.__name__}.hparams (the recipe's value cannot be checked)")
        elif normalise(name, got) != normalise(name, expected):
            where = "config" if in_config else f"config (unset: {cls.__name__} default)"
            problems.append(f"{key}: {where} {expected!r}, recipe {got!r}")


def compare_optimizer(prefix: str, cls: type, init_args: dict[str, Any], module: Any, problems: list[str]) -> None:
    """The module's optimizer factory makes the config's optimizer class with the same defaults (lr, ...)."""
    key = f"{prefix}.optimizer"
    spec = init_args.get("optimizer", MISSING)
    if spec is MISSING:
        spec = inspect.signature(cls.__init__).parameters["optimizer"].default
    if isinstance(spec, str):
        spec = {"class_path": spec}
    if isinstance(spec, dict):
        expected_cls, expected_args = import_path(spec["class_path"]), spec.get("init_args") or {}
    else:  # a class default
        expected_cls, expected_args = spec, {}
    expected = expected_cls([torch.nn.Parameter(torch.zeros(1))], **expected_args)
    got = module.optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    if type(got) is not expected_cls:
        problems.append(f"{key}.class_path: config {expected_cls.__name__}, recipe {type(got).__name__}")
        return
    for name in sorted(set(expected.defaults) | set(got.defaults)):
        want, have = expected.defaults.get(name, MISSING), got.defaults.get(name, MISSING)
        if want != have:
            where = "config" if name in expected_args else f"config (unset: {expected_cls.__name__} default)"
            problems.append(f"{key}.init_args.{name}: {where} {want!r}, recipe {have!r}")


def compare_lr_scheduler(prefix: str, init_args: dict[str, Any], module: Any, problems: list[str]) -> None:
    key = f"{prefix}.lr_scheduler"
    spec = init_args.get("lr_scheduler")
    factory = getattr(module, "lr_scheduler_factory", None)
    if spec is None:
        if factory is not None:
            problems.append(f"{key}: config none, recipe {factory!r}")
        return
    if factory is None:
        problems.append(f"{key}: config {spec!r}, recipe none")
        return
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    got = factory(optimizer)
    expected_cls = import_path(spec["class_path"])
    if type(got) is not expected_cls:
        problems.append(f"{key}.class_path: config {expected_cls.__name__}, recipe {type(got).__name__}")
    for name, value in (spec.get("init_args") or {}).items():
        if getattr(got, name, MISSING) != value:
            problems.append(f"{key}.init_args.{name}: config {value!r}, recipe {getattr(got, name, MISSING)!r}")


def compare_callback(section: str, cls: type, settings: dict[str, Any], callbacks: list[Any],
                     problems: list[str]) -> Any:
    found = [cb for cb in callbacks if isinstance(cb, cls)]
    if len(found) != 1:
        problems.append(f"{section}: the recipe has {len(found)} {cls.__name__} callbacks, expected 1")
        return None
    callback = found[0]
    for name, value in settings.items():
        got = getattr(callback, name, getattr(callback, f"_{name}", MISSING))
        if got is MISSING:
            problems.append(f"{section}.{name}: {cls.__name__} has no attribute {name!r}")
        elif got != value:
            problems.append(f"{section}.{name}: config {value!r}, recipe {got!r}")
    return callback


def compare_trainer(config: dict[str, Any], trainer_kwargs: dict[str, Any], out: Path, problems: list[str]) -> None:
    from lightning.pytorch import Trainer

    from lit_llm.lightning.precision import resolve_precision

    for name, value in config.items():
        key = f"trainer.{name}"
        if key in EXEMPT:
            continue
        if name == "precision":  # what the CLI gives the Trainer (LitLLMCLI.before_instantiate_classes)
            value = resolve_precision(value, config.get("accelerator", "auto"), warn=False)
        if name not in trainer_kwargs:
            problems.append(f"{key}: in the config ({value!r}), not set by the recipe")
        elif trainer_kwargs[name] != value:
            problems.append(f"{key}: config {value!r}, recipe {trainer_kwargs[name]!r}")
    defaults = inspect.signature(Trainer.__init__).parameters
    for name, value in trainer_kwargs.items():
        if name in config or name in ("logger", "callbacks", "default_root_dir"):
            continue
        if name not in defaults:
            problems.append(f"trainer.{name}: set by the recipe, not a Trainer argument")
        elif value != defaults[name].default:
            problems.append(f"trainer.{name}: not in the config (Trainer default {defaults[name].default!r}), "
                            f"recipe {value!r}")
    if Path(trainer_kwargs.get("default_root_dir", "")) != out:
        problems.append(f"trainer.default_root_dir: recipe {trainer_kwargs.get('default_root_dir')!r}, not its --out")


@pytest.mark.parametrize(("recipe_file", "config_file"), PAIRS)
def test_recipe_matches_config(recipe_file, config_file, tmp_path, monkeypatch):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from lit_llm.lightning.callbacks import StepCheckpoint, ValidationSamples

    cfg = yaml.safe_load((ROOT / "configs" / config_file).read_text())
    recipe = load_recipe(recipe_file)
    out = tmp_path / "run"
    monkeypatch.setenv("PL_GLOBAL_SEED", "-1")  # build() must set it (restored after the test)
    module, data, trainer_kwargs = recipe.build(["--model", "tiny", "--out", str(out)])
    problems: list[str] = []

    for section, obj in (("model", module), ("data", data)):
        spec = cfg.get(section) or {}
        cls = import_path(spec["class_path"])
        if type(obj) is not cls:
            problems.append(f"{section}.class_path: config {cls.__name__}, recipe {type(obj).__name__}")
        init_args = spec.get("init_args") or {}
        compare_init_args(f"{section}.init_args", cls, init_args, dict(obj.hparams), problems)
        if section == "model":
            compare_optimizer("model.init_args", cls, init_args, obj, problems)
            compare_lr_scheduler("model.init_args", init_args, obj, problems)

    compare_trainer(cfg.get("trainer") or {}, trainer_kwargs, out, problems)
    Trainer(**trainer_kwargs)  # the keyword arguments are a valid Trainer

    loggers = trainer_kwargs.get("logger")
    loggers = loggers if isinstance(loggers, list) else [loggers]
    callbacks = trainer_kwargs.get("callbacks") or []
    for top, value in cfg.items():
        if top in ("model", "data", "trainer"):
            continue
        if top == "seed_everything":
            if os.environ.get("PL_GLOBAL_SEED") != str(value):
                problems.append(f"seed_everything: config {value!r}, recipe seeded {os.environ.get('PL_GLOBAL_SEED')}")
        elif top == "wandb":
            has = any(isinstance(lg, WandbLogger) for lg in loggers)
            if has != bool(value):
                problems.append(f"wandb: config {value!r}, recipe {'has' if has else 'has no'} WandbLogger")
            if not any(isinstance(lg, CSVLogger) for lg in loggers):
                problems.append("wandb: the CLI always logs to CSV; the recipe has no CSVLogger")
        elif top == "checkpoint":
            ckpt = compare_callback("checkpoint", StepCheckpoint, {**CLI_CHECKPOINT_DEFAULTS, **(value or {})},
                                    callbacks, problems)
            if ckpt is not None and Path(ckpt.dirpath).resolve() != (out / "checkpoints").resolve():
                problems.append(f"checkpoint.dirpath: the CLI writes to <root>/checkpoints, recipe {ckpt.dirpath}")
        elif top == "samples":
            settings = {n: p.default for n, p in inspect.signature(ValidationSamples.__init__).parameters.items()
                        if n != "self"} | (value or {})
            if settings["num_samples"] == 0 and not any(isinstance(cb, ValidationSamples) for cb in callbacks):
                continue  # disabled in the config, left out by the recipe
            compare_callback("samples", ValidationSamples, settings, callbacks, problems)
        else:
            problems.append(f"{top}: a config key this test does not check (and the recipe may not honour)")

    assert not problems, f"recipes/{recipe_file} disagrees with configs/{config_file}:\n  " + "\n  ".join(problems)
