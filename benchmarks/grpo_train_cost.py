"""What the training part of a GRPO step costs, in figures a loaded machine does not distort much (issue 31).

Wall-clock seconds on a CPU shared with other jobs vary several-fold; the work a step does does not. This runs
``--steps`` GRPO steps of ``grpo_step.py``'s workload (SmolLM2-135M-Instruct, 8 arithmetic prompts x 8 generations,
<= 32 new tokens, ``dapo``, AdamW) with **one intra-op thread** (``--threads``) and prints, for each step's training
part (``PolicyModule.training_step``: forward, backward, clipping, optimizer, metrics; the rollout is not in it):

- ``cpu_s``: CPU seconds of the thread that ran it (``time.thread_time``: one thread, so no OpenMP spin-waits);
- ``minflt``: its minor page faults (each one a 4 KiB page the kernel had to map and zero: memory that was given back
  to the system and touched again);
- ``sys_s``: its system CPU seconds (mostly those page faults);
- ``wall_s``: wall seconds (only meaningful on a quiet machine);
- ``step_minflt``, ``step_sys_s``, ``step_wall_s``: the same for the whole step, every thread of the process
  (``RUSAGE_SELF`` from batch start to batch end: the rollout's generation threads, the release, the logging).

It also prints every host-memory release (:meth:`~lit_llm.lightning.module.PolicyModule.release_host_memory`): call
site, resident set before / after (GiB), seconds. The first step's figures include one-time costs; compare steps 2+.

Run it from any checkout (each tree's own code first on ``PYTHONPATH``) to compare commits::

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/grpo_train_cost.py --steps 4
    # the same with the releases off, or with another growth threshold:
    ... benchmarks/grpo_train_cost.py --steps 4 --no-release
    ... benchmarks/grpo_train_cost.py --steps 4 --release-growth 0
    # glibc's default malloc arenas (one per thread, up to 8 x cores) instead of one shared arena:
    ... benchmarks/grpo_train_cost.py --steps 4 --malloc-arenas none
    # glibc's default mmap / trim thresholds (large freed blocks unmapped at once) instead of keeping freed pages:
    ... benchmarks/grpo_train_cost.py --steps 4 --keep-freed-pages no
    # grpo_step.py's two threads (then cpu_s counts one thread's share only):
    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/grpo_train_cost.py --steps 4 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from functools import partial

import torch
from _memory import machine_line
from lightning.pytorch import Callback, Trainer

import lit_llm
from lit_llm.lightning import module as module_mod
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.lightning.host_memory import host_rss_bytes

REWARDS = ["lit_llm.rewards:strict_arithmetic_reward", "lit_llm.rewards:arithmetic_answer_reward"]


def commit_of(path: str) -> str:
    """The git commit (short) of the checkout holding ``path``, ``"unknown"`` outside git."""
    try:
        return subprocess.run(["git", "-C", os.path.dirname(path), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (grpo_step.py uses the cores)")
    p.add_argument("--no-release", action="store_true", help="replace the host-memory release by a no-op")
    p.add_argument("--release-sites", default=None,
                   help="comma-separated release call sites that may release (rollout, step, validation); the others"
                        " become no-ops (default: all)")
    p.add_argument("--release-growth", type=float, default=None,
                   help="PolicyModule.host_memory_release_growth (trees that have it)")
    p.add_argument("--malloc-arenas", default=None,
                   help="PolicyModule.host_malloc_arenas (trees that have it): a number, or 'none' for glibc's default")
    p.add_argument("--keep-freed-pages", choices=["yes", "no"], default=None,
                   help="PolicyModule.host_malloc_keep_freed_pages (trees that have it)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    # no logger on purpose: Lightning's "self.log(...) but have no logger configured" lines, several per step
    warnings.filterwarnings("ignore", message=r".*but have no logger configured")
    print(machine_line(), f"; lit_llm {commit_of(lit_llm.__file__)} ({os.path.dirname(lit_llm.__file__)})",
          flush=True)

    releases: list[dict[str, float | str]] = []
    real_trim = module_mod.trim_host_memory

    def traced_trim() -> bool:
        caller = sys._getframe(1)  # release_host_memory (its ``site`` argument), or an older tree's caller
        site = caller.f_locals.get("site") or caller.f_back.f_code.co_name
        before, t = host_rss_bytes() or 0, time.perf_counter()
        off = a.no_release or (a.release_sites is not None and site not in a.release_sites.split(","))
        done = False if off else real_trim()
        releases.append({"site": site, "released": done, "rss_before_gib": round(before / 2**30, 2),
                         "rss_after_gib": round((host_rss_bytes() or 0) / 2**30, 2),
                         "seconds": round(time.perf_counter() - t, 3)})
        return done

    module_mod.trim_host_memory = traced_trim
    if a.release_growth is not None:
        module_mod.PolicyModule.host_memory_release_growth = a.release_growth
    if a.malloc_arenas is not None:
        module_mod.PolicyModule.host_malloc_arenas = None if a.malloc_arenas == "none" else int(a.malloc_arenas)
    if a.keep_freed_pages is not None:
        module_mod.PolicyModule.host_malloc_keep_freed_pages = a.keep_freed_pages == "yes"

    steps: list[dict[str, float]] = []
    real_step = module_mod.PolicyModule.training_step

    def timed_step(self, *args, **kwargs):
        r0, c0, w0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
        out = real_step(self, *args, **kwargs)
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        steps.append({"step": len(steps) + 1, "cpu_s": round(time.thread_time() - c0, 2),
                      "minflt": r1.ru_minflt - r0.ru_minflt, "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
                      "wall_s": round(time.perf_counter() - w0, 2), "releases_before": len(releases)})
        return out

    module_mod.PolicyModule.training_step = timed_step

    class WholeStep(Callback):
        """Adds the whole step's process-wide figures (every thread) to the step's row."""

        def on_train_batch_start(self, *args) -> None:
            self.start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            (r0, w0), r1 = self.start, resource.getrusage(resource.RUSAGE_SELF)
            if steps:
                steps[-1].update(step_minflt=r1.ru_minflt - r0.ru_minflt,
                                 step_sys_s=round(r1.ru_stime - r0.ru_stime, 2),
                                 step_wall_s=round(time.perf_counter() - w0, 2),
                                 rss_gib=round((host_rss_bytes() or 0) / 2**30, 2))  # before the step's release

    module = GRPOModule(a.model, reward_funcs=REWARDS, num_generations=8, max_new_tokens=32, temperature=1.0,
                        micro_batch_size=64, log_samples_every=0, optimizer=partial(torch.optim.AdamW, lr=1e-6))
    data = GRPODataModule("arithmetic", batch_size=8, num_train=8 * a.steps, num_eval=0)
    Trainer(max_steps=a.steps, precision=a.precision, accelerator="cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[WholeStep()]).fit(module, data)
    for row in steps:
        print(json.dumps(row))
    for row in releases:
        print("release", json.dumps(row))
    print("peak_rss_gib", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2))


if __name__ == "__main__":
    main()
