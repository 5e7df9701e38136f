"""SIGTERM / SIGINT stop ``lit-llm fit`` cleanly (issue 30 item 3), from the user's side: the CLI in a subprocess is
signalled once a training step is logged; it ends after the step with ``last.ckpt`` and exit status 143 (SIGTERM) /
130 (SIGINT), and ``--ckpt_path last`` reaches the same final weights as an uninterrupted run, also when the SIGTERM
comes twice in a row (a process group signalled as a whole: the copy within ``DEBOUNCE_S`` is the same request). A
second signal after that window exits at once, even while a reward function hangs. Under DDP (2 gloo ranks) both
ranks stop together. In process (fast): a ``Trainer.fit`` signalled at a step (once, or twice back to back) stops
after it with ``last.ckpt`` and gives the handlers back; the handler with a fake clock: the same signal within the
window is ignored, after it (or the other signal within it) exits at once; a SIGTERM that Lightning's own handler
took before training started still stops after the first step with ``last.ckpt``."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_llm.lightning.graceful_stop import DEBOUNCE_S, GracefulStop, stop_exit_code

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def sleepy_reward(completions, **kwargs):
    """A reward function that takes 60 s (imported by the CLI subprocess as ``test_graceful_stop:sleepy_reward``)."""
    time.sleep(60)
    return [0.0] * len(completions)


class HoldAfterStop(Callback):
    """Keeps a fit that a signal stopped alive 1.5 s longer, with GracefulStop's handlers still installed (its
    ``on_train_end`` runs after this one's: ``--trainer.callbacks`` come before the modules' own), so that a copy
    of the signal sent by the test after the first one's line reaches the handler, not the default action (a tiny
    model's step ends within the test's polling interval). Used by the CLI subprocess as
    ``test_graceful_stop.HoldAfterStop``."""

    def on_train_end(self, trainer, pl_module):
        if stop_exit_code(trainer) is not None:
            time.sleep(1.5)


def _command(tmp: Path, config: str, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "lit_llm.lightning.cli", "fit", "--config", str(ROOT / "configs" / config),
           "--trainer.default_root_dir", str(tmp), "--trainer.enable_progress_bar", "false", *args]
    return cmd, env


def _run(tmp: Path, config: str, *args: str) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd, env = _command(tmp, config, *args)
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _train_rows(tmp: Path, key: str, version: int = 0) -> list[dict[str, str]]:
    path = tmp / "csv" / f"version_{version}" / "metrics.csv"
    if not path.exists():
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r.get(key)]


def _start(tmp: Path, config: str, *args: str) -> tuple[subprocess.Popen, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd, env = _command(tmp, config, *args)
    log = tmp / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"condition not met (exit {proc.returncode})\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the run did not stop within {timeout} s\n{log.read_text()[-4000:]}") from None


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def _stop_resume_and_compare(tmp: Path, config: str, key: str, signum: int, *args: str, twice: bool = False) -> None:
    """An uninterrupted run; a run signalled after its first logged step (exit 128 + signum, last.ckpt of the step
    it stopped at), resumed with ``--ckpt_path last``; both end with the same weights. ``twice``: the signal is sent
    again as soon as the first one's line is out (well within ``DEBOUNCE_S``): the same stop."""
    if twice:
        args = (*args, "--trainer.callbacks+=test_graceful_stop.HoldAfterStop")
    _run(tmp / "full", config, *args)
    proc, log = _start(tmp / "part", config, *args)
    _wait_for(lambda: len(_train_rows(tmp / "part", key)) >= 1, proc, log)
    proc.send_signal(signum)
    name = signal.Signals(signum).name
    if twice:
        t0 = time.monotonic()
        _wait_for(lambda: f"lit-llm: {name} received" in log.read_text(), proc, log, timeout=30)
        proc.send_signal(signum)
        assert time.monotonic() - t0 < DEBOUNCE_S  # the test machine was quick enough for the copy to be one
    code = _finish(proc, log)
    out = log.read_text()
    assert code == 128 + signum, out[-4000:]
    assert (f"lit-llm: {name} received: stopping after the current optimizer step and writing last.ckpt (exit "
            f"status {128 + signum}); send it again after 2 s to exit at once.") in out
    again = (f"lit-llm: {name} again within 2 s of the first: the same stop request (still stopping after the "
             f"current optimizer step).")
    assert out.count(again) == int(twice) and "second SIGTERM" not in out, out[-4000:]
    last = tmp / "part" / "checkpoints" / "last.ckpt"
    stopped_at = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    full_steps = torch.load(tmp / "full" / "checkpoints" / "last.ckpt", map_location="cpu",
                            weights_only=False)["global_step"]
    assert 1 <= stopped_at < full_steps, (stopped_at, full_steps)
    assert f"lit-llm: {name}: training stopped after step {stopped_at}; {last} written" in out
    assert len(_train_rows(tmp / "part", key)) == stopped_at  # one logged row per step, none after the stop
    _run(tmp / "part", config, *args, "--ckpt_path", "last")
    full, resumed = _weights(tmp / "full" / "checkpoints" / "last.ckpt"), _weights(last)
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == full_steps
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full), [k for k in full if not torch.equal(full[k],
                                                                                                  resumed[k])]


@pytest.mark.slow
def test_sft_sigterm_twice_in_a_row_stops_after_the_step_with_last_ckpt_and_resumes_exactly(tmp_path):
    _stop_resume_and_compare(tmp_path, "sft_tiny.yaml", "train/loss", signal.SIGTERM, "--trainer.max_steps", "12",
                             twice=True)


@pytest.mark.slow
def test_grpo_sigint_stops_after_the_step_with_last_ckpt_and_resumes_exactly(tmp_path):
    _stop_resume_and_compare(tmp_path, "grpo_tiny.yaml", "train/reward", signal.SIGINT, "--trainer.max_steps", "8",
                             "--trainer.num_sanity_val_steps", "0")


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_while_a_reward_function_hangs(tmp_path):
    proc, log = _start(tmp_path, "grpo_tiny.yaml", "--model.init_args.reward_funcs",
                       '["test_graceful_stop:sleepy_reward"]', "--model.init_args.reward_weights", "null",
                       "--model.init_args.reward_timeout", "null", "--trainer.num_sanity_val_steps", "0")
    _wait_for(lambda: "Total params" in log.read_text(), proc, log)
    time.sleep(5)  # training started: inside the first rollout (its reward call takes 60 s)
    proc.send_signal(signal.SIGTERM)
    _wait_for(lambda: "lit-llm: SIGTERM received" in log.read_text(), proc, log, timeout=30)
    time.sleep(DEBOUNCE_S + 0.5)  # after the window: a second request, not the first one delivered twice
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = _finish(proc, log, timeout=30)
    assert time.monotonic() - t0 < 10
    assert code == -signal.SIGTERM  # killed by the signal itself, not a graceful 143
    assert ("lit-llm: second SIGTERM: exiting at once (a checkpoint being written is dropped; the last complete one "
            "stays).") in log.read_text()
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # no step ended: nothing written, nothing partial


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.slow
def test_ddp_sigterm_to_one_rank_stops_both_ranks_together(tmp_path):
    """2 gloo ranks (Lightning's launcher starts rank 1 as its child): SIGTERM to rank 1 only; at the next step both
    ranks agree to stop, ``last.ckpt`` is written and the launcher (rank 0, never signalled) exits 143."""
    proc, log = _start(tmp_path, "sft_tiny.yaml", "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                       "--trainer.strategy", "ddp", "--trainer.max_steps", "40")
    _wait_for(lambda: len(_train_rows(tmp_path, "train/loss")) >= 1, proc, log)
    (rank1,) = [p for p in _children(proc.pid) if "lit_llm" in Path(f"/proc/{p}/cmdline").read_text()]
    os.kill(rank1, signal.SIGTERM)
    code = _finish(proc, log)
    out = log.read_text()
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "[rank 1] lit-llm: SIGTERM received: stopping after the current optimizer step" in out
    stopped_at = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu",
                            weights_only=False)["global_step"]
    assert 1 <= stopped_at < 40 and len(_train_rows(tmp_path, "train/loss")) == stopped_at
    assert f"lit-llm: SIGTERM: training stopped after step {stopped_at};" in out
    deadline = time.monotonic() + 30
    while _alive(rank1):
        assert time.monotonic() < deadline, "rank 1 still runs after the launcher exited"
        time.sleep(0.2)


class _SignalAt(Callback):
    """Sends ``signum`` to this process ``times`` times in a row at the end of training batch ``at`` (before
    GracefulStop's hook runs)."""

    def __init__(self, signum: int, at: int, times: int = 1) -> None:
        self.signum, self.at, self.times = signum, at, times

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)  # Python runs the handler when the call returns


@pytest.mark.parametrize(("signum", "times"), [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2),
                                               (signal.SIGINT, 2)])
def test_in_process_fit_stops_after_the_signalled_step_with_last_ckpt(tmp_path, capfd, signum, times):
    """Signalled at step 3, once or twice back to back (the copy: one line, the same stop)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = GracefulStop()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=100)
    trainer = Trainer(max_steps=20, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[_SignalAt(signum, 2, times), stop, ckpt],
                      default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert (trainer.global_step, stop.signal, stop_exit_code(trainer)) == (3, signum, 128 + signum)
    assert torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    assert stop_exit_code(Trainer(logger=False, callbacks=[GracefulStop()])) is None
    name = signal.Signals(signum).name
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("lit-llm: ")]
    assert lines == [f"lit-llm: {name} received: stopping after the current optimizer step and writing last.ckpt "
                     f"(exit status {128 + signum}); send it again after 2 s to exit at once."] + [
        f"lit-llm: {name} again within 2 s of the first: the same stop request (still stopping after the current "
        f"optimizer step)."] * (times - 1)


class _Launcher:
    def __init__(self) -> None:
        self.killed: list[int] = []

    def kill(self, signum: int) -> None:
        self.killed.append(signum)


@pytest.mark.parametrize(("first", "second", "after", "exits"), [
    (signal.SIGTERM, signal.SIGTERM, 0.0, False), (signal.SIGTERM, signal.SIGTERM, DEBOUNCE_S - 0.01, False),
    (signal.SIGINT, signal.SIGINT, 1.0, False), (signal.SIGTERM, signal.SIGTERM, DEBOUNCE_S, True),
    (signal.SIGINT, signal.SIGINT, 60.0, True), (signal.SIGTERM, signal.SIGINT, 0.0, True),
    (signal.SIGINT, signal.SIGTERM, 0.5, True)])
def test_a_second_signal_exits_at_once_unless_it_is_the_same_within_the_window(monkeypatch, capfd, first, second,
                                                                              after, exits):
    """The handler itself, with a fake clock and ``os.kill`` / ``signal.signal`` recorded (nothing is delivered): the
    same signal less than ``DEBOUNCE_S`` after the first is ignored with one line; at or after it, or the other
    signal at any time, kills the DDP ranks this process launched and the process itself with that signal."""
    calls = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: calls.append(("kill", pid, signum)))
    monkeypatch.setattr(signal, "signal", lambda signum, handler: calls.append(("signal", signum, handler)))
    now = [100.0]
    stop, launcher = GracefulStop(clock=lambda: now[0]), _Launcher()
    stop._trainer = SimpleNamespace(global_rank=1, world_size=2, strategy=SimpleNamespace(launcher=launcher))
    stop._handle(first, None)
    now[0] += after
    stop._handle(second, None)
    err = capfd.readouterr().err.splitlines()
    assert err[0].startswith(f"[rank 1] lit-llm: {signal.Signals(first).name} received: stopping")
    name = signal.Signals(second).name
    if exits:
        what = f"second {name}" if second == first else f"{name} after {signal.Signals(first).name}"
        assert err[1:] == [f"[rank 1] lit-llm: {what}: exiting at once (a checkpoint being written is "
                           f"dropped; the last complete one stays)."]
        assert calls == [("signal", second, signal.SIG_DFL), ("kill", os.getpid(), second)]
        assert launcher.killed == [signal.SIGKILL]
    else:
        assert err[1:] == [f"[rank 1] lit-llm: {name} again within 2 s of the first: the same stop request (still "
                           f"stopping after the current optimizer step)."]
        assert calls == [] and launcher.killed == []
    assert stop._received == first  # what the safe point acts on


def test_a_sigterm_lightning_received_before_training_started_stops_after_the_first_step(tmp_path):
    """A SIGTERM between Lightning's handler registration and ``on_train_start`` (here: while the train dataloader is
    built) sets ``trainer.received_sigterm``: GracefulStop takes it as its signal and saves ``last.ckpt`` after the
    first step; Lightning then raises its ``SIGTERMException`` (``lit-llm`` exits 143 for it)."""

    class SignalWhileLoading(BoringModel):
        def train_dataloader(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().train_dataloader()

    stop = GracefulStop()
    trainer = Trainer(max_steps=20, limit_val_batches=0, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path,
                      callbacks=[stop, ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=100)])
    with pytest.raises(SIGTERMException):
        trainer.fit(SignalWhileLoading())
    assert (trainer.global_step, stop.signal) == (1, signal.SIGTERM)
    assert torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 1


class _Validations(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.steps.append(trainer.global_step)


@pytest.mark.parametrize(("val_every", "validated_at"), [(5, []), (3, [3])])
def test_a_stop_runs_no_validation_that_was_not_due(tmp_path, val_every, validated_at):
    """Signalled at step 3: Lightning answers ``should_stop`` with a validation; GracefulStop skips it unless one was
    due at step 3 anyway (every 3 steps), and gives ``limit_val_batches`` back; ``last.ckpt`` holds step 3 either
    way."""
    validations, stop = _Validations(), GracefulStop()
    trainer = Trainer(max_steps=20, val_check_interval=val_every, check_val_every_n_epoch=None, limit_val_batches=2,
                      num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=tmp_path,
                      callbacks=[_SignalAt(signal.SIGTERM, 2), stop, validations,
                                 ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=100)])
    trainer.fit(BoringModel())
    assert (trainer.global_step, stop.signal, validations.steps) == (3, signal.SIGTERM, validated_at)
    assert torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 3
    assert trainer.limit_val_batches == 2
