"""Helpers of the DDP tests: launch ``lit-llm fit`` with 2 gloo ranks on CPU (a subprocess with a hard time limit,
never inside the pytest process) and read back what :class:`ddp_probe.DDPProbe` recorded on every rank."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORLD = 2


def lit_llm_command() -> list[str]:
    """The installed ``lit-llm`` console script (``python -m lit_llm.lightning.cli`` when it is not installed)."""
    script = Path(sys.executable).parent / "lit-llm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lit_llm.lightning.cli"]


@dataclass
class DDPRun:
    """One finished launch: the run folder, the launcher's exit code, its output and the per-rank probe records."""

    root: Path
    returncode: int
    output: str
    ranks: list[dict[str, Any]]
    children: dict[str, Any]

    def metrics(self, key: str, version: int = 0) -> list[float]:
        """Values of ``key`` in ``csv/version_<version>/metrics.csv`` (rows that have it, in order)."""
        with open(self.root / "csv" / f"version_{version}" / "metrics.csv") as f:
            return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def launch(root: Path, config: str, *args: str, timeout: float = 240, skew_generation: bool = False,
           strategy: tuple[str, ...] = ("--trainer.strategy", "ddp")) -> DDPRun:
    """Run ``lit-llm fit --config configs/<config> ... --trainer.devices 2 --trainer.strategy ddp`` in ``root``
    (``strategy``: the strategy options instead, e.g. sharded training's).

    Raises:
        AssertionError: the launcher did not exit 0 (with the tail of its output), or a rank wrote no record.
        subprocess.TimeoutExpired: the run hung past ``timeout`` seconds (the process group is killed).
    """
    root.mkdir(parents=True, exist_ok=True)
    probe = root / "probe"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)  # never look like an already-launched rank
    env.pop("MASTER_PORT", None)  # let Lightning pick a free port
    cmd = [*lit_llm_command(), "fit", "--config", str(ROOT / "configs" / config),
           "--trainer.accelerator", "cpu", "--trainer.devices", str(WORLD), *strategy,
           "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false",
           "--trainer.callbacks+=ddp_probe.DDPProbe", "--trainer.callbacks.out_dir", str(probe),
           "--trainer.callbacks.skew_generation", str(skew_generation).lower(), *args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher and the rank it started share its session
        proc.communicate()
        raise
    assert proc.returncode == 0, f"launcher exit code {proc.returncode}\n{out[-6000:]}"
    ranks = []
    for r in range(WORLD):
        path = probe / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no probe record (did it finish fit?)\n{out[-4000:]}"
        ranks.append(json.loads(path.read_text()))
    children = json.loads((probe / "children.json").read_text()) if (probe / "children.json").exists() else {}
    return DDPRun(root, proc.returncode, out, ranks, children)


class RunCache:
    """Launch each named DDP run once per test module: ``get(name)`` calls ``make(base / name)`` on first use."""

    def __init__(self, base: Path, make: Callable[[str, Path], DDPRun]) -> None:
        self.base, self.make, self.cache = base, make, {}

    def get(self, name: str) -> DDPRun:
        if name not in self.cache:
            self.cache[name] = self.make(name, self.base / name)
        return self.cache[name]


def assert_clean_exit(run: DDPRun) -> None:
    """The launcher exited 0 (checked by :func:`launch`) and so did the rank it started."""
    assert run.children.get("exit_codes") == [0] * (WORLD - 1), run.children


def assert_same_weights_every_step(run: DDPRun) -> None:
    """Every rank holds bit-identical weights after every optimizer step and at the end."""
    r0, r1 = run.ranks
    assert len(r0["steps"]) == len(r1["steps"]) > 0
    for a, b in zip(r0["steps"], r1["steps"]):
        assert a["global_step"] == b["global_step"]
        assert a["hash"] == b["hash"], f"weights differ across ranks after step {a['global_step']}"
    assert r0["final_hash"] == r1["final_hash"]


def assert_checkpoints_written_by_rank_zero_only(run: DDPRun) -> None:
    """Rank 0 wrote every checkpoint file, the other ranks none."""
    assert run.ranks[0]["checkpoint_writes"], "rank 0 wrote no checkpoint"
    assert all(not r["checkpoint_writes"] for r in run.ranks[1:]), [r["checkpoint_writes"] for r in run.ranks]
    assert (run.root / "checkpoints" / "last.ckpt").exists()
    assert sorted(p.name for p in (run.root / "csv").iterdir()) == ["version_0"]  # one logger folder
