"""What a user sees while a run trains: one progress bar over the whole run, or plain lines in a log file.

:class:`StepProgressBar` is Lightning's :class:`~lightning.pytorch.callbacks.TQDMProgressBar` counted in **optimizer
steps over ``trainer.max_steps``** instead of batches of one epoch: the bar's total is the run's ``max_steps`` (its
ETA covers the whole run, evaluations excepted), a resumed run starts the bar at its ``global_step``, the rate reads
``s/it`` when a step takes longer than a second (Lightning's bar prints ``0.00it/s`` there), and the postfix holds the
step's key numbers (:data:`KEY_METRICS`: loss or reward, the last evaluation, tokens/s).

When stdout is not a terminal (``make demo > log``, CI, ``nohup``) the bars are off and the callback prints a plain
line every ``every_n_steps`` optimizer steps and after every evaluation, flushed at once::

    [step 20/80] 3m41s elapsed, ETA 11m02s, 8.3 s/step | reward 0.412 | eval 0.295 | tok/s 312

The evaluation line is the run's one report of an evaluation: printed plainly off a terminal, through
``tqdm.write`` (above the bar) on one. In ``validate`` / ``test`` it reads ``[step <checkpoint step>] evaluation:
<metrics>``, without max_steps or timing.

The ``lit-llm`` CLI adds it whenever ``trainer.enable_progress_bar`` is true (every shipped config) and no other
progress bar is given (:meth:`lit_llm.lightning.cli.LitLLMCLI.instantiate_trainer`).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

__all__ = ["KEY_METRICS", "StepProgressBar", "format_duration", "key_metrics"]

#: ``(short name, logged metric names in order of preference)``: the numbers shown on the bar / in each line. A
#: trailing ``*`` matches the first logged metric with that prefix (the first greedy-evaluation reward of GRPO).
KEY_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss", "train/loss")),
    ("reward", ("reward", "train/reward")),
    ("val_loss", ("val/loss",)),
    ("eval", ("eval/*",)),
    ("tok/s", ("train/tokens_per_sec",)),
)


def format_duration(seconds: float) -> str:
    """``"1h02m"``, ``"3m41s"`` or ``"12s"`` (``"?"`` for an unknown or infinite time)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _format_value(v: float) -> str:
    if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"


def key_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Pick :data:`KEY_METRICS` out of ``metrics`` (``trainer.callback_metrics``): ``{short name: value}``, in the
    table's order, only those logged."""
    out: dict[str, float] = {}
    for short, names in KEY_METRICS:
        for name in names:
            if name.endswith("*"):
                hit = next((k for k in metrics if k.startswith(name[:-1])), None)
            else:
                hit = name if name in metrics else None
            if hit is not None:
                try:
                    out[short] = float(metrics[hit])
                except (TypeError, ValueError):
                    continue
                break
    return out


class StepProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar over the run's optimizer steps, or plain flushed lines off a terminal.

    Args:
        refresh_rate: update the bar every this many training batches.
        every_n_steps: off a terminal, print a line every this many optimizer steps (``None``: about 50 lines per
            run, at least every step for runs of 50 steps or fewer).
        plain: force plain lines (``True``) or the bar (``False``); ``None`` decides from ``sys.stdout.isatty()``.

    Raises:
        ValueError: ``every_n_steps < 1``.
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1, every_n_steps: int | None = None, plain: bool | None = None) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=True)
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"StepProgressBar: every_n_steps must be >= 1 (or None), got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.plain = plain
        self._t0: float | None = None
        self._step0 = 0
        self._last_line_step = -1

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def is_plain(self) -> bool:
        """Plain lines instead of a bar (stdout is not a terminal, or forced)."""
        if self.plain is not None:
            return self.plain
        isatty = getattr(sys.stdout, "isatty", None)
        return not (callable(isatty) and isatty())

    @staticmethod
    def total_steps(trainer: Trainer) -> int | None:
        """The run's optimizer steps: ``trainer.max_steps``, or ``max_epochs * batches per epoch``; ``None`` if
        unbounded."""
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        batches = trainer.num_training_batches
        if trainer.max_epochs and trainer.max_epochs > 0 and math.isfinite(batches):
            return int(trainer.max_epochs * batches)
        return None

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        """The bar's postfix: :func:`key_metrics` of the run's logged metrics (no ``v_num``)."""
        return {k: _format_value(v) for k, v in key_metrics(dict(trainer.callback_metrics)).items()}

    def _line(self, trainer: Trainer, prefix: str, metrics: dict[str, float]) -> str:
        step, total = trainer.global_step, self.total_steps(trainer)
        elapsed = time.perf_counter() - (self._t0 or time.perf_counter())
        done = step - self._step0
        per_step = elapsed / done if done > 0 else math.nan
        head = f"[step {step}/{total}]" if total else f"[step {step}]"
        timing = f"{format_duration(elapsed)} elapsed"
        if done > 0:
            eta = (total - step) * per_step if total else math.nan
            rate = f"{per_step:.1f} s/step" if per_step >= 1 else f"{1 / per_step:.2f} steps/s"
            timing += f", ETA {format_duration(eta)}, {rate}"
        body = " | ".join(f"{k} {_format_value(v)}" for k, v in metrics.items())
        return " ".join(x for x in (head, prefix, timing) if x) + (f" | {body}" if body else "")

    def _print(self, text: str) -> None:
        """A line on stdout: printed as is in plain mode, through tqdm (above the bar, which stays) otherwise."""
        if self.is_plain:
            print(text, file=sys.stdout, flush=True)
        else:
            Tqdm.write(text, file=sys.stdout)

    # ---------------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.is_plain:
            self.disable()

    def init_train_tqdm(self) -> Tqdm:
        bar = super().init_train_tqdm()
        bar.unit = "step"
        return bar

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._t0, self._step0, self._last_line_step = time.perf_counter(), trainer.global_step, trainer.global_step
        total = self.total_steps(trainer)
        bar = self.train_progress_bar
        bar.total = total
        bar.initial = bar.n = trainer.global_step
        bar.set_description("Training")
        bar.refresh()

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        """No per-epoch reset: the bar counts the whole run."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.is_plain:
            if trainer.is_global_zero and step != self._last_line_step:
                total = self.total_steps(trainer) or 0
                every = self.every_n_steps or max(1, math.ceil(total / 50))
                if step % every == 0 or step == total:
                    self._last_line_step = step
                    self._print(self._line(trainer, "", key_metrics(dict(trainer.callback_metrics))))
            return
        bar = self.train_progress_bar
        if bar is not None and self._should_update(batch_idx + 1, math.inf):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._evaluation_line(trainer, pl_module, ("val/", "eval/"))

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_test_end(trainer, pl_module)
        self._evaluation_line(trainer, pl_module, ("test/", "val/", "eval/"))

    def _evaluation_line(self, trainer: Trainer, pl_module: LightningModule, prefixes: tuple[str, ...]) -> None:
        """The line of an evaluation (the run's only report of it: in plain mode and, through tqdm, on a terminal).
        While fitting: ``[step 3/6] evaluation: <timing> | <metrics>``; in ``validate`` / ``test``:
        ``[step <eval_step>] evaluation: <metrics>`` (the loaded checkpoint's step, no max_steps or timing)."""
        if not trainer.is_global_zero:
            return
        metrics = {k: v for k, v in dict(trainer.callback_metrics).items()
                   if k.startswith(prefixes) and getattr(v, "numel", lambda: 1)() == 1}
        if not metrics:
            return
        what = "sanity check:" if trainer.sanity_checking else "evaluation:"
        shown = {k: float(v) for k, v in metrics.items()}
        if trainer.state.fn == "fit":
            self._print(self._line(trainer, what, shown))
        else:
            step = int(getattr(pl_module, "eval_step", trainer.global_step))
            self._print(f"[step {step}] {what} " + " | ".join(f"{k} {_format_value(v)}" for k, v in shown.items()))
