"""``lit-llm plot LOG_DIR [--out PNG] [--version N]``: the command line of :func:`~lit_llm.plot.draw.
plot_training_curves` (:func:`main`; :func:`command` for the ``lit-llm`` console script)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lit_llm.plot.draw import plot_training_curves

__all__ = ["command", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``lit-llm plot LOG_DIR [--out PNG] [--version N]``.

    Prints the PNG path and returns 0; on a missing log or unplottable CSV prints ``lit-llm plot: error: ...`` to
    stderr and returns 1.
    """
    parser = argparse.ArgumentParser(
        prog="lit-llm plot",
        description="Write a PNG of the training curves of a run logged with Lightning's CSVLogger: one panel per "
        "concept (eval accuracy, reward ± std, per-function rewards, loss, KL, entropy, clip ratios, completion "
        "length, throughput, ...); the versions of a resumed run are joined.",
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the run folder (trainer.default_root_dir), its CSVLogger "
                        "folder (holding version_*) or one metrics.csv")
    parser.add_argument("--out", metavar="PNG", default=None, help="output path (default LOG_DIR/training_curves.png)")
    parser.add_argument("--version", type=int, default=None,
                        help="plot only version_N (default: the newest run, its resumed versions joined)")
    args = parser.parse_args(argv)
    try:
        result = plot_training_curves(args.log_dir, args.out, version=args.version)
    except (FileNotFoundError, ValueError) as e:
        print(f"lit-llm plot: error: {e}", file=sys.stderr)
        return 1
    print(result.path)
    return 0


def command(argv: Sequence[str]) -> None:
    """:func:`main` with the ``lit-llm`` subcommand signature: raises ``SystemExit(1)`` on error."""
    rc = main(argv)
    if rc:
        raise SystemExit(rc)


if __name__ == "__main__":
    sys.exit(main())
