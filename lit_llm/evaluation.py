"""Greedy GSM8K accuracy (``lit-llm evaluate``): generate an answer per question with the policy wrapper and match
the final number; and greedy completions of any prompt file, scored by reward functions (``lit-llm predict``).

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

and (``lit-llm predict``: one JSON line per prompt, :func:`predict`)::

    lit-llm predict --model CKPT --data prompts.jsonl --out completions.jsonl --reward_funcs [arithmetic_answer_reward]

``--model`` is a ``lit-llm fit`` checkpoint, a ``lit-llm export`` folder, a model name or a Hub id in the HF cache
(:func:`lit_llm.lightning.export.load_inference_policy`). Torch is imported only once the options are parsed, so
``lit-llm evaluate --help`` / ``lit-llm predict --help`` answer at once.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Completions", "GSM8KResult", "command", "evaluate_gsm8k", "greedy_completions", "main", "predict",
           "predict_command"]


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


@dataclass
class Completions:
    """Outcome of :func:`greedy_completions` (one entry per prompt, in the prompts' order).

    Attributes:
        completions: the responses decoded without special tokens.
        response_ids: the response token ids (``[L_i]`` int64, ending with the stop token unless truncated).
        truncated: responses that hit ``max_new_tokens`` without a stop token.
        generated_tokens: response tokens generated (stop tokens included).
        seconds: wall time of the generation.
    """

    completions: list[str]
    response_ids: list[Any]
    truncated: list[bool]
    generated_tokens: int
    seconds: float


def greedy_completions(model: Any, tokenizer: Any, prompt_ids: Sequence[Any], *, max_new_tokens: int = 256,
                       batch_size: int = 32, progress: bool = False) -> Completions:
    """Greedy responses of ``model`` to tokenised prompts through the generate version of
    :class:`~lit_llm.policy.TransformersWrapper` (``input_mode="tokens"``, KV cache, every EOS id stops), in batches
    of ``batch_size`` sorted by prompt length (left-padded by the wrapper); eval mode and no grad for the call, the
    model's mode restored after. Shared by ``lit-llm evaluate`` and ``lit-llm predict``.

    Args:
        model, tokenizer: an HF causal LM and its tokenizer.
        prompt_ids: ``P`` 1-D int tensors, the ids the model continues (rendered with the generation prompt).
        max_new_tokens: response budget per prompt.
        batch_size: prompts per generate call.
        progress: print one line per batch.
    """
    import torch
    from tensordict import TensorDict, lazy_stack

    from lit_llm.data.containers import Tokens
    from lit_llm.policy import TransformersWrapper

    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", return_log_probs=False,
                                 generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": False})
    order = sorted(range(len(prompt_ids)), key=lambda i: -prompt_ids[i].numel())
    out_ids: list[Any] = [None] * len(prompt_ids)
    truncated = [False] * len(prompt_ids)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    with torch.no_grad():
        try:
            for s in range(0, len(order), batch_size):
                idx = order[s:s + batch_size]
                td = TensorDict(tokens=lazy_stack([Tokens(prompt=prompt_ids[i], padded=False) for i in idx]),
                                batch_size=[len(idx)])
                out = policy(td)
                responses = out.get(("tokens", "response"), as_list=True)
                for j, i in enumerate(idx):
                    out_ids[i] = responses[j]
                    truncated[i] = bool(out["truncated"][j])
                if progress:
                    print(f"  generated {min(s + batch_size, len(order))}/{len(order)} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            model.train(was_training)
    return Completions([tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in out_ids], out_ids, truncated,
                       sum(int(r.numel()) for r in out_ids), time.perf_counter() - t0)


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
    from lit_llm.data.datasets import DataFormatError, read_examples, tokenize_example
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
    gen = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress)
    completions, truncated = gen.completions, gen.truncated
    refs = [ex.reference for ex in examples]
    scores = gsm8k_answer_reward(prompts=[None] * len(refs), completions=completions, answer=refs)
    rows = [{"sample_id": ex.sample_id, "completion": c, "reference": r, "correct": bool(sc), "truncated": tr}
            for ex, c, r, sc, tr in zip(examples, completions, refs, scores, truncated)]
    correct = sum(int(r["correct"]) for r in rows)
    return GSM8KResult(accuracy=correct / max(len(rows), 1), correct=correct, total=len(rows),
                       truncated=sum(truncated), with_hashes=sum("####" in c for c in completions),
                       seconds=gen.seconds, generated_tokens=gen.generated_tokens, rows=rows)


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


def predict(model: Any, tokenizer: Any, data: str, *, reward_funcs: Sequence[Any] | None = None,
            limit: int | None = None, max_new_tokens: int = 256, batch_size: int = 32,
            system_prompt: str | None = None, string_prompts: str = "chat",
            chat_template_kwargs: dict[str, Any] | None = None, progress: bool = False) -> tuple[list[dict], Any]:
    """Greedy completions of every prompt of a prompt file, scored by reward functions when given.

    The rows are read as GRPO's data module reads them (:func:`lit_llm.lightning.grpo_data.prompt_rows`: a ``prompt``
    column, string or messages, and any other columns), rendered with the generation prompt
    (:func:`lit_llm.data.prompts.tokenize_prompts`) and answered by :func:`greedy_completions`; the reward functions
    (:class:`lit_llm.rewards.RewardFunctions`: built-in names, ``module:function``, ``file.py:function``) get the
    completions as GRPO's greedy evaluation passes them (a string for a text prompt, ``[{"role": "assistant",
    "content": ...}]`` for a chat prompt), the ids and the row's other columns.

    Returns:
        ``(rows, completions)``: per prompt ``{"sample_id", "prompt", "completion", "truncated"}`` plus ``"rewards"``
        (``{function: float, or None where it returned None}``) when ``reward_funcs`` is given; and the
        :class:`Completions`.

    Raises:
        FileNotFoundError, DataFormatError: a missing file, no ``prompt`` column, a bad row (file:line named).
        RewardError: an unknown reward function, a column it needs that the file lacks, a function that fails.
    """
    import math
    import warnings

    from lit_llm.data.prompts import tokenize_prompts
    from lit_llm.lightning.grpo_data import prompt_rows
    from lit_llm.rewards import RewardFunctions

    rows = prompt_rows(data, system_prompt=system_prompt, string_prompts=string_prompts, limit=limit,
                       option="--data", split="test")
    columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "sample_id")}
    # a None reward is recorded as null (no total is reported, so TRL's "total 0" for all-None rows does not apply)
    rewards = RewardFunctions(list(reward_funcs), allow_all_none=True) if reward_funcs else None
    if rewards is not None:
        rewards.check_columns(columns, source=f"--data {data}")
    prompts = [r["prompt"] for r in rows]
    ids = tokenize_prompts(prompts, tokenizer, chat_template_kwargs=chat_template_kwargs)
    gen = greedy_completions(model, tokenizer, ids, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress)
    out = [{"sample_id": r["sample_id"], "prompt": p, "completion": c, "truncated": t}
           for r, p, c, t in zip(rows, prompts, gen.completions, gen.truncated)]
    if rewards is not None:
        completions = [c if isinstance(p, str) else [{"role": "assistant", "content": c}]
                       for p, c in zip(prompts, gen.completions)]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Every reward function .* returned None")
            _, per_fn = rewards(prompts=prompts, completions=completions,
                                completion_ids=[r.tolist() for r in gen.response_ids], **columns)
        for i, row in enumerate(out):
            row["rewards"] = {n: (None if math.isnan(float(v[i])) else float(v[i])) for n, v in per_fn.items()}
    return out, gen


def predict_command(argv: Sequence[str]) -> list[dict]:
    """``lit-llm predict --data PROMPTS --out OUT.jsonl [--model M] [--reward_funcs [f, ...]]``: greedy completions
    of a prompt file as JSONL (one ``{"sample_id", "prompt", "completion", "truncated"[, "rewards"]}`` per prompt, in
    file order), written to a temporary file and renamed when complete; a JSON summary line on stdout. The options
    are parsed (``--help`` answered) before torch is imported.

    Raises:
        FileExistsError: ``--out`` exists and ``--overwrite`` is not set.
        FileNotFoundError / ValueError: a missing model, checkpoint or data file, a bad row, a bad reward function
            (the console script prints them as one ``lit-llm predict: error:`` line).
    """
    import os
    import tempfile

    from lit_llm.cli_commands import ToolParser

    p = ToolParser(prog="lit-llm predict", description="Greedy completions of a model or a lit-llm checkpoint for "
                   "every prompt of a file (a 'prompt' column: text or messages, as GRPO data), as JSONL, scored by "
                   "reward functions when given.")
    p.add_argument("--model", "--model_name_or_path", type=str, default="smollm2-135m-instruct",
                   help="a .ckpt written by lit-llm fit, a lit-llm export folder, a model name or a Hub id (HF cache)")
    p.add_argument("--data", type=str, required=True, help="prompt rows: .jsonl, .parquet, .csv, .tsv, .json")
    p.add_argument("--out", type=str, required=True, help="the JSONL file to write")
    p.add_argument("--overwrite", type=bool, default=False, help="replace --out if it exists")
    p.add_argument("--reward_funcs", type=list[str] | None, default=None,
                   help="reward functions to score the completions with (built-in names, module:function, "
                        "file.py:function), e.g. [arithmetic_answer_reward]")
    p.add_argument("--string_prompts", type=Literal["chat", "text"], default="chat",
                   help="chat: a string prompt is one user message rendered with the chat template; text: tokenised "
                        "as it is (as --data.string_prompts of GRPO)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts (0 = all)")
    p.add_argument("--max_new_tokens", type=int, default=256, help="completion budget in tokens")
    p.add_argument("--batch_size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--system_prompt", type=str | None, default=None, help="system message of chat prompts")
    p.add_argument("--device", type=str, default="auto", help="auto (cuda when available, else cpu), cpu, cuda, ...")
    args = p.parse_args(list(argv))
    if args.limit < 0 or args.max_new_tokens < 1 or args.batch_size < 1:
        p.error(f"--limit must be >= 0 (0 = all prompts), --max_new_tokens and --batch_size >= 1; got {args.limit}, "
                f"{args.max_new_tokens}, {args.batch_size}")
    out = Path(args.out).expanduser()
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"lit-llm predict: --out {str(out)!r} exists; choose another --out or pass "
                              f"--overwrite true to replace it.")
    if out.exists() and not out.is_file():
        raise IsADirectoryError(f"lit-llm predict: --out {str(out)!r} is a folder; give a file path (.jsonl).")
    from lit_llm.lightning.export import check_writable_folder, load_inference_policy

    if not out.exists():
        check_writable_folder(out, "--out", "lit-llm predict")
    policy = load_inference_policy(args.model, device=args.device, who="lit-llm predict")
    rows, gen = predict(policy.model, policy.tokenizer, args.data, reward_funcs=args.reward_funcs,
                        limit=args.limit or None, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        system_prompt=args.system_prompt, string_prompts=args.string_prompts,
                        chat_template_kwargs=policy.chat_template_kwargs, progress=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    summary: dict[str, Any] = {"model": args.model, "data": args.data, "out": str(out), "rows": len(rows),
                               "truncated": sum(gen.truncated), "generated_tokens": gen.generated_tokens,
                               "seconds": round(gen.seconds, 3)}
    for name in rows[0].get("rewards", {}):
        values = [r["rewards"][name] for r in rows if r["rewards"][name] is not None]
        summary[f"reward/{name}"] = sum(values) / len(values) if values else None
    print(json.dumps(summary), flush=True)
    return rows


#: ``python -m lit_llm.evaluation``'s entry point (same options as ``lit-llm evaluate``).
main = command


if __name__ == "__main__":
    main()
