"""Issue 29: round trips on every registered template, TorchRL's History examples, and the pinned ids of the shipped
configs.

Round trips: history -> text -> history and history -> tokens -> history give back the messages, complete and
truncated (a cut last reply comes back with ``is_complete=False``). Exempt where the template changes the chat on
purpose, and only there:

* ``qwen`` / ``qwen2.5-instruct`` inject a default system prompt when there is none: it comes back as a message;
* ``qwen3`` writes an empty think block into the final reply: it comes back inside that reply's content;
* ``gemma`` folds the system prompt into the first user turn: chats with a system prompt are not compared;
* ``dialogpt`` writes no roles: roles are read as alternating user / assistant, so chats have no system prompt;
* the chujiezheng templates (``llama3``, ``llama2``, ``mistral``, ``gemma``, ``phi3``, ``zephyr``) and ``llama``'s
  system prompt trim content: the random contents have no surrounding whitespace;
* ``falcon`` / ``deepseek`` end a turn with a blank line: the random contents hold no ``"\\n\\n"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data import History, add_chat_template
from lit_llm.data.template_registry import CHAT_TEMPLATE_FILES, get_chat_template, remove_chat_template

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(CHAT_TEMPLATE_FILES)
_TEXT = st.text(alphabet="abcXYZ 019,.?!\n", min_size=1, max_size=14).map(
    lambda s: " ".join(s.replace("\n\n", "\n").split(" ")).strip() or "z")


@st.composite
def chats(draw):
    chat = [{"role": "system", "content": draw(_TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        chat += [{"role": "user", "content": draw(_TEXT)}, {"role": "assistant", "content": draw(_TEXT)}]
    return chat


def expected_messages(name: str, chat: list[dict]) -> list[dict]:
    """What the template lets come back (see the module docstring)."""
    out = [dict(m) for m in chat]
    if name in ("qwen", "qwen2.5-instruct") and out[0]["role"] != "system":
        default = ("You are a helpful assistant." if name == "qwen"
                   else "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
        out.insert(0, {"role": "system", "content": default})
    if name == "qwen3" and out[-1]["role"] == "assistant":
        out[-1]["content"] = "<think>\n\n</think>\n\n" + out[-1]["content"]
    return out


def usable(name: str, chat: list[dict]) -> list[dict] | None:
    if name == "dialogpt":
        return [m for m in chat if m["role"] != "system"]
    if name == "gemma" and chat[0]["role"] == "system":
        return None
    return chat


def render(tokenizer, name: str, chat: list[dict], gp: bool) -> str:
    return History.from_chats(chat).apply_chat_template(tokenizer, chat_template_name=name, tokenize=False,
                                                         add_generation_prompt=gp)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=chats(), cut=st.floats(0.2, 0.8))
def test_round_trips(tokenizer, name, chat, cut):
    chat = usable(name, chat)
    if chat is None:
        return
    want = expected_messages(name, chat)
    text = render(tokenizer, name, chat, False)
    assert History.from_text(text, chat_template_name=name).to_chats() == want
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    assert History.from_text(decoded, chat_template_name=name).to_chats() == want
    # Truncated: the prompt with its generation prompt, then part of the last reply.
    prompt = render(tokenizer, name, chat[:-1], True)
    reply = chat[-1]["content"]
    part = reply[: max(1, int(len(reply) * cut))]
    lead = " " if name in ("falcon", "deepseek", "llama2", "mistral") else ""  # what the reply's render starts with
    if name == "qwen3":
        part = "<think>\n\n</think>\n\n" + part
    truncated = prompt + lead + part
    if part.endswith((" ", "\n")) and name not in ("chatml", "qwen", "qwen2.5-instruct", "qwen3", "dialogpt"):
        return  # trimming templates never end a reply with whitespace
    for txt in (truncated, tokenizer.decode(tokenizer(truncated, add_special_tokens=False)["input_ids"])):
        got = History.from_text(txt, chat_template_name=name)
        back = got.to_chats()
        assert back[:-1] == want[:-1]
        assert back[-1]["role"] == "assistant" and back[-1]["content"] == part
        assert back[-1].get("is_complete") is False and list(got.is_complete)[-1] is False


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_through_ids(tokenizer, name):
    chat = usable(name, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                         {"role": "assistant", "content": "6"}]) or [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids = History.from_chats(chat).apply_chat_template(tokenizer, chat_template_name=name, tokenize=True,
                                                       add_generation_prompt=False, return_dict=False)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert History.from_text(text, chat_template_name=name).to_chats() == expected_messages(name, chat)


# ----------------------------------------------------------------------------- TorchRL's History examples, as tests
def test_torchrl_example_history_class_docstring(tokenizer):
    """``History``'s class docstring (Qwen2.5-0.5B's tokenizer there, SmolLM2's here)."""
    history = History.from_chats([[
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "I'm doing well, thanks!"},
    ]])
    result = history.apply_chat_template(
        tokenizer=tokenizer,
        add_generation_prompt=False,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assistant_masks = result["assistant_masks"]
    assert assistant_masks.sum().item() == len(tokenizer("Hi there!<|im_end|>I'm doing well, thanks!<|im_end|>",
                                                         add_special_tokens=False)["input_ids"])


def test_torchrl_example_stack_and_generation_prompt(tokenizer):
    """The stacked-History example (GPT-2's tokenizer there: no template, so ChatML), unchanged: TorchRL's defaults
    (``tokenize=None`` -> text) give the prompt's text."""
    import copy

    gpt2_like = copy.deepcopy(tokenizer)
    gpt2_like.chat_template = None
    history0 = History(role="system", content="""CONTENT
This is the setup""")
    history1 = History(role="user", content="""CONTENT
This is the first user prompt""")
    history2 = History(role="assistant", content="""CONTENT
This is the second prompt, the first for the assistant.""")
    history = torch.stack([history0, history1, history2])
    assert history.role == ["system", "user", "assistant"]
    parsed_string = history.apply_chat_template(tokenizer=gpt2_like, add_generation_prompt=True)
    assert parsed_string == (
        "<|im_start|>system\nCONTENT\nThis is the setup<|im_end|>\n"
        "<|im_start|>user\nCONTENT\nThis is the first user prompt<|im_end|>\n"
        "<|im_start|>assistant\nCONTENT\nThis is the second prompt, the first for the assistant.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_torchrl_example_add_chat_template(tokenizer):
    """``add_chat_template``'s docstring, under its own name ``"llama"`` (Llama-2's tokenizer there; here SmolLM2's,
    renamed and without its own template, since lit_llm's detection never replaces a tokenizer's own template). An
    added template shadows the shipped one of that name until ``remove_chat_template``, which brings it back."""
    import copy
    import re

    from tensordict import lazy_stack

    llama_template = '''
{% for message in messages %}
{%- if message['role'] == 'user' %}
{{ '<s>[INST] ' + message['content'] + ' [/INST]' }}
{%- elif message['role'] == 'assistant' %}
{% generation %}{{ message['content'] + '</s>' }}{% endgeneration %}
{%- endif %}
{% endfor %}
{%- if add_generation_prompt %}
{% generation %}{{ ' ' }}{% endgeneration %}
{%- endif %}
'''

    def parse_llama_text(text: str) -> History:
        pattern = r'<s>\[INST\]\s*(.*?)\s*\[/INST\]\s*(.*?)</s>'
        matches = re.findall(pattern, text, re.DOTALL)
        messages = []
        for user_content, assistant_content in matches:
            messages.append(History(role="user", content=user_content.strip()))
            messages.append(History(role="assistant", content=assistant_content.strip()))
        return lazy_stack(messages)

    shipped_llama = get_chat_template("llama")
    add_chat_template(
        template_name="llama",
        template=llama_template,
        inverse_parser=parse_llama_text,
        model_family_keywords=["llama", "meta-llama"],
    )
    try:
        tok = copy.deepcopy(tokenizer)
        tok.chat_template = None
        tok.name_or_path = "meta-llama/Llama-2-7b-chat-hf"
        history = History.from_chats([[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there!"}
        ]])
        result = history.apply_chat_template(
            tokenizer=tok,
            add_generation_prompt=False,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        explicit = history.apply_chat_template(
            tokenizer=tok,
            chat_template_name="llama",
            add_generation_prompt=False,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert torch.equal(result["input_ids"], explicit["input_ids"])
        masked = tok.decode(result["input_ids"][0][result["assistant_masks"][0].bool()])
        assert masked == "Hi there!</s>"
        text = history.apply_chat_template(tokenizer=tok, add_generation_prompt=False, tokenize=False)[0]
        assert History.from_text(text, chat_template_name="llama").to_chats() == [
            {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there!"}]
    finally:
        remove_chat_template("llama")
    assert get_chat_template("llama") == shipped_llama


def test_torchrl_example_from_text(tokenizer):
    """``History.from_text``'s docstring (Qwen2.5-7B-Instruct's tokenizer there). TorchRL strips contents; lit_llm
    keeps them exactly (the system content keeps its newline)."""
    text = "<|im_start|>system\nYou are a helpful assistant.\n<|im_end|>\n<|im_start|>user\nWrite a python script that gives the capital of France or Germany.\n<|im_end|>\n<|im_start|>assistant\n<think>The capital of France is Paris, the capital of Germany is Berlin.</think>\n<answer><python>\n"  # noqa: E501
    history = History.from_text(text, tokenizer=tokenizer)
    assert history.shape == (3,)
    assert list(history.role) == ["system", "user", "assistant"]
    assert list(history.is_complete) == [True, True, False]
    assert [c.strip() for c in history.content][0] == "You are a helpful assistant."


def test_torchrl_example_default_spec():
    history = History(role=["system", "user"], content=["a message", "another message"], batch_size=(2,))
    spec = history.default_spec()
    zero = spec.zero()
    assert tuple(spec.shape) == (-1,) and zero.shape == (1,) and zero.content == ["foo"]


# --------------------------------------------------------------- ids of the shipped configs (recorded before issue 29)
def test_shipped_config_ids_are_unchanged(tokenizer):
    """SFT rows and rollout prompts of configs/sft_tiny.yaml and configs/grpo_tiny.yaml (and a system-prompt row as
    in the GSM8K configs), through the functions the SFT data module and the prompt tokenizer call, equal the ids
    recorded before issue 29 changed the data layer."""
    from lit_llm.data.arithmetic import arithmetic_split
    from lit_llm.data.datasets import Example, arithmetic_examples, tokenize_example
    from lit_llm.data.prompts import tokenize_prompts

    pinned = json.loads((ROOT / "tests" / "fixtures" / "pinned_ids" / "shipped_configs_smollm2.json").read_text())

    def row(s):
        return {"sample_id": s.sample_id, "input_ids": s.input_ids.tolist(),
                "assistant_mask": [int(x) for x in s.assistant_mask],
                "response_mask": [int(x) for x in s.response_mask], "prompt_ids": s.prompt_ids.tolist()}

    train, val = arithmetic_examples(32, 8, seed=0)
    assert [row(tokenize_example(ex, tokenizer, chat_template=None, max_length=64))
            for ex in train[:3] + val[:1]] == pinned["sft_tiny"]
    sys_row = pinned["sft_system_prompt"][0]
    system = pinned["grpo_system_prompt"][0]["prompt"]
    ex = Example([*system, {"role": "assistant", "content": "3 + 4 = 7\n#### 7"}], 2, sys_row["sample_id"], "#### 7")
    assert row(tokenize_example(ex, tokenizer, chat_template=None)) == sys_row
    tr, held = arithmetic_split(64, 8, seed=0, low=10, high=99)
    for r, want in zip(tr[:3] + held[:1], pinned["grpo_tiny_prompts"]):
        assert r["prompt"] == want["prompt"]
        assert tokenize_prompts([r["prompt"]], tokenizer, chat_template=None)[0].tolist() == want["ids"]
    want = pinned["grpo_system_prompt"][0]["ids"]
    assert tokenize_prompts([system], tokenizer, chat_template=None)[0].tolist() == want


def _tool_and_episode_ids(tokenizer) -> dict:
    """The ids of configs/sft_calculator_tools.yaml's first traces (SFTDataModule's tokenisation: ``tools=`` when the
    template renders them, else a system message) and of configs/grpo_tools_tiny.yaml's episodes (the first render of
    a calculator prompt and the suffix render of a tool reply, :class:`~lit_llm.rollouts.episode_renderer.
    EpisodeRenderer`), with SmolLM2's own template."""
    from lit_llm.data.datasets import tokenize_example
    from lit_llm.lightning.datamodules import calculator_examples
    from lit_llm.rollouts.envs import CalculatorEnv, prompt_with_tools, template_supports_tools
    from lit_llm.rollouts.episode_renderer import EpisodeRenderer

    takes_tools = template_supports_tools(tokenizer, None)
    _, tools = prompt_with_tools([], CalculatorEnv.tools, template_takes_tools=takes_tools)
    train, _ = calculator_examples(2, 0, seed=0, tools_in_system=not takes_tools)
    sft = []
    for ex in train:
        s = tokenize_example(ex, tokenizer, chat_template=None, max_length=1024,
                             chat_template_kwargs={"tools": tools} if tools is not None else None)
        sft.append({"sample_id": s.sample_id, "input_ids": s.input_ids.tolist(),
                    "assistant_mask": [int(x) for x in s.assistant_mask], "prompt_ids": s.prompt_ids.tolist()})
    renderer = EpisodeRenderer(tokenizer)
    episodes = []
    for row in CalculatorEnv.make_rows(2, 0, split="train"):
        msgs = renderer.prompt_messages(CalculatorEnv().reset(row), CalculatorEnv.tools)
        episodes.append({"sample_id": row["sample_id"],
                         "prompt_ids": renderer.prompt_ids(msgs, CalculatorEnv.tools).tolist(),
                         "tool_suffix_ids": renderer.suffix_ids([{"role": "tool", "content": "42"}],
                                                                CalculatorEnv.tools).tolist()})
    return {"sft_calculator_tools": sft, "grpo_tools_episodes": episodes}


def test_shipped_tool_config_ids_are_unchanged(tokenizer):
    """The tool-using configs' ids (SFT traces, episode renders) equal those recorded before
    ``History.apply_chat_template`` took TorchRL's defaults (every internal call passes them explicitly)."""
    pinned = json.loads((ROOT / "tests" / "fixtures" / "pinned_ids" / "shipped_configs_smollm2.json").read_text())
    got = _tool_and_episode_ids(tokenizer)
    assert got["sft_calculator_tools"] == pinned["sft_calculator_tools"]
    assert got["grpo_tools_episodes"] == pinned["grpo_tools_episodes"]
