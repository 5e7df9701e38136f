"""Model-level per-token log-probs of an HF causal LM over the chunked LM-head kernel (:mod:`lit_llm.policy.kernel`).

Hidden states aligned to the tokens they predict come from :func:`token_hidden_states` (full rows, either padding
side) and :func:`completion_hidden_states` (the GRPO prompt/completion layout, prompts shared through a KV cache);
:func:`model_token_log_probs` and :func:`completion_log_probs` are those plus the kernel, giving ``log_probs.full`` of
DESIGN.md property 4: ``out[:, t] = log p(x_t | x_<t)``, 0.0 at each row's first real token and at padding. The
masked distributions of the log-prob version (:class:`~lit_llm.policy.masked_dist.ChunkedLLMMaskedCategorical`) run
the same kernel on the same aligned hidden states.

The kernel's names (:func:`chunked_token_log_probs`, :func:`naive_token_log_probs`, ``IGNORE_INDEX``) are re-exported
here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_llm.policy.deferred import check_value
from lit_llm.policy.generation import cache_kwarg, pad_rows
from lit_llm.policy.kernel import IGNORE_INDEX, _check_scalars, chunked_token_log_probs, naive_token_log_probs

__all__ = ["IGNORE_INDEX", "base_causal_lm", "check_packed_positions", "chunked_token_log_probs",
           "completion_hidden_states", "completion_log_probs", "model_token_log_probs", "naive_token_log_probs",
           "token_hidden_states"]

_UNSUPPORTED_HEAD_CONFIG = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def base_causal_lm(model):
    """The HF causal LM that computes ``model``'s outputs: for a ``peft`` ``PeftModel``, ``model.get_base_model()``
    (the base model with the adapter layers injected in place, so it computes the *adapted* outputs while the adapters
    are enabled); any other model itself.

    A ``PeftModel`` forwards unknown attributes to the base causal LM, so ``peft_model.model`` is the whole
    ``*ForCausalLM`` (not its backbone): reading the backbone through it would feed logits where hidden states are
    expected. Every model-level entry point here unwraps with this function first.
    """
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _backbone_and_head(model, name: str = "model_token_log_probs"):
    """``(backbone, head)`` of an HF causal LM (a ``PeftModel`` is unwrapped with :func:`base_causal_lm`); raises when
    the head post-processes logits the kernel cannot mimic or carries a LoRA adapter the kernel would skip."""
    model = base_causal_lm(model)
    config = getattr(model, "config", None)
    for key in _UNSUPPORTED_HEAD_CONFIG:
        value = getattr(config, key, None)
        if value is not None and not (key == "logits_scaling" and value == 1.0):
            raise NotImplementedError(
                f"{name}: model.config.{key}={value!r} post-processes the logits, which the chunked "
                f"kernel does not do. Use naive_token_log_probs(model(...).logits, ...) for this model."
            )
    backbone = getattr(model, "model", None)
    if backbone is None and hasattr(model, "get_decoder"):
        backbone = model.get_decoder()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{name}: {type(model).__name__} must be an HF causal LM with a backbone (model.model or "
            f"model.get_decoder()) and a linear head (model.get_output_embeddings()); pass an AutoModelForCausalLM."
        )
    if hasattr(head, "base_layer"):  # a peft tuner layer: its forward adds the adapter, its .weight does not
        raise ValueError(
            f"{name}: the output head carries a peft adapter ({type(head).__name__}); the chunked kernel reads the "
            f"head's weight and would ignore it. Leave the head out of lora_target_modules (e.g. ['all-linear'])."
        )
    return backbone, head


def lm_head(model) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of an HF causal LM's output head (a ``PeftModel``'s base model's), checked
    as the kernel needs it.

    Raises:
        ValueError: no backbone or linear head; a head with a peft adapter.
        NotImplementedError: the config post-processes logits (softcapping, logit scale).
    """
    _, head = _backbone_and_head(model, "lm_head")
    return head.weight, getattr(head, "bias", None)


def _check_mask(input_ids: Tensor, attention_mask: Tensor, name: str = "model_token_log_probs") -> Tensor:
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"{name}: input_ids and attention_mask must both be [B, T]; got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}."
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"{name}: input_ids must be integer ids (torch.long), got {input_ids.dtype}")
    mask = attention_mask.bool()
    # One contiguous block of 1s per row (left or right padding): at most one 0->1 rise, counting a 1 at t=0 as one.
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0].long()

    def holes() -> ValueError:
        row = int((rises > 1).nonzero()[0])
        return ValueError(
            f"{name}: attention_mask row {row} has holes (padding inside the sequence). Only left- or "
            f"right-padded rows (one contiguous block of 1s) are supported; re-pad the batch."
        )

    check_value((rises > 1).any(), holes)  # inside a training step: read with the step's one host read
    return mask


def _predicted(mask: Tensor) -> Tensor:
    """``[B, T]`` bool: real tokens with a real token before them (the positions that have a prediction)."""
    out = torch.zeros_like(mask)
    out[:, 1:] = mask[:, 1:] & mask[:, :-1]
    return out


def check_packed_positions(position_ids: Tensor, attention_mask: Tensor, name: str = "token_hidden_states") -> Tensor:
    """Validate the ``position_ids`` of packed rows (several sequences per row, see :mod:`lit_llm.data.packing`).

    At real tokens (``attention_mask`` True) each position is either 0 (a sequence starts) or the previous column's
    position + 1 with the previous column a real token (the sequence goes on); the first real token of each row is
    0. Positions at padding are not read.

    Args:
        position_ids: ``[B, T]`` integer tensor.
        attention_mask: ``[B, T]`` bool, real tokens.

    Returns:
        ``[B, T]`` long position ids, 0 at padding.

    Raises:
        ValueError: shape or dtype mismatch, or a real token whose position neither starts nor continues a sequence
            (names the row and column).
    """
    if position_ids.shape != attention_mask.shape or position_ids.dtype.is_floating_point \
            or position_ids.dtype == torch.bool:
        raise ValueError(f"{name}: position_ids must be an integer [B, T] tensor aligned with the ids "
                         f"{tuple(attention_mask.shape)}; got {position_ids.dtype} {tuple(position_ids.shape)}.")
    pos = position_ids.to(attention_mask.device).long().masked_fill(~attention_mask, 0)
    prev_pos = torch.nn.functional.pad(pos[:, :-1], (1, 0), value=-2)
    prev_real = torch.nn.functional.pad(attention_mask[:, :-1], (1, 0), value=False)
    ok = (pos == 0) | ((pos == prev_pos + 1) & prev_real)
    bad = attention_mask & ~ok
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}: packed position_ids row {row}, column {col}: {int(pos[row, col])} neither starts a "
                         f"sequence (0) nor continues the previous real token's position; position ids must restart at "
                         f"0 for each packed sequence and count up by 1 (see lit_llm.data.packing.collate_packed).")
    return pos


def _run_backbone(backbone, ids: Tensor, mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """Last hidden states ``[B, T, H]``, no cache: left- or right-padded rows with positions from the mask, or packed
    rows (``position_ids`` given, checked by :func:`check_packed_positions`) with no attention mask, so transformers
    makes every sequence attend only to itself (see :func:`token_hidden_states`)."""
    # padding ids are never read (masked out of attention and zeroed below), but the embedding still looks them up
    ids = ids.long().masked_fill(~mask, 0)
    if position_ids is None:
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = backbone(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids, use_cache=False)
    else:  # packed: no mask and no cache, or transformers would let the sequences attend to each other
        out = backbone(input_ids=ids, attention_mask=None, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _align(hidden: Tensor, predicted: Tensor) -> Tensor:
    """Shift ``[B, T, H]`` right by one (``out[:, t] = hidden[:, t-1]``), zeros where nothing is predicted."""
    shifted = torch.nn.functional.pad(hidden[:, :-1], (0, 0, 1, 0))  # one [B, T, H] copy; pad's backward is a slice
    return shifted.masked_fill_(~predicted.unsqueeze(-1), 0.0)


def token_hidden_states(model, input_ids: Tensor, attention_mask: Tensor, *,
                        position_ids: Tensor | None = None) -> Tensor:
    """Final hidden states of an HF causal LM aligned to the tokens they predict: ``out[:, t]`` scores ``x_t``.

    Runs the backbone (``model.model`` or ``model.get_decoder()``, never the LM head) once with
    ``position_ids = attention_mask.cumsum(-1) - 1`` clamped at 0, so a padded row gets the positions of the unpadded
    row, and shifts its output right by one position. Feed the result to :func:`chunked_token_log_probs` with the
    head ``model.get_output_embeddings()`` and ``input_ids`` as targets to get ``log_probs.full``. Padding is read from
    ``attention_mask`` only, never from ids (SmolLM2's pad id equals its end-of-turn id); the ids at padding are never
    looked at. Keeps autograd (gradients reach the backbone's parameters when grad is enabled).

    **Packed rows** (``position_ids`` given, :mod:`lit_llm.data.packing`): each row holds several sequences whose
    positions restart at 0. The backbone then gets those ``position_ids``, **no attention mask and
    ``use_cache=False``**: transformers (>= 4.53, ``masking_utils.find_packed_sequence_indices``) derives a
    block-diagonal causal mask from ``position_ids`` only in that case; with an attention mask, or with the default
    ``use_cache=True`` (a ``DynamicCache`` is created before the mask), the sequences of a row silently attend to
    each other (measured on a tiny Llama: hidden states off by ~3). This works for the ``sdpa``, ``eager`` and
    ``flex_attention`` implementations (tested with ``sdpa`` and ``eager``); flash-attention 2/3 read the same
    ``position_ids`` as varlen boundaries (transformers' documented path; not tested here, CPU only). The first token
    of each sequence has no prediction (zeros), like a row's first real token. Padding (``attention_mask`` False) may
    only sit outside the sequences (one contiguous block of real tokens per row); its positions are not read.

    Args:
        model: an HF ``*ForCausalLM`` (e.g. ``LlamaForCausalLM``), or a ``peft`` ``PeftModel`` over one (its
            :func:`base_causal_lm`'s backbone runs, adapters included while enabled).
        input_ids: ``[B, T]`` long token ids, left- **or** right-padded.
        attention_mask: ``[B, T]`` bool or 0/1 integers; 1 = real token; one contiguous block of 1s per row.
        position_ids: ``[B, T]`` integer positions of packed rows (see :func:`check_packed_positions`), or ``None``
            (one sequence per row, positions from the mask).

    Returns:
        ``[B, T, H]`` in the backbone's dtype: ``out[:, t]`` = backbone output at ``t - 1`` (the state that predicts
        ``input_ids[:, t]``) where ``x_t`` and ``x_{t-1}`` are both real tokens of the same sequence; zeros at
        ``t = 0``, at each sequence's first token and at padding (positions with no prediction).

    Raises:
        ValueError: shapes differ / are not 2-D, float ids, a mask with holes, packed ``position_ids`` that do not
            restart at 0 and count up by 1 per sequence, a model without backbone or head.
        NotImplementedError: the config post-processes logits (``final_logit_softcapping``, ``logit_scale``,
            ``logits_scaling`` != 1), which the kernel does not reproduce.
    """
    mask = _check_mask(input_ids, attention_mask, "token_hidden_states")
    backbone, _ = _backbone_and_head(model, "token_hidden_states")
    if position_ids is None:
        return _align(_run_backbone(backbone, input_ids, mask), _predicted(mask))
    pos = check_packed_positions(position_ids, mask)
    return _align(_run_backbone(backbone, input_ids, mask, pos), mask & (pos > 0))


def model_token_log_probs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
    score_mask: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced ``log_probs.full`` of an HF causal LM without materialising ``[B, T, V]`` logits.

    :func:`token_hidden_states` (one backbone pass, positions from the mask) followed by
    :func:`chunked_token_log_probs` over the head ``model.get_output_embeddings()``. Padding is read from
    ``attention_mask`` only. Gradients flow to the model parameters when grad is enabled.

    Args:
        model: an HF ``*ForCausalLM`` (e.g. ``LlamaForCausalLM``).
        input_ids: ``[B, T]`` long token ids, left- or right-padded.
        attention_mask: ``[B, T]`` 0/1 (any int or bool dtype); 1 = real token; one contiguous block per row.
        temperature: the sampling temperature (> 0); log-probs are those of the full temperature-scaled distribution
            (DESIGN.md property 4), not renormalised after top-k/top-p.
        chunk_size: rows per LM-head chunk (see :func:`chunked_token_log_probs`).
        return_entropy: also return the per-position entropy of the predicting distribution.
        matmul_dtype: dtype of the LM-head matmul (``None`` = fp32; see :func:`chunked_token_log_probs`).
        score_mask: optional ``[B, T]`` bool: score only these positions (e.g. a GRPO completion mask); the LM head
            is applied there only, so prompt tokens cost the backbone alone (TRL's ``logits_to_keep``). Other
            positions are 0.0. ``None`` = every real token.

    Returns:
        fp32 ``[B, T]`` with ``out[:, t] = log p(x_t | x_<t)`` for every real token that has a real token before it
        (and is in ``score_mask`` when given); 0.0 at each row's first real token (position 0 of the unpadded row),
        at padding and outside ``score_mask``. With
        ``return_entropy``: ``(log_probs, entropy)``, the entropy at ``t`` being that of ``p(. | x_<t)``, zeroed alike.

    Raises:
        ValueError: shapes differ / are not 2-D, float ids, a mask with holes, bad temperature or chunk size, a model
            without backbone or head.
        NotImplementedError: the config post-processes logits (``final_logit_softcapping``, ``logit_scale``,
            ``logits_scaling`` != 1), which the kernel does not reproduce.
    """
    _check_scalars(temperature, chunk_size)
    mask = _check_mask(input_ids, attention_mask)
    backbone, head = _backbone_and_head(model)
    scored = _predicted(mask)
    if score_mask is not None:
        if score_mask.shape != input_ids.shape:
            raise ValueError(f"score_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(score_mask.shape)}.")
        scored = scored & score_mask.bool()
    hidden = _align(_run_backbone(backbone, input_ids, mask), scored)
    targets = input_ids.long().masked_fill(~scored, IGNORE_INDEX)
    return chunked_token_log_probs(
        hidden, head.weight, targets, bias=getattr(head, "bias", None), temperature=temperature,
        chunk_size=chunk_size, return_entropy=return_entropy, matmul_dtype=matmul_dtype,
    )


def _check_completion_inputs(name: str, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                             completion_mask: Tensor, prompt_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Validate the GRPO prompt/completion layout; returns ``(prompt_mask, completion_mask, prompt_index)`` as
    bool, bool, long."""
    n_rows, comp_len = completion_ids.shape if completion_ids.dim() == 2 else (-1, -1)
    if (prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape or completion_ids.dim() != 2
            or completion_mask.shape != completion_ids.shape or prompt_index.shape != (n_rows,)):
        raise ValueError(
            f"{name}: expected prompt_ids/prompt_mask [P, Lp], completion_ids/completion_mask [N, Lc] "
            f"and prompt_index [N]; got {tuple(prompt_ids.shape)}, {tuple(prompt_mask.shape)}, "
            f"{tuple(completion_ids.shape)}, {tuple(completion_mask.shape)}, {tuple(prompt_index.shape)}.")
    for arg, value in (("prompt_ids", prompt_ids), ("completion_ids", completion_ids)):
        if value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name}: {arg} must be integer token ids (torch.long), got {value.dtype}.")
    if prompt_ids.shape[1] == 0:
        raise ValueError(f"{name}: every prompt row must be non-empty and left-padded (its real tokens "
                         "end at the last column); re-pad the prompts on the left.")
    if n_rows == 0 or comp_len == 0:
        raise ValueError(f"{name}: no completion to score (completion_ids "
                         f"{tuple(completion_ids.shape)}); give at least one row with at least one completion token.")
    if prompt_index.dtype.is_floating_point or prompt_index.dtype == torch.bool:
        raise ValueError(f"{name}: prompt_index must be integer row indices, got {prompt_index.dtype}.")
    n_prompts = prompt_ids.shape[0]
    if n_prompts == 0:
        raise ValueError(f"{name}: prompt_index must lie in [0, 0): prompt_ids has no row; give each completion's "
                         f"prompt.")
    pmask, cmask, index = prompt_mask.bool(), completion_mask.bool(), prompt_index.long()
    # The value checks: one host read outside a training step, none inside one (read with the step's flags).
    bad_prompts = ~pmask[:, -1].all() | (pmask[:, 1:] < pmask[:, :-1]).any()
    bad_completions = (cmask[:, 1:] > cmask[:, :-1]).any()
    bad_index = ((index < 0) | (index >= n_prompts)).any()

    def error() -> ValueError:
        if bool(bad_prompts):
            return ValueError(f"{name}: every prompt row must be non-empty and left-padded (its real tokens "
                              "end at the last column); re-pad the prompts on the left.")
        if bool(bad_completions):
            return ValueError(f"{name}: completion_mask rows must be right-padded (1s then 0s); re-pad the "
                              "completions on the right.")
        return ValueError(f"{name}: prompt_index must lie in [0, {n_prompts}); got values in "
                          f"[{int(index.min())}, {int(index.max())}].")

    check_value(bad_prompts | bad_completions | bad_index, error)
    return pmask, cmask, index.clamp(0, n_prompts - 1)  # a deferred bad index must not index out of range meanwhile


def completion_hidden_states(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    prompt_index: Tensor,
    *,
    share_prompts: bool = True,
) -> Tensor:
    """Final hidden states of ``N`` completions of ``P <= N`` prompts (a GRPO micro-batch), aligned to the completion.

    Row ``i`` is the sequence ``prompt_ids[prompt_index[i]]`` (real tokens) followed by ``completion_ids[i]`` (real
    tokens); ``out[i, t]`` is the state that predicts ``completion_ids[i, t]`` (for ``t = 0`` the last prompt token's
    output). Positions count from each row's first real prompt token, as in :func:`token_hidden_states`, so the
    numbers do not depend on padding. Feed it to :func:`chunked_token_log_probs` with ``completion_ids`` as targets.

    With ``share_prompts`` (default) each of the ``P`` prompts goes through the backbone **once**: its KV cache (which
    keeps its autograd history) is gathered to the ``N`` rows with ``prompt_index`` and only the completion tokens
    are run on top of it. A GRPO group is ``G`` completions of one prompt, so the backbone sees
    ``P * prompt + N * completion`` tokens instead of ``N * (prompt + completion)``. Values and gradients equal the
    full rows' up to float rounding: the shared prompt activations receive the sum of their rows' gradients, which is
    what the full rows' backward accumulates too. ``share_prompts=False`` runs the ``N`` full rows left-padded
    through :func:`token_hidden_states` (needed when the backbone keeps no cache, e.g. under gradient checkpointing
    in training mode).

    Args:
        model: an HF ``*ForCausalLM`` (its backbone must take a ``DynamicCache`` when ``share_prompts``).
        prompt_ids: ``[P, Lp]`` long, **left**-padded prompts (any padding id: padding is read from the masks).
        prompt_mask: ``[P, Lp]`` bool/0-1, 1 = real prompt token; every row non-empty and left-padded.
        completion_ids: ``[N, Lc]`` long, **right**-padded completions.
        completion_mask: ``[N, Lc]`` bool/0-1, 1 = real completion token (a prefix of each row).
        prompt_index: ``[N]`` long in ``[0, P)``, the prompt of each completion row.
        share_prompts: run each prompt through the backbone once (see above).

    Returns:
        ``[N, Lc, H]`` in the backbone's dtype, with autograd; zeros where ``completion_mask`` is 0.

    Raises:
        ValueError: shapes that do not line up, float ids, no completion token (``N == 0`` or
            ``Lc == 0``), a prompt row that is empty or not left-padded, a completion mask that is not right-padded,
            a non-integer ``prompt_index`` or one outside ``[0, P)``; a model without backbone or head.
        RuntimeError: ``share_prompts`` and the backbone returned no ``DynamicCache`` (gradient checkpointing in
            training mode turns caching off): pass ``share_prompts=False``.
        NotImplementedError: see :func:`token_hidden_states`.
    """
    return _completion_hidden_states("completion_hidden_states", model, prompt_ids, prompt_mask, completion_ids,
                                     completion_mask, prompt_index, share_prompts)


def _completion_hidden_states(name: str, model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                              completion_mask: Tensor, prompt_index: Tensor, share_prompts: bool) -> Tensor:
    pmask, cmask, index = _check_completion_inputs(name, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                   prompt_index)
    backbone, _ = _backbone_and_head(model, name)
    if not share_prompts:
        return _full_rows_completion_hidden(backbone, prompt_ids, pmask, completion_ids, cmask, index)
    comp_len = completion_ids.shape[1]
    # padding ids are never read (masked out of attention and scoring), but the embedding still looks them up
    prompt_ids, completion_ids = prompt_ids.long().masked_fill(~pmask, 0), completion_ids.long().masked_fill(~cmask, 0)
    p_pos = (pmask.long().cumsum(-1) - 1).clamp(min=0)
    out = backbone(input_ids=prompt_ids, attention_mask=pmask.long(), position_ids=p_pos, use_cache=True)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    if cache is None or not hasattr(cache, "layers"):
        raise RuntimeError(f"{name}: the backbone returned no DynamicCache (gradient checkpointing in "
                           "training mode turns caching off); pass share_prompts=False.")
    for layer in cache.layers:
        layer.batch_select_indices(index)
    last_prompt_hidden = out.last_hidden_state[:, -1]  # predicts each row's first completion token
    attn = torch.cat([pmask[index], cmask], 1).long()
    c_pos = pmask.long().sum(-1)[index, None] + torch.arange(comp_len, device=completion_ids.device)[None]
    hidden_c = backbone(input_ids=completion_ids, attention_mask=attn, position_ids=c_pos, use_cache=True,
                        **{cache_kwarg(backbone): cache}).last_hidden_state
    hidden = torch.cat([last_prompt_hidden[index, None].to(hidden_c.dtype), hidden_c[:, :-1]], 1)
    return hidden.masked_fill(~cmask.unsqueeze(-1), 0.0)


def _full_rows_completion_hidden(backbone, prompt_ids: Tensor, pmask: Tensor, completion_ids: Tensor, cmask: Tensor,
                                 index: Tensor) -> Tensor:
    """:func:`completion_hidden_states` without prompt sharing: left-pad the ``N`` full rows and run them."""
    p_len, c_len = pmask.sum(-1)[index], cmask.sum(-1)
    rows = [torch.cat([prompt_ids[j, prompt_ids.shape[1] - int(p_len[i]):], completion_ids[i, :int(c_len[i])]])
            for i, j in enumerate(index.tolist())]
    ids = pad_rows([r.long() for r in rows], 0)
    width = ids.shape[1]
    col = torch.arange(width, device=ids.device)[None]
    attn = col >= width - (p_len + c_len)[:, None]
    hidden = _align(_run_backbone(backbone, ids, attn), _predicted(attn))
    # back to the completion layout: row i's completion occupies the last c_len[i] columns
    gather = (width - c_len[:, None] + torch.arange(cmask.shape[1], device=ids.device)[None]).clamp(max=width - 1)
    out = hidden.gather(1, gather.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return out.masked_fill(~cmask.unsqueeze(-1), 0.0)


def completion_log_probs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    prompt_index: Tensor,
    *,
    share_prompts: bool = True,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Teacher-forced log-probs of ``N`` completions of ``P <= N`` prompts (a GRPO micro-batch), completions only.

    :func:`completion_hidden_states` (prompts shared through a KV cache by default, see there) followed by
    :func:`chunked_token_log_probs` on the completion tokens only (the LM head never runs on prompt positions, like
    TRL's ``logits_to_keep``). Positions count from each row's first real prompt token, so the numbers do not depend
    on padding, and they equal the full rows' ``model(ids).logits`` log-probs (values and gradients) in both modes.

    Args:
        model: an HF ``*ForCausalLM`` (its backbone must take a ``DynamicCache`` when ``share_prompts``).
        prompt_ids: ``[P, Lp]`` long, **left**-padded prompts (any padding id: padding is read from the masks).
        prompt_mask: ``[P, Lp]`` bool/0-1, 1 = real prompt token; every row non-empty and left-padded.
        completion_ids: ``[N, Lc]`` long, **right**-padded completions.
        completion_mask: ``[N, Lc]`` bool/0-1, 1 = real completion token (a prefix of each row).
        prompt_index: ``[N]`` long in ``[0, P)``, the prompt of each completion row.
        share_prompts: run each prompt through the backbone once; ``False`` scores the full left-padded rows (needed
            under gradient checkpointing in training mode, which turns the cache off).
        temperature, chunk_size, return_entropy, matmul_dtype: see :func:`model_token_log_probs`.

    Returns:
        fp32 ``[N, Lc]`` with ``out[i, t] = log p(c_t | prompt, c_<t)``, 0.0 where ``completion_mask`` is 0; with
        ``return_entropy``, ``(log_probs, entropy)`` alike.

    Raises:
        ValueError: see :func:`completion_hidden_states`; bad temperature or chunk size.
        RuntimeError: ``share_prompts`` and the backbone returned no ``DynamicCache``: pass ``share_prompts=False``.
    """
    _check_scalars(temperature, chunk_size)
    hidden = _completion_hidden_states("completion_log_probs", model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, prompt_index, share_prompts)
    weight, bias = lm_head(model)
    targets = completion_ids.long().masked_fill(~completion_mask.bool(), IGNORE_INDEX)
    return chunked_token_log_probs(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size,
                                   return_entropy=return_entropy, matmul_dtype=matmul_dtype)
