"""``TransformersWrapper``: a Hugging Face causal LM as a TorchRL-style policy (generate and log-prob versions).

Generate version (``generate=True``): prompt (History / text / ids) -> left-padded ids ->
:func:`~lit_llm.policy.generation.generate_tokens` (KV cache, every eos id of the generation config stops a row,
sampled ids and their log-probs kept) -> outputs.
Log-prob version (``generate=False``): full sequence -> :func:`~lit_llm.policy.logprobs.model_token_log_probs`
(chunked LM head, never ``[B, T, V]`` logits) -> ``log_probs.full``. When the input carries ``tokens.full`` (e.g. the
generate version's output) those ids are scored as they are: decoded text is never re-tokenised (DESIGN.md
property 1). The masked distributions of the log-prob version (``get_dist`` / ``get_sft_dist`` / ``get_rlhf_dist`` /
``get_generic_dist``, masks from ``head_mask``) are
:class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical` over the backbone's hidden states (one backbone pass,
the chunked LM head on masked-in positions only); see :meth:`LLMWrapperBase.get_dist` for the dense, ragged and GRPO
prompt/completion layouts. How the log-prob version reads its input (full ids, assistant masks, prompt lengths, the
distribution layout) is :class:`~lit_llm.policy.inputs.LogProbInputsMixin`; the two versions' forward passes are
:class:`~lit_llm.policy.generate_version.GenerateVersionMixin` and
:class:`~lit_llm.policy.logprob_version.LogProbVersionMixin`. This module holds the settings and the input helpers
they share.

Output keys (defaults): ``text`` (:class:`Text`, history/text modes), ``tokens`` (:class:`Tokens`), ``masks``
(:class:`Masks`), ``log_probs`` (:class:`LogProbs`), ``history`` (:class:`ChatHistory`, history mode) and, for
generation, ``truncated`` (``[B]`` bool, TorchRL's name: the row hit ``max_new_tokens`` without a stop token).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from tensordict import NestedKey, TensorDictBase
from torch import Tensor

from lit_llm.policy.common import LLMWrapperBase
from lit_llm.policy.generate_version import SAMPLING_SEED_KEY, GenerateVersionMixin
from lit_llm.policy.generation import resolve_generation_config, standardize_generate_kwargs
from lit_llm.policy.inputs import LogProbInputsMixin
from lit_llm.policy.logprob_version import LogProbVersionMixin
from lit_llm.policy.rows import _key

__all__ = ["SAMPLING_SEED_KEY", "TransformersWrapper"]


class TransformersWrapper(GenerateVersionMixin, LogProbVersionMixin, LogProbInputsMixin, LLMWrapperBase):
    """A transformers causal LM wrapped as a tensordict module (TorchRL's ``TransformersWrapper`` API).

    Args:
        model: an HF ``*ForCausalLM`` (shared, never copied, by every :meth:`get_new_version`), or a ``peft``
            ``PeftModel`` over one (LoRA): generation and the log-prob kernel run its ``get_base_model()``, which
            holds the adapter layers, so both versions compute the adapted model.
        tokenizer: its tokenizer (required except in ``"tokens"`` mode).
        input_mode: ``"history"`` (chat messages, rendered with ``chat_template``), ``"text"`` (strings tokenised
            with ``tokenizer_kwargs``) or ``"tokens"`` (1-D id tensors).
        input_key: the nested key to read; default ``(<mode key>, "prompt")`` when generating,
            ``(<mode key>, "full")`` otherwise.
        generate: generate version (``True``) or log-prob version (``False``).
        generate_kwargs: ``max_new_tokens`` (alias ``max_tokens``), ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``min_p``, ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``,
            ``stop_sequences`` (a stop string ends the response at the token that completes it; that token is in
            the response and the masks, like an eos token), ``skip_special_tokens`` (response text and History
            content only; ids untouched), ``num_return_sequences`` (alias ``n``), ``num_beams`` (1 only),
            ``eos_token_id``, ``pad_token_id``; see :class:`~lit_llm.policy.generation.GenerationConfig` for their
            meaning, :func:`~lit_llm.policy.generation.resolve_generation_config` for defaults and
            :func:`~lit_llm.policy.generation.validate_generate_kwargs` for the errors (beam search, ``logprobs``
            and the other keys of :data:`~lit_llm.policy.generation.UNSUPPORTED_GENERATE_KWARGS` raise with the
            reason). Reported log-probs stay those of the tempered raw distribution whatever the processing (see
            :func:`~lit_llm.policy.generation.prefix_dependent_settings`).
        tokenizer_kwargs: extra ``tokenizer(...)`` kwargs in text mode (default ``add_special_tokens=False``).
        pad_output: ``[B, T]`` padded outputs (prompt left-, response right-, full left-padded) instead of ragged
            lazy stacks. Both hold the same numbers.
        inplace: ``True`` (write into the input), ``False`` (new tensordict: input entries + outputs), ``"empty"``
            (outputs only); ``None`` = ``True`` unless ``num_samples`` is set (then ``False``).
        device: where inputs are moved (default: the model's device).
        num_samples: responses per prompt; output batch shape ``[B, num_samples]`` (default ``None``: ``[B]``).
            Also set by ``generate_kwargs["n"]``.
        chat_template: Jinja string, ``.jinja`` path or template name for history mode (default: the tokenizer's).
        chat_template_name: TorchRL's name for the template (``"chatml_format"``, ``"qwen"``, ``"llama3"``, ...;
            :data:`lit_llm.data.chat_template.CHAT_TEMPLATE_FILES`, read from the shared template folder);
            exclusive with ``chat_template``.
        return_log_probs: generate version: write ``log_probs.response`` and ``log_probs.full`` (zeros over the
            prompt). Default ``True``. Must not be ``False`` for the log-prob version.
        return_text, return_tokens, return_masks, return_history: write the ``text`` / ``tokens`` / ``masks`` /
            ``history`` containers (TorchRL's flags; defaults ``None`` = TorchRL's rule: text in history and text
            modes, history in history mode, tokens and masks always, in both versions). ``return_history=True``
            outside history mode and ``return_text=True`` in tokens mode raise.
        history_key, text_key, tokens_key, masks_key, log_probs_key: output container keys.
        attention_mask_key: tokens mode: where a dense ``[B, T]`` id tensor's attention mask may be found when the
            input has no ``masks.all_attention_mask`` (TorchRL's argument and default, ``"attention_mask"``, e.g. the
            mask of ``tokenizer(..., padding=True)``). Positions it marks ``False`` are padding and dropped; without
            either mask every position of a dense tensor is a real token (padding is never read from the ids).
        pad_model_input: TorchRL's switch between a padded (``True``, the default) and a packed (``False``) forward
            pass of the log-prob version. Rows are always left-padded with position ids from the attention mask, which
            gives each row the log-probs it has scored alone, the equality TorchRL's packing tests pin; ``False``
            raises (packing is not implemented), and any value raises for the generate version, as in TorchRL.
        batching, min_batch_size, max_batch_size, batching_timeout: the threaded batcher
            (:class:`~lit_llm.policy.batching.BatchingMixin`).
        temperature: log-prob version: logits are divided by it before the log-softmax (> 0). Default ``None`` = the
            sampling temperature of ``generate_kwargs`` (1.0 when greedy), so
            ``get_new_version(generate=False)`` scores with the temperature its generate version sampled at.
        chunk_size: positions per LM-head chunk in the log-prob version (peak extra memory ~ ``chunk_size * V * 4``
            bytes); also the chunk size of the distributions of :meth:`get_dist`.
        matmul_dtype: dtype of the LM-head matmuls of the log-prob version's distributions (``None``, the default:
            fp32; ``torch.bfloat16``: the head's weight and hidden states in bf16, softmax and reductions fp32 either
            way; see :func:`~lit_llm.policy.kernel.chunked_token_log_probs`).
        share_prompts: log-prob version, GRPO prompt/completion layout of :meth:`get_dist`: run each distinct prompt
            through the backbone once and the completions on top of its KV cache
            (:func:`~lit_llm.policy.logprobs.completion_hidden_states`). ``False`` runs the full rows (needed under
            gradient checkpointing in training mode, which turns the cache off). Same values and gradients either way.
        disable_adapter: run every model call of this version inside the ``PeftModel``'s ``disable_adapter()``
            context, i.e. as the base model without its adapters (e.g. the KL reference of a LoRA policy: no second
            copy of the weights). The switch is a flag on the shared model's adapter layers: a call of another version
            of the same model must not run concurrently (the training loop calls the versions one after another).

    Sampling seeds (generate version): when the input has the per-row key ``"sampling_seed"`` (an integer, int64
    recommended: ``[B]`` dense, or a 0-d entry per row of a lazy stack), sample ``k`` of row ``b`` (``k = 0`` without
    ``num_samples``) samples from its own generator seeded with
    :func:`row_seed(sampling_seed[b], k) <lit_llm.policy.sampling.row_seed>`
    (:func:`~lit_llm.policy.generation.generate_tokens` ``seeds=``): its ids depend only on that seed and its own
    logits, not on the other rows of the batch or the global RNG. Without the key, sampling uses the global RNG. The
    key is left in the output like any other input entry. Under threaded batching, rows with and without the key
    have different structures and never share a batch; for a batch identical to one unbatched call see
    :mod:`lit_llm.policy.batching` (``batch_order``).

    Log-probs: ``log_probs.full[t] = log_softmax(z_{t-1} / T)[x_t]`` with ``z`` the model's logits -- the
    temperature-scaled **full** distribution, not renormalised after top-k/top-p/min-p or the repetition penalty --
    0.0 at each row's first token and at padding (DESIGN.md property 4). Position ids always come from the attention
    mask, so a row's numbers do not depend on the rest of the batch.

    Raises:
        ValueError: invalid settings (named in the message), see also :class:`LLMWrapperBase`.
    """

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        input_mode: Literal["history", "text", "tokens"] = "history",
        input_key: NestedKey | None = None,
        generate: bool = True,
        generate_kwargs: dict[str, Any] | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        pad_output: bool = False,
        inplace: bool | Literal["empty"] | None = None,
        device: torch.device | str | None = None,
        num_samples: int | None = None,
        chat_template: str | None = None,
        return_log_probs: bool | None = None,
        return_text: bool | None = None,
        return_tokens: bool | None = None,
        return_masks: bool | None = None,
        return_history: bool | None = None,
        chat_template_name: str | None = None,
        history_key: NestedKey = "history",
        text_key: NestedKey = "text",
        tokens_key: NestedKey = "tokens",
        masks_key: NestedKey = "masks",
        log_probs_key: NestedKey = "log_probs",
        attention_mask_key: NestedKey = "attention_mask",
        pad_model_input: bool | None = None,
        batching: bool | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        batching_timeout: float = 10.0,
        temperature: float | None = None,
        chunk_size: int = 1024,
        matmul_dtype: torch.dtype | None = None,
        share_prompts: bool = True,
        disable_adapter: bool = False,
    ) -> None:
        super().__init__()
        model, tokenizer = _resolve_model(model, tokenizer)
        if not isinstance(disable_adapter, bool):
            raise ValueError(f"disable_adapter must be a bool, got {disable_adapter!r}.")
        if disable_adapter and not callable(getattr(model, "disable_adapter", None)):
            raise ValueError(f"disable_adapter=True needs a peft PeftModel (a model with adapters to disable), got "
                             f"{type(model).__name__}.")
        self.disable_adapter = disable_adapter
        self.generate_kwargs = standardize_generate_kwargs(generate_kwargs)
        self.generation_config = resolve_generation_config(self.generate_kwargs, model, tokenizer)
        # as passed (None = derived below), so get_new_version re-derives them from overridden generate_kwargs
        self._user_temperature, self._user_num_samples = temperature, num_samples
        n = self.generation_config.num_return_sequences
        if generate and "num_return_sequences" in self.generate_kwargs:
            if num_samples is None:
                num_samples = n if n > 1 else None
            elif num_samples != n:
                raise ValueError(f"num_samples={num_samples} contradicts generate_kwargs num_return_sequences/n={n}; "
                                 f"pass only one of them.")
        if temperature is None:
            temperature = self.generation_config.temperature
        if not temperature > 0:
            raise ValueError(f"temperature (log-prob version) must be > 0, got {temperature}.")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}.")
        self.temperature = float(temperature)
        self.chunk_size = chunk_size
        if matmul_dtype is not None and (not isinstance(matmul_dtype, torch.dtype)
                                         or not matmul_dtype.is_floating_point):
            raise ValueError(f"matmul_dtype must be None (fp32) or a floating torch.dtype such as torch.bfloat16, got "
                             f"{matmul_dtype!r}.")
        self.matmul_dtype = matmul_dtype
        if not isinstance(share_prompts, bool):
            raise ValueError(f"share_prompts must be a bool, got {share_prompts!r}.")
        self.share_prompts = share_prompts
        self._set_template_options(chat_template, chat_template_name, tokenizer_kwargs)
        self._device = torch.device(device) if device is not None else None
        self.attention_mask_key = attention_mask_key
        if pad_model_input is not None and generate:
            raise ValueError("pad_model_input is not supported when generate=True (TorchRL's rule): it only concerns "
                             "the log-prob version's forward pass. Leave it None.")
        if pad_model_input is False:
            raise ValueError("pad_model_input=False (a packed forward pass) is not supported: rows are left-padded "
                             "with position ids from the attention mask, which gives the same log-probs as packing. "
                             "Leave pad_model_input None (or True).")
        self._init_common(
            model=model, tokenizer=tokenizer, input_mode=input_mode, input_key=input_key, generate=generate,
            pad_output=pad_output, inplace=inplace, num_samples=num_samples, return_log_probs=return_log_probs,
            history_key=history_key, text_key=text_key, tokens_key=tokens_key, masks_key=masks_key,
            log_probs_key=log_probs_key, batching=batching, min_batch_size=min_batch_size,
            max_batch_size=max_batch_size, batching_timeout=batching_timeout, return_text=return_text,
            return_tokens=return_tokens, return_masks=return_masks, return_history=return_history,
        )

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "generate_kwargs": dict(self.generate_kwargs),
                "tokenizer_kwargs": dict(self.tokenizer_kwargs), "device": self._device,
                "chat_template": None if self.chat_template_name else self.chat_template,
                "chat_template_name": self.chat_template_name, "temperature": self._user_temperature,
                "num_samples": self._user_num_samples, "chunk_size": self.chunk_size, "matmul_dtype": self.matmul_dtype,
                "share_prompts": self.share_prompts, "disable_adapter": self.disable_adapter,
                "attention_mask_key": self.attention_mask_key}

    def _model_context(self) -> AbstractContextManager:
        """``model.disable_adapter()`` with ``disable_adapter=True``, else a no-op."""
        return self.model.disable_adapter() if self.disable_adapter else nullcontext()

    @property
    def device(self) -> torch.device:
        """Where inputs go: the ``device`` argument, else the model's parameters' device."""
        return self._device or next(self.model.parameters()).device

    # ---------------------------------------------------------------------------------------------- keys
    def _k(self, base: NestedKey, leaf: str) -> tuple[str, ...]:
        return (*_key(base), leaf)

    def _missing(self, td: TensorDictBase, key: NestedKey, what: str) -> ValueError:
        return ValueError(
            f"{type(self).__name__}(input_mode={self.input_mode!r}, generate={self.generate}): the input has no "
            f"{key!r} ({what}); keys present: {sorted(map(str, td.keys(True, True)))}. Set that key or pass "
            f"input_key=... ."
        )

    # ---------------------------------------------------------------------------------------------- inputs
    def _tokens_padded(self, td: TensorDictBase) -> bool:
        """Whether the input's ``tokens.padded`` flag says its id tensors are padded ``[B, T]`` tensors."""
        try:
            flag = td.get(self._k(self.tokens_key, "padded"), None)
        except Exception:  # a ragged lazy stack of unpadded rows
            return False
        if flag is None:
            return False
        flags = flag.tolist() if hasattr(flag, "tolist") else flag  # NonTensorData/Stack, tensor or bool
        return bool(torch.as_tensor(flags, dtype=torch.bool).all()) if isinstance(flags, list) else bool(flags)

    def _check_not_padded_without_mask(self, td: TensorDictBase, key: NestedKey, attn_key: NestedKey) -> None:
        """Padding cannot be read from ids (pad == eos for SmolLM2): padded ids need their attention mask."""
        if _key(key)[:-1] != _key(self.tokens_key) or not self._tokens_padded(td):
            return
        if td.get(attn_key, None) is not None:
            return
        where = f"without {attn_key!r}" + (f" or {self.attention_mask_key!r}" if self.input_mode == "tokens" else "")
        raise ValueError(
            f"{type(self).__name__}(generate={self.generate}): {key!r} is padded (tokens.padded=True) {where}; the "
            f"pad id can equal the end-of-turn id, so padding cannot be told from real tokens. Pass unpadded rows (a "
            f"lazy stack of 1-D tensors, padded=False) or the attention mask."
        )

    def _encode(self, text: str) -> Tensor:
        return torch.as_tensor(self.tokenizer(text, **self.tokenizer_kwargs)["input_ids"], dtype=torch.long)

    def _decode(self, ids: Tensor) -> str:
        """Response text; special tokens kept unless ``generate_kwargs["skip_special_tokens"]``."""
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=self.generation_config.skip_special_tokens)

    def _forward_impl(self, td: TensorDictBase, **kwargs: Any) -> tuple[dict, int | None]:
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward: unexpected keyword arguments {sorted(kwargs)}.")
        return self._generate(td) if self.generate else self._log_probs(td)


def _resolve_model(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """A model given by name or folder is loaded with :func:`lit_llm.models.load_model` (with its tokenizer when
    none is given); anything else that is not a module is refused now, not at the first call.

    Raises:
        ValueError: a string :func:`~lit_llm.models.load_model` cannot resolve (names the accepted forms), or a model
            that is not a ``torch.nn.Module``.
    """
    import os

    if isinstance(model, (str, os.PathLike)):
        from lit_llm.models import DEFAULT_MODEL, load_model

        try:
            loaded, loaded_tok = load_model(model)
        except FileNotFoundError as e:
            raise ValueError(
                f"TransformersWrapper: model={str(model)!r} cannot be loaded: {e} Pass a loaded model instead "
                f"(model, tokenizer = lit_llm.models.load_model(...)), the embedded default {DEFAULT_MODEL!r}, or "
                f"a local HF folder."
            ) from e
        return loaded, tokenizer if tokenizer is not None else loaded_tok
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"TransformersWrapper: model must be a torch.nn.Module (an HF causal LM), a model name or a "
                         f"local folder for lit_llm.models.load_model; got {type(model).__name__}.")
    return model, tokenizer
