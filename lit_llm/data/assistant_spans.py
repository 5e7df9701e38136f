"""Exact assistant masks from any Jinja chat template (DESIGN.md property 3): the character span of each assistant turn.

Two sources of spans:

* templates with ``{% generation %}`` markers: transformers' own tracker (``render_jinja_template``);
* any other Jinja template: spans derived from renders of the conversation's prefixes (:func:`_assistant_spans`).

A span runs from the end of the turn's generation prompt through its end-of-turn text (the stop token), never a
separator rendered after it. :func:`render_continuation` derives the text appended after a sampled turn (property 9)
from the same spans. ``lit_llm.data.chat_template`` maps the spans to tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lit_llm.data.errors import ChatTemplateError

if TYPE_CHECKING:
    from lit_llm.data.renderer import Renderer

__all__ = ["CONTINUATION_ANCHOR", "STOP_STRINGS", "assistant_spans", "free_chars", "render_continuation"]

STOP_STRINGS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>",
    "<｜end▁of▁sentence｜>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|return|>", "<|call|>", "<|eot|>",
)
"""End-of-turn texts of common template families (the tokenizer's ``eos_token`` is added at run time)."""


# ---------------------------------------------------------------------- assistant spans
def _assistant_spans(
    renderer: Renderer, messages: list[dict], *, add_generation_prompt: bool = False, where: str = "the conversation"
) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the character span ``[start, end)`` of each assistant turn in that render.

    With ``{% generation %}`` markers in the template the spans are transformers' (the marked blocks). Otherwise,
    with ``F`` the full render and ``T(msgs, gp)`` a render of a message list (``gp`` = add_generation_prompt),
    for assistant message ``i``:

    * start: ``len(T(messages[:i], gp=True))`` when that render is a prefix of ``F``. When it is not (templates
      that render a turn differently once it is followed by a reply, e.g. DeepSeek-V3 drops the ``<think>\\n``
      opened by its generation prompt), the span starts after the longest prefix of the generation prompt
      (``T(messages[:i], gp=True)`` minus ``T(messages[:i], gp=False)``) found in ``F`` between the previous
      span's end and the start of message ``i``'s content: the part of the generation prompt the full render
      agrees with is prompt, the rest of the turn is generated -- unless the rest of the generation prompt shows up
      later in the turn with text inserted before it (Qwen3 with ``enable_thinking=False`` and reasoning in a final
      turn: ``<think>\nreasoning\n</think>`` where the prompt has an empty think block): no mask of that turn is
      exact, and it is refused. When the template cannot render ``messages[:i]``
      at all (Qwen3 on an empty list, for a conversation opening with an assistant message), the generation prompt
      is taken from a one-user-message probe conversation instead.
    * content end: message ``i`` is rendered with a private-use marker (one absent from the conversation, the
      template and its variables) appended to its content; the text after the marker is the template's text after
      the content, so the content ends ``len(that text)`` before the end of ``F`` (exact even when the template
      trims or rewrites the content, e.g. Qwen3 dropping old reasoning).
    * end: the end-of-turn text is the common prefix of the text after the content in ``F``, in
      ``T(messages[:i+1])`` and in ``T(messages[:i+1] + [probe user message])`` (this drops a document-end token
      such as Phi-3.5's final ``eos_token``). The span ends after the last stop string (:data:`STOP_STRINGS` or
      the tokenizer's ``eos_token``) in that text, else after it with trailing whitespace removed. So the stop
      token is in, a separator newline after it is out; a template without end-of-turn text (falcon-instruct)
      gets the content only, and a model trained on it cannot learn to stop.

    Args:
        renderer: the template renderer (tokenizer, template, template kwargs).
        messages: one conversation without padding.
        add_generation_prompt: passed to the full render.
        where: names the conversation in errors.

    Returns:
        ``(F, spans)``: the full render and one ``(start, end)`` per assistant message, in order.

    Raises:
        ChatTemplateError: the template raised, a turn cannot be located in the full render, or a turn's render
            inserts text inside its generation prompt (names the message index and the fix).
    """
    if renderer.has_generation_markers:
        return renderer.render_with_generation_indices(messages, add_generation_prompt)
    full = renderer.render(messages, add_generation_prompt)
    stops = tuple(dict.fromkeys((*STOP_STRINGS, *([renderer.eos] if renderer.eos else []))))
    start_mark, end_mark, probe_user = _markers(renderer, messages)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        probe = dict(m, content=start_mark + m["content"] + end_mark)
        full_probe = renderer.render([*messages[:i], probe, *messages[i + 1:]], add_generation_prompt)
        mark = full_probe.find(end_mark, prev_end)
        tail_full = full_probe[mark + 1:]
        if mark < 0 and m.get("tool_calls"):  # the template renders the call only (Llama-3.1): turn from prefixes
            start, end = _unrendered_content_span(renderer, messages, i, full, prev_end, stops, where, probe_user)
            spans.append((start, end))
            prev_end = end
            continue
        if mark < 0 or not full.endswith(tail_full):
            raise ChatTemplateError(
                f"Chat template {renderer.name!r}: cannot locate the content of assistant message {i} of {where} in "
                f"the render (the template does not render the content verbatim). Use a template with "
                f"{{% generation %}} markers for this model."
            )
        content_end = len(full) - len(tail_full)
        content_start = full_probe.find(start_mark, prev_end, mark)
        content_start = content_end if content_start < 0 else min(content_start, content_end)
        if not m["content"]:
            # An empty content has no position of its own, and the probe's content may switch the template's
            # branch (Qwen2.5 / Qwen3 write "\n" + content only when there is content, then the tool calls, whose
            # own "\n" the full render has there instead): the turn's prompt ends at most where the two renders
            # part.
            content_start = len(os.path.commonprefix([full, full_probe]))
        # End-of-turn text: what follows the content in every continuation of the turn.
        last = renderer.render([*messages[:i], probe], False)
        tails = [tail_full, last[last.rfind(end_mark) + 1:]]
        try:
            nxt = renderer.render([*messages[:i], probe, {"role": "user", "content": probe_user}], False)
            tails.append(nxt[nxt.rfind(end_mark) + 1:])
        except ChatTemplateError:
            pass
        eot = os.path.commonprefix(tails)
        cut = max((eot.rfind(s) + len(s) for s in stops if s in eot), default=len(eot.rstrip()))
        end = content_end + cut
        start = _span_start(renderer, messages, i, full, prev_end, content_start, where, probe_user)
        if not prev_end <= start <= end:
            raise ChatTemplateError(
                f"Chat template {renderer.name!r}: assistant message {i} of {where} maps to characters "
                f"[{start}, {end}), which overlap the previous assistant turn (ending at {prev_end})."
            )
        spans.append((start, end))
        prev_end = end
    return full, spans


def _unrendered_content_span(renderer: Renderer, messages: list[dict], i: int, full: str, prev_end: int,
                             stops: tuple[str, ...], where: str, probe_user: str) -> tuple[int, int]:
    """The span of assistant turn ``i`` (with ``tool_calls``) whose content the template does not render (Llama-3.1
    writes only the call's JSON): the turn is what ``T(messages[:i+1])`` adds to the render before it, as far as
    ``F``, ``T(messages[:i+1])`` and ``T(messages[:i+1] + [probe user message])`` agree; it ends after its last stop
    string (else with trailing whitespace removed), and starts after the generation prompt (:func:`_span_start`).

    Raises:
        ChatTemplateError: the render of ``messages[:i+1]`` does not agree with ``F`` past the previous turn.
    """
    upto = renderer.render(messages[:i + 1], False)
    renders = [full, upto]
    try:
        renders.append(renderer.render([*messages[:i + 1], {"role": "user", "content": probe_user}], False))
    except ChatTemplateError:
        pass
    agreed = len(os.path.commonprefix(renders))
    start = _span_start(renderer, messages, i, full, prev_end, agreed, where, probe_user) if agreed > prev_end else -1
    turn = full[start:agreed]
    if start < 0 or not turn.strip():
        raise ChatTemplateError(
            f"Chat template {renderer.name!r}: cannot locate assistant message {i} of {where} in the render (its "
            f"content is not rendered and the render of the conversation up to it is not a prefix of the full "
            f"render). Use a template with {{% generation %}} markers for this model."
        )
    cut = max((turn.rfind(s) + len(s) for s in stops if s in turn), default=len(turn.rstrip()))
    return start, start + cut


#: The fixed conversation after whose assistant turn :func:`render_continuation` renders new messages.
CONTINUATION_ANCHOR = ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."})


def render_continuation(renderer: Renderer, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
    """The text the template renders for ``messages`` appended after an assistant turn: everything after that turn's
    end-of-turn text (its stop token), through the generation prompt of the next turn (DESIGN.md property 9).

    Derived from one render of :data:`CONTINUATION_ANCHOR` followed by ``messages``: the anchor's assistant turn is
    delimited by :func:`_assistant_spans` (so its end is the end of the stop string, exactly as in the assistant
    masks) and the continuation is the rest of the render. The anchor's turn may be rendered differently once
    messages follow it (Qwen3 drops the empty think block of a non-final turn): only the text after it is used, never
    a re-render of an episode's history. For ChatML the continuation starts with the ``"\\n"`` rendered after
    ``<|im_end|>``.

    Args:
        renderer: the template renderer (tokenizer, template, template variables incl. ``tools``).
        messages: the new messages (``tool`` / ``user`` / ``system``; no ``assistant`` message), possibly empty
            (then the continuation is the generation prompt only, when the template renders it).
        add_generation_prompt: end with the next turn's generation prompt.

    Returns:
        The continuation text.

    Raises:
        ChatTemplateError: the template cannot render ``messages`` after an assistant turn (e.g. roles that must
            alternate, a ``tool`` role it does not know), or the anchor's turn cannot be delimited; names the
            template, the roles and the fix.
    """
    conversation = [*map(dict, CONTINUATION_ANCHOR), *messages]
    roles = [m.get("role") for m in messages]
    try:
        full, spans = _assistant_spans(renderer, conversation, add_generation_prompt=add_generation_prompt,
                                       where="the continuation anchor")
    except (ChatTemplateError, TypeError, IndexError, KeyError) as e:
        raise ChatTemplateError(
            f"Chat template {renderer.name!r} cannot render new messages with roles {roles} after an assistant turn, "
            f"so the suffix that appends them to an episode cannot be derived ({type(e).__name__}: {e}). Use a "
            f"template that renders these roles after an assistant turn (e.g. one with tool support for 'tool' "
            f"messages), or let the environment reply with 'user' messages."
        ) from e
    if len(spans) != 1:
        raise ChatTemplateError(
            f"Chat template {renderer.name!r}: the new messages (roles {roles}) render as assistant turns, so no "
            f"suffix after the sampled turn can be derived; environments reply with 'tool', 'user' or 'system' "
            f"messages."
        )
    # A template may silently drop a role it does not know (Phi-3.5 drops 'tool'): the model would never see it.
    marks = free_chars(renderer, conversation, len(messages))
    probe = renderer.render([*conversation[:2], *(dict(m, content=k) for m, k in zip(messages, marks))],
                            add_generation_prompt)
    dropped = [i for i, k in enumerate(marks) if k not in probe]
    if dropped:
        raise ChatTemplateError(
            f"Chat template {renderer.name!r} does not render the content of new message(s) {dropped} (roles "
            f"{[roles[i] for i in dropped]}) after an assistant turn: the model would never see them. Use a template "
            f"that renders this role, or let the environment reply with 'user' messages."
        )
    return full[spans[0][1]:]


def _span_start(renderer: Renderer, messages: list[dict], i: int, full: str, prev_end: int, content_start: int,
                where: str, probe_user: str) -> int:
    prompt = renderer.render(messages[:i], True, empty_ok=True)
    if prompt is not None and full.startswith(prompt) and prev_end <= len(prompt) <= content_start:
        return len(prompt)
    # The template renders this turn differently once it is followed by a reply: find the generation prompt.
    before = renderer.render(messages[:i], False, empty_ok=True)
    if prompt is None or before is None:  # the template cannot render messages[:i] (e.g. Qwen3 on no message)
        probe = [{"role": "user", "content": probe_user}]
        prompt, before = renderer.render(probe, True, empty_ok=True), renderer.render(probe, False, empty_ok=True)
    gen = "" if prompt is None or before is None else prompt[len(os.path.commonprefix([prompt, before])):]
    for k in range(len(gen), 0, -1):
        pos = full.rfind(gen[:k], prev_end, content_start)
        if pos >= 0:
            _check_prompt_not_interrupted(renderer, full, gen, k, pos + k, content_start, i, where)
            return pos + k
    raise ChatTemplateError(
        f"Chat template {renderer.name!r}: the generation prompt {gen!r} (render of messages[:{i}] with "
        f"add_generation_prompt=True minus the one without) is not found before assistant message {i} of {where} in "
        f"the full render, so its turn cannot be delimited. Use a template with {{% generation %}} markers."
    )


def _check_prompt_not_interrupted(renderer: Renderer, full: str, gen: str, k: int, start: int, content_start: int,
                                  i: int, where: str) -> None:
    """Refuse a turn whose render splits the generation prompt ``gen`` with extra text.

    The full render agrees with ``gen[:k]`` up to ``start``. When the rest of the generation prompt, ``gen[k:]``,
    is then found further on in the same turn (before its content ends), the template rendered the turn as the
    generation prompt with text inserted inside it: that text is neither prompt nor what a model generates after the
    prompt, so no mask of this turn is exact. Example: Qwen3 with ``enable_thinking=False`` prompts with an empty
    think block (``<think>\n\n</think>\n\n``) but renders a final turn's reasoning inside the block
    (``<think>\nreasoning\n</think>\n\n``). A rest that is only whitespace is not searched (it occurs anywhere).
    When the rest is absent, the template dropped it from the turn (DeepSeek-V3's ``<think>\n``) and the turn is
    exact from ``start``.

    Raises:
        ChatTemplateError: names the template, the assistant message index, the inserted text and the fix.
    """
    rest = gen[k:]
    if not rest.strip():
        return
    again = full.find(rest, start, content_start)
    if again < 0:
        return
    inserted = full[start:again]
    hint = (f"With enable_thinking=False the generation prompt ends with an empty think block, so the model never "
            f"writes reasoning: remove the reasoning (<think>...</think>) from assistant message "
            f"{i}, or set enable_thinking true (model.chat_template_kwargs)."
            if renderer.variables.get("enable_thinking") is False else
            f"Change assistant message {i} so that its render continues the generation prompt, or use a template "
            f"with {{% generation %}} markers.")
    raise ChatTemplateError(
        f"Chat template {renderer.name!r}: assistant message {i} of {where} does not continue its generation prompt: "
        f"the prompt ends with {gen!r}, but the render of the turn inserts {inserted!r} inside it (before "
        f"{rest!r}), text that is neither prompt nor what the model generates after that prompt, so the turn has no "
        f"exact assistant mask. {hint}"
    )


def _markers(renderer: Renderer, messages: list[dict]) -> tuple[str, str, str]:
    """Three private-use characters (never whitespace, never changed by Jinja filters) that occur nowhere in the
    conversation, the template or its variables: ``(start mark, end mark, probe user content)``."""
    return free_chars(renderer, messages, 3)


def free_chars(renderer: Renderer, messages: list[dict], n: int) -> tuple[str, ...]:
    """``n`` private-use characters (U+E000 onwards) that occur nowhere in ``messages``, the template or its
    variables (tools, documents, special tokens and template kwargs of ``renderer``).

    Placeholders that survive a render unchanged and cannot be confused with the conversation: the assistant-span
    markers here, the stand-ins of special tokens in :class:`lit_llm.rollouts.episode_renderer.EpisodeRenderer`.

    Args:
        renderer: the :class:`~lit_llm.data.renderer.Renderer` the characters will be rendered with.
        messages: the conversation (nested values are searched too).
        n: how many characters.

    Returns:
        ``n`` distinct characters, in increasing code point order.
    """
    used: set[str] = set()
    stack: list[Any] = [renderer.template, messages, renderer.tools, renderer.documents, renderer.variables]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            used.update(x)
        elif isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    free = (c for c in map(chr, range(0xE000, 0xF900)) if c not in used)
    return tuple(next(free) for _ in range(n))


assistant_spans = _assistant_spans
