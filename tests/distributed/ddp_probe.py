"""Test-only Lightning callback that records, on every DDP rank, what the DDP tests assert on.

Added to a ``lit-llm fit`` run with (``tests/distributed`` on ``PYTHONPATH``)::

    --trainer.callbacks+=ddp_probe.DDPProbe --trainer.callbacks.out_dir DIR [--trainer.callbacks.skew_generation true]

Each rank writes ``DIR/rank<r>.json`` at the end of fit:

* ``steps``: per training batch, the ``global_step`` after it, the sample ids this rank trained on, this rank's
  token count of the step (SFT: the loss-head tokens = ``step_denominator``; GRPO: completion tokens of its rollouts),
  the sampling seed (GRPO), the completion lengths and the sha256 of the weights after the step;
* ``final_hash``: sha256 of the weights at the end of fit; ``checkpoint_writes``: paths this rank actually wrote;
* on rank 0, ``DIR/children.json`` (written at interpreter exit): the exit codes of the processes Lightning's launcher
  started for the other ranks (so the test sees every rank's exit status, not only the launcher's).

``skew_generation=True`` (GRPO) makes rank 0 stop every completion at its first token (every id is a stop id) and
rank 1 never stop (no stop id: every completion runs to ``max_new_tokens``), to check that ranks generating very
different lengths neither hang nor desynchronise. In ``rollout_mode: async`` the producer's engine (built with the
train dataloader) is skewed alike, and the recorded rollout is the one the module takes (``take_rollout``).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def weights_hash(module: torch.nn.Module) -> str:
    """sha256 over the names and bytes of every tensor of ``module.state_dict()`` (sorted by name); a sharded
    (FSDP2 ``DTensor``) tensor is gathered whole first (a collective: every rank calls this)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _skew(engine: Any, eos: tuple[int, ...]) -> None:
    """Make ``engine``'s generate version (and the batcher's versions of it) stop at exactly the ids ``eos``."""
    engine.policy.generation_config = dataclasses.replace(engine.policy.generation_config, eos_token_ids=eos)
    batched_policy = engine.batched_policy

    def skewed(rows: int, **kw: Any) -> Any:  # the batcher's version of the generate version stops alike
        version = batched_policy(rows, **kw)
        version.generation_config = dataclasses.replace(version.generation_config, eos_token_ids=eos)
        return version

    engine.batched_policy = skewed


class DDPProbe(Callback):
    """See the module docstring.

    Args:
        out_dir: folder of the per-rank JSON files (created).
        skew_generation: GRPO only: rank 0 stops at once, rank 1 always runs to ``max_new_tokens``.
    """

    def __init__(self, out_dir: str, skew_generation: bool = False) -> None:
        self.out_dir, self.skew_generation = Path(out_dir), skew_generation
        self.record: dict[str, Any] = {}
        self._last_rollout: Any = None
        self._pending: dict[str, Any] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        rank = trainer.global_rank
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.record = {"rank": rank, "world_size": trainer.world_size, "pid": os.getpid(), "steps": [],
                       "checkpoint_writes": []}
        io = trainer.strategy.checkpoint_io
        save = io.save_checkpoint

        def counting_save(checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            self.record["checkpoint_writes"].append(os.path.basename(str(path)))
            return save(checkpoint, path, storage_options)

        io.save_checkpoint = counting_save
        engine = getattr(pl_module, "engine", None)
        if engine is not None:
            switch = pl_module.versions
            rollout = switch.rollout  # the trained batch (with dynamic sampling: the kept groups of every round)

            def capturing_rollout(*args: Any, **kwargs: Any) -> Any:
                td = rollout(*args, **kwargs)
                self._last_rollout = td
                return td

            switch.rollout = capturing_rollout
            if switch.rollout_mode == "async":  # produced by the background thread: capture what the module takes
                take_rollout = switch.take_rollout

                def capturing_take(*args: Any, **kwargs: Any) -> Any:
                    taken = take_rollout(*args, **kwargs)
                    self._last_rollout = taken[0]
                    return taken

                switch.take_rollout = capturing_take
            if self.skew_generation:
                vocab = int(pl_module.model.get_output_embeddings().weight.shape[0])
                eos = tuple(range(vocab)) if rank == 0 else ()
                _skew(engine, eos)
                wrap = switch.wrap_train_loader

                def skewed_producer(*args: Any, **kwargs: Any) -> Any:  # async: the producer's twin engine too
                    loader = wrap(*args, **kwargs)
                    if switch.async_rollouts is not None:
                        _skew(switch.async_rollouts.engine, eos)
                    return loader

                switch.wrap_train_loader = skewed_producer
        if rank == 0:
            launcher = getattr(trainer.strategy, "launcher", None)
            atexit.register(self._write_children, list(getattr(launcher, "procs", []) or []))

    def _write_children(self, procs: list[Any]) -> None:
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=120))
            except Exception as e:  # noqa: BLE001 - recorded for the test
                codes.append(repr(e))
        (self.out_dir / "children.json").write_text(json.dumps({"exit_codes": codes}))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if isinstance(batch, dict) and "micro_batches" in batch:  # SFT
            mbs = batch["micro_batches"]
            self._pending = {"sample_ids": [s for mb in mbs for s in mb["sample_ids"]],
                             "tokens": float(pl_module.step_denominator(mbs)),
                             "micro_batches": len(mbs)}
        elif isinstance(batch, dict) and "sample_id" in batch:  # GRPO prompt batch
            engine = pl_module.engine
            self._pending = {"prompt_ids": list(batch["sample_id"]),
                             "seed": engine.sampling_seed(trainer.global_step)}

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        rec = dict(self._pending)
        td, self._last_rollout = self._last_rollout, None
        if td is not None:
            rec["sample_ids"] = list(td.sample_id)
            rec["groups"] = td.group.tolist()
            rec["tokens"] = float(td.loss_mask.sum())
            rec["completion_lengths"] = td.completion_lengths.tolist()
            rec["truncated"] = td.truncated.tolist()
            rec["completions"] = list(td.completion)
        rec["global_step"] = trainer.global_step
        rec["hash"] = weights_hash(pl_module.model)
        self.record["steps"].append(rec)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.record["final_hash"] = weights_hash(pl_module.model)
        self.record["global_step"] = trainer.global_step
        path = self.out_dir / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.record))
