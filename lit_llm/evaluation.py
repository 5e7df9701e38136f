"""Greedy GSM8K accuracy: generate an answer per question with the policy wrapper and match the final number.

Each GSM8K row (``{"question", "answer"}``) is rendered exactly as :class:`~lit_llm.lightning.SFTDataModule` renders
it for training (optional system prompt, the question as the user message, the chat template's generation prompt),
so the ids the model continues are the training prompts' ids (DESIGN.md property 1). Answers are generated greedily
through the generate version of :class:`~lit_llm.policy.TransformersWrapper` (``input_mode="tokens"``, KV cache,
stops at every EOS id), in batches sorted by prompt length, decoded without special tokens and scored with
:func:`lit_llm.rewards.gsm8k_answer_reward` (the number after the last ``####``, else the last number, compared as a
decimal to the reference's ``#### N``).

Usage::

    python -m lit_llm.evaluation --model smollm2-135m-instruct --data ../shared/data/gsm8k/test.jsonl --limit 100
    python -m lit_llm.evaluation --model runs/sft_gsm8k/hf --data ../shared/data/gsm8k/test.jsonl --limit 100 \\
        --out eval.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["GSM8KResult", "evaluate_gsm8k", "main"]


@dataclass
class GSM8KResult:
    """Outcome of :func:`evaluate_gsm8k`.

    Attributes:
        accuracy: fraction of questions whose extracted final answer equals the reference (0-1).
        correct: number of correct answers.
        total: number of questions.
        truncated: answers that hit ``max_new_tokens`` without a stop token.
        with_hashes: answers containing ``####`` (the GSM8K final-answer marker).
        seconds: wall time of the generation.
        generated_tokens: response tokens generated (stop tokens included).
        rows: per question ``{"sample_id", "completion", "reference", "correct", "truncated"}``.
    """

    accuracy: float
    correct: int
    total: int
    truncated: int
    with_hashes: int
    seconds: float
    generated_tokens: int
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)


@torch.no_grad()
def evaluate_gsm8k(model: Any, tokenizer: Any, path: str, *, limit: int | None = 100, max_new_tokens: int = 256,
                   batch_size: int = 32, system_prompt: str | None = None, chat_template: str | None = None,
                   progress: bool = False) -> GSM8KResult:
    """Greedy final-answer accuracy of ``model`` on the first ``limit`` rows of a GSM8K JSONL file.

    Args:
        model: an HF causal LM (put in eval mode for the call, its mode restored after).
        tokenizer: its tokenizer.
        path: GSM8K JSONL (``question`` / ``answer`` per line).
        limit: first N rows (``None`` = all).
        max_new_tokens: generation budget per answer.
        batch_size: prompts per generate call (left-padded; sorted by length to cut padding).
        system_prompt: optional system message (as ``data.system_prompt`` in training).
        chat_template: Jinja string or ``.jinja`` path (``None`` = the tokenizer's own).
        progress: print one line per batch.

    Returns:
        A :class:`GSM8KResult`.

    Raises:
        FileNotFoundError, DataFormatError: missing file or bad row (see :func:`lit_llm.data.datasets.read_examples`).
        ValueError: ``batch_size`` or ``max_new_tokens`` < 1.
    """
    from tensordict import TensorDict, lazy_stack

    from lit_llm.data.containers import Tokens
    from lit_llm.data.datasets import read_examples, tokenize_example
    from lit_llm.policy import TransformersWrapper
    from lit_llm.rewards import gsm8k_answer_reward

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"evaluate_gsm8k: batch_size and max_new_tokens must be >= 1, got {batch_size}, "
                         f"{max_new_tokens}.")
    examples = read_examples(path, fmt="gsm8k", system_prompt=system_prompt, limit=limit, option="--data")
    prompts = [tokenize_example(ex, tokenizer, chat_template=chat_template).prompt_ids for ex in examples]
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", return_log_probs=False,
                                 generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": False})
    order = sorted(range(len(prompts)), key=lambda i: -prompts[i].numel())
    completions: list[str] = [""] * len(prompts)
    truncated = [False] * len(prompts)
    n_tokens = 0
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    try:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            td = TensorDict(tokens=lazy_stack([Tokens(prompt=prompts[i], padded=False) for i in idx]),
                            batch_size=[len(idx)])
            out = policy(td)
            responses = out.get(("tokens", "response"), as_list=True)
            for j, i in enumerate(idx):
                completions[i] = tokenizer.decode(responses[j].tolist(), skip_special_tokens=True)
                truncated[i] = bool(out["truncated"][j])
                n_tokens += int(responses[j].numel())
            if progress:
                print(f"  generated {min(s + batch_size, len(order))}/{len(order)} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - t0
    refs = [ex.reference for ex in examples]
    scores = gsm8k_answer_reward(prompts=[None] * len(refs), completions=completions, answer=refs)
    rows = [{"sample_id": ex.sample_id, "completion": c, "reference": r, "correct": bool(sc), "truncated": tr}
            for ex, c, r, sc, tr in zip(examples, completions, refs, scores, truncated)]
    correct = sum(int(r["correct"]) for r in rows)
    return GSM8KResult(accuracy=correct / max(len(rows), 1), correct=correct, total=len(rows),
                       truncated=sum(truncated), with_hashes=sum("####" in c for c in completions), seconds=seconds,
                       generated_tokens=n_tokens, rows=rows)


def main(argv: Sequence[str] | None = None) -> GSM8KResult:
    """``python -m lit_llm.evaluation``: print the accuracy as a JSON line (and write per-question rows with
    ``--out``)."""
    p = argparse.ArgumentParser(description="Greedy GSM8K final-answer accuracy of a model.")
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or a local HF folder")
    p.add_argument("--data", required=True, help="GSM8K JSONL (question/answer)")
    p.add_argument("--limit", type=int, default=100, help="first N questions (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="write per-question rows (JSONL) here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from lit_llm.models import load_model

    model, tokenizer = load_model(args.model)
    res = evaluate_gsm8k(model, tokenizer, args.data, limit=args.limit or None, max_new_tokens=args.max_new_tokens,
                         batch_size=args.batch_size, system_prompt=args.system_prompt, progress=True)
    summary = {k: v for k, v in asdict(res).items() if k != "rows"}
    summary.update(model=args.model, data=args.data, limit=args.limit, max_new_tokens=args.max_new_tokens)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in res.rows), encoding="utf-8")
    print(json.dumps(summary))
    return res


if __name__ == "__main__":
    main()
