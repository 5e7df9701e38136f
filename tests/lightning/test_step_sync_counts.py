"""Host syncs of a training step and of a rollout, counted on CPU tensors (issue 28; tests/sync_counter.py says what
counts): the losses (``lit_llm/objectives``) read nothing per micro-batch, :class:`PolicyModule.training_step` reads
one flag tensor per step, the log-prob path one ``nonzero`` per kernel call (exact counts per micro-batch below), a
rollout copies its rows to the host once, not once per row. Also: the value checks of the losses and of the log-prob
path, deferred to that one read inside a step, raise the same error as outside one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from lightning.pytorch import Trainer
from sync_counter import SyncCounter, count_syncs
from tensordict import TensorDict

from lit_llm.lightning import module as module_mod
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.objectives import deferred_checks, sft_loss
from lit_llm.objectives.reduction import resolve_normalizer
from lit_llm.policy.logprobs import chunked_token_log_probs, completion_log_probs, model_token_log_probs
from lit_llm.policy.masked_dist import ChunkedLLMMaskedCategorical
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rewards import RewardFunctions
from lit_llm.rollouts import RolloutEngine

pytestmark = pytest.mark.usefixtures("one_thread")

#: The one read of a step: the all-reduced flags (non-finite loss, non-finite gradient norm, failed input check).
STEP_READS = {("tolist", "module.py:training_step"): 1}
OWN = ("objectives", "module.py")  # lit_llm/objectives/*.py and lightning/module.py: exact counts
OBJECTIVES = {"sft.py", "grpo.py", "reduction.py", "correction.py", "loss_types.py", "advantages.py"}
#: What is left per micro-batch (policy and reference versions; for SFT also the step count's mask), measured, exact:
#: one ``nonzero`` per kernel call (the scored positions: its size is data-dependent, so it is the kernel's one host
#: sync; before, 2 reads and that ``nonzero`` when a target was ignored) and ``.to(device)`` calls, which the counter
#: counts whenever a device is passed: no-ops in training, where the micro-batch is already on the model's device
#: (Lightning moves SFT batches, ``GRPOModule.micro_batches`` moves rollouts); they copy only when a caller hands host
#: tensors to a model on a GPU. The value checks of the log-prob path (kernel targets, masked-distribution ids,
#: attention-mask holes and 0/1 values, dense ids, the GRPO layout's masks and prompt index) are deferred to the
#: step's one read, GRPO's ratio ranges stay on the device (before: SFT 26 per micro-batch with 11 check reads, GRPO
#: 38 with 16 check reads and 8 reads of GRPOStepStats.add).
PER_MICRO_BATCH = {
    "sft": {("nonzero", "kernel.py:chunked_token_log_probs"): 2, ("to_device", "inputs.py:_dense_full"): 9,
            ("to_device", "dists.py:_explicit_mask"): 2, ("to_device", "masked_dist.py:_score"): 2},
    "grpo": {("nonzero", "kernel.py:chunked_token_log_probs"): 2, ("to_device", "dists.py:<dictcomp>"): 10,
             ("to_device", "dists.py:_explicit_mask"): 2, ("to_device", "masked_dist.py:_score"): 2},
}


def elsewhere(counter: SyncCounter) -> dict:
    """The counted sites outside the losses and the module (``OWN``)."""
    return {k: n for k, n in counter.sites.items() if k[1].split(":")[0] not in OBJECTIVES | {"module.py"}}


def times(sites: dict, n: int) -> dict:
    return {k: v * n for k, v in sites.items()}


def own_sites(counter: SyncCounter) -> dict:
    return {k: n for k, n in counter.sites.items() if k[1].split(":")[0] in OBJECTIVES | {"module.py"}}


def counted_step(monkeypatch) -> list[SyncCounter]:
    """Count each ``training_step`` separately (the rollout of GRPO runs before it, in the callback)."""
    counters: list[SyncCounter] = []
    real = module_mod.PolicyModule.training_step

    def step(self, batch, batch_idx):
        counters.append(SyncCounter())
        with counters[-1]:
            return real(self, batch, batch_idx)

    monkeypatch.setattr(module_mod.PolicyModule, "training_step", step)
    return counters


def fit(module, dm) -> None:
    Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0).fit(module, dm)


@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_sft_step_reads_once_whatever_the_micro_batches(monkeypatch, micro_batch_size):
    """4 samples as 2 or 4 micro-batches, with a KL reference: the same single read per step in the losses' and the
    module's code (before: per micro-batch 1 ``float`` of the loss, 4 reads of the normalizer checks, 1 ``item`` of
    the token count; per step 2 ``float`` and 1 ``item``, and 3 ``float`` in the metrics)."""
    counters = counted_step(monkeypatch)
    dm = SFTDataModule(format="arithmetic", num_samples=4, batch_size=4, micro_batch_size=micro_batch_size,
                       max_length=48, val_limit=1, tokenizer="tiny")
    fit(SFTModule("tiny", kl_coef=0.1), dm)
    (counter,) = counters
    assert own_sites(counter) == STEP_READS
    assert elsewhere(counter) == times(PER_MICRO_BATCH["sft"], 4 // micro_batch_size)


def frac_reward(prompts, completions, completion_ids, **kwargs):
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


@pytest.mark.parametrize("micro_batch_size", [8, 4])
def test_grpo_step_reads_once_whatever_the_micro_batches(monkeypatch, micro_batch_size):
    """2 prompts x 4 generations as 1 or 2 micro-batches, with a KL reference and the mismatch metrics: one read per
    step in the objective's and the module's code (before: per micro-batch 1 ``item`` (empty mask), 2 boolean
    indexings (ratio min/max) + 1 in the mismatch metrics, 1 ``bool`` (finite advantages), 4 in the normalizer checks,
    1 ``float`` of the loss)."""
    counters = counted_step(monkeypatch)
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=4, max_new_tokens=4,
                        micro_batch_size=micro_batch_size, beta=0.1, log_samples_every=0, rollout_seed=1)
    fit(module, GRPODataModule(batch_size=2, num_train=8, num_eval=0))
    (counter,) = counters
    assert own_sites(counter) == STEP_READS
    assert elsewhere(counter) == times(PER_MICRO_BATCH["grpo"], 8 // micro_batch_size)


def rollout_sites(tiny, tokenizer, n_prompts: int, g: int) -> dict:
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens",
                                 generate_kwargs={"max_new_tokens": 4, "temperature": 1.0})
    engine = RolloutEngine(policy, tokenizer=tokenizer, reward_fn=RewardFunctions([frac_reward]), num_generations=g,
                           seed=0, batching=False)
    with count_syncs() as counter:
        engine.rollout({"prompt": [f"Say {i}" for i in range(n_prompts)]}, step=0)
    return {k: n for k, n in counter.sites.items() if k[1].split(":")[0] in {"engine.py", "batch.py"}}


def test_rollout_reads_per_rollout_not_per_row(tiny, tokenizer):
    """4 and 12 rows give the same reads in the rollout engine and RolloutBatch: the rows' ids and log-probs reach the
    host in one copy per dtype (before: one ``.cpu()`` per row and one ``tolist`` per row twice, for the text and
    for the reward functions, plus one per prompt for the distinct prompts). What is left: the decoded ids and the
    distinct prompts as lists (``host_lists``, one read each), the truncation flags (one per policy call), the
    statistic ``frac_reward_zero_std`` and the prompt-index range check of ``from_rows`` (host tensors)."""
    small, large = rollout_sites(tiny, tokenizer, 2, 2), rollout_sites(tiny, tokenizer, 3, 4)
    assert small == large == {("tolist", "batch.py:host_lists"): 2, ("tolist", "engine.py:policy_responses"): 1,
                              ("float", "engine.py:rollout"): 1, ("int", "batch.py:from_rows"): 2}


# ------------------------------------------------------------------------------------------------ deferred checks
SMALLER = ("normalizer=2 is smaller than this micro-batch's own count 5; it must count the whole optimizer step "
           "(all micro-batches, all ranks) after every mask (incl. truncation masking).")


def test_deferred_checks_raise_the_same_error_when_verified():
    local = torch.tensor(5)
    with pytest.raises(ValueError) as direct:
        resolve_normalizer(local, torch.tensor(2.0), name="normalizer")
    assert str(direct.value) == SMALLER
    with deferred_checks() as checks:
        resolve_normalizer(local, torch.tensor(2.0), name="normalizer")  # recorded, not raised
        resolve_normalizer(local, torch.tensor(7.0), name="normalizer")
    assert bool(checks.failed())
    with pytest.raises(ValueError) as deferred:
        checks.verify()
    assert str(deferred.value) == SMALLER
    with deferred_checks() as checks:
        resolve_normalizer(local, float("nan"), name="normalizer")
        sft_loss(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool), normalizer=None)
    with pytest.raises(ValueError, match=r"^normalizer must be a finite non-negative scalar count, got nan\.$"):
        checks.verify()
    with deferred_checks() as checks:
        pass
    assert checks.failed() is None
    checks.verify()  # nothing checked: nothing raised


def test_failed_loss_check_in_a_step_raises_and_keeps_the_weights(monkeypatch):
    """A step count below a micro-batch's own count (the count taken before a mask) fails inside the step: the
    error is the loss's own, raised after the step's one read, before the optimizer step."""
    module = SFTModule("tiny")
    monkeypatch.setattr(module, "step_denominator", lambda mbs: torch.tensor(1))
    before = [p.detach().clone() for p in module.model.parameters()]
    dm = SFTDataModule(format="arithmetic", num_samples=4, batch_size=4, micro_batch_size=2, max_length=48,
                       val_limit=1, tokenizer="tiny")
    with pytest.raises(ValueError, match=r"^normalizer=1 is smaller than this micro-batch's own count \d+; it must "
                                         r"count the whole optimizer step"):
        fit(module, dm)
    assert all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))
    assert all(p.grad is None for p in module.model.parameters())


def policy_check_cases(tiny, tokenizer) -> dict[str, Callable[[], object]]:
    """Calls of the log-prob path with one bad input each (its value check deferred inside a step)."""
    h, w = torch.randn(1, 3, 4), torch.randn(5, 4)
    ids = torch.randint(5, 2000, (2, 5), generator=torch.Generator().manual_seed(0))
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    prompts, pmask = ids[:, :3], torch.ones(2, 3, dtype=torch.bool)
    policy = TransformersWrapper(tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)

    def dist_of(full, attn):
        return policy.get_generic_dist(TensorDict({"tokens": {"full": full}, "masks": {"all_attention_mask": attn}},
                                                  batch_size=[2]))

    vocab = tiny.get_input_embeddings().num_embeddings
    return {
        "kernel": lambda: chunked_token_log_probs(h, w, torch.tensor([[0, 5, 1]])),
        "masked_dist": lambda: ChunkedLLMMaskedCategorical(h, w, torch.ones(1, 3, dtype=torch.bool)).log_prob(
            torch.tensor([[0, 7, 1]])),
        "mask_holes": lambda: model_token_log_probs(tiny, ids, holes),
        "prompt_index": lambda: completion_log_probs(tiny, prompts, pmask, ids[:, 3:], torch.ones(2, 2, dtype=bool),
                                                     torch.tensor([0, 2])),
        "completion_mask": lambda: completion_log_probs(tiny, prompts, pmask, ids[:, 3:],
                                                        torch.tensor([[0, 1], [1, 1]]), torch.tensor([0, 1])),
        "dense_ids": lambda: dist_of(ids.masked_fill(holes == 0, vocab), torch.ones_like(ids)),
        "attention_values": lambda: dist_of(ids, torch.full_like(ids, 2)),
    }


@pytest.mark.parametrize("case", ["kernel", "masked_dist", "mask_holes", "prompt_index", "completion_mask",
                                  "dense_ids", "attention_values"])
def test_log_prob_path_checks_deferred_in_a_step_raise_the_same_error(tiny, tokenizer, case):
    """The log-prob path's value checks (kernel targets, masked-distribution ids, attention-mask holes, the GRPO
    layout's prompt index and completion mask, dense ids outside the vocabulary, a non-0/1 attention mask): outside a
    step raised at once; inside ``deferred_checks`` the call finishes (its bad values made safe, no index error) and
    the step's verify raises the same error."""
    call = policy_check_cases(tiny, tokenizer)[case]
    with pytest.raises(ValueError) as eager:
        call()
    with torch.no_grad(), deferred_checks() as checks:
        call()
    with pytest.raises(ValueError) as deferred:
        checks.verify()
    assert str(deferred.value) == str(eager.value)
