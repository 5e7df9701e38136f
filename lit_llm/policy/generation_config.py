"""Generation settings: TorchRL's standardised ``generate_kwargs`` (``torchrl/modules/llm/policies/common.py``:
vLLM's ``max_tokens`` -> ``max_new_tokens``, ``n`` -> ``num_return_sequences``), their validation rules, and the
frozen :class:`GenerationConfig` they resolve to against a model's own generation config
(:func:`resolve_generation_config`). :func:`prefix_dependent_settings` names the settings under which the sampled
ids depart from the reported (tempered, unprocessed) log-probs. The decoding loop itself is
:mod:`lit_llm.policy.generation`'s."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "PREFIX_DEPENDENT_GENERATE_KWARGS", "SUPPORTED_GENERATE_KWARGS",
           "UNSUPPORTED_GENERATE_KWARGS", "GenerationConfig", "prefix_dependent_settings",
           "resolve_generation_config", "standardize_generate_kwargs", "validate_generate_kwargs"]

#: Keys accepted in ``generate_kwargs`` after standardisation (``max_tokens`` and ``n`` are accepted as aliases).
SUPPORTED_GENERATE_KWARGS = frozenset({
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "num_return_sequences", "eos_token_id", "pad_token_id", "stop_sequences", "skip_special_tokens",
    "no_repeat_ngram_size", "min_new_tokens", "num_beams",
})

_BEAM_WHY = ("beam search is not supported: the generate version returns sampled (or greedy) trajectories with the "
             "log-prob of each of their own tokens, which a beam search does not have; use num_samples / 'n' for "
             "several responses per prompt")
_DICT_WHY = ("the wrapper returns per-token log-probs itself (return_log_probs=True, the default, writes "
             "log_probs.response) and its outputs are containers, not model.generate's output dict")
#: Keys of TorchRL's / transformers' ``generate_kwargs`` that lit_llm refuses, with the reason given in the error.
UNSUPPORTED_GENERATE_KWARGS: dict[str, str] = {
    "length_penalty": _BEAM_WHY, "early_stopping": _BEAM_WHY, "num_beam_groups": _BEAM_WHY,
    "diversity_penalty": _BEAM_WHY, "constraints": _BEAM_WHY, "force_words_ids": _BEAM_WHY,
    "logprobs": _DICT_WHY, "output_scores": _DICT_WHY, "output_logits": _DICT_WHY,
    "return_dict_in_generate": _DICT_WHY,
    "encoder_repetition_penalty": "the wrapped models are decoder-only causal LMs (no encoder)",
    "bad_words_ids": "not implemented by the sampling loop (lit_llm.policy.generation.generate_tokens); mask the "
                     "ids out of the vocabulary yourself or use transformers' generate directly",
}
#: Settings whose processing depends on the row's previous tokens (or on how many were generated): the ids are then
#: sampled from a distribution other than the tempered one whose log-probs are reported (and that the log-prob
#: version scores), so an importance ratio against those log-probs is off-policy
#: (see :func:`prefix_dependent_settings`).
PREFIX_DEPENDENT_GENERATE_KWARGS = ("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens")
_LEGACY_NAMES = {"max_tokens": "max_new_tokens", "n": "num_return_sequences"}
DEFAULT_MAX_NEW_TOKENS = 128


def standardize_generate_kwargs(generate_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Rename vLLM-style keys to the transformers names, then validate (TorchRL seed semantics).

    ``max_tokens`` -> ``max_new_tokens`` and ``n`` -> ``num_return_sequences``. When both the legacy and the standard
    name are given, the legacy name wins and a ``UserWarning`` names both values.

    Args:
        generate_kwargs: user settings, or ``None`` (-> ``{}``). Not modified.

    Returns:
        A new dict with standard names only.

    Raises:
        ValueError: see :func:`validate_generate_kwargs`.
    """
    out = dict(generate_kwargs or {})
    for legacy, standard in _LEGACY_NAMES.items():
        if legacy in out:
            value = out.pop(legacy)
            if standard in out and out[standard] != value:
                warnings.warn(
                    f"generate_kwargs: both {legacy!r}={value!r} and {standard!r}={out[standard]!r} were given; the "
                    f"legacy name {legacy!r} wins ({standard}={value!r}). Pass only {standard!r}.",
                    UserWarning, stacklevel=2,
                )
            out[standard] = value
    validate_generate_kwargs(out)
    return out


def validate_generate_kwargs(generate_kwargs: dict[str, Any]) -> None:
    """Check standardised ``generate_kwargs``; raise on the first invalid setting.

    Rules (TorchRL's ``_validate_parameter_combinations`` plus unknown keys and types): ``temperature``, ``top_p``,
    ``min_p``, ``repetition_penalty`` are real numbers (not NaN), ``top_k``, ``max_new_tokens``,
    ``num_return_sequences`` integers, ``do_sample`` a bool; ``temperature >= 0``;
    ``0 <= top_p <= 1``; ``top_k > 0`` (``None`` = off); ``0 <= min_p <= 1``; ``repetition_penalty > 0``;
    ``max_new_tokens >= 1``; ``num_return_sequences >= 1``; an explicitly passed non-zero ``temperature`` together
    with ``do_sample=False`` is contradictory; ``do_sample=True`` with ``temperature=0`` too.

    Also: ``stop_sequences`` a non-empty string or a list of them; ``skip_special_tokens`` a bool;
    ``no_repeat_ngram_size`` and ``min_new_tokens`` non-negative integers (0 = off), ``min_new_tokens <=
    max_new_tokens``; ``num_beams`` only 1. The keys of :data:`UNSUPPORTED_GENERATE_KWARGS` (beam-search settings,
    ``logprobs`` / ``output_scores``-style output switches, ...) raise with the reason.

    Args:
        generate_kwargs: standardised settings (see :func:`standardize_generate_kwargs`).

    Raises:
        ValueError: an unsupported key (named, with why), an unknown key (the message lists the supported ones) or
            one of the rules above; the message names the key, the value and the fix.
    """
    for key in generate_kwargs:
        if key in UNSUPPORTED_GENERATE_KWARGS:
            raise ValueError(f"generate_kwargs: {key!r} is not supported: {UNSUPPORTED_GENERATE_KWARGS[key]}. "
                             f"Remove {key!r}.")
    unknown = sorted(set(generate_kwargs) - SUPPORTED_GENERATE_KWARGS)
    if unknown:
        raise ValueError(
            f"generate_kwargs: unsupported key(s) {unknown}. Supported: {sorted(SUPPORTED_GENERATE_KWARGS)} "
            f"(aliases: 'max_tokens', 'n'). Remove them or use transformers directly."
        )
    g = generate_kwargs.get
    beams = g("num_beams")
    if beams is not None and (isinstance(beams, bool) or not isinstance(beams, numbers.Integral) or beams != 1):
        raise ValueError(f"generate_kwargs: num_beams={beams!r} is not supported: {_BEAM_WHY}. Remove num_beams "
                         f"(or pass 1).")
    stops = g("stop_sequences")
    if stops is not None:
        items = [stops] if isinstance(stops, str) else stops
        if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x for x in items):
            raise ValueError(f"generate_kwargs: stop_sequences must be a non-empty string or a list of non-empty "
                             f"strings, got {stops!r}.")
    if g("skip_special_tokens") is not None and not isinstance(g("skip_special_tokens"), bool):
        raise ValueError(f"generate_kwargs: skip_special_tokens must be a bool, got {g('skip_special_tokens')!r}.")
    for key in ("no_repeat_ngram_size", "min_new_tokens"):
        value = g(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
            raise ValueError(f"generate_kwargs: {key} must be a non-negative integer (0 = off), got {value!r}.")
    if g("min_new_tokens") and g("max_new_tokens") is not None and g("min_new_tokens") > g("max_new_tokens"):
        raise ValueError(f"generate_kwargs: min_new_tokens={g('min_new_tokens')} exceeds max_new_tokens="
                         f"{g('max_new_tokens')}; lower min_new_tokens or raise max_new_tokens.")
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = g(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value):
            raise ValueError(f"generate_kwargs: {key} must be a real number (or None), got {value!r}.")
    for key in ("top_k", "max_new_tokens", "num_return_sequences"):
        value = g(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise ValueError(f"generate_kwargs: {key} must be an integer (or None), got {value!r}.")
    if g("do_sample") is not None and not isinstance(g("do_sample"), bool):
        raise ValueError(f"generate_kwargs: do_sample must be a bool (or None), got {g('do_sample')!r}.")
    temperature = g("temperature")
    if temperature is not None and temperature < 0:
        raise ValueError(f"generate_kwargs: temperature must be non-negative, got {temperature}. Use 0 for greedy "
                         f"decoding or a positive value for sampling.")
    top_p = g("top_p")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"generate_kwargs: top_p must be between 0 and 1, got {top_p}. Use 1.0 (or None) to "
                         f"disable nucleus filtering.")
    top_k = g("top_k")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"generate_kwargs: top_k must be positive, got {top_k}. Use None to disable top-k "
                         f"filtering.")
    min_p = g("min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise ValueError(f"generate_kwargs: min_p must be between 0 and 1, got {min_p}.")
    penalty = g("repetition_penalty")
    if penalty is not None and penalty <= 0:
        raise ValueError(f"generate_kwargs: repetition_penalty must be positive, got {penalty}. Use 1.0 (or None) "
                         f"for no penalty.")
    for key in ("max_new_tokens", "num_return_sequences"):
        value = g(key)
        if value is not None and value < 1:
            raise ValueError(f"generate_kwargs: {key} must be a positive integer, got {value!r}.")
    do_sample = g("do_sample")
    if do_sample is False and temperature not in (None, 0):
        raise ValueError(
            f"generate_kwargs: do_sample=False (greedy decoding) contradicts temperature={temperature}. Remove "
            f"temperature (or set it to 0) for greedy decoding, or set do_sample=True to sample."
        )
    if do_sample is True and temperature == 0:
        raise ValueError("generate_kwargs: do_sample=True with temperature=0 cannot sample. Use a temperature > 0, "
                         "or do_sample=False for greedy decoding.")


def _as_id_tuple(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (int(value),)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class GenerationConfig:
    """Resolved generation settings (one per wrapper).

    Attributes:
        max_new_tokens: maximum number of sampled tokens per row (a row that reaches it without a stop token is
            truncated).
        do_sample: sample (``True``) or take the argmax of the processed scores (``False``, greedy).
        temperature: sampling temperature; also the temperature of the reported log-probs. ``1.0`` when greedy
            (greedy log-probs are those of the unscaled distribution).
        top_k: keep the ``top_k`` highest scores before sampling; ``None`` = off.
        top_p: nucleus filtering threshold; ``None`` = off.
        min_p: min-p filtering threshold; ``None`` = off.
        repetition_penalty: CTRL repetition penalty (Keskar et al. 2019); ``None`` = off.
        num_return_sequences: responses per prompt requested through ``generate_kwargs`` (``n``).
        eos_token_ids: every id that stops a row (DESIGN.md property 5).
        pad_token_id: id written after a row stopped, in padded outputs only.
        stop_sequences: strings that end a row at the token whose decoded text completes one (that token is the
            response's last); ``()`` = none.
        skip_special_tokens: decode the response text (``text.response``, the reply's History content) without
            special tokens. The ids are unaffected.
        no_repeat_ngram_size: forbid any n-gram of this size from occurring twice in a row's real tokens (prompt and
            response; transformers' ``NoRepeatNGramLogitsProcessor``); ``None`` = off.
        min_new_tokens: no row stops (eos id or stop string) before it has this many tokens; eos ids are masked out
            of the scores until then. ``0`` = off.
    """

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    num_return_sequences: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    stop_sequences: tuple[str, ...] = ()
    skip_special_tokens: bool = False
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int = 0


def resolve_generation_config(generate_kwargs: dict[str, Any] | None, model: Any,
                              tokenizer: Any | None = None) -> GenerationConfig:
    """Standardise ``generate_kwargs`` and fill the rest from the model's generation config.

    Sampling settings come from ``generate_kwargs`` only (default: greedy), never from
    ``model.generation_config``, so the temperature of the reported log-probs is always the one the caller chose.
    ``do_sample`` defaults to ``True`` when a positive ``temperature`` is given, else ``False``; ``temperature=0``
    means greedy. ``eos_token_id`` defaults to ``model.generation_config.eos_token_id`` (an int or a list: every id
    stops a row), then ``model.config.eos_token_id``, then ``tokenizer.eos_token_id``. ``max_new_tokens`` defaults to
    ``model.generation_config.max_new_tokens`` or 128.

    Args:
        generate_kwargs: user settings (see :data:`SUPPORTED_GENERATE_KWARGS`).
        model: an HF causal LM (its ``generation_config`` / ``config`` are read).
        tokenizer: optional tokenizer used as the last fallback for eos/pad ids.

    Returns:
        A :class:`GenerationConfig`.

    Raises:
        ValueError: invalid ``generate_kwargs`` (see :func:`validate_generate_kwargs`), or no eos id anywhere.
    """
    kw = standardize_generate_kwargs(generate_kwargs)
    gen_cfg = getattr(model, "generation_config", None)
    cfg = getattr(model, "config", None)
    eos = _as_id_tuple(kw.get("eos_token_id"))
    for source in (gen_cfg, cfg, tokenizer):
        if not eos and source is not None:
            eos = _as_id_tuple(getattr(source, "eos_token_id", None))
    if not eos:
        raise ValueError("generate_kwargs: no eos_token_id in generate_kwargs, model.generation_config, model.config "
                         "or the tokenizer; pass generate_kwargs={'eos_token_id': ...}.")
    pad = kw.get("pad_token_id")
    for source in (gen_cfg, cfg, tokenizer):
        if pad is None and source is not None:
            pad = getattr(source, "pad_token_id", None)
    temperature = kw.get("temperature")
    do_sample = kw.get("do_sample")
    if do_sample is None:
        do_sample = temperature is not None and temperature > 0
    max_new = kw.get("max_new_tokens") or getattr(gen_cfg, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
    penalty = kw.get("repetition_penalty")
    min_new = int(kw.get("min_new_tokens") or 0)
    if min_new > int(max_new):
        raise ValueError(f"generate_kwargs: min_new_tokens={min_new} exceeds max_new_tokens={int(max_new)} (from the "
                         f"model's generation config or the default); lower min_new_tokens or pass max_new_tokens.")
    stops = kw.get("stop_sequences") or ()
    return GenerationConfig(
        max_new_tokens=int(max_new),
        do_sample=bool(do_sample),
        temperature=float(temperature) if (do_sample and temperature is not None) else 1.0,
        top_k=kw.get("top_k"),
        top_p=None if kw.get("top_p") in (None, 1.0) else float(kw["top_p"]),
        min_p=None if kw.get("min_p") in (None, 0.0) else float(kw["min_p"]),
        repetition_penalty=None if penalty in (None, 1.0) else float(penalty),
        num_return_sequences=int(kw.get("num_return_sequences") or 1),
        eos_token_ids=eos,
        pad_token_id=int(pad if pad is not None else eos[0]),
        stop_sequences=(stops,) if isinstance(stops, str) else tuple(stops),
        skip_special_tokens=bool(kw.get("skip_special_tokens", False)),
        no_repeat_ngram_size=kw.get("no_repeat_ngram_size") or None,
        min_new_tokens=min_new,
    )


def prefix_dependent_settings(config: GenerationConfig) -> list[str]:
    """The active settings of ``config`` that make the sampled ids depart from the reported log-probs.

    The generate version reports (and the log-prob version scores) ``log_softmax(z / T)`` of the raw logits ``z``.
    ``repetition_penalty`` and ``no_repeat_ngram_size`` change the scores as a function of the row's earlier tokens,
    and ``min_new_tokens`` as a function of how many were generated, so tokens are sampled from another
    distribution than the one whose log-probs are reported: an importance ratio (GRPO/PPO) against those log-probs
    is off-policy by an unknown amount. A consumer that needs on-policy log-probs should refuse these settings unless
    it recomputes the old log-probs under the same processing.

    Args:
        config: resolved settings.

    Returns:
        The names (in :data:`PREFIX_DEPENDENT_GENERATE_KWARGS`) whose setting is active, in that order.
    """
    active = {"repetition_penalty": config.repetition_penalty is not None,
              "no_repeat_ngram_size": config.no_repeat_ngram_size is not None,
              "min_new_tokens": config.min_new_tokens > 0}
    return [k for k in PREFIX_DEPENDENT_GENERATE_KWARGS if active[k]]
