"""One check for an offline GPU machine (issue 28 item 6): is lit_llm ready for it, and how fast does it train there?

Run it through ``benchmarks/gpu_check.sh`` (which sets ``HF_HUB_OFFLINE=1`` and puts the checkout first on the path)
on a machine that has torch with CUDA, transformers and Lightning. In order, within ``--time-limit`` seconds (300 by
default, imports and warm-up included; past it the run stops with a ``FAILED`` line and every thread's stack):

1. **machine**: the CPU line of ``benchmarks/_memory.py`` (model, bf16 flags, cores), each visible GPU (name, compute
   capability, memory), the torch / CUDA / cuDNN / transformers / Lightning / vLLM versions.
2. **imports**: every distribution this check needs (``_requirements.NEEDED``, with lit_llm's version ranges from
   ``pyproject.toml``) and, recursively, what those need, read from the installed metadata without importing
   anything; one ``missing: ...`` / ``wrong version: ...`` line each, then the command that downloads their wheels on
   a machine with network access (``--download-wheels``, below) and exit 2.
3. **model**: ``--model PATH`` (an HF folder, or any name :func:`lit_llm.models.load_model` takes), else the tiny
   ``tiny-vllm`` model (:func:`lit_llm.models.tiny_vllm_path`: a random 2-layer Llama over SmolLM2's tokenizer that
   the check saves once under the lit_llm cache; it times the plumbing, not a real workload).
4. **kernel**: the chunked LM-head log-prob kernel against ``log_softmax`` of full logits on the training device:
   values and gradients in fp32 (TF32 off), values with ``matmul_dtype=bfloat16``.
5. **tf32** (CUDA): fp32 matmul TFLOP/s with TF32 off and on, and bf16, on 4096 x 4096 matrices.
6. **grpo**: ``GRPOModule`` + ``GRPODataModule`` (the arithmetic prompts) driven by ``lightning.Trainer.fit`` at
   ``--precision`` (``auto``: ``bf16-mixed``, ``16-mixed`` on a GPU without bf16), ``--steps`` optimizer steps (the
   first is warm-up and not reported), ``old_log_probs: recompute`` so the log-prob pass is timed on its own;
   **grpo-vllm**: the same with ``use_vllm`` when ``vllm`` is importable. **sft**: ``SFTModule`` + ``SFTDataModule``
   (arithmetic chats) the same way. On CUDA the fits run under ``torch.cuda.set_sync_debug_mode("warn")`` and the
   synchronising calls are counted by place.
7. **tests** (CUDA; ``--tests always`` on the CPU too): pytest on :data:`TEST_PATHS` (kernel, generation, log-prob,
   objectives, rng-state and any ``*device*`` / ``*sync*`` / ``*cast*`` test files), not ``slow``, ``real_model`` or
   ``vllm``, with what is left of the time limit.

Per stage it prints tok/s and MFU (``stage <fit>/<stage>: ...``), per fit the peak memory (``memory <fit>: ...``) and,
on CUDA, the synchronising calls (``syncs <fit>: ...``). Tokens per second: ``generate`` = generated
tokens / generation time (``rollout/tokens_per_sec``); ``log-prob`` = the trained rows' prompt + completion tokens /
the no-grad recompute forward (``time/recompute``); ``train`` = the same tokens / forward + backward + optimizer
(``train/tokens_per_sec``; SFT: non-padding tokens / step wall time, ``train/real_tokens_per_sec``); ``weight push``
= seconds and GB/s of the push into vLLM (``time/weight_push``). MFU = model FLOPs / time / peak: ``6 * N * tokens``
for a training stage, ``2 * N * tokens`` for a forward-only one, ``N`` = the model's parameters without the input
embedding when it is not tied to the LM head (the lookup costs no FLOPs; a tied head's matmul is counted once);
attention FLOPs are not counted; GRPO counts each row's prompt although ``share_prompts`` runs it once per group,
which overstates GRPO's MFU by up to the prompt share. The peak is the dense bf16 tensor-core figure of NVIDIA's data
sheet for the GPU's name (:data:`PEAK_BF16_TFLOPS`) or ``--peak-tflops``. Peak memory =
``torch.cuda.max_memory_allocated`` on CUDA (reset per fit), the process's peak resident set (``VmHWM``, reset per
fit) on the CPU. Every GPU-only part prints ``skipped: <what> (no CUDA)`` on a CPU machine; any failure prints
``FAILED: <stage>: <first line>`` and the exit status is 1.

``--download-wheels DIR --python X.Y [--platform TAG] [PKG ...]`` runs on a machine with network access and a
lit_llm environment: ``pip download`` of the wheels of ``PKG`` (default: every needed distribution but torch,
transformers and Lightning) and of what they need (the installed metadata here, recursively), minus what torch,
transformers and Lightning bring with them, each pinned to the version installed here (the tested one; ``PKG==V``
picks another), for CPython ``X.Y`` on ``TAG`` (``manylinux_2_N_<arch>`` also takes the older manylinux tags; default:
this machine's); then the size of each file, the total, and the ``pip install --no-index`` line for the GPU machine.
``--dry-run`` prints the pip command only.

Usage::

    benchmarks/gpu_check.sh                                   # the tiny model, bf16-mixed, 300 s at most
    benchmarks/gpu_check.sh --model /data/Qwen2.5-0.5B-Instruct --peak-tflops 989
    benchmarks/gpu_check.sh --download-wheels wheels --python 3.11 --platform manylinux_2_35_x86_64
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.metadata
import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

from _requirements import NEEDED, check_requirements, download_wheels, missing_hint

ROOT = Path(__file__).resolve().parents[1]

#: pytest paths of the GPU-relevant tests (a missing path is left out) and the globs that add device / sync tests.
TEST_PATHS = ("tests/policy/test_logprobs.py", "tests/policy/test_generation.py", "tests/policy/test_masked_dist.py",
              "tests/policy/test_batching.py", "tests/objectives", "tests/lightning/test_rng_state.py")
TEST_GLOBS = ("tests/**/test_*device*.py", "tests/**/test_*sync*.py", "tests/**/test_*cast*.py",
              "tests/**/test_frozen_*.py", "tests/**/test_grad_scaling.py", "tests/**/test_head_matmul_dtype.py",
              "tests/**/test_*shard*.py")

#: Dense bf16 tensor-core peak (TFLOP/s) by GPU name (NVIDIA data sheets, without sparsity); first match wins.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 2250.0), (r"\bH100 NVL\b", 835.0), (r"\bH100 PCIe\b", 756.0), (r"\bH[12]00\b", 989.0),
    (r"\bH800\b", 989.0), (r"\bA100\b", 312.0), (r"\bA800\b", 312.0), (r"\bL40S\b", 362.0), (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0), (r"\bA10\b", 125.0), (r"\bRTX A6000\b", 155.0),
)

_failures: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)


def fail(stage: str, error: BaseException | str) -> None:
    """Record a failed stage and print ``FAILED: <stage>: <first line>`` (the traceback goes to stderr)."""
    if isinstance(error, BaseException):
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        first = (str(error).strip().splitlines() or [""])[0]
        error = f"{type(error).__name__}: {first}"
    _failures.append(stage)
    say(f"FAILED: {stage}: {error}")


# ------------------------------------------------------------------------------------------------ machine
def machine_lines() -> list[str]:
    """The machine, first: CPU line (``benchmarks/_memory.py``), GPUs, library versions."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from _memory import machine_line

    lines = [f"machine: {machine_line()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"machine: GPU {i}: {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
                         f"{p.multi_processor_count} SMs), bf16 {'native' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        lines.append("machine: GPU: none (torch.cuda.is_available() is False)")
    versions = [f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}, cuDNN "
                f"{torch.backends.cudnn.version() if torch.cuda.is_available() else 'none'})"]
    for name in ("transformers", "lightning", "vllm"):
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} not installed")
    versions.append(f"python {platform.python_version()}")
    lines.append("machine: " + ", ".join(versions))
    return lines


# ------------------------------------------------------------------------------------------------ measuring
class StageMemory:
    """Peak memory of a fit (model load included): ``torch.cuda.max_memory_allocated`` (reset at the start) on CUDA,
    else the peak resident set (``VmHWM``, reset at the start through ``/proc/self/clear_refs``); ``peak`` is the
    text after the block."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __enter__(self) -> StageMemory:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            from _memory import release_and_reset_peak

            try:
                release_and_reset_peak()
            except OSError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            self.peak = f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated on CUDA"
        else:
            from _memory import status_kb

            self.peak = f"peak RSS {status_kb('VmHWM') / 2**20:.2f} GiB (no CUDA)"


class SyncCounter:
    """On CUDA: ``torch.cuda.set_sync_debug_mode("warn")`` and the synchronising calls' warnings counted by place
    (file:line); elsewhere nothing (``active`` False)."""

    def __init__(self, cuda: bool) -> None:
        self.active, self.places = cuda, {}

    def __enter__(self) -> SyncCounter:
        if self.active:
            import torch

            self._catch = warnings.catch_warnings(record=True)
            self._records = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if not self.active:
            return
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(*exc)
        for w in self._records:
            if "synchroniz" in str(w.message):
                place = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(str(ROOT)) else w.filename}" \
                        f":{w.lineno}"
                self.places[place] = self.places.get(place, 0) + 1
        for w in self._records:  # everything else is shown as usual
            if "synchroniz" not in str(w.message):
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)

    def line(self, stage: str) -> str:
        top = sorted(self.places.items(), key=lambda kv: -kv[1])[:5]
        where = ", ".join(f"{p} x{n}" for p, n in top)
        return f"syncs {stage}: {sum(self.places.values())} synchronising CUDA calls" + (f" (top: {where})" if top
                                                                                         else "")


def peak_tflops(override: float | None, cuda: bool) -> tuple[float | None, str]:
    """``(peak TFLOP/s, where it came from)``: ``--peak-tflops``, else :data:`PEAK_BF16_TFLOPS` by GPU name."""
    if override:
        return override, "--peak-tflops"
    if not cuda:
        return None, "no CUDA; --peak-tflops gives one"
    import torch

    name = torch.cuda.get_device_name()
    for pattern, value in PEAK_BF16_TFLOPS:
        if re.search(pattern, name):
            return value, f"{name} dense bf16"
    return None, f"{name!r} not in the table; --peak-tflops gives one"


def model_flops_params(model) -> int:
    """``N`` of ``6 * N * tokens``: parameters (a tied LM head counted once), without an untied input embedding."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if emb is not None and (head is None or head.weight is not emb.weight):
        n -= emb.weight.numel()
    return n


class Stages:
    """Formats ``stage <run>/<name>: <tok/s>, MFU, memory`` lines."""

    def __init__(self, n_params: int, peak: float | None, peak_note: str) -> None:
        self.n, self.peak, self.note = n_params, peak, peak_note

    def mfu(self, tokens_per_s: float, factor: int) -> str:
        if self.peak is None:
            return f"MFU n/a ({self.note})"
        return f"MFU {100 * factor * self.n * tokens_per_s / (self.peak * 1e12):.2f}% ({factor}N, {self.note} " \
               f"{self.peak:g} TFLOP/s)"

    def line(self, name: str, tokens_per_s: float, factor: int) -> str:
        return f"stage {name}: {tokens_per_s:,.0f} tok/s, {self.mfu(tokens_per_s, factor)}"


# ------------------------------------------------------------------------------------------------ stages
def prepare_model(model: str | None) -> str:
    from lit_llm.models import TINY_VLLM_MODEL, resolve_model_path, tiny_vllm_path

    if model is None:
        path = tiny_vllm_path()
        say(f"model: {TINY_VLLM_MODEL} fallback, saved at {path} (random 2-layer Llama over SmolLM2's tokenizer: "
            f"it checks the plumbing; --model PATH times a real model)")
        return str(path)
    path = resolve_model_path(model)
    say(f"model: {model} ({path})")
    return path


def kernel_check(device) -> None:
    """Chunked LM-head log-probs vs ``log_softmax`` of full logits on ``device``: fp32 values and gradients (TF32
    off) within 1e-4, bf16 LM-head matmuls within 0.1 (absolute log-prob)."""
    import torch

    from lit_llm.policy.kernel import IGNORE_INDEX, chunked_token_log_probs, naive_token_log_probs

    g = torch.Generator().manual_seed(0)
    n, h, v = 512, 256, 32000
    hidden0 = torch.randn(n, h, generator=g).to(device)
    weight0 = (torch.randn(v, h, generator=g) * 0.05).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    targets[::7] = IGNORE_INDEX
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        got = chunked_token_log_probs(hidden, weight, targets, chunk_size=128)
        got.sum().backward()
        ref_h, ref_w = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        want = naive_token_log_probs(ref_h @ ref_w.T, targets)
        want.sum().backward()
        diff = (got - want).abs().max().item()
        grad = max(((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
                   for a, b in ((hidden, ref_h), (weight, ref_w)))
        with torch.no_grad():
            bf16 = chunked_token_log_probs(hidden0, weight0, targets, chunk_size=128, matmul_dtype=torch.bfloat16)
        bf16_diff = (bf16 - want).abs().max().item()
    finally:
        torch.set_float32_matmul_precision(previous)
    line = (f"kernel: chunked LM-head log-probs on {device} vs full logits: fp32 max |diff| {diff:.1e} (<= 1e-4), "
            f"gradients max relative diff {grad:.1e} (<= 1e-4); bf16 matmul max |diff| {bf16_diff:.1e} (<= 0.1)")
    if diff > 1e-4 or grad > 1e-4 or bf16_diff > 0.1:
        raise AssertionError(line)
    say(line)


def tf32_check() -> None:
    """fp32 matmul TFLOP/s with TF32 off and on, and bf16 (4096 x 4096, 20 timed matmuls after 3 warm-up ones)."""
    import torch

    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    previous = torch.get_float32_matmul_precision()
    results = []
    try:
        for label, precision, dtype in (("fp32", "highest", torch.float32), ("tf32", "high", torch.float32),
                                        ("bf16", "highest", torch.bfloat16)):
            torch.set_float32_matmul_precision(precision)
            x, y = a.to(dtype), b.to(dtype)
            for _ in range(3):
                x @ y
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                x @ y
            torch.cuda.synchronize()
            results.append(f"{label} {20 * 2 * 4096**3 / (time.perf_counter() - t) / 1e12:.1f}")
    finally:
        torch.set_float32_matmul_precision(previous)
    say(f"tf32: matmul TFLOP/s {', '.join(results)} (TF32 is torch.set_float32_matmul_precision('high'), a global "
        f"switch: off in lit_llm unless set)")


def _release(cuda: bool) -> None:
    """Free the last fit's model and optimizer before the next one (a colocated vLLM engine takes a share of the GPU's
    memory when it starts)."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def _fit(module, data, args, cuda: bool, root: str) -> tuple[list[dict[str, float]], SyncCounter]:
    """``Trainer.fit`` for ``args.steps`` steps; every step's logged metrics (the first, warm-up, dropped when there
    are more) and the synchronising calls seen."""
    from lightning.pytorch import Callback, Trainer

    class Rows(Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1})

    rows = Rows()
    trainer = Trainer(max_steps=args.steps, precision=args.precision, accelerator="cuda" if cuda else "cpu",
                      devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
                      callbacks=[rows])
    with SyncCounter(cuda) as syncs, warnings.catch_warnings():
        # the check runs without a logger on purpose: Lightning's "self.log(...) but have no logger" lines, one per
        # metric and step, would bury the report
        warnings.filterwarnings("ignore", message=r".*but have no logger configured")
        trainer.fit(module, data)
    if len(rows.rows) != args.steps:
        raise RuntimeError(f"{len(rows.rows)} of {args.steps} training steps ran")
    return (rows.rows[1:] if len(rows.rows) > 1 else rows.rows), syncs


def grpo_stage(name: str, model: str, args, cuda: bool, root: str, use_vllm: bool) -> None:
    """One GRPO fit; prints its stage, memory and (CUDA) sync lines."""
    import torch

    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.grpo_data import GRPODataModule

    with StageMemory(cuda) as memory:
        module = GRPOModule(model, num_generations=args.generations, max_new_tokens=args.max_new_tokens,
                            temperature=1.0, micro_batch_size=args.prompts * args.generations, log_samples_every=0,
                            old_log_probs="recompute", use_vllm=use_vllm,
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-6))
        data = GRPODataModule("arithmetic", batch_size=args.prompts, num_train=args.prompts * args.steps, num_eval=0)
        rows, syncs = _fit(module, data, args, cuda, root)
    peak, note = peak_tflops(args.peak_tflops, cuda)
    stages = Stages(model_flops_params(module.model), peak, note)
    train_tps, train_time = _median(rows, "train/tokens_per_sec"), _median(rows, "time/training")
    say(stages.line(f"{name}/generate", _median(rows, "rollout/tokens_per_sec"), 2))
    recompute = _median(rows, "time/recompute")
    say(stages.line(f"{name}/log-prob", train_tps * train_time / recompute, 2))
    say(stages.line(f"{name}/train", train_tps, 6))
    if use_vllm:
        push = _median(rows, "time/weight_push")
        size = sum(p.numel() * p.element_size() for p in module.model.parameters()) / 1e9
        say(f"stage {name}/weight push: {push:.3f} s per push, {size / push:.2f} GB/s ({size:.2f} GB)")
    say(f"memory {name}: {memory.peak}")
    if syncs.active:
        say(syncs.line(name))


def sft_stage(model: str, args, cuda: bool, root: str) -> None:
    """One SFT fit; prints its stage, memory and (CUDA) sync lines."""
    import torch

    from lit_llm.lightning import SFTDataModule, SFTModule

    with StageMemory(cuda) as memory:
        module = SFTModule(model, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-6))
        data = SFTDataModule(format="arithmetic", num_samples=args.sft_batch_size * args.steps, eval_limit=0,
                             batch_size=args.sft_batch_size, micro_batch_size=args.sft_batch_size)
        rows, syncs = _fit(module, data, args, cuda, root)
    peak, note = peak_tflops(args.peak_tflops, cuda)
    stages = Stages(model_flops_params(module.model), peak, note)
    say(stages.line("sft/train", _median(rows, "train/real_tokens_per_sec"), 6))
    say(f"memory sft: {memory.peak}")
    if syncs.active:
        say(syncs.line("sft"))


def test_paths() -> list[str]:
    paths = [p for p in TEST_PATHS if (ROOT / p).exists()]
    for pattern in TEST_GLOBS:
        paths += sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(pattern) if str(p.relative_to(ROOT)) not in paths)
    return paths


def tests_stage(paths: list[str], seconds: float) -> None:
    """pytest on ``paths`` (not slow / real_model / vllm) in a child process stopped after ``seconds``."""
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-m",
           "not slow and not real_model and not vllm"]
    say(f"tests: {' '.join(paths)} (at most {seconds:.0f} s)")
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        sys.stderr.write(tail.decode(errors="replace") if isinstance(tail, bytes) else tail)
        raise RuntimeError(f"pytest did not finish within {seconds:.0f} s, what --time-limit left for it (raise "
                           f"--time-limit, or --tests never)") from None
    lines = [ln for ln in out.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else "(no output)"
    if out.returncode:
        sys.stderr.write(out.stdout[-8000:] + out.stderr[-4000:])
        raise RuntimeError(f"pytest exited {out.returncode}: {summary}")
    say(f"tests: {summary.strip('= ')}")


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_check.sh", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or lit_llm model name (default: the tiny-vllm model)")
    p.add_argument("--precision", default="auto",
                   help="Trainer precision of the GRPO and SFT steps; auto = bf16-mixed (16-mixed on a CUDA GPU "
                        "without bf16)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per fit; the first is warm-up (>= 2)")
    p.add_argument("--prompts", type=int, default=4, help="GRPO prompts per step")
    p.add_argument("--generations", type=int, default=4, help="GRPO completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32, help="GRPO completion budget")
    p.add_argument("--sft-batch-size", type=int, default=16, help="SFT conversations per step")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak TFLOP/s for MFU")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds for the whole check, imports included")
    p.add_argument("--tests", choices=("auto", "always", "never"), default="auto",
                   help="run the GPU-relevant tests: auto = on CUDA only")
    p.add_argument("--test-paths", nargs="+", default=None, help="pytest paths instead of the default selection")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM run even when vllm is importable")
    p.add_argument("--download-wheels", metavar="DIR", type=Path, default=None,
                   help="download the wheels of missing dependencies into DIR (on a machine with network access)")
    p.add_argument("--python", default=None, help="with --download-wheels: the GPU machine's CPython version (3.11)")
    p.add_argument("--platform", default=None, help="with --download-wheels: its platform tag (default: this one's)")
    p.add_argument("--dry-run", action="store_true", help="with --download-wheels: print the pip command only")
    p.add_argument("packages", nargs="*", help="with --download-wheels: the distributions (default: all needed)")
    args = p.parse_args(argv)
    if args.download_wheels is None and (args.packages or args.python or args.platform or args.dry_run):
        p.error("PACKAGES, --python, --platform and --dry-run go with --download-wheels DIR")
    if args.download_wheels is not None and not args.python:
        p.error("--download-wheels needs --python X.Y (the GPU machine's CPython version, e.g. 3.11)")
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (the first step is warm-up), got {args.steps}")
    return args


def _watchdog(limit: float, start: float) -> None:
    def expire() -> None:
        say(f"FAILED: time limit: the check ran past --time-limit {limit:g} s (threads' stacks on stderr)")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(max(limit - (time.perf_counter() - start), 0), expire)
    timer.daemon = True
    timer.start()


def run_check(args: argparse.Namespace, start: float) -> int:
    """The check (module docstring); 0 passed, 1 a stage failed, 2 packages missing."""
    _failures.clear()
    _watchdog(args.time_limit, start)
    say(f"gpu_check: lit_llm GPU check, limit {args.time_limit:g} s")
    try:
        for line in machine_lines():
            say(line)
    except ImportError as e:
        say(f"machine: torch not importable ({e})")
    problems = check_requirements()
    if problems:
        for line in problems:
            say(line)
        say(missing_hint(problems))
        return 2
    say(f"imports: ok ({len(NEEDED)} distributions this check needs, and theirs)")

    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.precision == "auto":
        args.precision = "16-mixed" if cuda and not torch.cuda.is_bf16_supported() else "bf16-mixed"
    say(f"precision: {args.precision}; {args.steps} steps per fit, the first one warm-up (not reported)")
    try:
        model = prepare_model(args.model)
    except Exception as e:  # nothing else can run without the model
        fail("model", e)
        return 1
    try:
        kernel_check(device)
    except Exception as e:
        fail("kernel", e)
    if cuda:
        try:
            tf32_check()
        except Exception as e:
            fail("tf32", e)
    else:
        say("skipped: TF32 / bf16 matmul throughput (no CUDA)")
        say('skipped: torch.cuda.set_sync_debug_mode("warn") during the fits (no CUDA)')
    with tempfile.TemporaryDirectory(prefix="lit_llm_gpu_check_") as root:
        try:
            grpo_stage("grpo", model, args, cuda, root, use_vllm=False)
        except Exception as e:
            fail("grpo", e)
        _release(cuda)
        if args.no_vllm:
            say("skipped: GRPO with vLLM, weight push (--no-vllm)")
        elif importlib.util.find_spec("vllm") is None:
            say("skipped: GRPO with vLLM, weight push (vllm not importable)")
        else:
            try:
                grpo_stage("grpo-vllm", model, args, cuda, root, use_vllm=True)
            except Exception as e:
                fail("grpo-vllm", e)
            _release(cuda)
        try:
            sft_stage(model, args, cuda, root)
        except Exception as e:
            fail("sft", e)
    if args.tests == "always" or (args.tests == "auto" and cuda):
        left = args.time_limit - (time.perf_counter() - start) - 5
        try:
            if left < 10:
                raise RuntimeError(f"only {max(left, 0):.0f} s of --time-limit left for the tests (raise "
                                   f"--time-limit, or --tests never)")
            tests_stage(args.test_paths or test_paths(), left)
        except Exception as e:
            fail("tests", e)
    else:
        say("skipped: GPU-relevant tests (no CUDA; `make test` runs them on the CPU, --tests always here)")
    elapsed = time.perf_counter() - start
    if _failures:
        say(f"gpu_check: FAILED ({', '.join(_failures)}) in {elapsed:.1f} s")
        return 1
    say(f"gpu_check: passed in {elapsed:.1f} s (limit {args.time_limit:g} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    args = parse_args(argv)
    if args.download_wheels is not None:
        return download_wheels(args.download_wheels, args.python, args.platform, args.packages, args.dry_run)
    return run_check(args, start)


if __name__ == "__main__":
    sys.exit(main())
