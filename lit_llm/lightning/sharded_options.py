"""``--trainer.strategy`` for sharded training, checked by ``lit-llm`` before any process is launched
(docs/distributed.md, "Sharded training (FSDP2)"):

* :func:`resolve_strategy`: the bare class name ``--trainer.strategy ModelParallelStrategy`` (which Lightning's
  ``Trainer`` would take as a registered strategy name and refuse) becomes the class with its default options;
  FSDP1 (``fsdp``, ``fsdp_cpu_offload``, ``FSDPStrategy``) is refused, naming ``ModelParallelStrategy`` (FSDP2).
* :func:`check_model_parallel_sizes`: ``data_parallel_size x tensor_parallel_size`` must be the number of processes
  (``trainer.devices x trainer.num_nodes``; Lightning raises it inside every launched process) and the tensor-parallel
  size 1 (lit-llm shards with data-parallel FSDP2 only), ``auto`` sizes resolved as Lightning resolves them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDP1_NAMES", "MODEL_PARALLEL", "check_model_parallel_sizes", "is_model_parallel", "resolve_strategy",
           "resolve_strategy_config", "strategy_class_path"]

#: The class path of Lightning's FSDP2 strategy (what ``lit-llm`` shards with).
MODEL_PARALLEL = "lightning.pytorch.strategies.ModelParallelStrategy"
#: Lightning's registered strategy names for FSDP1's ``FSDPStrategy`` (refused by :func:`resolve_strategy`).
FSDP1_NAMES = ("fsdp", "fsdp_cpu_offload")
_SIZES = ("--trainer.strategy.data_parallel_size", "--trainer.strategy.tensor_parallel_size")


def strategy_class_path(strategy: Any) -> str | None:
    """The class path of a ``trainer.strategy`` config value: a ``class_path`` mapping / namespace as given, a string
    that names a class (``ModelParallelStrategy``, ``lightning.pytorch.strategies.FSDPStrategy``, any case) as
    ``lightning.pytorch.strategies.<Name>``, a registered FSDP1 name (:data:`FSDP1_NAMES`) as ``FSDPStrategy``'s;
    ``None`` for other strings (``auto``, ``ddp``) and instances."""
    if isinstance(strategy, str):
        name = strategy.rpartition(".")[2].lower()
        if strategy.lower() in FSDP1_NAMES or name == "fsdpstrategy":
            return "lightning.pytorch.strategies.FSDPStrategy"
        return MODEL_PARALLEL if name == "modelparallelstrategy" else None
    get = getattr(strategy, "get", None)
    path = get("class_path") if callable(get) else getattr(strategy, "class_path", None)
    return path if isinstance(path, str) else None


def is_model_parallel(strategy: Any) -> bool:
    """Whether a ``trainer.strategy`` config value is ``ModelParallelStrategy`` (sharded training): its name (any
    case), a ``class_path`` of it or of a subclass, or an instance. A class path that does not import is ``False``
    (the ``Trainer`` reports it)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return True
    path = strategy_class_path(strategy) or ""
    if path.rpartition(".")[2] == "ModelParallelStrategy":
        return True
    if "." not in path:
        return False
    import importlib

    module, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, ModelParallelStrategy)


def resolve_strategy(strategy: Any) -> Any:
    """The ``trainer.strategy`` config value to build: ``{"class_path": MODEL_PARALLEL}`` for the bare class name (its
    sizes ``auto``, checked by :func:`check_model_parallel_sizes`), ``strategy`` itself otherwise.

    Raises:
        ValueError: FSDP1 (``FSDPStrategy``, by name or class path): one line naming ``ModelParallelStrategy`` and its
            two size options.
    """
    path = strategy_class_path(strategy)
    if path is not None and path.rpartition(".")[2] == "FSDPStrategy":
        shown = strategy if isinstance(strategy, str) else path
        raise ValueError(f"--trainer.strategy {shown}: FSDP1 (FSDPStrategy) is not supported; lit-llm shards with "
                         f"FSDP2 (ModelParallelStrategy). Fix: --trainer.strategy ModelParallelStrategy "
                         f"{_SIZES[0]} <devices> {_SIZES[1]} 1.")
    if isinstance(strategy, str) and path == MODEL_PARALLEL:
        return {"class_path": MODEL_PARALLEL}
    return strategy


def _shown_devices(given: Any, devices: int) -> str:
    """``--trainer.devices`` as the user gave it, with what it resolved to when that is not the same number
    (``auto (1 device here)``, ``-1 (4 devices here)``, ``[0, 1] (2 devices here)``)."""
    if given is None or str(given).strip() == str(devices):
        return f"--trainer.devices {devices}"
    shown = "[" + ", ".join(map(str, given)) + "]" if isinstance(given, (list, tuple)) else str(given)
    return f"--trainer.devices {shown} ({devices} device{'s' if devices != 1 else ''} here)"


def check_model_parallel_sizes(trainer: Any, config: Any) -> None:
    """Under ``ModelParallelStrategy`` (``trainer.strategy``), refuse sizes that do not fit the processes, or a
    tensor-parallel size above 1, before any process is launched. ``auto`` sizes are Lightning's: data parallel =
    ``trainer.num_nodes``, tensor parallel = ``trainer.num_devices`` (the devices per node).

    Args:
        trainer: the built ``Trainer`` (``strategy``, ``num_devices``, ``num_nodes`` are read).
        config: the ``trainer`` section of the parsed config (a mapping or ``None``): its ``strategy``'s
            ``init_args`` (the sizes as given, ``auto`` kept) and ``devices`` as given (shown with what it resolved
            to: ``--trainer.devices auto (1 device here)``).

    Raises:
        ValueError: one line naming ``--trainer.devices`` and the two size options, with the values to give.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(trainer.strategy, ModelParallelStrategy):
        return
    config = config if callable(getattr(config, "get", None)) else {}
    strategy = config.get("strategy")
    init = (strategy.get("init_args") if callable(getattr(strategy, "get", None)) else None) or {}
    given = [init.get("data_parallel_size", "auto"), init.get("tensor_parallel_size", "auto")]
    devices, nodes = trainer.num_devices, trainer.num_nodes
    dp, tp = (nodes if given[0] == "auto" else int(given[0]), devices if given[1] == "auto" else int(given[1]))
    world = devices * nodes
    shown = f"{_SIZES[0]} {given[0]} x {_SIZES[1]} {given[1]}" + (f" (= {dp} x {tp})" if "auto" in given else "")
    nodes_shown = f" x --trainer.num_nodes {nodes}" if nodes > 1 else ""
    fix = f"Fix: {_SIZES[0]} {world} {_SIZES[1]} 1"
    if dp * tp != world:
        raise ValueError(f"{_shown_devices(config.get('devices'), devices)}{nodes_shown} makes {world} "
                         f"process{'es' if world != 1 else ''}, but {shown} is a mesh of {dp * tp}. {fix}"
                         + (f", or --trainer.devices {dp // nodes}." if tp == 1 and dp % nodes == 0 else "."))
    if tp > 1:
        why = f" (Lightning's default: the {tp} devices per node)" if given[1] == "auto" else ""
        raise ValueError(f"{_SIZES[1]} {given[1]}{why}: lit-llm shards with data-parallel FSDP2 only, not tensor "
                         f"parallel. {fix}.")


def resolve_strategy_config(config: Any, parser: Any) -> Any:
    """``config`` (LightningCLI's parsed config, with or without a subcommand) with its ``trainer.strategy`` passed
    through :func:`resolve_strategy` (re-parsed by ``parser`` when it changes, so the saved ``config.yaml`` holds the
    class and its options). Raises what :func:`resolve_strategy` raises."""
    sub = config.get("subcommand")
    trainer = (config[sub] if sub else config).get("trainer")
    strategy = trainer.get("strategy") if trainer is not None else None
    new = resolve_strategy(strategy)
    if new is strategy:
        return config
    return parser.parse_object({sub: {"trainer": {"strategy": new}}} if sub else {"trainer": {"strategy": new}},
                               config)
