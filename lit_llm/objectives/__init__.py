"""Loss maths of lit_llm: supervised heads (sft / rlhf / generic) and the GRPO family (advantages, clipped / GSPO /
CISPO surrogates, KL, entropy bonus, sampler/trainer rollout correction).

Pure tensor code, no Lightning: inputs are ``[B, T]`` tensors aligned to ``tokens.full``.
"""

from lit_llm.objectives.correction import mismatch_metrics, rollout_correction_weights
from lit_llm.objectives.grpo import GRPOObjective, compute_advantages, effective_completion_mask, grpo_loss
from lit_llm.objectives.reduction import deferred_checks, k3_kl
from lit_llm.objectives.sft import NonFiniteLossError, check_finite, loss_mask, sft_loss, sft_step_count

__all__ = [
    "GRPOObjective",
    "NonFiniteLossError",
    "check_finite",
    "compute_advantages",
    "deferred_checks",
    "effective_completion_mask",
    "grpo_loss",
    "k3_kl",
    "loss_mask",
    "mismatch_metrics",
    "rollout_correction_weights",
    "sft_loss",
    "sft_step_count",
]
