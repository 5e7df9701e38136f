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

Run: ``HF_HUB_OFFLINE=1 python benchmarks/tool_call_rate.py [--prompts 64 --generations 8 --max-new-tokens 64]
[--threads 1]``.
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
    template_supports_tools,
    tools_system_prompt,
)
from lit_llm.rollouts.envs.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


def first_turn_messages(env: CalculatorEnv, row: dict, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """The first render's messages and ``tools=`` argument: the tools go to the template when it takes them, else
    into a system message (merged before an existing system message's text)."""
    messages = env.reset(row)
    if template_supports_tools(tokenizer):
        return messages, [t.schema for t in env.tools]
    prompt = tools_system_prompt(env.tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": prompt + "\n\n" + messages[0]["content"]}, *messages[1:]], None
    return [{"role": "system", "content": prompt}, *messages], None


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
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_line())
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    model, tokenizer = load_model("smollm2-135m-instruct")
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate=True,
                                 generate_kwargs={"max_new_tokens": args.max_new_tokens, "do_sample": True,
                                                  "temperature": args.temperature})
    env = CalculatorEnv()
    rows = CalculatorEnv.make_rows(args.prompts, seed=args.seed, split="eval")
    prompt_ids = []
    for row in rows:
        messages, tools = first_turn_messages(env, row, tokenizer)
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        prompt_ids.append(torch.tensor(ids, dtype=torch.long))
    print(f"template takes tools=: {template_supports_tools(tokenizer)}; prompt length {len(prompt_ids[0])} tokens "
          f"(first problem: {rows[0]['expression']})")

    flat = [prompt_ids[k] for k in range(args.prompts) for _ in range(args.generations)]
    seeds = row_seeds(args.seed, 0, 0, args.prompts, args.generations)
    texts: list[str] = []
    truncated = 0
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(flat), args.batch_size):
            resp, _, trunc = policy_responses(policy, flat[i:i + args.batch_size], seeds=seeds[i:i + args.batch_size])
            texts += tokenizer.batch_decode([r.tolist() for r in resp], skip_special_tokens=True)
            truncated += sum(trunc)
            print(f"  {len(texts)}/{len(flat)} sampled, {time.perf_counter() - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start

    stats = [classify(t, env, rows[i // args.generations]) for i, t in enumerate(texts)]
    n = len(stats)
    print(f"\n{n} samples ({args.prompts} prompts x {args.generations}), T={args.temperature}, max_new_tokens "
          f"{args.max_new_tokens}: {elapsed:.0f} s sampling, {truncated} hit max_new_tokens; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for key in ("markup", "parsable", "right_tool_valid_args", "right_result", "no_tool_exact"):
        k = sum(s[key] for s in stats)
        print(f"  {key:<22} {k:4d} / {n} = {100 * k / n:.2f}%")
    solved = sum(any(s["parsable"] for s in stats[j * args.generations:(j + 1) * args.generations])
                 for j in range(args.prompts))
    print(f"  prompts with >= 1 parsable call among their {args.generations}: {solved} / {args.prompts}")

    print("\nExamples (problem -> completion):")
    shown = [i for i, s in enumerate(stats) if s["markup"]][:args.examples // 2]
    shown += [i for i in range(n) if i not in shown][:args.examples - len(shown)]
    for i in shown:
        print(f"--- [{i}] {rows[i // args.generations]['expression']} = {rows[i // args.generations]['answer']} "
              f"{ {k: v for k, v in stats[i].items() if v} }\n{texts[i]!r}")


if __name__ == "__main__":
    main()
