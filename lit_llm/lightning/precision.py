"""``trainer.precision: auto``: the precision that is fast on the machine the job runs on.

Whether bf16 pays off depends on the hardware, not on the model, and the two cases differ by an order of magnitude
(measured on 2-core cloud CPUs, see ``DESIGN.md`` "Memory and speed" and ``benchmarks/README.md``):

* CPUs with AVX512-BF16 (or AMX) run a bf16 matmul about **4x faster** than fp32 (~850 vs ~204 GFLOP/s on 2 cores),
  and ``bf16-mixed`` made SFT / GRPO steps 1.5-2x faster;
* on an AVX2-only AMD EPYC (no AVX-512, no AVX512-BF16: common on servers and laptops) bf16 is emulated and a
  ``bf16-mixed`` SmolLM2-135M forward+backward was about **5x slower** than fp32 (4 x 128 tokens: 146 s vs 29 s), which
  turned the 8-minute GRPO demo into a 30-minute run of 3 steps (issue 13);
* CUDA GPUs from Ampere (compute capability 8.0) on run bf16 natively; older ones emulate it.

So ``auto`` resolves, before the ``Trainer`` is built, to ``bf16-mixed`` where bf16 matmuls are native and to
``32-true`` elsewhere (:func:`resolve_precision`); forcing ``bf16-mixed`` / ``bf16-true`` where they are not native
warns. :class:`AutoPrecisionTrainer` is the ``Trainer`` whose ``precision`` argument also accepts ``"auto"`` (the
``lit-llm`` CLI's ``trainer_class``, so that LightningCLI's parser accepts the value).

The CPU checks honour the variables used to emulate an AVX2 machine on an AVX-512 one
(``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``): with either capping below bf16, ``auto`` picks ``32-true``.
"""

import os
import typing
from typing import Any, Literal

import torch
from jsonargparse.typing import register_type
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import Trainer

__all__ = ["PRECISION_VALUES", "AutoPrecisionTrainer", "PrecisionInput", "bf16_support", "explain_precision",
           "resolve_precision"]


def _literal_values(hint: Any) -> list[Any]:
    if typing.get_origin(hint) is Literal:
        return list(typing.get_args(hint))
    return [v for arg in typing.get_args(hint) for v in _literal_values(arg)]


_FIRST = ("auto", "32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")
_LIGHTNING_VALUES = _literal_values(typing.get_type_hints(Trainer.__init__)["precision"])
#: Every value ``trainer.precision`` accepts: ``"auto"`` and Lightning's own (``"32-true"``, ``"bf16-mixed"``, ...,
#: the short forms ``32`` / ``"32"`` / ``"bf16"``, ...), the usual ones first.
PRECISION_VALUES: tuple[Any, ...] = (*_FIRST, *[v for v in _LIGHTNING_VALUES if v not in _FIRST])


class PrecisionInput:
    """The type of :class:`AutoPrecisionTrainer`'s ``precision`` for jsonargparse (LightningCLI's parser): a value of
    :data:`PRECISION_VALUES` or ``None`` (Lightning's default, ``32-true``). Registered with
    ``jsonargparse.typing.register_type`` so that a bad value is one error line listing the allowed values (a
    ``Literal`` of strings and ints reports the failed ``int`` conversion instead)."""


def _not_a_precision(value: Any) -> Any:
    _check(value)
    return value


register_type(PrecisionInput, serializer=lambda value: value, deserializer=_not_a_precision,
              type_check=lambda value, _: value is None or value in PRECISION_VALUES)

_BF16 = ("bf16", "bf16-mixed", "bf16-true")
_FP16_MIXED = ("16", "16-mixed")  # str() of Lightning's spellings of fp16 AMP (16, "16", "16-mixed")
# oneDNN ISAs (ONEDNN_MAX_CPU_ISA) without bf16 dot products; ATEN_CPU_CAPABILITY values below AVX-512.
_ONEDNN_NO_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ATEN_NO_BF16 = {"default", "avx2"}


def _cpu_flags() -> set[str]:
    """The ``flags`` of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _cpu_has(probe: str, flag: str) -> bool:
    """``torch.cpu.<probe>()`` where this torch has it, else ``flag`` in ``/proc/cpuinfo``."""
    fn = getattr(torch.cpu, probe, None)
    if callable(fn):
        try:
            return bool(fn())
        except Exception:  # a private probe: fall back to the flags
            pass
    return flag in _cpu_flags()


def _cpu_bf16() -> tuple[bool, str]:
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    avx512_bf16 = _cpu_has("_is_avx512_bf16_supported", "avx512_bf16")
    amx = _cpu_has("_is_amx_tile_supported", "amx_bf16")
    if avx512_bf16 or amx:
        if aten.lower() in _ATEN_NO_BF16:
            return False, f"CPU capped by ATEN_CPU_CAPABILITY={aten}"
        if onednn.upper() in _ONEDNN_NO_BF16:
            return False, f"CPU capped by ONEDNN_MAX_CPU_ISA={onednn}"
        return True, "CPU with " + " and ".join(n for n, ok in (("AVX512-BF16", avx512_bf16), ("AMX", amx)) if ok)
    best = ("AVX-512" if _cpu_has("_is_avx512_supported", "avx512f")
            else "AVX2 only" if _cpu_has("_is_avx2_supported", "avx2") else "no AVX2")
    return False, f"CPU without AVX512-BF16 or AMX ({best})"


def _cuda_bf16() -> tuple[bool, str]:
    try:
        native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch without the argument
        native = bool(torch.cuda.is_bf16_supported())
    try:
        name = torch.cuda.get_device_name()
        major, minor = torch.cuda.get_device_capability()
        device = f"CUDA {name}, compute capability {major}.{minor}"
    except Exception:  # only for the message
        device = "CUDA"
    return native, f"{device}{'' if native else ', no native bf16'}"


def _device(accelerator: Any) -> str:
    """``"cuda"``, ``"cpu"``, ``"mps"`` or the accelerator's own name: where a ``Trainer`` with ``accelerator`` runs."""
    if accelerator is not None and not isinstance(accelerator, str):  # an Accelerator object, or its class_path
        name = str(getattr(accelerator, "class_path", None) or type(accelerator).__name__).lower()
        return next((d for d in ("cuda", "cpu", "mps") if d in name), name)
    name = (accelerator or "auto").lower()
    if name in ("auto", "gpu"):
        if torch.cuda.is_available():
            return "cuda"
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return "mps"
        return "cpu" if name == "auto" else "cuda"
    return name


def bf16_support(accelerator: Any = "auto") -> tuple[bool, str]:
    """Whether bf16 matmuls are native where a ``Trainer(accelerator=accelerator)`` runs, and why, in words.

    CUDA: ``torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)``. CPU: AVX512-BF16
    or AMX (``torch.cpu._is_avx512_bf16_supported()`` / ``_is_amx_tile_supported()``, else the ``avx512_bf16`` /
    ``amx_bf16`` flags of ``/proc/cpuinfo``), unless ``ATEN_CPU_CAPABILITY`` / ``ONEDNN_MAX_CPU_ISA`` cap the ISA below
    them. Other accelerators (MPS, TPU, ...): ``False`` (``auto`` does not pick bf16 there; set it explicitly).

    Returns:
        ``(native, reason)``, e.g. ``(True, "CPU with AVX512-BF16")`` or ``(False, "CPU without AVX512-BF16 or AMX
        (AVX2 only)")``.
    """
    device = _device(accelerator)
    if device == "cpu":
        return _cpu_bf16()
    if device == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        return _cuda_bf16()
    return False, f"accelerator {device!r}: auto picks bf16 only on CUDA and on CPUs with native bf16"


def _check(value: Any) -> None:
    if value is not None and value not in PRECISION_VALUES:
        allowed = ", ".join(str(v) for v in PRECISION_VALUES if isinstance(v, str))
        raise ValueError(f"{value!r} is not a trainer.precision; use one of: {allowed} (or null: Lightning's default, "
                         "32-true)")


def explain_precision(value: Any, accelerator: Any = "auto", *, warn: bool = True) -> tuple[Any, str]:
    """:func:`resolve_precision` and the one line that says what was chosen and why.

    ``16-mixed`` (or ``16``) on the CPU, where there is no fp16 AMP, becomes ``bf16-mixed`` here, with a warning,
    rather than inside the ``Trainer`` (Lightning's own fallback), so ``config.yaml`` and the ``precision``
    hyperparameter say what runs.

    Returns:
        ``(precision, line)``, e.g. ``("bf16-mixed", "precision: auto -> bf16-mixed (CPU with AVX512-BF16)")`` or
        ``("32-true", "precision: 32-true (as given; auto would choose bf16-mixed: CPU with AVX512-BF16)")``.
    """
    _check(value)
    native, reason = bf16_support(accelerator)
    auto = "bf16-mixed" if native else "32-true"
    if value == "auto":
        return auto, f"precision: auto -> {auto} ({reason})"
    device = _device(accelerator)
    if device == "cpu" and str(value) in _FP16_MIXED:
        if warn:
            slow = "" if native else f" without native bf16 matmuls ({reason}: slower than 32-true)"
            rank_zero_warn(f"trainer.precision={value!r}: fp16 mixed precision (AMP) is not supported on the CPU, so "
                           f"the run uses bf16-mixed{slow}, as Lightning would; config.yaml and the precision "
                           f"hyperparameter say bf16-mixed. Set --trainer.precision auto, 32-true or bf16-mixed to "
                           f"choose explicitly.", category=UserWarning)
        return "bf16-mixed", f"precision: {value} -> bf16-mixed (no fp16 AMP on the CPU; auto would choose {auto}: " \
                             f"{reason})"
    if warn and str(value) in _BF16 and not native and (device == "cpu" or
                                                        (device == "cuda" and torch.cuda.is_available())):
        slowdown = ("bf16 is emulated there: a bf16-mixed SmolLM2-135M step was measured ~5x slower than 32-true on "
                    "an AVX2-only AMD EPYC (forward+backward 146 s vs 29 s, benchmarks/README.md, issue 13)"
                    if device == "cpu" else "bf16 is emulated there (slower than fp32)")
        rank_zero_warn(f"trainer.precision={value!r} without native bf16 matmuls ({reason}): {slowdown}. "
                       "Use precision auto or 32-true.", category=UserWarning)
    shown = "null (Lightning's default, 32-true)" if value is None else value
    return value, f"precision: {shown} (as given; auto would choose {auto}: {reason})"


def resolve_precision(value: Any, accelerator: Any = "auto", *, warn: bool = True) -> Any:
    """The ``Trainer`` precision for ``value``: ``"auto"`` becomes ``"bf16-mixed"`` where bf16 matmuls are native
    (:func:`bf16_support`) and ``"32-true"`` elsewhere; ``"16-mixed"`` on the CPU becomes ``"bf16-mixed"`` (what
    Lightning runs there, warned); any other value is returned unchanged.

    Why it depends on the machine (measured, see the module docstring): with AVX512-BF16 a bf16 matmul ran ~4x faster
    than fp32 (~850 vs ~204 GFLOP/s on 2 cores), while on an AVX2-only EPYC a ``bf16-mixed`` SmolLM2 step was ~5x
    *slower* than fp32 (``DESIGN.md`` "Memory and speed", ``benchmarks/README.md``).

    Args:
        value: ``"auto"`` or a Lightning precision (``"32-true"``, ``"bf16-mixed"``, ``32``, ``None``, ...).
        accelerator: the ``Trainer``'s ``accelerator`` (``"auto"``, ``"cpu"``, ``"gpu"``, ``"cuda"``, an object).
        warn: warn (``UserWarning``, rank zero) when ``value`` forces bf16 on a CPU / GPU without native bf16, or is
            ``16-mixed`` on the CPU.

    Raises:
        ValueError: ``value`` is not a precision (the message lists :data:`PRECISION_VALUES`).
    """
    return explain_precision(value, accelerator, warn=warn)[0]


class AutoPrecisionTrainer(Trainer):
    """A ``Trainer`` whose ``precision`` also accepts ``"auto"`` (the default), resolved by :func:`resolve_precision`
    against its ``accelerator``. The ``lit-llm`` CLI's ``trainer_class``: LightningCLI validates ``trainer.precision``
    against this signature. Every other argument is ``Trainer``'s."""

    def __init__(self, *, precision: PrecisionInput = "auto", **kwargs: Any) -> None:
        """
        Args:
            precision: ``auto`` (default): ``bf16-mixed`` where bf16 matmuls are native (CUDA with bf16, CPUs with
                AVX512-BF16 or AMX), else ``32-true``. Or force one of Lightning's: ``32-true``, ``bf16-mixed``,
                ``bf16-true``, ``16-mixed``, ``16-true``, ``64-true``, ... (bf16 without native support warns).
            kwargs: the other ``Trainer`` arguments.
        """
        if precision == "auto":
            precision = resolve_precision(precision, kwargs.get("accelerator", "auto"), warn=False)
        super().__init__(precision=precision, **kwargs)
