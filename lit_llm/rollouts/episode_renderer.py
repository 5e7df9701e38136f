"""The renders of an episode with one chat template (DESIGN.md property 9): the **first render** of the initial
messages with the generation prompt (``tools=`` passed to the template when it reads them, else the tools described
by a system message), and after each environment reply the **suffix render** of only the new messages plus the next
generation prompt (:func:`lit_llm.data.chat_template.render_continuation`), starting right after the sampled stop
token (ChatML's ``"\\n"`` after ``<|im_end|>`` belongs to the suffix). The history is never re-rendered, so templates
that rewrite earlier turns (Qwen3 drops old reasoning) cannot make the trained context differ from the sampled one.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lit_llm.data.assistant_spans import free_chars
from lit_llm.data.chat_template import Renderer, render_continuation, resolve_template, template_takes_tools
from lit_llm.data.history import History
from lit_llm.data.validation import find_special_tokens
from lit_llm.rollouts.envs.tools import prompt_with_tools, tool_schemas

__all__ = ["EpisodeRenderer"]

#: Where rendered ids live: on the host, as the trajectory keeps them (the generate version copies a batch's prompts
#: to the model's device in one transfer, ``rows_to_device``), whatever torch's default device is.
_HOST = torch.device("cpu")


class EpisodeRenderer:
    """Token ids of an episode's renders with one chat template: the first render and the suffixes.

    Args:
        tokenizer: the policy's (fast) Hugging Face tokenizer.
        chat_template: as :meth:`lit_llm.data.history.History.apply_chat_template` (``None``: the tokenizer's).
        chat_template_kwargs: template variables of every render (e.g. ``{"enable_thinking": False}``).
        tools_prompt: ``fn(tools) -> str``, the system-prompt text describing ``tools`` for templates that do not
            read ``tools``; default :func:`lit_llm.rollouts.envs.tools_system_prompt`.

    Raises:
        ChatTemplateError: an unusable template (a path that does not exist, invalid Jinja).
    """

    def __init__(self, tokenizer: Any, *, chat_template: Any = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 tools_prompt: Callable[[list], str] | None = None) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.template, self.name = resolve_template(tokenizer, chat_template, None)
        self.takes_tools = template_takes_tools(self.template)
        self.tools_prompt = tools_prompt
        self._renderers: dict[str, Renderer] = {}
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.RLock()  # fast tokenizers are not safe to call from concurrent threads

    # ---------------------------------------------------------------------------------------------------- tools
    def _template_kwargs(self, tools: Sequence[Any] | None) -> dict[str, Any]:
        schemas = tool_schemas(tools)
        return {**self.chat_template_kwargs, **({"tools": schemas} if schemas and self.takes_tools else {})}

    def _renderer(self, tools: Sequence[Any] | None) -> Renderer:
        kwargs = self._template_kwargs(tools)
        key = json.dumps(kwargs, sort_keys=True, default=repr)
        with self._lock:
            r = self._renderers.get(key)
            if r is None:
                r = self._renderers[key] = Renderer(self.tokenizer, self.template, self.name, kwargs)
            return r

    def prompt_messages(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
                        ) -> list[dict]:
        """The initial messages as the model sees them: unchanged when there is no tool or the template reads
        ``tools``; otherwise the tools' description (:attr:`tools_prompt`) ends the system message (one is added
        first when there is none): :func:`~lit_llm.rollouts.envs.prompt_with_tools`, as the SFT traces."""
        if not tools or self.takes_tools:
            return [dict(m) for m in messages]
        return prompt_with_tools(messages, list(tools), template_takes_tools=False, describe=self.tools_prompt)[0]

    # -------------------------------------------------------------------------------------------------- renders
    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> Tensor:
        """``[Lp]`` long: the first render of ``messages`` (already :meth:`prompt_messages`) with the generation
        prompt, ``tools=`` given to the template when it reads them.

        Raises:
            InvalidConversationError, SpecialTokenInContentError, ChatTemplateError: as
                :meth:`History.apply_chat_template` (bad messages, special-token text in content, template errors).
        """
        with self._tokenizer_lock:
            return History.from_chats([dict(m) for m in messages]).apply_chat_template(
                self.tokenizer, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True,
                return_dict=False, **self._template_kwargs(tools)).long().reshape(-1)

    def suffix_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
        """The text of :meth:`suffix_ids` (special-token strings in content left as text)."""
        return render_continuation(self._renderer(tools), [dict(m) for m in messages])

    def suffix_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> Tensor:
        """``[Ls]`` long: the ids of the render of only ``messages`` after an assistant turn, through the next
        generation prompt, starting right after the turn's stop token (:func:`~lit_llm.data.chat_template.
        render_continuation`), tokenised on its own.

        Special-token strings inside a message's content (e.g. a tool echoing ``"<|im_end|>"``) stay text: they are
        tokenised with ``split_special_tokens=True``, never as control tokens (DESIGN.md property 8).

        Raises:
            ChatTemplateError: the template cannot render ``messages`` after an assistant turn, or drops them (names
                the template, the roles and the fix).
        """
        renderer = self._renderer(tools)
        msgs = [dict(m) for m in messages]
        specials = sorted({t for m in msgs for t in find_special_tokens(self.tokenizer, m["content"])},
                          key=lambda t: (-len(t), t))
        if not specials:
            return self._encode(render_continuation(renderer, msgs))
        holders = free_chars(renderer, msgs, len(specials))
        for m in msgs:
            for s, h in zip(specials, holders):
                m["content"] = m["content"].replace(s, h)
        text = render_continuation(renderer, msgs)
        back = dict(zip(holders, specials))
        ids: list[int] = []
        with self._tokenizer_lock:
            for piece in re.split(f"([{''.join(holders)}])", text):
                if piece in back:
                    ids += self.tokenizer(back[piece], add_special_tokens=False,
                                          split_special_tokens=True)["input_ids"]
                elif piece:
                    ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long, device=_HOST)

    def _encode(self, text: str) -> Tensor:
        with self._tokenizer_lock:
            return torch.tensor(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long,
                                device=_HOST)

    def decode(self, ids: Sequence[int] | Tensor, *, skip_special_tokens: bool = True) -> str:
        """``tokenizer.decode`` (thread-safe): a sampled turn's text as the environment reads it."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        with self._tokenizer_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
