"""Sharded training (FSDP2, ``lit_llm.policy.sharding`` and ``PolicyModule.configure_model``) in one process: the
units :func:`shard_model` makes, the backbone hook that gathers the root for our own forward passes and the kernel,
generation over a gathered model, and the refusals. One-process gloo group (no real communication: the two-process
runs are in tests/distributed/test_sharded.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lit_llm.lightning import SFTModule
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.models import tiny_model
from lit_llm.policy.generation import generate_tokens
from lit_llm.policy.generation_config import resolve_generation_config
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.sharding import (
    check_same_count,
    decoder_layers,
    full_tensor,
    gathered,
    is_sharded,
    reshard_root,
    shard_model,
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[5, 17, 300, 9, 44, 2], [0, 0, 71, 8, 1000, 3]])
    return ids, ids != 0


def test_shard_model_units_log_probs_grads_and_generation(mesh, tokenizer, one_thread):
    torch.manual_seed(0)
    model = tiny_model(tokenizer)
    plain = copy.deepcopy(model)
    units = shard_model(model, mesh)
    # the decoder layers, then the causal LM as the root unit; every parameter a DTensor shard; the tie kept
    assert units == [*model.model.layers, model]
    assert all(isinstance(u, FSDPModule) for u in units) and is_sharded(model) and not is_sharded(plain)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert shard_model(model, mesh) == units  # a second call does nothing

    ids, mask = _batch()
    lp = model_token_log_probs(model, ids, mask)  # backbone hook: root gathered, kernel reads the whole head
    assert not isinstance(model.lm_head.weight, DTensor)
    lp_plain = model_token_log_probs(plain, ids, mask)
    torch.testing.assert_close(lp, lp_plain, rtol=0, atol=1e-6)
    (lp * mask).sum().backward()
    (lp_plain * mask).sum().backward()
    # FSDP2's end-of-backward callback reduced the root unit's gradients and resharded it
    assert isinstance(model.lm_head.weight, DTensor)
    sharded = dict(model.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(sharded[name].grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-7, msg=name)
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
    assert isinstance(norm, DTensor)
    torch.testing.assert_close(full_tensor(norm), torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 1.0))

    with torch.no_grad():  # no backward: the root stays gathered until reshard_root (before the optimizer step)
        torch.testing.assert_close(model_token_log_probs(model, ids, mask), lp_plain, rtol=0, atol=1e-6)
    assert not isinstance(model.lm_head.weight, DTensor)
    reshard_root(model)
    assert isinstance(model.lm_head.weight, DTensor)

    config = resolve_generation_config({"max_new_tokens": 5, "do_sample": False}, plain)
    prompts = [torch.tensor([5, 17, 300]), torch.tensor([71, 8])]
    model.eval(), plain.eval()
    with torch.no_grad(), gathered(model):
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # whole for the block
        out = generate_tokens(model, prompts, config)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # resharded after
    with torch.no_grad():
        expected = generate_tokens(plain, prompts, config)
    assert [r.tolist() for r in out.response_ids] == [r.tolist() for r in expected.response_ids]


def test_decoder_layers_refuses_a_model_without_layer_classes():
    with pytest.raises(ValueError) as e:
        decoder_layers(torch.nn.Linear(2, 2))
    assert str(e.value) == ("shard_model: Linear has no decoder layer to shard (its _no_split_modules is []); sharded "
                            "training needs an HF causal LM whose _no_split_modules names its decoder layer class. "
                            "Fix: use such a model, or train without --trainer.strategy ModelParallelStrategy.")


def test_check_same_count_refuses_unequal_micro_batch_counts():
    calls = []

    def all_sum(sums):  # two ranks with 3 and 1 micro-batches: sums [4, 10]
        calls.append(sums.tolist())
        return torch.tensor([4.0, 10.0])

    with pytest.raises(ValueError) as e:
        check_same_count(3, all_sum, 2, what="micro-batches", fix="do X.")
    assert calls == [[3.0, 9.0]]
    assert str(e.value) == ("Sharded training: the ranks have different numbers of micro-batches in this step (this "
                            "rank: 3, mean 2); FSDP2 needs the same forward passes on every rank. Fix: do X.")
    check_same_count(2, lambda s: torch.tensor([4.0, 8.0]), 2, what="micro-batches", fix="")  # equal: passes
    check_same_count(2, None, 1, what="micro-batches", fix="")  # one rank: nothing reduced


class FakeMesh:
    """What ``shard_policy`` reads of Lightning's 2-D ``device_mesh``."""

    mesh_dim_names = ("data_parallel", "tensor_parallel")

    def __init__(self, tensor_parallel: int) -> None:
        self.sizes = {"data_parallel": 2, "tensor_parallel": tensor_parallel}

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name])


def refusal(module, *, tensor_parallel: int) -> str:
    """The one-line error of ``module.configure_model()`` under a (fake) data-parallel mesh."""
    module._device_mesh = FakeMesh(tensor_parallel=tensor_parallel)
    with pytest.raises(ValueError) as e:
        module.configure_model()
    return str(e.value)


def test_configure_model_without_a_mesh_does_nothing_and_refusals():
    module = SFTModule("tiny")
    module.configure_model()
    assert not is_sharded(module.model) and not any(isinstance(p, DTensor) for p in module.model.parameters())
    assert refusal(module, tensor_parallel=2) == (
        "--trainer.strategy.tensor_parallel_size: the device mesh is tensor parallel over 2 devices (`auto`, the "
        "default, means the devices per node); lit-llm shards with data-parallel FSDP2 only. Fix: "
        "--trainer.strategy.data_parallel_size 4 --trainer.strategy.tensor_parallel_size 1.")


def test_distributed_checkpoint_folder_consolidated_into_one_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lit_llm.lightning.sharded_checkpoint import checkpoint_file, consolidate_checkpoint, is_distributed_checkpoint

    folder = tmp_path / "last.ckpt"  # as ModelParallelStrategy writes it: the tensors by DCP, the rest in meta.pt
    weights = {"model.w": torch.arange(6.0).reshape(2, 3), "trained_tokens": torch.tensor(5.0, dtype=torch.float64)}
    optimizer = {"state": {"model.w": {"step": torch.tensor(3.0)}},
                 "param_groups": [{"lr": 0.1, "params": ["model.w"]}]}
    dcp.save({"state_dict": weights, "optimizer_0": optimizer}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 7, "hyper_parameters": {"lr": 0.1}}, folder / "meta.pt")
    assert is_distributed_checkpoint(folder) and not is_distributed_checkpoint(tmp_path)
    ckpt = torch.load(consolidate_checkpoint(folder, tmp_path / "one.ckpt"), weights_only=False)
    assert sorted(ckpt) == ["global_step", "hyper_parameters", "optimizer_states", "state_dict"]
    assert ckpt["global_step"] == 7 and ckpt["hyper_parameters"] == {"lr": 0.1}
    assert sorted(ckpt["state_dict"]) == ["model.w", "trained_tokens"]
    assert all(torch.equal(ckpt["state_dict"][k], v) for k, v in weights.items())
    assert ckpt["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": ["model.w"]}]
    assert torch.equal(ckpt["optimizer_states"][0]["state"]["model.w"]["step"], torch.tensor(3.0))
    with checkpoint_file(folder) as file:  # a temporary consolidated file, deleted after
        assert file.is_file() and torch.load(file, weights_only=False)["global_step"] == 7
    assert not file.exists()
    with checkpoint_file(tmp_path / "one.ckpt") as same:  # a file is itself
        assert same == tmp_path / "one.ckpt"
    with pytest.raises(ValueError) as e:
        consolidate_checkpoint(tmp_path, tmp_path / "two.ckpt")
    assert str(e.value) == f"{tmp_path}: not a distributed checkpoint folder (no meta.pt and .metadata in it)."


def test_configure_model_refuses_vllm_under_sharding():
    grpo = GRPOModule("tiny")
    grpo.versions.vllm = SimpleNamespace()  # what use_vllm builds (vLLM itself is not installed here)
    assert refusal(grpo, tensor_parallel=1) == (
        "--model.init_args.use_vllm true is not supported with --trainer.strategy ModelParallelStrategy (as "
        "under DDP: the colocated engine runs in one process and initialises its own torch.distributed group, "
        "beside the strategy's). Fix: use_vllm false (rollouts on the sharded model), or train on one device "
        "without this strategy.")
    assert not is_sharded(grpo.model)
