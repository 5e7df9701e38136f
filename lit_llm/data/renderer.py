"""Render a message list with one Jinja chat template exactly as transformers' ``apply_chat_template`` does
(:class:`Renderer`, through ``render_jinja_template``). Its own module so that ``lit_llm.data.assistant_spans`` (which
reads renders) and ``lit_llm.data.chat_template`` (which builds renderers and maps spans to tokens) both import it
without importing each other; ``lit_llm.data.chat_template`` re-exports it."""

from __future__ import annotations

from typing import Any

from lit_llm.data.errors import ChatTemplateError

__all__ = ["Renderer"]


class Renderer:
    """Renders message lists with one template exactly as transformers' ``apply_chat_template`` does."""

    def __init__(self, tokenizer: Any, template: str, name: str, template_kwargs: dict[str, Any]):
        import re

        self.name = name
        self.template = template
        kwargs = dict(template_kwargs)
        self.tools = kwargs.pop("tools", None)
        self.documents = kwargs.pop("documents", None)
        self.variables = {**tokenizer.special_tokens_map, **kwargs}
        self.eos = getattr(tokenizer, "eos_token", None)
        self.has_generation_markers = re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None

    def _call(self, messages: list[dict], add_generation_prompt: bool, with_indices: bool):
        from jinja2.exceptions import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, indices = render_jinja_template(
                conversations=[messages], tools=self.tools, documents=self.documents, chat_template=self.template,
                return_assistant_tokens_mask=with_indices, add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"Chat template {self.name!r} raised: {e}") from e
        return texts[0], (indices[0] if with_indices else None)

    def render(self, messages: list[dict], add_generation_prompt: bool, *, empty_ok: bool = False) -> str | None:
        """Render; with ``empty_ok``, a template failing on an (empty) prefix gives ``None``."""
        try:
            return self._call(messages, add_generation_prompt, False)[0]
        except (ChatTemplateError, TypeError, IndexError, KeyError):
            if empty_ok:
                return None
            raise

    def render_with_generation_indices(self, messages: list[dict], add_generation_prompt: bool):
        text, indices = self._call(messages, add_generation_prompt, True)
        return text, [tuple(ix) for ix in indices]
