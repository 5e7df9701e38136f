"""`make demo`: load the embedded SmolLM2-135M-Instruct and answer one chat prompt.

Usage: ``python -m lit_llm.demo [--prompt TEXT] [--max-new-tokens N]``
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="What is 47 + 38? Reply with just the number.")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)

    from lit_llm.models import load_model

    t0 = time.perf_counter()
    model, tokenizer = load_model()
    print(f"loaded the embedded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"user: {args.prompt}\nassistant: {reply}\n({time.perf_counter() - t0:.1f} s, greedy)")


if __name__ == "__main__":
    main()
