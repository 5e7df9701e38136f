"""History: construction, validation, conversions, growth, rendering outputs and property 8 (special tokens)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_llm.data.errors import ChatTemplateError, InvalidConversationError, SpecialTokenInContentError
from lit_llm.data.history import History, find_special_tokens

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]
SHORT = [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Sup"}]
SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


# ---------------------------------------------------------------- construction and conversion
def test_from_chats_one_conversation():
    h = History.from_chats(CHAT)
    assert h.shape == (3,)
    assert list(h.role) == ["system", "user", "assistant"]
    assert list(h.content) == ["You are terse.", "Hi", "Hello!"]
    assert list(h.is_complete) == [True, True, True]
    assert h[2].role == "assistant" and h[2].content == "Hello!"
    assert h.to_chats() == CHAT


def test_from_chats_ragged_batch_is_padded_with_none_role():
    h = History.from_chats([CHAT, SHORT])
    assert h.shape == (2, 3)
    assert [list(r) for r in h.role] == [["system", "user", "assistant"], ["user", "assistant", "<none>"]]
    assert h[1, 2].content == ""
    assert h.to_chats() == [CHAT, SHORT]
    rows = h.unbind(0)
    assert [r.to_chats() for r in rows] == [CHAT, SHORT]
    assert list(h[:, 0].role) == ["system", "user"]


def test_optional_fields_round_trip():
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    chat = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "42"},
        {"role": "tool", "name": "f", "tool_call_id": "call_0", "content": "43"},
        {"role": "assistant", "content": "It is 4", "is_complete": False},
    ]
    h = History.from_chats(chat)
    assert h[4].is_complete is False
    assert (h[3].name, h[3].tool_call_id, h[2].name) == ("f", "call_0", None)
    assert h.to_chats() == chat
    assert History.from_chats([chat, SHORT]).to_chats() == [chat, SHORT]


@pytest.mark.parametrize(
    ("chats", "message"),
    [
        ([], "expected a conversation"),
        ("hello", "expected a conversation"),
        ([[]], "conversation 0 is empty"),
        ([SHORT, []], "conversation 1 is empty"),
        ([{"role": "user"}], "message 0 has no 'content' key"),
        ([{"content": "x"}], "message 0 has no 'role' key"),
        ([SHORT, [{"role": "user", "content": "a"}, {"role": "assistant"}]],
         "conversation 1, message 1 has no 'content' key"),
        ([{"role": "robot", "content": "x"}], "unknown role 'robot' (key 'role')"),
        ([{"role": "user", "content": 3}], "'content' must be a str, got int"),
        ([{"role": "assistant", "content": None}], "'content' must be a str, got NoneType"),
        ([{"role": "user", "content": "x", "weight": 1}], "unknown key(s) ['weight']"),
        ([{"role": "tool", "content": "x", "name": 3}], "'name'=3; it must be a str"),
        ([{"role": "tool", "content": "x", "tool_call_id": ["a"]}], "'tool_call_id'=['a']; it must be a str"),
        ([{"role": "user", "content": "x", "is_complete": "yes"}], "'is_complete'='yes'; it must be a bool"),
        ([{"role": "user", "content": "x", "tool_calls": "f()"}], "'tool_calls' of type str"),
        (["not a dict"], "conversation 0 is 'not a dict', not a list of message dicts"),
        ([SHORT, "oops"], "conversation 1 is 'oops', not a list"),
        ([SHORT, ["oops"]], "conversation 1, message 0 is 'oops', not a dict"),
    ],
)
def test_from_chats_bad_input(chats, message):
    with pytest.raises(InvalidConversationError) as err:
        History.from_chats(chats)
    assert message in str(err.value)


def test_from_text_delegates_to_chat_parsing(monkeypatch):
    from lit_llm.data import chat_parsing

    calls = []

    def parse_chat_text(text, chat_template_name, eos_token=None):
        calls.append((text, chat_template_name))
        return [{"role": "user", "content": text.upper()}, {"role": "assistant", "content": "ok"}][: len(text)]

    monkeypatch.setattr(chat_parsing, "parse_chat_text", parse_chat_text)
    h = History.from_text("hi", chat_template_name="chatml")
    assert calls == [("hi", "chatml")] and h.to_chats() == [
        {"role": "user", "content": "HI"}, {"role": "assistant", "content": "ok"}]
    b = History.from_text(["ab", "c"], chat_template_name="llama3")
    assert b.shape == (2, 2) and b.to_chats()[1] == [{"role": "user", "content": "C"}]
    with pytest.raises(InvalidConversationError, match="text 1 parsed into no message"):
        History.from_text(["ab", ""], chat_template_name="chatml")


# ---------------------------------------------------------------- growth
def test_append_one_message_per_conversation():
    h = History.from_chats([CHAT, SHORT])
    new = History.from_chats([[{"role": "user", "content": "more"}], [{"role": "user", "content": "again"}]])[:, 0]
    out = h.append(new, inplace=False)
    assert out.shape == (2, 4) and h.shape == (2, 3)
    assert out.to_chats() == [CHAT + [{"role": "user", "content": "more"}],
                              SHORT + [{"role": "user", "content": "again"}]]
    assert h.append(new) is h and h.shape == (2, 4)  # in place


def test_append_and_extend_1d():
    h = History.from_chats(SHORT)
    h.append(History.from_chats([{"role": "user", "content": "x"}])[0])
    assert h.to_chats() == SHORT + [{"role": "user", "content": "x"}]
    h.extend(History.from_chats(CHAT))
    assert h.shape == (6,) and h.to_chats() == SHORT + [{"role": "user", "content": "x"}] + CHAT
    with pytest.raises(ValueError, match="one dimension less than self"):
        h.append(History.from_chats(CHAT))
    with pytest.raises(ValueError, match="as many dimensions as self"):
        h.extend(History.from_chats(CHAT)[0])
    with pytest.raises(ValueError, match="no batch dimension"):
        h[0].append(h[1])


def test_extend_batch_dimension():
    """TorchRL's default ``dim=0`` grows a ``[B, n]`` History by conversations; ``dim=-1`` by messages."""
    h = History.from_chats([CHAT])
    out = h.extend(History.from_chats([[*SHORT, SHORT[0]]]), inplace=False)
    assert out.shape == (2, 3) and out.to_chats() == [CHAT, [*SHORT, SHORT[0]]]
    out = h.extend(History.from_chats([SHORT]), dim=-1, inplace=False)
    assert out.shape == (1, 5) and out.to_chats() == [CHAT + SHORT]


# ---------------------------------------------------------------- rendering outputs
def test_render_text_and_ids_match_transformers(tokenizer):
    h = History.from_chats(CHAT)
    text = h.apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n")
    prompt = History.from_chats(CHAT[1:2]).apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=True)
    assert prompt == SMOL_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = h.apply_chat_template(tokenizer, return_dict=False, add_generation_prompt=False, tokenize=True)
    assert ids.dtype == torch.long and ids.ndim == 1
    assert ids.tolist() == list(tokenizer.apply_chat_template(CHAT, return_dict=False))
    assert ids[:3].tolist() == [1, 9690, 198]  # <|im_start|> "system" "\n"
    out = h.apply_chat_template(tokenizer, add_generation_prompt=False, tokenize=True, return_dict=True)
    assert set(out) == {"input_ids", "attention_mask"}
    assert out["attention_mask"].dtype == torch.long and out["attention_mask"].tolist() == [1] * len(ids)


def test_defaults_are_torchrls(tokenizer):
    """TorchRL 0.14's defaults and their resolution: ``add_generation_prompt=True``; ``tokenize=None`` is ``True``
    only with masks or ``return_tensors``; ``return_dict=None`` gives a dict only with masks."""
    import inspect

    params = inspect.signature(History.apply_chat_template).parameters
    assert {k: params[k].default for k in ("add_generation_prompt", "tokenize", "return_dict", "padding",
                                           "truncation", "return_tensors", "return_assistant_tokens_mask")} == {
        "add_generation_prompt": True, "tokenize": None, "return_dict": None, "padding": False,
        "truncation": False, "return_tensors": None, "return_assistant_tokens_mask": False}
    h = History.from_chats(CHAT)
    prompt_text = h.apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=True)
    assert h.apply_chat_template(tokenizer) == prompt_text == tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert h.apply_chat_template(tokenizer, return_tensors="pt").tolist() == list(prompt_ids)
    enc = h.apply_chat_template(tokenizer, return_assistant_tokens_mask=True)
    assert set(enc) == {"input_ids", "attention_mask", "assistant_masks"}
    assert enc["input_ids"].tolist() == list(prompt_ids)
    assert tokenizer.decode(enc["input_ids"][enc["assistant_masks"]]) == "Hello!<|im_end|>"


def test_render_batch_outputs(tokenizer):
    h = History.from_chats([CHAT, SHORT])
    texts = h.apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=False)
    assert texts == [History.from_chats(c).apply_chat_template(tokenizer, tokenize=False,
                                                               add_generation_prompt=False) for c in (CHAT, SHORT)]
    assert texts[1] == SMOL_SYSTEM + "<|im_start|>user\nYo<|im_end|>\n<|im_start|>assistant\nSup<|im_end|>\n"
    ids = h.apply_chat_template(tokenizer, return_dict=False, add_generation_prompt=False, tokenize=True)
    assert isinstance(ids, list) and [len(x) for x in ids] == [len(tokenizer(t)["input_ids"]) for t in texts]
    padded = h.apply_chat_template(tokenizer, return_dict=False, padding=True, padding_side="left",
                                   add_generation_prompt=False, tokenize=True)
    n0, n1 = len(ids[0]), len(ids[1])
    assert n1 - n0 == 12  # SHORT is longer: SmolLM2 adds its long default system prompt
    assert padded.shape == (2, n1) and padded[1].tolist() == ids[1].tolist()
    assert padded[0, n1 - n0:].tolist() == ids[0].tolist()
    assert padded[0, :n1 - n0].tolist() == [tokenizer.pad_token_id] * (n1 - n0)


def test_template_from_path_string_and_kwargs(tokenizer, templates_dir):
    path = templates_dir / "llama-3-instruct.jinja"
    h = History.from_chats(CHAT[1:])
    expected = "<|im_start|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" \
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
    assert h.apply_chat_template(tokenizer, chat_template=path, tokenize=False, add_generation_prompt=False) == expected
    assert h.apply_chat_template(tokenizer, chat_template=str(path), tokenize=False,
                                 add_generation_prompt=False) == expected
    assert h.apply_chat_template(tokenizer, chat_template=path.read_text(), tokenize=False,
                                 add_generation_prompt=False) == expected
    # Extra keyword arguments reach the template as variables.
    tpl = "{{ greeting }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert h.apply_chat_template(tokenizer, chat_template=tpl, tokenize=False, greeting="hey",
                                 add_generation_prompt=False) == "hey|HiHello!"
    llama = templates_dir / "stock-llama3_1.jinja"
    text = h.apply_chat_template(tokenizer, chat_template=llama, tokenize=False, date_string="01 Jan 2030",
                                 add_generation_prompt=False)
    assert "Today Date: 01 Jan 2030\n\n" in text


def test_bad_template_path(tokenizer):
    with pytest.raises(ChatTemplateError, match="looks like a .jinja path but no such file exists"):
        History.from_chats(CHAT).apply_chat_template(tokenizer, chat_template="/nonexistent/x.jinja",
                                                     add_generation_prompt=False, tokenize=True, return_dict=True)


def test_template_exception_is_wrapped(tokenizer, templates_dir):
    h = History.from_chats([{"role": "assistant", "content": "first"}, {"role": "user", "content": "u"}])
    with pytest.raises(ChatTemplateError, match=r"'gemma-it.jinja' raised: Conversation roles must alternate"):
        h.apply_chat_template(tokenizer, chat_template=templates_dir / "gemma-it.jinja", add_generation_prompt=False,
                              tokenize=True, return_dict=True)


def test_render_validation_errors(tokenizer):
    h = History.from_chats([CHAT, SHORT])
    h[1, 0].role = "narrator"  # bypasses from_chats validation
    with pytest.raises(InvalidConversationError, match="conversation 1, message 0: unknown role 'narrator'"):
        h.apply_chat_template(tokenizer, add_generation_prompt=False, tokenize=True, return_dict=True)
    pad = History.from_chats([{"role": "<none>", "content": ""}])
    with pytest.raises(InvalidConversationError, match="the conversation is empty"):
        pad.apply_chat_template(tokenizer, add_generation_prompt=False, tokenize=True, return_dict=True)
    with pytest.raises(ValueError, match=r"shape \[n\] or \[B, n\]"):
        History.from_chats([CHAT]).unsqueeze(0).apply_chat_template(tokenizer, add_generation_prompt=False,
                                                                    tokenize=True, return_dict=True)


# ---------------------------------------------------------------- property 8: control tokens are not content
def test_special_token_in_content_raises(tokenizer):
    chat = [{"role": "user", "content": "end it<|im_end|> now"}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(SpecialTokenInContentError) as err:
        History.from_chats(chat).apply_chat_template(tokenizer, add_generation_prompt=False, tokenize=True,
                                                     return_dict=True)
    assert "message 0 (user) of the conversation" in str(err.value)
    assert "'<|im_end|>'" in str(err.value) and "allow_special_tokens=True" in str(err.value)
    batch = History.from_chats([SHORT, [{"role": "user", "content": "q"}, {"role": "assistant", "content":
                                                                             "<repo_name>x"}]])
    with pytest.raises(SpecialTokenInContentError, match=r"message 1 \(assistant\) of conversation 1 .*'<repo_name>'"):
        batch.apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=False)


def test_special_token_opt_in_tokenises_control_token(tokenizer):
    chat = [{"role": "user", "content": "a<|im_end|>b"}, {"role": "assistant", "content": "ok"}]
    ids = History.from_chats(chat).apply_chat_template(tokenizer, return_dict=False, allow_special_tokens=True,
                                                       add_generation_prompt=False, tokenize=True)
    # SMOL system prompt, then "<|im_start|>user\na", then the control token id 2, then "b<|im_end|>\n"...
    user = tokenizer("<|im_start|>user\na", add_special_tokens=False)["input_ids"]
    start = len(tokenizer(SMOL_SYSTEM, add_special_tokens=False)["input_ids"])
    assert ids[start:start + len(user) + 1].tolist() == user + [2]
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_find_special_tokens(tokenizer):
    assert find_special_tokens(tokenizer, "plain <|im_start text") == []
    assert find_special_tokens(tokenizer, "x<|endoftext|>y<file_sep>") == ["<|endoftext|>", "<file_sep>"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=5))
def test_property_ragged_padding_round_trip(lengths):
    chats = [[{"role": "user" if j % 2 == 0 else "assistant", "content": f"{i}-{j}"} for j in range(n)]
             for i, n in enumerate(lengths)]
    h = History.from_chats(chats)
    assert h.shape == (len(lengths), max(lengths))
    assert h.to_chats() == chats
    roles = [list(r) for r in h.role]
    assert [r.count("<none>") for r in roles] == [max(lengths) - n for n in lengths]
    assert all(r[:n] == [c["role"] for c in chat] for r, n, chat in zip(roles, lengths, chats))
