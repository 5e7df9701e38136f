"""SFTModule: loss values per head against a hand computation, step normalisation across micro-batches, the
non-finite guard, token accuracy, KL to the reference."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer

from lit_llm.data.datasets import collate, read_examples, tokenize_example
from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.objectives.sft import NonFiniteLossError

ROWS = [
    {"prompt": "Name a colour.", "completion": "Blue"},
    {"prompt": "Count to five.", "completion": "one two three four five, and then six seven eight nine ten"},
    {"prompt": "Say yes.", "completion": "yes indeed"},
    {"prompt": "Describe the sea.", "completion": "The sea is wide, deep, salty and blue, with waves and tides."},
]


@pytest.fixture
def rows_path(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def batch(rows_path, tokenizer):
    examples = read_examples(rows_path)
    samples = [tokenize_example(e, tokenizer) for e in examples[:2]]
    return collate(samples, pad_token_id=tokenizer.pad_token_id)


def naive_token_log_probs(model, input_ids, attention_mask):
    """``[B, T]`` log p(x_t | x_<t) from full logits (right padding: default positions are right)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(lp.shape[0], 1), lp], 1)


@pytest.mark.parametrize("head", ["sft", "rlhf", "generic"])
def test_head_loss_matches_hand_computation(batch, head):
    module = SFTModule("tiny", loss=head)
    attn = batch["attention_mask"].bool()
    if head == "sft":
        mask = batch["response_mask"].clone()
    elif head == "rlhf":
        mask = batch["assistant_mask"].clone()
    else:
        mask = attn.clone()
        mask[:, 0] = False  # the first token has no prediction
    assert mask.sum() > 0
    with torch.no_grad():
        lp = naive_token_log_probs(module.model, batch["input_ids"], batch["attention_mask"])
        expected = -(lp * mask).sum() / mask.sum()
        denom = module.step_denominator([batch])
        loss, stats = module.micro_batch_loss(batch, denom)
    assert int(denom) == int(mask.sum())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert int(stats["num_tokens"]) == int(mask.sum())


@pytest.mark.parametrize("head", ["sft", "rlhf", "generic"])
def test_head_mask_is_built_once_per_micro_batch(batch, head, monkeypatch):
    """The step count and the loss read one head mask per micro-batch (SFTModule.head): the head's rule
    (MaskedDistributionsMixin._head_mask) runs once, and get_<head>_dist with that mask is get_<head>_dist."""
    from lit_llm.policy.dists import MaskedDistributionsMixin

    module = SFTModule("tiny", loss=head)
    version = module.versions.log_prob_version
    with torch.no_grad():
        expected = getattr(version, f"get_{head}_dist")(module.policy_inputs(batch))
        calls = []
        real = MaskedDistributionsMixin._head_mask
        monkeypatch.setattr(MaskedDistributionsMixin, "_head_mask",
                            lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
        loss, _ = module.micro_batch_loss(batch, module.step_denominator([batch]))
    assert len(calls) == 1
    inputs, mask = module.head(batch)
    assert torch.equal(mask, expected.mask)
    with torch.no_grad():
        lp = expected.log_prob(expected.tokens)
    torch.testing.assert_close(loss, -lp.sum() / mask.sum(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="head_mask .* cannot be combined"):
        key = {"sft": "prompt_mask_key", "rlhf": "assistant_mask_key", "generic": "attention_mask_key"}[head]
        getattr(version, f"get_{head}_dist")(inputs, head_mask=mask, **{key: "x"})


def test_sft_and_rlhf_differ_only_on_multi_turn(batch):
    assert torch.equal(batch["response_mask"], batch["assistant_mask"])  # single-turn rows: same tokens


def fit_one_step(rows_path, tokenizer, *, micro: int, normalization: str = "token", **module_kw):
    torch.manual_seed(0)
    module = SFTModule("tiny", normalization=normalization, optimizer=partial(torch.optim.SGD, lr=1.0),
                       grad_clip=None, token_accuracy=False, **module_kw)
    dm = SFTDataModule(str(rows_path), batch_size=4, micro_batch_size=micro)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1)
    trainer.fit(module, dm)
    return module, dm


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_two_micro_batches_equal_one_batch(rows_path, tokenizer, normalization):
    """Property 6: one step of 2 micro-batches with different token counts == the same step as one batch."""
    one, dm = fit_one_step(rows_path, tokenizer, micro=4, normalization=normalization)
    two, dm2 = fit_one_step(rows_path, tokenizer, micro=2, normalization=normalization)
    assert [len(next(iter(d.train_dataloader()))["micro_batches"]) for d in (dm, dm2)] == [1, 2]
    counts = [int(one.mask(mb).sum()) for mb in next(iter(dm2.train_dataloader()))["micro_batches"]]
    assert counts[0] != counts[1]  # the two micro-batches carry different token counts
    moved = 0.0
    for (name, p1), p2 in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=2e-6, msg=name)
    from lit_llm.models import tiny_model

    fresh = tiny_model(tokenizer)
    for p1, p0 in zip(one.model.parameters(), fresh.parameters()):
        moved = max(moved, float((p1 - p0).abs().max()))
    assert moved > 1e-3  # the step did change the weights


def test_mean_of_micro_batch_means_would_differ(rows_path, tokenizer):
    """Guard for the test above: with these rows the naive mean of per-micro-batch means is a different number."""
    module = SFTModule("tiny", token_accuracy=False)
    samples = [tokenize_example(e, tokenizer) for e in read_examples(rows_path)]
    full = collate(samples, pad_token_id=0)
    halves = [collate(samples[i:i + 2], pad_token_id=0) for i in (0, 2)]
    with torch.no_grad():
        whole, _ = module.micro_batch_loss(full, module.step_denominator([full]))
        split = sum(module.micro_batch_loss(h, module.step_denominator(halves))[0] for h in halves)
        naive = sum(module.micro_batch_loss(h, module.step_denominator([h]))[0] for h in halves) / 2
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert abs(float(naive) - float(whole)) > 1e-3


def nan_loss(module):
    original = module.micro_batch_loss

    def patched(mb, normalizer):
        loss, stats = original(mb, normalizer)
        return loss * float("nan"), stats

    module.micro_batch_loss = patched


def test_nonfinite_loss_raises_with_step_and_ids(rows_path, tokenizer):
    module = SFTModule("tiny", token_accuracy=False)
    nan_loss(module)
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(NonFiniteLossError, match=r"at step 0 for the batch with sample ids \[.*rows\.jsonl:\d"):
        trainer.fit(module, dm)


def test_nonfinite_loss_skip_keeps_weights(rows_path, tokenizer):
    module = SFTModule("tiny", token_accuracy=False, on_nonfinite="skip")
    before = [p.detach().clone() for p in module.model.parameters()]
    nan_loss(module)
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, dm)
    assert int(module.skipped_steps) == 2 and trainer.global_step == 0
    for p0, p1 in zip(before, module.model.parameters()):
        assert torch.equal(p0, p1)


def test_trainer_accumulation_is_rejected(rows_path, tokenizer):
    module = SFTModule("tiny")
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, accumulate_grad_batches=2,
                      enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(Exception, match=r"accumulate_grad_batches|micro_batch_size"):
        trainer.fit(module, dm)


@pytest.mark.parametrize("head", ["sft", "rlhf", "generic"])
def test_token_accuracy_hits_match_full_logits(batch, head):
    """Argmax hits come from the log-prob kernel's chunks (no second LM-head pass) and equal full-logit argmaxes."""
    module = SFTModule("tiny", loss=head, chunk_size=3)
    mask = module.mask(batch)
    with torch.no_grad():
        logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        _, stats = module.forward_stats(batch, normalizer=None, reduction="token_mean")
    pred = logits[:, :-1].argmax(-1)
    expected = ((pred == batch["input_ids"][:, 1:]) & mask[:, 1:]).sum()
    assert int(stats["hits"]) == int(expected) and int(stats["num_tokens"]) == int(mask.sum())


def test_kl_to_reference_is_zero_at_start(batch):
    module = SFTModule("tiny", kl_coef=0.5)
    reference = module.versions.reference_version.model
    assert reference is not module.model and not any(p.requires_grad for p in reference.parameters())
    n_params = len(module.model.state_dict())
    assert len([k for k in module.state_dict() if not k.startswith(("trained_tokens", "skipped_steps", "val_sums"))]) \
        == n_params  # the reference copy is neither a submodule nor checkpointed
    with torch.no_grad():
        loss, stats = module.micro_batch_loss(batch, module.step_denominator([batch]))
    assert float(stats["kl"]) == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(loss, stats["nll_sum"] / stats["num_tokens"], rtol=1e-6, atol=1e-6)


def test_policy_wrapper_shares_weights():
    module = SFTModule("tiny")
    policy = module.policy()
    assert policy.model is module.model and policy is module.versions.log_prob_version
    assert module.policy(generate=True) is module.versions.generate_version
    assert not any(k.startswith("policy") for k in module.state_dict())


def test_bf16_mixed_on_cpu(rows_path, tokenizer):
    torch.manual_seed(0)
    module = SFTModule("tiny", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    dm = SFTDataModule(str(rows_path), batch_size=2, eval_fraction=0.25)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, precision="bf16-mixed", accelerator="cpu")
    trainer.fit(module, dm)
    assert trainer.global_step == 2
    assert module.model.model.embed_tokens.weight.dtype == torch.float32  # master weights stay fp32
    metrics = trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/loss"])


def test_nonfinite_gradient_raises(rows_path, tokenizer):
    module = SFTModule("tiny", token_accuracy=False)
    original = module.micro_batch_loss

    def inf_grad(mb, normalizer):  # finite loss value, infinite gradient
        loss, stats = original(mb, normalizer)
        return loss + _InfGrad.apply(module.model.model.norm.weight), stats

    module.micro_batch_loss = inf_grad
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(NonFiniteLossError, match=r"gradient norm inf\) at step 0; this rank's sample ids"):
        trainer.fit(module, dm)


class _InfGrad(torch.autograd.Function):
    """0 in the forward pass, an infinite gradient in the backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x.sum() * 0.0

    @staticmethod
    def backward(ctx, g):
        return torch.full((64,), float("inf"))  # the tiny model's hidden size


# ------------------------------------------------------------------------------------------------ model options
def test_model_options_are_keyword_arguments_of_every_module():
    """One place for the model options: each ModelConfig field (``model`` for ``model_name_or_path``) is a keyword
    argument with the same default on PolicyModule, SFTModule and GRPOModule."""
    import dataclasses
    import inspect

    from lit_llm.lightning.grpo import GRPOModule
    from lit_llm.lightning.module import PolicyModule
    from lit_llm.models import ModelConfig

    defaults = ModelConfig()
    for cls in (PolicyModule, SFTModule, GRPOModule):
        params = inspect.signature(cls.__init__).parameters
        for f in dataclasses.fields(ModelConfig):
            name = "model" if f.name == "model_name_or_path" else f.name
            default = getattr(defaults, f.name)
            assert params[name].default == (None if default == {} else default), (cls.__name__, name)


def test_model_options_reach_module_tokenizer_and_hparams(templates_dir):
    path = templates_dir / "chatml.jinja"
    module = SFTModule("tiny", dtype="bfloat16", attn_implementation="eager", chat_template=str(path),
                       chat_template_kwargs={"enable_thinking": False})
    assert module.model.dtype == torch.bfloat16 and module.model.config._attn_implementation == "eager"
    assert module.chat_template == str(path) and module.chat_template_kwargs == {"enable_thinking": False}
    assert module.tokenizer.chat_template == path.read_text()  # renders without a template and exports use it
    assert module.model_config.model_name_or_path == "tiny" and module.model_config.dtype == "bfloat16"
    for key, value in (("dtype", "bfloat16"), ("attn_implementation", "eager"), ("chat_template", str(path)),
                       ("chat_template_kwargs", {"enable_thinking": False})):
        assert module.hparams[key] == value, key
    plain = SFTModule("tiny")
    assert plain.chat_template is None and plain.chat_template_kwargs == {} and plain.model.dtype == torch.float32


def test_unknown_chat_template_is_refused_at_construction(tmp_path):
    from lit_llm.data.errors import ChatTemplateError

    with pytest.raises(ChatTemplateError, match=r"no-such\.jinja.*no such file"):
        SFTModule("tiny", chat_template=str(tmp_path / "no-such.jinja"))


@pytest.mark.parametrize(("dtype", "fix"), [("bfloat16", "bf16-true"), ("float16", "16-true")])
def test_half_weights_with_mixed_precision_refused_at_fit_start(rows_path, tokenizer, dtype, fix):
    precision = "bf16-mixed"  # Lightning turns 16-mixed into bf16-mixed on CPU (16-mixed: next test)
    module = SFTModule("tiny", dtype=dtype)
    before = module.model.model.norm.weight.detach().clone()
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, precision=precision, accelerator="cpu")
    with pytest.raises(ValueError, match=rf"model\.dtype='{dtype}' loads the weights in {dtype}, but "
                                         rf"trainer\.precision='{precision}' is mixed precision.*set model\.dtype "
                                         rf"float32.*trainer\.precision {fix}"):
        trainer.fit(module, dm)
    assert trainer.global_step == 0 and torch.equal(module.model.model.norm.weight, before)


@pytest.mark.parametrize(("dtype", "precision", "refused"), [
    (torch.float16, "16-mixed", True), (torch.bfloat16, "16-mixed", True), (torch.bfloat16, "bf16-true", False),
    (torch.bfloat16, "32-true", True), (torch.float16, "32-true", True), (torch.float16, "bf16-true", True),
    (torch.float16, "16-true", False), (torch.float32, "bf16-mixed", False), (torch.float32, "16-mixed", False),
    (torch.float32, "32-true", False)])
def test_check_weights_precision(tokenizer, dtype, precision, refused):
    from lit_llm.lightning.module import check_weights_precision
    from lit_llm.models import tiny_model

    model = tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, dtype=dtype)
    if refused:
        with pytest.raises(ValueError, match=rf"model\.dtype='auto'.*trainer\.precision='{precision}'"):
            check_weights_precision(model, precision, "auto")
    else:
        check_weights_precision(model, precision, "auto")


def test_bfloat16_weights_train_with_bf16_true(rows_path, tokenizer):
    module = SFTModule("tiny", dtype="bfloat16", optimizer=partial(torch.optim.AdamW, lr=1e-2))
    dm = SFTDataModule(str(rows_path), batch_size=2)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, precision="bf16-true", accelerator="cpu", limit_val_batches=0)
    trainer.fit(module, dm)
    assert trainer.global_step == 1 and module.model.model.norm.weight.dtype == torch.bfloat16


def test_grpo_rollouts_and_greedy_eval_render_with_template_kwargs(templates_dir):
    """chat_template_kwargs reach every prompt render of GRPO: the rollout engine (and its async copy's
    construction arguments) and the greedy evaluation."""
    from lit_llm.data.prompts import tokenize_prompts
    from lit_llm.lightning.grpo import GRPOModule

    path = str(templates_dir / "stock-qwen3.jinja")
    module = GRPOModule("tiny", reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                        num_generations=2, max_new_tokens=2, chat_template=path,
                        chat_template_kwargs={"enable_thinking": False})
    assert module.engine.chat_template == path and module.engine.chat_template_kwargs == {"enable_thinking": False}
    prompt = [[{"role": "user", "content": "What is 2 + 3?"}]]
    expected = tokenize_prompts(prompt, module.tokenizer, chat_template=path,
                                chat_template_kwargs={"enable_thinking": False})[0]
    assert module.tokenizer.decode(expected).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    seen: list[list[int]] = []
    module.versions.greedy = lambda prompts, n: seen.extend(p.tolist() for p in prompts) or [torch.tensor([2])]
    module.greedy_responses({"prompt": prompt})
    assert seen == [expected.tolist()]
    rollout = module.engine.rollout({"prompt": prompt})
    assert rollout.prompt_ids[0].tolist() == expected.tolist()


def test_cli_model_options_survive_checkpoint_and_export(tmp_path, templates_dir):
    """``lit-llm fit`` with model options as dotted overrides of a config that says ``model: tiny``; the checkpoint's
    hyperparameters rebuild the module for ``lit-llm export``: bf16 weights, the template override in the tokenizer."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_llm.lightning.cli import main

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "chatml_thinking.jinja"  # ChatML that reads enable_thinking (an unread key is refused)
    path.write_text("{%- if enable_thinking is defined %}{% endif %}" + (templates_dir / "chatml.jinja").read_text())
    cli = main(["fit", "--config", str(root / "configs/sft_tiny.yaml"), "--model.init_args.dtype", "bfloat16",
                "--model.init_args.chat_template", str(path), "--model.init_args.chat_template_kwargs",
                "{enable_thinking: false}", "--trainer.precision", "bf16-true", "--trainer.max_steps", "1",
                "--trainer.default_root_dir", str(tmp_path / "run"), "--data.init_args.num_samples", "8",
                "--samples.num_samples", "0"])
    module = cli.model
    assert module.model_name == "tiny" and module.model.dtype == torch.bfloat16  # the config's model kept
    assert module.chat_template_kwargs == {"enable_thinking": False}
    out = tmp_path / "exported"
    main(["export", "--ckpt_path", str(tmp_path / "run/checkpoints/last.ckpt"), "--out", str(out)])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert hf.dtype == torch.bfloat16
    torch.testing.assert_close(hf.model.norm.weight, module.model.model.norm.weight.cpu(), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(out).chat_template == path.read_text()


def test_model_and_data_chat_templates_that_differ_are_refused(rows_path, tokenizer, templates_dir):
    chatml, qwen3 = str(templates_dir / "chatml.jinja"), str(templates_dir / "stock-qwen3.jinja")
    module = SFTModule("tiny", chat_template=chatml)
    dm = SFTDataModule(str(rows_path), batch_size=2, chat_template=qwen3)
    dm.tokenizer = tokenizer
    trainer = Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0)
    with pytest.raises(ValueError, match=r"model\.chat_template=.*chatml\.jinja.* and data\.chat_template=.*"
                                         r"stock-qwen3\.jinja.* differ.*set chat_template once, on the model"):
        trainer.fit(module, dm)
