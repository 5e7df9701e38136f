"""GRPOModule: learning on a trivial reward, on-policy ratio 1, KL to the reference, step normalisation across
micro-batches, sync reproducibility, async mode, greedy evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.grpo_data import GRPODataModule
from lit_llm.objectives.grpo import grpo_loss
from lit_llm.policy.generation import generate_tokens, pad_rows, resolve_generation_config
from lit_llm.policy.logprobs import completion_log_probs, model_token_log_probs
from lit_llm.rollouts.dynamic_sampling import informative_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def frac_reward(prompts, completions, completion_ids, **kwargs):
    """Trivial reward: fraction of completion ids divisible by 8 (about 1/8 at random)."""
    return [sum(i % 8 == 0 for i in c) / max(1, len(c)) for c in completion_ids]


class Recorder(Callback):
    """Keeps the logged metrics of every training batch."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def fit(steps: int, *, lr: float = 3e-2, callbacks=(), dm_kwargs=None, **module_kwargs):
    kw = dict(reward_funcs=[frac_reward], num_generations=8, max_new_tokens=4, micro_batch_size=32,
              log_samples_every=0, optimizer=lambda p: torch.optim.AdamW(p, lr=lr))
    kw.update(module_kwargs)
    module = GRPOModule("tiny", **kw)
    dm = GRPODataModule(**{"batch_size": 2, "num_train": 200, "num_eval": 0, **(dm_kwargs or {})})
    rec = Recorder()
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[rec, *callbacks],
                      num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, dm)
    return module, rec.steps


def test_reward_rises_on_trivial_task():
    """Gradients flow in the right direction: the mean reward climbs from ~1/8 towards 1 in 24 steps."""
    _, steps = fit(24)
    rewards = [s["train/reward"] for s in steps]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert first < 0.3 and last > first + 0.4, rewards


def test_first_on_policy_iteration_has_ratio_one_and_no_clipping():
    _, steps = fit(2, num_iterations=1)
    for s in steps:
        assert abs(s["train/ratio_min"] - 1) < 1e-4 and abs(s["train/ratio_max"] - 1) < 1e-4
        assert s["train/clip_ratio/region_mean"] == 0.0
        assert s["train/staleness"] == 0.0
        # a step = the callback's rollout (generation + rewards) + training
        assert s["time/step"] >= s["time/rollout_wait"] + s["time/training"] - 1e-6
        assert s["time/rollout_wait"] >= s["time/generation"] > 0
        for key in ("train/loss", "train/entropy", "train/grad_norm", "time/generation", "time/training",
                    "train/tokens_per_sec", "train/completions/mean_length", "train/frac_reward_zero_std"):
            assert math.isfinite(s[key]), key
    # mu = 2: the second optimizer step on the same rollouts sees ratios != 1 (importance-corrected)
    module, steps = fit(2, num_iterations=2, lr=1e-2)
    assert module.global_step == 2 and len(steps) == 1
    assert steps[0]["train/ratio_max"] - steps[0]["train/ratio_min"] > 1e-3


def test_kl_zero_at_reference_then_positive():
    module, steps = fit(3, beta=0.1)
    reference = module.versions.reference_version.model
    assert reference is not module.model and not any(p.requires_grad for p in reference.parameters())
    assert abs(steps[0]["train/kl"]) < 1e-6
    assert steps[-1]["train/kl"] > 1e-6
    no_ref, _ = fit(1, beta=0.0)
    assert no_ref.versions.reference_version is None and "train/kl" not in _[0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_step_normalisation_independent_of_micro_batching(loss_type, tokenizer):
    """Sum of micro-batch losses with the step-level count == the loss of the whole batch at once."""
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=4, max_new_tokens=5, loss_type=loss_type,
                        mask_truncated_completions=False, rollout_seed=1)
    dm = GRPODataModule(batch_size=3, num_train=20, num_eval=0, tokenizer="tiny")
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    rollout = module.engine.rollout(batch, step=0)
    rollout.advantage = torch.linspace(-1, 1, 12)  # non-trivial advantages
    module.micro_batch_size = 12
    whole = module.micro_batches(rollout)
    module.micro_batch_size = 5
    parts = module.micro_batches(rollout)
    assert len(parts) == 3 and sum(p.num_rows for p in parts) == 12
    norm_whole, norm_parts = module.step_denominator(whole), module.step_denominator(parts)
    assert float(norm_whole) == float(norm_parts)
    loss_whole, _ = module.micro_batch_loss(whole[0], norm_whole.float())
    loss_parts = sum(module.micro_batch_loss(p, norm_parts.float())[0] for p in parts)
    assert torch.allclose(loss_whole, loss_parts, atol=1e-6)


def test_micro_batches_rebuild_the_rollout_rows(tokenizer):
    """Micro-batches hold exactly each rollout row's tokens and generation-time log-probs, with one prompt row per
    distinct prompt, and keep groups together."""
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=4, max_new_tokens=6, rollout_seed=3)
    rollout = module.engine.rollout({"prompt": ["What is 1 + 1?", "Hello", "Say hi", "What is 2 + 2?"]}, step=0)
    full = rollout.full_rows()
    rows = {(rollout.sample_id[i], tuple(full[i].tolist())): i for i in range(16)}
    for size, n_prompts in ((16, [4]), (8, [2, 2]), (6, [2, 2, 1])):
        module.micro_batch_size = size
        mbs = module.micro_batches(rollout)
        assert [mb.prompt_ids.shape[0] for mb in mbs] == n_prompts
        seen = []
        for mb in mbs:
            for k, row in enumerate(mb.full_rows()):
                i = rows[(mb.sample_id[k], tuple(row.tolist()))]
                seen.append(i)
                c = int(mb.completion_lengths[k])
                assert torch.equal(mb.completion_ids[k, :c], rollout.completion_ids[i, :c])
                assert torch.equal(mb.old_log_probs[k, :c], rollout.old_log_probs[i, :c])
                assert (mb.old_log_probs[k, c:] == 0).all() and not mb.loss_mask[k, c:].any()
                assert float(mb.advantage[k]) == float(rollout.advantage[i])
                assert int(mb.group[k]) == int(rollout.group[i])
            assert int(module.micro_batch_real_tokens(mb)) == sum(r.numel() for r in mb.full_rows())
            assert len(set(mb.group.tolist())) == mb.prompt_ids.shape[0]  # groups stay whole
        assert sorted(seen) == list(range(16))


@pytest.mark.parametrize("share_prompts", [True, False])
def test_micro_batch_log_probs_match_full_kernel(tiny, tokenizer, share_prompts):
    """The log-prob version's distribution on a micro-batch == the full-row kernel on the rollout rows; ratio 1
    against the sampler's log-probs."""
    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=3, max_new_tokens=5, micro_batch_size=4,
                        temperature=0.7, share_prompts=share_prompts)
    rollout = module.engine.rollout({"prompt": ["What is 1 + 1?", "Hello"]}, step=0)
    for mb in module.micro_batches(rollout):
        rows = mb.full_rows()
        ids, attn = pad_rows(rows, 0), pad_rows([torch.ones(r.numel(), dtype=torch.bool) for r in rows], False)
        ref, ref_ent = model_token_log_probs(module.model, ids, attn, temperature=0.7, return_entropy=True)
        dist = module.versions.log_prob_version.get_dist(mb.policy_inputs())
        lp, ent = dist.log_prob_and_entropy(mb.completion_ids)
        m = mb.completion_mask
        expected = torch.cat([ref[k, -int(c):] for k, c in enumerate(mb.completion_lengths)])
        expected_ent = torch.cat([ref_ent[k, -int(c):] for k, c in enumerate(mb.completion_lengths)])
        assert torch.allclose(lp[m], expected, atol=1e-5) and (lp[~m] == 0).all()
        assert torch.allclose(ent[m], expected_ent, atol=1e-5)
        _, stats = grpo_loss(lp, mb.old_log_probs, mb.advantage, m)
        assert abs(float(stats["ratio_min"]) - 1) < 1e-4 and abs(float(stats["ratio_max"]) - 1) < 1e-4
        args = (mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask, mb.prompt_index)
        assert torch.equal(lp, completion_log_probs(module.model, *args, share_prompts=share_prompts,
                                                    temperature=0.7))


def test_sync_mode_is_reproducible():
    a, steps_a = fit(3, lr=1e-2)
    b, steps_b = fit(3, lr=1e-2)
    assert [s["train/reward"] for s in steps_a] == [s["train/reward"] for s in steps_b]
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_async_mode_trains_with_bounded_staleness():
    module, steps = fit(5, rollout_mode="async", max_staleness=2, sync_every=1)
    assert module.global_step == 5
    producer = module.async_rollouts
    assert producer is not None and producer.engine.model is not module.model
    assert all(s["train/staleness"] <= 2 for s in steps)
    assert any(s["train/staleness"] >= 1 for s in steps)  # generated ahead, from older weights
    # the producer's copy received the weights of the latest sync
    assert producer.trainer_version == 5
    assert math.isfinite(steps[-1]["train/loss"])


class PromptIds(Callback):
    """The sample ids (one per prompt, in order) of every training batch."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ids = batch["sample_id"] if isinstance(batch, dict) else batch.sample_id  # sync: prompts; async: rollouts
        self.steps.append(list(dict.fromkeys(ids)))


def _async_fit(tmp_path, name, max_steps, ckpt_path=None, *, max_epochs=None, rollout_mode="async",
               cli_checkpoints=False) -> list[list[str]]:
    """Sample ids of every step of a fit; checkpoints every step (``cli_checkpoints``: the CLI's, every 3 steps
    and ``last.ckpt`` at the end of training, where Lightning counts the epoch as finished)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_llm.lightning.callbacks import StepCheckpoint

    module = GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=2, max_new_tokens=2, log_samples_every=0,
                        rollout_mode=rollout_mode, max_staleness=100)
    dm = GRPODataModule(batch_size=2, num_train=8, num_eval=0)  # 4 steps per epoch
    ids = PromptIds()
    trainer = Trainer(max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", logger=False,
                      enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=tmp_path / name,
                      callbacks=[ids, StepCheckpoint(tmp_path / name, save_last=True, every_n_train_steps=3)
                                 if cli_checkpoints else
                                 ModelCheckpoint(tmp_path / name, save_last=True, every_n_train_steps=1)])
    trainer.fit(module, dm, ckpt_path=ckpt_path, weights_only=False)  # hparams hold the test's reward function
    return ids.steps


@pytest.mark.slow  # three fits, ~6 s; the default suite checks the same resume on a stub engine (test_grpo_data.py)
def test_async_resume_trains_the_prompts_of_the_uninterrupted_run(tmp_path):
    """Lightning end to end: an asynchronous run stopped after 2 steps (its producer a queued and a generated batch
    ahead) and resumed from last.ckpt trains on exactly the uninterrupted run's prompt batches, into the next epoch;
    every epoch trains all its batches (Lightning's iterability check no longer starts a producer that draws some)."""
    full = _async_fit(tmp_path, "full", 5)
    assert len(full) == 5 and len({s for step in full[:4] for s in step}) == 8  # epoch 0: every prompt once
    part = _async_fit(tmp_path, "part", 2)
    part += _async_fit(tmp_path, "part", 5, ckpt_path=str(tmp_path / "part" / "last.ckpt"))
    assert part == full


def test_greedy_evaluation_logs_accuracy_before_and_during(tokenizer, tmp_path):
    from lightning.pytorch.loggers import Logger

    module = GRPOModule("tiny", reward_funcs=[frac_reward], eval_reward_funcs=[frac_reward], num_generations=2,
                        max_new_tokens=3, eval_max_new_tokens=5, micro_batch_size=8, log_samples_every=0)
    dm = GRPODataModule(batch_size=2, num_train=20, num_eval=6, eval_batch_size=4)
    logged: list[tuple[dict, int]] = []

    class Capture(Logger):
        name, version, log_dir = "capture", 0, None

        def log_metrics(self, metrics, step=None):
            logged.append((dict(metrics), step))

        def log_hyperparams(self, *args, **kwargs):
            pass

    dm.setup()
    prompts = [r["prompt_ids"] for r in dm.eval_rows]
    config = resolve_generation_config({"max_new_tokens": 5, "do_sample": False}, module.model, module.tokenizer)

    def plain_greedy():  # the plain greedy loop, for comparison
        module.model.eval()
        out = generate_tokens(module.model, prompts, config).response_ids
        module.model.train()
        return out

    greedy = plain_greedy()
    assert [torch.equal(a, b) for a, b in zip(module.greedy_responses({"prompt_ids": prompts}), greedy)] == [True] * 6
    before = sum(frac_reward(None, None, [g.tolist() for g in greedy])) / 6
    trainer = Trainer(max_steps=2, accelerator="cpu", logger=Capture(), enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=-1,
                      val_check_interval=2, check_val_every_n_epoch=None, default_root_dir=str(tmp_path))
    trainer.fit(module, dm)
    evals = [(m, s) for m, s in logged if "eval/frac_reward" in m]
    assert len(evals) == 2 and evals[0][1] == 0  # before training (sanity check, step 0), then after 2 steps
    assert evals[0][0]["eval/frac_reward"] == pytest.approx(before, abs=1e-6)
    after = sum(frac_reward(None, None, [g.tolist() for g in plain_greedy()])) / 6
    assert evals[1][0]["eval/frac_reward"] == pytest.approx(after, abs=1e-6)
    assert (tmp_path / "eval_samples.csv").read_text().count("arithmetic-eval") == 8  # 4 rows x 2 evaluations


def test_invalid_settings_are_named():
    with pytest.raises(ValueError, match="num_generations must be an integer >= 2"):
        GRPOModule("tiny", reward_funcs=[frac_reward], num_generations=1)
    with pytest.raises(ValueError, match="rollout_mode must be 'sync' or 'async'"):
        GRPOModule("tiny", reward_funcs=[frac_reward], rollout_mode="fast")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GRPOModule("tiny", reward_funcs=[frac_reward], temperature=0.0)
    with pytest.raises(ValueError, match="dynamic_sampling needs rollout_mode 'sync'"):
        GRPOModule("tiny", reward_funcs=[frac_reward], rollout_mode="async", dynamic_sampling=True)
    with pytest.raises(ValueError, match="max_sampling_rounds must be an integer >= 1"):
        GRPOModule("tiny", reward_funcs=[frac_reward], max_sampling_rounds=0)
    with pytest.raises(ValueError, match="max_sampling_rounds 1 draws no extra prompt batch .* set max_sampling_rounds "
                                         ">= 2"):
        GRPOModule("tiny", reward_funcs=[frac_reward], dynamic_sampling=True, max_sampling_rounds=1)
    GRPOModule("tiny", reward_funcs=[frac_reward], dynamic_sampling=False, max_sampling_rounds=1)  # unused: no error
    with pytest.raises(ValueError, match="dynamic_sampling must be true or false, got None"):
        GRPOModule("tiny", reward_funcs=[frac_reward], dynamic_sampling=None)


def odd_answers_only(prompts, completions, completion_ids, answer, **kwargs):
    """frac_reward where the problem's answer is odd; 0.5 for every completion of an even one (a zero-std group)."""
    return [0.5 if int(a) % 2 == 0 else frac_reward(None, None, [c])[0] for a, c in zip(answer, completion_ids)]


class RolloutSpy(Callback):
    """Records what the callback's rollout returns (the trained batch) and the prompt loader's position."""

    def __init__(self) -> None:
        self.trained: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        switch = pl_module.versions
        rollout = switch.rollout

        def spy(batch, step):
            out = rollout(batch, step)
            self.trained.append((out, switch.last_sampling_rounds, switch.last_generated_tokens))
            return out

        switch.rollout = spy


def test_dynamic_sampling_trains_informative_groups_and_draws_extra_prompts():
    spy, epochs = RolloutSpy(), set()

    def odd_answers_recording_epoch(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        epochs.add(trainer_state.epoch)
        return odd_answers_only(prompts, completions, completion_ids, answer)

    module, steps = fit(4, reward_funcs=[odd_answers_recording_epoch], dynamic_sampling=True, max_sampling_rounds=4,
                        callbacks=[spy], dm_kwargs={"batch_size": 4})
    assert len(spy.trained) == 4
    rounds = [r for _, r, _ in spy.trained]
    assert [s["train/sampling_rounds"] for s in steps] == rounds
    assert all(r > 1 for r in rounds)  # about half of each batch is zero-std, so every step draws more
    assert any(r < 4 for r in rounds)  # and most find 4 informative groups before the last round
    for (rollout, r, generated), s in zip(spy.trained, steps):
        # generation throughput counts every round's tokens (more than the trained batch's when rounds were added)
        assert generated > int(rollout.completion_lengths.sum())
        assert s["rollout/tokens_per_sec"] * s["time/generation"] == pytest.approx(generated, rel=1e-4)
        assert rollout.num_rows == 4 * 8 and rollout.group.tolist() == [k // 8 for k in range(32)]
        informative = informative_groups(rollout.reward, 8)
        if r < 4:  # found enough before the last round: no zero-std group is trained
            assert bool(informative.all())
    # the loader handed out one batch per round (the fit loop's own included)
    assert module.versions._prompt_loader.state_dict()["position"] == sum(rounds)
    # the reward functions' trainer_state.epoch counts every batch drawn (200 prompts / 4 = 50 batches per epoch), not
    # the optimizer steps: one value per round, 0, 1/50, 2/50, ...
    assert sorted(epochs) == [i / 50 for i in range(sum(rounds))]
    # frac_reward_zero_std is over every group drawn: about half, never 0 although the trained batches are
    assert all(0 < s["train/frac_reward_zero_std"] < 1 for s in steps)


def test_dynamic_sampling_off_draws_one_batch_per_step():
    module, steps = fit(2, reward_funcs=[odd_answers_only])
    assert "train/sampling_rounds" not in steps[0]
    assert module.versions._prompt_loader is None


def test_dynamic_sampling_without_the_prompt_loader_is_an_error(tokenizer):
    module = GRPOModule("tiny", reward_funcs=[frac_reward], dynamic_sampling=True, max_new_tokens=2)
    batch = GRPODataModule(batch_size=2, num_train=20, num_eval=0, tokenizer="tiny")
    batch.setup("fit")
    prompts = next(iter(batch.train_dataloader()))  # a loader never handed to the module's wrap_train_loader
    with pytest.raises(RuntimeError, match="dynamic_sampling is on, but no prompt loader was handed"):
        module.versions.rollout(prompts, 0)


@pytest.mark.slow  # three fits, ~4-5 s; the default suite checks the checkpoint handling (test_grpo_data.py)
@pytest.mark.parametrize("rollout_mode", ["sync", "async"])
def test_resume_after_a_finished_epoch_trains_the_next_epochs_prompts(tmp_path, rollout_mode):
    """Resumed with ``max_steps=-1`` from a checkpoint whose epoch counts as finished (Lightning then does not load the
    train loader's state itself), the run trains the uninterrupted run's epoch 1, not epoch 0 again."""
    full = _async_fit(tmp_path, "full", -1, max_epochs=2, rollout_mode=rollout_mode, cli_checkpoints=True)
    assert len(full) == 8 and full[4:] != full[:4]
    part = _async_fit(tmp_path, "part", -1, max_epochs=1, rollout_mode=rollout_mode, cli_checkpoints=True)
    part += _async_fit(tmp_path, "part", -1, str(tmp_path / "part" / "last.ckpt"), max_epochs=2,
                       rollout_mode=rollout_mode, cli_checkpoints=True)
    assert part == full


@pytest.mark.slow  # three fits, ~6 s; the default suite checks the checkpoint handling (test_grpo_data.py)
def test_resume_of_an_epoch_max_steps_stopped_finishes_it(tmp_path):
    """Stopped by ``max_steps=5`` one batch into epoch 1 and resumed with ``max_steps=-1, max_epochs=3``: the run
    trains the rest of epoch 1 and epoch 2, the uninterrupted 3-epoch run's 12 steps (Lightning alone counted epoch 1
    as finished and ran 9 steps)."""
    full = _async_fit(tmp_path, "full", -1, max_epochs=3, rollout_mode="sync", cli_checkpoints=True)
    part = _async_fit(tmp_path, "part", 5, rollout_mode="sync", cli_checkpoints=True)
    part += _async_fit(tmp_path, "part", -1, str(tmp_path / "part" / "last.ckpt"), max_epochs=3,
                       rollout_mode="sync", cli_checkpoints=True)
    assert len(full) == 12 and part == full
