"""Regression tests from a review of the data layer (issue 2): exact masked text, clear errors."""

from __future__ import annotations

import pytest

from lit_llm.data.errors import ChatTemplateError
from lit_llm.data.history import History


def _masked_runs(tokenizer, enc) -> list[str]:
    """Decode each maximal run of masked tokens separately."""
    runs, cur = [], []
    for i, m in zip(enc["input_ids"].tolist(), enc["assistant_masks"].tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def test_private_use_characters_in_content_are_masked_exactly(tokenizer):
    # The span finder marks content with private-use characters; content holding those very characters (icon
    # fonts, Apple's U+F8FF) used to make the mask computation fail with a misleading "not rendered verbatim" error.
    h = History.from_chats([{"role": "user", "content": "a\ue002"},
                            {"role": "assistant", "content": "x\ue000y\ue001\uf8ff"}])
    enc = h.apply_chat_template(tokenizer, return_assistant_tokens_mask=True, add_generation_prompt=False)
    assert _masked_runs(tokenizer, enc) == ["x\ue000y\ue001\uf8ff<|im_end|>"]


def test_unknown_template_name_raises_instead_of_rendering_it_literally(tokenizer):
    # An unknown name is not one of the SmolLM2 tokenizer's named templates, not a known template name and not
    # Jinja: it used to be rendered as the constant text (token ids of that word, silently).
    h = History.from_chats([{"role": "user", "content": "Hi"}])
    msg = (r"chat_template='chatml-nope' is not a Jinja template \(it has no '\{'\), not an existing file and not one "
           r"of the tokenizer's named templates")
    with pytest.raises(ChatTemplateError, match=msg):
        h.apply_chat_template(tokenizer, chat_template="chatml-nope", tokenize=False, add_generation_prompt=False)


def test_template_path_without_jinja_suffix_is_read(tokenizer, tmp_path):
    path = tmp_path / "chatml.j2"
    path.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    h = History.from_chats([{"role": "user", "content": "Hi"}])
    text = h.apply_chat_template(tokenizer, chat_template=str(path), tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n"


def test_qwen3_conversation_opening_with_an_assistant_message(tokenizer, templates_dir):
    # Qwen3's template cannot render an empty message list; the generation prompt of message 0 used to be unknown.
    h = History.from_chats([{"role": "assistant", "content": "Hello, how can I help?"},
                            {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}])
    enc = h.apply_chat_template(tokenizer, chat_template=templates_dir / "stock-qwen3.jinja",
                                return_assistant_tokens_mask=True, add_generation_prompt=False)
    assert _masked_runs(tokenizer, enc) == ["Hello, how can I help?<|im_end|>", "<think>\n\n</think>\n\nc<|im_end|>"]
