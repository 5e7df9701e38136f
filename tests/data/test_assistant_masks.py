"""Exact assistant masks (DESIGN.md property 3) for every real-model chat template of the fixtures and the SmolLM2
template.

The expected strings below are written by hand from reading each template (``tests/fixtures/chat_templates``) and
the SmolLM2 tokenizer's merges; they are not produced by the code under test. Each entry is the list of decoded
contiguous masked runs (one per assistant turn, in order), or the error message the template raises.

Notes that explain the less obvious entries (SmolLM2 tokenizer, byte-level BPE, GPT-2 pre-tokenizer):

* a token overlapping a span is in the mask, so when a template's newline is followed by content that starts with
  spaces, the token ``ĊĠ`` ("\\n ") is in and the decoded run starts with "\\n" (no-trim templates, conversation C2);
* llama-3 and DeepSeek stop texts are not special tokens here; BPE merges the stop text's last characters with the
  next header's "<" (tokens ``|><`` and ``｜><``), so a turn followed by another message decodes with a trailing "<";
* falcon-instruct has no end-of-turn text: only the content (after "Assistant:") is masked, so a model trained on
  it cannot learn to stop. An empty reply masks the single space token, which BPE merges with the next "\\n";
* templates without a generation prompt (llama-2, mistral) and those whose prompt ends before a space (vicuna,
  openchat, falcon) put the leading space in the turn: the model generates it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data.errors import ChatTemplateError, NoAssistantTokensError
from lit_llm.data.history import History

C1 = [  # system + user + assistant + user + assistant
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
]
C2 = [  # no system; newlines; unicode with leading/trailing spaces
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Line one\nLine two"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "  café ☕ naïve  "},
]
C3 = [  # empty assistant content
    {"role": "user", "content": "Say nothing"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "ok"},
    {"role": "assistant", "content": "fine"},
]
C4 = [  # roles that do not alternate
    {"role": "user", "content": "a"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "c"},
]
ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
EOS = "<|im_end|>"  # the SmolLM2 tokenizer's eos_token, rendered by templates that write {{ eos_token }}


def trimmed(stop: str, lead: str = "", c4: str | None = None) -> tuple:
    """Templates that trim the content and close the turn with ``stop`` (``lead``: text generated before it)."""
    return (
        [f"{lead}Hello!{stop}", f"{lead}2 + 2 = 4.{stop}"],
        [f"{lead}Line one\nLine two{stop}", f"{lead}café ☕ naïve{stop}"],
        [f"{lead}{stop}", f"{lead}fine{stop}"],
        c4 if c4 is not None else ALTERNATE,
    )


def verbatim(stop: str) -> tuple:
    """Templates that keep the content as is after "<header>\\n" (``ĊĠ`` merge on leading spaces)."""
    return (
        [f"Hello!{stop}", f"2 + 2 = 4.{stop}"],
        [f"Line one\nLine two{stop}", f"\n  café ☕ naïve  {stop}"],
        [f"{stop}", f"fine{stop}"],
        [f"c{stop}"],
    )


LLAMA3 = (
    ["Hello!<|eot_id|><", "2 + 2 = 4.<|eot_id|>"],
    ["Line one\nLine two<|eot_id|><", "café ☕ naïve<|eot_id|>"],
    ["<|eot_id|><", "fine<|eot_id|>"],
    ["c<|eot_id|>"],
)
EXPECTED: dict[str, tuple] = {
    "alpaca": trimmed(EOS),
    "chatml": trimmed("<|im_end|>"),
    "zephyr": trimmed(EOS),
    "gemma-it": trimmed("<end_of_turn>"),
    "stock-gemma3": trimmed("<end_of_turn>"),
    "phi-3": trimmed("<|end|>"),
    "phi-3-small": trimmed("<|end|>"),
    "mistral-instruct": trimmed(EOS, lead=" "),
    "vicuna": trimmed(EOS, lead=" "),
    "llama-2-chat": (
        [f" Hello! {EOS}", f" 2 + 2 = 4. {EOS}"],
        [f" Line one\nLine two {EOS}", f" café ☕ naïve {EOS}"],
        [f"  {EOS}", f" fine {EOS}"],
        ALTERNATE,
    ),
    "openchat-3.5": (
        [" Hello!<|end_of_turn|>", " 2 + 2 = 4.<|end_of_turn|>"],
        [" Line one\nLine two<|end_of_turn|>", "   café ☕ naïve  <|end_of_turn|>"],
        [" <|end_of_turn|>", " fine<|end_of_turn|>"],
        ALTERNATE,
    ),
    "falcon-instruct": (
        [" Hello!", " 2 + 2 = 4."],
        [" Line one\nLine two", " café ☕ naïve"],
        [" \n", " fine"],
        ALTERNATE,
    ),
    "llama-3-instruct": (*LLAMA3[:3], ALTERNATE),
    "stock-llama3_1": LLAMA3,
    "stock-llama3_2": LLAMA3,
    # chujiezheng's qwen2.5 file had its newlines removed: "<|im_start|>assistant" + content, no "\n" to merge.
    "qwen2.5-instruct": (
        ["Hello!<|im_end|>", "2 + 2 = 4.<|im_end|>"],
        ["Line one\nLine two<|im_end|>", "  café ☕ naïve  <|im_end|>"],
        ["<|im_end|>", "fine<|im_end|>"],
        ["c<|im_end|>"],
    ),
    "stock-qwen2_5": verbatim("<|im_end|>"),
    "stock-lfm2": verbatim("<|im_end|>"),
    "stock-phi3_5": verbatim("<|end|>"),  # its final eos_token (document end, not generated) is out
    "tokenizer default": verbatim("<|im_end|>"),  # SmolLM2's own template (adds a default system prompt)
    # Qwen3 renders an empty think block in the last assistant turn (the model emits it): in the mask.
    "stock-qwen3": (
        ["Hello!<|im_end|>", "<think>\n\n</think>\n\n2 + 2 = 4.<|im_end|>"],
        ["Line one\nLine two<|im_end|>", "<think>\n\n</think>\n\n  café ☕ naïve  <|im_end|>"],
        ["<|im_end|>", "<think>\n\n</think>\n\nfine<|im_end|>"],
        ["<think>\n\n</think>\n\nc<|im_end|>"],
    ),
    "stock-deepseekv3": (
        ["Hello!<｜end▁of▁sentence｜><", "2 + 2 = 4.<｜end▁of▁sentence｜>"],
        ["Line one\nLine two<｜end▁of▁sentence｜><", "  café ☕ naïve  <｜end▁of▁sentence｜>"],
        ["><｜end▁of▁sentence｜><", "fine<｜end▁of▁sentence｜>"],  # "<｜Assistant｜>" + "" merges "><"
        ["c<｜end▁of▁sentence｜>"],
    ),
}
CONVERSATIONS = {"C1": C1, "C2": C2, "C3": C3, "C4": C4}


def masked_runs(tokenizer, out: dict) -> list[str]:
    """Decode each contiguous run of masked tokens."""
    ids, mask = out["input_ids"].tolist(), out["assistant_masks"].tolist()
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r, clean_up_tokenization_spaces=False) for r in runs]


def template_arg(templates_dir: Path, name: str) -> Path | None:
    return None if name == "tokenizer default" else templates_dir / f"{name}.jinja"


def test_table_covers_every_shared_template(templates_dir):
    files = {p.stem for p in templates_dir.glob("*.jinja")}
    assert len(files) == 21
    assert files | {"tokenizer default"} == set(EXPECTED)


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(EXPECTED))
def test_masked_text_per_template(tokenizer, templates_dir, name, conv):
    expected = EXPECTED[name][list(CONVERSATIONS).index(conv)]
    history = History.from_chats(CONVERSATIONS[conv])
    template = template_arg(templates_dir, name)
    if isinstance(expected, str):
        with pytest.raises(ChatTemplateError, match=re.escape(expected)):
            history.apply_chat_template(tokenizer, chat_template=template, return_assistant_tokens_mask=True,
                                        add_generation_prompt=False)
        return
    out = history.apply_chat_template(tokenizer, chat_template=template, return_assistant_tokens_mask=True,
                                      add_generation_prompt=False)
    assert masked_runs(tokenizer, out) == expected
    assert out["assistant_masks"].dtype == torch.bool
    # Same ids as transformers' own apply_chat_template with that template.
    text = template.read_text() if template else None
    ref = tokenizer.apply_chat_template(CONVERSATIONS[conv], chat_template=text, return_dict=False)
    assert out["input_ids"].tolist() == list(ref)


def test_generation_prompt_is_never_masked(tokenizer):
    out = History.from_chats(C1).apply_chat_template(
        tokenizer, add_generation_prompt=True, return_assistant_tokens_mask=True
    )
    ids = out["input_ids"].tolist()
    # "<|im_start|>assistant\n" closes the render: tokens <|im_start|>, "ass", "istant", "Ċ".
    assert tokenizer.decode(ids[-4:]) == "<|im_start|>assistant\n"
    assert out["assistant_masks"][-4:].tolist() == [False] * 4
    assert masked_runs(tokenizer, out) == ["Hello!<|im_end|>", "2 + 2 = 4.<|im_end|>"]


REASONING = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
]


def test_qwen3_drops_old_reasoning_masks_stay_exact(tokenizer, templates_dir):
    """Qwen3 rewrites earlier turns (old reasoning dropped): the mask is exact on the full render."""
    history = History.from_chats(REASONING)
    template = templates_dir / "stock-qwen3.jinja"
    text = history.apply_chat_template(tokenizer, chat_template=template, tokenize=False, add_generation_prompt=False)
    assert text == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n"
    )
    out = history.apply_chat_template(tokenizer, chat_template=template, return_assistant_tokens_mask=True,
                                      add_generation_prompt=False)
    assert masked_runs(tokenizer, out) == ["A1<|im_end|>", "<think>\nr2\n</think>\n\nA2<|im_end|>"]


def test_qwen3_enable_thinking_false_reaches_template(tokenizer, templates_dir):
    history = History.from_chats(C4[1:])  # user "b", assistant "c"
    template = templates_dir / "stock-qwen3.jinja"
    prompt = History.from_chats(C4[1:2]).apply_chat_template(
        tokenizer, chat_template=template, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt == "<|im_start|>user\nb<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # The empty think block is now part of the generation prompt: out of the mask.
    out = history.apply_chat_template(
        tokenizer, chat_template=template, add_generation_prompt=False, return_assistant_tokens_mask=True,
        enable_thinking=False,
    )
    assert masked_runs(tokenizer, out) == ["c<|im_end|>"]


def test_deepseek_generation_prompt_not_in_full_render(tokenizer, templates_dir):
    """DeepSeek-V3's prompt ends with "<｜Assistant｜><think>\\n", the full render keeps only the answer."""
    out = History.from_chats(REASONING).apply_chat_template(
        tokenizer, chat_template=templates_dir / "stock-deepseekv3.jinja", add_generation_prompt=False,
        return_assistant_tokens_mask=True,
    )
    assert masked_runs(tokenizer, out) == ["\n\nA1<｜end▁of▁sentence｜><", "\n\nA2<｜end▁of▁sentence｜>"]


TOOL_CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
TOOL_CHAT = [
    {"role": "user", "content": "1+2?"},
    {"role": "assistant", "content": "", "tool_calls": TOOL_CALL},
    {"role": "tool", "content": "3"},
    {"role": "assistant", "content": "It is 3."},
]


def test_tool_call_turn_is_masked_tool_result_is_not(tokenizer, templates_dir):
    history = History.from_chats(TOOL_CHAT)
    template = templates_dir / "stock-qwen2_5.jinja"
    out = history.apply_chat_template(tokenizer, chat_template=template, tools=TOOLS,
                                      return_assistant_tokens_mask=True, add_generation_prompt=False)
    # Qwen2.5 writes "<|im_start|>assistant" + "\n<tool_call>..." for a call without content; the "\n" is the
    # generation prompt's ("<|im_start|>assistant\n"), so it is out of the mask: the model generates "<tool_call>".
    assert masked_runs(tokenizer, out) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        "It is 3.<|im_end|>",
    ]
    text = history.apply_chat_template(tokenizer, chat_template=template, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=False)
    assert "# Tools" in text and '"name": "add"' in text  # `tools` reached the template
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text


GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_generation_markers_are_used(tokenizer):
    """The marked block is the mask, even where prefix renders would disagree (here: the content only)."""
    marked = GENERATION_TEMPLATE.replace("{% generation %}{{ m['content'] + '<|im_end|>' }}",
                                         "{{ '' }}{% generation %}{{ m['content'] }}")
    marked = marked.replace("{% endgeneration %}{{ '\n' }}", "{% endgeneration %}{{ '<|im_end|>\n' }}")
    out = History.from_chats(C2).apply_chat_template(tokenizer, chat_template=marked,
                                                     return_assistant_tokens_mask=True, add_generation_prompt=False)
    assert masked_runs(tokenizer, out) == ["Line one\nLine two", "\n  café ☕ naïve  "]
    out = History.from_chats(C2).apply_chat_template(tokenizer, chat_template=GENERATION_TEMPLATE,
                                                     return_assistant_tokens_mask=True, add_generation_prompt=False)
    assert masked_runs(tokenizer, out) == ["Line one\nLine two<|im_end|>", "\n  café ☕ naïve  <|im_end|>"]


@pytest.mark.parametrize("conv", [
    [{"role": "user", "content": "only a question"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
])
def test_no_assistant_tokens_raises(tokenizer, conv):
    with pytest.raises(NoAssistantTokensError, match=r"no assistant tokens .*'tokenizer default'"):
        History.from_chats(conv).apply_chat_template(tokenizer, return_assistant_tokens_mask=True,
                                                     add_generation_prompt=False)
    batch = History.from_chats([C1, conv])
    with pytest.raises(NoAssistantTokensError, match="conversation 1 has no assistant tokens"):
        batch.apply_chat_template(tokenizer, return_assistant_tokens_mask=True, add_generation_prompt=False)


def test_masks_need_tokenized_dict(tokenizer):
    with pytest.raises(ValueError, match="return_assistant_tokens_mask=True needs tokenize=True and return_dict"):
        History.from_chats(C1).apply_chat_template(tokenizer, tokenize=False, return_assistant_tokens_mask=True,
                                                   add_generation_prompt=False)


@pytest.mark.parametrize("side", ["left", "right"])
def test_ragged_batch_padded_masks(tokenizer, side):
    batch = History.from_chats([C1, C3[:2]])  # 5 and 2 messages -> [2, 5] with "<none>" padding
    assert batch.shape == (2, 5)
    out = batch.apply_chat_template(tokenizer, return_assistant_tokens_mask=True, padding=True, padding_side=side,
                                    add_generation_prompt=False)
    single = [History.from_chats(c).apply_chat_template(tokenizer, return_assistant_tokens_mask=True,
                                                        add_generation_prompt=False)
              for c in (C1, C3[:2])]
    n0, n1 = len(single[0]["input_ids"]), len(single[1]["input_ids"])
    assert out["input_ids"].shape == (2, max(n0, n1)) and n0 > n1
    pad = max(n0, n1) - n1
    keep = slice(pad, None) if side == "left" else slice(0, n1)
    padpos = slice(0, pad) if side == "left" else slice(n1, None)
    assert out["input_ids"][1, keep].tolist() == single[1]["input_ids"].tolist()
    assert out["input_ids"][1, padpos].tolist() == [tokenizer.pad_token_id] * pad
    assert out["attention_mask"][1].tolist() == ([0] * pad + [1] * n1 if side == "left" else [1] * n1 + [0] * pad)
    assert out["assistant_masks"][1, padpos].tolist() == [False] * pad
    assert out["assistant_masks"][1, keep].tolist() == single[1]["assistant_masks"].tolist()
    assert out["attention_mask"].dtype == torch.long and out["assistant_masks"].dtype == torch.bool
    # Without padding (TorchRL's shape): a lazy stack of per-row TensorDicts, one [T_b] row per conversation.
    lst = batch.apply_chat_template(tokenizer, return_assistant_tokens_mask=True, add_generation_prompt=False)
    assert lst.batch_size[0] == 2 and [row.batch_size[0] for row in lst.unbind(0)] == [n0, n1]
    masks, ids = lst.get("assistant_masks", as_list=True), lst.get("input_ids", as_list=True)
    assert [m.tolist() for m in masks] == [s["assistant_masks"].tolist() for s in single]
    assert [m.tolist() for m in ids] == [s["input_ids"].tolist() for s in single]


# ---------------------------------------------------------------- property test (SmolLM2 template)
ALPHABET = "abcXYZ019 \n\t.,!?-_'\"é☕ß漢"
content = st.text(alphabet=ALPHABET, max_size=12).filter(lambda s: not s[:1].isspace())
message = st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), content)
conversation = st.lists(message, min_size=1, max_size=6).filter(lambda c: any(r == "assistant" for r, _ in c))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(convs=st.lists(conversation, min_size=1, max_size=3), side=st.sampled_from(["left", "right"]))
def test_property_smollm2_masks(tokenizer, convs, side):
    chats = [[{"role": r, "content": c} for r, c in conv] for conv in convs]
    out = History.from_chats(chats).apply_chat_template(
        tokenizer, return_assistant_tokens_mask=True, padding=True, padding_side=side, add_generation_prompt=False
    )
    for b, chat in enumerate(chats):
        keep = out["attention_mask"][b].bool()
        ids, mask = out["input_ids"][b][keep], out["assistant_masks"][b][keep]
        assert not bool(out["assistant_masks"][b][~keep].any())  # never on padding
        ref = tokenizer.apply_chat_template(chat, return_dict=False)
        assert ids.tolist() == list(ref)
        got = masked_runs(tokenizer, {"input_ids": ids, "assistant_masks": mask})
        assert got == [m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant"]
