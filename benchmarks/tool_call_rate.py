"""Base rate of tool calls (issue 16, "Real outcome", first measurement): how often does SmolLM2-135M-Instruct, asked a
calculator problem with the calculator tool described in its prompt, write a parsable ``<tool_call>``?

Method: ``--prompts`` problems of :class:`~lit_llm.rollouts.envs.CalculatorEnv` (``make_rows(split="eval")``),
rendered as the episode engine renders a first turn: SmolLM2's template does not take ``tools=``
(:func:`~lit_llm.rollouts.envs.template_supports_tools` is False), so the tools are described by a system message
(:func:`~lit_llm.rollouts.envs.tools_system_prompt`) before the row's user message; ``add_generation_prompt=True``.
Each prompt is sampled ``--generations`` times at ``--temperature`` (per-row seeds, the engine's
:func:`~lit_llm.rollouts.engine.row_seeds`) with the generate version the GRPO module builds
(:class:`~lit_llm.policy.TransformersWrapper`, tokens mode, ``do_sample=True``), ``--max-new-tokens`` per turn. Each
completion, decoded with ``skip_special_tokens=True``, is classified:

* **markup**: it holds ``<tool_call>`` / ``</tool_call>`` or is a bare JSON call (an attempt);
* **parsable**: :func:`~lit_llm.rollouts.envs.parse_tool_calls` returns at least one call without error;
* **right tool, valid args**: a parsed call named ``calculator`` whose arguments pass the tool's schema check;
* **right result**: such a call whose expression evaluates to the problem's answer;
* **no-tool exact**: a completion without call markup whose last number is the answer (the no-tool baseline).

With ``--answer-turn`` (the default) every sample whose first turn calls ``calculator`` with valid arguments gets a
second turn, as an episode would: the environment runs the call (:meth:`CalculatorEnv.step`, its tool message
appended), the conversation is rendered again with the generation prompt (a re-render: the episode engine's
token-in / token-out suffixes are not used here; SmolLM2's template renders earlier turns verbatim) and sampled once
more (same temperature, ``--answer-tokens``); the environment scores that turn exactly (``CalculatorEnv.score``: its
last number is the answer). Reported as

* **episode exact**: samples whose two-turn episode ends with the exact answer (over all samples), and the
  final turns that call a tool again instead of answering.

``--no-tools`` measures the **no-tool baseline** instead: the same problems asked without any tool (the user message
"What is {expression}? Give the final answer as a number.", no system message, no ``tools=``), scored as an episode's
final turn (``CalculatorEnv.score``: the last number is the answer). ``--greedy`` decodes greedily (one completion per
prompt, as the GRPO evaluation does) instead of sampling ``--generations`` at ``--temperature``.

``--model`` picks the model (default the embedded SmolLM2-135M-Instruct; e.g. the HF folder ``lit-llm export`` writes
after the ``configs/sft_calculator_tools.yaml`` warm-up).

Run: ``HF_HUB_OFFLINE=1 python benchmarks/tool_call_rate.py [--model DIR] [--prompts 64 --generations 8
--max-new-tokens 64] [--threads 1]``; the no-tool baseline of the GRPO evaluation's 100 held-out problems:
``--no-tools --greedy --prompts 100``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from _memory import machine_line

from lit_llm.models import load_model
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rollouts.engine import policy_responses, row_seeds
from lit_llm.rollouts.envs import (
    CalculatorEnv,
    ToolCallParseError,
    evaluate_expression,
    parse_tool_calls,
    prompt_with_tools,
    template_supports_tools,
)
from lit_llm.rollouts.envs.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def first_turn_messages(env: CalculatorEnv, row: dict, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The first render's messages and ``tools=`` argument (:func:`~lit_llm.rollouts.envs.prompt_with_tools`): the
    tools go to the template when it takes them, else into a system message."""
    return prompt_with_tools(env.reset(row), env.tools, template_takes_tools=template_supports_tools(tokenizer))


def sample(policy, tokenizer, prompts: list[torch.Tensor], seeds: torch.Tensor, batch_size: int,
           label: str) -> tuple[list[str], int, float]:
    """Sample one completion per prompt (batches of ``batch_size``): ``(texts, truncated count, seconds)``."""
    texts: list[str] = []
    truncated = 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch_size):
            resp, _, trunc = policy_responses(policy, prompts[i:i + batch_size], seeds=seeds[i:i + batch_size])
            texts += tokenizer.batch_decode([r.tolist() for r in resp], skip_special_tokens=True)
            truncated += sum(trunc)
            print(f"  {label}: {len(texts)}/{len(prompts)} sampled, {time.perf_counter() - start:.0f} s", flush=True)
    return texts, truncated, time.perf_counter() - start


def classify(text: str, env: CalculatorEnv, row: dict) -> dict[str, bool]:
    tool = env.tools[0]
    try:
        calls = parse_tool_calls(text)
        parse_ok = True
    except ToolCallParseError:
        calls, parse_ok = [], False
    markup = TOOL_CALL_OPEN in text or TOOL_CALL_CLOSE in text or bool(calls) or not parse_ok
    valid = [c for c in calls if c.name == tool.name and tool.validate(c.arguments) is None]

    def right(call) -> bool:
        try:
            return str(evaluate_expression(call.arguments["expression"])) == row["answer"]
        except (ValueError, TypeError):
            return False

    return {"markup": markup, "parsable": parse_ok and bool(calls), "right_tool_valid_args": bool(valid),
            "right_result": any(right(c) for c in valid),
            "no_tool_exact": not markup and env.score(text, row) == 1.0}


def decoding(args: argparse.Namespace) -> dict:
    """``generate`` keywords of ``--greedy`` / ``--temperature``."""
    return {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": args.temperature}


def no_tool_baseline(policy, tokenizer, env: CalculatorEnv, rows: list[dict], args: argparse.Namespace) -> None:
    """Ask each problem without a tool and print how many answers end with the exact result."""
    prompts = [torch.tensor(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {row['expression']}? Give the final answer as a number."}],
        add_generation_prompt=True, tokenize=True, return_dict=False), dtype=torch.long) for row in rows]
    flat = [prompts[k] for k in range(len(rows)) for _ in range(args.generations)]
    seeds = row_seeds(args.seed, 0, 0, len(rows), args.generations)
    texts, truncated, elapsed = sample(policy, tokenizer, flat, seeds, args.batch_size, "no-tool answers")
    exact = [env.score(t, rows[i // args.generations]) == 1.0 for i, t in enumerate(texts)]
    mode = "greedy" if args.greedy else f"T={args.temperature}"
    print(f"\nno-tool baseline, {len(texts)} answers ({len(rows)} problems x {args.generations}, {mode}, "
          f"max_new_tokens {args.max_new_tokens}): {elapsed:.0f} s, {truncated} hit max_new_tokens")
    print(f"  {'no_tool_exact':<22} {sum(exact):4d} / {len(texts)} = {100 * sum(exact) / len(texts):.2f}%")
    for i in range(min(args.examples, len(texts))):
        print(f"--- {rows[i // args.generations]['expression']} = {rows[i // args.generations]['answer']}: "
              f"{texts[i]!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=64, help="rows per generate call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--examples", type=int, default=6, help="completions to print")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name or HF folder (e.g. the lit-llm export of the SFT warm-up)")
    p.add_argument("--answer-turn", action=argparse.BooleanOptionalAction, default=True,
                   help="run the tool and sample the final turn of samples with a valid call")
    p.add_argument("--answer-tokens", type=int, default=32, help="max_new_tokens of the final turn")
    p.add_argument("--no-tools", action="store_true",
                   help="the no-tool baseline: ask each problem without a tool and score the answer")
    p.add_argument("--greedy", action="store_true", help="greedy decoding, one completion per prompt")
    args = p.parse_args()
    if args.greedy:
        args.generations = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    print(f"model: {args.model}")
    model, tokenizer = load_model(args.model)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=True,
                                 generate_kwargs={"max_new_tokens": args.max_new_tokens, **decoding(args)})
    env = CalculatorEnv()
    rows = CalculatorEnv.make_rows(args.prompts, seed=args.seed, split="eval")
    if args.no_tools:
        no_tool_baseline(policy, tokenizer, env, rows, args)
        return
    prompt_ids, first = [], []
    for row in rows:
        messages, tools = first_turn_messages(env, row, tokenizer)
        first.append((messages, tools))
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        prompt_ids.append(torch.tensor(ids, dtype=torch.long))
    print(f"template takes tools=: {template_supports_tools(tokenizer)}; prompt length {len(prompt_ids[0])} tokens "
          f"(first problem: {rows[0]['expression']})")

    flat = [prompt_ids[k] for k in range(args.prompts) for _ in range(args.generations)]
    seeds = row_seeds(args.seed, 0, 0, args.prompts, args.generations)
    texts, truncated, elapsed = sample(policy, tokenizer, flat, seeds, args.batch_size, "first turn")

    stats = [classify(t, env, rows[i // args.generations]) for i, t in enumerate(texts)]
    n = len(stats)
    finals: dict[int, tuple[str, float]] = {}
    if args.answer_turn:
        todo, second = [], []
        for i, s in enumerate(stats):
            if not s["right_tool_valid_args"]:
                continue
            messages, tools = first[i // args.generations]
            episode = CalculatorEnv()
            episode.reset(rows[i // args.generations])
            turn = [*messages, {"role": "assistant", "content": texts[i]}]
            reply = episode.step(turn)
            ids = tokenizer.apply_chat_template([*turn, *reply.messages], tools=tools, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
            todo.append((i, episode, [*turn, *reply.messages]))
            second.append(torch.tensor(ids, dtype=torch.long))
        if second:
            answer_policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=True,
                                                generate_kwargs={"max_new_tokens": args.answer_tokens,
                                                                 **decoding(args)})
            seeds2 = row_seeds(args.seed, 1, 0, len(second), 1)
            answers, _, elapsed2 = sample(answer_policy, tokenizer, second, seeds2, args.batch_size, "final turn")
            elapsed += elapsed2
            for (i, episode, turn), answer in zip(todo, answers):
                result = episode.step([*turn, {"role": "assistant", "content": answer}])
                finals[i] = (answer, result.reward if result.done else -1.0)  # -1: called a tool again
    print(f"\n{n} samples ({args.prompts} prompts x {args.generations}), T={args.temperature}, max_new_tokens "
          f"{args.max_new_tokens}: {elapsed:.0f} s sampling, {truncated} first turns hit max_new_tokens; load "
          f"average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for key in ("markup", "parsable", "right_tool_valid_args", "right_result", "no_tool_exact"):
        k = sum(s[key] for s in stats)
        print(f"  {key:<22} {k:4d} / {n} = {100 * k / n:.2f}%")
    if args.answer_turn:
        exact = sum(r == 1.0 for _, r in finals.values())
        again = sum(r < 0 for _, r in finals.values())
        print(f"  {'episode_exact':<22} {exact:4d} / {n} = {100 * exact / n:.2f}%  (final turns run: {len(finals)}; "
              f"{again} called a tool again)")
    solved = sum(any(s["parsable"] for s in stats[j * args.generations:(j + 1) * args.generations])
                 for j in range(args.prompts))
    print(f"  prompts with >= 1 parsable call among their {args.generations}: {solved} / {args.prompts}")

    print("\nExamples (problem -> completion):")
    # failures first (call markup that is not a valid call, episodes that end wrong), then calls, then the rest
    failed = [i for i, s in enumerate(stats) if s["markup"] and not s["right_tool_valid_args"]]
    failed += [i for i, (_, r) in finals.items() if r != 1.0]
    calls = [i for i, s in enumerate(stats) if s["markup"] and i not in failed]
    shown = (failed + calls)[:args.examples // 2]
    shown += [i for i in range(n) if i not in shown][:args.examples - len(shown)]
    for i in shown:
        print(f"--- [{i}] {rows[i // args.generations]['expression']} = {rows[i // args.generations]['answer']} "
              f"{ {k: v for k, v in stats[i].items() if v} }\n{texts[i]!r}"
              + (f"\n  final turn: {finals[i][0]!r} (reward {finals[i][1]:g})" if i in finals else ""))


if __name__ == "__main__":
    main()
