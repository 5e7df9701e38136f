"""GRPO prompt data: the synthetic arithmetic task (seeded, ranges, disjoint splits), GSM8K prompts, the resumable
prompt loader, and its exact resume behind the asynchronous producer (``StatefulAsyncRollouts``)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lit_llm.data.arithmetic import arithmetic_prompts, arithmetic_split
from lit_llm.data.datasets import DataFormatError
from lit_llm.lightning.grpo_data import GRPODataModule, PromptBatchLoader, collate_prompts, gsm8k_prompts
from lit_llm.lightning.versions import (
    PolicyVersionSwitch,
    StatefulAsyncRollouts,
    restore_train_loader,
    resume_train_loader,
)


def _problem(row):
    a, op, rest = row["prompt"][-1]["content"].removeprefix("What is ").split(" ", 2)
    return int(a), op, int(rest.split("?")[0])


def test_arithmetic_split_seeded_disjoint_and_correct():
    train, held = arithmetic_split(300, 50, seed=3, low=5, high=30, ops=["+", "-", "*"])
    again, held_again = arithmetic_split(300, 50, seed=3, low=5, high=30, ops=["+", "-", "*"])
    assert train == again and held == held_again
    other, _ = arithmetic_split(300, 50, seed=4, low=5, high=30, ops=["+", "-", "*"])
    assert other != train
    problems = [_problem(r) for r in train]
    assert len(set(problems)) == 300 and not set(problems) & {_problem(r) for r in held}
    for row, (a, op, b) in zip(train, problems):
        assert 5 <= a <= 30 and 5 <= b <= 30
        assert row["answer"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert row["prompt"][-1]["content"] == f"What is {a} {op} {b}? Reply with just the number."
    assert {op for _, op, _ in problems} == {"+", "-", "*"}
    assert train[0]["sample_id"] == "arithmetic-train:0" and held[0]["sample_id"] == "arithmetic-eval:0"


def test_arithmetic_errors():
    with pytest.raises(ValueError, match="cannot draw 10 distinct train problems from 4"):
        arithmetic_prompts(10, low=1, high=2)
    with pytest.raises(ValueError, match=r"unknown operator\(s\) \['/'\]"):
        arithmetic_prompts(3, ops=["/"])
    with pytest.raises(ValueError, match="low <= high"):
        arithmetic_prompts(3, low=9, high=1)


def test_gsm8k_prompts(tmp_path, gsm8k_dir):
    rows = gsm8k_prompts(str(gsm8k_dir / "test.jsonl"), system_prompt="Be brief.", limit=3)
    first = json.loads((gsm8k_dir / "test.jsonl").read_text().splitlines()[0])
    assert len(rows) == 3 and rows[0]["answer"] == first["answer"]
    assert rows[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content":
                                                                               first["question"]}]
    assert rows[0]["sample_id"].endswith("test.jsonl:1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: missing or empty key\(s\) \['answer'\]"):
        gsm8k_prompts(str(bad))
    assert len(gsm8k_prompts(str(bad), on_bad_row="skip")) == 1


def test_prompt_loader_deals_ranks_and_resumes():
    rows = [{"prompt": f"p{i}", "sample_id": f"s{i}"} for i in range(10)]
    loader = PromptBatchLoader(rows, batch_size=3, seed=1)
    assert len(loader) == 3
    epoch0 = [b["sample_id"] for b in loader]
    epoch1 = [b["sample_id"] for b in loader]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0) and epoch0 != epoch1
    fresh = PromptBatchLoader(rows, batch_size=3, seed=1)
    it = iter(fresh)
    next(it)
    state = fresh.state_dict()
    resumed = PromptBatchLoader(rows, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    assert [b["sample_id"] for b in resumed] == epoch0[1:]
    r0 = PromptBatchLoader(rows, batch_size=2, seed=1, rank=0, world_size=2)
    r1 = PromptBatchLoader(rows, batch_size=2, seed=1, rank=1, world_size=2)
    a, b = [s for x in r0 for s in x["sample_id"]], [s for x in r1 for s in x["sample_id"]]
    assert len(a) == len(b) == 4 and not set(a) & set(b)
    with pytest.raises(ValueError) as e:
        PromptBatchLoader(rows, batch_size=11)
    assert str(e.value) == ("10 prompts (data.num_train, or the rows of data.path) cannot fill one step of "
                            "batch_size=11 x 1 rank(s); add prompts or lower data.batch_size.")
    # the CLI names the option the user gave (num_train, here from the command line), not the config's batch size
    from lit_llm.cli_errors import explain_config_error

    config = {"data": {"init_args": {"batch_size": 11, "num_train": 10, "path": None}}}
    assert explain_config_error(e.value, config).splitlines()[1] == (
        "  (set by --data.init_args.num_train 10; LIT_LLM_DEBUG=1 shows the traceback)")
    with pytest.raises(ValueError, match="different keys"):
        collate_prompts([{"a": 1}, {"b": 2}])


class _StubEngine:
    """The producer's engine without a model: a rollout is its prompt batch's sample ids with a policy version, -5
    (stale under any ``max_staleness`` while the trainer is at version 0) for batches whose first id is in ``stale``."""

    def __init__(self, stale=()) -> None:
        self.version, self.stale = 0, set(stale)

    def rollout(self, batch, *, step=0):
        version = -5 if batch["sample_id"][0] in self.stale else self.version
        return SimpleNamespace(sample_id=list(batch["sample_id"]), policy_version=torch.tensor([version]), step=step)


def _rows(n=10):
    return [{"prompt": f"p{i}", "sample_id": f"s{i}"} for i in range(n)]


def _producer(stale=(), rank=0, world_size=1):
    loader = PromptBatchLoader(_rows(), batch_size=3 if world_size == 1 else 1, seed=1, rank=rank,
                               world_size=world_size)
    return StatefulAsyncRollouts(_StubEngine(stale), loader, max_staleness=0, queue_size=2), loader


def _wait_drawn(loader, state, timeout=10.0):
    """Wait until the producer has drawn past ``state`` (it runs ahead of the consumer, as in training)."""
    t0 = time.perf_counter()
    while loader.state_dict() == state and time.perf_counter() - t0 < timeout:
        time.sleep(0.01)
    assert loader.state_dict() != state, "the producer drew nothing ahead"


def _trained(producer, epochs):
    """The sample ids of every batch the producer yields over ``epochs`` iterations (one ``iter()`` per epoch, as
    Lightning's fit loop does)."""
    return [b.sample_id for _ in range(epochs) for b in producer]


# plans (seed 1, 10 rows, 3 per step): epoch 0 [7,0,6] [9,3,1] [4,2,5]; epoch 1 [4,5,3] [6,0,1] [9,8,2]; epoch 2
# [6,8,7] ...: "s9", "s6" make [9,3,1] stale before the checkpoint, [6,0,1] (drawn ahead at it) after, and 2 more.
@pytest.mark.parametrize(("world_size", "stale"), [(1, ()), (1, ("s9", "s6")), (2, ())],
                         ids=["one-rank", "stale-drops", "two-ranks"])
def test_async_resume_trains_the_batches_of_the_uninterrupted_run(world_size, stale):
    """A checkpoint of an asynchronous run holds the loader position of the batches training consumed (stale drops
    included), not of those the producer drew ahead: the resumed producer, after Lightning's ``iter()`` check and the
    restore, yields exactly the uninterrupted run's remaining batches, across the epoch boundary, on every rank (under
    DDP the producers drop nothing: the callback drops on all ranks together)."""
    states, resumed = [], []
    for rank in range(world_size):
        full, plan = _producer(stale, rank, world_size)
        expected = _trained(full, 3)
        if not stale:  # the uninterrupted run: every step of the loader's plans, in order
            assert expected == [[f"s{i}" for i in step] for e in range(3) for step in plan.epoch_plan(e)]
        producer, loader = _producer(stale, rank, world_size)
        it = iter(producer)
        first_epoch = [b.sample_id for b in it]  # epoch 0 to its end, then 1 batch of epoch 1
        it = iter(producer)
        first_epoch.append(next(it).sample_id)
        state = producer.state_dict()
        _wait_drawn(loader, state)
        states.append(state)
        restart, restart_loader = _producer(stale, rank, world_size)
        iter(restart)  # Lightning's _check_dataloader_iterable: an iter() never advanced draws nothing
        assert restart_loader.state_dict() == {"epoch": 0, "position": 0} and restart._thread is None
        restart.load_state_dict(state)
        producer.close()
        rest = _trained(restart, 2)  # the rest of epoch 1, then epoch 2
        restart.close()
        assert first_epoch + rest == expected
        resumed.append(first_epoch + rest)
    assert states[0] == {"epoch": 1, "position": 1}  # epoch 0 whole and 1 step of epoch 1 consumed
    assert all(s == states[0] for s in states)  # every rank records the same position: rank 0's file fits all
    if world_size == 2:  # each rank its own share of every step
        assert all(not set(a) & set(b) for a, b in zip(*resumed))
    if stale:
        assert [b[0] for b in resumed[0]] == ["s7", "s4", "s4", "s2", "s3"]  # 4 of 9 batches dropped


def test_async_rollout_seeds_follow_the_prompt_batch_not_the_producer():
    """The seed step of an asynchronous rollout is its prompt batch's index in the run (epoch x steps per epoch +
    position), as the sync mode's ``global_step``: it does not restart at 0 with every epoch's producer (which gave
    every epoch the first epoch's seeds), and a resumed run's batch gets the seeds the uninterrupted run gave it."""
    full, _ = _producer()
    assert [b.step for _ in range(3) for b in full] == list(range(9))
    restart, _ = _producer()
    restart.load_state_dict({"epoch": 1, "position": 1})
    assert [b.step for _ in range(2) for b in restart] == list(range(4, 9))
    plain = StatefulAsyncRollouts(_StubEngine(), [collate_prompts(_rows(2))] * 2)  # no state: a running count
    assert [b.step for _ in range(2) for b in plain] == [0, 1, 2, 3]
    for p in (full, restart, plain):
        p.close()


def test_async_restore_of_an_old_checkpoint_state_and_bad_states():
    """A plain ``{"epoch", "position"}`` (every checkpoint so far) loads; a state without them is a clear error."""
    producer, loader = _producer()
    plan = [[f"s{i}" for i in step] for step in loader.epoch_plan(0)]
    producer.load_state_dict({"epoch": 0, "position": 2})
    assert producer.state_dict() == {"epoch": 0, "position": 2}
    assert [b.sample_id for b in producer] == plan[2:]
    assert producer.state_dict() == {"epoch": 0, "position": 3}
    with pytest.raises(ValueError) as e:
        producer.load_state_dict({"epoch": 0})
    assert str(e.value) == ("PromptBatchLoader.load_state_dict: expected {'epoch': int, 'position': int} (the "
                            "checkpoint's loops.fit_loop.state_dict.combined_loader entry), got {'epoch': 0}.")
    with pytest.raises(ValueError, match=r"epoch and position must be >= 0, got \{'epoch': 0, 'position': -1\}"):
        loader.load_state_dict({"epoch": 0, "position": -1})
    with pytest.raises(TypeError) as e:
        StatefulAsyncRollouts(_StubEngine(), [collate_prompts(_rows(2))]).load_state_dict({"epoch": 0, "position": 0})
    assert str(e.value) == ("AsyncRollouts.restore_prompts: the prompt iterable (list) has no load_state_dict(); use a "
                            "stateful loader such as PromptBatchLoader.")


def test_datamodule_renders_prompt_ids_once(tokenizer):
    dm = GRPODataModule(batch_size=4, num_train=12, num_eval=5, eval_batch_size=2, system_prompt="Be brief.")
    dm.setup()
    assert len(dm.train_rows) == 12 and len(dm.eval_rows) == 5
    row = dm.train_rows[0]
    expected = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    expected = expected["input_ids"] if isinstance(expected, dict) else expected
    assert row["prompt_ids"].tolist() == list(expected)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "sample_id", "prompt_ids"} and len(batch["prompt"]) == 4
    assert all(isinstance(p, torch.Tensor) for p in batch["prompt_ids"])
    assert [len(b["prompt"]) for b in dm.val_dataloader()] == [2, 2, 1]
    short = GRPODataModule(batch_size=1, num_train=4, num_eval=0, max_prompt_length=5)
    with pytest.raises(DataFormatError, match="no training prompt left"):
        short.setup()
    with pytest.raises(ValueError, match="task='gsm8k' needs --data.path"):
        GRPODataModule("gsm8k")


def test_missing_gsm8k_eval_file_names_its_own_option(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    dm = GRPODataModule("gsm8k", path=str(train), eval_path=str(tmp_path / "test.jsonl"), batch_size=1, num_eval=1)
    with pytest.raises(FileNotFoundError, match=r"test\.jsonl.*--data\.eval_path"):
        dm.setup()


# ------------------------------------------------------------------------------------ the user's prompt datasets
PROMPTS = [
    {"prompt": [{"role": "user", "content": "Write add(a, b)."}], "answer": "def add(a, b): return a + b",
     "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
    {"prompt": [{"role": "user", "content": "Write neg(a)."}], "answer": "def neg(a): return -a",
     "tests": ["assert neg(1) == -1"]},
    {"prompt": [{"role": "user", "content": "Write one()."}], "answer": "def one(): return 1",
     "tests": ["assert one() == 1"]},
]


def test_prompt_dataset_columns_reach_the_batch(tmp_path, tokenizer):
    """A Parquet file with a 'prompt' column: every other column is in the batch, exactly the engine's reward kwargs."""
    import datasets

    from lit_llm.rollouts.engine import RESERVED_KEYS

    path = tmp_path / "code.parquet"
    datasets.Dataset.from_list(PROMPTS).to_parquet(str(path))
    dm = GRPODataModule(path=str(path), num_eval=1, batch_size=2, system_prompt="Answer in Python.")
    assert dm.task is None and dm.columns is None  # known once the file is read
    dm.setup()
    assert dm.columns == ["answer", "tests"]
    assert len(dm.train_rows) == 2 and len(dm.eval_rows) == 1
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) - RESERVED_KEYS == set(dm.columns)
    for sid, prompt, answer, tests, ids in zip(batch["sample_id"], batch["prompt"], batch["answer"], batch["tests"],
                                               batch["prompt_ids"]):
        src = PROMPTS[int(sid.rsplit("row ", 1)[1]) - 1]
        assert sid.startswith(f"{path}:row ")
        assert answer == src["answer"] and tests == src["tests"]
        assert prompt == [{"role": "system", "content": "Answer in Python."}, *src["prompt"]]
        expected = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert ids.tolist() == list(expected["input_ids"] if isinstance(expected, dict) else expected)
    (val,) = list(dm.val_dataloader())
    assert set(val) == set(batch) and len(val["prompt"]) == 1
    # holding out all 3 rows leaves nothing to train: an error naming num_eval (it was silently capped at 2)
    with pytest.raises(DataFormatError, match=r"num_eval=3 holds out 3 of the 3 rows of --data.path .* leaving 0 "
                                              r"to train on, fewer than one step's batch_size=1. Fix: lower "
                                              r"--data.num_eval, give --data.eval_path or lower --data.batch_size"):
        GRPODataModule(path=str(path), num_eval=3, batch_size=1).setup()
    # rows remain, but fewer than one step needs (it failed later, blaming batch_size only); num_train is named
    with pytest.raises(DataFormatError, match=r"num_eval=1 holds out 1 of the 3 rows read from --data.path .*"
                                              r"\(data.num_train=3 limits them\) .*leaving 2 .* batch_size=4. Fix: "
                                              r".*raise --data.num_train"):
        GRPODataModule(path=str(path), num_train=3, num_eval=1, batch_size=4).setup()
    # a num_train above the file's rows limits nothing: not named
    with pytest.raises(DataFormatError, match=r"1 of the 3 rows of --data.path \S+ for") as err:
        GRPODataModule(path=str(path), num_train=64, num_eval=1, batch_size=4).setup()
    assert "num_train" not in str(err.value)


def test_string_prompts_text_or_chat(tmp_path, tokenizer):
    path = tmp_path / "p.csv"
    path.write_text("prompt,answer\nThe sum of 2 and 3 is,5\nThe sum of 4 and 4 is,8\n")
    text = GRPODataModule(path=str(path), num_eval=0, batch_size=1)
    text.setup()
    assert [r["prompt"] for r in text.train_rows] == ["The sum of 2 and 3 is", "The sum of 4 and 4 is"]
    assert text.train_rows[0]["prompt_ids"].tolist() == tokenizer("The sum of 2 and 3 is",
                                                                   add_special_tokens=False)["input_ids"]
    assert [r["answer"] for r in text.train_rows] == [5, 8] and text.columns == ["answer"]
    chat = GRPODataModule(path=str(path), num_eval=0, batch_size=1, string_prompts="chat", system_prompt="Sys.")
    chat.setup()
    assert chat.train_rows[0]["prompt"] == [{"role": "system", "content": "Sys."},
                                            {"role": "user", "content": "The sum of 2 and 3 is"}]
    bad = GRPODataModule(path=str(path), num_eval=0, batch_size=1, system_prompt="Sys.")
    with pytest.raises(DataFormatError, match=r"p\.csv:row 1: --data\.system_prompt needs chat prompts.*"
                                              r"--data\.string_prompts chat"):
        bad.setup()


def test_rename_columns_and_column_errors(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"q": f"Q{i}?", "sol": str(i)}) + "\n" for i in range(3)))
    with pytest.raises(DataFormatError, match=r"q\.jsonl:1: no 'prompt' column \(columns: \['q', 'sol'\]\).*"
                                              r"--data\.rename_columns"):
        GRPODataModule(path=str(path), num_eval=0, batch_size=1).setup()
    dm = GRPODataModule(path=str(path), rename_columns={"q": "prompt", "sol": "answer"}, string_prompts="chat",
                        num_eval=0, batch_size=1)
    dm.setup()
    assert dm.columns == ["answer"] and [r["answer"] for r in dm.train_rows] == ["0", "1", "2"]
    assert dm.train_rows[2]["prompt"] == [{"role": "user", "content": "Q2?"}]
    clash = tmp_path / "clash.jsonl"
    clash.write_text(json.dumps({"prompt": "p", "sample_id": "mine"}) + "\n")
    with pytest.raises(DataFormatError, match=r"\['sample_id'\] are the prompt batch's own keys"):
        GRPODataModule(path=str(clash), num_eval=0, batch_size=1).setup()
    ragged = tmp_path / "ragged.jsonl"
    ragged.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n" + json.dumps({"prompt": "b", "x": 2}) + "\n")
    with pytest.raises(DataFormatError, match=r"ragged\.jsonl:2: columns \['prompt', 'x'\] differ"):
        GRPODataModule(path=str(ragged), num_eval=0, batch_size=1).setup()
    skip = GRPODataModule(path=str(ragged), num_eval=0, batch_size=1, on_bad_row="skip")
    skip.setup()
    assert [r["sample_id"] for r in skip.train_rows] == [f"{ragged}:1"]
    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"prompt": "c"}) + "\n")
    with pytest.raises(DataFormatError, match=r"eval\.jsonl:1: the evaluation prompts lack the training column\(s\) "
                                              r"\['answer'\]"):
        GRPODataModule(path=str(ragged), eval_path=str(evals), on_bad_row="skip", batch_size=1).setup()


def test_arithmetic_task_reads_no_file(tmp_path):
    with pytest.raises(ValueError, match=r"task='arithmetic' .* reads no file.*--data\.path is set.*"
                                         r"--data\.task null"):
        GRPODataModule("arithmetic", path="prompts.jsonl")
    with pytest.raises(ValueError, match=r"--data\.eval_path is set"):
        GRPODataModule("arithmetic", eval_path="prompts.jsonl")
    dm = GRPODataModule(num_train=4, num_eval=2, batch_size=2)  # no task, no path: the synthetic task
    assert dm.task == "arithmetic" and dm.columns == ["answer"]


def test_gsm8k_is_a_column_mapping_with_extra_columns(tmp_path):
    path = tmp_path / "g.parquet"
    import datasets

    datasets.Dataset.from_list([{"question": f"Q{i}", "answer": f"r\n#### {i}", "level": i} for i in range(4)]
                               ).to_parquet(str(path))
    rows = gsm8k_prompts(str(path))
    assert rows[1] == {"prompt": [{"role": "user", "content": "Q1"}], "answer": "r\n#### 1", "level": 1,
                       "sample_id": f"{path}:row 2"}
    dm = GRPODataModule("gsm8k", path=str(path), num_eval=1, batch_size=1)
    dm.setup()
    assert dm.columns == ["answer", "level"] and dm.string_prompts == "chat"


class _PlanModule(LightningModule):
    """A trivial module over the prompt loader (sync) or a stub-engine producer over it (async), with GRPO's
    :class:`PolicyVersionSwitch` (no engine): records every training batch's sample ids."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.weight, self.ids = mode, torch.nn.Parameter(torch.zeros(1)), []

    def configure_callbacks(self):
        version = SimpleNamespace(generate=True, model=torch.nn.Linear(1, 1),
                                  get_new_version=lambda **kw: SimpleNamespace())
        return [PolicyVersionSwitch(version)]

    def train_dataloader(self):
        loader = PromptBatchLoader(_rows(8), batch_size=2, seed=1)  # 4 steps per epoch
        return loader if self.mode == "sync" else StatefulAsyncRollouts(_StubEngine(), loader, max_staleness=2**62)

    def training_step(self, batch, batch_idx):
        self.ids.append(list(batch["sample_id"] if isinstance(batch, dict) else batch.sample_id))
        return (self.weight - 1).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _plan_fit(root, mode, *, max_steps=-1, max_epochs=None, resume=False):
    from lit_llm.lightning.callbacks import StepCheckpoint

    module = _PlanModule(mode)
    trainer = Trainer(max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      callbacks=[StepCheckpoint(root, save_last=True, every_n_train_steps=3)])
    trainer.fit(module, ckpt_path=str(root / "last.ckpt") if resume else None)
    return module.ids


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(("first", "then"), [({"max_epochs": 1}, {"max_epochs": 2}),  # last.ckpt: epoch 0 finished
                                             ({"max_steps": 5}, {"max_epochs": 3}),  # stopped 1 step into epoch 1
                                             ({"max_steps": 5}, {"max_steps": 12})],  # Lightning restores it itself
                         ids=["finished-epoch", "max-steps-then-max-epochs", "max-steps-then-max-steps"])
def test_resume_continues_the_prompt_plan_where_the_checkpoint_left_it(tmp_path, mode, first, then):
    """Lightning (2.6) loads the train loader's saved state only when it resumes mid-epoch: not from the ``last.ckpt``
    written at the end of training with ``max_steps=-1`` (the epoch counts as finished), where the loader restarted
    epoch 0; and it counts an epoch ``max_steps`` stopped as finished (skipping its rest). ``PolicyVersionSwitch``
    loads the state itself then, and resumes inside the stopped epoch: the resumed run trains the uninterrupted run's
    steps, all of them."""
    full = _plan_fit(tmp_path / "full", mode, **{"max_steps": -1, **then})
    assert len(full) == (8 if then.get("max_epochs") == 2 else 12)
    assert full[:4] != full[4:8]  # each epoch its own order
    part = _plan_fit(tmp_path / "part", mode, **first)
    part += _plan_fit(tmp_path / "part", mode, **{"max_steps": -1, **then}, resume=True)
    assert part == full


def test_resume_train_loader_counts_a_max_steps_stopped_epoch_as_unfinished():
    """The checkpoint rewrite: only an epoch stopped before its last batch with every count equal becomes the state a
    mid-epoch checkpoint holds; finished epochs, mid-epoch checkpoints and checkpoints without loops are left as
    they are."""
    def checkpoint(epoch_counts, ready_in_epoch, is_last_batch):
        counts = dict(zip(("ready", "started", "processed", "completed"), epoch_counts))
        return {"loops": {"fit_loop": {
            "state_dict": {"combined_loader": [{"epoch": 1, "position": 1}]},
            "epoch_progress": {"total": dict(counts), "current": dict(counts)},
            "epoch_loop.batch_progress": {"current": {"ready": ready_in_epoch, "processed": ready_in_epoch},
                                          "is_last_batch": is_last_batch}}}}

    stopped = checkpoint((2, 2, 2, 2), 1, False)
    assert resume_train_loader(stopped) == [{"epoch": 1, "position": 1}]
    assert stopped["loops"]["fit_loop"]["epoch_progress"]["total"] == {"ready": 2, "started": 2, "processed": 1,
                                                                       "completed": 1}
    assert stopped["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"] == 1
    for kept in (checkpoint((1, 1, 1, 1), 4, True), checkpoint((2, 2, 1, 1), 1, False),
                 checkpoint((1, 1, 1, 0), 4, True)):
        before = json.dumps(kept)
        assert resume_train_loader(kept) == [{"epoch": 1, "position": 1}] and json.dumps(kept) == before
    assert resume_train_loader({}) == []
    loader = PromptBatchLoader(_rows(), batch_size=3, seed=1)
    assert restore_train_loader(loader, [{"epoch": 0, "position": 3}]) is True
    assert loader.state_dict() == {"epoch": 0, "position": 3}
    assert restore_train_loader(loader, [{"epoch": 0, "position": 3}]) is False  # already there (Lightning's)
    assert restore_train_loader(loader, []) is False and restore_train_loader([], [{"epoch": 0}]) is False
    assert [b["sample_id"] for b in loader] == [[f"s{i}" for i in s] for s in loader.epoch_plan(1)]
