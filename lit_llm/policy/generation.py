"""The sampling loop with KV cache (and, re-exported from :mod:`lit_llm.policy.generation_config`, the generation
settings).

Two public pieces used by :class:`~lit_llm.policy.transformers_wrapper.TransformersWrapper`:

* :func:`standardize_generate_kwargs` / :func:`resolve_generation_config` (:mod:`~lit_llm.policy.generation_config`):
  TorchRL's seed names
  (``torchrl/modules/llm/policies/common.py``: vLLM's ``max_tokens`` -> ``max_new_tokens``, ``n`` ->
  ``num_return_sequences``) and its validation rules, resolved into one frozen :class:`GenerationConfig`.
* :func:`generate_tokens`: a left-padded, KV-cached decoding loop that keeps the sampled ids exactly and records the
  log-prob of every sampled token under the temperature-scaled model distribution (DESIGN.md properties 1, 4, 5).
  With ``seeds`` each row samples from its own generator (:func:`sample_from_probs`, :func:`row_seed`, in
  :mod:`lit_llm.policy.sampling` and re-exported here), so a row's sample never depends on the other rows of the
  batch or on the global RNG.

Why our own loop rather than ``model.generate``: the reported log-probs must be ``log_softmax(logits / T)`` of the raw
logits (not the processed scores), and keeping ``output_logits`` for every step costs ``[B, V]`` fp32 per step; here
each step gathers the one sampled log-prob and frees the rest. The logits processors themselves are transformers'
(repetition penalty, no-repeat-n-gram, temperature, top-k, top-p, min-p, in ``model.generate``'s order); stop strings
and ``min_new_tokens`` are handled by the loop.

Reported log-probs under processing: always the tempered, **unprocessed** distribution (the one the log-prob version
scores). Top-k/top-p/min-p only truncate it; the prefix-dependent settings (:data:`PREFIX_DEPENDENT_GENERATE_KWARGS`)
sample from a different one, which :func:`prefix_dependent_settings` names for consumers (GRPO) that must refuse them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_llm.data.padding import pad_rows
from lit_llm.policy.generation_config import (
    PREFIX_DEPENDENT_GENERATE_KWARGS,
    SUPPORTED_GENERATE_KWARGS,
    UNSUPPORTED_GENERATE_KWARGS,
    GenerationConfig,
    prefix_dependent_settings,
    resolve_generation_config,
    standardize_generate_kwargs,
    validate_generate_kwargs,
)
from lit_llm.policy.sampling import _check_seeds, _row_uniforms, row_seed, sample_from_probs

__all__ = [
    "DONE_CHECK_EVERY",
    "PREFIX_DEPENDENT_GENERATE_KWARGS",
    "SUPPORTED_GENERATE_KWARGS",
    "UNSUPPORTED_GENERATE_KWARGS",
    "GenerationConfig",
    "GenerationOutput",
    "cache_kwarg",
    "check_token_ids",
    "generate_tokens",
    "pad_rows",
    "prefix_dependent_settings",
    "resolve_generation_config",
    "row_seed",
    "rows_to_device",
    "sample_from_probs",
    "standardize_generate_kwargs",
    "unique_rows",
    "validate_generate_kwargs",
]

@dataclass
class GenerationOutput:
    """Per-row results of :func:`generate_tokens` (unpadded).

    Attributes:
        response_ids: ``B`` 1-D ``torch.long`` tensors ``[R_b]``: the sampled ids, ending with the stop token unless
            the row was truncated.
        response_log_probs: ``B`` 1-D ``torch.float32`` tensors ``[R_b]``: ``log_softmax(logits / T)`` of each
            sampled id (``T`` = :attr:`GenerationConfig.temperature`).
        truncated: ``[B]`` bool: the row reached ``max_new_tokens`` without stopping (no eos id, no stop string).
    """

    response_ids: list[Tensor]
    response_log_probs: list[Tensor]
    truncated: Tensor


def cache_kwarg(module: Any) -> str:
    """The name under which ``module.forward`` takes a KV cache: ``"cache"`` (transformers >= 5.x) or
    ``"past_key_values"``."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _processors(config: GenerationConfig) -> tuple[list, list]:
    """``(row_processors, warpers)``: transformers' processors in ``model.generate``'s order. The first list depends
    on a row's earlier tokens and runs on each row's unpadded ids (padding must not count as tokens); the warpers
    are row-independent and run on the batch."""
    from transformers.generation import logits_process as lp

    rows: list = []
    if config.repetition_penalty is not None:
        rows.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size is not None:
        rows.append(lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    warpers: list = []
    if config.do_sample:
        if config.temperature != 1.0:
            warpers.append(lp.TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None:
            warpers.append(lp.TopKLogitsWarper(config.top_k))
        if config.top_p is not None:
            warpers.append(lp.TopPLogitsWarper(config.top_p))
        if config.min_p is not None:
            warpers.append(lp.MinPLogitsWarper(config.min_p))
    return rows, warpers


class _StopStrings:
    """Per-row detection of ``stop_sequences`` in the decoded response (special tokens kept).

    A stop string is matched when the text decoded from the row's last ``window`` response ids contains it and the
    same window without the newest id does not: the newest token completed it. ``window`` covers the longest stop
    string even at one byte per token (4 bytes per character at most), so no occurrence is missed.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], batch: int):
        if tokenizer is None:
            raise ValueError("generate_tokens: generate_kwargs stop_sequences need the tokenizer to decode the "
                             "response; pass tokenizer=... (the wrapper passes its own).")
        self.tokenizer, self.stops = tokenizer, stops
        self.window = 4 * max(len(s) for s in stops) + 1
        self.ids: list[list[int]] = [[] for _ in range(batch)]

    def hit(self, nxt: list[int], alive: list[bool], *, can_stop: bool = True) -> list[bool]:
        """Per row: did ``nxt`` complete a stop string? Rows not ``alive`` (finished) are skipped and keep no ids;
        before ``can_stop`` (``min_new_tokens``) ids are kept but nothing stops."""
        out = []
        for b, (tok, on) in enumerate(zip(nxt, alive)):
            if not on:  # a finished row never comes back: its ids are never read again
                out.append(False)
                continue
            tail = self.ids[b]
            tail.append(tok)
            del tail[:-self.window]  # only the last ``window`` ids are ever decoded
            if not can_stop:
                out.append(False)
                continue
            cur = self.tokenizer.decode(tail, skip_special_tokens=False)
            if not any(s in cur for s in self.stops):
                out.append(False)
                continue
            prev = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
            out.append(any(s in cur and s not in prev for s in self.stops))
        return out


def check_token_ids(model: Any, rows: Sequence[Tensor], *, extra: int = 0, max_context: int | None = None,
                    what: str = "input") -> None:
    """Fail loudly (DESIGN.md property 7) on rows a model cannot score or extend.

    Args:
        model: an HF causal LM (its input embeddings give the vocabulary size, ``config.max_position_embeddings``
            the context length).
        rows: ``B`` 1-D integer id tensors.
        extra: tokens that will be appended to each row (``max_new_tokens`` when generating).
        max_context: the context length; ``None`` reads ``model.config.max_position_embeddings`` (no check when
            absent).
        what: names the rows in the message, e.g. ``"generate: prompt"``.

    Raises:
        ValueError: an empty row, a non-integer row, an id outside ``[0, vocab_size)``, or a row (plus ``extra``)
            longer than the context; the message names the row and the fix.
    """
    for b, r in enumerate(rows):
        if r.numel() == 0:
            raise ValueError(f"{what} row {b} is empty; every row needs at least one token.")
        if r.dtype.is_floating_point or r.dtype.is_complex or r.dtype == torch.bool:
            raise ValueError(f"{what} row {b} has dtype {r.dtype}; token ids must be an integer tensor (torch.long).")
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    flat = torch.cat([r.reshape(-1) for r in rows]) if vocab is not None and rows else None
    if flat is not None and bool(((flat < 0) | (flat >= vocab)).any()):  # one host read for every row
        for b, r in enumerate(rows):  # only on failure: name the first bad row
            bad = (r < 0) | (r >= vocab)
            if bool(bad.any()):
                pos = int(bad.nonzero()[0])
                raise ValueError(f"{what} row {b} holds id {int(r[pos])} at position {pos}, outside the model's "
                                 f"vocabulary [0, {vocab}). Tokenize with the model's own tokenizer.")
    if max_context is None:
        max_context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if max_context is None:
        return
    lengths = [int(r.numel()) for r in rows]
    row = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if row is not None and lengths[row] + extra > max_context:
        plus = f"; with max_new_tokens={extra} it" if extra else ", which"
        fix = "Shorten the prompt or lower max_new_tokens." if extra else "Truncate or drop the sequence."
        raise ValueError(f"{what} row {row} has {lengths[row]} tokens{plus} exceeds the model's context of "
                         f"{max_context} tokens. {fix}")


def unique_rows(ids: Tensor, lengths: list[int]) -> tuple[Tensor, Tensor | None]:
    """Deduplicate the rows of a padded batch.

    Args:
        ids: ``[B, T]`` padded ids (any padding side, the same for every row).
        lengths: ``B`` real lengths; rows are equal when their lengths and all ``T`` ids are.

    Returns:
        ``(unique, inverse)``: ``unique`` ``[U]`` long, the first row of each distinct value in order of first
        appearance, and ``inverse`` ``[B]`` long with ``ids[unique][inverse] == ids``; ``inverse`` is ``None`` when the
        rows are all distinct (``unique`` is then ``arange(B)``).
    """
    first: dict[tuple[int, bytes], int] = {}
    host = ids.cpu().numpy()  # one device-to-host copy
    keys = [first.setdefault((n, row.tobytes()), len(first)) for n, row in zip(lengths, host)]
    if len(first) == len(keys):
        return torch.arange(len(keys), device=ids.device), None
    rep = {k: i for i, k in reversed(list(enumerate(keys)))}  # key -> first row holding it
    unique = torch.tensor([rep[k] for k in range(len(first))], dtype=torch.long, device=ids.device)
    return unique, torch.tensor(keys, dtype=torch.long, device=ids.device)


#: Decode steps between two host reads of "is every row done?" on an accelerator (:func:`generate_tokens`
#: ``done_check_every``): at most 7 extra steps after the last row stops, for no host-device round trip in between.
DONE_CHECK_EVERY = 8


def rows_to_device(rows: Sequence[Tensor], device: torch.device | str) -> list[Tensor]:
    """``rows`` on ``device``, copied in **one** transfer per source device and dtype (concatenated, copied, split
    back) instead of one per row: each ``.to(device)`` / ``.cpu()`` of a row is a blocking copy, a host sync on CUDA.

    Args:
        rows: tensors of any shapes, dtypes and devices (e.g. the ``B`` prompts of a batch, or its sampled rows).
        device: where they go.

    Returns:
        ``len(rows)`` tensors on ``device``, each with its row's shape and dtype: the rows already there unchanged,
        the copied ones views of one buffer per group (autograd follows the copy, as with ``.to``).
    """
    device = torch.device(device)
    out = list(rows)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, r in enumerate(out):
        if r.device != device:
            groups.setdefault((r.device, r.dtype), []).append(i)
    for idx in groups.values():
        flat = torch.cat([out[i].reshape(-1) for i in idx]).to(device)
        for i, part in zip(idx, flat.split([out[i].numel() for i in idx])):
            out[i] = part.view(out[i].shape)
    return out


@torch.no_grad()
def generate_tokens(model: Any, prompts: Sequence[Tensor], config: GenerationConfig, *,
                    device: torch.device | None = None, max_context: int | None = None,
                    seeds: Sequence[int] | Tensor | None = None, tokenizer: Any = None,
                    num_samples: int = 1, done_check_every: int | None = None) -> GenerationOutput:
    """Decode every prompt with a KV cache; stop each row at its first eos id; keep ids and their log-probs.

    Prompts are left-padded into ``[B, P]`` with an attention mask built from their lengths (never from
    ``ids != pad``: SmolLM2's pad id is its end-of-turn id) and position ids ``attention_mask.cumsum(-1) - 1``
    clamped at 0, so a row's numbers do not depend on the other rows' lengths. With ``num_samples = n > 1`` (a GRPO
    group: the caller's grouping, kept) each prompt is given once, prefilled once, and its KV cache copied to its
    ``n`` sample rows (prompt-major: rows ``[b*n, (b+1)*n)`` are prompt ``b``'s); without, identical prompts are
    found by their ids and prefilled once likewise (:func:`unique_rows`). At each step the next-token logits
    ``z`` (fp32) give the reported log-prob ``log_softmax(z / T)[x]`` of the chosen id ``x`` -- the temperature-scaled
    full distribution, **not** renormalised after top-k/top-p/min-p or the repetition penalty -- and the processed
    scores give ``x`` (a sample, or the argmax when greedy). A row is done once it emits any id of
    ``config.eos_token_ids`` (kept as the response's last token), or the token whose decoded text completes one of
    ``config.stop_sequences`` (kept likewise; matched on the response text with special tokens, see
    :class:`_StopStrings`); before ``config.min_new_tokens`` tokens neither stops a row (eos ids are masked out of
    the scores). The loop stops when every row is done or after ``config.max_new_tokens`` steps. The model's
    train/eval mode is left unchanged; no gradients are recorded.

    Processing, in ``model.generate``'s order: repetition penalty and no-repeat-n-gram on each row's **unpadded** ids
    (prompt and response so far; padding never counts), the eos mask of ``min_new_tokens``, then temperature,
    top-k, top-p, min-p. The reported log-probs are of the tempered raw logits, whatever the processing; see
    :func:`prefix_dependent_settings` for the settings under which the sampled ids then depart from them.

    Sampling: without ``seeds``, ``torch.multinomial`` on the global RNG of ``device`` (one draw for the whole batch
    per step, so a row's sample depends on the batch). With ``seeds``, row ``i`` draws ``config.max_new_tokens``
    float64 uniforms up front from its own ``torch.Generator`` on ``device`` seeded with ``seeds[i]`` and samples step
    ``t`` with :func:`sample_from_probs` on uniform ``t``: the choice depends only on that seed and on the row's
    processed probabilities, never on the other rows or on the global RNG (left untouched). Bit-identical
    ids then need bit-identical logits, which a different padded batch layout can perturb at float precision.

    Args:
        model: an HF causal LM.
        prompts: ``B`` non-empty 1-D ``torch.long`` id tensors.
        config: resolved settings (:func:`resolve_generation_config`).
        device: where to run (default: the model's parameters' device).
        max_context: the model's context length; ``None`` reads ``model.config.max_position_embeddings``.
        seeds: ``B * num_samples`` integer seeds (a sequence of ints in ``[-2**63, 2**64)``, taken modulo ``2**64``,
            or a 1-D integer tensor), one per sample row; ``None`` = global RNG. Ignored when greedy (still
            validated). Equal seeds on equal prompts give equal samples: derive distinct seeds per sample with
            :func:`row_seed`.
        tokenizer: decodes responses for ``config.stop_sequences`` (required then, unused otherwise).
        num_samples: samples per prompt (>= 1).
        done_check_every: decode steps between two reads of "is every row done?" on the host (each one a
            device-to-host sync: on a GPU the host then waits for the step instead of queueing the next ones).
            ``None``: every step on the CPU (a read costs nothing there, a decode step past the end costs a forward
            pass), every :data:`DONE_CHECK_EVERY` steps elsewhere. The outputs are the same for every value (steps
            past the last stop only decode padding, cut off by the rows' lengths); only the work after the last
            stop (at most ``done_check_every - 1`` extra steps) and, when sampling from the global RNG (no
            ``seeds``), the draws taken from it differ. With ``stop_sequences`` the host decodes every step anyway
            and stops as soon as every row is done.

    Host syncs (DESIGN.md "Memory and speed", issue 28): the prompts are padded where they are and copied to
    ``device`` once; each decode step reads nothing back (the done check above aside; ``stop_sequences`` read the
    step's sampled ids, one copy per step); the row lengths are read once at the end. Transformers' row-dependent
    processors (``no_repeat_ngram_size``) read each row's ids themselves.

    Returns:
        :class:`GenerationOutput` with per-row ids, log-probs and truncation flags (``B * num_samples`` rows,
        prompt-major), on ``device``.

    Raises:
        ValueError: see :func:`check_token_ids` (empty prompt, id outside the vocabulary, prompt plus
            ``max_new_tokens`` longer than the context); ``seeds`` of the wrong length, shape or type, or with an
            entry that is not an integer (the message names ``seeds``); ``stop_sequences`` without a tokenizer;
            ``num_samples`` or ``done_check_every`` not an integer >= 1.
    """
    if device is None:
        device = next(model.parameters()).device
    check_token_ids(model, prompts, extra=config.max_new_tokens, max_context=max_context, what="generate: prompt")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"generate: num_samples must be an integer >= 1, got {num_samples!r}.")
    if done_check_every is not None and (isinstance(done_check_every, bool) or not isinstance(done_check_every, int)
                                         or done_check_every < 1):
        raise ValueError(f"generate: done_check_every must be an integer >= 1 (or None: by device), got "
                         f"{done_check_every!r}.")
    device = torch.device(device)
    lengths = [int(p.numel()) for p in prompts]
    batch = len(prompts) * num_samples
    seed_list = _check_seeds(seeds, batch) if seeds is not None else None
    # padded where the prompts are (the host, usually), then one copy to the device for everything built here
    ids = pad_rows([p.to(dtype=torch.long) for p in prompts], config.pad_token_id)
    width = ids.shape[1]
    attn = (torch.arange(width, device=ids.device) >= torch.tensor([width - n for n in lengths],
                                                                     device=ids.device)[:, None]).long()
    eos = torch.tensor(config.eos_token_ids, dtype=torch.long, device=ids.device)
    if num_samples > 1:  # the caller's groups: every prompt prefilled once, its cache copied to its samples
        ids, attn, eos = rows_to_device([ids, attn, eos], device)
        unique = torch.arange(len(prompts), device=device)
        inverse: Tensor | None = unique.repeat_interleave(num_samples)
    else:  # plain rows: identical prompts (found by their ids) prefilled once
        unique, inverse = unique_rows(ids, lengths)
        ids, attn, eos, unique, *inv = rows_to_device(
            [ids, attn, eos, unique, *([] if inverse is None else [inverse])], device)
        inverse = inv[0] if inv else None
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    prefill = {"input_ids": ids[unique], "attention_mask": attn[unique], "position_ids": position_ids[unique]}
    if num_samples > 1:
        lengths = [n for n in lengths for _ in range(num_samples)]
        ids, attn, position_ids = ids[inverse], attn[inverse], position_ids[inverse]
    row_procs, warpers = _processors(config)
    stop_strings = _StopStrings(tokenizer, config.stop_sequences, batch) if config.stop_sequences else None
    cache_kw = cache_kwarg(model)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    # Each distinct prompt is prefilled once and its KV cache and last logits gathered back to every row of it: the
    # same numbers as prefilling each row, for 1/G the cost.
    out = model(**prefill, use_cache=True, **extra)
    cache = out.get("cache", None) or out.get("past_key_values", None)
    if inverse is not None:
        if cache is None or not hasattr(cache, "layers"):
            out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=True, **extra)
            cache = out.get("cache", None) or out.get("past_key_values", None)
        else:
            for layer in cache.layers:
                layer.batch_select_indices(inverse)
            out.logits = out.logits[inverse]
    uniforms = None
    if seed_list is not None and config.do_sample:
        uniforms = _row_uniforms(seed_list, config.max_new_tokens, device)
    check_every = done_check_every if done_check_every is not None else (1 if device.type == "cpu" else
                                                                          DONE_CHECK_EVERY)
    seq = ids
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    done_host = [False] * batch if stop_strings is not None else None  # stop strings: the host knows every stop
    eos_set = frozenset(config.eos_token_ids)
    ended = torch.zeros(batch, dtype=torch.bool, device=device)  # stopped by an eos id or a stop string
    end_len = torch.full((batch,), config.max_new_tokens, dtype=torch.long, device=device)
    new_column = torch.ones(batch, 1, dtype=attn.dtype, device=device)
    steps_ids: list[Tensor] = []
    steps_lp: list[Tensor] = []
    for step in range(config.max_new_tokens):
        logits = out.logits[:, -1, :].float()
        scores = logits
        if row_procs:
            width = seq.shape[1]
            rows = []
            for b in range(batch):
                row_ids, row_scores = seq[b:b + 1, width - lengths[b] - step:], scores[b:b + 1]
                for proc in row_procs:
                    row_scores = proc(row_ids, row_scores)
                rows.append(row_scores)
            scores = torch.cat(rows)
        if step < config.min_new_tokens:
            scores = scores.index_fill(1, eos, float("-inf"))
        for proc in warpers:
            scores = proc(seq, scores)
        if uniforms is not None:
            nxt = sample_from_probs(torch.softmax(scores, dim=-1), uniforms[step])
        elif config.do_sample:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            nxt = scores.argmax(dim=-1)
        nxt = torch.where(done, torch.full_like(nxt, config.pad_token_id), nxt)
        lp = torch.log_softmax(logits / config.temperature, dim=-1).gather(1, nxt[:, None]).squeeze(1)
        steps_ids.append(nxt)
        steps_lp.append(lp.masked_fill(done, 0.0))
        stop = torch.isin(nxt, eos) & ~done
        all_done = None  # known on the host without a sync (stop strings), else read every check_every steps
        if stop_strings is not None:  # the one host read of the step: the sampled ids, to decode
            can_stop = step + 1 >= config.min_new_tokens
            host_ids = nxt.tolist()
            hits = stop_strings.hit(host_ids, [not d for d in done_host], can_stop=can_stop)
            stop = stop | torch.tensor(hits, dtype=torch.bool, device=device)
            done_host = [d or h or i in eos_set for d, h, i in zip(done_host, hits, host_ids)]
            all_done = all(done_host)
        end_len = torch.where(stop, torch.full_like(end_len, step + 1), end_len)
        ended = ended | stop
        done = done | stop
        if step == config.max_new_tokens - 1:
            break
        if all_done is None and (step + 1) % check_every == 0:
            all_done = bool(done.all())
        if all_done:
            break
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        attn = torch.cat([attn, new_column], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                    use_cache=True, **{cache_kw: cache})
        cache = out.get("cache", None) or out.get("past_key_values", None)
    all_ids = torch.stack(steps_ids, dim=1)  # [B, S]
    all_lp = torch.stack(steps_lp, dim=1)
    resp_len = end_len.clamp(max=all_ids.shape[1]).tolist()
    response_ids = [all_ids[b, :resp_len[b]] for b in range(batch)]
    response_lp = [all_lp[b, :resp_len[b]] for b in range(batch)]
    return GenerationOutput(response_ids=response_ids, response_log_probs=response_lp, truncated=~ended)
