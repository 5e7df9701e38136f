"""The ``lit-llm`` subcommand table and the front that answers without Lightning: the top-level help
(:func:`top_parser`), a mistyped subcommand and the extra subcommands (:data:`EXTRA_COMMANDS`: ``export``, ``plot``,
``chat``, ``evaluate``, ``predict``, which replaces LightningCLI's; their ``--help`` too) and LightningCLI's ``test``,
which lit_llm does not offer (:data:`NOT_OFFERED`: one error line naming ``validate`` / ``evaluate`` /
``predict``), dispatched by :func:`front` with argparse / jsonargparse before torch or Lightning is imported.

Extra subcommands are entries of :data:`EXTRA_COMMANDS`: a one-line summary and ``"module:function"``, a function
of the remaining arguments that parses them (answering ``--help``) before importing torch; its module must import
neither torch nor Lightning at import time. Adding a command is one entry. The targets are named as text and imported
only when their command runs (as a console script's entry point), so this module imports no layer below it: it sits
in layer 0, read by both the console script (:mod:`lit_llm.cli_entry`, through :mod:`lit_llm.cli_commands`, which
re-exports it and holds ``export``) and LightningCLI's entry point (:mod:`lit_llm.lightning.cli`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jsonargparse import ArgumentParser

from lit_llm.cli_errors import DEBUG_ENV, OneLineErrors, debug_enabled, near

__all__ = ["EXTRA_COMMANDS", "LIGHTNING_COMMANDS", "NOT_OFFERED", "PROG", "Command", "ToolParser", "answer_front",
           "front", "offered_commands", "top_parser"]

PROG = "lit-llm"

#: LightningCLI's subcommands and their one-line help (the first line of the Trainer method's docstring).
LIGHTNING_COMMANDS: dict[str, str] = {
    "fit": "Runs the full optimization routine.",
    "validate": "Perform one evaluation epoch over the validation set.",
    "test": "Perform one evaluation epoch over the test set.",
    "predict": "Run inference on your data.",
}

#: LightningCLI subcommands lit_llm does not offer (its modules define no ``test_step``: ``validate`` on a test file
#: is that evaluation): left out of the help and answered with one error line naming the commands that do the job.
#: (LightningCLI's ``predict`` is replaced by the extra command of the same name, :data:`EXTRA_COMMANDS`.)
NOT_OFFERED: dict[str, str] = {
    "test": "evaluate a checkpoint with `lit-llm validate --config CONFIG --ckpt_path CKPT "
            "--data.init_args.eval_path TEST_FILE` (GRPO: greedy answers scored by eval_reward_funcs; SFT: the "
            "validation loss), `lit-llm evaluate --model CKPT --data gsm8k/test.jsonl` (GSM8K accuracy) or "
            "`lit-llm predict --model CKPT --data TEST_FILE --out rows.jsonl --reward_funcs [...]` (completions and "
            "rewards per prompt).",
}


@dataclass(frozen=True)
class Command:
    """An extra subcommand: ``summary`` (one line of the top-level help) and ``target`` (``"module:function"``,
    called with the arguments after the subcommand's name; it parses them before importing torch)."""

    summary: str
    target: str

    def load(self) -> Callable[[Sequence[str]], None]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


class ToolParser(OneLineErrors, ArgumentParser):
    """A jsonargparse parser for an extra subcommand: no abbreviations, one-message errors (``lit-llm CMD: error:``)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.error_prefix = self.prog


#: Subcommands handled outside LightningCLI (name -> :class:`Command`); the top-level help lists them in this order.
EXTRA_COMMANDS: dict[str, Command] = {
    "export": Command("Write a checkpoint's policy as a Hugging Face folder.", "lit_llm.cli_commands:export_command"),
    "plot": Command("Draw a run's training curves (CSV log) as a PNG.", "lit_llm.plot:command"),
    "chat": Command("Chat with a model or checkpoint, multi-turn.", "lit_llm.chat:command"),
    "evaluate": Command("Greedy GSM8K accuracy of a model or checkpoint.", "lit_llm.evaluation:command"),
    "predict": Command("Greedy completions and rewards for a prompt file.",
                       "lit_llm.evaluation:predict_command"),
}


def offered_commands() -> list[str]:
    """The subcommand names ``lit-llm --help`` lists: LightningCLI's but :data:`NOT_OFFERED` and those an extra
    command replaces (``predict``), then the :data:`EXTRA_COMMANDS`."""
    return [*(c for c in LIGHTNING_COMMANDS if c not in NOT_OFFERED and c not in EXTRA_COMMANDS), *EXTRA_COMMANDS]


def top_parser() -> argparse.ArgumentParser:
    """The top-level parser for ``lit-llm --help`` and the usage line: every subcommand with its summary."""
    summaries = {**LIGHTNING_COMMANDS, **{k: c.summary for k, c in EXTRA_COMMANDS.items()}}
    commands = {name: summaries[name] for name in offered_commands()}
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="LLM post-training (SFT, GRPO) on Lightning: LightningCLI subcommands over YAML configs, plus "
                    "tools for their runs.",
        epilog=f"`{PROG} COMMAND --help` lists a command's options; `{PROG} fit --model.help GRPOModule` (or "
               f"SFTModule) a module's.\nExamples:\n"
               f"  {PROG} fit --config configs/grpo_tiny.yaml --trainer.max_steps 4\n"
               f"  {PROG} export --ckpt_path runs/sft_tiny/checkpoints/last.ckpt --out exported/\n"
               f"  {PROG} plot runs/sft_tiny\n"
               f"  {PROG} chat --model runs/sft_tiny/checkpoints/last.ckpt\n"
               f"  {PROG} evaluate --model exported/ --data gsm8k/test.jsonl --limit 100\n"
               f"  {PROG} predict --model exported/ --data prompts.jsonl --out completions.jsonl\n"
               f"A bad option is one `{PROG}: error:` line; {DEBUG_ENV}=1 shows the parser's full message and "
               "tracebacks.")
    sub = parser.add_subparsers(title="commands", metavar="{" + ",".join(commands) + "}")
    for name, summary in commands.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def front(argv: Sequence[str]) -> bool:
    """Handle what needs no Lightning: no arguments or ``-h``/``--help`` first (top-level help), an unknown
    subcommand (exit 2 with a near match), ``test`` (:data:`NOT_OFFERED`: exit 2 with one error line)
    and the :data:`EXTRA_COMMANDS`. Returns whether ``argv`` was handled;
    ``False`` leaves it to LightningCLI."""
    argv = list(argv)
    if not argv:
        parser = top_parser()
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{PROG}: error: give a command: {', '.join(offered_commands())}\n")
    if argv[0] in ("-h", "--help"):
        top_parser().print_help()
        raise SystemExit(0)
    if argv[0] in EXTRA_COMMANDS:
        EXTRA_COMMANDS[argv[0]].load()(argv[1:])
        return True
    if argv[0] in NOT_OFFERED:
        sys.stderr.write(f"{PROG}: error: `{PROG} {argv[0]}` is not offered (lit_llm's modules have no "
                         f"{argv[0]}_step); {NOT_OFFERED[argv[0]]}\n")
        raise SystemExit(2)
    if not argv[0].startswith("-") and argv[0] not in LIGHTNING_COMMANDS:
        names = offered_commands()
        close = near(argv[0], names, n=1)
        top_parser().print_usage(sys.stderr)
        raise SystemExit(f"{PROG}: error: unknown command '{argv[0]}'; use one of: {', '.join(names)}"
                         + (f" (did you mean {close[0]}?)" if close else ""))
    return False


def answer_front(argv: Sequence[str]) -> bool:
    """:func:`front`, with an extra subcommand's ``OSError`` / ``ValueError`` (a missing checkpoint, an existing
    ``--out``) printed as one ``lit-llm CMD: error:`` line plus the :data:`DEBUG_ENV` hint and exit status 2
    (:data:`DEBUG_ENV` re-raises). Returns whether ``argv`` was handled."""
    try:
        return front(argv)
    except (OSError, ValueError) as e:
        if debug_enabled():
            raise
        prefix = f"{PROG} {argv[0]}: "
        text = str(e).removeprefix(prefix)
        sys.stderr.write(f"{prefix}error: {text}\n  ({DEBUG_ENV}=1 shows the traceback)\n")
        raise SystemExit(2) from None
