"""How ``lit-llm`` prints a user error (:func:`print_user_error`): one ``lit-llm: error: ...`` message per run, also
when the DDP / sharded ranks it launched all raise it.

Every rank of a distributed run is a ``lit-llm`` process of its own (Lightning's launcher starts ranks > 0 as
children of rank 0; torchrun and SLURM start them all), and each one that raises a user error prints it on the
terminal they share. A refusal that every rank raises alike (:class:`~lit_llm.cli_errors.EveryRankError`, e.g. the
uneven micro-batches of sharded training, :func:`~lit_llm.lightning.policy_setup.check_sharded_step_plan`) is printed
by global rank 0 only; no collective is needed: the error itself says that rank 0 raises it too. Any other error is
printed by every rank that raises it (one raised on rank 1 alone is still seen).

A silent rank > 0 waits :data:`QUIET_RANK_GRACE_S` before it exits: Lightning's launcher watches the ranks it
started and ``SIGKILL``\\ s rank 0 as soon as one of them exits non-zero (its process observer, every 5 s), which could
otherwise kill rank 0 before it printed the message. The wait costs nothing on a terminal (the shell returns when rank
0 exits; torchrun stops the other workers when one fails) but holds a pipe reading every rank's output that long.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping

from lit_llm.cli_errors import CLIConfigError, EveryRankError, explain_config_error
from lit_llm.cli_front import PROG
from lit_llm.lightning.policy_setup import launch_is_global_rank_zero

__all__ = ["QUIET_RANK_GRACE_S", "print_user_error"]

#: Seconds a rank > 0 waits, silent, before it exits with an :class:`~lit_llm.cli_errors.EveryRankError` (rank 0
#: raises it at the same point of the run and prints it meanwhile).
QUIET_RANK_GRACE_S = 3.0


def _every_rank(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it was raised from (``__cause__``) is an :class:`EveryRankError`."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, EveryRankError):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def print_user_error(exc: BaseException, environ: Mapping[str, str] | None = None,
                     sleep: Callable[[float], object] = time.sleep) -> bool:
    """Write ``lit-llm: error: <message>`` for a user error on stderr (the message: a
    :class:`~lit_llm.cli_errors.CLIConfigError`'s text, else :func:`~lit_llm.cli_errors.explain_config_error`'s),
    unless it is an :class:`~lit_llm.cli_errors.EveryRankError` (or raised from one) on a rank > 0: that rank
    writes nothing and waits :data:`QUIET_RANK_GRACE_S` (rank 0 writes it).

    Args:
        exc: the error (``lit_llm.lightning.cli.USER_ERRORS``).
        environ: the launch environment that gives the rank
            (:func:`~lit_llm.lightning.policy_setup.launch_is_global_rank_zero`; default ``os.environ``; a
            variable that is not an integer counts as rank 0: the message is written).
        sleep: waits that many seconds (tests pass a recorder).

    Returns:
        Whether the message was written.
    """
    if _every_rank(exc):
        try:
            quiet = not launch_is_global_rank_zero(environ)
        except ValueError:
            quiet = False
        if quiet:
            try:
                sleep(QUIET_RANK_GRACE_S)
            except KeyboardInterrupt:  # Ctrl-C reaches every rank: end quietly
                pass
            return False
    message = str(exc) if isinstance(exc, CLIConfigError) else explain_config_error(exc)
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return True
