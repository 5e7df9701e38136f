"""dr_grpo / dapo / cispo losses are invariant to the world size: 2 gloo ranks (a subprocess with a hard time limit,
never inside the pytest process), each with half of the batch in 2 micro-batches, give the single-process full-batch
loss (summed over ranks) and gradient (DDP's average), with GSPO's ratio and the rollout corrections too."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from objectives_worker import CASES, B, step

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_objectives")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "objectives_worker.py"), str(out), str(_free_port())], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES, ids=["/".join(c) for c in CASES])
def test_world_size_invariance(ranks, case):
    key = "/".join(case)
    full_loss, full_grad = step(case, slice(0, B), 1, lambda x: x)
    assert ranks[0][key]["loss"] + ranks[1][key]["loss"] == pytest.approx(full_loss, abs=1e-12, rel=1e-10)
    torch.testing.assert_close(torch.tensor(ranks[0][key]["grad"]), torch.tensor(full_grad), atol=1e-12, rtol=1e-10)
    assert ranks[0][key]["grad"] == ranks[1][key]["grad"]  # every rank holds the same averaged gradient
    assert any(abs(g) > 1e-6 for g in full_grad)
