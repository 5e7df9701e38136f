"""Tests for lit_llm.data.containers: the typed containers and their conversions (exact ids and strings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import lazy_stack

from lit_llm.data.containers import ChatHistory, LogProbs, Masks, Text, Tokens, template_display_name
from lit_llm.data.errors import PrefixMismatchError

# A short SmolLM2 conversation rendered by the tokenizer's own template, written out by hand. SmolLM2 ids:
# <|im_start|>=1, <|im_end|>=2, "\n"=198, "system"=9690, "user"=4093, "ass"+"istant"=520 9531, "Be"=6077,
# " brief"=5453, "."=30, digits "0".."9" = 32..41, "+"=27, "?"=47.
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]
PROMPT_TEXT = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
RESPONSE_TEXT = "4<|im_end|>\n"
FULL_TEXT = PROMPT_TEXT + RESPONSE_TEXT
PROMPT_IDS = [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]
RESPONSE_IDS = [36, 2, 198]

# A second, longer conversation (for batches): "3+5?" -> "8", no system prompt given -> SmolLM2's default is added.
CONV2 = [{"role": "user", "content": "3+5?"}, {"role": "assistant", "content": "8"}]
SMOL_SYS = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
PROMPT2_TEXT = f"<|im_start|>system\n{SMOL_SYS}<|im_end|>\n<|im_start|>user\n3+5?<|im_end|>\n<|im_start|>assistant\n"
RESPONSE2_TEXT = "8<|im_end|>\n"
RESPONSE2_IDS = [40, 2, 198]


def ids(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------- containers
def test_fields_default_to_none():
    assert Text().prompt is None and Text().response is None and Text().full is None
    t = Tokens(prompt=ids([1, 2]), padded=False)
    assert t.response is None and t.full is None and t.padded is False and t.batch_size == torch.Size([])
    m = Masks(all_attention_mask=torch.tensor([True, False]), padded=False)
    assert m.all_assistant_mask is None
    lp = LogProbs(full=torch.tensor([0.0, -1.5]), padded=False)
    assert lp.full.dtype == torch.float32 and lp.prompt is None
    assert ChatHistory().prompt is None


def test_lazy_stack_of_ragged_tokens_pads_on_request():
    batch = lazy_stack([Tokens(prompt=ids([5, 6]), response=ids([7]), padded=False),
                        Tokens(prompt=ids([1, 2, 3]), response=ids([8, 9]), padded=False)])
    assert batch.batch_size == torch.Size([2])
    assert [x.tolist() for x in batch.get("prompt", as_list=True)] == [[5, 6], [1, 2, 3]]
    left = batch.get("prompt", as_padded_tensor=True, padding_side="left", padding_value=0)
    assert left.tolist() == [[0, 5, 6], [1, 2, 3]]
    right = batch.get("response", as_padded_tensor=True, padding_side="right", padding_value=0)
    assert right.tolist() == [[7, 0], [8, 9]]


def test_template_display_name():
    assert template_display_name(None) == "tokenizer default"
    assert template_display_name("/x/y/stock-qwen3.jinja") == "stock-qwen3.jinja"
    assert template_display_name(Path("/x/zephyr.jinja")) == "zephyr.jinja"
    assert template_display_name("{% for m in messages %}{{ m.content }}{% endfor %}") == "<inline template>"


# ------------------------------------------------------------------------------------------------- Text.to_tokens
def test_text_to_tokens_exact_ids(tokenizer):
    for text in (Text(prompt=PROMPT_TEXT, full=FULL_TEXT), Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT)):
        tok = text.to_tokens(tokenizer)
        assert tok.prompt.tolist() == PROMPT_IDS
        assert tok.response.tolist() == RESPONSE_IDS
        assert tok.full.tolist() == PROMPT_IDS + RESPONSE_IDS
        assert tok.full.dtype == torch.long and tok.padded is False
    only_prompt = Text(prompt=PROMPT_TEXT).to_tokens(tokenizer)
    assert only_prompt.prompt.tolist() == PROMPT_IDS and only_prompt.response is None and only_prompt.full is None


def test_text_to_tokens_text_not_a_prefix(tokenizer):
    with pytest.raises(PrefixMismatchError, match=r"Text.to_tokens: .*first difference at character position 3"):
        Text(prompt="abcX", full="abcdef").to_tokens(tokenizer)


def test_text_to_tokens_bpe_merge_across_boundary(tokenizer):
    # The text is a prefix, but "\n\n" at the end of the prompt is one token (1116) while in the full text it is two
    # (198, 198) because "4" follows: the ids are not a prefix, and the error says where (position 18).
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    with pytest.raises(PrefixMismatchError, match=r"position 18 \(prompt id 1116 vs full id 198\)"):
        Text(prompt=prompt, response="4<|im_end|>\n").to_tokens(tokenizer)


def test_text_missing_prompt_and_full_raises(tokenizer):
    with pytest.raises(ValueError, match=r"Text.to_tokens: the 'prompt' field is None \(and no 'full'\)"):
        Text(response="x").to_tokens(tokenizer)


def test_text_to_tokens_batch_matches_single(tokenizer):
    rows = [Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT), Text(prompt=PROMPT2_TEXT, response=RESPONSE2_TEXT)]
    for batch in (lazy_stack(rows), Text(prompt=[PROMPT_TEXT, PROMPT2_TEXT], response=[RESPONSE_TEXT, RESPONSE2_TEXT],
                                         batch_size=[2])):
        out = batch.to_tokens(tokenizer)
        assert out.batch_size == torch.Size([2])
        assert [r.tolist() for r in out.get("response", as_list=True)] == [RESPONSE_IDS, RESPONSE2_IDS]
        for i, row in enumerate(rows):
            single = row.to_tokens(tokenizer)
            assert out[i].prompt.tolist() == single.prompt.tolist()
            assert out[i].full.tolist() == single.full.tolist()


# -------------------------------------------------------------------------------------------------- Tokens.to_text
def test_tokens_to_text_keeps_special_tokens(tokenizer):
    for tokens in (Tokens(prompt=ids(PROMPT_IDS), response=ids(RESPONSE_IDS)),
                   Tokens(prompt=ids(PROMPT_IDS), full=ids(PROMPT_IDS + RESPONSE_IDS))):
        text = tokens.to_text(tokenizer)
        assert text.prompt == PROMPT_TEXT
        assert text.response == RESPONSE_TEXT
        assert text.full == FULL_TEXT
    assert Tokens(response=ids([36, 2])).to_text(tokenizer).response == "4<|im_end|>"


def test_tokens_to_text_padded_raises(tokenizer):
    with pytest.raises(ValueError, match="padded=True"):
        Tokens(prompt=ids([[1, 2]]), padded=True, batch_size=[1])[0].to_text(tokenizer)


def test_tokens_to_text_batch(tokenizer):
    batch = lazy_stack([Tokens(prompt=ids(PROMPT_IDS), response=ids(RESPONSE_IDS), padded=False),
                        Tokens(prompt=ids(PROMPT_IDS[:3]), response=ids(RESPONSE2_IDS), padded=False)])
    text = batch.to_text(tokenizer)
    assert list(text.response) == [RESPONSE_TEXT, RESPONSE2_TEXT]
    assert list(text.prompt) == [PROMPT_TEXT, "<|im_start|>system\n"]


_piece = st.sampled_from(["a", "b", " c", "12", "+", "\n", "é", "中", "<|im_end|>", "<|im_start|>", "?", " "])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.lists(_piece, max_size=6).map("".join), st.lists(_piece, max_size=6).map("".join)),
                     min_size=1, max_size=4))
def test_text_tokens_round_trip_property(tokenizer, rows):
    """full == prompt ⊕ response by ids, decode(full) == prompt + response, batch == rows; or a prefix error."""
    texts, ok = [Text(prompt=p, response=r) for p, r in rows], []
    for (p, r), text in zip(rows, texts, strict=True):
        try:
            single = text.to_tokens(tokenizer)
        except PrefixMismatchError:
            continue  # a BPE merge across the boundary: the error is the contract (property 2)
        assert torch.equal(single.full, torch.cat([single.prompt, single.response]))
        back = single.to_text(tokenizer)
        assert (back.prompt, back.response, back.full) == (p, r, p + r)
        ok.append((text, single))
    if len(ok) < len(texts):
        with pytest.raises(PrefixMismatchError):
            lazy_stack(texts).to_tokens(tokenizer)
    if ok:
        batch = lazy_stack([t for t, _ in ok]).to_tokens(tokenizer)
        for row, (_, single) in zip(batch.unbind(0), ok, strict=True):
            assert torch.equal(row.full, single.full) and torch.equal(row.response, single.response)


# ------------------------------------------------------------------------------------------ with History (helper A)
def history(messages):
    from lit_llm.data.history import History

    return History.from_chats(messages)


def test_chat_history_to_tokens_exact(tokenizer):
    for ch in (ChatHistory(prompt=history(CONV[:2]), full=history(CONV)),
               ChatHistory(prompt=history(CONV[:2]), response=history(CONV[2:]))):
        tok = ch.to_tokens(tokenizer)
        assert tok.prompt.tolist() == PROMPT_IDS
        assert tok.response.tolist() == RESPONSE_IDS
        assert tok.full.tolist() == PROMPT_IDS + RESPONSE_IDS
        text = ch.to_text(tokenizer)
        assert (text.prompt, text.response, text.full) == (PROMPT_TEXT, RESPONSE_TEXT, FULL_TEXT)


def test_chat_history_to_tokens_prefix_error_names_template(tokenizer, templates_dir):
    # Qwen3 with enable_thinking=False writes an empty think block in the generation prompt, but renders the reply's
    # own reasoning in the full conversation: ids differ at position 15 ("\n" of the empty block vs "r").
    path = templates_dir / "stock-qwen3.jinja"
    ch = ChatHistory(prompt=history([{"role": "user", "content": "q1"}]),
                     response=history([{"role": "assistant", "content": "<think>\nr\n</think>\n\nA1"}]))
    with pytest.raises(PrefixMismatchError, match=r"'stock-qwen3.jinja'.*position 15 \(prompt id 198 vs full id 98\)"):
        ch.to_tokens(tokenizer, chat_template=str(path), enable_thinking=False)
    with pytest.raises(PrefixMismatchError, match=r"'stock-qwen3.jinja'.*character position 60"):
        ch.to_text(tokenizer, chat_template=str(path), enable_thinking=False)


def test_chat_history_batch_matches_single(tokenizer):
    rows = [ChatHistory(prompt=history(CONV[:2]), response=history(CONV[2:])),
            ChatHistory(prompt=history(CONV2[:1]), response=history(CONV2[1:]))]
    out = lazy_stack(rows).to_tokens(tokenizer)
    assert out.batch_size == torch.Size([2])
    assert [r.tolist() for r in out.get("response", as_list=True)] == [RESPONSE_IDS, RESPONSE2_IDS]
    assert out[0].prompt.tolist() == PROMPT_IDS
    for i, row in enumerate(rows):
        assert torch.equal(out[i].full, row.to_tokens(tokenizer).full)
    text = lazy_stack(rows).to_text(tokenizer)
    assert list(text.prompt) == [PROMPT_TEXT, PROMPT2_TEXT]


def test_chat_history_padded_history_batch(tokenizer):
    """A [B, n] History ("<none>"-padded rows) gives the same tokens as the rows one by one."""
    from lit_llm.data.history import History

    ch = ChatHistory(prompt=History.from_chats([CONV[:2], CONV2[:1]]),
                     response=History.from_chats([CONV[2:], CONV2[1:]]), batch_size=[2])
    out = ch.to_tokens(tokenizer)
    assert [r.tolist() for r in out.get("response", as_list=True)] == [RESPONSE_IDS, RESPONSE2_IDS]
    assert out[0].prompt.tolist() == PROMPT_IDS
    assert list(ch.to_text(tokenizer).response) == [RESPONSE_TEXT, RESPONSE2_TEXT]


def test_chat_history_inline_template_and_missing_prompt(tokenizer):
    # A template whose generation prompt ("A:\n") is not what it renders before a reply ("A: "): character 10.
    tpl = ("{% for m in messages %}{{ m.role[0]|upper }}: {{ m.content }}\n{% endfor %}"
           "{% if add_generation_prompt %}A:\n{% endif %}")
    ch = ChatHistory(prompt=history(CONV2[:1]), response=history(CONV2[1:]))
    assert history(CONV2).apply_chat_template(tokenizer, chat_template=tpl, tokenize=False,
                                              add_generation_prompt=False) == "U: 3+5?\nA: 8\n"
    with pytest.raises(PrefixMismatchError, match=r"'<inline template>'.*character position 10 \(prompt '\\n' vs"):
        ch.to_text(tokenizer, chat_template=tpl)
    pattern = r"'<inline template>'.*token position 10 \(prompt id 198 vs full id 216\)"
    with pytest.raises(PrefixMismatchError, match=pattern):
        ch.to_tokens(tokenizer, chat_template=tpl)
    with pytest.raises(ValueError, match=r"ChatHistory.to_tokens: the 'prompt' and 'full' fields are None"):
        ChatHistory(response=history(CONV2)).to_tokens(tokenizer)


def test_text_and_tokens_to_history(tokenizer):
    expected_prompt = [("system", "Be brief."), ("user", "2+2?")]
    for ch in (Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT).to_history("smollm2"),
               Tokens(prompt=ids(PROMPT_IDS), response=ids(RESPONSE_IDS)).to_history(tokenizer, "smollm2")):
        assert _chat(ch.prompt) == expected_prompt
        assert _chat(ch.full) == [*expected_prompt, ("assistant", "4")]
        assert _chat(ch.response) == [("assistant", "4")]
        assert ch.full.is_complete.tolist() == [True, True, True]
    partial = Text(prompt=PROMPT_TEXT, response="Fo").to_history("smollm2")
    assert _chat(partial.response) == [("assistant", "Fo")]
    assert partial.response.is_complete.tolist() == [False]


def _chat(h):
    return [(r, c) for r, c in zip(list(h.role), list(h.content), strict=True)]


def test_text_to_history_batch(tokenizer):
    batch = lazy_stack([Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT),
                        Text(prompt=PROMPT2_TEXT, response=RESPONSE2_TEXT)])
    out = batch.to_history("chatml")
    assert _chat(out[1].prompt) == [("system", SMOL_SYS), ("user", "3+5?")]
    assert _chat(out[1].response) == [("assistant", "8")]
    assert _chat(out[0].response) == [("assistant", "4")]


# ------------------------------------------------------------------------- TorchRL parity (issue 12, items 4-6)
def test_torchrl_signatures_text_and_tokens(tokenizer):
    text = Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT)
    for ch in (text.to_history(tokenizer), text.to_history(tokenizer, chat_template_name="chatml_format"),
               Tokens(prompt=ids(PROMPT_IDS), response=ids(RESPONSE_IDS)).to_history(tokenizer, None,
                                                                                     skip_special_tokens=False)):
        assert _chat(ch.prompt) == [("system", "Be brief."), ("user", "2+2?")]
        assert _chat(ch.response) == [("assistant", "4")]
    skipped = Tokens(prompt=ids(PROMPT_IDS), response=ids(RESPONSE_IDS)).to_text(tokenizer, skip_special_tokens=True)
    assert skipped.response == "4\n" and skipped.prompt == "system\nBe brief.\nuser\n2+2?\nassistant\n"
    with pytest.raises(ValueError, match="return_tensors='np' is not supported"):
        text.to_tokens(tokenizer, return_tensors="np")
    # No name and nothing to detect from: ChatML, TorchRL's default parser.
    assert _chat(text.to_history(object()).prompt) == [("system", "Be brief."), ("user", "2+2?")]


def test_text_to_tokens_padding_and_truncation(tokenizer):
    batch = lazy_stack([Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT), Text(prompt="Hi", response=" there")])
    pad = tokenizer.pad_token_id
    out = batch.to_tokens(tokenizer, padding=True)
    ab, abc = tokenizer("Hi")["input_ids"], tokenizer("Hi there")["input_ids"]
    assert out.padded is True and out.batch_size == torch.Size([2])
    width = len(PROMPT_IDS)
    assert out.prompt.tolist() == [PROMPT_IDS, [pad] * (width - len(ab)) + ab]
    resp2 = abc[len(ab):]
    assert out.response.tolist() == [RESPONSE_IDS, resp2 + [pad] * (len(RESPONSE_IDS) - len(resp2))]
    full_w = len(PROMPT_IDS) + len(RESPONSE_IDS)
    assert out.full.tolist() == [PROMPT_IDS + RESPONSE_IDS, [pad] * (full_w - len(abc)) + abc]
    cut = Text(prompt=PROMPT_TEXT, response=RESPONSE_TEXT).to_tokens(tokenizer, truncation=True, max_length=22)
    assert cut.prompt.tolist() == PROMPT_IDS and cut.full.tolist() == (PROMPT_IDS + RESPONSE_IDS)[:22]
    assert cut.response.tolist() == RESPONSE_IDS[:1]


def test_chat_template_name_honoured_and_aliased(tokenizer, templates_dir):
    ch = ChatHistory(prompt=history(CONV[:2]), response=history(CONV[2:]))
    reference = templates_dir.parent / "reference_templates" / "chatml-transformers-default.jinja"
    chatml = reference.read_text()  # ChatML as transformers' default writes it (no BOS, no trim)
    expected = ch.to_tokens(tokenizer, chatml)
    default = ch.to_tokens(tokenizer)
    for name in ("chatml", "chatml_format", "ChatML_Format"):
        got = ch.to_tokens(tokenizer, chat_template_name=name)
        assert got.full.tolist() == expected.full.tolist() and got.prompt.tolist() == expected.prompt.tolist()
    assert ch.to_text(tokenizer, chat_template_name="chatml_format").full == ch.to_text(tokenizer, chatml).full
    qwen = ch.to_text(tokenizer, chat_template_name="qwen2.5-instruct")
    assert qwen.full == ch.to_text(tokenizer, str(templates_dir / "stock-qwen2_5.jinja")).full
    assert qwen.full.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    llama = ch.to_text(tokenizer, chat_template_name="llama3").full
    assert "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>" in llama
    assert default.full.tolist() == PROMPT_IDS + RESPONSE_IDS
    with pytest.raises(ValueError, match="pass chat_template or chat_template_name, not both"):
        ch.to_tokens(tokenizer, chatml, chat_template_name="chatml")


def test_named_templates_need_no_folder_beside_the_package(tokenizer, monkeypatch, tmp_path):
    """The named templates ship in the package: the old folder variables change nothing."""
    monkeypatch.setenv("LIT_LLM_CHAT_TEMPLATES", str(tmp_path))
    monkeypatch.setenv("LIT_LLM_SHARED_DATA", str(tmp_path))
    ch = ChatHistory(prompt=history(CONV[:2]))
    out = ch.to_tokens(tokenizer, chat_template_name="chatml_format")
    assert tokenizer.decode(out.prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_chat_history_same_rank_warns_and_unsqueezes():
    from lit_llm.data.history import History

    h = History.from_chats([[{"role": "user", "content": "a"}], [{"role": "user", "content": "bb"}]])  # [2, 1]
    with pytest.warns(UserWarning, match=r"ChatHistory.prompt: the History should have one more batch dimension.*"
                                         r"got 1 and 1"):
        ch = ChatHistory(prompt=h[:, 0], batch_size=[2])
    assert ch.prompt.batch_size == torch.Size([2, 1]) and list(ch.prompt[1].content) == ["bb"]
    with pytest.warns(UserWarning, match="got 0 and 0"):
        one = ChatHistory(prompt=h[0, 0])
    assert one.prompt.batch_size == torch.Size([1])
    import warnings as _w
    with _w.catch_warnings():
        _w.simplefilter("error")
        ChatHistory(prompt=h, batch_size=[2])  # the right rank: no warning


def test_non_history_fields_raise_type_error(tokenizer):
    with pytest.raises(TypeError, match=r"ChatHistory: 'prompt' must be a History .*got (list|LinkedList)"):
        ChatHistory(prompt=[{"role": "user", "content": "a"}])


def test_full_only_conversions_split_at_the_last_assistant_turn(tokenizer):
    conv = [*CONV, {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]
    whole = ChatHistory(full=history(conv)).to_tokens(tokenizer)
    split = ChatHistory(prompt=history(conv[:4]), response=history(conv[4:])).to_tokens(tokenizer)
    for key in ("prompt", "response", "full"):
        assert getattr(whole, key).tolist() == getattr(split, key).tolist()
    assert tokenizer.decode(whole.response.tolist()) == "6<|im_end|>\n"
    text = ChatHistory(full=history(conv)).to_text(tokenizer)
    assert text.response == "6<|im_end|>\n" and text.full == text.prompt + text.response
    no_reply = ChatHistory(full=history(CONV[:2])).to_tokens(tokenizer)
    assert no_reply.prompt is None and no_reply.response is None
    assert no_reply.full.tolist() == PROMPT_IDS[:-4]  # no generation prompt: ends after "2+2?<|im_end|>\n"
    # Text / Tokens holding only full
    full_text = Text(full=FULL_TEXT)
    assert full_text.to_tokens(tokenizer).full.tolist() == PROMPT_IDS + RESPONSE_IDS
    assert full_text.to_tokens(tokenizer).prompt is None
    ch = full_text.to_history(tokenizer)
    assert _chat(ch.prompt) == [("system", "Be brief."), ("user", "2+2?")]
    assert _chat(ch.response) == [("assistant", "4")]
    assert _chat(ch.full) == [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4")]
    tok = Tokens(full=ids(PROMPT_IDS + RESPONSE_IDS), padded=False)
    assert tok.to_text(tokenizer).full == FULL_TEXT and tok.to_text(tokenizer).prompt is None
    assert _chat(tok.to_history(tokenizer).response) == [("assistant", "4")]


def test_unbatched_containers_holding_a_batch_of_one(tokenizer):
    from lit_llm.data.history import History

    single = ChatHistory(prompt=history(CONV[:2]), response=history(CONV[2:])).to_tokens(tokenizer)
    one_row = ChatHistory(prompt=History.from_chats([CONV[:2]]), response=History.from_chats([CONV[2:]]))
    # TorchRL's shapes: a batch of one in gives a batch of one out ([1, T] ids, one-element lists, [1, n] History)
    got = one_row.to_tokens(tokenizer)
    assert got.batch_size == torch.Size([]) and got.full.tolist() == [single.full.tolist()]
    assert got.prompt.tolist() == [single.prompt.tolist()] and got.response.tolist() == [single.response.tolist()]
    assert list(one_row.to_text(tokenizer).full) == [FULL_TEXT]
    listed = Text(prompt=[PROMPT_TEXT], response=[RESPONSE_TEXT])
    assert listed.to_tokens(tokenizer).full.tolist() == [PROMPT_IDS + RESPONSE_IDS]
    back = listed.to_history(tokenizer)
    assert back.response.batch_size == torch.Size([1, 1]) and _chat(back.response[0]) == [("assistant", "4")]
    two_d = Tokens(prompt=ids([PROMPT_IDS]), response=ids([RESPONSE_IDS]), padded=False)
    assert list(two_d.to_text(tokenizer).full) == [FULL_TEXT]
    with pytest.raises(ValueError, match=r"Text.prompt: this container is unbatched .* holds 2 rows; build it with "
                                         r"batch_size=\[2\]"):
        Text(prompt=[PROMPT_TEXT, PROMPT2_TEXT]).to_tokens(tokenizer)
    two = ChatHistory(prompt=History.from_chats([CONV[:2], CONV2[:1]]))
    with pytest.raises(ValueError, match=r"ChatHistory.prompt: this container is unbatched .* holds 2 rows"):
        two.to_tokens(tokenizer)
