"""Tool conversations are first-class in the data layer: ``History`` keeps the tool messages' ``name`` /
``tool_call_id`` and assistant ``tool_calls``, and the assistant (rlhf) masks of multi-turn tool conversations are
exact (DESIGN.md property 3): every assistant turn -- the ones that call a tool included -- is in the mask, from
the end of its generation prompt through its stop token; tool results, user and system messages never are.

Templates: SmolLM2's own (no ``tools=``: the tool is described in a system message, calls are text in the content),
and the shared stock Qwen2.5, Qwen3 and Llama-3.1 templates, which take ``tools=`` and render structured
``tool_calls`` themselves.

The expected masks are computed from string positions, independently of the code under test: the rendered text is
transformers' own ``tokenizer.apply_chat_template``; each assistant turn's generated text is written from the
template's structure (:func:`generated_text`: header, the content or the template's rendering of the calls, stop
token); it is located after its header in that render, and characters map to tokens with the tokenizer's offset
mapping (a token overlapping a span is in the mask).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data.datasets import Example, tokenize_example
from lit_llm.data.errors import ChatTemplateError
from lit_llm.data.history import History

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "the sum"}},
                   "required": ["expression"]}}}]
SYSTEM = "You can call calculator. Write <tool_call>{json}</tool_call> to call it."


def call_text(expression: str) -> str:
    """A call as text in the content (what a model writes and the episode engine decodes)."""
    return "<tool_call>\n" + '{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def structured(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


TEXT_CALLS = [  # calls as text (SmolLM2 / any template); two rounds of call + result, then the answer
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 347 * 5812 + 1?"},
    {"role": "assistant", "content": call_text("347 * 5812")},
    {"role": "tool", "name": "calculator", "content": "2016764"},
    {"role": "assistant", "content": call_text("2016764 + 1")},
    {"role": "tool", "name": "calculator", "content": "2016765"},
    {"role": "assistant", "content": "The answer is 2016765."},
]
STRUCTURED_CALLS = [  # OpenAI-style: empty content, structured tool_calls, tool messages with name and call id
    {"role": "user", "content": "What is 347 * 5812 + 1?"},
    {"role": "assistant", "content": "", "tool_calls": [structured("347 * 5812")]},
    {"role": "tool", "name": "calculator", "tool_call_id": "call_0", "content": "2016764"},
    {"role": "assistant", "content": "", "tool_calls": [structured("2016764 + 1")]},
    {"role": "tool", "name": "calculator", "tool_call_id": "call_1", "content": "2016765"},
    {"role": "assistant", "content": "It is 2016765."},
]
PARALLEL_CALLS = [  # two calls in one turn, two tool results in a row; text before the calls
    {"role": "user", "content": "Add 12 + 30 and 5 + 6."},
    {"role": "assistant", "content": "Let me compute both.",
     "tool_calls": [structured("12 + 30"), structured("5 + 6")]},
    {"role": "tool", "name": "calculator", "content": "42"},
    {"role": "tool", "name": "calculator", "content": "11"},
    {"role": "assistant", "content": "42 and 11."},
]
CONVERSATIONS = {"text": TEXT_CALLS, "structured": STRUCTURED_CALLS, "parallel": PARALLEL_CALLS}

CHATML_HEADER, CHATML_STOP = "<|im_start|>assistant\n", "<|im_end|>"
LLAMA_HEADER, LLAMA_STOP = "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"
TEMPLATES = {"smollm2": None, "qwen2.5": "stock-qwen2_5.jinja", "qwen3": "stock-qwen3.jinja",
             "llama3.1": "stock-llama3_1.jinja"}


def generated_text(template: str, messages: list[dict], i: int) -> str:
    """What the model generates for assistant message ``i`` under ``template`` (from reading the template)."""
    m = messages[i]
    calls = [c["function"] for c in m.get("tool_calls") or []]
    if template == "llama3.1":  # the content is replaced by the single call's JSON; "parameters", not "arguments"
        if calls:
            args = json.dumps(calls[0]["arguments"], ensure_ascii=False)  # Jinja's tojson: ensure_ascii=False
            return '{"name": "' + calls[0]["name"] + '", "parameters": ' + args + "}" + LLAMA_STOP
        return m["content"].strip() + LLAMA_STOP
    if template == "smollm2":  # its template ignores tool_calls: the content only
        return m["content"] + CHATML_STOP
    rendered = ['<tool_call>\n{"name": "' + c["name"] + '", "arguments": '
                + json.dumps(c["arguments"], ensure_ascii=False) + "}\n</tool_call>" for c in calls]
    text = "\n".join(([m["content"]] if m["content"] else []) + rendered)
    last_user = max(j for j, x in enumerate(messages) if x["role"] == "user")
    if template == "qwen3" and i == len(messages) - 1 and i > last_user:  # the final turn opens an empty think block
        text = "<think>\n\n</think>\n\n" + text
    return text + CHATML_STOP


def expected_mask(tokenizer, template: str, text: str, messages: list[dict]) -> list[bool]:
    header = LLAMA_HEADER if template == "llama3.1" else CHATML_HEADER
    spans, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = text.index(header, pos) + len(header)
        generated = generated_text(template, messages, i)
        assert text.startswith(generated, start), (text[start:start + 200], generated)
        spans.append((start, start + len(generated)))
        pos = spans[-1][1]
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [any(a < e and b > s for s, e in spans) for a, b in offsets]


def render_args(templates_dir, template: str) -> dict:
    name = TEMPLATES[template]
    return {} if name is None else {"chat_template": str(templates_dir / name), "tools": TOOLS}


def reference(tokenizer, templates_dir, template: str, messages: list[dict]) -> tuple[str, list[int]]:
    """transformers' own render and ids (the code under test is not used)."""
    name = TEMPLATES[template]
    kw = {} if name is None else {"chat_template": (templates_dir / name).read_text(), "tools": TOOLS}
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
    return text, list(ids)


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_tool_conversation_masks_are_exact(tokenizer, templates_dir, template, conv):
    messages = CONVERSATIONS[conv]
    history = History.from_chats(messages)
    if template == "llama3.1" and conv == "parallel":  # the template itself refuses two calls in one turn
        with pytest.raises(ChatTemplateError, match="only supports single tool-calls at once"):
            history.apply_chat_template(tokenizer, add_generation_prompt=False, return_assistant_tokens_mask=True,
                                        **render_args(templates_dir, template))
        return
    text, ref_ids = reference(tokenizer, templates_dir, template, messages)
    out = history.apply_chat_template(tokenizer, add_generation_prompt=False, return_assistant_tokens_mask=True,
                                      **render_args(templates_dir, template))
    assert out["input_ids"].tolist() == ref_ids
    assert out["assistant_masks"].tolist() == expected_mask(tokenizer, template, text, messages)


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("template", ["smollm2", "qwen2.5", "qwen3"])
def test_each_turn_starts_where_its_prompt_ends(tokenizer, templates_dir, template, conv):
    """What an episode trains: the ids of the conversation up to assistant turn ``i`` rendered with the generation
    prompt are a prefix of the full ids, and turn ``i``'s masked run starts right there (none of these templates
    rewrites earlier turns of a tool conversation). Not Llama-3.1 here: with SmolLM2's tokenizer its header texts
    are not special tokens, and BPE merges the prompt's final "\n\n" with the turn's first character (property 2's
    error case, not a mask question)."""
    messages = CONVERSATIONS[conv]
    kw = render_args(templates_dir, template)
    out = History.from_chats(messages).apply_chat_template(tokenizer, add_generation_prompt=False,
                                                           return_assistant_tokens_mask=True, **kw)
    ids, mask = out["input_ids"].tolist(), out["assistant_masks"].tolist()
    starts = [t for t in range(len(mask)) if mask[t] and (t == 0 or not mask[t - 1])]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(turns)
    for i, start in zip(turns, starts):
        prompt = History.from_chats(messages[:i]).apply_chat_template(tokenizer, add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False,
                                                                      **kw).tolist()
        assert ids[:len(prompt)] == prompt and start == len(prompt)


def test_tool_messages_round_trip_and_reach_the_template(tokenizer):
    """``name`` / ``tool_call_id`` survive History (batched, padded) and reach the template as message fields."""
    batch = History.from_chats([STRUCTURED_CALLS, TEXT_CALLS[1:4]])
    assert batch.to_chats() == [STRUCTURED_CALLS, TEXT_CALLS[1:4]]
    assert batch[0, 2].name == "calculator" and batch[0, 2].tool_call_id == "call_0" and batch[0, 0].name is None
    template = ("{% for m in messages %}{{ m.role }}{% if m.name %}({{ m.name }}#{{ m.tool_call_id }}){% endif %}: "
                "{{ m.content }}\n{% endfor %}")
    text = History.from_chats(STRUCTURED_CALLS[:3]).apply_chat_template(tokenizer, chat_template=template,
                                                                        tokenize=False, add_generation_prompt=False)
    assert text == "user: What is 347 * 5812 + 1?\nassistant: \ntool(calculator#call_0): 2016764\n"


def test_tool_trace_trains_both_assistant_turns_with_the_rlhf_mask(tokenizer):
    """Through the SFT data path (one render of the chat example): the assistant mask holds the call turn and the
    answer turn and nothing else; the response mask (``sft`` head) only the final answer."""
    example = Example(TEXT_CALLS[:4] + [{"role": "assistant", "content": "2016764"}], 4, "trace:1")
    sample = tokenize_example(example, tokenizer)
    ids = sample.input_ids.tolist()

    def runs(mask):
        out, cur = [], []
        for t, m in zip(ids, mask.tolist()):
            if m:
                cur.append(t)
            elif cur:
                out, cur = out + [tokenizer.decode(cur)], []
        return out + ([tokenizer.decode(cur)] if cur else [])

    assert runs(sample.assistant_mask) == [call_text("347 * 5812") + "<|im_end|>", "2016764<|im_end|>"]
    assert runs(sample.response_mask) == ["2016764<|im_end|>"]


# ---------------------------------------------------------------- property test: random tool conversations
ALPHABET = "abcXYZ0123456789 +-*.,!?'é"
word = st.text(alphabet=ALPHABET, min_size=1, max_size=10).map(str.strip).filter(bool)


@st.composite
def tool_conversation(draw):
    """user, then 1-3 rounds of (assistant call turn, 1-2 tool results), then a final answer; calls as text or
    structured (structured: one call per turn for Llama-3.1's sake, empty or non-empty content)."""
    messages = [{"role": "user", "content": draw(word)}]
    for _ in range(draw(st.integers(1, 3))):
        expression = draw(word)
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": call_text(expression)})
        else:
            messages.append({"role": "assistant", "content": draw(st.sampled_from(["", "Calling."])),
                             "tool_calls": [structured(expression)]})
        for _ in range(draw(st.integers(1, 2))):
            messages.append({"role": "tool", "name": "calculator", "content": draw(word)})
    messages.append({"role": "assistant", "content": draw(word)})
    return messages


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=tool_conversation(), template=st.sampled_from(list(TEMPLATES)))
def test_property_tool_conversation_masks(tokenizer, templates_dir, messages, template):
    if template == "llama3.1":  # the template trims and drops the content of a structured-call turn
        messages = [dict(m, content=m["content"].strip()) for m in messages]
    text, ref_ids = reference(tokenizer, templates_dir, template, messages)
    out = History.from_chats(messages).apply_chat_template(tokenizer, add_generation_prompt=False,
                                                           return_assistant_tokens_mask=True,
                                                           **render_args(templates_dir, template))
    assert out["input_ids"].tolist() == ref_ids
    assert out["assistant_masks"].tolist() == expected_mask(tokenizer, template, text, messages)
