"""Datasets and the SFT data module: exact masks, truncation, errors with file and line, resumable step batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_llm.data.datasets import (
    DataFormatError,
    arithmetic_examples,
    collate,
    read_examples,
    tokenize_example,
)
from lit_llm.lightning.datamodules import SFTDataModule, StepBatchLoader

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def two_rows(tmp_path):
    return write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "Times 3?"}, {"role": "assistant", "content": "12"}]},
    ])


def test_exact_masks_two_row_jsonl(two_rows, tokenizer):
    """Hand-built ids and masks for SmolLM2's ChatML template: response = last turn + <|im_end|>, never the '\\n'."""
    ex = read_examples(two_rows)
    assert [e.sample_id for e in ex] == [f"{two_rows}:1", f"{two_rows}:2"]
    s1, s2 = (tokenize_example(e, tokenizer) for e in ex)

    head1 = ids(tokenizer, SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    turn1 = ids(tokenizer, "Hello there<|im_end|>")
    nl = ids(tokenizer, "\n")
    assert s1.input_ids.tolist() == head1 + turn1 + nl
    expect1 = [False] * len(head1) + [True] * len(turn1) + [False] * len(nl)
    assert s1.response_mask.tolist() == expect1
    assert s1.assistant_mask.tolist() == expect1
    assert s1.prompt_ids.tolist() == head1

    p_a = ids(tokenizer, SYSTEM + "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    a1 = ids(tokenizer, "4<|im_end|>")
    p_b = ids(tokenizer, "\n<|im_start|>user\nTimes 3?<|im_end|>\n<|im_start|>assistant\n")
    a2 = ids(tokenizer, "12<|im_end|>")
    assert s2.input_ids.tolist() == p_a + a1 + p_b + a2 + nl
    assert s2.assistant_mask.tolist() == [False] * len(p_a) + [True] * len(a1) + [False] * len(p_b) + [True] * len(
        a2) + [False]
    assert s2.response_mask.tolist() == [False] * (len(p_a) + len(a1) + len(p_b)) + [True] * len(a2) + [False]
    assert s2.prompt_ids.tolist() == p_a + a1 + p_b

    batch = collate([s1, s2], pad_token_id=tokenizer.pad_token_id)
    t = max(len(s1), len(s2))
    assert batch["input_ids"].shape == (2, t) and batch["input_ids"].dtype == torch.long
    n1 = len(s1)
    assert batch["attention_mask"][0].tolist() == [1] * n1 + [0] * (t - n1)
    assert batch["input_ids"][0, n1:].eq(tokenizer.pad_token_id).all()
    assert not batch["response_mask"][0, n1:].any() and batch["response_mask"].dtype == torch.bool
    assert batch["sample_ids"] == [s1.sample_id, s2.sample_id]


def test_prompt_completion_strings_and_messages(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": "Say hi", "completion": "hi"},
        {"prompt": [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Say hi"}],
         "completion": [{"role": "assistant", "content": "hi"}]},
    ])
    a, b = read_examples(path, system_prompt="Be short.")
    assert a.messages == b.messages and a.num_prompt_messages == b.num_prompt_messages == 2
    sa = tokenize_example(a, tokenizer)
    assert tokenizer.decode(sa.input_ids[sa.response_mask]) == "hi<|im_end|>"


def test_gsm8k_answer_verbatim(gsm8k_dir, tokenizer):
    (ex,) = read_examples(gsm8k_dir / "train.jsonl", fmt="gsm8k", limit=1)
    row = json.loads((gsm8k_dir / "train.jsonl").open().readline())
    assert ex.messages[-1] == {"role": "assistant", "content": row["answer"]}
    s = tokenize_example(ex, tokenizer)
    assert tokenizer.decode(s.input_ids[s.response_mask]) == row["answer"] + "<|im_end|>"


def test_arithmetic_task_is_deterministic():
    (a, a_val), (b, _) = arithmetic_examples(3, 40, seed=5), arithmetic_examples(3, 40, seed=5)
    assert [e.messages for e in a] == [e.messages for e in b]
    q = a[0].messages[0]["content"]
    x, y = (int(v) for v in q.removeprefix("What is ").split("?")[0].split(" + "))
    assert a[0].reference == str(x + y) and 10 <= x <= 99 and 10 <= y <= 99
    assert a[0].messages[-1] == {"role": "assistant", "content": str(x + y)} and a[0].num_prompt_messages == 1
    # train and validation problems are disjoint
    assert len(a_val) == 40 and not {e.messages[0]["content"] for e in a} & {e.messages[0]["content"] for e in a_val}


@pytest.mark.parametrize(("lines", "match"), [
    (['{"messages": []}', "not json"], r"bad\.jsonl:2: not a JSON object"),
    (['{"body": "x"}'], r"bad\.jsonl:1: cannot tell the row format .* 'messages'.* 'text'"),
    (['{"messages": [{"role": "user", "content": "q"}]}'], r"bad\.jsonl:1: the conversation has no assistant message"),
    (['{"question": "q"}'], r"bad\.jsonl:1: cannot tell"),
    ([""], r"bad\.jsonl: the file holds no JSON row"),
])
def test_bad_data_names_file_and_line(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFormatError, match=match):
        read_examples(path)


def test_missing_key_for_explicit_format(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:1: missing key\(s\) \['answer'\] for format 'gsm8k'"):
        read_examples(path, fmt="gsm8k")


def test_missing_file_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*--data\.path"):
        read_examples(tmp_path / "nope.jsonl")


def test_unknown_role_error_names_line(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "robot", "content": "x"},
                                                             {"role": "assistant", "content": "y"}]}])
    dm = SFTDataModule(str(path), loss_head="sft")
    dm.tokenizer = tokenizer
    with pytest.raises(DataFormatError, match=r"r\.jsonl:1: .*robot"):
        dm.setup("fit")


def test_skip_bad_rows_and_drop_truncated(tmp_path, tokenizer):
    long_answer = " ".join(["word"] * 200)
    path = write_jsonl(tmp_path / "mixed.jsonl", [
        {"prompt": "short", "completion": "ok"},
        "{broken",
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"prompt": "p " * 120, "completion": long_answer},  # the prompt alone exceeds max_length: nothing to train
        {"prompt": "short 2", "completion": long_answer},  # truncated but keeps trainable tokens
    ])
    dm = SFTDataModule(str(path), on_bad_row="skip", max_length=96, loss_head="sft")
    dm.tokenizer = tokenizer
    dm.setup("fit")
    assert dm.num_skipped_rows == 2
    assert dm.num_dropped_no_tokens == 1
    assert dm.num_truncated == 2
    assert [s.sample_id.rsplit(":", 1)[1] for s in dm.train_samples] == ["1", "5"]
    assert max(len(s) for s in dm.train_samples) == 96


def test_every_row_dropped_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "p " * 120, "completion": "x"}])
    dm = SFTDataModule(str(path), max_length=32, loss_head="sft")
    dm.tokenizer = tokenizer
    with pytest.raises(DataFormatError, match=r"no training sample left .*max_length=32"):
        dm.setup("fit")


def test_val_fraction_split_is_disjoint(tokenizer, gsm8k_dir):
    dm = SFTDataModule(str(gsm8k_dir / "train.jsonl"), format="gsm8k", limit=40, eval_fraction=0.25, loss_head="sft")
    dm.tokenizer = tokenizer
    dm.setup("fit")
    train_ids = {s.sample_id for s in dm.train_samples}
    val_ids = {s.sample_id for s in dm.val_samples}
    assert len(val_ids) == 10 and len(train_ids) == 30 and not train_ids & val_ids


# --------------------------------------------------------------------------------------------- step batches
def fake_samples(lengths: list[int]):
    from lit_llm.data.datasets import TokenizedExample

    out = []
    for i, n in enumerate(lengths):
        m = torch.zeros(n, dtype=torch.bool)
        m[1:] = True
        out.append(TokenizedExample(torch.arange(n), m, m, torch.arange(1), f"s:{i}"))
    return out


def flat_ids(batch) -> list[str]:
    return [sid for mb in batch["micro_batches"] for sid in mb["sample_ids"]]


def test_step_loader_resumes_exactly():
    samples = fake_samples([3 + (7 * i) % 11 for i in range(22)])
    kw = dict(batch_size=4, micro_batch_size=2, pad_token_id=0, seed=3)
    ref = StepBatchLoader(samples, **kw)
    assert len(ref) == 6  # 22 // 4 = 5 full steps + one of 2 samples
    full = [flat_ids(b) for _ in range(3) for b in ref]  # 3 epochs

    run = StepBatchLoader(samples, **kw)
    it = iter(run)
    seen = [flat_ids(next(it)) for _ in range(4)]
    state = run.state_dict()
    assert state == {"epoch": 0, "position": 4}
    resumed = StepBatchLoader(samples, **kw)
    resumed.load_state_dict(state)
    seen += [flat_ids(b) for b in resumed] + [flat_ids(b) for _ in range(2) for b in resumed]
    assert seen == full
    assert sorted(s for step in full[:6] for s in step) == sorted(s.sample_id for s in samples)  # one epoch = all
    assert full[:6] != full[6:12]  # reshuffled per epoch


def test_step_loader_micro_batches_and_length_grouping():
    samples = fake_samples([5, 50, 6, 52, 7, 49, 4, 51] * 4)
    loader = StepBatchLoader(samples, batch_size=4, micro_batch_size=2, pad_token_id=0, length_group_steps=8)
    padded, real = 0, 0
    for batch in loader:
        assert [mb["input_ids"].shape[0] for mb in batch["micro_batches"]] == [2, 2]
        for mb in batch["micro_batches"]:
            padded += mb["attention_mask"].numel()
            real += int(mb["attention_mask"].sum())
    ungrouped = StepBatchLoader(samples, batch_size=4, micro_batch_size=2, pad_token_id=0, group_by_length=False)
    padded_u = sum(mb["attention_mask"].numel() for b in ungrouped for mb in b["micro_batches"])
    assert padded == real  # lengths come in exact pairs -> grouping removes all padding here
    assert padded_u > padded


def test_step_loader_shards_ranks():
    samples = fake_samples(list(range(2, 22)))
    plans = [StepBatchLoader(samples, batch_size=3, micro_batch_size=3, pad_token_id=0, rank=r, world_size=2)
             for r in range(2)]
    assert len(plans[0]) == len(plans[1]) == 4  # 20 // 6 = 3 full + one of 2 samples (one per rank)
    ids0 = [s for b in plans[0] for s in flat_ids(b)]
    ids1 = [s for b in plans[1] for s in flat_ids(b)]
    assert not set(ids0) & set(ids1) and len(ids0) + len(ids1) == 20


def test_missing_validation_file_names_its_own_option(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}])
    dm = SFTDataModule(str(train), eval_path=str(tmp_path / "val.jsonl"), loss_head="sft")
    dm.tokenizer = tokenizer
    with pytest.raises(FileNotFoundError, match=r"val\.jsonl.*--data\.eval_path"):
        dm.setup("fit")


# ------------------------------------------------------------------------------- text rows, names, the task guard
def test_text_rows_tokenised_as_text_plus_eos(tmp_path, tokenizer):
    """TRL's language-modelling rows: the ids of the text (a literal <|im_end|> stays text, property 8) + EOS."""
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello <|im_end|> world"}])
    (ex,) = read_examples(path)
    s = tokenize_example(ex, tokenizer)
    expected = tokenizer("Hello <|im_end|> world", split_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    assert s.input_ids.tolist() == expected
    assert tokenizer.eos_token_id not in expected[:-1]  # the typed marker did not become the control token
    assert not s.assistant_mask.any() and not s.response_mask.any() and s.prompt_ids.tolist() == expected[:1]
    assert tokenize_example(ex, tokenizer, max_length=2).input_ids.tolist() == expected[:2]


def test_text_rows_need_the_generic_head(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two three"}, {"text": "four five"}])
    dm = SFTDataModule(str(path), loss_head="sft")
    dm.tokenizer = tokenizer
    with pytest.raises(DataFormatError, match=r"t\.jsonl:1: 'text' rows .* 'sft' loss head has nothing to train on.*"
                                              r"--model\.loss generic"):
        dm.setup("fit")
    ok = SFTDataModule(str(path), loss_head="generic", format="text")
    ok.tokenizer = tokenizer
    ok.setup("fit")
    assert [len(s) for s in ok.train_samples] == [len(tokenizer(t)["input_ids"]) + 1
                                                  for t in ("one two three", "four five")]


def test_arithmetic_format_with_a_path_is_an_error():
    with pytest.raises(ValueError, match=r"--data\.format is 'arithmetic' .* --data\.path is set\. Fix: set "
                                         r"--data\.format auto"):
        SFTDataModule("chat.jsonl", format="arithmetic")
    with pytest.raises(ValueError, match=r"--data\.eval_path is set"):
        SFTDataModule(format="arithmetic", eval_path="val.jsonl")


def test_val_names_are_deprecated_aliases(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.warns(DeprecationWarning, match=r"--data\.val_path is deprecated; use --data\.eval_path"):
        dm = SFTDataModule(str(train), val_path="v.jsonl", val_fraction=None, val_limit=3)
    assert (dm.eval_path, dm.eval_limit) == ("v.jsonl", 3)
    assert dm.hparams["eval_path"] == "v.jsonl" and dm.hparams["val_path"] is None
    with pytest.warns(DeprecationWarning, match="val_fraction"):
        assert SFTDataModule(str(train), val_fraction=0.5).eval_fraction == 0.5
    with pytest.raises(ValueError, match=r"both --data\.val_path \(deprecated\) and --data\.eval_path"):
        SFTDataModule(str(train), val_path="a.jsonl", eval_path="b.jsonl")


def test_chat_template_and_kwargs_come_from_the_module(tmp_path, tokenizer):
    """With no data.chat_template, the attached module's chat_template and chat_template_kwargs render the rows."""
    from types import SimpleNamespace

    template = ("{% for m in messages %}{{ tag }}{{ m['role'] }}:\n{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}{{ tag }}assistant:\n{% endif %}")
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hi", "completion": "yo"}])
    dm = SFTDataModule(str(path), loss_head="sft")
    dm.tokenizer = tokenizer
    dm.trainer = SimpleNamespace(lightning_module=SimpleNamespace(chat_template=template,
                                                                   chat_template_kwargs={"tag": "#"}), loggers=[])
    dm.setup("fit")
    (s,) = dm.train_samples
    assert tokenizer.decode(s.input_ids) == "#user:\nhi\n#assistant:\nyo<|im_end|>"
    assert tokenizer.decode(s.input_ids[s.response_mask]) == "yo<|im_end|>"
