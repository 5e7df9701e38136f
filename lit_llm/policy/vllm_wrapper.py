"""``vLLMWrapper``: a vLLM engine as a TorchRL-style policy, beside :class:`TransformersWrapper` on the same
:class:`~lit_llm.policy.common.LLMWrapperBase` (TorchRL's ``torchrl/modules/llm/policies/vllm_wrapper.py``).

The two versions read their inputs and build their outputs exactly as ``TransformersWrapper``'s do
(:class:`~lit_llm.policy.generate_version.GenerateVersionMixin`,
:class:`~lit_llm.policy.logprob_version.LogProbVersionMixin`, :class:`~lit_llm.policy.inputs.LogProbInputsMixin`);
only the backend half differs: :meth:`vLLMWrapper._sample` (``LLM.generate`` on token-id prompts, one ``n = 1``
request per sample) and :meth:`vLLMWrapper._full_log_probs` (vLLM's prompt log-probs). Prompts are rendered by
lit_llm (``History.apply_chat_template`` with the wrapper's template) and sent as ``TokensPrompt`` ids, never through
``LLM.chat``; the returned ``token_ids`` are kept as they are, the stop token (an eos id or the token that completes a
stop string) ends the response and stays in it (DESIGN.md properties 1, 5, 9). vLLM is imported lazily
(:func:`~lit_llm.policy.vllm_engine.require_vllm`).
"""

from __future__ import annotations

import numbers
import os
import weakref
from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from lit_llm.policy.common import LLMWrapperBase
from lit_llm.policy.generate_version import SAMPLING_SEED_KEY, GenerateVersionMixin
from lit_llm.policy.generation import (
    GenerationOutput,
    check_token_ids,
    resolve_generation_config,
    standardize_generate_kwargs,
)
from lit_llm.policy.generation_config import SUPPORTED_GENERATE_KWARGS, UNSUPPORTED_GENERATE_KWARGS
from lit_llm.policy.inputs import LogProbInputsMixin
from lit_llm.policy.logprob_version import LogProbVersionMixin
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.policy.vllm_engine import (
    EngineModel,
    engine_lock,
    is_vllm_engine,
    load_weights,
    make_engine,
    require_vllm,
)

__all__ = ["NO_VLLM_MAPPING", "SAMPLING_SEED_KEY", "WRAPPER_SETTINGS", "vLLMWrapper"]

#: Standardised ``generate_kwargs`` that vLLM's ``SamplingParams`` has no equivalent for (refused, with the reason).
NO_VLLM_MAPPING = {
    "no_repeat_ngram_size": "vLLM's SamplingParams has no n-gram blocking; drop it or use TransformersWrapper",
}
_ALIASES = ("max_tokens", "n")
#: The wrapper settings vLLMWrapper passes on to :meth:`LLMWrapperBase._init_common` as keyword arguments, with their
#: defaults (TransformersWrapper's).
WRAPPER_SETTINGS: dict[str, Any] = {
    "input_key": None, "pad_output": False, "inplace": None, "return_log_probs": None, "return_text": None,
    "return_tokens": None, "return_masks": None, "return_history": None, "history_key": "history", "text_key": "text",
    "tokens_key": "tokens", "masks_key": "masks", "log_probs_key": "log_probs", "batching": None,
    "min_batch_size": None, "max_batch_size": None, "batching_timeout": 10.0,
}
_NO_DIST = ("vLLM returns the log-probs of given ids, not logits or hidden states, so there is no masked "
            "distribution to build; the loss needs TransformersWrapper's log-prob version "
            "(TransformersWrapper(model, ...).get_new_version(generate=False))")


class vLLMWrapper(GenerateVersionMixin, LogProbVersionMixin, LogProbInputsMixin, LLMWrapperBase):  # noqa: N801
    """A vLLM engine wrapped as a tensordict module (TorchRL's ``vLLMWrapper`` name and surface).

    Args:
        model: a ``vllm.LLM`` (shared, never copied, by every :meth:`get_new_version`), or anything
            :func:`~lit_llm.models.resolve_model_path` takes (``"tiny-vllm"``, ``"smollm2-135m-instruct"``, a local HF
            folder, a cached Hub id): then an in-process engine is built by
            :func:`~lit_llm.policy.vllm_engine.make_engine` with ``engine_kwargs``.
        tokenizer: the HF tokenizer prompts are rendered and responses decoded with; default: loaded from the
            engine's model folder (:func:`lit_llm.models.load_tokenizer`), not vLLM's wrapped copy.
        input_mode, generate, num_samples, chat_template, chat_template_name, tokenizer_kwargs, attention_mask_key:
            as in :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`.
        **settings: the other settings of TransformersWrapper, same names, meaning and defaults
            (:data:`WRAPPER_SETTINGS`: ``input_key``, ``pad_output``, ``inplace``, ``return_log_probs``,
            ``return_text`` / ``return_tokens`` / ``return_masks`` / ``return_history``, the output keys, ``batching``,
            ``min_batch_size``, ``max_batch_size``, ``batching_timeout``); any other keyword is a ``TypeError``.
        generate_kwargs: TorchRL's standardised names (``max_tokens`` and ``n`` accepted as aliases), mapped to
            ``SamplingParams``: ``max_new_tokens`` -> ``max_tokens``; ``do_sample=False`` / no temperature ->
            ``temperature=0`` (greedy); ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``;
            ``min_new_tokens`` -> ``min_tokens``; ``stop_sequences`` -> ``stop``; ``eos_token_id`` (default: the
            model's generation config) -> ``stop_token_ids`` with ``ignore_eos=True`` (exactly those ids stop a
            row); ``num_return_sequences`` / ``n`` -> ``num_samples`` (one ``n = 1`` request per sample);
            ``skip_special_tokens`` (response text only), ``pad_token_id`` (padded outputs only), ``num_beams=1``.
            Refused, naming the key: ``no_repeat_ngram_size`` (:data:`NO_VLLM_MAPPING`), the keys of
            :data:`~lit_llm.policy.generation_config.UNSUPPORTED_GENERATE_KWARGS`, and any other key (vLLM's own
            ``presence_penalty``, ``ignore_eos``, ... have no standardised name).
        device: where the output tensors are put (default CPU; vLLM returns Python lists).
        pad_model_input: TorchRL's argument; vLLM takes unpadded token lists, so any value but ``None`` raises.
        temperature: log-prob version: must be 1.0 (default ``None`` = the sampling temperature of
            ``generate_kwargs``, 1.0 when greedy). vLLM's prompt log-probs are untempered ``log_softmax(z)``.
        engine_kwargs: keyword arguments of :func:`~lit_llm.policy.vllm_engine.make_engine` when ``model`` is a name
            or folder (``dtype``, ``seed``, ``max_model_len``, ``kv_cache_gib``, ``enforce_eager``, ...); refused
            with a ``vllm.LLM``.

    Log-probs. Generate version: vLLM's ``processed_logprobs`` of each sampled id (the engine must run with
    ``logprobs_mode="processed_logprobs"``; :func:`~lit_llm.policy.vllm_engine.make_engine` sets it, another
    ``vllm.LLM`` is refused): with ``top_p=1``, no ``top_k`` / ``min_p`` and no penalty, exactly
    ``log_softmax(z / T)[x_t]`` of the full vocabulary, as :class:`TransformersWrapper` reports; with truncation or a
    penalty, vLLM's log-probs are those of the truncated / penalised distribution (TransformersWrapper's stay the
    tempered full one), so an importance ratio against the trainer's log-prob version is then off by that processing.
    Greedy: ``log_softmax(z)``. Log-prob version: ``log_probs.full[t] = log_softmax(z_{t-1})[x_t]`` from vLLM's
    prompt log-probs (prefix cache bypassed by vLLM for such requests), 0.0 at position 0.

    Sampling seeds: as in :class:`TransformersWrapper`, the per-row ``"sampling_seed"`` gives sample ``k`` of row
    ``b`` the seed :func:`row_seed(sampling_seed[b], k) <lit_llm.policy.sampling.row_seed>` (or the per-sample
    ``[B, n]`` form), passed as ``SamplingParams(seed=...)`` of its own ``n = 1`` request: its ids depend only on that
    seed and the engine's weights, not on the other rows or the batch composition. The streams differ from
    TransformersWrapper's (vLLM's sampler draws Gumbel noise, lit_llm's loop draws inverse-CDF uniforms). Without the
    key, rows draw from the engine's own generator (seeded by its ``seed``; depends on the batch).

    Not supported (raise ``NotImplementedError`` naming :class:`TransformersWrapper`): ``get_dist``, the
    ``get_*_dist`` family, ``head_mask`` and ``forward(..., logits_only=True)``: vLLM has no hidden states to build
    the chunked distributions from.

    Raises:
        ImportError: vLLM is not installed (one line naming ``make setup-vllm``).
        ValueError: invalid settings, each named (a generate kwarg without a vLLM mapping, a log-prob version
            temperature other than 1, an engine whose ``logprobs_mode`` is not ``processed_logprobs``, ...); see also
            :class:`~lit_llm.policy.common.LLMWrapperBase`.
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        input_mode: Literal["history", "text", "tokens"] = "history",
        generate: bool = True,
        generate_kwargs: dict[str, Any] | None = None,
        num_samples: int | None = None,
        temperature: float | None = None,
        chat_template: str | None = None,
        chat_template_name: str | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        attention_mask_key: NestedKey = "attention_mask",
        pad_model_input: bool | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        unknown = sorted(set(settings) - set(WRAPPER_SETTINGS))
        if unknown:
            raise TypeError(f"vLLMWrapper: unexpected keyword arguments {unknown}; the wrapper settings besides the "
                            f"named ones are {sorted(WRAPPER_SETTINGS)}.")
        model = _resolve_engine(model, engine_kwargs)
        mode = model.llm_engine.model_config.logprobs_mode
        if mode != "processed_logprobs":
            raise ValueError(f"vLLMWrapper: the engine runs with logprobs_mode={mode!r}, whose log-probs ignore the "
                             f"sampling temperature; build it with logprobs_mode='processed_logprobs' (or pass the "
                             f"model name / folder and let vLLMWrapper build it).")
        self._engine_model, default_tokenizer = _engine_info(model)
        tokenizer = default_tokenizer if tokenizer is None else tokenizer
        _check_generate_kwargs(generate_kwargs)
        self.generate_kwargs = standardize_generate_kwargs(generate_kwargs)
        self.generation_config = resolve_generation_config(self.generate_kwargs, self._engine_model, tokenizer)
        self._user_temperature, self._user_num_samples = temperature, num_samples
        if generate:
            num_samples = _samples_per_prompt(num_samples, self.generate_kwargs, self.generation_config)
        self.temperature = _log_prob_temperature(temperature, self.generation_config.temperature, generate)
        self._set_template_options(chat_template, chat_template_name, tokenizer_kwargs)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.attention_mask_key = attention_mask_key
        if pad_model_input is not None:
            raise ValueError(f"pad_model_input={pad_model_input!r} is not supported by vLLMWrapper (TorchRL's rule): "
                             f"vLLM takes unpadded token lists. Leave pad_model_input None.")
        self._init_common(model=model, tokenizer=tokenizer, input_mode=input_mode, generate=generate,
                          num_samples=num_samples, **{**WRAPPER_SETTINGS, **settings})

    # the same reading of inputs as TransformersWrapper (no model call in these)
    _k = TransformersWrapper._k
    _missing = TransformersWrapper._missing
    _tokens_padded = TransformersWrapper._tokens_padded
    _check_not_padded_without_mask = TransformersWrapper._check_not_padded_without_mask
    _encode = TransformersWrapper._encode
    _decode = TransformersWrapper._decode
    _forward_impl = TransformersWrapper._forward_impl

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "generate_kwargs": dict(self.generate_kwargs),
                "tokenizer_kwargs": dict(self.tokenizer_kwargs), "device": self._device,
                "chat_template": None if self.chat_template_name else self.chat_template,
                "chat_template_name": self.chat_template_name, "temperature": self._user_temperature,
                "num_samples": self._user_num_samples, "attention_mask_key": self.attention_mask_key}

    @property
    def device(self) -> torch.device:
        """Where output tensors go (the ``device`` argument, default CPU)."""
        return self._device

    def load_weights(self, weights: Any) -> None:
        """Push ``(name, tensor)`` pairs of an HF model into the engine in place and reset its prefix cache; see
        :func:`lit_llm.policy.vllm_engine.load_weights` (every version of this wrapper shares the engine)."""
        load_weights(self.model, weights)

    # ---------------------------------------------------------------------------------------------- generate
    def _sampling_kwargs(self) -> dict[str, Any]:
        """``SamplingParams`` keywords of one ``n = 1`` request, seed aside (see the class docstring for the
        mapping)."""
        c = self.generation_config
        kw: dict[str, Any] = dict(n=1, max_tokens=c.max_new_tokens, temperature=c.temperature if c.do_sample else 0.0,
                                  logprobs=0 if self.return_log_probs else None, ignore_eos=True,
                                  stop_token_ids=list(c.eos_token_ids), min_tokens=c.min_new_tokens,
                                  detokenize=bool(c.stop_sequences))
        if c.do_sample:
            kw.update(top_k=c.top_k or 0, top_p=1.0 if c.top_p is None else c.top_p, min_p=c.min_p or 0.0)
        if c.repetition_penalty is not None:
            kw["repetition_penalty"] = c.repetition_penalty
        if c.stop_sequences:
            kw["stop"] = list(c.stop_sequences)
        return kw

    def _sample(self, prompts: list[Tensor], seeds: list[int] | None, n: int) -> GenerationOutput:
        """``n`` samples of each prompt (b-major), one ``n = 1`` request each, in one ``LLM.generate`` call."""
        vllm = require_vllm()
        check_token_ids(self._engine_model, prompts, extra=self.generation_config.max_new_tokens,
                        max_context=self._engine_model.max_model_len, what=f"{type(self).__name__}: prompt")
        requests = [vllm.inputs.TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
        kw = self._sampling_kwargs()
        params = (vllm.SamplingParams(**kw) if seeds is None
                  else [vllm.SamplingParams(**kw, seed=s) for s in seeds])  # b-major, one per sample
        with engine_lock(self.model):
            outs = self.model.generate([r for r in requests for _ in range(n)], params, use_tqdm=False)
        dev = self.device
        ids, lps, truncated = [], [], []
        for out in outs:
            c = out.outputs[0]
            row = [int(t) for t in c.token_ids]
            ids.append(torch.tensor(row, dtype=torch.long, device=dev))
            if c.logprobs is not None:
                lps.append(torch.tensor([step[t].logprob for step, t in zip(c.logprobs, row)], dtype=torch.float32,
                                        device=dev))
            else:
                lps.append(torch.zeros(len(row), dtype=torch.float32, device=dev))
            truncated.append(c.finish_reason == "length")
        return GenerationOutput(ids, lps, torch.tensor(truncated, dtype=torch.bool, device=dev))

    # ---------------------------------------------------------------------------------------------- log-probs
    def _full_log_probs(self, full: list[Tensor]) -> list[Tensor]:
        """``log_softmax(z_{t-1})[x_t]`` per row from vLLM's prompt log-probs (one token generated and dropped)."""
        vllm = require_vllm()
        name = type(self).__name__
        check_token_ids(self._engine_model, full, extra=1, max_context=self._engine_model.max_model_len,
                        what=f"{name} (log-prob version): tokens.full")
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                                     ignore_eos=True)
        rows = [f.tolist() for f in full]
        with engine_lock(self.model):
            outs = self.model.generate([vllm.inputs.TokensPrompt(prompt_token_ids=r) for r in rows], params,
                                       use_tqdm=False)
        result = []
        for b, (out, row) in enumerate(zip(outs, rows)):
            scored = out.prompt_logprobs
            if scored is None or len(scored) != len(row):
                got = "none" if scored is None else len(scored)
                raise RuntimeError(f"{name} (log-prob version): row {b}: vLLM returned {got} prompt log-probs for "
                                   f"{len(row)} ids (a prefix served from its cache?); cannot score the row.")
            values = [0.0] + [scored[t][row[t]].logprob for t in range(1, len(row))]
            result.append(torch.tensor(values, dtype=torch.float32, device=self.device))
        return result

    # ---------------------------------------------------------------------------------------------- no dists
    def _no_dist(self, name: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__}.{name} is not supported: {_NO_DIST}.")

    def get_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Not supported: raises ``NotImplementedError`` naming :class:`TransformersWrapper`."""
        raise self._no_dist("get_dist")

    def get_sft_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Not supported (see :meth:`get_dist`)."""
        raise self._no_dist("get_sft_dist")

    def get_rlhf_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Not supported (see :meth:`get_dist`)."""
        raise self._no_dist("get_rlhf_dist")

    def get_generic_dist(self, tensordict: TensorDictBase, **kwargs: Any):
        """Not supported (see :meth:`get_dist`)."""
        raise self._no_dist("get_generic_dist")

    def head_mask(self, tensordict: TensorDictBase, head: str) -> Tensor:
        """Not supported (see :meth:`get_dist`)."""
        raise self._no_dist("head_mask")

    _get_sft_dist = get_sft_dist
    _get_rlhf_dist = get_rlhf_dist
    _get_generic_dist = get_generic_dist
    _get_dist_with_prompt_mask = get_sft_dist
    _get_dist_with_assistant_mask = get_rlhf_dist
    _get_dist_with_attention_mask = get_generic_dist

    def _get_dist_with_custom_mask(self, tensordict: TensorDictBase, mask: Tensor, **kwargs: Any):
        raise self._no_dist("_get_dist_with_custom_mask")

    def _aligned_logits(self, td: TensorDictBase) -> TensorDictBase:
        raise self._no_dist("forward(logits_only=True)")


def _resolve_engine(model: Any, engine_kwargs: dict[str, Any] | None) -> Any:
    """The ``vllm.LLM`` of the ``model`` argument (built from a name / folder with ``engine_kwargs``).

    Raises:
        ImportError: vLLM is not installed (names ``make setup-vllm``).
        ValueError: ``engine_kwargs`` with a ``vllm.LLM``; anything else than an engine, a name or a folder.
    """
    require_vllm()
    if is_vllm_engine(model):
        if engine_kwargs:
            raise ValueError(f"vLLMWrapper: engine_kwargs {sorted(engine_kwargs)} only apply when the wrapper builds "
                             f"the engine (model given by name or folder); the vllm.LLM passed is already built.")
        return model
    if isinstance(model, (str, os.PathLike)):
        return make_engine(model, **(engine_kwargs or {}))
    raise ValueError(f"vLLMWrapper: model must be a vllm.LLM, a model name or a local folder; got "
                     f"{type(model).__name__} (an HF model goes in TransformersWrapper).")


def _samples_per_prompt(num_samples: int | None, generate_kwargs: dict[str, Any], config: Any) -> int | None:
    """``num_samples`` of the generate version: the argument, or ``generate_kwargs``' ``n`` / ``num_return_sequences``
    (``None`` for 1); both given and different raises."""
    if "num_return_sequences" not in generate_kwargs:
        return num_samples
    n = config.num_return_sequences
    if num_samples is not None and num_samples != n:
        raise ValueError(f"num_samples={num_samples} contradicts generate_kwargs num_return_sequences/n={n}; pass "
                         f"only one of them.")
    return num_samples if num_samples is not None else (n if n > 1 else None)


_ENGINE_INFO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _engine_info(llm: Any) -> tuple[EngineModel, Any]:
    """``(EngineModel, tokenizer)`` of an engine, read once per engine (every wrapper over it shares them): the
    tokenizer is loaded from the engine's model folder by :func:`lit_llm.models.load_tokenizer`."""
    if llm not in _ENGINE_INFO:
        from lit_llm.models import load_tokenizer

        info = EngineModel.of(llm)
        _ENGINE_INFO[llm] = (info, load_tokenizer(info.path))
    return _ENGINE_INFO[llm]


def _check_generate_kwargs(generate_kwargs: dict[str, Any] | None) -> None:
    """Refuse, by name, the keys that have no ``SamplingParams`` mapping here (the rest is checked by
    :func:`~lit_llm.policy.generation.resolve_generation_config`)."""
    for key, value in (generate_kwargs or {}).items():
        if key in NO_VLLM_MAPPING and value not in (None, 0):
            raise ValueError(f"vLLMWrapper: generate_kwargs {key!r} is not supported: {NO_VLLM_MAPPING[key]}.")
        if key not in SUPPORTED_GENERATE_KWARGS and key not in UNSUPPORTED_GENERATE_KWARGS and key not in _ALIASES:
            raise ValueError(f"vLLMWrapper: generate_kwargs {key!r} has no mapping to vLLM's SamplingParams here; "
                             f"supported (TorchRL's standardised names): {sorted(SUPPORTED_GENERATE_KWARGS)} "
                             f"(aliases 'max_tokens', 'n'). Remove {key!r}.")


def _log_prob_temperature(temperature: float | None, sampling: float, generate: bool) -> float:
    """The wrapper's ``temperature``: the log-prob version's must be 1 (vLLM's prompt log-probs are untempered)."""
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
                                    or not temperature > 0):
        raise ValueError(f"temperature (log-prob version) must be > 0, got {temperature!r}.")
    value = float(sampling if temperature is None else temperature)
    if not generate and value != 1.0:
        origin = "temperature" if temperature is not None else "temperature (from generate_kwargs['temperature'])"
        raise ValueError(f"vLLMWrapper (log-prob version): {origin}={value} is not supported: vLLM's prompt log-probs "
                         f"are untempered log_softmax(z). Pass temperature=1.0, or score tempered log-probs with "
                         f"TransformersWrapper(...).get_new_version(generate=False).")
    return value
