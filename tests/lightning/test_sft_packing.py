"""SFT packing end to end: packed rows never attend to each other (exactly), per-token log-probs, masks, losses,
step counts and gradients equal the unpacked batch's, and the data option trains the same run with no padding."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger
from tensordict import TensorDict
from test_loss_parity import ROWS as CHAT_ROWS  # pytest puts this folder on sys.path

from lit_llm.data.datasets import collate, read_examples, tokenize_example
from lit_llm.data.packing import collate_packed, unpack_rows
from lit_llm.lightning.datamodules import SFTDataModule, StepBatchLoader
from lit_llm.lightning.sft import SFTModule
from lit_llm.policy.logprobs import token_hidden_states

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    *CHAT_ROWS,  # multi-turn, single-turn, system-prompt chats (tests/lightning/test_loss_parity.py)
    {"messages": [{"role": "user", "content": "Describe the sea."},
                  {"role": "assistant", "content": "The sea is wide, deep, salty and blue, with waves and tides."}]},
    {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes indeed"}]},
]


@pytest.fixture
def rows_path(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def samples(rows_path, tokenizer):
    return [tokenize_example(e, tokenizer) for e in read_examples(rows_path)]


def row_log_probs(module, mb):
    """``[N, T]`` per-token log-probs (generic head: every token but each row's first) of a micro-batch's rows."""
    with torch.no_grad():
        dist = module.versions.log_prob_version.get_generic_dist(module.policy_inputs(mb))
        return module._rows(mb, dist.log_prob(dist.tokens)), module._rows(mb, dist.mask, False)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_rows_never_attend_across_the_boundary(samples, tokenizer, attn_implementation):
    module = SFTModule("tiny", attn_implementation=attn_implementation, loss="generic")
    mb = collate_packed(samples, pad_token_id=tokenizer.pad_token_id, max_length=1024)
    assert mb["input_ids"].shape[0] == 1  # one pack holds every row: every row has neighbours on both sides
    before, _ = row_log_probs(module, mb)
    row_index = mb["row_index"][0]
    for a in range(len(samples)):  # perturb row a's tokens (same length): every other row is bitwise unchanged
        perturbed = dict(mb, input_ids=mb["input_ids"].clone())
        cols = row_index == a
        perturbed["input_ids"][0, cols] = (perturbed["input_ids"][0, cols] * 7 + 11) % 40000 + 100
        after, _ = row_log_probs(module, perturbed)
        others = torch.arange(len(samples)) != a
        assert torch.equal(after[others], before[others]), f"a row attended to row {a}"
        assert not torch.equal(after[a], before[a])  # the perturbation is real
    # the test has teeth: the same pack run the wrong way (default use_cache=True: transformers then builds a plain
    # causal mask) lets the later rows see row 0
    backbone = module.model.model
    ids, pos = mb["input_ids"], mb["position_ids"]
    with torch.no_grad():
        right = token_hidden_states(module.model, ids, mb["attention_mask"], position_ids=pos)
        wrong = backbone(input_ids=ids, position_ids=pos).last_hidden_state  # use_cache defaults to True
    later = (row_index > 0)[1:]
    assert float((wrong[0, :-1][later] - right[0, 1:][later]).abs().max()) > 1e-2


def test_packed_hidden_states_equal_each_row_alone(samples, tokenizer, tiny):
    mb = collate_packed(samples, pad_token_id=tokenizer.pad_token_id, max_length=80)
    assert mb["input_ids"].shape[0] > 1  # several packs, right-padded
    with torch.no_grad():
        hidden = token_hidden_states(tiny, mb["input_ids"], mb["attention_mask"], position_ids=mb["position_ids"])
        rows = unpack_rows(hidden, mb["unpack_index"], mb["row_lengths"])
        for i, s in enumerate(samples):
            alone = token_hidden_states(tiny, s.input_ids[None], torch.ones(1, len(s), dtype=torch.long))[0]
            torch.testing.assert_close(rows[i, :len(s)], alone, rtol=1e-5, atol=1e-5)
            assert float(rows[i, 0].abs().max()) == 0.0  # a row's first token has no prediction


@pytest.mark.parametrize("head", ["sft", "rlhf", "generic"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_packed_loss_counts_and_grads_equal_unpacked(samples, tokenizer, head, normalization, kl_coef):
    torch.manual_seed(0)
    module = SFTModule("tiny", loss=head, normalization=normalization, kl_coef=kl_coef)
    if kl_coef:  # make the reference differ from the policy, so the KL term is not 0
        with torch.no_grad():
            for p in module.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    pad = tokenizer.pad_token_id
    halves = [samples[:3], samples[3:]]  # two micro-batches, as the loader cuts a step
    plain = [collate(h, pad_token_id=pad) for h in halves]
    packed = [collate_packed(h, pad_token_id=pad, max_length=96) for h in halves]
    assert any(p["input_ids"].shape[0] < len(h) for p, h in zip(packed, halves))  # rows really share packs
    for p, u in zip(packed, plain):  # per-token log-probs and the head masks, in row layout
        lp_p, m_p = row_log_probs(module, p)
        lp_u, m_u = row_log_probs(module, u)
        torch.testing.assert_close(lp_p, lp_u, rtol=1e-5, atol=1e-5)
        assert torch.equal(m_p, m_u)
        assert torch.equal(module.mask(p), module.mask(u))
    denom = module.step_denominator(plain)
    assert int(module.step_denominator(packed)) == int(denom)  # tokens, or sequences = original rows

    def run(mbs):
        out = []
        for mb in mbs:
            loss, stats = module.micro_batch_loss(mb, denom.float())
            loss.backward()
            out.append((loss.detach(), stats))
        grads = [p.grad.clone() for p in module.model.parameters()]
        module.model.zero_grad(set_to_none=True)
        return out, grads

    (res_p, grads_p), (res_u, grads_u) = run(packed), run(plain)
    for (loss_p, st_p), (loss_u, st_u), p in zip(res_p, res_u, packed):
        torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)
        for k in ("nll_sum", "num_tokens", "entropy_sum", "hits", *(("kl",) if kl_coef else ())):
            torch.testing.assert_close(st_p[k], st_u[k], rtol=1e-5, atol=1e-5)
        assert float(st_p["input_slots"]) == p["input_ids"].numel()  # positions that went through the model
    for g_p, g_u in zip(grads_p, grads_u):
        torch.testing.assert_close(g_p, g_u, rtol=1e-5, atol=1e-5)


def fit(rows_path, tokenizer, tmp_path, *, packing: bool, max_steps: int = 2):
    torch.manual_seed(0)
    module = SFTModule("tiny", loss="rlhf", optimizer=partial(torch.optim.SGD, lr=0.5), grad_clip=None)
    dm = SFTDataModule(str(rows_path), batch_size=4, micro_batch_size=2, max_length=128, packing=packing,
                       group_by_length=False)
    dm.tokenizer = tokenizer
    logger = CSVLogger(tmp_path / ("packed" if packing else "plain"))
    trainer = Trainer(max_steps=max_steps, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      accelerator="cpu", devices=1)
    trainer.fit(module, dm)
    rows = [json.loads(json.dumps(r)) for r in _csv(logger.log_dir)]
    return module, [r for r in rows if r.get("train/loss")]


def _csv(log_dir):
    import csv
    from pathlib import Path

    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_packing_option_trains_the_same_run_without_padding(rows_path, tokenizer, tmp_path):
    packed_module, packed_log = fit(rows_path, tokenizer, tmp_path, packing=True)
    plain_module, plain_log = fit(rows_path, tokenizer, tmp_path, packing=False)
    assert len(packed_log) == len(plain_log) == 2
    for p, u in zip(packed_log, plain_log):  # same rows per step, same loss, same counts
        assert float(p["train/loss"]) == pytest.approx(float(u["train/loss"]), rel=1e-5, abs=1e-6)
        assert float(p["train/step_tokens"]) == float(u["train/step_tokens"])
        assert float(p["train/pad_fraction"]) < float(u["train/pad_fraction"])
        assert 0.0 <= float(p["train/pad_fraction"]) < 1.0
    for a, b in zip(packed_module.model.parameters(), plain_module.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_pad_fraction_is_padding_over_positions(rows_path, tokenizer, tmp_path):
    _, log = fit(rows_path, tokenizer, tmp_path, packing=False, max_steps=1)
    dm = SFTDataModule(str(rows_path), batch_size=4, micro_batch_size=2, max_length=128, group_by_length=False)
    dm.tokenizer = tokenizer
    dm.setup("fit")
    loader = StepBatchLoader(dm.train_samples, batch_size=4, micro_batch_size=2, pad_token_id=tokenizer.pad_token_id,
                             group_by_length=False)
    mbs = next(iter(loader))["micro_batches"]
    real = sum(int(mb["attention_mask"].sum()) for mb in mbs)
    slots = sum(mb["input_ids"].numel() for mb in mbs)
    assert float(log[0]["train/pad_fraction"]) == pytest.approx(1 - real / slots, rel=1e-6)


def test_packing_loader_keeps_the_step_plan(samples, tokenizer):
    kw = dict(batch_size=4, micro_batch_size=2, pad_token_id=tokenizer.pad_token_id, seed=3)
    plain, packed = StepBatchLoader(samples, **kw), StepBatchLoader(samples, packing=True, pack_length=128, **kw)
    for a, b in zip(plain, packed):
        assert [mb["sample_ids"] for mb in a["micro_batches"]] == [mb["sample_ids"] for mb in b["micro_batches"]]
        for mb in b["micro_batches"]:
            assert mb["input_ids"].shape[1] <= 128 and "position_ids" in mb
    assert plain.state_dict() == packed.state_dict()
    with pytest.raises(ValueError, match="pack_length"):
        StepBatchLoader(samples, packing=True, pack_length=4, **kw)


def test_packed_inputs_fail_loudly(samples, tokenizer):
    module = SFTModule("tiny", loss="sft")
    policy = module.versions.log_prob_version
    mb = collate_packed(samples[:3], pad_token_id=tokenizer.pad_token_id, max_length=1024)
    bad = dict(mb, position_ids=mb["position_ids"].clone())
    bad["position_ids"][0, 3] += 5
    with pytest.raises(ValueError, match="position_ids row 0, column 3"):
        policy.get_sft_dist(module.policy_inputs(bad))
    td = module.policy_inputs(mb)
    td["tokens", "prompt"] = mb["input_ids"][:, :2]
    with pytest.raises(ValueError, match="tokens.prompt"):
        policy.head_mask(td, "sft")
    no_asst = TensorDict({("tokens", "full"): mb["input_ids"], ("masks", "all_attention_mask"):
                          mb["attention_mask"].bool(), "position_ids": mb["position_ids"]}, batch_size=[1])
    with pytest.raises(ValueError, match="all_assistant_mask"):
        policy.head_mask(no_asst, "sft")
