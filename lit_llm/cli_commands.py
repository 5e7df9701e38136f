"""``lit-llm export`` (:func:`export_command`: a checkpoint's policy as an HF folder), the one subcommand the command
line layer owns; the names of :mod:`lit_llm.cli_front` (the subcommand table, the front that answers without
Lightning, :class:`ToolParser`) are re-exported here, where the console script (:mod:`lit_llm.cli_entry`), ``lit-llm
chat`` and ``lit-llm evaluate`` import them. Imports neither torch nor Lightning at import time (``lit-llm export
--help`` answers without them); the export itself imports :mod:`lit_llm.lightning.export`.
"""

from __future__ import annotations

from collections.abc import Sequence

from lit_llm.cli_front import (
    EXTRA_COMMANDS,
    LIGHTNING_COMMANDS,
    PROG,
    Command,
    ToolParser,
    answer_front,
    front,
    top_parser,
)

__all__ = ["EXTRA_COMMANDS", "LIGHTNING_COMMANDS", "PROG", "Command", "ToolParser", "answer_front", "export_command",
           "front", "top_parser"]


def export_command(argv: Sequence[str]) -> None:
    """``lit-llm export --ckpt_path X.ckpt --out DIR [--overwrite true]``: a checkpoint's policy as an HF folder.

    Raises:
        FileNotFoundError / FileExistsError / ValueError: from :func:`lit_llm.lightning.export.export_checkpoint`.
    """
    parser = ToolParser(prog=f"{PROG} export", description="Write a checkpoint's policy as an HF folder (loadable "
                        "with AutoModelForCausalLM.from_pretrained and AutoTokenizer).")
    parser.add_argument("--ckpt_path", type=str, required=True, help="a .ckpt written by lit-llm fit")
    parser.add_argument("--out", type=str, required=True, help="the folder to create")
    parser.add_argument("--overwrite", type=bool, default=False, help="replace --out if it exists")
    cfg = parser.parse_args(list(argv))
    from lit_llm.lightning.export import export_checkpoint

    out = export_checkpoint(cfg.ckpt_path, cfg.out, overwrite=cfg.overwrite)
    print(f"exported {cfg.ckpt_path} -> {out}")
