"""Colocated vLLM rollouts (GRPO's ``use_vllm``, issue 27): the ``vllm_*`` options, the engine built from the
trainer's precision, and the trainer's weights pushed into it.

*Colocated* means one process: the engine core runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so a push hands the trainer's own tensors to vLLM's in-place reload (no disk round trip, no copy through another
process). :class:`VLLMRollouts` builds the engine once (:func:`~lit_llm.policy.vllm_engine.shared_engine`: one per
process and setting, never deleted), checks that it serves the trained architecture, and returns the
:class:`~lit_llm.policy.vLLMWrapper` generate version the rollout engine samples with;
:class:`~lit_llm.lightning.versions.PolicyVersionSwitch` decides when to push (:meth:`VLLMRollouts.push`).
What building an engine changes in the process is listed in :mod:`lit_llm.policy.vllm_engine`.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lit_llm.policy.vllm_engine import DEFAULT_KV_CACHE_GIB, load_weights, shared_engine
from lit_llm.rollouts.settings import RolloutError, RolloutSettings

__all__ = ["VLLMRollouts", "VLLMSettings", "check_vllm_sampling", "engine_dtype", "hf_weights", "start_error"]

#: Head sizes vLLM's CPU attention supports (vLLM 0.32 ``cpu_attn``).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: Config fields that must agree between the engine's model and the trained one.
SAME_MODEL_FIELDS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class VLLMSettings:
    """GRPO's ``vllm_*`` options (TRL's names where TRL has them; ``enforce_eager`` and ``kv_cache_gib`` are ours).

    Attributes:
        mode: ``"colocate"`` (TRL's ``vllm_mode``: the engine in the trainer's process; TRL's default ``"server"``,
            a separate ``trl vllm-serve`` process, is not offered).
        gpu_memory_utilization: share of the GPU's memory vLLM reserves for weights and KV cache (TRL's default 0.3:
            the trainer shares the GPU); CUDA only, read when ``kv_cache_gib`` is ``None``.
        max_model_length: the context the engine serves (prompt + completion, tokens; ``None``: the model's).
        tensor_parallel_size: GPUs per engine; only 1 is supported.
        enable_sleep_mode: offload the engine's weights and free its KV cache between rollouts (vLLM's sleep
            mode; CUDA only, sync rollouts only).
        enforce_eager: vLLM's ``enforce_eager`` (no ``torch.compile`` / CUDA graphs: a faster start, and with fp32
            bit-reproducible rollouts); ``False`` compiles (faster steps after a slower start).
        kv_cache_gib: KV-cache size in GiB (vLLM's ``kv_cache_memory_bytes``); ``None``: 1 GiB on the CPU
            (:data:`~lit_llm.policy.vllm_engine.DEFAULT_KV_CACHE_GIB`; vLLM's own CPU rule reserves 92 % of the
            machine's memory), ``gpu_memory_utilization`` on CUDA.

    Raises:
        RolloutError: an option out of range, named ``vllm_<option>``.
    """

    mode: Literal["colocate"] = "colocate"
    gpu_memory_utilization: float = 0.3
    max_model_length: int | None = None
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    enforce_eager: bool = True
    kv_cache_gib: float | None = None

    def __post_init__(self) -> None:
        if self.mode != "colocate":
            raise RolloutError(f"vllm_mode must be 'colocate' (the engine in the trainer's process), got "
                               f"{self.mode!r}; a vLLM server mode is not offered.")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise RolloutError(f"vllm_gpu_memory_utilization must be in (0, 1], got {u!r}.")
        m = self.max_model_length
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise RolloutError(f"vllm_max_model_length must be an integer >= 2 or null (the model's), got {m!r}.")
        if self.tensor_parallel_size != 1:
            raise RolloutError(f"vllm_tensor_parallel_size={self.tensor_parallel_size!r}: only 1 is supported (one "
                               f"engine per trainer process); set it to 1.")
        k = self.kv_cache_gib
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k)
                              or not k > 0):
            raise RolloutError(f"vllm_kv_cache_gib must be a size in GiB > 0 or null, got {k!r}.")
        for name in ("enable_sleep_mode", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise RolloutError(f"vllm_{name} must be true or false, got {getattr(self, name)!r}.")


def check_vllm_sampling(settings: RolloutSettings, old_log_probs: str) -> None:
    """Sampling options vLLM cannot score like the trainer: with ``top_p`` / ``top_k`` vLLM's log-probs are those of the
    truncated distribution (``processed_logprobs``) while the trainer's log-prob version scores the full tempered one,
    so the generation-time log-probs cannot be the ratio's denominator.

    Raises:
        RolloutError: ``top_p`` / ``top_k`` with ``old_log_probs: rollout`` (names both and the fix); async rollouts
            with sleep mode are checked by :class:`VLLMRollouts`.
    """
    truncation = [f"{k}={v}" for k, v in (("top_p", settings.top_p), ("top_k", settings.top_k)) if v is not None]
    if truncation and old_log_probs != "recompute":
        raise RolloutError(f"use_vllm with {' and '.join(truncation)}: vLLM's log-probs are then those of the "
                           f"truncated distribution, not the full tempered one the trainer scores, so they cannot be "
                           f"the ratio's old log-probs; set old_log_probs: recompute (or drop {truncation[0]}).")


def engine_dtype(precision: Any) -> str:
    """The engine's dtype for a resolved ``trainer.precision``: ``bf16-*`` -> ``"bfloat16"``, ``16-*`` ->
    ``"float16"``, anything else (``32-true``, ``64-true``) -> ``"float32"``."""
    p = str(precision)
    if p.startswith("bf16"):
        return "bfloat16"
    if p.startswith("16"):
        return "float16"
    return "float32"


@torch.no_grad()
def hf_weights(trained: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The trained model's weights as ``(HF checkpoint name, tensor)`` pairs, the tensors themselves (no copy).

    A ``peft`` LoRA model yields its base model's names with each adapted layer's weight merged out of place
    (``W + get_delta_weight(adapter)`` = ``W + (lora_alpha / r) B A`` for each active adapter, in ``W``'s dtype): the
    engine serves base + adapters while the trainer keeps its adapters unmerged. Adapter tensors are not yielded; a
    tied weight is yielded once (as ``named_parameters()`` lists it).

    The tensors keep the trainer's dtype (fp32 master weights): vLLM's weight loaders cast each one into the engine's
    dtype as they copy it, once per push, not once per decode step (docs/distributed.md, issue 28). Under
    ``bf16-mixed`` with LoRA the base is bf16 during the fit, so the merge runs in bf16 there
    (:func:`~lit_llm.policy.frozen_weights.cast_frozen_base_weights`).
    """
    get_base = getattr(trained, "get_base_model", None)
    if not callable(get_base):
        yield from ((name, p.detach()) for name, p in trained.named_parameters())
        return
    from peft.tuners.lora import LoraLayer

    base = get_base()
    adapted = {name for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    seen: set[int] = set()  # a tied weight once, as named_parameters() lists it
    for name, module in base.named_modules():
        if name in adapted:
            layer = module.base_layer
            weight = layer.weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
            yield f"{name}.weight", weight
            if getattr(layer, "bias", None) is not None:
                yield f"{name}.bias", layer.bias.detach()
            continue
        parent = name.rpartition(".")[0]
        while parent and parent not in adapted:
            parent = parent.rpartition(".")[0]
        if parent in adapted:  # inside an adapted layer: its base layer, lora_A / lora_B, dropout
            continue
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield (f"{name}.{pname}" if name else pname), p.detach()


class VLLMRollouts:
    """The colocated engine of one GRPO module: built at ``setup``, the trained weights pushed into it.

    Args:
        model: the trained model's name or folder (GRPO's ``model`` option): the engine loads the same folder
            (:func:`lit_llm.models.resolve_model_path`), then gets the trained weights at every push.
        settings: the ``vllm_*`` options.
        seed: the engine's seed (the stream of requests without a per-row seed; ``rollout_seed`` or 0).

    Attributes:
        llm: the ``vllm.LLM`` (``None`` before :meth:`build`).
        num_pushes, last_push_time (s), total_push_time (s), num_sleeps, num_wake_ups: counters.
        pushed_at: the key of the weights last pushed (see :meth:`push`).
    """

    def __init__(self, model: str, settings: VLLMSettings, *, seed: int | None = 0) -> None:
        self.model_name, self.settings, self.seed = str(model), settings, 0 if seed is None else int(seed)
        self.llm: Any = None
        self.num_pushes = self.num_sleeps = self.num_wake_ups = 0
        self.last_push_time = self.total_push_time = 0.0
        self.pushed_at: Any = None
        self.asleep = False

    def engine_kwargs(self, *, precision: Any, device: torch.device) -> dict[str, Any]:
        """:func:`~lit_llm.policy.vllm_engine.make_engine` keyword arguments on ``device`` at ``precision``."""
        s = self.settings
        on_cuda = device.type == "cuda"
        kv = s.kv_cache_gib if s.kv_cache_gib is not None else (None if on_cuda else DEFAULT_KV_CACHE_GIB)
        kwargs: dict[str, Any] = dict(dtype=engine_dtype(precision), seed=self.seed, max_model_len=s.max_model_length,
                                      kv_cache_gib=kv, enforce_eager=s.enforce_eager)
        if on_cuda:
            kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
            if s.enable_sleep_mode:
                kwargs["enable_sleep_mode"] = True
        return kwargs

    def check_setup(self, *, device: torch.device, world_size: int, rollout_mode: str, trained: torch.nn.Module
                    ) -> None:
        """What must hold before an engine is built.

        Raises:
            RolloutError: more than one process (``use_vllm`` runs one engine in one trainer process; a per-rank engine
                under Lightning's process group is not built: vLLM initialises its own ``torch.distributed`` group);
                sleep mode off CUDA or with async rollouts; on the CPU, a head size vLLM's CPU attention lacks.
        """
        if world_size > 1:
            raise RolloutError(f"use_vllm runs one colocated engine in one trainer process; this run has {world_size} "
                               f"processes (trainer.devices / num_nodes). Train on one device "
                               f"(--trainer.devices 1) or set use_vllm: false (rollouts on the trained model).")
        if self.settings.enable_sleep_mode and device.type != "cuda":
            raise RolloutError(f"vllm_enable_sleep_mode frees GPU memory between rollouts and needs a CUDA device; "
                               f"this run is on {device.type}: set vllm_enable_sleep_mode: false.")
        if self.settings.enable_sleep_mode and rollout_mode != "sync":
            raise RolloutError("vllm_enable_sleep_mode with rollout_mode: async: the producer generates all the time, "
                               "so the engine never sleeps; set one of them off.")
        cfg = _config(trained)
        heads = getattr(cfg, "num_attention_heads", None)
        head = getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else None)
        if device.type == "cpu" and head is not None and head not in CPU_HEAD_SIZES:
            raise RolloutError(f"use_vllm: the model {self.model_name!r} has attention head size {head}, which vLLM's "
                               f"CPU attention does not support ({', '.join(map(str, CPU_HEAD_SIZES))}); use a model "
                               f"with one of those (the test model 'tiny-vllm' has 32) or use_vllm: false.")

    def build(self, *, precision: Any, device: torch.device, trained: torch.nn.Module, tokenizer: Any,
              generate_kwargs: dict[str, Any]) -> Any:
        """Build (or reuse) the engine and return the generate version over it.

        Args:
            precision: the resolved ``trainer.precision`` (the engine's dtype, :func:`engine_dtype`).
            device: the trainer's root device (CPU: ``kv_cache_gib`` default 1 GiB; CUDA: ``gpu_memory_utilization``).
            trained: the trained model (its config must match the engine's).
            tokenizer: the trainer's tokenizer (renders and decodes as in training).
            generate_kwargs: the rollout sampling settings (:meth:`RolloutSettings.generate_kwargs`).

        Returns:
            ``vLLMWrapper(llm, input_mode="tokens", generate=True, generate_kwargs=...)`` (outputs on the CPU).

        Raises:
            ImportError: vLLM is not installed (one line naming ``make setup-vllm``).
            RolloutError: the engine could not start (vLLM's first line, and for KV-cache memory the option to
                raise), or its model differs from the trained one (names the fields and both values).
        """
        from lit_llm.policy.vllm_wrapper import vLLMWrapper

        if self.llm is None:
            # the engine initialises torch.distributed (world size 1), after which Lightning advises sync_dist=True
            # for every epoch-level metric; with one process (check_setup) there is nothing to sync
            warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting.*")
            kwargs = self.engine_kwargs(precision=precision, device=device)
            try:
                self.llm = shared_engine(self.model_name, **kwargs)
            except ImportError:
                raise
            except Exception as e:  # vLLM's start-up errors are long: keep what says why, and what to change here
                raise RolloutError(f"use_vllm: vLLM could not start an engine for {self.model_name!r} "
                                   f"({', '.join(f'{k}={v}' for k, v in kwargs.items())}): {start_error(e)}") from e
        check_same_model(self.llm, trained, self.model_name)
        return vLLMWrapper(self.llm, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=generate_kwargs)

    def check_context(self, prompts: list[tuple[list[Any], int, str]], limit: int | None = None) -> None:
        """Every prompt fits the engine's context with its budget (checked at setup, before the first rollout; the
        data module's own check uses the model's context, which ``vllm_max_model_length`` may lower).

        Args:
            prompts: ``(rows, max_new_tokens, what)`` triples: prompt rows with ``prompt_ids`` (and ``sample_id``),
                the new-token budget of their generations, and what they are (named in the error).
            limit: the context in tokens (default: the engine's ``max_model_len``).

        Raises:
            RolloutError: the longest prompt of a set does not fit, naming it, the sum, the engine's context and the
                options to change.
        """
        limit = int(self.llm.llm_engine.model_config.max_model_len) if limit is None else int(limit)
        for rows, budget, what in prompts:
            if not rows:
                continue
            longest = max(rows, key=lambda r: len(r["prompt_ids"]))
            n = len(longest["prompt_ids"])
            if n + budget > limit:
                raise RolloutError(f"use_vllm: the {what} {longest.get('sample_id', '')!r} has {n} tokens; with "
                                   f"{budget} new tokens it exceeds the engine's context of {limit} tokens "
                                   f"(vllm_max_model_length={self.settings.max_model_length}). Raise "
                                   f"--model.init_args.vllm_max_model_length (null: the model's context) or lower "
                                   f"the new-token budget.")

    def push(self, trained: torch.nn.Module, key: Any) -> float:
        """Push the trained weights (:func:`hf_weights`: LoRA merged) into the engine in place, reset its prefix cache
        (:func:`~lit_llm.policy.vllm_engine.load_weights`) and record ``key`` (what the weights are, e.g.
        ``(run, global_step)``) in :attr:`pushed_at`. Wakes a sleeping engine first.

        Returns:
            The push's wall time in seconds.

        Raises:
            RuntimeError: no engine (:meth:`build` not called); vLLM's own errors (nothing else is written: the
                trainer's weights and checkpoints are untouched).
        """
        if self.llm is None:
            raise RuntimeError("VLLMRollouts.push: no engine yet (build() runs at setup).")
        self.wake_up()
        t0 = time.perf_counter()
        load_weights(self.llm, hf_weights(trained))
        self.last_push_time = time.perf_counter() - t0
        self.total_push_time += self.last_push_time
        self.num_pushes += 1
        self.pushed_at = key
        return self.last_push_time

    def wake_up(self) -> None:
        """Sleep mode: wake the engine (weights back, KV cache re-allocated) if it sleeps."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            self.num_wake_ups += 1

    def sleep(self) -> None:
        """Sleep mode: offload the engine's weights and free its KV cache (vLLM's ``sleep(level=1)``); no-op without
        ``enable_sleep_mode``."""
        if self.settings.enable_sleep_mode and self.llm is not None and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
            self.num_sleeps += 1


def start_error(error: BaseException) -> str:
    """One line of a vLLM start-up error: its first line (with a validation error's first detail line, where the
    reason is), then the ``vllm_*`` option to change when the error is about KV-cache memory or the context length
    (vLLM's own text names its ``gpu_memory_utilization`` / ``max_model_len``, which are not this run's knobs)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [type(error).__name__]
    text = lines[0] + (f" {lines[1]}" if "validation error" in lines[0] and len(lines) > 1 else "")
    lower = str(error).lower()
    if "max_model_len" in lower and "greater than" in lower:
        return f"{text} Lower --model.init_args.vllm_max_model_length (or null: the model's context)."
    if "kv cache" in lower or "cache blocks" in lower or "gpu_memory_utilization" in lower:
        return f"{text} Raise --model.init_args.vllm_kv_cache_gib (or lower vllm_max_model_length)."
    return text


def _config(model: torch.nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return (get_base() if callable(get_base) else model).config


def check_same_model(llm: Any, trained: torch.nn.Module, name: str) -> None:
    """The engine serves the trained architecture (:data:`SAME_MODEL_FIELDS` of both configs agree).

    Raises:
        RolloutError: naming each field that differs with both values.
    """
    engine_cfg, cfg = llm.llm_engine.model_config.hf_config, _config(trained)
    diff = [f"{f}: engine {getattr(engine_cfg, f, None)!r} vs trained {getattr(cfg, f, None)!r}"
            for f in SAME_MODEL_FIELDS if getattr(engine_cfg, f, None) != getattr(cfg, f, None)]
    if diff:
        raise RolloutError(f"use_vllm: the engine's model ({name!r}) is not the trained one ({'; '.join(diff)}); the "
                           f"engine loads the folder of the model option, so the trained model must keep its "
                           f"architecture and vocabulary (no resized embeddings).")
