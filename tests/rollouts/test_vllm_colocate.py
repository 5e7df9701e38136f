"""The colocated-vLLM pieces that need no vLLM: the ``vllm_*`` options' rules, the sampling refusal, the engine dtype
of each precision, the weights pushed (LoRA merged out of place), the set-up refusals and the engine's start-up
error (``lit_llm.rollouts.vllm_colocate``). The engine itself is tested under ``make test-vllm``."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from lit_llm.lightning import grpo_options
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_options import build_vllm
from lit_llm.rollouts import vllm_colocate
from lit_llm.rollouts.settings import RolloutError, RolloutSettings
from lit_llm.rollouts.vllm_colocate import (
    VLLMRollouts,
    VLLMSettings,
    check_same_model,
    check_vllm_sampling,
    engine_dtype,
    hf_weights,
)


@pytest.mark.parametrize(("options", "message"), [
    ({"mode": "server"}, "vllm_mode must be 'colocate' (the engine in the trainer's process), got 'server'; a vLLM "
                         "server mode is not offered."),
    ({"gpu_memory_utilization": 0.0}, "vllm_gpu_memory_utilization must be in (0, 1], got 0.0."),
    ({"gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization must be in (0, 1], got 1.5."),
    ({"max_model_length": 1}, "vllm_max_model_length must be an integer >= 2 or null (the model's), got 1."),
    ({"tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2: only 1 is supported (one engine per trainer "
                                  "process); set it to 1."),
    ({"kv_cache_gib": 0}, "vllm_kv_cache_gib must be a size in GiB > 0 or null, got 0."),
    ({"kv_cache_gib": float("inf")}, "vllm_kv_cache_gib must be a size in GiB > 0 or null, got inf."),
    ({"enforce_eager": "yes"}, "vllm_enforce_eager must be true or false, got 'yes'."),
])
def test_settings_refused(options, message):
    with pytest.raises(RolloutError) as e:
        VLLMSettings(**options)
    assert str(e.value) == message


def test_top_p_top_k_need_recompute():
    settings = RolloutSettings(num_generations=2, top_p=0.9, top_k=20)
    with pytest.raises(RolloutError) as e:
        check_vllm_sampling(settings, "rollout")
    assert str(e.value).startswith("use_vllm with top_p=0.9 and top_k=20: vLLM's log-probs are then those of the "
                                   "truncated distribution")
    assert str(e.value).endswith("set old_log_probs: recompute (or drop top_p=0.9).")
    check_vllm_sampling(settings, "recompute")  # the trainer's forward is then the denominator
    check_vllm_sampling(RolloutSettings(num_generations=2), "rollout")


def test_module_refuses_top_p_without_recompute_at_init(monkeypatch):
    monkeypatch.setattr(grpo_options, "check_vllm_installed", lambda owner: None)
    with pytest.raises(ValueError, match=r"^GRPOModule: use_vllm with top_p=0.9: "):
        GRPOModule("tiny", num_generations=2, top_p=0.9, use_vllm=True)


@pytest.mark.parametrize(("precision", "dtype"), [
    ("32-true", "float32"), ("32", "float32"), ("64-true", "float32"), ("bf16-mixed", "bfloat16"),
    ("bf16-true", "bfloat16"), ("16-mixed", "float16"), ("16-true", "float16")])
def test_engine_dtype_follows_precision(precision, dtype):
    assert engine_dtype(precision) == dtype


def test_engine_kwargs_cpu_and_cuda():
    cpu = VLLMRollouts("tiny-vllm", VLLMSettings(), seed=None).engine_kwargs(precision="bf16-mixed",
                                                                             device=torch.device("cpu"))
    assert cpu == {"dtype": "bfloat16", "seed": 0, "max_model_len": None, "kv_cache_gib": 1.0, "enforce_eager": True}
    cuda = VLLMRollouts("m", VLLMSettings(enable_sleep_mode=True, max_model_length=512), seed=3).engine_kwargs(
        precision="32-true", device=torch.device("cuda", 1))
    assert cuda == {"dtype": "float32", "seed": 3, "max_model_len": 512, "kv_cache_gib": None, "enforce_eager": True,
                    "gpu_memory_utilization": 0.3, "enable_sleep_mode": True}


def test_hf_weights_plain_model_are_the_parameters_themselves(tiny):
    pairs = list(hf_weights(tiny))
    assert [n for n, _ in pairs] == [n for n, _ in tiny.named_parameters()]
    assert all(t.data_ptr() == p.data_ptr() for (_, t), (_, p) in zip(pairs, tiny.named_parameters()))


def test_hf_weights_lora_merged_out_of_place(tiny):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: give the adapters an effect
                p.copy_(torch.randn(p.shape, generator=gen))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pushed = dict(hf_weights(model))
    assert sorted(pushed) == sorted(n for n, _ in tiny.named_parameters())
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    expected = q.base_layer.weight + (8 / 4) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(pushed["model.layers.0.self_attn.q_proj.weight"], expected, rtol=0, atol=1e-6)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the trainer keeps its adapters


def test_build_vllm_off_warns_about_set_options(monkeypatch):
    monkeypatch.setattr(grpo_options, "check_vllm_installed", lambda owner: None)
    settings = RolloutSettings(num_generations=2)
    with pytest.warns(UserWarning, match=r"GRPOModule: vllm_enforce_eager, vllm_kv_cache_gib set but use_vllm is "
                                         r"false: unused"):
        assert build_vllm(False, "tiny", settings, "rollout", kv_cache_gib=2.0, enforce_eager=False) is None
    built = build_vllm(True, "tiny-vllm", RolloutSettings(num_generations=2, seed=5), "rollout")
    assert (built.model_name, built.seed, built.settings) == ("tiny-vllm", 5, VLLMSettings())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 2}, "use_vllm runs one colocated engine in one trainer process; this run has 2 processes "
                        "(trainer.devices / num_nodes). Train on one device (--trainer.devices 1) or set use_vllm: "
                        "false (rollouts on the trained model)."),
    ({"sleep": True}, "vllm_enable_sleep_mode frees GPU memory between rollouts and needs a CUDA device; this run is "
                      "on cpu: set vllm_enable_sleep_mode: false."),
    ({"sleep": True, "device": torch.device("cuda"), "rollout_mode": "async"},
     "vllm_enable_sleep_mode with rollout_mode: async: the producer generates all the time, so the engine never "
     "sleeps; set one of them off."),
    ({}, "use_vllm: the model 'tiny' has attention head size 16, which vLLM's CPU attention does not support (32, "
         "64, 80, 96, 112, 128, 160, 192, 224, 256, 512); use a model with one of those (the test model 'tiny-vllm' "
         "has 32) or use_vllm: false."),
])
def test_setup_refusals(tiny, kwargs, message):
    rollouts = VLLMRollouts("tiny", VLLMSettings(enable_sleep_mode=kwargs.pop("sleep", False)))
    args = {"device": torch.device("cpu"), "world_size": 1, "rollout_mode": "sync", "trained": tiny, **kwargs}
    with pytest.raises(RolloutError) as e:
        rollouts.check_setup(**args)
    assert str(e.value) == message


def test_engine_of_another_model_refused(tiny):
    cfg = copy.deepcopy(tiny.config)
    cfg.vocab_size += 1
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=cfg)))
    with pytest.raises(RolloutError) as e:
        check_same_model(llm, tiny, "other")
    v = tiny.config.vocab_size
    assert str(e.value).startswith(f"use_vllm: the engine's model ('other') is not the trained one (vocab_size: engine "
                                   f"{v + 1} vs trained {v}); ")


def test_engine_start_failure_is_one_line_naming_the_option(tiny, monkeypatch):
    def no_room(model, **kwargs):
        raise ValueError("To serve at least one request with the models's max seq len (8192), (0.38 GiB KV cache is "
                         "needed, which is larger than the available KV cache memory (0.25 GiB).\nmore lines")

    monkeypatch.setattr(vllm_colocate, "shared_engine", no_room)
    rollouts = VLLMRollouts("tiny-vllm", VLLMSettings(kv_cache_gib=0.25))
    with pytest.raises(RolloutError) as e:
        rollouts.build(precision="32-true", device=torch.device("cpu"), trained=tiny, tokenizer=None,
                       generate_kwargs={})
    assert str(e.value) == (
        "use_vllm: vLLM could not start an engine for 'tiny-vllm' (dtype=float32, seed=0, max_model_len=None, "
        "kv_cache_gib=0.25, enforce_eager=True): To serve at least one request with the models's max seq len (8192), "
        "(0.38 GiB KV cache is needed, which is larger than the available KV cache memory (0.25 GiB). Raise "
        "--model.init_args.vllm_kv_cache_gib (or lower vllm_max_model_length).")


def test_push_before_build_refused(tiny):
    with pytest.raises(RuntimeError, match=r"^VLLMRollouts.push: no engine yet"):
        VLLMRollouts("tiny-vllm", VLLMSettings()).push(tiny, (1, 0))


def test_sleep_mode_wakes_before_a_push_and_sleeps_once(monkeypatch, tiny):
    """vLLM's sleep mode (CUDA only, never run here): the calls the engine gets, in order, on a stand-in."""
    calls = []
    llm = types.SimpleNamespace(sleep=lambda level: calls.append(("sleep", level)),
                                wake_up=lambda: calls.append(("wake_up",)))
    monkeypatch.setattr(vllm_colocate, "load_weights", lambda engine, weights: calls.append(("push",)))
    rollouts = VLLMRollouts("tiny-vllm", VLLMSettings(enable_sleep_mode=True))
    rollouts.llm = llm
    rollouts.sleep()
    rollouts.push(tiny, (1, 0))
    rollouts.sleep()
    rollouts.sleep()
    rollouts.wake_up()
    rollouts.wake_up()
    assert calls == [("sleep", 1), ("wake_up",), ("push",), ("sleep", 1), ("wake_up",)]
    assert (rollouts.num_sleeps, rollouts.num_wake_ups, rollouts.num_pushes) == (2, 2, 1)
    awake = VLLMRollouts("tiny-vllm", VLLMSettings())
    awake.llm = llm
    awake.sleep()  # without enable_sleep_mode: never
    assert len(calls) == 5


@pytest.mark.parametrize(("text", "line"), [
    ("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
     "engine.\nmore", "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
     "initializing the engine. Raise --model.init_args.vllm_kv_cache_gib (or lower vllm_max_model_length)."),
    ("1 validation error for ModelConfig\n  Value error, User-specified max_model_len (100000) is greater than the "
     "derived max_model_len (max_position_embeddings=2048 in model's config.json). [type=value_error]\n    For "
     "further information visit https://errors.pydantic.dev",
     "1 validation error for ModelConfig Value error, User-specified max_model_len (100000) is greater than the "
     "derived max_model_len (max_position_embeddings=2048 in model's config.json). [type=value_error] Lower "
     "--model.init_args.vllm_max_model_length (or null: the model's context)."),
    ("Something else\nsecond line", "Something else"),
])
def test_start_error_keeps_the_reason_and_names_our_option(text, line):
    assert vllm_colocate.start_error(RuntimeError(text)) == line


def test_prompts_over_the_engine_context_are_refused_at_setup():
    rollouts = VLLMRollouts("tiny-vllm", VLLMSettings(max_model_length=8))
    rollouts.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=8)))
    rows = [{"prompt_ids": [1] * 3, "sample_id": "a"}, {"prompt_ids": [1] * 5, "sample_id": "train:7"}]
    rollouts.check_context([(rows, 3, "training prompt")])  # 5 + 3 = 8 fits
    with pytest.raises(RolloutError) as e:
        rollouts.check_context([([], 99, "evaluation prompt"), (rows, 4, "training prompt")])
    assert str(e.value) == ("use_vllm: the training prompt 'train:7' has 5 tokens; with 4 new tokens it exceeds the "
                            "engine's context of 8 tokens (vllm_max_model_length=8). Raise "
                            "--model.init_args.vllm_max_model_length (null: the model's context) or lower the "
                            "new-token budget.")
