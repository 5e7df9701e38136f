"""Supervised fine-tuning as a LightningModule (:class:`SFTModule`): the prompt-masked (``sft``), assistant-masked
(``rlhf``) and attention-masked (``generic``) loss heads on the log-prob version's masked distributions, step-level
normalisation (:mod:`lit_llm.objectives.sft`), an optional KL term to a frozen reference, validation NLL / perplexity
/ token accuracy."""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from tensordict import TensorDict
from torch import Tensor
from torchmetrics import SumMetric

from lit_llm.data.packing import is_packed, unpack_rows
from lit_llm.lightning.module import PolicyModule
from lit_llm.lightning.versions import PolicyVersionSwitch
from lit_llm.models import DEFAULT_MODEL, DType
from lit_llm.objectives.sft import sft_loss, sft_step_count
from lit_llm.policy.transformers_wrapper import TransformersWrapper

__all__ = ["SFTModule"]


class SFTModule(PolicyModule):
    """Supervised fine-tuning with a choice of loss head and an optional KL term to a frozen reference copy.

    Heads (the log-prob version's masked distributions): ``"sft"`` trains on the completion (prompt-masked,
    ``get_sft_dist``), ``"rlhf"`` on every assistant turn (assistant-masked, ``get_rlhf_dist``), ``"generic"`` on every
    real token (attention-masked, ``get_generic_dist``).

    Args:
        model, dtype, attn_implementation, chat_template, chat_template_kwargs, use_peft, lora_r, lora_alpha,
        lora_dropout, lora_target_modules: the model options (see :class:`PolicyModule` and
            :class:`~lit_llm.models.ModelConfig`).
        loss: the loss head, ``"sft"``, ``"rlhf"`` or ``"generic"``.
        normalization: ``"token"`` = mean over the trained tokens of the whole optimizer step (all micro-batches,
            all ranks); ``"sequence"`` = each sequence's token mean, averaged over the step's sequences.
        kl_coef: weight of the k3 KL-to-reference term (``> 0`` keeps a frozen copy of the initial model, not
            saved in checkpoints; with ``use_peft`` the reference is the same model with its adapters disabled).
        token_accuracy: log the mean token accuracy (argmax hits from the log-prob kernel's chunks: no extra
            LM-head pass).
        optimizer, lr_scheduler, grad_clip, on_nonfinite, gradient_checkpointing, chunk_size, lm_head_matmul_dtype:
            see :class:`PolicyModule`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: DType = "float32", attn_implementation: str | None = None,
                 chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                 use_peft: bool = False, lora_r: int = 16, lora_alpha: int = 32, lora_dropout: float = 0.05,
                 lora_target_modules: list[str] | None = None, loss: Literal["sft", "rlhf", "generic"] = "sft",
                 normalization: Literal["token", "sequence"] = "token",
                 kl_coef: float = 0.0, token_accuracy: bool = True, optimizer: OptimizerCallable = torch.optim.AdamW,
                 lr_scheduler: LRSchedulerCallable | None = None, grad_clip: float | None = 1.0,
                 on_nonfinite: Literal["raise", "skip"] = "raise", gradient_checkpointing: bool = False,
                 chunk_size: int = 1024, lm_head_matmul_dtype: Literal["float32", "bfloat16"] = "float32") -> None:
        super().__init__(**PolicyModule.options_of(locals()))
        if loss not in ("sft", "rlhf", "generic"):
            raise ValueError(f"SFTModule: loss must be 'sft', 'rlhf' or 'generic', got {loss!r}.")
        if normalization not in ("token", "sequence"):
            raise ValueError(f"SFTModule: normalization must be 'token' or 'sequence', got {normalization!r}.")
        if kl_coef < 0:
            raise ValueError(f"SFTModule: kl_coef must be >= 0, got {kl_coef}.")
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        self.loss, self.normalization, self.kl_coef, self.token_accuracy = loss, normalization, kl_coef, token_accuracy
        # The generate version answers greedily (ValidationSamples); its log-prob version scores at temperature 1.
        policy = TransformersWrapper(self.model, tokenizer=self.tokenizer, input_mode="tokens",
                                     generate_kwargs={"max_new_tokens": 64, "do_sample": False}, chunk_size=chunk_size,
                                     matmul_dtype=self.head_matmul_dtype)
        # the reference (kl_coef > 0) lives in the callback: not trained, not checkpointed, not exported (with LoRA:
        # the trained model with its adapters disabled)
        self.versions = PolicyVersionSwitch(policy, reference_model=self.reference_model() if kl_coef > 0 else None)
        self.val_sums = torch.nn.ModuleDict({k: SumMetric() for k in ("nll_sum", "num_tokens", "hits", "entropy_sum")})

    @property
    def reduction(self) -> Literal["token_mean", "sequence_mean"]:
        """The :func:`~lit_llm.objectives.sft.sft_loss` reduction of :attr:`normalization`."""
        return "token_mean" if self.normalization == "token" else "sequence_mean"

    @staticmethod
    def policy_inputs(mb: dict[str, Any]) -> TensorDict:
        """The log-prob version's input for a collated micro-batch (same tensors, no copy, no re-padding):
        ``tokens.full`` ``[B, T]`` long, ``masks.all_attention_mask`` and ``masks.all_assistant_mask`` ``[B, T]``
        bool (right-padded, as :func:`~lit_llm.data.datasets.collate` writes them); for a packed micro-batch
        (:func:`~lit_llm.data.packing.collate_packed`) ``B`` packs and their ``position_ids`` ``[B, T]`` (the
        log-prob version's packed layout: rows never attend to each other)."""
        ids = mb["input_ids"]
        entries = {("tokens", "full"): ids, ("masks", "all_attention_mask"): mb["attention_mask"].bool(),
                   ("masks", "all_assistant_mask"): mb["assistant_mask"]}
        if is_packed(mb):
            entries["position_ids"] = mb["position_ids"]
        return TensorDict(entries, batch_size=ids.shape[:1])

    @staticmethod
    def _rows(mb: dict[str, Any], packed: Tensor, fill: float | bool = 0) -> Tensor:
        """A packed micro-batch's ``[P, L]`` tensor in its rows' ``[N, T]`` layout (as returned for unpacked ones)."""
        return unpack_rows(packed, mb["unpack_index"], mb["row_lengths"], fill=fill) if is_packed(mb) else packed

    def head(self, mb: dict[str, Any]) -> tuple[TensorDict, Tensor]:
        """``(inputs, mask)`` of a micro-batch, built once per micro-batch and kept on it (under ``"policy_head"``):
        the log-prob version's input (:meth:`policy_inputs`) and the configured head's mask in that input's layout
        (``[B, T]`` bool; ``[P, L]`` packs for a packed micro-batch), the one definition of the head
        (:meth:`~lit_llm.policy.LLMWrapperBase.head_mask`, :mod:`lit_llm.policy.heads`) that both the step count
        (:meth:`step_denominator`) and the loss (:meth:`forward_stats`) read, without a forward pass."""
        kept = mb.get("policy_head")
        if kept is None:
            inputs = self.policy_inputs(mb)
            kept = (inputs, self.versions.log_prob_version.head_mask(inputs, self.loss))
            mb["policy_head"] = kept
        return kept

    def mask(self, mb: dict[str, Any]) -> Tensor:
        """``[N, T]`` bool loss mask of a micro-batch's ``N`` rows for the configured head (:meth:`head`); for a
        packed micro-batch, gathered back to the rows (:func:`~lit_llm.data.packing.unpack_rows`), so token and
        sequence counts are those of the same rows unpacked."""
        return self._rows(mb, self.head(mb)[1], False)

    def step_denominator(self, micro_batches: list[dict[str, Any]]) -> Tensor:
        """Trained tokens (``normalization="token"``) or sequences with >= 1 trained token, over the micro-batches."""
        return sum(sft_step_count(self.mask(mb), self.reduction) for mb in micro_batches)

    def forward_stats(self, mb: dict[str, Any], *, normalizer: Tensor | None,
                      reduction: str) -> tuple[Tensor, dict[str, Tensor]]:
        """Score one micro-batch with the log-prob version's masked distribution of the configured head (one backbone
        pass; log-probs, entropies and argmax hits from one pass of the chunked kernel over the masked positions):
        ``(loss, stats)`` with detached sums (``loss``, ``nll_sum``, ``num_tokens``, ``entropy_sum``, ``hits`` and
        ``kl`` with a reference)."""
        inputs, head_mask = self.head(mb)
        version = self.versions.log_prob_version
        get_head_dist = {"sft": version.get_sft_dist, "rlhf": version.get_rlhf_dist,
                         "generic": version.get_generic_dist}[self.loss]
        dist = get_head_dist(inputs, head_mask=head_mask)  # the head's mask as counted: not computed again
        log_probs, entropy, hits = dist.log_prob_and_entropy(dist.tokens, return_hits=True)  # hits: ~free
        mask = dist.mask
        ref = None
        if self.versions.reference_version is not None:
            with torch.no_grad():
                ref = self._rows(mb, self.versions.reference_version.get_dist(inputs, mask=mask).log_prob(dist.tokens))
        # packed micro-batch: back to the rows, so the loss and its counts are the unpacked batch's
        log_probs, entropy = self._rows(mb, log_probs), self._rows(mb, entropy)
        hits, mask = self._rows(mb, hits, False), self._rows(mb, mask, False)
        loss, metrics = sft_loss(log_probs, mask, normalizer=normalizer, reduction=reduction, ref_log_probs=ref,
                                 kl_coef=self.kl_coef)
        stats = {"loss": metrics["loss"], "nll_sum": metrics["nll_sum"], "num_tokens": metrics["num_tokens"],
                 "entropy_sum": (entropy.detach() * mask).sum().float(),
                 "hits": (hits & mask).sum().float() if self.token_accuracy else torch.zeros((), device=mask.device)}
        if "kl" in metrics:
            stats["kl"] = metrics["kl"]
        return loss, stats

    def micro_batch_loss(self, mb: dict[str, Any], normalizer: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``sft_loss`` of one micro-batch normalised by the step-level ``normalizer``; its stats also count the
        token slots that went through the model (``input_slots``: ``input_ids.numel()``, padding included)."""
        loss, stats = self.forward_stats(mb, normalizer=normalizer, reduction=self.reduction)
        stats["input_slots"] = torch.tensor(float(mb["input_ids"].numel()), device=loss.device)
        return loss, stats

    def _log_step(self, totals: dict[str, Tensor], grad_norm: Tensor, opt: Any) -> None:
        """:meth:`PolicyModule._log_step`, plus ``train/pad_fraction``: padding positions over all positions that went
        through the model in the step (all micro-batches, all ranks; 0 = no padding)."""
        slots = totals.pop("input_slots", None)
        super()._log_step(totals, grad_norm, opt)
        if slots is not None and "real_tokens" in totals:
            real, slots = self._all_sum(torch.stack([totals["real_tokens"].float(), slots.float()])).unbind()
            self.log("train/pad_fraction", 1 - real / slots.clamp(min=1), on_step=True, on_epoch=False,
                     batch_size=1)

    # ------------------------------------------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Accumulate the NLL sum, token count, argmax hits and entropy sum of the validation set."""
        _, stats = self.forward_stats(batch, normalizer=None, reduction="token_mean")
        for k, metric in self.val_sums.items():
            metric.update(stats[k])

    def on_validation_epoch_end(self) -> None:
        """Log ``val/loss`` (token-mean NLL of the whole validation set), ``val/ppl``, ``val/token_accuracy``,
        ``val/entropy``."""
        sums = {k: m.compute() for k, m in self.val_sums.items()}
        for m in self.val_sums.values():
            m.reset()
        n = sums["num_tokens"].clamp(min=1)
        nll = sums["nll_sum"] / n
        self.log_dict({"val/loss": nll, "val/ppl": torch.exp(nll), "val/token_accuracy": sums["hits"] / n,
                       "val/entropy": sums["entropy_sum"] / n, "val/tokens": sums["num_tokens"],
                       "step": float(self.eval_step)},  # x value: the checkpoint's step in validate
                      prog_bar=False, batch_size=1, sync_dist=False)
