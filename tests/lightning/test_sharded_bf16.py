"""``bf16-mixed`` under sharding (FSDP2, no ``MixedPrecisionPolicy``: the sharded parameters stay fp32 and autocast
casts them at each matmul, as for the unsharded model): log-probs and one training step (backward, global-norm clip,
AdamW) of a sharded model under Lightning's autocast (``MixedPrecision.autocast_context_manager``: bf16, cast cache
off) equal the unsharded model's under the same autocast. One-process gloo group, as tests/lightning/test_sharding.py
(no real communication: the 2-process runs are fp32, tests/distributed/test_sharded.py)."""

from __future__ import annotations

import copy

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.distributed.tensor import DTensor

from lit_llm.models import tiny_model
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.sharding import full_tensor, shard_model


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor, mask: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs under Lightning's bf16-mixed autocast, then backward, the global-norm clip and an AdamW step:
    ``(log_probs [B, T] fp32, grad norm before clipping)``."""
    with MixedPrecision("bf16-mixed", "cpu").autocast_context_manager():
        lp = model_token_log_probs(model, ids, mask)
    (-(lp * mask).sum() / mask.sum()).backward()
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.5))
    opt.step()
    opt.zero_grad()
    return lp.detach(), norm


def test_sharded_step_under_bf16_autocast_equals_the_unsharded_one(mesh, tokenizer, one_thread):
    torch.manual_seed(0)
    model = tiny_model(tokenizer)
    plain = copy.deepcopy(model)
    shard_model(model, mesh)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in model.parameters())  # fp32 shards
    opt, opt_plain = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain))
    ids = torch.tensor([[5, 17, 300, 9, 44, 2], [0, 0, 71, 8, 1000, 3]])
    mask = ids != 0
    with torch.no_grad():
        fp32 = model_token_log_probs(plain, ids, mask)
    for _ in range(2):
        lp, norm = train_step(model, opt, ids, mask)
        lp_plain, norm_plain = train_step(plain, opt_plain, ids, mask)
        assert lp.dtype == torch.float32
        torch.testing.assert_close(lp, lp_plain, rtol=0, atol=0)
        torch.testing.assert_close(norm, norm_plain, rtol=1e-6, atol=0)
        if fp32 is not None:  # autocast ran in bf16: the first step's log-probs are not the fp32 ones
            assert (lp - fp32).abs().max() > 1e-4
            fp32 = None
    sharded = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(sharded[name].full_tensor(), p.detach(), rtol=0, atol=0, msg=name)
