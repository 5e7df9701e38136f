"""Greedy GSM8K accuracy: generate an answer per question with the policy wrapper and match the final number.

Each GSM8K row (``{"question", "answer"}``) is rendered exactly as :class:`~lit_llm.lightning.SFTDataModule` renders
it for training (optional system prompt, the question as the user message, the chat template's generation prompt),
so the ids the model continues are the training prompts' ids (DESIGN.md property 1). Answers are generated greedily
through the generate version of :class:`~lit_llm.policy.TransformersWrapper` (``input_mode="tokens"``, KV cache,
stops at every EOS id), in batches sorted by prompt length, decoded without special tokens and scored with
:func:`lit_llm.rewards.gsm8k_answer_reward` (the number after the last ``####``, else the last number, compared as a
decimal to the reference's ``#### N``).

Usage (``lit-llm evaluate``; ``python -m lit_llm.evaluation`` takes the same options)::

    lit-llm evaluate --model smollm2-135m-instruct --data gsm8k/test.jsonl --limit 100
    lit-llm evaluate --model runs/sft_gsm8k/checkpoints/last.ckpt --data gsm8k/test.jsonl --limit 100 --out eval.jsonl

``--model`` is a ``lit-llm fit`` checkpoint, a ``lit-llm export`` folder, a model name or a Hub id in the HF cache
(:func:`lit_llm.lightning.export.load_inference_policy`). Torch is imported only once the options are parsed, so
``lit-llm evaluate --help`` answers at once.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["GSM8KResult", "command", "evaluate_gsm8k", "main"]


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
        ValueError: ``batch_size`` or ``max_new_tokens`` < 1, or ``limit`` < 1 (``None`` is all rows).
        DataFormatError: rows without ``question`` / ``answer`` (the message names the file and those columns).
    """
    import torch
    from tensordict import TensorDict, lazy_stack

    from lit_llm.data.containers import Tokens
    from lit_llm.data.datasets import DataFormatError, read_examples, tokenize_example
    from lit_llm.policy import TransformersWrapper
    from lit_llm.rewards import gsm8k_answer_reward

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"evaluate_gsm8k: batch_size and max_new_tokens must be >= 1, got {batch_size}, "
                         f"{max_new_tokens}.")
    if limit is not None and limit < 1:
        raise ValueError(f"evaluate_gsm8k: limit must be >= 1 (or None = all rows), got {limit}.")
    try:
        examples = read_examples(path, fmt="gsm8k", system_prompt=system_prompt, limit=limit, option="--data")
    except DataFormatError as e:  # the reader's fix names --data.format, an option of fit, not of evaluate
        generic = "Fix the row, or choose the right --data.format."
        if generic not in str(e):
            raise
        raise DataFormatError(str(e).replace(generic, f"lit-llm evaluate reads GSM8K rows: --data {path} needs "
                                             f"'question' and 'answer' columns (the answer ending '#### N').")) from e
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
    with torch.no_grad():
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


def command(argv: Sequence[str] | None = None) -> GSM8KResult:
    """``lit-llm evaluate`` (and ``python -m lit_llm.evaluation``): print the accuracy as a JSON line, write
    per-question rows with ``--out``. The options are parsed (``--help`` answered) before torch is imported.

    Raises:
        FileNotFoundError / ValueError: a missing model, checkpoint or data file, a bad row or setting (the console
            script prints them as one ``lit-llm evaluate: error:`` line).
    """
    from lit_llm.cli_commands import ToolParser

    p = ToolParser(prog="lit-llm evaluate", description="Greedy GSM8K final-answer accuracy of a model or a lit-llm "
                   "checkpoint (prompts rendered as in training; '#### N' or the last number vs the reference).")
    p.add_argument("--model", "--model_name_or_path", type=str, default="smollm2-135m-instruct",
                   help="a .ckpt written by lit-llm fit, a lit-llm export folder, a model name or a Hub id (HF cache)")
    p.add_argument("--data", type=str, required=True, help="GSM8K rows (question/answer): .jsonl, .parquet, .csv")
    p.add_argument("--limit", type=int, default=100, help="first N questions (0 = all)")
    p.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=256, help="answer budget in tokens")
    p.add_argument("--batch_size", "--batch-size", type=int, default=32, help="questions per generate call")
    p.add_argument("--system_prompt", "--system-prompt", type=str | None, default=None,
                   help="system message (as data.system_prompt in training)")
    p.add_argument("--device", type=str, default="auto", help="auto (cuda when available, else cpu), cpu, cuda, ...")
    p.add_argument("--threads", type=int | None, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", type=str | None, default=None, help="write per-question rows (JSONL) here")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.limit < 0:
        p.error(f"--limit: must be >= 0 (0 = all questions), got {args.limit}")
    import torch

    from lit_llm.lightning.export import load_inference_policy

    if args.threads:
        torch.set_num_threads(args.threads)
    policy = load_inference_policy(args.model, device=args.device, who="lit-llm evaluate")
    res = evaluate_gsm8k(policy.model, policy.tokenizer, args.data, limit=args.limit or None,
                         max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         system_prompt=args.system_prompt, progress=True)
    summary = {k: v for k, v in asdict(res).items() if k != "rows"}
    summary.update(model=args.model, data=args.data, limit=args.limit, max_new_tokens=args.max_new_tokens)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in res.rows), encoding="utf-8")
    print(json.dumps(summary), flush=True)
    return res


#: ``python -m lit_llm.evaluation``'s entry point (same options as ``lit-llm evaluate``).
main = command


if __name__ == "__main__":
    main()
