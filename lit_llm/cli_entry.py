"""The ``lit-llm`` console script: answers what needs no Lightning before importing it.

``lit-llm``, ``lit-llm --help``, a mistyped subcommand and the extra subcommands (``export``, ``plot``, ``chat``,
``evaluate``; their ``--help`` too) are handled by :mod:`lit_llm.cli_front` (through :mod:`lit_llm.cli_commands`)
with argparse / jsonargparse and import neither torch nor Lightning, so they answer in well under a second. Everything
else (``fit``, ``validate``, ``test``, ``predict``) goes to :func:`lit_llm.lightning.cli.run_console` (LightningCLI),
which prints a one-message error (:mod:`lit_llm.cli_errors`) for a bad option and exits 2. The names of
:mod:`lit_llm.cli_commands` are re-exported here.
"""

from __future__ import annotations

import sys

from lit_llm.cli_commands import (
    EXTRA_COMMANDS,
    LIGHTNING_COMMANDS,
    Command,
    ToolParser,
    answer_front,
    export_command,
    front,
    top_parser,
)
from lit_llm.cli_commands import PROG as PROG

__all__ = ["EXTRA_COMMANDS", "LIGHTNING_COMMANDS", "Command", "ToolParser", "console_main", "export_command", "front",
           "top_parser"]


def console_main() -> None:
    """The ``lit-llm`` console script. A user-input error raised while a LightningCLI run is built or runs
    (:data:`lit_llm.lightning.cli.USER_ERRORS`: ``ValueError`` and its subclasses such as
    :class:`~lit_llm.cli_errors.CLIConfigError`, ``FileNotFoundError``, Lightning's ``MisconfigurationException``)
    is printed as ``lit-llm: error: ...`` plus the :data:`~lit_llm.cli_errors.DEBUG_ENV` hint (no traceback) with
    exit status 2; any other exception (a bug) keeps its traceback; an extra subcommand's ``OSError`` /
    ``ValueError`` (a missing checkpoint, an existing ``--out``) is one ``lit-llm CMD: error:`` line and exit status 2
    (:data:`~lit_llm.cli_errors.DEBUG_ENV` re-raises)."""
    if answer_front(sys.argv[1:]):
        return
    from lit_llm.lightning.cli import run_console  # torch and Lightning: only for LightningCLI's subcommands

    run_console()


if __name__ == "__main__":
    console_main()
