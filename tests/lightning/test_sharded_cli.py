"""Sharded training's command line (issue 28, a fresh user's trial): the bare ``--trainer.strategy
ModelParallelStrategy``, FSDP1 refused, the mesh sizes against ``--trainer.devices``, a sharded checkpoint folder given
to a run without the sharded strategy, and the uneven micro-batch counts refused before the first step: one line each,
in process (``main``), before any process is launched."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_llm.cli_errors import CLIConfigError
from lit_llm.data.datasets import TokenizedExample
from lit_llm.lightning import policy_setup
from lit_llm.lightning.cli import main
from lit_llm.lightning.datamodules import StepBatchLoader
from lit_llm.lightning.sharded_checkpoint import check_strategy_reads_it
from lit_llm.lightning.sharded_options import check_model_parallel_sizes, resolve_strategy

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs/sft_tiny.yaml")
DP, TP = "--trainer.strategy.data_parallel_size", "--trainer.strategy.tensor_parallel_size"
FSDP1 = ("FSDP1 (FSDPStrategy) is not supported; lit-llm shards with FSDP2 (ModelParallelStrategy). Fix: "
         f"--trainer.strategy ModelParallelStrategy {DP} <devices> {TP} 1.")


@pytest.mark.parametrize(("given", "shown"), [
    ("fsdp", "fsdp"), ("fsdp_cpu_offload", "fsdp_cpu_offload"), ("FSDPStrategy", "FSDPStrategy"),
    ({"class_path": "lightning.pytorch.strategies.FSDPStrategy", "init_args": {}},
     "lightning.pytorch.strategies.FSDPStrategy")])
def test_fsdp1_is_refused_naming_model_parallel(given, shown):
    with pytest.raises(ValueError) as e:
        resolve_strategy(given)
    assert str(e.value) == f"--trainer.strategy {shown}: {FSDP1}"


def test_bare_model_parallel_becomes_the_class_others_unchanged():
    path = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}
    assert resolve_strategy("ModelParallelStrategy") == path
    assert resolve_strategy("lightning.pytorch.strategies.ModelParallelStrategy") == path
    for other in ("auto", "ddp", None, {"class_path": "lightning.pytorch.strategies.DDPStrategy"}):
        assert resolve_strategy(other) is other


def test_fsdp1_on_the_command_line_is_one_line():
    with pytest.raises(ValueError) as e:
        main(["fit", "--config", SFT, "--trainer.strategy", "fsdp"])
    assert str(e.value) == f"--trainer.strategy fsdp: {FSDP1}"


def fake_trainer(devices: int, nodes: int = 1) -> SimpleNamespace:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return SimpleNamespace(strategy=ModelParallelStrategy(), num_devices=devices, num_nodes=nodes)


def sharded_config(dp, tp, devices=None) -> dict:
    """The ``trainer`` section of a parsed config (``devices``: as given; ``None``: left out)."""
    return {"strategy": {"init_args": {"data_parallel_size": dp, "tensor_parallel_size": tp}},
            **({} if devices is None else {"devices": devices})}


def sizes_error(devices: int, dp, tp, nodes: int = 1, given=None) -> str:
    with pytest.raises(ValueError) as e:
        check_model_parallel_sizes(fake_trainer(devices, nodes), sharded_config(dp, tp, given))
    return str(e.value)


def test_sizes_against_devices_and_tensor_parallel():
    assert sizes_error(2, 4, 1) == (
        f"--trainer.devices 2 makes 2 processes, but {DP} 4 x {TP} 1 is a mesh of 4. Fix: {DP} 2 {TP} 1, or "
        f"--trainer.devices 4.")
    assert sizes_error(2, 2, "auto") == (
        f"--trainer.devices 2 makes 2 processes, but {DP} 2 x {TP} auto (= 2 x 2) is a mesh of 4. Fix: {DP} 2 {TP} "
        f"1.")
    assert sizes_error(4, 2, 1, nodes=2) == (
        f"--trainer.devices 4 x --trainer.num_nodes 2 makes 8 processes, but {DP} 2 x {TP} 1 is a mesh of 2. Fix: "
        f"{DP} 8 {TP} 1, or --trainer.devices 1.")
    assert sizes_error(2, 1, 2) == (
        f"{TP} 2: lit-llm shards with data-parallel FSDP2 only, not tensor parallel. Fix: {DP} 2 {TP} 1.")
    for devices, dp, tp in [(2, 2, 1), (1, "auto", "auto"), (4, 4, 1)]:  # what runs
        check_model_parallel_sizes(fake_trainer(devices), sharded_config(dp, tp, "auto"))
    check_model_parallel_sizes(SimpleNamespace(strategy="ddp"), None)  # not sharded: nothing read


def test_devices_shown_as_given_with_what_they_resolved_to():
    """A user who typed ``auto`` (or ``-1``, a list) reads it back, with the number of devices it made here; a number
    is shown once."""
    assert sizes_error(1, 2, 1, given="auto") == (
        f"--trainer.devices auto (1 device here) makes 1 process, but {DP} 2 x {TP} 1 is a mesh of 2. Fix: {DP} 1 "
        f"{TP} 1, or --trainer.devices 2.")
    assert sizes_error(4, 2, 1, given=-1).startswith("--trainer.devices -1 (4 devices here) makes 4 processes, but ")
    assert sizes_error(2, 4, 1, given=[0, 1]).startswith("--trainer.devices [0, 1] (2 devices here) makes 2 ")
    assert sizes_error(2, 4, 1, given="2").startswith("--trainer.devices 2 makes 2 processes, but ")
    assert sizes_error(2, 4, 1, given=2).startswith("--trainer.devices 2 makes 2 processes, but ")


def test_bare_model_parallel_on_two_devices_is_one_line_naming_both_sizes(tmp_path):
    """The bare class name is built (not Lightning's "invalid strategy name"); its default sizes (``auto``) make a
    tensor-parallel mesh of the 2 devices: refused when the Trainer is built, before any process is launched."""
    with pytest.raises(CLIConfigError) as e:
        main(["fit", "--config", SFT, "--trainer.devices", "2", "--trainer.strategy", "ModelParallelStrategy",
              "--trainer.default_root_dir", str(tmp_path)])
    assert str(e.value).splitlines() == [
        f"{TP} auto (Lightning's default: the 2 devices per node): lit-llm shards with data-parallel FSDP2 only, not "
        f"tensor parallel. Fix: {DP} 2 {TP} 1.",
        "  (LIT_LLM_DEBUG=1 shows the traceback)"]
    assert not any(tmp_path.iterdir())  # nothing written


def test_devices_auto_on_the_command_line_is_shown_as_given(tmp_path):
    """The fresh user's case: ``--trainer.devices auto`` (1 CPU device here) with a mesh of 2."""
    with pytest.raises(CLIConfigError) as e:
        main(["fit", "--config", SFT, "--trainer.devices", "auto", "--trainer.strategy", "ModelParallelStrategy",
              DP, "2", TP, "1", "--trainer.default_root_dir", str(tmp_path)])
    assert str(e.value).splitlines() == [
        f"--trainer.devices auto (1 device here) makes 1 process, but {DP} 2 x {TP} 1 is a mesh of 2. Fix: {DP} 1 "
        f"{TP} 1, or --trainer.devices 2.",
        "  (LIT_LLM_DEBUG=1 shows the traceback)"]
    assert not any(tmp_path.iterdir())  # nothing written


def sharded_folder(tmp_path: Path, ranks: int = 2) -> Path:
    """A distributed checkpoint folder as ModelParallelStrategy writes it: ``meta.pt``, ``.metadata``, one
    ``__<rank>_0.distcp`` per process (written by one process, one file per entry, renamed as ``ranks`` processes
    name them: the folder check reads ``.metadata`` and the file sizes, the strategy refusal counts the files)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "last.ckpt"
    state = {"state_dict": {f"w{r}": torch.ones(2) for r in range(ranks)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=False), no_dist=True)
    index = dcp.FileSystemReader(folder).read_metadata()
    for info in index.storage_data.values():  # __0_<r>.distcp -> __<r>_0.distcp
        r = info.relative_path.removeprefix("__0_").removesuffix(".distcp")
        (folder / info.relative_path).rename(folder / f"__{r}_0.distcp.tmp")
        info.relative_path = f"__{r}_0.distcp"
    for f in folder.glob("*.tmp"):
        f.rename(f.with_suffix(""))
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(index, f)
    torch.save({"hyper_parameters": {"_class_path": "lit_llm.lightning.SFTModule", "model": "tiny"}},
               folder / "meta.pt")
    assert sorted(p.name for p in folder.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(ranks)]
    return folder


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_sharded_folder_without_the_sharded_strategy_is_one_line(subcommand, tmp_path):
    folder = sharded_folder(tmp_path)
    then = ("--model.init_args.model DIR (its weights in a new run, not a resume)" if subcommand == "fit"
            else "--model.init_args.model DIR")
    other = ("another count also resumes, but with other batches per step and the generator states not restored"
             if subcommand == "fit" else "another count reads it too")
    with pytest.raises(ValueError) as e:
        main([subcommand, "--config", SFT, "--ckpt_path", str(folder), "--trainer.default_root_dir", str(tmp_path)])
    assert str(e.value) == (
        f"--ckpt_path {folder}: a sharded checkpoint (a distributed checkpoint folder written by 2 processes under "
        f"--trainer.strategy ModelParallelStrategy), which {subcommand} reads only under that strategy. Fix: "
        f"{subcommand} under it (--trainer.strategy ModelParallelStrategy {DP} 2 {TP} 1 --trainer.devices 2: the "
        f"processes that wrote it; {other}), or `lit-llm export --ckpt_path {folder} --out DIR` first and "
        f"{subcommand} {then}.")
    check_strategy_reads_it(folder, sharded=True, subcommand=subcommand)  # the sharded strategy reads it
    check_strategy_reads_it(tmp_path / "missing.ckpt", sharded=False, subcommand=subcommand)  # not a folder: later


def fake_samples(n: int) -> list[TokenizedExample]:
    mask = torch.tensor([False, True, True])
    return [TokenizedExample(torch.arange(3), mask, mask, torch.arange(1), f"s:{i}") for i in range(n)]


def plan_error(n: int, batch_size: int, micro_batch_size: int, world_size: int, monkeypatch) -> str | None:
    """:func:`check_sharded_step_plan`'s message for a sharded model and rank 0's loader (``None``: accepted)."""
    monkeypatch.setattr("lit_llm.policy.sharding.is_sharded", lambda model: True)
    loader = StepBatchLoader(fake_samples(n), batch_size=batch_size, micro_batch_size=micro_batch_size,
                             pad_token_id=0, seed=1, world_size=world_size)
    try:
        policy_setup.check_sharded_step_plan(SimpleNamespace(model=None), loader)
    except ValueError as e:
        assert loader.rank == 0  # the loader itself is unchanged
        return str(e)
    return None


def test_uneven_micro_batches_refused_before_the_first_step(monkeypatch):
    """13 samples, 2 ranks x batch 4, micro-batch 2: one step of 5 samples dealt 3 + 2, i.e. 2 and 1 micro-batches
    (docs/distributed.md's example); wherever the shuffled step order puts it, it is refused at the start."""
    assert plan_error(13, 4, 2, 2, monkeypatch) == (
        "Sharded training: one step of every epoch would give the ranks different numbers of micro-batches (rank 0: "
        "2, rank 1: 1: 13 training samples leave a step of 5 for 2 ranks x data.batch_size 4, data.micro_batch_size "
        f"2); FSDP2 needs the same forward passes on every rank. Fix: {policy_setup.MICRO_BATCH_FIX}")
    assert plan_error(12, 4, 2, 2, monkeypatch) is None  # a last step of 4 dealt 2 + 2: one micro-batch each
    assert plan_error(14, 4, 2, 2, monkeypatch) is None  # a last step of 6 dealt 3 + 3: 2 and 2
    assert plan_error(13, 4, 4, 2, monkeypatch) is None  # micro-batch = batch: one micro-batch each
    policy_setup.check_sharded_step_plan(SimpleNamespace(model=None), [])  # no epoch_plan: the per-step check


def test_grpo_prompt_loader_left_to_the_per_step_check(monkeypatch):
    """GRPO's PromptBatchLoader has an epoch plan of prompts but no micro-batches (every rank rolls out batch_size
    prompts: equal counts by construction): accepted at the start, even with prompts that do not divide evenly."""
    from lit_llm.lightning.grpo_data import PromptBatchLoader

    monkeypatch.setattr("lit_llm.policy.sharding.is_sharded", lambda model: True)
    loader = PromptBatchLoader([{"prompt_ids": [i]} for i in range(13)], batch_size=4, seed=1, world_size=2)
    assert callable(loader.epoch_plan) and not hasattr(loader, "micro_batch_size")
    policy_setup.check_sharded_step_plan(SimpleNamespace(model=None), loader)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_uneven_micro_batches_stop_two_sharded_ranks_before_the_first_step(tmp_path):
    """Through the console script with 2 gloo ranks (~20 s): both ranks stop at the start of training with the one
    line, printed once (by rank 0; exit status 2, no hang, no step run)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for name in ("LIT_LLM_DEBUG", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "lit_llm.cli_entry", "fit", "--config", SFT, "--trainer.devices", "2",
         "--trainer.strategy", "ModelParallelStrategy", DP, "2", TP, "1", "--data.num_samples", "13",
         "--data.batch_size", "4", "--data.micro_batch_size", "2", "--trainer.max_steps", "4",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lit-llm: error: ")]
    assert errors == [
        "lit-llm: error: Sharded training: one step of every epoch would give the ranks different numbers of "
        "micro-batches (rank 0: 2, rank 1: 1: 13 training samples leave a step of 5 for 2 ranks x data.batch_size 4, "
        f"data.micro_batch_size 2); FSDP2 needs the same forward passes on every rank. Fix: "
        f"{policy_setup.MICRO_BATCH_FIX}"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "checkpoints").exists()
