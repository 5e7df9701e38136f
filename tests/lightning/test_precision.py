"""``trainer.precision: auto`` (lit_llm.lightning.precision): resolution on mocked CPU flags and CUDA capabilities,
explicit values unchanged, the warning when bf16 is forced without native support, the error for a bad value, and
through the CLI: ``auto`` accepted by ``--print_config``, resolved before the Trainer is built, printed, logged and
written to the saved ``config.yaml``. No GPU and no real bf16 hardware needed: the torch probes are monkeypatched."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import LightningDataModule

from lit_llm.lightning import PolicyModule
from lit_llm.lightning import precision as P
from lit_llm.lightning.cli import LitLLMCLI, main
from lit_llm.lightning.precision import (
    PRECISION_VALUES,
    AutoPrecisionTrainer,
    bf16_support,
    explain_precision,
    resolve_precision,
)

ROOT = Path(__file__).resolve().parents[2]
SFT_TINY = str(ROOT / "configs" / "sft_tiny.yaml")


@pytest.fixture
def machine(monkeypatch):
    """Set the machine: ``machine(cpu=<subset of {"avx512_bf16", "amx", "avx512", "avx2"}>, cuda=None | (native_bf16,
    (major, minor)))``. The ISA-capping variables are cleared first."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)

    def set_machine(cpu=("avx2",), cuda=None):
        cpu = set(cpu)
        for probe, flag in (("_is_avx512_bf16_supported", "avx512_bf16"), ("_is_amx_tile_supported", "amx"),
                            ("_is_avx512_supported", "avx512"), ("_is_avx2_supported", "avx2")):
            monkeypatch.setattr(torch.cpu, probe, lambda flag=flag: flag in cpu, raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda is not None)
        if cuda is not None:
            native, capability = cuda
            monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                                lambda including_emulation=True: native or including_emulation)
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mock GPU")
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return set_machine


# ------------------------------------------------------------------------------------------------- resolution
@pytest.mark.parametrize(("cpu", "expected", "reason"), [
    ({"avx512_bf16", "avx512", "avx2"}, "bf16-mixed", "CPU with AVX512-BF16"),
    ({"amx", "avx512", "avx2"}, "bf16-mixed", "CPU with AMX"),
    ({"avx512_bf16", "amx", "avx512", "avx2"}, "bf16-mixed", "CPU with AVX512-BF16 and AMX"),
    ({"avx512", "avx2"}, "32-true", "CPU without AVX512-BF16 or AMX (AVX-512)"),
    ({"avx2"}, "32-true", "CPU without AVX512-BF16 or AMX (AVX2 only)"),
    (set(), "32-true", "CPU without AVX512-BF16 or AMX (no AVX2)"),
])
@pytest.mark.parametrize("accelerator", ["auto", "cpu", None])
def test_auto_on_cpu_flags(machine, cpu, expected, reason, accelerator):
    machine(cpu=cpu)
    assert resolve_precision("auto", accelerator) == expected
    assert bf16_support(accelerator) == (expected == "bf16-mixed", reason)
    assert explain_precision("auto", accelerator)[1] == f"precision: auto -> {expected} ({reason})"


def test_cpuinfo_flags_when_torch_has_no_probe(machine, monkeypatch):
    machine(cpu=set())
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert bf16_support("cpu") == (True, "CPU with AVX512-BF16")
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert bf16_support("cpu") == (True, "CPU with AMX")
    monkeypatch.setattr(P, "_cpu_flags", lambda: {"avx2"})
    assert resolve_precision("auto", "cpu") == "32-true"


def test_real_probes_exist_in_this_torch():
    """The private torch probes the resolution prefers (else /proc/cpuinfo): present in the pinned torch."""
    assert callable(torch.cpu._is_avx512_bf16_supported) and callable(torch.cpu._is_amx_tile_supported)
    assert resolve_precision("auto", "cpu") in ("bf16-mixed", "32-true")


@pytest.mark.parametrize(("var", "value"), [("ONEDNN_MAX_CPU_ISA", "AVX2"), ("ONEDNN_MAX_CPU_ISA", "avx512_core"),
                                            ("ATEN_CPU_CAPABILITY", "avx2")])
def test_avx2_emulation_variables_cap_auto(machine, monkeypatch, var, value):
    """``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` emulate an AVX2 machine: auto follows them."""
    machine(cpu={"avx512_bf16", "avx512", "avx2"})
    monkeypatch.setenv(var, value)
    assert bf16_support("cpu") == (False, f"CPU capped by {var}={value}")
    assert resolve_precision("auto") == "32-true"
    monkeypatch.setenv(var, "AVX512_CORE_AMX" if var == "ONEDNN_MAX_CPU_ISA" else "avx512")
    assert resolve_precision("auto") == "bf16-mixed"


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda", None])
def test_auto_on_cuda(machine, accelerator):
    machine(cpu={"avx2"}, cuda=(True, (8, 0)))
    assert resolve_precision("auto", accelerator) == "bf16-mixed"
    assert explain_precision("auto", accelerator)[1] == \
        "precision: auto -> bf16-mixed (CUDA Mock GPU, compute capability 8.0)"
    machine(cpu={"avx2"}, cuda=(False, (7, 0)))  # pre-Ampere: bf16 only emulated
    assert resolve_precision("auto", accelerator) == "32-true"
    assert bf16_support(accelerator) == (False, "CUDA Mock GPU, compute capability 7.0, no native bf16")


def test_cpu_accelerator_on_a_cuda_machine_follows_the_cpu(machine):
    machine(cpu={"avx2"}, cuda=(True, (9, 0)))
    assert resolve_precision("auto", "cpu") == "32-true"
    machine(cpu={"avx512_bf16"}, cuda=None)
    assert resolve_precision("auto", "gpu") == "32-true"  # asked for a GPU, none there: Lightning will say so
    assert bf16_support("gpu") == (False, "no CUDA device")


def test_other_accelerators_stay_fp32(machine):
    machine(cpu={"avx512_bf16"})
    assert resolve_precision("auto", "mps") == "32-true"
    assert resolve_precision("auto", "tpu") == "32-true"


def test_accelerator_objects(machine):
    from lightning.pytorch.accelerators import CPUAccelerator

    machine(cpu={"avx512_bf16"})
    assert resolve_precision("auto", CPUAccelerator()) == "bf16-mixed"
    machine(cpu={"avx2"})
    assert resolve_precision("auto", CPUAccelerator()) == "32-true"


# ------------------------------------------------------------------------------------ explicit values, warnings
@pytest.mark.parametrize("value", ["32-true", 32, "32", "bf16-mixed", "bf16-true", "bf16", "16-true", "64-true", None])
def test_explicit_values_pass_through_unchanged(machine, value):  # 16-mixed on the CPU: test_silently_ignored.py
    machine(cpu={"avx512_bf16", "avx2"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_precision(value, "cpu") is value
        assert resolve_precision(value, "auto") is value


@pytest.mark.parametrize("value", ["bf16-mixed", "bf16-true", "bf16"])
def test_forcing_bf16_without_native_support_warns(machine, value):
    machine(cpu={"avx2"})
    with pytest.warns(UserWarning, match=r"without native bf16.*AVX2 only.*~5x slower than 32-true.*AVX2-only "
                                         r"AMD EPYC.*benchmarks/README.md"):
        assert resolve_precision(value, "cpu") == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_precision(value, "cpu", warn=False) == value
        assert resolve_precision("32-true", "cpu") == "32-true"  # fp32 never warns
        assert resolve_precision(value, "mps") == value  # not a CPU / CUDA decision
        machine(cpu={"avx512_bf16"})
        assert resolve_precision(value, "cpu") == value  # native: no warning
        machine(cpu={"avx2"}, cuda=(True, (8, 0)))
        assert resolve_precision(value, "auto") == value  # runs on the GPU


def test_forcing_bf16_on_an_old_gpu_warns(machine):
    machine(cpu={"avx2"}, cuda=(False, (7, 5)))
    with pytest.warns(UserWarning, match=r"compute capability 7.5, no native bf16.*emulated"):
        resolve_precision("bf16-mixed", "gpu")


def test_invalid_value_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'fp8' is not a trainer.precision; use one of: auto, 32-true, bf16-mixed, "
                                         r"bf16-true, 16-mixed, 16-true, 64-true, .*\(or null"):
        resolve_precision("fp8")
    assert {"auto", "32-true", "bf16-mixed", "bf16-true", 32, "32", None} - {*PRECISION_VALUES, None} == set()


def test_trainer_resolves_auto_itself(machine):
    machine(cpu={"avx2"})
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    assert AutoPrecisionTrainer(**kwargs).precision == "32-true"  # default auto
    machine(cpu={"avx512_bf16"})
    assert AutoPrecisionTrainer(precision="auto", **kwargs).precision == "bf16-mixed"
    assert AutoPrecisionTrainer(precision="32-true", **kwargs).precision == "32-true"


# ------------------------------------------------------------------------------------------------------ the CLI
def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", SFT_TINY, *args, "--print_config"])
    assert exc.value.code in (0, None), capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


#: Shipped configs that pin a precision, with the reason their comment gives.
PINNED = {"grpo_arithmetic.yaml": ("32-true", "seed sweep ran in fp32"),
          "grpo_vllm_tiny.yaml": ("32-true", "reruns give identical rollouts")}


def test_every_shipped_config_defaults_to_auto_except_the_pinned_ones():
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        text = config.read_text()
        value, reason = PINNED.get(config.name, ("auto", ""))
        assert yaml.safe_load(text)["trainer"]["precision"] == value, config.name
        assert reason in text, f"{config.name}: the pinned precision's comment should say why ({reason!r})"


def test_cli_accepts_auto_and_explicit_values(capsys):
    """``--print_config`` shows the portable value as given (``auto`` is resolved when the job runs, below)."""
    assert print_config([], capsys)["trainer"]["precision"] == "auto"
    assert print_config(["--trainer.precision", "auto"], capsys)["trainer"]["precision"] == "auto"
    assert print_config(["--trainer.precision", "32-true"], capsys)["trainer"]["precision"] == "32-true"
    assert print_config(["--trainer.precision", "null"], capsys)["trainer"]["precision"] is None


def test_cli_invalid_value_error_lists_the_allowed_ones(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", SFT_TINY, "--trainer.precision", "fp8", "--print_config"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("lit-llm: error: --trainer.precision: ")
    assert "'fp8' is not a trainer.precision; use one of: auto, 32-true, bf16-mixed, bf16-true" in err


def build_cli(*args: str) -> LitLLMCLI:
    """The CLI with the classes instantiated, nothing run (no subcommand)."""
    return LitLLMCLI(PolicyModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
                     args=["--config", SFT_TINY, "--wandb", "false", *args])


def test_cli_resolves_before_the_trainer_is_built(machine, capsys):
    machine(cpu={"avx512_bf16", "avx2"})
    cli = build_cli()
    assert cli.config["trainer"]["precision"] == "bf16-mixed"
    assert cli.trainer.precision == "bf16-mixed"
    assert "precision: auto -> bf16-mixed (CPU with AVX512-BF16)" in capsys.readouterr().out


def test_cli_run_prints_logs_and_saves_the_resolved_value(machine, tmp_path, capsys):
    """A one-step tiny SFT run with ``auto`` on a CPU without bf16: one line says why, ``config.yaml`` and
    ``hparams.yaml`` in the log dir hold ``32-true``."""
    machine(cpu={"avx2"})
    cli = main(["fit", "--config", SFT_TINY, "--trainer.default_root_dir", str(tmp_path), "--trainer.max_steps", "1",
                "--trainer.limit_val_batches", "0", "--samples.num_samples", "0"])
    assert cli.trainer.precision == "32-true"
    out = capsys.readouterr().out
    assert out.count("precision: auto -> 32-true (CPU without AVX512-BF16 or AMX (AVX2 only))") == 1
    log_dir = Path(cli.trainer.log_dir)
    assert yaml.safe_load((log_dir / "config.yaml").read_text())["trainer"]["precision"] == "32-true"
    assert yaml.safe_load((log_dir / "hparams.yaml").read_text())["precision"] == "32-true"


def test_cli_forcing_bf16_without_native_support_warns(machine, capsys):
    machine(cpu={"avx2"})
    with pytest.warns(UserWarning, match="~5x slower"):
        cli = build_cli("--trainer.precision", "bf16-mixed")
    assert cli.trainer.precision == "bf16-mixed"
    assert "precision: bf16-mixed (as given; auto would choose 32-true" in capsys.readouterr().out
