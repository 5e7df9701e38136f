"""``lit-llm``'s user-error message once per run (issue 28, a fresh user's trial of sharded runs): a refusal every
rank raises alike (:class:`EveryRankError`) is printed by global rank 0 only, as the launch environment gives the
rank (Lightning's launcher: ``LOCAL_RANK`` / ``NODE_RANK``; torchrun: ``RANK``); a rank > 0 waits
``QUIET_RANK_GRACE_S`` silently; every rank still exits 2; any other error is printed by every rank that raises
it. The 2-rank run through the console script is ``test_sharded_cli.py``'s slow test (the line counted once)."""

from __future__ import annotations

import pytest

from lit_llm.cli_errors import CLIConfigError, EveryRankError
from lit_llm.lightning import cli, console_errors
from lit_llm.lightning.console_errors import QUIET_RANK_GRACE_S, print_user_error

REFUSAL = "Sharded training: one step of every epoch would give the ranks different numbers of micro-batches."
SHOWN = f"lit-llm: error: {REFUSAL}\n  (EveryRankError; LIT_LLM_DEBUG=1 shows the traceback)\n"


@pytest.mark.parametrize(("environ", "written"), [
    ({}, True),  # one process
    ({"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "2"}, True),  # Lightning's launcher, rank 0
    ({"LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}, False),  # the rank it started
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),  # the first process of the second node
    ({"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1"}, False),  # torchrun
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NAME": "train"}, False),
    ({"LOCAL_RANK": "one"}, True),  # not a rank: written rather than lost
])
def test_a_refusal_every_rank_raises_is_written_by_rank_zero_only(capsys, environ, written):
    waits: list[float] = []
    assert print_user_error(EveryRankError(REFUSAL), environ, sleep=waits.append) is written
    assert capsys.readouterr().err == (SHOWN if written else "")
    assert waits == ([] if written else [QUIET_RANK_GRACE_S]) and QUIET_RANK_GRACE_S == 3.0


def test_any_other_error_is_written_by_the_rank_that_raises_it(capsys):
    """A plain ``ValueError`` on rank 1 (raised there alone, say): written at once; an error raised from an
    ``EveryRankError`` (a ``CLIConfigError`` wrapping it) is still one every rank raises."""
    waits: list[float] = []
    rank1 = {"LOCAL_RANK": "1", "NODE_RANK": "0"}
    assert print_user_error(ValueError("data.batch_size must be >= 1, got 0."), rank1, sleep=waits.append)
    assert capsys.readouterr().err == ("lit-llm: error: data.batch_size must be >= 1, got 0.\n  (ValueError; "
                                       "LIT_LLM_DEBUG=1 shows the traceback)\n")
    assert print_user_error(CLIConfigError("--data.batch_size 0: must be >= 1."), rank1, sleep=waits.append)
    assert capsys.readouterr().err == "lit-llm: error: --data.batch_size 0: must be >= 1.\n" and waits == []
    try:
        raise CLIConfigError("wrapped") from EveryRankError(REFUSAL)
    except CLIConfigError as e:
        assert not print_user_error(e, rank1, sleep=waits.append)
    assert capsys.readouterr().err == "" and waits == [QUIET_RANK_GRACE_S]


def test_a_quiet_rank_ends_quietly_on_ctrl_c(capsys):
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    assert not print_user_error(EveryRankError(REFUSAL), {"LOCAL_RANK": "1"}, sleep=interrupted)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("local_rank", "shown"), [("0", SHOWN), ("1", "")])
def test_every_rank_exits_2(monkeypatch, capsys, local_rank, shown):
    """``run_console`` (the console script) on each rank: exit status 2 on both, the message on rank 0 only."""
    def refuse(args=None):
        raise EveryRankError(REFUSAL)

    monkeypatch.setattr(cli, "main", refuse)
    monkeypatch.setattr(console_errors, "QUIET_RANK_GRACE_S", 0.0)
    monkeypatch.delenv("LIT_LLM_DEBUG", raising=False)
    for name in ("RANK", "GROUP_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("NODE_RANK", "0")
    with pytest.raises(SystemExit) as e:
        cli.run_console()
    assert e.value.code == 2 and capsys.readouterr().err == shown
