"""Shared fixtures: the real SmolLM2 tokenizer, a tiny random model, the committed chat templates, and GSM8K from the
team's shared data folder (the one thing read from beside the checkout; its tests skip naming GSM8K without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHARED_DATA = Path(os.environ.get("LIT_LLM_SHARED_DATA", SHARED / "data"))
#: The real models' chat templates the mask tests use (MIT, committed with their licences: a fresh clone needs nothing
#: beside it).
TEMPLATES_DIR = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
GSM8K_DIR = SHARED_DATA / "gsm8k"


def require_shared(path: Path, what: str = "GSM8K") -> Path:
    """Skip (naming the data set and the path) when the shared data the project must not copy is absent."""
    if not path.exists():
        pytest.skip(f"{what} test data not found at {path} (the project ships no copy; set LIT_LLM_SHARED_DATA to "
                    f"the shared/data folder that holds it)")
    return path


@pytest.fixture(autouse=True)
def _process_malloc_left_alone(monkeypatch):
    """Fits inside the pytest process leave glibc's malloc as it is: the module's fit-start arena cap and kept freed
    pages are process-wide and cannot be undone, so here they are no-ops returning ``False`` (as off glibc).
    tests/lightning/test_host_memory.py counts the module's calls and checks the real ones in fresh interpreters; the
    CLI tests' subprocesses run them for real."""
    monkeypatch.setattr("lit_llm.lightning.module.limit_malloc_arenas", lambda arenas: False)
    monkeypatch.setattr("lit_llm.lightning.module.keep_freed_pages", lambda: False)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (small models on 2 shared cores run several times faster), restored after."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def mesh(tmp_path):
    """A one-process gloo group and its 1-D data-parallel ``DeviceMesh`` (``data_parallel``), destroyed after the
    test: FSDP2 (sharded training) in one process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def templates_dir() -> Path:
    return TEMPLATES_DIR


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    return require_shared(GSM8K_DIR)


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (converted once from the embedded GGUF file, then cached)."""
    from lit_llm.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny(tokenizer):
    """A tiny random Llama-style model over the real tokenizer's vocabulary (fp32, eval mode)."""
    from lit_llm.models import tiny_model

    return tiny_model(tokenizer)


@pytest.fixture(scope="session")
def real_model():
    """The real SmolLM2-135M-Instruct (fp32, eval). ~5 s from the cache."""
    from lit_llm.models import load_model

    return load_model()


def pytest_runtest_setup(item):
    """A test marked ``vllm`` fails (never skips) where vLLM cannot be imported: ``make test-vllm`` must not pass
    without running them. ``make test`` / ``make test-slow`` deselect them (``-m "not vllm"``)."""
    if item.get_closest_marker("vllm") is not None:
        from lit_llm.policy.vllm_engine import require_vllm

        require_vllm(f"{item.nodeid} (marked vllm)")
