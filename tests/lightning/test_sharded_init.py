"""Meta-device construction for sharded training (``lit_llm.lightning.policy_setup.sharded_init``,
``lit_llm.policy.sharding.fill_from_rank0``) in one process: which process builds on the meta device, the empty build
of each model kind against a full load, a meta model (and a meta copy, the KL reference's case) sharded and filled
from rank 0's weights on a one-process gloo group (``set_model_state_dict`` broadcast + the non-persistent buffers),
and the refusals. The two-process run (rank 1 on the meta device, matching DDP) is in tests/distributed/test_sharded.py.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lit_llm.lightning import SFTModule
from lit_llm.lightning.policy_setup import (
    in_sharded_init,
    launch_is_global_rank_zero,
    load_policy_model,
    sharded_init,
    sharded_init_for_trainer,
)
from lit_llm.models import ModelConfig
from lit_llm.policy.logprobs import model_token_log_probs
from lit_llm.policy.sharding import fill_from_rank0, is_meta, non_persistent_buffers, rank0_weights, shard_model

ROPE = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


@pytest.fixture
def rank_one(monkeypatch):
    """This process looks like rank 1 of Lightning's launcher (``LOCAL_RANK=1``)."""
    for name in ("RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")


def test_launch_is_global_rank_zero_reads_the_launch_variables():
    assert launch_is_global_rank_zero({})
    assert launch_is_global_rank_zero({"LOCAL_RANK": "0", "NODE_RANK": "0", "RANK": "0", "GROUP_RANK": ""})
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        assert not launch_is_global_rank_zero({name: "1"}), name
    assert not launch_is_global_rank_zero({"LOCAL_RANK": "0", "NODE_RANK": "2"})  # process 0 of the third node
    assert not launch_is_global_rank_zero({"SLURM_NTASKS": "4", "SLURM_PROCID": "3"})
    assert launch_is_global_rank_zero({"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_JOB_NAME": "bash"})
    assert launch_is_global_rank_zero({"SLURM_PROCID": "3"})  # not a SLURM launch (no SLURM_NTASKS)
    with pytest.raises(ValueError) as e:
        launch_is_global_rank_zero({"LOCAL_RANK": "one"})
    assert str(e.value) == ("The environment variable LOCAL_RANK='one' is not an integer rank. Fix: unset it or give "
                            "the process's rank.")


def test_sharded_init_for_trainer_only_under_model_parallel_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    class MyStrategy(ModelParallelStrategy):
        pass

    parsed = SimpleNamespace(class_path="lightning.pytorch.strategies.ModelParallelStrategy",
                             init_args=SimpleNamespace(data_parallel_size=2))
    sharded = [{"strategy": "ModelParallelStrategy"}, {"strategy": parsed}, {"strategy": MyStrategy()},
               {"strategy": {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}}]
    plain = [None, {}, {"strategy": "ddp"}, {"strategy": "auto"}, {"strategy": {"class_path": "lightning.pytorch."
                                                                                "strategies.DDPStrategy"}},
             {"strategy": {"class_path": "no.such.Strategy"}}]
    for trainer in sharded:
        assert not in_sharded_init()
        with sharded_init_for_trainer(trainer):
            assert in_sharded_init(), trainer
    for trainer in plain:
        with sharded_init_for_trainer(trainer):
            assert not in_sharded_init(), trainer
    with sharded_init(), sharded_init(enabled=False):
        assert not in_sharded_init()
    assert not in_sharded_init()


def _save_folder(path, use_generation_config: bool = True):
    model, tokenizer = load_policy_model("tiny")
    model.generation_config.max_new_tokens = 7  # a value only generation_config.json holds
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if not use_generation_config:
        (path / "generation_config.json").unlink()
    return path


def test_empty_build_matches_a_full_load_without_reading_weights(tmp_path):
    folder = _save_folder(tmp_path / "hf")
    cases = [ModelConfig("tiny"), ModelConfig("tiny", use_peft=True, lora_r=4, lora_alpha=8),
             ModelConfig(str(folder), attn_implementation="eager"), ModelConfig(str(folder), dtype="auto")]
    for config in cases:
        torch.manual_seed(3)
        full, tokenizer = load_policy_model(config)
        rng = torch.get_rng_state()
        torch.manual_seed(3)
        empty, tokenizer2 = load_policy_model(config, empty=True)
        assert torch.equal(torch.get_rng_state(), rng)  # the same random draws (LoRA's init): the same later stream
        assert all(t.is_meta for t in (*empty.parameters(), *empty.buffers())), config
        assert [(n, p.shape, p.dtype, p.requires_grad) for n, p in empty.named_parameters()] == \
            [(n, p.shape, p.dtype, p.requires_grad) for n, p in full.named_parameters()]
        assert [n for n, _ in non_persistent_buffers(empty)] == [n for n, _ in non_persistent_buffers(full)]
        assert empty.config.to_dict() == full.config.to_dict()
        assert empty.generation_config.to_dict() == full.generation_config.to_dict()
        assert tokenizer2.get_vocab() == tokenizer.get_vocab()
        assert [n for n, _ in non_persistent_buffers(full)] == \
            [("base_model.model." if config.use_peft else "") + n for n in ROPE]
    assert load_policy_model(str(folder), empty=True)[0].generation_config.max_new_tokens == 7
    (folder / "model.safetensors").unlink()  # no weight file read: the empty build still works
    assert is_meta(load_policy_model(str(folder), empty=True)[0])
    bare = _save_folder(tmp_path / "bare", use_generation_config=False)  # generation config from config.json
    assert load_policy_model(str(bare), empty=True)[0].generation_config.to_dict() == \
        load_policy_model(str(bare))[0].generation_config.to_dict()


@pytest.mark.parametrize("use_peft", [False, True])
def test_meta_model_and_meta_copy_filled_from_rank0(mesh, use_peft, one_thread):
    config = ModelConfig("tiny", use_peft=use_peft, lora_r=4, lora_alpha=8)
    torch.manual_seed(1)
    source, _ = load_policy_model(config)  # rank 0's model
    source.eval()
    with torch.no_grad():  # adapters and rotary buffers unlike their init: the values must come from `source`
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        for _, b in non_persistent_buffers(source):
            b.mul_(1.5)
    weights = rank0_weights(source)
    model, _ = load_policy_model(config, empty=True)
    copy_ = copy.deepcopy(model)  # the KL reference of a meta model: a meta copy
    assert is_meta(copy_)
    for target in (model, copy_):
        shard_model(target, mesh)
        assert is_meta(target)
        assert fill_from_rank0(target, weights, mesh) == len(source.state_dict()) + 2
        assert not is_meta(target)
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in target.parameters())
        got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in target.state_dict().items()}
        expected = source.state_dict()
        assert sorted(got) == sorted(expected)
        for k, v in expected.items():
            assert torch.equal(got[k], v), k
        buffers = dict(non_persistent_buffers(target))
        for k, v in non_persistent_buffers(source):  # not in the state dict: set from rank 0's
            assert torch.equal(buffers[k], v), k
        base = target.get_base_model() if use_peft else target
        assert base.lm_head.weight is base.model.embed_tokens.weight  # still tied
        ids = torch.tensor([[5, 17, 300, 9, 44, 2]])
        mask = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():  # eval: no LoRA dropout
            torch.testing.assert_close(model_token_log_probs(target.eval(), ids, mask),
                                       model_token_log_probs(source, ids, mask), rtol=0, atol=0)


def test_module_built_on_meta_on_rank_one_only_inside_sharded_init(rank_one, one_thread):
    plain = SFTModule("tiny", kl_coef=0.1)
    assert not plain.sharded_init and not is_meta(plain.model)
    with sharded_init():
        module = SFTModule("tiny", kl_coef=0.1)
    reference = module.versions.reference_version.model
    assert module.sharded_init and is_meta(module.model) and is_meta(reference) and reference is not module.model
    assert module.tokenizer.get_vocab() == plain.tokenizer.get_vocab()  # loaded on every rank
    assert not module.trained_tokens.is_meta  # the module's own buffers are real
    with pytest.raises(ValueError) as e:  # no device mesh: the run is not sharded after all
        module.configure_model()
    assert str(e.value) == (
        "This process built its policy model on the meta device for sharded training (sharded_init, global rank > 0), "
        "but the run is not sharded (trainer.strategy: none (no Trainer)), so it would train on empty weights. Fix: "
        "run with --trainer.strategy ModelParallelStrategy, or build the module outside "
        "lit_llm.lightning.policy_setup.sharded_init().")


def configure_error(module, mesh) -> str:
    """The one line ``configure_model`` refuses ``module`` with under ``mesh``."""
    module._device_mesh = mesh
    with pytest.raises(ValueError) as e:
        module.configure_model()
    return str(e.value)


def test_rank_zero_on_meta_is_refused_before_any_broadcast(rank_one, mesh):
    with sharded_init():  # a launch environment that wrongly says "not rank 0" on the process that is rank 0
        module = SFTModule("tiny")
    assert configure_error(module, mesh) == (
        "Sharded init: global rank 0 has no weights to broadcast (it built its model on the meta device: its launch "
        "environment said it was not rank 0, one of RANK, LOCAL_RANK, NODE_RANK, GROUP_RANK or SLURM_PROCID above 0). "
        "Fix: launch so that rank 0 has none of them above 0, or build the module outside sharded_init() "
        "(lit_llm.lightning.policy_setup).")
    assert is_meta(module.model)  # nothing materialised


def test_a_rank_with_another_model_is_refused(mesh, monkeypatch):
    model, _ = load_policy_model("tiny", empty=True)
    shard_model(model, mesh)
    source, _ = load_policy_model("tiny")
    theirs, _ = load_policy_model(ModelConfig("tiny", dtype="bfloat16"), empty=True)

    def two_ranks(out, mine):  # rank 1 built a bf16 model (e.g. dtype auto resolved differently)
        from lit_llm.policy.sharding import _signature

        out[:] = [mine, (False, _signature(theirs))]

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_gather_object", two_ranks)
    with pytest.raises(ValueError) as e:
        fill_from_rank0(model, rank0_weights(source), mesh)
    assert str(e.value) == (
        "Sharded init: rank 1 built a different model from rank 0's (model.embed_tokens.weight [49152, 64] bfloat16 vs "
        "rank 0's model.embed_tokens.weight [49152, 64] float32), so rank 0's weights cannot fill it. Fix: give every "
        "rank the same model options (e.g. an explicit --model.init_args.dtype instead of auto).")
    assert is_meta(model)


def test_sharded_init_on_rank_zero_loads_and_configure_model_fills_the_same_weights(mesh, monkeypatch, one_thread):
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    plain = SFTModule("tiny", kl_coef=0.1)
    with sharded_init():
        module = SFTModule("tiny", kl_coef=0.1)
    assert module.sharded_init and not is_meta(module.model)  # rank 0 loads as usual
    module._device_mesh = mesh
    module.configure_model()  # shards, then broadcasts rank 0's weights (to itself here)
    reference = module.versions.reference_version.model
    for model in (module.model, reference):
        got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert all(torch.equal(got[k], v) for k, v in plain.model.state_dict().items())
        assert all(torch.equal(b, dict(non_persistent_buffers(plain.model))[k]) for k, b in
                   non_persistent_buffers(model))


def test_a_meta_model_outside_sharded_init_is_refused(mesh):
    module = SFTModule("tiny")
    module.model = load_policy_model("tiny", empty=True)[0]  # meta, but nothing would fill it
    assert configure_error(module, mesh) == (
        "The policy model is on the meta device but the module was not built inside "
        "lit_llm.lightning.policy_setup.sharded_init(), so nothing would fill it. Fix: build the module inside "
        "sharded_init() on every rank, or with its weights.")
    assert not any(isinstance(p, DTensor) for p in module.model.parameters())  # refused before sharding
