"""Template variables (``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) and exact assistant masks.

DESIGN.md property 3: an assistant mask is what a model generates after the generation prompt. With
``enable_thinking=False`` Qwen3's generation prompt ends with an empty think block (``<think>\\n\\n</think>\\n\\n``), so
the model generates only the answer and ``<|im_end|>``; a turn the template renders with reasoning inside that block
has no exact mask and is refused with an error naming the turn.

The expected masks here are computed from string positions: the rendered text comes from transformers' own
``tokenizer.apply_chat_template`` (not from the code under test), each assistant turn's generated text is located from
the structure of the template (header, optional think block, answer, stop token), and characters map to tokens with
the tokenizer's offset mapping (a token overlapping a span is in the mask).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data.datasets import DataFormatError, Example, tokenize_example
from lit_llm.data.errors import ChatTemplateError
from lit_llm.data.history import History
from lit_llm.data.prompts import tokenize_prompts

HEADER = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
STOP = "<|im_end|>"


def _expected_mask(tokenizer, text: str, spans: list[tuple[int, int]]) -> list[bool]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]


def _turns(messages: list[dict]) -> list[tuple[int, str, str]]:
    """``(index, reasoning, answer)`` of each assistant message (reasoning written as ``<think>\\nr\\n</think>``)."""
    out = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            c = m["content"]
            if "</think>" in c:
                r = c.split("</think>")[0].split("<think>")[-1].strip("\n")
                out.append((i, r, c.split("</think>")[-1].lstrip("\n")))
            else:
                out.append((i, "", c))
    return out


def qwen3_expected_spans(text: str, messages: list[dict], enable_thinking: bool) -> list[tuple[int, int]]:
    """Character spans of the generated text of each assistant turn in a Qwen3 render (stock template).

    Turns after the last user message are rendered ``HEADER <think>\\n{r}\\n</think>\\n\\n answer STOP``; with
    ``enable_thinking=False`` the generation prompt already holds an (empty) think block, so the span starts after it;
    otherwise the think block is generated. Earlier turns are rendered ``HEADER answer STOP`` (old reasoning dropped).
    """
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    spans, pos = [], 0
    for i, r, answer in _turns(messages):
        start = text.index(HEADER, pos) + len(HEADER)
        generated = answer + STOP
        if i > last_user:
            block = f"<think>\n{r}\n</think>\n\n"
            assert text.startswith(block, start)
            if enable_thinking:
                generated = block + generated
            else:
                assert block == EMPTY_THINK  # reasoning here is refused
                start += len(block)
        assert text.startswith(generated, start)
        spans.append((start, start + len(generated)))
        pos = spans[-1][1]
    return spans


REASONING_LAST = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
]
REASONING_EARLIER = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "A2"},
]


@pytest.fixture(scope="module")
def qwen3(templates_dir):
    path = templates_dir / "stock-qwen3.jinja"
    return path, path.read_text()


def test_reasoning_in_final_turn_with_thinking_off_is_refused_naming_the_turn(tokenizer, qwen3):
    path, _ = qwen3
    with pytest.raises(ChatTemplateError, match=r"assistant message 3 of the conversation .* inserts 'r2' .*"
                                                r"enable_thinking=False.*remove the reasoning.*message 3"):
        History.from_chats(REASONING_LAST).apply_chat_template(
            tokenizer, chat_template=path, return_assistant_tokens_mask=True, enable_thinking=False,
                add_generation_prompt=False)
    # The same conversation with thinking on is exact: the think block is generated.
    out = History.from_chats(REASONING_LAST).apply_chat_template(
        tokenizer, chat_template=path, return_assistant_tokens_mask=True, enable_thinking=True,
            add_generation_prompt=False)
    ids = out["input_ids"].tolist()
    text = tokenizer.decode(ids)
    assert out["assistant_masks"].tolist() == _expected_mask(
        tokenizer, text, qwen3_expected_spans(text, REASONING_LAST, True))


def test_sft_data_path_refuses_it_too(tokenizer, qwen3):
    path, _ = qwen3
    ex = Example(messages=REASONING_LAST, num_prompt_messages=3, sample_id="row:7")
    with pytest.raises(DataFormatError, match=r"row:7.*assistant message 3"):
        tokenize_example(ex, tokenizer, chat_template=str(path), chat_template_kwargs={"enable_thinking": False})


def test_old_reasoning_with_thinking_off_is_exact(tokenizer, qwen3):
    """Qwen3 drops old reasoning, so an earlier turn's tokens are its answer: exact, no error."""
    path, text_template = qwen3
    out = History.from_chats(REASONING_EARLIER).apply_chat_template(
        tokenizer, chat_template=path, return_assistant_tokens_mask=True, enable_thinking=False,
            add_generation_prompt=False)
    text = tokenizer.apply_chat_template(REASONING_EARLIER, chat_template=text_template, tokenize=False,
                                         enable_thinking=False)
    assert text == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nb"
                    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n")
    assert out["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = [(text.index(a), text.index(a) + len(a + STOP)) for a in ("A1", "A2")]
    assert spans[1] == (text.rindex(EMPTY_THINK) + len(EMPTY_THINK), len(text) - 1)
    assert out["assistant_masks"].tolist() == _expected_mask(tokenizer, text, spans)


def test_final_mask_is_what_follows_the_generation_prompt(tokenizer, qwen3):
    """DESIGN.md property 3 literally: the prompt rendered for generation (thinking off, through tokenize_prompts) is
    a prefix of the full render, and the final turn's mask covers exactly the characters after it up to and including
    <|im_end|> (a token straddling the boundary is in, as for every template)."""
    path, text_template = qwen3
    kwargs = {"enable_thinking": False}
    (prompt,) = tokenize_prompts([REASONING_EARLIER[:3]], tokenizer, chat_template=str(path),
                                 chat_template_kwargs=kwargs)
    prompt_text = tokenizer.decode(prompt)
    assert prompt_text.endswith(HEADER + EMPTY_THINK)
    text = tokenizer.apply_chat_template(REASONING_EARLIER, chat_template=text_template, tokenize=False, **kwargs)
    assert text.startswith(prompt_text) and text[len(prompt_text):] == f"A2{STOP}\n"
    out = History.from_chats(REASONING_EARLIER).apply_chat_template(
        tokenizer, chat_template=path, add_generation_prompt=False, return_assistant_tokens_mask=True, **kwargs)
    first = text.index("A1")
    spans = [(first, first + len("A1" + STOP)), (len(prompt_text), len(text) - 1)]
    assert out["assistant_masks"].tolist() == _expected_mask(tokenizer, text, spans)


def test_template_without_thinking_ignores_the_variable(tokenizer, templates_dir):
    """chatml has no enable_thinking: the same render and the same exact mask with or without it."""
    path = templates_dir / "chatml.jinja"
    conv = REASONING_EARLIER
    plain = History.from_chats(conv).apply_chat_template(tokenizer, chat_template=path,
                                                         return_assistant_tokens_mask=True, add_generation_prompt=False)
    off = History.from_chats(conv).apply_chat_template(tokenizer, chat_template=path,
                                                       return_assistant_tokens_mask=True, enable_thinking=False,
                                                           add_generation_prompt=False)
    assert torch.equal(plain["input_ids"], off["input_ids"])
    assert torch.equal(plain["assistant_masks"], off["assistant_masks"])
    text = tokenizer.apply_chat_template(conv, chat_template=path.read_text(), tokenize=False, enable_thinking=False)
    spans, pos = [], 0
    for m in conv:  # chatml: "<|im_start|>assistant\n" + content (trimmed) + "<|im_end|>" + "\n"
        if m["role"] == "assistant":
            start = text.index(HEADER, pos) + len(HEADER)
            assert text.startswith(m["content"].strip() + STOP, start)
            spans.append((start, start + len(m["content"].strip() + STOP)))
            pos = spans[-1][1]
    assert off["assistant_masks"].tolist() == _expected_mask(tokenizer, text, spans)


WORDS = st.text(alphabet="abc xyz12\n", min_size=1, max_size=8).filter(lambda s: s.strip() == s and "\n\n" not in s)


@st.composite
def conversations(draw):
    n = draw(st.integers(1, 3))
    msgs = []
    for _ in range(n):
        msgs.append({"role": "user", "content": draw(WORDS)})
        answer = draw(WORDS)
        reasoning = draw(st.one_of(st.none(), WORDS))
        content = answer if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n{answer}"
        msgs.append({"role": "assistant", "content": content})
    return msgs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=conversations(), enable_thinking=st.booleans())
def test_qwen3_masks_exact_or_refused(tokenizer, qwen3, conv, enable_thinking):
    """Property: for any conversation, the mask equals the one computed from string positions, or (thinking off and
    reasoning in the final turn, the only turn after the last user message) an error naming that turn."""
    path, text_template = qwen3
    history = History.from_chats(conv)
    final_reasoning = _turns(conv)[-1][1]
    if not enable_thinking and final_reasoning:
        with pytest.raises(ChatTemplateError, match=f"assistant message {len(conv) - 1} "):
            history.apply_chat_template(tokenizer, chat_template=path, return_assistant_tokens_mask=True,
                                        enable_thinking=False, add_generation_prompt=False)
        return
    out = history.apply_chat_template(tokenizer, chat_template=path, return_assistant_tokens_mask=True,
                                      enable_thinking=enable_thinking, add_generation_prompt=False)
    text = tokenizer.apply_chat_template(conv, chat_template=text_template, tokenize=False,
                                         enable_thinking=enable_thinking)
    assert out["input_ids"].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    spans = qwen3_expected_spans(text, conv, enable_thinking)
    assert out["assistant_masks"].tolist() == _expected_mask(tokenizer, text, spans)
