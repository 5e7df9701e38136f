"""Tests for lit_llm.data.chat_parsing: parse_chat_text per family, round trips through the shared templates."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data.chat_parsing import CHAT_TEMPLATE_NAMES, parse_chat_text
from lit_llm.data.errors import InvalidConversationError


def pairs(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in messages]


# --------------------------------------------------------------------------------- hand-written texts, per family
HAND_WRITTEN = [
    (
        "chatml",
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi\nthere<|im_end|>\n"
        "<|im_start|>assistant\n yo <|im_end|>\n",
        [("system", "S", True), ("user", "hi\nthere", True), ("assistant", " yo ", True)],
    ),
    ("smollm2", "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nhalf an ans", [
        ("user", "q", True), ("assistant", "half an ans", False)]),
    ("qwen", "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", [("user", "q", True), ("assistant", "", False)]),
    (
        "llama3",
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"
        "{}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nFo",
        [("user", "2+2?", True), ("assistant", "4", True), ("tool", "{}", True), ("assistant", "Fo", False)],
    ),
    (
        "mistral",
        "<s>Be nice.\n\n[INST] a [/INST] b</s>[INST] c [/INST] d</s>",
        [("system", "Be nice.", True), ("user", "a", True), ("assistant", "b", True), ("user", "c", True),
         ("assistant", "d", True)],
    ),
    ("mistral", "<s>[INST] a [/INST] par", [("user", "a", True), ("assistant", "par", False)]),
    ("mistral", "<s>[INST] a [/INST]", [("user", "a", True), ("assistant", "", False)]),
    (
        "llama2",
        "<s>[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\na [/INST] b </s><s>[INST] c [/INST] d </s>",
        [("system", "Be nice.", True), ("user", "a", True), ("assistant", "b", True), ("user", "c", True),
         ("assistant", "d", True)],
    ),
    (
        "gemma",
        "<bos><start_of_turn>user\nx<end_of_turn>\n<start_of_turn>model\ny<end_of_turn>\n",
        [("user", "x", True), ("assistant", "y", True)],
    ),
    (
        "phi3",
        "<|system|>\ns<|end|>\n<|user|>\nx<|end|>\n<|assistant|>\ny<|end|>\n<|endoftext|>",
        [("system", "s", True), ("user", "x", True), ("assistant", "y", True)],
    ),
    (
        "zephyr",
        "<|user|>\nx</s>\n<|assistant|>\ny</s>\n<|user|>\nz</s>\n<|assistant|>\nw",
        [("user", "x", True), ("assistant", "y", True), ("user", "z", True), ("assistant", "w", False)],
    ),
]


@pytest.mark.parametrize(("name", "text", "expected"), HAND_WRITTEN, ids=[f"{n}-{i}" for i, (n, *_) in
                                                                          enumerate(HAND_WRITTEN)])
def test_parse_hand_written(name, text, expected):
    got = parse_chat_text(text, name)
    assert [(m["role"], m["content"], m["is_complete"]) for m in got] == expected


def test_explicit_bos_eos_tokens():
    text = "<BOS>[INST] a [/INST] b<EOS>[INST] c [/INST] d"
    got = parse_chat_text(text, "mistral", bos_token="<BOS>", eos_token="<EOS>")
    assert [(m["role"], m["content"], m["is_complete"]) for m in got] == [
        ("user", "a", True), ("assistant", "b", True), ("user", "c", True), ("assistant", "d", False)]
    # with an explicit eos, the default ones are ordinary text
    got = parse_chat_text("[INST] a [/INST] b</s>", "mistral", eos_token="<EOS>")
    assert got[-1] == {"role": "assistant", "content": "b</s>", "is_complete": False}


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown chat_template_name 'vicuna'") as info:
        parse_chat_text("USER: hi", "vicuna")
    for name in ("chatml", "smollm2", "qwen", "llama3", "mistral", "llama2", "gemma", "phi3", "zephyr"):
        assert name in str(info.value)
    assert set(CHAT_TEMPLATE_NAMES) == {"chatml", "chatml_format", "smollm2", "qwen", "qwen2.5-instruct", "qwen3",
                                        "llama", "llama3", "mistral", "llama2", "gemma", "phi3", "zephyr",
                                        "dialogpt", "falcon", "deepseek"}


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("chatml", "hello", r"expected a turn header at character position 0, found 'hello'"),
        ("chatml", "<|im_start|>user\nq<|im_start|>assistant\na<|im_end|>",
         r"expected the end of the 'user' turn \(<\|im_end\|> or <\|endoftext\|>\) at character position 18"),
        ("llama3", "<|im_start|>user\nq<|im_end|>", r"parse_chat_text\('llama3'\): expected a turn header"),
        ("mistral", "just text", r"expected '\[INST\] ' at character position 0, found 'just text'"),
        ("mistral", "Sys\n[INST] a [/INST]", r"expected '\[INST\] ' or a system prompt ending in"),
        ("chatml", "", r"expected at least one turn at character position 0"),
        ("chatml", "<|im_start|>user\nq<|im_end|>\ngarbage", r"turn header at character position 29, found 'garbage'"),
    ],
)
def test_malformed_text_raises(name, text, match):
    with pytest.raises(InvalidConversationError, match=match):
        parse_chat_text(text, name)


def test_non_string_text_raises():
    with pytest.raises(TypeError, match="'text' must be a str"):
        parse_chat_text(["<|im_start|>"], "chatml")


# ------------------------------------------------------------------------ round trips through the shared templates
CONV = [
    {"role": "system", "content": " Be brief. "},
    {"role": "user", "content": "  What is 2+2?\n"},
    {"role": "assistant", "content": "4\nFour ✓"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": " You're welcome! "},
]
RAW = pairs(CONV)
TRIMMED = [("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4\nFour ✓"), ("user", "Thanks"),
           ("assistant", "You're welcome!")]
SMOL_SYS = ("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")
QWEN_SYS = ("system", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
LLAMA31_DATE = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"

# What each template does on purpose, written out: template file (None = the SmolLM2 tokenizer's own), family name,
# expected parse of render(CONV), expected parse of render(CONV without its system message).
ROUND_TRIPS = [
    # keeps content as is; adds a default system prompt when there is none
    (None, "smollm2", RAW, [SMOL_SYS, *RAW[1:]]),
    # trims content
    ("chatml.jinja", "chatml", TRIMMED, TRIMMED[1:]),
    # keeps content as is; adds a default system prompt when there is none
    ("stock-qwen2_5.jinja", "qwen", RAW, [QWEN_SYS, *RAW[1:]]),
    # trims content
    ("llama-3-instruct.jinja", "llama3", TRIMMED, TRIMMED[1:]),
    # trims content; prepends a knowledge-cutoff header to the system prompt (an empty one when there is none)
    ("stock-llama3_1.jinja", "llama3", [("system", LLAMA31_DATE + "Be brief."), *TRIMMED[1:]],
     [("system", LLAMA31_DATE), *TRIMMED[1:]]),
    # trims content
    ("mistral-instruct.jinja", "mistral", TRIMMED, TRIMMED[1:]),
    # folds the trimmed system prompt into the first user turn, then trims that turn as a whole
    ("llama-2-chat.jinja", "llama2", [("system", "Be brief."), ("user", "  What is 2+2?"), *TRIMMED[2:]],
     TRIMMED[1:]),
    # folds the system prompt into the first user turn (not separable again); trims; assistant -> model -> assistant
    ("gemma-it.jinja", "gemma", [("user", "Be brief.\n\n  What is 2+2?"), *TRIMMED[2:]], TRIMMED[1:]),
    # folds the untrimmed system prompt into the first user turn; trims
    ("stock-gemma3.jinja", "gemma", [("user", " Be brief. \n\nWhat is 2+2?"), *TRIMMED[2:]], TRIMMED[1:]),
    # trims content
    ("phi-3.jinja", "phi3", TRIMMED, TRIMMED[1:]),
    # keeps content as is; appends EOS after the last turn (ignored by the parser)
    ("stock-phi3_5.jinja", "phi3", RAW, RAW[1:]),
    # trims content; eos_token ends every turn
    ("zephyr.jinja", "zephyr", TRIMMED, TRIMMED[1:]),
]
IDS = [f"{t or 'smollm2-own'}" for t, *_ in ROUND_TRIPS]


def _template(templates_dir, name):
    return None if name is None else (templates_dir / name).read_text()


@pytest.mark.parametrize(("template", "family", "with_system", "without_system"), ROUND_TRIPS, ids=IDS)
def test_round_trip_shared_templates(tokenizer, templates_dir, template, family, with_system, without_system):
    tpl = _template(templates_dir, template)
    for conv, expected in ((CONV, with_system), (CONV[1:], without_system)):
        text = tokenizer.apply_chat_template(conv, chat_template=tpl, tokenize=False)
        got = parse_chat_text(text, family)
        assert pairs(got) == expected
        assert all(m["is_complete"] for m in got)


# The text a family renders between the generation prompt and the reply (Mistral/Llama-2 have no generation prompt:
# the prompt ends with "[/INST]" and the reply starts with a space).
REPLY_PREFIX = {"mistral": " ", "llama2": " "}


@pytest.mark.parametrize(("template", "family", "with_system", "without_system"), ROUND_TRIPS, ids=IDS)
def test_unfinished_reply_is_incomplete(tokenizer, templates_dir, template, family, with_system, without_system):
    tpl = _template(templates_dir, template)
    prompt = tokenizer.apply_chat_template(CONV[:-1], chat_template=tpl, tokenize=False, add_generation_prompt=True)
    bare = parse_chat_text(prompt, family)
    assert pairs(bare) == with_system[:-1] + [("assistant", "")]
    assert [m["is_complete"] for m in bare] == [True] * (len(bare) - 1) + [False]
    partial = parse_chat_text(prompt + REPLY_PREFIX.get(family, "") + "You're wel", family)
    assert partial[-1] == {"role": "assistant", "content": "You're wel", "is_complete": False}
    assert pairs(partial[:-1]) == with_system[:-1]


# ----------------------------------------------------------------------------------------- property: exact inverse
EXACT = [(None, "smollm2"), ("chatml.jinja", "chatml"), ("stock-qwen2_5.jinja", "qwen"),
         ("llama-3-instruct.jinja", "llama3"), ("mistral-instruct.jinja", "mistral"), ("llama-2-chat.jinja", "llama2"),
         ("phi-3.jinja", "phi3"), ("zephyr.jinja", "zephyr")]
_content = st.text(alphabet=st.sampled_from(list("abcXYZ019 .,?!\n\té✓中")), min_size=1, max_size=12).map(
    str.strip).filter(bool)


@st.composite
def conversations(draw):
    n_turns = draw(st.integers(1, 3))
    conv = [{"role": "system", "content": draw(_content)}]
    for _ in range(n_turns):
        conv += [{"role": "user", "content": draw(_content)}, {"role": "assistant", "content": draw(_content)}]
    return conv


@pytest.mark.parametrize(("template", "family"), EXACT, ids=[t or "smollm2-own" for t, _ in EXACT])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations())
def test_parse_inverts_render(tokenizer, templates_dir, template, family, conv):
    """For trimmed contents and a system message, these templates change nothing: parse(render(c)) == c."""
    text = tokenizer.apply_chat_template(conv, chat_template=_template(templates_dir, template), tokenize=False)
    got = parse_chat_text(text, family)
    assert got == [{**m, "is_complete": True} for m in conv]


# --------------------------------------------------------------------------------------- through History.from_text
@pytest.mark.parametrize(("template", "family", "with_system", "without_system"), ROUND_TRIPS, ids=IDS)
def test_history_from_text_round_trip(tokenizer, templates_dir, template, family, with_system, without_system):
    """History.from_text(render(h)) == h, modulo the template's own changes (the table above); batched too."""
    from lit_llm.data.history import History

    tpl = _template(templates_dir, template)
    h = History.from_chats([CONV, CONV[1:3]])  # [2, 5], the second row "<none>"-padded
    texts = h.apply_chat_template(tokenizer, chat_template=tpl, tokenize=False, add_generation_prompt=False)
    back = History.from_text(texts, chat_template_name=family)
    assert back.batch_size[0] == 2
    assert [[(m["role"], m["content"]) for m in row] for row in back.to_chats()] == [with_system,
                                                                                     without_system[:-2]]
    single = History.from_text(texts[0], chat_template_name=family)
    assert [(m["role"], m["content"]) for m in single.to_chats()] == with_system
    prompt = History.from_chats(CONV[:-1]).apply_chat_template(tokenizer, chat_template=tpl, tokenize=False,
                                                               add_generation_prompt=True)
    unfinished = History.from_text(prompt + REPLY_PREFIX.get(family, "") + "You're", chat_template_name=family)
    assert unfinished.to_chats()[-1] == {"role": "assistant", "content": "You're", "is_complete": False}
