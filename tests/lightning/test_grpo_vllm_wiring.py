"""GRPO's ``use_vllm`` wiring without vLLM: the colocated engine is replaced by a stand-in (a separate copy of the
model behind a ``TransformersWrapper``, the push a ``load_state_dict`` into it), so the default suite checks what the
version switch does with an engine — built at setup, every rollout and greedy evaluation sampled from it, the trained
weights pushed at fit start and before every generation whose weights changed (sync), between two rollouts (async),
after a restore (validate) — while ``make test-vllm`` runs the same paths on vLLM itself."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lit_llm.lightning import grpo_options
from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.models import load_model
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.rollouts import vllm_colocate
from lit_llm.rollouts.vllm_colocate import VLLMRollouts, VLLMSettings

pytestmark = pytest.mark.usefixtures("one_thread")


def frac_reward(prompts, completions, completion_ids, **kwargs):
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


class StandInEngine(VLLMRollouts):
    """:class:`VLLMRollouts` whose engine is a copy of the trained model (what vLLM would hold); records every
    generation with the weights key the engine held and the trainer's key at that time."""

    def __init__(self) -> None:
        super().__init__("tiny-vllm", VLLMSettings())
        self.builds: list[dict] = []
        self.generations: list[tuple] = []
        self.versions = None

    def build(self, *, precision, device, trained, tokenizer, generate_kwargs):
        self.builds.append({"precision": precision, "device": device})
        self.llm = load_model(self.model_name)[0].eval().requires_grad_(False)  # the folder's weights, as vLLM
        policy = TransformersWrapper(self.llm, tokenizer=tokenizer, input_mode="tokens",
                                     generate_kwargs=generate_kwargs)
        stand_in = self
        sample = policy._sample

        def recorded(*args, **kwargs):
            stand_in.generations.append((stand_in.pushed_at, stand_in.versions.weights_key()))
            return sample(*args, **kwargs)

        policy._sample = recorded
        original = type(policy).get_new_version

        def get_new_version(self_, **kwargs):  # every version (group, batched, greedy) records too
            new = original(self_, **kwargs)
            new._sample = recorded
            return new

        policy.get_new_version = get_new_version.__get__(policy)
        return policy

    def check_context(self, prompts, limit=None):
        self.context_checks = [(len(rows), budget, what) for rows, budget, what in prompts]
        super().check_context(prompts, limit=self.llm.config.max_position_embeddings)


@pytest.fixture
def stand_in(monkeypatch):
    def push_into_copy(llm, weights):
        result = llm.load_state_dict(dict(weights), strict=False)
        assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result  # tied head

    monkeypatch.setattr(vllm_colocate, "load_weights", push_into_copy)
    monkeypatch.setattr(grpo_options, "check_vllm_installed", lambda owner: None)  # the stand-in needs no vLLM
    return StandInEngine()


class Recorder(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def make_module(engine: StandInEngine, **kwargs) -> GRPOModule:
    kw = dict(reward_funcs=[frac_reward], num_generations=4, max_new_tokens=4, micro_batch_size=16,
              log_samples_every=0, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2), use_vllm=True)
    kw.update(kwargs)
    module = GRPOModule("tiny-vllm", **kw)
    assert isinstance(module.vllm, VLLMRollouts) and module.versions.vllm is module.vllm
    module.vllm = module.versions.vllm = engine
    engine.versions = module.versions
    return module


def trainer_for(steps: int, rec: Callback, **kwargs) -> Trainer:
    """A quiet Trainer; ``default_root_dir`` (where eval_samples.csv goes without a logger) a fresh temporary folder."""
    kwargs.setdefault("default_root_dir", tempfile.mkdtemp(prefix="lit_llm_vllm_wiring_"))
    return Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=[rec], **kwargs)


def test_sync_rollouts_and_greedy_eval_sample_from_the_engine_with_the_trained_weights(stand_in):
    module = make_module(stand_in)
    rec = Recorder()
    dm = GRPODataModule(batch_size=2, num_train=40, num_eval=4, eval_batch_size=4)
    trainer_for(4, rec, num_sanity_val_steps=-1, val_check_interval=2, check_val_every_n_epoch=None).fit(module, dm)
    assert stand_in.builds == [{"precision": "32-true", "device": torch.device("cpu")}]
    assert stand_in.context_checks == [(40, 4, "training prompt"), (4, 4, "evaluation prompt")]
    assert module.engine.policy.model is stand_in.llm is not module.model  # the engine samples, not the trained model
    # pushes: fit start (1, 0); rollouts of steps 1, 3; the evaluations after steps 2 and 4 (their rollouts reuse it)
    assert stand_in.num_pushes == 5
    assert len(stand_in.generations) == 4 + 3  # 4 rollouts (one batched call each), greedy evals at steps 0, 2, 4
    assert all(pushed == current for pushed, current in stand_in.generations)  # never stale weights
    assert [current for _, current in stand_in.generations] == [(1, 0), (1, 0), (1, 1), (1, 2), (1, 2), (1, 3),
                                                                (1, 4)]
    # the engine holds the trained weights: the sampler/trainer mismatch stays at fp32 rounding after updates
    assert all(s["train/mismatch/kl"] < 1e-9 for s in rec.steps), [s["train/mismatch/kl"] for s in rec.steps]
    assert [s["rollout/weight_pushes"] for s in rec.steps] == [1.0, 2.0, 3.0, 4.0]
    assert all(s["time/weight_push"] > 0 for s in rec.steps)
    for name, p in module.model.named_parameters():  # the final evaluation pushed the final weights
        torch.testing.assert_close(stand_in.llm.get_parameter(name), p.detach(), rtol=0, atol=0)


def test_without_pushes_the_engine_would_drift(stand_in, monkeypatch):
    """The control: with the push made a no-op after the first, the mismatch grows (so the test above sees pushes)."""
    calls = []

    def first_only(llm, weights):
        calls.append(1)
        if len(calls) == 1:
            assert not llm.load_state_dict(dict(weights), strict=False).unexpected_keys

    monkeypatch.setattr(vllm_colocate, "load_weights", first_only)
    module = make_module(stand_in)
    rec = Recorder()
    trainer_for(3, rec, limit_val_batches=0, num_sanity_val_steps=0).fit(module, GRPODataModule(
        batch_size=2, num_train=40, num_eval=0))
    assert rec.steps[0]["train/mismatch/kl"] < 1e-9 < rec.steps[2]["train/mismatch/kl"]


def test_async_pushes_between_two_rollouts_and_labels_their_version(stand_in):
    module = make_module(stand_in, rollout_mode="async", sync_every=1, max_staleness=4)
    rec = Recorder()
    trainer_for(4, rec, limit_val_batches=0, num_sanity_val_steps=0).fit(module, GRPODataModule(
        batch_size=2, num_train=40, num_eval=0))
    producer = module.async_rollouts
    assert producer.engine.policy is module.engine.policy  # no copy of the weights: the producer shares the engine
    assert module.versions.num_syncs == 4 and stand_in.num_pushes == 1 + 4  # fit start + after every step
    assert producer.engine.version == 4
    # each rollout came from exactly one pushed version: the one its engine was labelled with
    assert all(pushed is not None for pushed, _ in stand_in.generations)


def test_validate_pushes_the_restored_weights_first(stand_in, tmp_path):
    module = make_module(stand_in, reward_funcs=["lit_llm.rewards:strict_arithmetic_reward"])
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0,
                      limit_val_batches=0)
    dm = GRPODataModule(batch_size=2, num_train=40, num_eval=4, eval_batch_size=4)
    trainer.fit(module, dm)
    ckpt = tmp_path / "step1.ckpt"
    trainer.save_checkpoint(ckpt)
    trained = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    with torch.no_grad():  # weights that differ from the checkpoint's, pushed: validate must replace them
        for p in module.model.parameters():
            p.add_(1.0)
    module.versions.push_weights()
    before = stand_in.num_pushes
    Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path).validate(
        module, dm, ckpt_path=ckpt)
    assert stand_in.num_pushes == before + 1
    assert stand_in.generations[-1][0] == stand_in.generations[-1][1]
    for name, value in trained.items():
        torch.testing.assert_close(stand_in.llm.get_parameter(name), value, rtol=0, atol=0)


def test_lora_pushes_base_plus_adapters(stand_in):
    module = make_module(stand_in, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                         lora_target_modules=["q_proj", "v_proj"])  # dropout would make the trainer differ itself
    rec = Recorder()
    trainer_for(3, rec, limit_val_batches=0, num_sanity_val_steps=0).fit(module, GRPODataModule(
        batch_size=2, num_train=40, num_eval=0))
    assert all(s["train/mismatch/kl"] < 1e-9 for s in rec.steps), [s["train/mismatch/kl"] for s in rec.steps]
    module.versions.push_weights()  # the last step's update (pushed before the next generation, which never came)
    merged = copy.deepcopy(module.model).merge_and_unload()
    for name, p in merged.named_parameters():
        torch.testing.assert_close(stand_in.llm.get_parameter(name), p.detach(), rtol=0, atol=1e-6)
    assert any("lora_" in n for n, _ in module.model.named_parameters())  # the trainer keeps its adapters


def test_checkpoint_of_a_vllm_run_loads_without_vllm(tmp_path):
    """export / predict / chat / evaluate read a use_vllm run's checkpoint in an environment without vLLM."""
    from lit_llm.lightning.export import load_checkpoint_module

    module = GRPOModule("tiny-vllm", reward_funcs=["lit_llm.rewards:strict_arithmetic_reward"], num_generations=2)
    trainer = Trainer(max_steps=0, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "vllm_run.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)
    hp = state["hyper_parameters"]  # as `lit-llm fit --model.init_args.use_vllm true` saves it
    hp["use_vllm"], hp["_class_path"] = True, "lit_llm.lightning.grpo.GRPOModule"
    hp["vllm_kv_cache_gib"] = 0.25
    torch.save(state, ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "vllm_* set but use_vllm is false" for options the user did not set here
        loaded = load_checkpoint_module(ckpt)
    assert loaded.hparams.use_vllm is False and loaded.vllm is None
    for name, p in module.model.named_parameters():
        torch.testing.assert_close(loaded.model.get_parameter(name), p.detach(), rtol=0, atol=0)


def test_a_failed_push_leaves_the_last_checkpoint_intact(stand_in, monkeypatch, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    pushes = []

    def fails_third(llm, weights):
        pushes.append(1)
        if len(pushes) == 3:
            raise RuntimeError("engine lost")
        llm.load_state_dict(dict(weights), strict=False)

    monkeypatch.setattr(vllm_colocate, "load_weights", fails_third)
    module = make_module(stand_in, reward_funcs=["lit_llm.rewards:strict_arithmetic_reward"])
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1, save_top_k=0)
    trainer = Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ckpt], limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="engine lost"):  # the push before step 2's rollout
        trainer.fit(module, GRPODataModule(batch_size=2, num_train=40, num_eval=0))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2  # the last completed step's checkpoint, whole and loadable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
