"""LoRA checkpoints: only the adapters (and their optimizer state) plus the base model's identity are saved; resume,
``validate`` and :func:`~lit_llm.lightning.export.load_checkpoint_module` restore them over the base loaded from
the ``model`` option and refuse another base; ``export`` merges into a plain HF folder with the adapted model's
outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from cli_runs import first_error
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_llm.lightning.datamodules import SFTDataModule
from lit_llm.lightning.export import export_checkpoint, load_checkpoint_module
from lit_llm.lightning.module import PolicyModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.models import base_model_identity, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [{"prompt": f"Say the number {i}.", "completion": f"The number is {i}, of course."} for i in range(8)]
ROOT = Path(__file__).resolve().parents[2]
LORA = dict(use_peft=True, lora_r=4, lora_alpha=16, lora_dropout=0.0)


def data(tmp_path) -> SFTDataModule:
    path = tmp_path / "rows.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return SFTDataModule(str(path), batch_size=4, micro_batch_size=2, val_fraction=0.25)


def fit(tmp_path, module, steps: int, *, name: str, ckpt_path: str | None = None):
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                      default_root_dir=tmp_path / name,
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / name / "checkpoints", save_last=True)])
    trainer.fit(module, data(tmp_path), ckpt_path=ckpt_path)
    return trainer, tmp_path / name / "checkpoints" / "last.ckpt"


def lora_module(model: str = "tiny", **kw) -> SFTModule:
    return SFTModule(model, **{**LORA, **kw}, optimizer=partial(torch.optim.AdamW, lr=3e-2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA SFT run of 2 steps and its last.ckpt, and a full fine-tuning run for the size comparison."""
    tmp = tmp_path_factory.mktemp("lora_ckpt")
    module = lora_module()
    _, ckpt = fit(tmp, module, 2, name="lora")
    full = SFTModule("tiny", optimizer=partial(torch.optim.AdamW, lr=1e-3))
    _, full_ckpt = fit(tmp, full, 2, name="full")
    return tmp, module, ckpt, full_ckpt


def test_checkpoint_holds_only_adapters_their_optimizer_state_and_the_base_identity(trained):
    tmp, module, ckpt, full_ckpt = trained
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    adapters = {f"model.{n}" for n, p in module.model.named_parameters() if p.requires_grad}
    model_keys = {k for k in saved["state_dict"] if k.startswith("model.")}
    assert model_keys == adapters and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    for k in model_keys:
        torch.testing.assert_close(saved["state_dict"][k], module.state_dict()[k], rtol=0, atol=0)
    assert "trained_tokens" in saved["state_dict"]  # the module's counters stay
    (opt,) = saved["optimizer_states"]
    assert len(opt["state"]) == len(adapters)  # AdamW moments of the adapters only
    record = saved["lit_llm_peft"]
    assert record["base_model"] == base_model_identity("tiny", tiny_model(module.tokenizer))
    assert record["base_model"]["model_name_or_path"] == "tiny" and len(record["base_model"]["config_sha256"]) == 64
    assert record["lora"]["lora_r"] == 4 and record["trainable"] == sorted(adapters)
    assert ckpt.stat().st_size < 0.05 * full_ckpt.stat().st_size, (ckpt.stat().st_size, full_ckpt.stat().st_size)


def test_load_checkpoint_module_restores_adapters_over_the_base(trained):
    _, module, ckpt, _ = trained
    loaded = load_checkpoint_module(ckpt)
    # written by a plain Trainer (no CLI class path): a PolicyModule with the saved model options
    assert isinstance(loaded, PolicyModule) and not loaded.training and loaded.model_config.use_peft
    mine = dict(module.model.named_parameters())
    fresh = dict(tiny_model(module.tokenizer).named_parameters())
    for n, p in loaded.model.named_parameters():
        torch.testing.assert_close(p, mine[n], rtol=0, atol=0)
        if not p.requires_grad:  # frozen base == the tiny model's initial weights
            base_name = n.removeprefix("base_model.model.").replace(".base_layer", "")
            torch.testing.assert_close(p, fresh[base_name], rtol=0, atol=0)


def test_resume_restores_adapters_and_optimizer_and_continues(trained, tmp_path):
    tmp, module, ckpt, _ = trained
    again = lora_module()
    trainer, _ = fit(tmp_path, again, 3, name="resumed", ckpt_path=str(ckpt))
    assert trainer.global_step == 3
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    params = dict(again.model.named_parameters())
    moved = [k for k, v in saved["state_dict"].items() if k.startswith("model.")
             and not torch.equal(params[k.removeprefix("model.")], v)]
    assert moved  # one more step from the restored adapters
    state = trainer.optimizers[0].state
    assert all(int(s["step"]) == 3 for s in state.values())  # AdamW's step count continued from the checkpoint's 2


def test_resume_refuses_another_base_naming_both(trained, tmp_path, tokenizer):
    _, _, ckpt, _ = trained
    other = tmp_path / "other-base"
    tiny_model(tokenizer, seed=1, hidden_size=32, num_heads=2).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ValueError, match=rf"trained on base model 'tiny'.*loads '{other}'.*sha256"):
        fit(tmp_path, lora_module(str(other)), 3, name="other", ckpt_path=str(ckpt))
    # same path, another config (the recorded hash no longer matches)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved["lit_llm_peft"]["base_model"]["config_sha256"] = "0" * 64
    changed = tmp_path / "changed.ckpt"
    torch.save(saved, changed)
    both = r"'tiny' \(config sha256 000000000000\).*'tiny' \(config sha256 [0-9a-f]{12}\)"
    with pytest.raises(ValueError, match=both):
        load_checkpoint_module(changed)


def test_resume_refuses_mismatched_lora_settings(trained, tmp_path):
    _, _, ckpt, _ = trained
    with pytest.raises(ValueError, match=r"use_peft false"):
        fit(tmp_path, SFTModule("tiny"), 3, name="plain", ckpt_path=str(ckpt))
    with pytest.raises(ValueError, match=r"adapters .* do not match.*lora_r"):
        fit(tmp_path, lora_module(lora_r=2), 3, name="r2", ckpt_path=str(ckpt))
    _, _, _, full_ckpt = trained
    with pytest.raises(ValueError, match=r"holds full weights"):
        fit(tmp_path, lora_module(), 3, name="onfull", ckpt_path=str(full_ckpt))


def test_validate_loads_the_adapter_checkpoint(trained):
    tmp, module, ckpt, _ = trained
    dm = data(tmp)
    kw = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    from_ckpt = Trainer(**kw).validate(lora_module(), dm, ckpt_path=str(ckpt), verbose=False)[0]
    in_memory = Trainer(**kw).validate(module, data(tmp), verbose=False)[0]
    fresh = Trainer(**kw).validate(lora_module(), data(tmp), verbose=False)[0]
    assert from_ckpt["val/loss"] == pytest.approx(in_memory["val/loss"], rel=1e-6)
    assert abs(from_ckpt["val/loss"] - fresh["val/loss"]) > 1e-4  # the adapters were really loaded


def test_export_merges_adapters_into_a_plain_hf_folder(trained, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, module, ckpt, _ = trained
    out = export_checkpoint(ckpt, tmp_path / "merged")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and not any("lora" in k or "base_layer" in k for k in keys)
    assert not (out / "adapter_config.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    module.model.eval()
    prompts = [torch.tensor(tok(t)["input_ids"]) for t in ("Say the number 3.", "What is 2 + 2?")]
    with torch.no_grad():
        ids = prompts[0][None]
        adapted, base_logits = module.model(ids).logits, None
        with module.model.disable_adapter():
            base_logits = module.model(ids).logits
        torch.testing.assert_close(hf(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        assert (adapted - base_logits).abs().max() > 1e-3  # the merge carried the adapters
        ours = module.generate(prompts, max_new_tokens=8)
        for p, mine in zip(prompts, ours):
            theirs = hf.generate(p[None], attention_mask=torch.ones_like(p[None]), max_new_tokens=8,
                                 do_sample=False)[0, p.numel():]
            assert theirs.tolist() == mine.tolist()


def _adapters(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def test_resume_with_lora_dropout_draws_the_uninterrupted_runs_dropout_masks(tmp_path, monkeypatch):
    # LoRA dropout draws from torch's global generator; the checkpoint keeps its state (lit_llm_rng_states), so a run
    # interrupted after step 3 and resumed ends with the uninterrupted run's adapters, bit for bit.
    def run(name: str, steps: int, ckpt_path: str | None = None) -> tuple[SFTModule, object]:
        torch.manual_seed(0)
        module = lora_module(lora_dropout=0.3)
        torch.manual_seed(1234 if ckpt_path else 0)  # a resumed process starts from another generator state
        fit(tmp_path, module, steps, name=name, ckpt_path=ckpt_path)
        return module, tmp_path / name / "checkpoints" / "last.ckpt"

    straight, _ = run("straight", 5)
    _, ckpt = run("first", 3)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)  # as Lightning's resume reads it
    (state,) = saved["lit_llm_rng_states"]  # one process: one rank's states
    assert set(state) == {"torch", "cuda", "python", "numpy"} and state["torch"].dtype == torch.uint8
    resumed, _ = run("resumed", 5, ckpt_path=str(ckpt))
    want = _adapters(straight)
    for name, value in _adapters(resumed).items():
        torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)

    # without the restore the resumed steps draw other masks: the check above can fail
    monkeypatch.setattr("lit_llm.lightning.checkpointing.restore_rng_states", lambda *args: False)
    unrestored, _ = run("unrestored", 5, ckpt_path=str(ckpt))
    assert any(not torch.equal(value, want[name]) for name, value in _adapters(unrestored).items())


def test_resume_with_another_process_count_warns_that_generators_are_not_restored(trained, tmp_path):
    _, _, ckpt, _ = trained
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    saved["lit_llm_rng_states"] = saved["lit_llm_rng_states"] * 2  # as if written by 2 DDP processes
    two = tmp_path / "two_ranks.ckpt"
    torch.save(saved, two)
    with pytest.warns(UserWarning, match=r"saved by 2 process\(es\), this run has 1: they are not restored"):
        fit(tmp_path, lora_module(), 3, name="other_count", ckpt_path=str(two))


# ------------------------------------------------------------------------ from the command line (issue 30 item 4)
def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "OMP_NUM_THREADS": "1"}
    env.pop("LIT_LLM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "lit_llm.cli_entry", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


CLI_LORA = ["--config", str(ROOT / "configs/sft_tiny.yaml"), "--model.init_args.use_peft", "true",
            "--model.init_args.lora_r", "4", "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true",
            "--samples.num_samples", "0"]


@pytest.fixture(scope="module")
def cli_lora_ckpt(tmp_path_factory):
    """``lit-llm fit`` of LoRA adapters over ``model: tiny`` for 1 step: its last.ckpt."""
    run = tmp_path_factory.mktemp("cli_lora") / "run"
    proc = _cli("fit", *CLI_LORA, "--trainer.default_root_dir", str(run), "--trainer.max_steps", "1",
                "--trainer.val_check_interval", "1", "--checkpoint.every_n_train_steps", "1", cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_cli_resume_refuses_lora_adapters_over_another_base(cli_lora_ckpt, tmp_path, tokenizer):
    """``--model.init_args.model OTHER`` with a LoRA checkpoint: refused naming the option and the checkpoint's base
    (LightningCLI re-applied the checkpoint's ``model`` over the command line before, so this could not trigger)."""
    other = tmp_path / "other-base"
    tiny_model(tokenizer, seed=1, hidden_size=32, num_heads=2).save_pretrained(other)
    tokenizer.save_pretrained(other)
    line = first_error(_cli("fit", *CLI_LORA, "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path",
                             str(cli_lora_ckpt), "--model.init_args.model", str(other), "--trainer.max_steps", "2",
                             cwd=tmp_path))
    assert line.startswith(f"lit-llm: error: --ckpt_path {cli_lora_ckpt}: model.init_args.model '{other}' differs "
                           f"from the checkpoint's 'tiny'; model is the base weights and tokenizer the checkpoint's "
                           f"weights (or LoRA adapters) were trained on, so the run cannot resume"), line
    line = first_error(_cli("fit", *CLI_LORA, "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path",
                             str(cli_lora_ckpt), "--model.init_args.lora_r", "8", "--trainer.max_steps", "2",
                             cwd=tmp_path))
    assert line.startswith(f"lit-llm: error: --ckpt_path {cli_lora_ckpt}: model.init_args.lora_r 8 differs from the "
                           f"checkpoint's 4; lora_r is the adapters' shapes"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_cli_resume_refuses_a_base_that_changed_under_the_same_name(cli_lora_ckpt, tmp_path):
    """The same ``model`` option whose config no longer hashes as recorded (a folder rewritten since training): the
    LoRA base check of ``on_load_checkpoint`` names both identities."""
    saved = torch.load(cli_lora_ckpt, map_location="cpu", weights_only=False)
    mine = saved["lit_llm_peft"]["base_model"]["config_sha256"]
    saved["lit_llm_peft"]["base_model"]["config_sha256"] = "0" * 64
    changed = tmp_path / "changed.ckpt"
    torch.save(saved, changed)
    line = first_error(_cli("fit", *CLI_LORA, "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path",
                             str(changed), "--trainer.max_steps", "2", cwd=tmp_path))
    assert line == (
        f"lit-llm: error: The LoRA checkpoint was trained on base model 'tiny' (config sha256 000000000000), but this "
        f"module loads 'tiny' (config sha256 {mine[:12]}); adapters only make sense over the base they were trained "
        f"on. Set model: tiny (the same folder, unchanged), or start a new run."), line
