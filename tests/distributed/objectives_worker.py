"""Worker of test_ddp_objectives.py: 2 gloo ranks on CPU, each with half of a fixed GRPO batch cut into 2 micro-batches,
run the objective the way :class:`~lit_llm.lightning.module.PolicyModule` does (step count all-reduced before any
backward, each micro-batch loss times the world size, gradients averaged over ranks as DDP does) and write the summed
loss and the averaged gradient to ``<out>/rank<r>.json``. Run as ``python objectives_worker.py <out> <port>``."""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_llm.objectives import GRPOObjective

WORLD, B, T, D, V = 2, 6, 5, 4, 7
CASES = list(itertools.product(["dr_grpo", "dapo", "cispo"], ["token", "sequence"],
                               ["none", "token_truncate", "sequence_mask"]))


def batch() -> dict[str, torch.Tensor]:
    """The fixed batch: features, ids, masks (uneven token counts per rank), old / rollout log-probs, advantages."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w0 = torch.randn(D, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    lp0 = torch.log_softmax(x @ w0, -1).gather(-1, ids[..., None]).squeeze(-1)
    old = lp0 + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    rollout = old + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 2.0
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    trunc = torch.tensor([False, False, True, False, False, False])
    return {"x": x, "w0": w0, "ids": ids, "mask": mask, "old": old, "rollout": rollout, "adv": adv, "trunc": trunc}


def step(case: tuple[str, str, str], rows: slice, world: int, reduce) -> tuple[float, list[float]]:
    """One optimizer step's loss (summed over micro-batches) and gradient on ``rows`` of the batch."""
    loss_type, level, correction = case
    d = batch()
    w = d["w0"].clone().requires_grad_(True)
    obj = GRPOObjective(loss_type=loss_type, epsilon_high=4.0 if loss_type == "cispo" else 0.28,
                        max_completion_length=T, mask_truncated_completions=True, importance_sampling_level=level,
                        rollout_correction=correction, rollout_correction_clip_max=2.0)
    idx = list(range(B))[rows]
    mbs = [idx[: len(idx) // 2], idx[len(idx) // 2:]]
    count = reduce(sum(obj.local_count(d["mask"][m], d["trunc"][m], d["old"][m], d["rollout"][m]) for m in mbs)
                   .double())
    total = 0.0
    for m in mbs:
        lp = torch.log_softmax(d["x"][m] @ w, -1).gather(-1, d["ids"][m][..., None]).squeeze(-1)
        loss, _ = obj(lp, d["old"][m], d["adv"][m], d["mask"][m], step_count=count, truncated=d["trunc"][m],
                      rollout_log_probs=d["rollout"][m], num_micro_batches=len(mbs), world_size=world)
        (loss * world).backward()
        total += float(loss.detach())
    grad = w.grad.clone()
    if world > 1:  # DDP averages gradients over ranks
        dist.all_reduce(grad)
        grad /= world
    return total, grad.reshape(-1).tolist()


def run(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)

    def reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    per = B // WORLD
    res = {}
    for case in CASES:
        loss, grad = step(case, slice(rank * per, (rank + 1) * per), WORLD, reduce)
        res["/".join(case)] = {"loss": loss, "grad": grad}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2])), nprocs=WORLD, join=True)
