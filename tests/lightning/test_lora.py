"""LoRA through peft (``use_peft``): only the adapters train, generation and the log-prob kernel run the adapted model,
the KL reference is the same model with its adapters disabled, the kernel equals a naive computation from the
PeftModel's logits, async rollouts sync the adapters only."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.models import ModelConfig, tiny_model
from lit_llm.policy.logprobs import model_token_log_probs, token_hidden_states

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"prompt": "Name a colour.", "completion": "Blue"},
    {"prompt": "Count to five.", "completion": "one two three four five"},
    {"prompt": "Say yes.", "completion": "yes indeed"},
    {"prompt": "Describe the sea.", "completion": "The sea is wide, deep and blue."},
]


def frac_reward(prompts, completions, completion_ids, **kwargs):
    """Fraction of completion ids divisible by 8."""
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


def naive_log_probs(model, ids, attn):
    """``[B, T]`` log p(x_t | x_<t) from the model's own full logits (right padding), 0 at t = 0."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(lp.shape[0], 1), lp], 1) * attn * torch.cat(
        [torch.zeros(attn.shape[0], 1, dtype=attn.dtype), attn[:, :-1]], 1)


def randomize_adapters(model, seed: int = 0) -> None:
    """Give the LoRA B matrices (zero at init) random values, so the adapted model differs from its base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def lora_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def trainer(steps: int, **kw) -> Trainer:
    base = dict(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    return Trainer(**{**base, **kw})


def grpo_module(**kw) -> GRPOModule:
    args = dict(reward_funcs=[frac_reward], num_generations=4, max_new_tokens=4, micro_batch_size=8,
                log_samples_every=0, use_peft=True, lora_r=4, optimizer=lambda p: torch.optim.AdamW(p, lr=5e-2))
    return GRPOModule("tiny", **{**args, **kw})


# ------------------------------------------------------------------------------------------------ options
def test_lora_options_are_checked():
    for kwargs, match in (({"lora_r": 0}, "lora_r"), ({"lora_alpha": 1.5}, "lora_alpha"),
                          ({"lora_dropout": 1.0}, "lora_dropout"), ({"lora_target_modules": []}, "lora_target_modules"),
                          ({"use_peft": "yes"}, "use_peft")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**kwargs)
    with pytest.raises(ValueError, match=r"lm_head.*output head.*all-linear"):
        ModelConfig(use_peft=True, lora_target_modules=["q_proj", "lm_head"])



def test_kernel_refuses_an_adapter_on_the_output_head(tokenizer):
    """peft itself can put LoRA on the head (e.g. a regex target); the kernel would read the bare weight: refused."""
    from peft import LoraConfig, get_peft_model

    from lit_llm.policy.logprobs import lm_head

    peft_model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match=r"output head carries a peft adapter.*lora_target_modules"):
        lm_head(peft_model)


def test_lora_module_wraps_only_the_targets():
    module = SFTModule("tiny", use_peft=True, lora_r=8, lora_alpha=16, lora_target_modules=["q_proj", "o_proj"])
    names = lora_names(module.model)
    # 2 layers x 2 targets x (A, B); nothing else trains
    assert len(names) == 8 and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"q_proj", "o_proj"}
    a = next(p for n, p in module.model.named_parameters() if "q_proj.lora_A" in n)
    assert a.shape == (8, 64)  # [r, in]
    assert module.hparams["use_peft"] is True and module.hparams["lora_target_modules"] == ["q_proj", "o_proj"]
    default = SFTModule("tiny", use_peft=True)  # peft's default targets for Llama: q_proj, v_proj
    assert {n.split(".")[-4] for n in lora_names(default.model)} == {"q_proj", "v_proj"}


# ------------------------------------------------------------------------------------------------ training
def test_lora_sft_trains_only_the_adapters(tmp_path, tokenizer):
    import json

    from lit_llm.lightning.datamodules import SFTDataModule

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    module = SFTModule("tiny", use_peft=True, lora_r=4, optimizer=partial(torch.optim.AdamW, lr=1e-2))
    base_before = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    dm = SFTDataModule(str(path), batch_size=4, micro_batch_size=2)
    t = trainer(2)
    t.fit(module, dm)
    params = dict(module.model.named_parameters())
    for n, before in base_before.items():
        assert torch.equal(params[n], before) and params[n].grad is None, n
    assert any(not torch.equal(params[n], before) for n, before in lora_before.items())
    # the optimizer holds state for the adapters only
    state = t.optimizers[0].state
    assert len(state) == len(lora_before) and all(p.requires_grad for p in state)


def test_lora_grpo_trains_adapters_and_generation_uses_them(tokenizer):
    module = grpo_module()
    base_before = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    prompts = [torch.tensor(tokenizer("What is 2 + 3?")["input_ids"])]
    gen = module.versions.generate_version
    before = gen.get_new_version(generate_kwargs={"max_new_tokens": 6, "do_sample": False}, batching=False)
    t = trainer(3)
    t.fit(module, GRPODataModule(batch_size=2, num_train=50, num_eval=0))
    assert module.global_step == 3 and math.isfinite(float(t.callback_metrics["train/loss"]))
    params = dict(module.model.named_parameters())
    for n, b in base_before.items():
        assert torch.equal(params[n], b) and params[n].grad is None, n
    # the generate version's log-probs are the adapted model's teacher-forced ones, not the base's
    from tensordict import TensorDict, lazy_stack

    module.model.eval()
    with torch.no_grad():
        out = before(lazy_stack([TensorDict({("tokens", "prompt"): prompts[0]}, batch_size=[])]))
        full = out["tokens", "full"][0][None]
        resp_lp = out["log_probs", "response"][0]
        attn = torch.ones_like(full)
        adapted = naive_log_probs(module.model, full, attn)[0, -resp_lp.numel():]
        with module.model.disable_adapter():
            base = naive_log_probs(module.model, full, attn)[0, -resp_lp.numel():]
    torch.testing.assert_close(resp_lp, adapted, rtol=1e-5, atol=1e-5)
    assert (resp_lp - base).abs().max() > 1e-3


def test_lora_reference_is_the_base_with_adapters_disabled(tokenizer):
    module = grpo_module(beta=0.1)
    ref = module.versions.reference_version
    assert ref.model is module.model and ref.disable_adapter  # no second copy of the weights
    randomize_adapters(module.model)
    module.model.eval()  # no LoRA dropout, so the adapted numbers repeat
    ids = torch.tensor([tokenizer("Hello there, how are you today?")["input_ids"]])
    attn = torch.ones_like(ids)
    fresh = tiny_model(tokenizer)  # the base model: same seed, no adapters
    with torch.no_grad():
        expected = naive_log_probs(fresh, ids, attn)
        adapted = naive_log_probs(module.model, ids, attn)
        td = {("tokens", "full"): ids, ("masks", "all_attention_mask"): attn.bool()}
        from tensordict import TensorDict

        got = ref.get_dist(TensorDict(td, batch_size=[1])).log_prob(ids)
    assert (expected - adapted).abs().max() > 1e-2  # the adapters change the model...
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=1e-5, atol=1e-5)  # ...the reference ignores them
    # and the adapters are enabled again afterwards
    with torch.no_grad():
        torch.testing.assert_close(naive_log_probs(module.model, ids, attn), adapted)


def test_lora_grpo_kl_starts_at_zero_and_grows():
    module = grpo_module(beta=0.1)
    seen: list[float] = []

    from lightning.pytorch import Callback

    class Rec(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["train/kl"]))

    trainer(3, callbacks=[Rec()]).fit(module, GRPODataModule(batch_size=2, num_train=50, num_eval=0))
    assert abs(seen[0]) < 1e-7 and seen[-1] > 1e-6, seen  # B = 0 at init: adapted == base at step 0


# ------------------------------------------------------------------------------------------------ kernel
def test_kernel_log_probs_through_a_peft_model_equal_naive_logits(tokenizer):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    randomize_adapters(peft_model, seed=1)
    rows = [tokenizer(t)["input_ids"] for t in ("The cat sat on the mat.", "Hi!")]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        hidden = token_hidden_states(peft_model, ids, attn)
        got = model_token_log_probs(peft_model, ids, attn, chunk_size=3)
        expected = naive_log_probs(peft_model, ids, attn)
    assert hidden.shape == (2, width, 64)  # hidden states, not [B, T, V] logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ async
def test_async_lora_syncs_adapter_weights_only(tokenizer):
    from lit_llm.rollouts import AsyncRollouts

    module = grpo_module()
    policy = module.versions.generate_version
    producer = AsyncRollouts.from_policy(policy, [], tokenizer=tokenizer, reward_fn=module.rewards,
                                         num_generations=4)
    randomize_adapters(module.model)
    producer.sync_weights(module.model, 3, trainable_only=True)
    staged, version, strict = producer._staged
    assert set(staged) == lora_names(module.model) and version == 3 and strict is False
    producer.engine.load_weights(staged, version, strict=strict)
    copy = dict(producer.engine.model.named_parameters())
    for n, p in module.model.named_parameters():
        assert torch.equal(copy[n], p) and copy[n] is not p, n
    with pytest.raises(RuntimeError, match="has no"):
        producer.engine.load_weights({"nope.weight": torch.zeros(1)}, 4, strict=False)


def test_async_lora_grpo_runs():
    module = grpo_module(rollout_mode="async", max_staleness=2)
    trainer(3).fit(module, GRPODataModule(batch_size=2, num_train=50, num_eval=0))
    assert module.global_step == 3 and module.versions.num_syncs == 3
    producer = module.versions.async_rollouts
    assert producer.engine.model is not module.model


def test_lora_with_gradient_checkpointing_gives_adapter_gradients(tokenizer, tmp_path):
    """Frozen embeddings + checkpointed blocks: the adapters still get the gradients of the plain run."""
    import json

    from lit_llm.data.datasets import collate, read_examples, tokenize_example

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    samples = [tokenize_example(e, tokenizer) for e in read_examples(path)]
    batch = collate(samples, pad_token_id=tokenizer.pad_token_id)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same lora_A initialisation
        module = SFTModule("tiny", use_peft=True, lora_r=4, lora_dropout=0.0, gradient_checkpointing=checkpointing)
        randomize_adapters(module.model)
        loss, _ = module.micro_batch_loss(batch, module.step_denominator([batch]))
        loss.backward()
        grads.append({n: p.grad for n, p in module.model.named_parameters() if p.requires_grad})
        assert all(p.grad is None for p in module.model.parameters() if not p.requires_grad)
    assert all(g is not None and g.abs().sum() > 0 for g in grads[1].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6)
