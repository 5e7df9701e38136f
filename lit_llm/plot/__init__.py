"""Training-curve PNG from a Lightning ``CSVLogger`` run (``lit-llm plot LOG_DIR``).

One job per module: :mod:`~lit_llm.plot.panels` (which column goes to which panel, :data:`PANEL_SPECS`),
:mod:`~lit_llm.plot.logs` (finding and joining a run's ``metrics.csv`` files), :mod:`~lit_llm.plot.draw` (the figure
and the PNG) and :mod:`~lit_llm.plot.cli` (``lit-llm plot``). This package re-exports their public names; it imports
neither torch nor Lightning (matplotlib only when drawing), so ``lit-llm plot --help`` answers at once.

Lightning's ``CSVLogger`` writes ``<save_dir>/<name>/version_<N>/metrics.csv``: one row per logging call, with
only the columns logged by that call filled (the file is *sparse*), plus ``step`` and ``epoch``. ``step`` is
``global_step``, the optimizer steps done, as progress lines and ``eval_samples.csv`` count them: a step's training
metrics at the step it completes (the first at 1), the evaluation after step N at N, the pre-training evaluation and
the ``data/*`` counts at 0 (the lit-llm modules log an explicit ``step``; Lightning's default for manual optimization
would be one less). ``lit-llm validate`` logs at the checkpoint's step; such an evaluation-only version adds its
points to the eval panels (later wins) and is no new run.

A run resumed with ``--ckpt_path`` gets a new ``version_N`` folder; this module joins
the versions of one run into one curve per metric (:func:`load_metrics`: where steps overlap after a resume, the
later version wins) and draws **one panel per concept** (:data:`PANEL_SPECS`, in this order):

=================================  =====================================================================  ==========
panel                              columns (regular expression searched in the name)                      unit
=================================  =====================================================================  ==========
Eval accuracy (greedy)             ``eval/<reward fn>``: greedy evaluation on held-out prompts            reward
Reward                             ``train/reward`` with a ±1 std band from ``train/reward_std``          reward
Reward per function                ``train/rewards/<fn>/mean`` with a ±1 std band from ``.../std``         reward
Loss                               ``train/loss``, ``train/nll``, ``val/loss``                            per token
Token accuracy                     ``train/token_accuracy``, ``val/token_accuracy``                       fraction
Sampler/trainer mismatch           any name with ``mismatch`` (``train/mismatch_kl``...)                  nats, ratio
KL to reference                    ``train/kl``                                                           nats/token
Entropy                            ``train/entropy``, ``val/entropy``                                     nats/token
Policy ratio                       ``train/ratio_{mean,min,max}`` (π_θ / π_old)                           ratio
Clip ratios                        ``train/clip_ratio/{low,high,region}_mean``                            fraction
Completion length                  ``train/completions/{mean,min,max}_length``                            tokens
Zero-std groups, truncation        ``train/frac_reward_zero_std``, ``train/completions/clipped_ratio``    fraction
Dynamic sampling                   ``train/sampling_rounds`` (``dynamic_sampling``: rollouts per step)     count
Episode rates                      ``train/episodes/{tool_call_rate,tool_success_rate,truncated[/...]}``  fraction
Episode tokens                     ``train/episodes/{sampled,env}_tokens_mean``                           tokens
Reward by turn count               ``train/reward_by_turns/<k>``                                          reward
Episodes                           other names with ``turns``/``tool_calls``/``episode`` (turns_mean...)  count
Throughput                         ``*tokens_per_sec`` (``train/``, ``rollout/``, ``train/real_``)         tokens/s
Time per step                      ``time/*`` (generation, rollout wait, training, step, tools, env...)   s
Async rollouts                     ``train/staleness``, ``train/dropped_rollouts``                        steps, count
Gradient norm                      ``train/grad_norm``                                                    L2 norm
Learning rate                      ``train/lr``, ``lr-<Optimizer>`` (LearningRateMonitor)                 lr
Skipped steps                      ``train/skipped_steps`` (non-finite steps skipped)                     count
Host memory                        ``memory/host_rss_gib``, ``memory/host_peak_rss_gib``                  GiB
GPU memory                         ``memory/cuda_allocated_gib``, ``memory/cuda_peak_gib`` (CUDA only)    GiB
=================================  =====================================================================  ==========

A column goes to the first spec of that list whose pattern it matches; a spec's named group ``label`` (when it has
one) is the legend label. A column named like a mean's standard deviation (``X_std`` or ``X/std`` beside ``X`` or
``X/mean``) is drawn as the ±1 std band of that mean, not as a curve.

**Left out on purpose** (:data:`IGNORED`): ``step``, ``epoch``, ``*/ppl`` (``exp`` of the per-token loss: the loss
curve on another scale), ``*/tokens`` and ``*/step_tokens`` (token counts: cumulative or per batch, not a training
signal).

**Any other column** (a metric no spec knows yet) gets a panel of its own, titled with the column name, after the
known panels: a new metric is never hidden, and no panel mixes unknown units. To group it with others, add a
:class:`PanelSpec` to :data:`PANEL_SPECS`.

**Constants**: a panel whose every series is constant (one value throughout, or a single point: a fixed learning
rate, ``train/staleness`` of a synchronous run) is not drawn; its columns and values are listed under the figure
(and returned in :attr:`CurvesPlot.constants`). The x axis is the optimizer step with integer ticks, shared by all
panels; a dotted vertical line marks the step where each resumed version starts.

Usage::

    lit-llm plot runs/grpo_tiny                  # -> runs/grpo_tiny/training_curves.png
    lit-llm plot runs/sft/csv --out curves.png --version 3
"""

from lit_llm.plot.cli import command, main
from lit_llm.plot.draw import CurvesPlot, plot_training_curves
from lit_llm.plot.logs import find_metrics_files, load_metrics
from lit_llm.plot.panels import IGNORED, PANEL_SPECS, PanelSpec, Series, collect_panels, panel_for

__all__ = [
    "IGNORED",
    "PANEL_SPECS",
    "CurvesPlot",
    "PanelSpec",
    "Series",
    "collect_panels",
    "command",
    "find_metrics_files",
    "load_metrics",
    "main",
    "panel_for",
    "plot_training_curves",
]
