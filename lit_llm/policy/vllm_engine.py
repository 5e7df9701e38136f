"""The vLLM engine colocated with the trainer: importing vLLM (:func:`require_vllm`), building an in-process engine
with settings fit for a shared CPU machine (:func:`make_engine`), what the policy code reads of it
(:class:`EngineModel`) and pushing a trainer's weights into it in place (:func:`load_weights`).

vLLM is optional (``make setup-vllm`` installs it in its own virtualenv, ``.venv-vllm``); nothing here imports it at
module level.

What an in-process engine changes in the process that builds it (vLLM 0.32, CPU build; say so to users):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set in ``os.environ`` (the engine core runs in this process, so weights
  pass to it as tensors, never serialised);
* ``torch.distributed`` is initialised (gloo, world size 1, a ``file://`` rendezvous under ``/tmp``) unless it
  already was;
* the CPU worker replaces ``torch.set_num_threads`` with a function that only logs a warning, for the whole process
  (the thread count stays what it was);
* the global torch / numpy / ``random`` seeds, which vLLM resets to the engine's ``seed``, are put back by
  :func:`make_engine` (the trainer's RNG streams are unchanged by building an engine);
* ``kv_cache_gib`` GiB of host memory are reserved for the KV cache (vLLM's own default on CPU is
  ``gpu_memory_utilization`` = 92 % of the machine's memory, which a shared machine does not have).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["DEFAULT_KV_CACHE_GIB", "LOGPROBS_MODE", "SETUP_HINT", "EngineModel", "check_vllm_installed", "engine_lock",
           "is_vllm_engine", "load_weights", "make_engine", "require_vllm", "shared_engine"]

SETUP_HINT = "make setup-vllm"
#: The KV-cache size :func:`make_engine` reserves by default, in GiB (tiny and 135M models need far less).
DEFAULT_KV_CACHE_GIB = 1.0
#: vLLM's ``logprobs_mode`` the wrapper needs: the sampled token's log-prob after temperature (and after any
#: top-k / top-p / min-p / penalty processing: see :class:`~lit_llm.policy.vllm_wrapper.vLLMWrapper`).
LOGPROBS_MODE = "processed_logprobs"


def require_vllm(owner: str = "vLLMWrapper") -> Any:
    """Import and return the ``vllm`` package.

    Raises:
        ImportError: vLLM is not installed (or fails to import); one line naming ``make setup-vllm``.
    """
    try:
        import vllm

        if not hasattr(vllm, "LLM"):  # a folder named vllm on sys.path, seen as a namespace package
            raise ImportError(f"'vllm' resolves to {list(getattr(vllm, '__path__', []))}, not the vLLM package")
    except ImportError as e:
        raise ImportError(f"{owner} needs vLLM, which is not importable here ({e}); install it with `{SETUP_HINT}` "
                          f"(its own virtualenv .venv-vllm) and run with .venv-vllm/bin/python.") from None
    return vllm


def check_vllm_installed(owner: str) -> None:
    """Raise, without importing vLLM (an import takes seconds and logs), when it is not installed.

    Raises:
        ValueError: no ``vllm`` package on ``sys.path`` (or only a folder named ``vllm``); one line naming
            ``make setup-vllm``.
    """
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:  # absent, or a namespace package (a folder named vllm)
        raise ValueError(f"{owner} needs vLLM, which is not installed in this Python environment ({sys.prefix}); "
                         f"install it with `{SETUP_HINT}` (its own virtualenv .venv-vllm) and run "
                         f".venv-vllm/bin/lit-llm (or .venv-vllm/bin/python).")


def is_vllm_engine(model: Any) -> bool:
    """Whether ``model`` is a ``vllm.LLM`` (checked by type name, so vLLM need not be imported)."""
    cls = type(model)
    return cls.__name__ == "LLM" and cls.__module__.startswith("vllm")


def make_engine(model: str | os.PathLike, *, dtype: str = "float32", seed: int = 0, max_model_len: int | None = None,
                kv_cache_gib: float | None = DEFAULT_KV_CACHE_GIB, enforce_eager: bool = True,
                gpu_memory_utilization: float | None = None, enable_prefix_caching: bool = True,
                **engine_kwargs: Any) -> Any:
    """An in-process ``vllm.LLM`` for a model name or folder, set up for rollouts.

    Args:
        model: anything :func:`lit_llm.models.resolve_model_path` takes (``"tiny-vllm"``, the embedded default
            ``"smollm2-135m-instruct"``, a local HF folder, a cached Hub id); the engine loads the resolved folder.
        dtype: the engine's weights and compute dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
        seed: the engine's seed (the stream of requests without a ``seed`` of their own).
        max_model_len: the context the engine serves (prompt + response); ``None``: the model's.
        kv_cache_gib: KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``); ``None``: vLLM's rule from
            ``gpu_memory_utilization`` (on the CPU backend, that share of the machine's memory).
        enforce_eager: vLLM's ``enforce_eager`` (no compilation / CUDA graphs: faster start, reproducible).
        gpu_memory_utilization: vLLM's option (``None``: vLLM's default); only read when ``kv_cache_gib`` is
            ``None``.
        enable_prefix_caching: vLLM's automatic prefix caching (the samples of one prompt share its KV).
        **engine_kwargs: any other ``vllm.LLM`` keyword argument, except ``logprobs_mode`` (fixed to
            :data:`LOGPROBS_MODE`).

    Returns:
        The ``vllm.LLM``, its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Raises:
        ImportError: vLLM is not installed (names ``make setup-vllm``).
        ValueError: ``kv_cache_gib`` not > 0; a ``logprobs_mode`` other than :data:`LOGPROBS_MODE`; the model name
            cannot be resolved (from :func:`~lit_llm.models.resolve_model_path`).
    """
    if kv_cache_gib is not None and (isinstance(kv_cache_gib, bool) or not isinstance(kv_cache_gib, (int, float))
                                     or not kv_cache_gib > 0):
        raise ValueError(f"kv_cache_gib: expected a size in GiB > 0 (or None for vLLM's own rule), got "
                         f"{kv_cache_gib!r}.")
    mode = engine_kwargs.pop("logprobs_mode", LOGPROBS_MODE)
    if mode != LOGPROBS_MODE:
        raise ValueError(f"logprobs_mode={mode!r}: the wrapper reports the sampled tokens' log-probs after "
                         f"temperature, which vLLM gives with logprobs_mode={LOGPROBS_MODE!r} only. Leave "
                         f"logprobs_mode out.")
    vllm = require_vllm("make_engine")
    path = _model_folder(model)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with _rng_kept():
        return vllm.LLM(**_engine_kwargs(path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                         kv_cache_gib=kv_cache_gib, enforce_eager=enforce_eager,
                                         gpu_memory_utilization=gpu_memory_utilization,
                                         enable_prefix_caching=enable_prefix_caching), **engine_kwargs)


def _engine_kwargs(path: str, *, dtype: str, seed: int, max_model_len: int | None, kv_cache_gib: float | None,
                   enforce_eager: bool, gpu_memory_utilization: float | None,
                   enable_prefix_caching: bool) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of :func:`make_engine`'s named options."""
    kwargs: dict[str, Any] = dict(model=path, tokenizer=path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                                  enable_prefix_caching=enable_prefix_caching, logprobs_mode=LOGPROBS_MODE)
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return kwargs


def _model_folder(model: str | os.PathLike) -> str:
    """:func:`lit_llm.models.resolve_model_path`, its ``FileNotFoundError`` as a ``ValueError`` naming the engine."""
    from lit_llm.models import resolve_model_path

    try:
        return resolve_model_path(model)
    except FileNotFoundError as e:
        raise ValueError(f"vLLM engine: model={str(model)!r} cannot be resolved: {e}") from e


@contextmanager
def _rng_kept() -> Iterator[None]:
    """Put the global torch (CPU and CUDA), numpy and ``random`` RNG states back after the block (vLLM reseeds them
    all with its ``seed`` while building an engine)."""
    import numpy as np

    states = (torch.get_rng_state(), np.random.get_state(), random.getstate(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


#: Engines built by :func:`shared_engine`, by their settings; kept for the life of the process (deleting an in-process
#: engine tears down vLLM's process-wide distributed state, which every later engine would need).
_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


def shared_engine(model: str | os.PathLike, **kwargs: Any) -> Any:
    """:func:`make_engine`, built once per process for each set of arguments (the same ``vllm.LLM`` is returned for
    the same resolved model folder and keyword arguments; a second ``fit`` in one process reuses the engine of the
    first). Engines are never deleted (see :data:`_SHARED`).

    Raises:
        The errors of :func:`make_engine`.
    """
    path = _model_folder(model)
    key = (str(path), tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = make_engine(path, **kwargs)
        return _SHARED[key]


_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def engine_lock(llm: Any) -> threading.RLock:
    """The re-entrant lock every call into ``llm`` holds (``generate`` by :class:`~lit_llm.policy.vLLMWrapper`, the
    weight push by :func:`load_weights`): a ``vllm.LLM`` is not thread-safe, and the greedy evaluation (trainer
    thread) may meet the asynchronous producer's rollouts (its thread) on the same engine."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(llm)
        if lock is None:
            lock = _LOCKS[llm] = threading.RLock()
        return lock


@dataclass(frozen=True)
class EngineModel:
    """What the policy code reads of a model, for a vLLM engine: the duck type
    :func:`~lit_llm.policy.generation.resolve_generation_config` and
    :func:`~lit_llm.policy.generation.check_token_ids` take in place of an HF model.

    Attributes:
        config: the engine's HF config (``vocab_size``, eos / pad ids).
        generation_config: the model folder's ``generation_config.json`` (a ``transformers.GenerationConfig``) or
            ``None`` when it has none.
        max_model_len: the context the engine serves (prompt + response), in tokens.
        path: the folder (or Hub id) the engine loaded.
    """

    config: Any
    generation_config: Any
    max_model_len: int
    path: str

    @classmethod
    def of(cls, llm: Any) -> EngineModel:
        """Read it from a ``vllm.LLM``."""
        from transformers import GenerationConfig

        mc = llm.llm_engine.model_config
        try:
            gen = GenerationConfig.from_pretrained(mc.model)
        except OSError:  # no generation_config.json: eos ids come from the config / tokenizer
            gen = None
        return cls(config=mc.hf_config, generation_config=gen, max_model_len=int(mc.max_model_len),
                   path=str(mc.model))


def load_weights(llm: Any, weights: Iterable[tuple[str, Tensor]]) -> None:
    """Push weights into an in-process engine, in place, then reset its prefix cache.

    The ``(name, tensor)`` pairs go, as the same tensor objects (no disk round trip, no copy through another
    process), to vLLM's in-place reload (``worker.reload_weights(weights_iterator=...)`` through
    ``LLM.collective_rpc``), which maps the checkpoint names to the engine's layers (fused ``qkv_proj`` /
    ``gate_up_proj``, a tied head skipped), casts to the engine's dtype and repacks as the backend needs. Then
    ``LLM.reset_prefix_cache()``, so no prompt seen before is answered from the old weights' KV (the bug TorchRL hit,
    pytorch/rl#3809).

    Args:
        llm: a ``vllm.LLM`` whose engine core runs in this process (:func:`make_engine`, or any ``LLM`` built with
            ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        weights: ``(name, tensor)`` pairs with the HF checkpoint's names, e.g. ``model.named_parameters()`` or
            ``model.state_dict().items()`` of the trainer's HF model (any device / dtype; read once, may be a
            generator). Push every weight: vLLM only logs the layers it did not receive and keeps their old values.
            A tied output head (``tie_word_embeddings``) is pushed as ``lm_head.weight`` from the pushed
            ``*embed_tokens.weight`` when the pairs lack it (``named_parameters()`` lists a tied weight once; vLLM's
            in-place reload would keep the old head).

    Raises:
        ValueError: ``llm`` is not a ``vllm.LLM`` or its engine core runs in another process (tensors would be
            serialised); names ``VLLM_ENABLE_V1_MULTIPROCESSING=0``.
        RuntimeError: the prefix cache could not be reset (a request still running).
        Exception: vLLM's own error for a name the model does not have or a tensor of the wrong shape.
    """
    if not is_vllm_engine(llm):
        raise ValueError(f"load_weights: expected a vllm.LLM, got {type(llm).__name__}.")
    core = type(llm.llm_engine.engine_core).__name__
    if core != "InprocClient":
        raise ValueError(f"load_weights: the engine core runs in another process ({core}), where the weights would be "
                         f"serialised and copied; build the engine with VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                         f"(lit_llm.policy.vllm_engine.make_engine does).")
    tied = bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
    _quiet_reload_log()
    with engine_lock(llm):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _with_tied_head(weights, tied)})
        reset = llm.reset_prefix_cache()
    if reset is False:
        raise RuntimeError("load_weights: the weights were pushed but vLLM did not reset its prefix cache (a request "
                           "was still running); call llm.reset_prefix_cache() once no generate call is in flight.")


class _NoWeightlessLayerWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" line of every in-place reload: the rotary embedding has
    no weights (its cos / sin cache is computed), so there is nothing to load."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _quiet_reload_log() -> None:
    logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _NoWeightlessLayerWarning) for f in logger.filters):
        logger.addFilter(_NoWeightlessLayerWarning())


def _with_tied_head(weights: Iterable[tuple[str, Tensor]], tied: bool) -> Iterator[tuple[str, Tensor]]:
    """The pairs, then ``("lm_head.weight", <the embedding>)`` for a tied head the pairs did not name (HF's names)."""
    embedding, head = None, False
    for name, tensor in weights:
        if name.endswith("embed_tokens.weight"):
            embedding = tensor
        head = head or name.endswith("lm_head.weight")
        yield name, tensor
    if tied and not head and embedding is not None:
        yield "lm_head.weight", embedding
