"""Issue 29: the named templates shipped in the package, TorchRL's template arguments and detection, and the
ChatML fallback.

Byte identity: each shipped template, ``{% generation %}`` markers removed, renders exactly as its model's template
(``tests/fixtures/chat_templates`` for the real-model files, ``tests/fixtures/reference_templates`` for the formats
whose model template is short enough to write down: ChatML's transformers default, GPT-2 / DialoGPT's default,
DeepSeek LLM chat; the Qwen2.5 base template is the Instruct one with its default system prompt; Falcon and Llama 4
are checked against hand-written renders of their formats). Masks: the marker path equals the prefix-derived path
(DESIGN.md property 3) on every shipped template.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data import History, UnknownChatTemplateError, add_chat_template
from lit_llm.data.chat_template import resolve_template
from lit_llm.data.errors import ChatTemplateError, TokenizerRequiredError
from lit_llm.data.template_registry import (
    CHAT_TEMPLATE_FILES,
    chat_template_names,
    chat_templates_dir,
    detect_template_name,
    get_chat_template,
    remove_chat_template,
)

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "chat_templates"
REF = ROOT / "tests" / "fixtures" / "reference_templates"
QWEN_INSTRUCT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def strip_markers(template: str) -> str:
    return re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)


def reference(name: str) -> str | None:
    files = {"chatml": REF / "chatml-transformers-default.jinja", "dialogpt": REF / "gpt2-dialogpt-default.jinja",
             "deepseek": REF / "deepseek-llm-chat.jinja", "qwen2.5-instruct": FIX / "stock-qwen2_5.jinja",
             "qwen3": FIX / "stock-qwen3.jinja", "llama3": FIX / "llama-3-instruct.jinja",
             "llama2": FIX / "llama-2-chat.jinja", "mistral": FIX / "mistral-instruct.jinja",
             "gemma": FIX / "gemma-it.jinja", "phi3": FIX / "phi-3.jinja", "zephyr": FIX / "zephyr.jinja"}
    if name == "qwen":  # Qwen2.5 base models: the Instruct template with "You are a helpful assistant."
        return (FIX / "stock-qwen2_5.jinja").read_text().replace(QWEN_INSTRUCT_SYSTEM, "You are a helpful assistant.")
    return files[name].read_text() if name in files else None


def no_template(tokenizer, name_or_path: str | None = None):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    if name_or_path is not None:
        tok.name_or_path = name_or_path
    return tok


# Templates that check user/assistant alternation or fold the system prompt take alternating chats.
ALTERNATING = {"llama3", "llama2", "mistral", "gemma", "phi3", "zephyr", "dialogpt"}
CHATS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3"},
     {"role": "assistant", "content": "6, I think"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "say it\ntwice"}, {"role": "assistant", "content": "it\nit"},
     {"role": "user", "content": "thanks"}],
]


def test_every_shipped_template_is_a_package_file_with_its_licences():
    folder = chat_templates_dir()
    assert folder.parent == ROOT / "lit_llm" / "data" or "site-packages" in str(folder)
    for name, file in CHAT_TEMPLATE_FILES.items():
        assert (folder / file).is_file(), name
        assert "{% generation %}" in get_chat_template(name) or "{%- generation %}" in get_chat_template(name), name
    assert {"LICENSE-chujiezheng-chat-templates", "LICENSE-trl-templates", "README.md"} <= {
        p.name for p in folder.iterdir()}
    assert {"chatml", "chatml_format", "qwen", "llama", "dialogpt", "falcon", "deepseek"} <= set(chat_template_names())


@pytest.mark.slow  # ~10 s: a wheel build and a pip install
@pytest.mark.timeout(300)
def test_a_built_wheel_ships_the_templates(tmp_path):
    """Build the wheel from a copy of the sources (setuptools, no isolation: offline; the checkout is left alone),
    find every template and licence in it, install it (not editable) into a folder and load a named template there
    from a process that imports lit_llm from that folder only."""
    import shutil

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lit_llm", src / "lit_llm", ignore=shutil.ignore_patterns("__pycache__"))
    code = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=src, check=True, capture_output=True,
                   timeout=280)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for file in [*CHAT_TEMPLATE_FILES.values(), "LICENSE-chujiezheng-chat-templates", "LICENSE-trl-templates"]:
        assert f"lit_llm/data/templates/{file}" in names, file
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=120)
    probe = ("import lit_llm, sys; from lit_llm.data.template_registry import CHAT_TEMPLATE_FILES, "
             "get_chat_template; print(lit_llm.__file__); "
             "print(sum(bool(get_chat_template(n)) for n in CHAT_TEMPLATE_FILES), len(CHAT_TEMPLATE_FILES))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**env, "PYTHONPATH": str(site)},
                         check=True, capture_output=True, text=True, timeout=120).stdout.split("\n")
    assert out[0] == str(site / "lit_llm" / "__init__.py")  # the installed copy, not the checkout
    assert out[1] == f"{len(CHAT_TEMPLATE_FILES)} {len(CHAT_TEMPLATE_FILES)}"


@pytest.mark.parametrize("name", sorted(set(CHAT_TEMPLATE_FILES) - {"falcon", "llama"}))  # those two: below
def test_renders_byte_identically_to_its_model_template(tokenizer, name):
    ref = reference(name)
    shipped = get_chat_template(name)
    for chat in CHATS:
        h = History.from_chats(chat)
        for gp in (False, True):
            kw = dict(tokenize=False, add_generation_prompt=gp)
            assert h.apply_chat_template(tokenizer, chat_template=shipped, **kw) == h.apply_chat_template(
                tokenizer, chat_template=ref, **kw), (name, chat, gp)
            assert h.apply_chat_template(tokenizer, chat_template=strip_markers(shipped), **kw) == \
                h.apply_chat_template(tokenizer, chat_template=ref, **kw)


def test_falcon_and_llama4_formats(tokenizer):
    chat = History.from_chats(CHATS[1])
    falcon = chat.apply_chat_template(tokenizer, chat_template_name="falcon", tokenize=False,
                                      add_generation_prompt=False)
    assert falcon == ("Be brief.\n\nUser: 2+2?\n\nAssistant: 4\n\nUser: and 3+3\n\nAssistant: 6, I think\n\n")
    llama = chat.apply_chat_template(tokenizer, chat_template_name="llama", tokenize=False, add_generation_prompt=False)
    bos = tokenizer.bos_token
    assert llama == (f"{bos}<|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
                     "<|header_start|>user<|header_end|>\n\n2+2?<|eot|><|header_start|>assistant<|header_end|>\n\n4<|eot|>"
                     "<|header_start|>user<|header_end|>\n\nand 3+3<|eot|>"
                     "<|header_start|>assistant<|header_end|>\n\n6, I think<|eot|>")
    prompt = History.from_chats(CHATS[1][:2]).apply_chat_template(tokenizer, chat_template_name="llama",
                                                                  tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("2+2?<|eot|><|header_start|>assistant<|header_end|>\n\n")
    assert History.from_chats(CHATS[0]).apply_chat_template(
        tokenizer, chat_template_name="falcon", tokenize=False, add_generation_prompt=True).endswith("Assistant:")


# ------------------------------------------------------------------------------------------ exact masks, both paths
def _masked_text(tokenizer, out) -> str:
    return tokenizer.decode(out["input_ids"][out["assistant_masks"]])


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATE_FILES))
def test_marker_masks_equal_derived_masks(tokenizer, name):
    """The markers mark exactly what DESIGN.md property 3 derives from the prefixes (content + end of turn)."""
    shipped = get_chat_template(name)
    for chat in CHATS:
        if chat[-1]["role"] != "assistant":
            continue
        h = History.from_chats(chat)
        a = h.apply_chat_template(tokenizer, chat_template=shipped, add_generation_prompt=False, tokenize=True,
                                  return_assistant_tokens_mask=True)
        b = h.apply_chat_template(tokenizer, chat_template=strip_markers(shipped), add_generation_prompt=False,
                                  tokenize=True, return_assistant_tokens_mask=True)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["assistant_masks"], b["assistant_masks"])


@pytest.mark.parametrize(("name", "expected"), [
    ("chatml", "Hello!<|im_end|>"), ("qwen", "Hello!<|im_end|>"), ("qwen3", "<think>\n\n</think>\n\nHello!<|im_end|>"),
    ("llama", "Hello!<|eot|>"), ("llama3", "Hello!<|eot_id|>"), ("llama2", " Hello! <|im_end|>"),
    ("mistral", " Hello!<|im_end|>"), ("gemma", "Hello!<end_of_turn>"), ("phi3", "Hello!<|end|>"),
    ("zephyr", "Hello!<|im_end|>"), ("dialogpt", "Hello!<|im_end|>"), ("falcon", " Hello!"),
    ("deepseek", " Hello!<|im_end|>"),
])
def test_mask_is_the_reply_and_its_stop_token(tokenizer, name, expected):
    out = History.from_chats(CHATS[0]).apply_chat_template(
        tokenizer, chat_template_name=name, add_generation_prompt=False, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)
    assert _masked_text(tokenizer, out) == expected


def test_qwen3_enable_thinking_false_masks_agree(tokenizer):
    shipped = get_chat_template("qwen3")
    h = History.from_chats(CHATS[1])
    kw = dict(add_generation_prompt=False, tokenize=True, return_assistant_tokens_mask=True, enable_thinking=False)
    a = h.apply_chat_template(tokenizer, chat_template=shipped, **kw)
    b = h.apply_chat_template(tokenizer, chat_template=strip_markers(shipped), **kw)
    assert torch.equal(a["assistant_masks"], b["assistant_masks"])
    assert _masked_text(tokenizer, a) == "4<|im_end|>6, I think<|im_end|>"


_TEXT = st.text(alphabet="abcXYZ 019,.?!\n", min_size=1, max_size=12).map(lambda s: s.strip() or "z")


@st.composite
def chats(draw):
    n_turns = draw(st.integers(1, 3))
    chat = [{"role": "system", "content": draw(_TEXT)}] if draw(st.booleans()) else []
    for _ in range(n_turns):
        chat += [{"role": "user", "content": draw(_TEXT)}, {"role": "assistant", "content": draw(_TEXT)}]
    return chat


@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATE_FILES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=chats())
def test_property_marker_masks_equal_derived_masks(tokenizer, name, chat):
    if name in ("dialogpt",):
        chat = [m for m in chat if m["role"] != "system"]
    shipped = get_chat_template(name)
    h = History.from_chats(chat)
    kw = dict(add_generation_prompt=False, tokenize=True, return_assistant_tokens_mask=True)
    a = h.apply_chat_template(tokenizer, chat_template=shipped, **kw)
    b = h.apply_chat_template(tokenizer, chat_template=strip_markers(shipped), **kw)
    assert torch.equal(a["assistant_masks"], b["assistant_masks"]), _masked_text(tokenizer, a)


# ----------------------------------------------------------------------------------------- names, detection, fallback
def test_chatml_format_writes_no_bos(tokenizer):
    """SmolLM2's BOS is <|im_start|>: a template opening with bos_token would render <|im_start|><|im_start|>."""
    text = History.from_chats(CHATS[0]).apply_chat_template(tokenizer, chat_template_name="chatml_format",
                                                             tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"


def test_chat_template_name_selects_the_template_not_a_variable(tokenizer):
    h = History.from_chats(CHATS[0])
    own = h.apply_chat_template(tokenizer, tokenize=False, add_generation_prompt=False)
    qwen = h.apply_chat_template(tokenizer, chat_template_name="qwen", tokenize=False, add_generation_prompt=False)
    assert qwen != own and qwen.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert qwen == h.apply_chat_template(tokenizer, chat_template="qwen", tokenize=False, add_generation_prompt=False)


def test_unknown_name_is_an_error_naming_the_known_ones(tokenizer):
    h = History.from_chats(CHATS[0])
    with pytest.raises(UnknownChatTemplateError, match="known names: .*chatml_format.*qwen") as e:
        h.apply_chat_template(tokenizer, chat_template_name="no-such-template", add_generation_prompt=False,
                              tokenize=True, return_dict=True)
    assert isinstance(e.value, KeyError) and isinstance(e.value, ChatTemplateError)
    with pytest.raises(NotImplementedError, match="unknown chat_template_name 'nope'"):
        History.from_text("<|im_start|>user\nhi<|im_end|>\n", chat_template_name="nope")
    with pytest.raises(ChatTemplateError, match="not both"):
        h.apply_chat_template(tokenizer, chat_template="chatml", chat_template_name="qwen",
                              add_generation_prompt=False, tokenize=True, return_dict=True)
    with pytest.raises(RuntimeError, match="tokenizer"):
        h.apply_chat_template(chat_template_name="chatml", add_generation_prompt=False, tokenize=True, return_dict=True)
    assert issubclass(TokenizerRequiredError, RuntimeError)


def test_tokenizer_without_template_falls_back_to_chatml(tokenizer):
    bare = no_template(tokenizer)
    h = History.from_chats(CHATS[0])
    text = h.apply_chat_template(bare, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    out = h.apply_chat_template(bare, tokenize=True, add_generation_prompt=False, return_assistant_tokens_mask=True)
    assert _masked_text(bare, out) == "Hello!<|im_end|>"


@pytest.mark.parametrize(("name_or_path", "expected"), [
    ("Qwen/Qwen2.5-0.5B", "qwen"), ("microsoft/DialoGPT-medium", "dialogpt"), ("tiiuae/falcon-7b-instruct", "falcon"),
    ("deepseek-ai/deepseek-llm-7b-chat", "deepseek"), ("meta-llama/Llama-4-Scout-17B-16E", "llama"),
    ("gpt2", None),
])
def test_detection_by_name_applies_only_without_an_own_template(tokenizer, name_or_path, expected):
    assert detect_template_name(no_template(tokenizer, name_or_path)) == expected
    bare = no_template(tokenizer, name_or_path)
    _, used = resolve_template(bare, None)
    assert used == f"{expected or 'chatml'} (the tokenizer has no chat template)"
    own = copy.deepcopy(tokenizer)
    own.name_or_path = name_or_path
    text, used = resolve_template(own, None)
    assert used == "tokenizer default" and text == tokenizer.chat_template  # never replaced


def test_add_chat_template_name_keywords_and_inverse_parser(tokenizer):
    template = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
                "{{ '>> ' + message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
                "{{ '<< ' + message['content'] + '\n' }}{% endif %}{% endfor %}")

    def parse(text: str) -> list[dict]:
        out = []
        for line in re.findall(r"<< (.*?)\n|>> (.*?)<\|im_end\|>", text):
            out.append({"role": "user", "content": line[0]} if line[0] else {"role": "assistant", "content": line[1]})
        return out

    add_chat_template("arrows", template, inverse_parser=parse, model_family_keywords=["arrow-lm"])
    try:
        h = History.from_chats(CHATS[0])
        text = h.apply_chat_template(tokenizer, chat_template_name="arrows", tokenize=False,
                                     add_generation_prompt=False)
        assert text == "<< Hi there\n>> Hello!<|im_end|>"
        bare = no_template(tokenizer, "org/Arrow-LM-1B")
        assert h.apply_chat_template(bare, tokenize=False, add_generation_prompt=False) == text
        out = h.apply_chat_template(bare, tokenize=True, return_assistant_tokens_mask=True, add_generation_prompt=False)
        assert _masked_text(tokenizer, out) == ">> Hello!<|im_end|>"
        assert History.from_text(text, chat_template_name="arrows").to_chats() == CHATS[0]
        assert History.from_text(text, tokenizer=bare).to_chats() == CHATS[0]
        assert "arrows" in chat_template_names()
    finally:
        remove_chat_template("arrows")
    assert "arrows" not in chat_template_names()


# ------------------------------------------------------------------------------------------ TorchRL's History surface
def test_batched_masks_are_a_lazy_stack_of_rows(tokenizer):
    h = History.from_chats([CHATS[0], CHATS[1]])
    out = h.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=False, return_dict=True,
                                return_assistant_tokens_mask=True)
    rows = out.unbind(0)
    for row, chat in zip(rows, (CHATS[0], CHATS[1])):
        single = History.from_chats(chat).apply_chat_template(tokenizer, add_generation_prompt=False,
                                                              return_assistant_tokens_mask=True)
        assert torch.equal(row["input_ids"], single["input_ids"])
        assert torch.equal(row["assistant_masks"], single["assistant_masks"])


def test_endoftext_ends_a_chatml_turn():
    h = History.from_text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|endoftext|>",
                          chat_template_name="chatml_format")
    assert h.to_chats() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert list(h.is_complete) == [True, True]


def test_append_extend_wrong_dims_raise_runtime_error():
    h = History.from_chats(CHATS[0])
    with pytest.raises(RuntimeError, match="one dimension less"):
        h.append(h)
    with pytest.raises(RuntimeError, match="as many dimensions"):
        h.extend(h[0])
    with pytest.raises(ValueError):
        h.extend(h[0])


def test_default_spec():
    spec = History.default_spec()
    assert tuple(spec.shape) == (-1,)
    zero = spec.zero()
    assert isinstance(zero, History) and zero.shape == (1,) and zero.role == ["foo"]
    assert spec.is_in(History.from_chats(CHATS[1]))
