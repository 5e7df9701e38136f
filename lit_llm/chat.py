"""``lit-llm chat``: talk to a model or a training checkpoint in the terminal, one streamed reply per line you type.

Each user line is added to the conversation (multi-turn: the whole history is re-rendered every turn), rendered with
the model's chat template and its generation prompt (:meth:`lit_llm.data.History.apply_chat_template`, the renderer
of training, DESIGN.md property 1) and answered by ``model.generate``; the reply's text is written as it is decoded
(transformers' :class:`~transformers.TextStreamer`) and kept, decoded without special tokens, as the assistant turn.
``/reset`` starts a new conversation (the system message stays), ``/exit`` or end of input (Ctrl-D) stops.

Usage::

    lit-llm chat --model runs/grpo_arithmetic/checkpoints/last.ckpt
    lit-llm chat --model exported/ --temperature 0.7 --system "Answer briefly."
    printf 'What is 2 + 3?\\nAnd times 4?\\n' | lit-llm chat   # the embedded smollm2-135m-instruct

This module imports neither torch nor Lightning until a model is loaded (``lit-llm chat --help`` stays fast).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["chat", "command", "reply"]

PROG = "lit-llm chat"
#: ``--model``'s default: the embedded model, as everywhere else (``lit_llm.models.DEFAULT_MODEL``; named here so
#: that ``lit-llm chat --help`` does not import torch).
DEFAULT_MODEL = "smollm2-135m-instruct"


def reply(model: Any, tokenizer: Any, messages: list[dict[str, str]], *, max_new_tokens: int = 256,
          temperature: float = 0.0, chat_template_kwargs: dict[str, Any] | None = None,
          output: TextIO | None = None) -> str:
    """Generate the assistant's answer to a conversation, streaming its text to ``output``.

    Args:
        model: an HF causal LM (its ``generation_config`` gives the stop tokens).
        tokenizer: its tokenizer; its chat template renders ``messages`` with the generation prompt.
        messages: ``[{"role", "content"}, ...]`` ending with the user's turn.
        max_new_tokens: reply budget in tokens.
        temperature: 0 = greedy; > 0 samples at this temperature.
        chat_template_kwargs: template variables (e.g. ``{"enable_thinking": False}``).
        output: where the reply's text is written as it is decoded (``None``: not streamed).

    Returns:
        The reply, decoded without special tokens and stripped.

    Raises:
        ValueError: ``max_new_tokens`` < 1 or ``temperature`` < 0.
        SpecialTokenInContentError: a message spells a special token (e.g. ``<|im_end|>``).
    """
    import torch

    from lit_llm.data import History

    if max_new_tokens < 1 or temperature < 0:
        raise ValueError(f"{PROG}: --max_new_tokens must be >= 1 and --temperature >= 0, got {max_new_tokens}, "
                         f"{temperature}.")
    ids = History.from_chats(messages).apply_chat_template(tokenizer, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False, **(chat_template_kwargs or {}))
    device = next(model.parameters()).device
    input_ids = ids.to(device=device, dtype=torch.long).unsqueeze(0)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        kwargs["temperature"] = temperature
    else:  # greedy: drop sampling defaults of the model's generation_config (top_p, top_k) that would warn
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if output is not None:
        kwargs["streamer"] = _streamer(tokenizer, output)
    if tokenizer.pad_token_id is not None:
        kwargs["pad_token_id"] = tokenizer.pad_token_id
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
    return tokenizer.decode(out[0, input_ids.shape[1]:].tolist(), skip_special_tokens=True).strip()


def chat(model: Any, tokenizer: Any, *, input: TextIO, output: TextIO, system: str | None = None,
         max_new_tokens: int = 256, temperature: float = 0.0, chat_template_kwargs: dict[str, Any] | None = None,
         prompt: str = "") -> list[dict[str, str]]:
    """The chat loop: read user lines from ``input`` until end of input or ``/exit``, answer each with
    :func:`reply` (streamed to ``output``, one line per reply), keep the conversation.

    Args:
        model, tokenizer, max_new_tokens, temperature, chat_template_kwargs: see :func:`reply`.
        input: the user's lines (blank lines are skipped; ``/reset`` clears the history, ``/exit`` stops).
        output: replies (and ``prompt`` before each read).
        system: an optional system message at the start of every conversation.
        prompt: written before each read (``"> "`` in a terminal, nothing when input is piped).

    Returns:
        The last conversation's messages (system, then alternating user / assistant).
    """
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        if prompt:
            output.write(prompt)
            output.flush()
        line = input.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            messages = list(start)
            output.write("(new conversation)\n")
            continue
        messages.append({"role": "user", "content": text})
        try:
            answer = reply(model, tokenizer, messages, max_new_tokens=max_new_tokens, temperature=temperature,
                           chat_template_kwargs=chat_template_kwargs, output=output)
        except ValueError as e:  # a special token typed in the message (SpecialTokenInContentError), a bad template
            messages.pop()
            output.write(f"(not sent: {e})\n")
            continue
        output.write("\n")
        output.flush()
        messages.append({"role": "assistant", "content": answer})
    return messages


def _streamer(tokenizer: Any, output: TextIO) -> Any:
    """transformers' ``TextStreamer`` (prompt skipped, special tokens dropped) writing to ``output``, flushed."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            output.write(text)
            output.flush()

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def command(argv: Sequence[str]) -> None:
    """``lit-llm chat [--model PATH_OR_CKPT] [--max_new_tokens N] [--temperature T] [--system TEXT]``; without
    ``--model`` it chats with the embedded default (:data:`DEFAULT_MODEL`).

    Raises:
        FileNotFoundError / ValueError: from :func:`lit_llm.lightning.export.load_inference_policy` (a missing
            checkpoint or model, a checkpoint not written by lit-llm fit); the console script prints them as one
            ``lit-llm chat: error:`` line.
    """
    from lit_llm.cli_commands import ToolParser

    parser = ToolParser(prog=PROG, description="Chat with a model or a lit-llm checkpoint: type a message, get a "
                        "streamed reply; the conversation is kept (multi-turn) and rendered with the model's chat "
                        "template. /reset starts over, /exit or Ctrl-D stops. Reads piped stdin too.")
    parser.add_argument("--model", type=str, default=DEFAULT_MODEL,
                        help="a .ckpt written by lit-llm fit, a folder written by lit-llm export, a model name "
                             "or a Hub id in the HF cache (default: the embedded smollm2-135m-instruct)")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="reply budget in tokens")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples at it")
    parser.add_argument("--system", type=str | None, default=None, help="system message of the conversation")
    parser.add_argument("--device", type=str, default="auto", help="auto (cuda when available, else cpu), cpu, "
                        "cuda, cuda:1, ...")
    cfg = parser.parse_args(list(argv))
    if cfg.max_new_tokens < 1 or cfg.temperature < 0:
        raise ValueError(f"{PROG}: --max_new_tokens must be >= 1 and --temperature >= 0, got {cfg.max_new_tokens}, "
                         f"{cfg.temperature}.")
    from lit_llm.lightning.export import load_inference_policy

    policy = load_inference_policy(cfg.model, device=cfg.device, who=PROG)
    device = next(policy.model.parameters()).device
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {cfg.model} on {device}; /reset starts over, /exit or Ctrl-D stops", flush=True)
    chat(policy.model, policy.tokenizer, input=sys.stdin, output=sys.stdout, system=cfg.system,
         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
         chat_template_kwargs=policy.chat_template_kwargs, prompt="> " if interactive else "")
