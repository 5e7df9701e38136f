"""The modules' losses run through the log-prob version's masked distributions; values and gradients equal the
kernel-function path they replaced (``model_token_log_probs`` / ``completion_log_probs`` + the objective functions
with the per-head / per-``loss_type`` step counts written out here), in fp32 to 1e-6, for every head and loss type."""

from __future__ import annotations

import json

import pytest
import torch

from lit_llm.data.datasets import collate, read_examples, tokenize_example
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.objectives.grpo import effective_completion_mask, grpo_loss
from lit_llm.objectives.sft import loss_mask, sft_loss
from lit_llm.policy.logprobs import completion_log_probs, model_token_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"},
                  {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, of course."}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]},
    {"messages": [{"role": "user", "content": "Count to five."},
                  {"role": "assistant", "content": "one two three four five"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sea?"},
                  {"role": "assistant", "content": "Wide and blue."}]},
]


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def assert_same_grads(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


def check_module_path(module, mbs, old_losses, old_grads, kl_key: str, with_kl: bool) -> None:
    """The module's own step (step count, then each micro-batch's loss through the log-prob version's distribution)
    gives the same losses and accumulated gradients as the kernel path."""
    new = []
    for mb in mbs:
        loss, stats = module.micro_batch_loss(mb, module.step_denominator(mbs).float())
        loss.backward()
        new.append(loss.detach())
        assert (kl_key in stats) == with_kl
    torch.testing.assert_close(torch.stack(new), torch.stack(old_losses), rtol=1e-6, atol=1e-6)
    assert_same_grads(grads(module.model), old_grads)


@pytest.fixture
def sft_micro_batches(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    samples = [tokenize_example(e, tokenizer) for e in read_examples(path)]
    pad = tokenizer.pad_token_id
    return [collate(samples[:2], pad_token_id=pad), collate(samples[2:], pad_token_id=pad)]


@pytest.mark.parametrize("head", ["sft", "rlhf", "generic"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_sft_heads_equal_the_kernel_path(sft_micro_batches, head, normalization, kl_coef):
    torch.manual_seed(0)
    module = SFTModule("tiny", loss=head, normalization=normalization, kl_coef=kl_coef)
    model = module.model
    if kl_coef:  # make the reference differ from the policy, so the KL term is not 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    reduction = "token_mean" if normalization == "token" else "sequence_mean"
    mbs = sft_micro_batches
    masks = [loss_mask(head, attention_mask=mb["attention_mask"], assistant_mask=mb["assistant_mask"],
                       response_mask=mb["response_mask"]) for mb in mbs]
    for mb, m in zip(mbs, masks):  # the distribution's head mask is the data's mask
        assert torch.equal(module.mask(mb), m)
    count = sum(m.sum() if normalization == "token" else (m.sum(-1) > 0).sum() for m in masks)
    assert int(module.step_denominator(mbs)) == int(count)

    old = []
    for mb, m in zip(mbs, masks):
        lp = model_token_log_probs(model, mb["input_ids"], mb["attention_mask"])
        ref = None
        if kl_coef:
            with torch.no_grad():
                ref = model_token_log_probs(module.versions.reference_version.model, mb["input_ids"],
                                            mb["attention_mask"])
        loss, _ = sft_loss(lp, m, normalizer=count.float(), reduction=reduction, ref_log_probs=ref, kl_coef=kl_coef)
        loss.backward()
        old.append(loss.detach())
    old_grads = grads(model)
    check_module_path(module, mbs, old, old_grads, "kl", bool(kl_coef))


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_grpo_loss_types_equal_the_kernel_path(loss_type, mask_truncated, beta, share_prompts):
    module = GRPOModule("tiny", reward_funcs=[lambda completion_ids, **kw: [float(len(c)) for c in completion_ids]],
                        num_generations=4, max_new_tokens=5, loss_type=loss_type, beta=beta, temperature=0.8,
                        mask_truncated_completions=mask_truncated, share_prompts=share_prompts, micro_batch_size=5,
                        rollout_seed=7)
    model = module.model
    rollout = module.versions.rollout({"prompt": ["What is 1 + 1?", "Hello", "Say hi"]}, step=0)
    rollout.truncated = torch.arange(rollout.num_rows) % 3 == 0  # a fixed batch with both kinds of rows
    rollout.advantage = torch.linspace(-1.0, 1.0, rollout.num_rows)
    if beta:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    mbs = module.micro_batches(rollout)
    module.stats.reset(len(mbs))
    # the step count each loss type states, written out
    if loss_type in ("grpo", "dr_grpo"):
        count = torch.tensor(float(rollout.num_rows))
    else:
        count = sum(effective_completion_mask(mb.completion_mask, mb.truncated, mask_truncated).sum()
                    for mb in mbs).float()
    assert float(module.step_denominator(mbs)) == float(count)

    old = []
    for mb in mbs:
        args = (mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, mb.prompt_index)
        lp, ent = completion_log_probs(model, *args, share_prompts=share_prompts, temperature=0.8,
                                       return_entropy=True)
        ref = None
        if beta:
            with torch.no_grad():
                ref = completion_log_probs(module.versions.reference_version.model, *args,
                                           share_prompts=share_prompts, temperature=0.8)
        counts = {"dapo": {"num_items_in_batch": count}, "bnpo": {}, "grpo": {"num_sequences_in_batch": count},
                  "dr_grpo": {"num_sequences_in_batch": count}}[loss_type]
        loss, _ = grpo_loss(lp, mb.old_log_probs, mb.advantage, mb.completion_mask, loss_type=loss_type, epsilon=0.2,
                            beta=beta, ref_log_probs=ref, entropy=ent.detach(), truncated=mb.truncated,
                            mask_truncated_completions=mask_truncated, max_completion_length=5, **counts)
        if loss_type == "bnpo":
            loss = loss / len(mbs)
        loss.backward()
        old.append(loss.detach())
    old_grads = grads(model)
    check_module_path(module, mbs, old, old_grads, "kl_sum", bool(beta))
