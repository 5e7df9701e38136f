"""Episodes with a scripted policy (DESIGN.md property 9): the trajectory is each sampled turn's ids exactly plus
each environment suffix (expected suffix texts written by hand from reading the templates), the loss mask is
exactly the sampled ids, nothing is re-tokenised; where the template does not rewrite earlier turns the loss mask is
the assistant mask of the rendered History; with Qwen3 (which does) the trajectory is what the model saw."""

from __future__ import annotations

import copy

import pytest
import torch
from episode_doubles import ScriptedEnv, Step, fake_log_probs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_llm.data.errors import ChatTemplateError
from lit_llm.data.history import History
from lit_llm.rollouts import EpisodeRenderer, RolloutError, run_episode
from lit_llm.rollouts.envs import tool_schemas
from lit_llm.rollouts.episodes import turn_seed

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def llama3_tokenizer(tokenizer):
    """The SmolLM2 tokenizer with Llama-3's control tokens added as special tokens (as in Llama-3's own)."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    return tok


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "12*7".
    """
    return str(eval(expression))  # noqa: S307 - test tool


CHATML_USER = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
LLAMA3_USER = ("<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n")

# name: (template file or None, tokenizer, stop text, env role, expected suffix of one env message, rewrites turns,
#        canonical tokenisation of prompt+reply == full render's, with tools)
CASES = {
    "smollm2": (None, "smollm2", "<|im_end|>", "user", CHATML_USER, False, True, False),
    "chatml": ("chatml.jinja", "smollm2", "<|im_end|>", "user", CHATML_USER, False, True, False),
    "llama-3": ("llama-3-instruct.jinja", "llama3", "<|eot_id|>", "user", LLAMA3_USER, False, False, False),
    "qwen2.5-tools": ("stock-qwen2_5.jinja", "smollm2", "<|im_end|>", "tool", QWEN_TOOL, False, True, True),
    "qwen3": ("stock-qwen3.jinja", "smollm2", "<|im_end|>", "user", CHATML_USER, True, False, False),
}


def reply_texts(case: str) -> list[str]:
    if case == "qwen3":
        return ["<think>\nreason a\n</think>\n\nI guess 50.", "<think>\nreason b\n</think>\n\nThen 75.",
                "<think>\nreason c\n</think>\n\nIt is 62."]
    return ["I guess 50.", "Then 75.", "It is 62."]


def setup_case(case, tokenizer, llama3_tokenizer, templates_dir):
    template, tok, stop, role, suffix, rewrites, canonical, with_tools = CASES[case]
    tok = llama3_tokenizer if tok == "llama3" else tokenizer
    template = None if template is None else templates_dir / template
    feedback = ["higher", "lower"]
    env = ScriptedEnv([Step([{"role": role, "content": feedback[0]}], reward=-0.25, info={"tool_calls": 1}),
                       Step([{"role": role, "content": feedback[1]}], reward=0.0,
                            info={"tool_calls": 2, "tool_errors": 1, "tool_time": 0.5}),
                       Step([], reward=1.0, done=True, info={"reason": "answer"})],
                      tools=[calculator] if with_tools else None)
    replies = [tok(t + stop, add_special_tokens=False)["input_ids"] for t in reply_texts(case)]
    return tok, template, env, replies, [suffix.format(f) for f in feedback], rewrites, canonical


def scripted_generate(replies, seen):
    def generate(ids, seed):
        seen.append((ids.tolist(), seed))
        out = replies[len(seen) - 1]
        return torch.tensor(out), fake_log_probs(out), False
    return generate


def per_token_text(tok, ids) -> list[str]:
    return [tok.decode([i]) for i in ids]


@pytest.mark.parametrize("case", list(CASES))
def test_trajectory_is_sampled_ids_plus_suffixes_and_mask_is_provenance(case, tokenizer, llama3_tokenizer,
                                                                        templates_dir):
    tok, template, env, replies, suffixes, rewrites, canonical = setup_case(case, tokenizer, llama3_tokenizer,
                                                                             templates_dir)
    renderer = EpisodeRenderer(tok, chat_template=template)
    seen = []
    traj = run_episode(env, {"prompt": "Guess my number."}, renderer=renderer,
                       generate=scripted_generate(replies, seen), seed=11)
    tools_kw = {"tools": tool_schemas(env.tools)} if env.tools else {}
    prompt = History.from_chats([{"role": "user", "content": "Guess my number."}]).apply_chat_template(
        tok, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False, **tools_kw)
    suffix_ids = [tok(s, add_special_tokens=False)["input_ids"] for s in suffixes]
    expected = [*replies[0], *suffix_ids[0], *replies[1], *suffix_ids[1], *replies[2]]
    assert torch.equal(traj.prompt_ids, prompt)
    assert traj.completion_ids.tolist() == expected
    assert traj.loss_mask.tolist() == ([True] * len(replies[0]) + [False] * len(suffix_ids[0])
                                       + [True] * len(replies[1]) + [False] * len(suffix_ids[1])
                                       + [True] * len(replies[2]))
    lp = traj.log_probs
    assert torch.equal(lp[traj.loss_mask], torch.cat([fake_log_probs(r) for r in replies]))
    assert (lp[~traj.loss_mask] == 0).all()
    # what the model saw: each turn's input is the trajectory so far; seeds per turn
    full = traj.full_ids.tolist()
    ends = [len(prompt), len(prompt) + len(replies[0]) + len(suffix_ids[0])]
    ends.append(ends[1] + len(replies[1]) + len(suffix_ids[1]))
    assert [s[0] for s in seen] == [full[:e] for e in ends]
    assert [s[1] for s in seen] == [turn_seed(11, t) for t in range(3)] and seen[0][1] == 11
    # bookkeeping
    assert (traj.turns, traj.done, traj.truncated, traj.reason) == (3, True, False, "answer")
    assert traj.env_reward == pytest.approx(0.75) and (traj.tool_calls, traj.tool_errors) == (3, 1)
    assert traj.tool_time == pytest.approx(0.5) and env.closed
    texts = [tok.decode(r, skip_special_tokens=True) for r in replies]
    role = CASES[case][3]
    assert traj.completion_messages == [{"role": "assistant", "content": texts[0]}, {"role": role, "content": "higher"},
                                        {"role": "assistant", "content": texts[1]}, {"role": role, "content": "lower"},
                                        {"role": "assistant", "content": texts[2]}]
    assert env.seen[-1] == traj.messages  # the environment saw the conversation, its last turn the decoded reply

    history = History.from_chats(traj.messages)
    rendered = history.apply_chat_template(tok, chat_template=template, add_generation_prompt=False, tokenize=False,
                                           **tools_kw)
    ours = "".join(per_token_text(tok, full))
    if rewrites:  # Qwen3 drops the reasoning of turns before the last user message: a re-render is not what was seen
        assert "reason a" in ours and "reason a" not in rendered
        return
    # the characters the model saw are the rendered History's, and the loss mask covers exactly its assistant spans
    assert rendered.startswith(ours) and rendered[len(ours):].strip() == ""
    enc = history.apply_chat_template(tok, chat_template=template, add_generation_prompt=False,
                                      return_assistant_tokens_mask=True, **tools_kw)
    offsets = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    asst_chars = [False] * len(rendered)
    for (a, b), m in zip(offsets, enc["assistant_masks"].tolist()):
        for c in range(a, b):
            asst_chars[c] = asst_chars[c] or m
    our_chars = [m for piece, m in zip(per_token_text(tok, full), [False] * len(prompt) + traj.loss_mask.tolist())
                 for _ in piece]
    assert our_chars == asst_chars[:len(ours)] and not any(asst_chars[len(ours):])
    if canonical:  # and token by token: the trajectory is the History's ids, the loss mask its assistant mask
        ids, mask = enc["input_ids"].tolist(), enc["assistant_masks"]
        assert ids[:len(full)] == full
        assert torch.equal(mask[len(prompt):len(full)], traj.loss_mask) and not mask[:len(prompt)].any()
        assert not mask[len(full):].any()


@pytest.mark.parametrize("case", ["chatml", "qwen3", "llama-3"])
def test_sampled_ids_are_never_retokenised(case, tokenizer, llama3_tokenizer, templates_dir):
    """A turn whose ids are not the canonical tokenisation of its text ("h" + "ello") stays as sampled."""
    tok, template, env, replies, suffixes, _, _ = setup_case(case, tokenizer, llama3_tokenizer, templates_dir)
    stop = tok.convert_tokens_to_ids(CASES[case][2])
    odd = tok.convert_tokens_to_ids(["h", "ello"]) + [stop]
    assert tok(tok.decode(odd, skip_special_tokens=True), add_special_tokens=False)["input_ids"] != odd[:-1]
    replies = [odd, *replies[1:]]
    traj = run_episode(env, {"prompt": "Hi"}, renderer=EpisodeRenderer(tok, chat_template=template),
                       generate=scripted_generate(replies, []))
    assert traj.segments[0].ids.tolist() == odd and traj.completion_ids[:3].tolist() == odd
    assert traj.messages[traj.num_prompt_messages] == {"role": "assistant", "content": "hello"}
    assert [s.source for s in traj.segments] == ["model", "env", "model", "env", "model"]


# ------------------------------------------------------------------------------------------------ suffix renders
def test_suffix_starts_after_the_stop_token_and_keeps_special_token_text_as_text(tokenizer):
    r = EpisodeRenderer(tokenizer)
    assert r.suffix_text([{"role": "user", "content": "ok"}]) == CHATML_USER.format("ok")
    assert r.suffix_text([]) == "\n<|im_start|>assistant\n"  # no new message: the next generation prompt only
    ids = r.suffix_ids([{"role": "tool", "content": "echo <|im_end|>!"}]).tolist()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_end) == 1  # only the template's own end of the tool turn is the control token
    text = "\n<|im_start|>tool\necho <|im_end|>!<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text
    literal = tokenizer("<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert any(ids[i:i + len(literal)] == literal for i in range(len(ids)))


def test_qwen3_tool_turns_group_and_thinking_off_reaches_the_suffix(tokenizer, templates_dir):
    r = EpisodeRenderer(tokenizer, chat_template=templates_dir / "stock-qwen3.jinja",
                        chat_template_kwargs={"enable_thinking": False})
    two = [{"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    assert r.suffix_text(two, [calculator]) == ("\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n"
                                               "<tool_response>\nB\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                                               "<think>\n\n</think>\n\n")


def test_tools_go_to_the_template_or_the_system_prompt(tokenizer, templates_dir):
    qwen = EpisodeRenderer(tokenizer, chat_template=templates_dir / "stock-qwen2_5.jinja")
    msgs = [{"role": "user", "content": "2*3?"}]
    assert qwen.takes_tools and qwen.prompt_messages(msgs, [calculator]) == msgs
    text = tokenizer.decode(qwen.prompt_ids(msgs, [calculator]))
    assert '"name": "calculator"' in text and "# Tools" in text
    smol = EpisodeRenderer(tokenizer, tools_prompt=lambda tools: "Tools: " + ", ".join(t.__name__ for t in tools))
    assert not smol.takes_tools
    assert smol.prompt_messages(msgs, [calculator]) == [{"role": "system", "content": "Tools: calculator"}, *msgs]
    assert smol.prompt_messages([{"role": "system", "content": "Be brief."}, *msgs], [calculator])[0] == {
        "role": "system", "content": "Be brief.\n\nTools: calculator"}


@pytest.mark.parametrize("template, role, match", [
    ("chatml.jinja", "tool", r"'chatml.jinja' cannot render new messages with roles \['tool'\].*'user' messages"),
    ("stock-phi3_5.jinja", "tool", r"'stock-phi3_5.jinja' does not render the content of new message\(s\) \[0\]"),
])
def test_underivable_suffix_names_the_template(tokenizer, templates_dir, template, role, match):
    r = EpisodeRenderer(tokenizer, chat_template=templates_dir / template)
    with pytest.raises(ChatTemplateError, match=match):
        r.suffix_ids([{"role": role, "content": "42"}])


# ------------------------------------------------------------------------------------------ endings and budgets
def env_of(n_feedback: int, *, done_reward: float = 1.0):
    steps = [Step([{"role": "user", "content": f"no {k}"}]) for k in range(n_feedback)]
    return ScriptedEnv([*steps, Step([], reward=done_reward, done=True)])


def test_max_turns_ends_truncated_and_drops_the_last_reply(tokenizer):
    replies = [tokenizer(f"try {k}<|im_end|>", add_special_tokens=False)["input_ids"] for k in range(5)]
    env = env_of(4)
    traj = run_episode(env, {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer),
                       generate=scripted_generate(replies, []), max_turns=2)
    assert (traj.turns, traj.truncated, traj.reason, traj.done) == (2, True, "max_turns", False)
    assert [s.source for s in traj.segments] == ["model", "env", "model"]  # ends with the sampled turn
    assert len(env.seen) == 2  # the last turn was still shown to the environment (it may be the answer)


def test_last_allowed_turn_is_stepped_its_tool_counts_and_reward_kept_its_messages_dropped(tokenizer):
    """As run_episode's docstring says: a tool call in the last allowed turn runs (counted, its reward kept) but its
    result is not rendered (no model turn follows)."""
    replies = [tokenizer(f"call {k}<|im_end|>", add_special_tokens=False)["input_ids"] for k in range(2)]
    tool = {"tool_calls": 2, "tool_errors": 1, "tool_time": 0.5}
    env = ScriptedEnv([Step([{"role": "tool", "content": f"result {k}"}], reward=-0.25, info=tool) for k in range(2)])
    traj = run_episode(env, {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer),
                       generate=scripted_generate(replies, []), max_turns=2)
    assert (traj.reason, traj.tool_calls, traj.tool_errors, traj.tool_time, traj.env_reward) == (
        "max_turns", 4, 2, 1.0, -0.5)
    assert [m["content"] for m in traj.messages] == ["Go", "call 0", "result 0", "call 1"]


def test_turn_without_stop_token_ends_without_stepping(tokenizer):
    seen = []

    def generate(ids, seed):
        seen.append(1)
        return torch.tensor([5, 6, 7]), fake_log_probs([5, 6, 7]), True
    env = env_of(3)
    traj = run_episode(env, {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer), generate=generate)
    assert (traj.turns, traj.truncated, traj.reason, env.seen) == (1, True, "max_new_tokens", [])


def test_episode_token_budget_cuts_turns_and_drops_suffixes(tokenizer):
    replies = [tokenizer(f"answer number {k}<|im_end|>", add_special_tokens=False)["input_ids"] for k in range(4)]
    suffix = len(tokenizer(CHATML_USER.format("no 0"), add_special_tokens=False)["input_ids"])
    r0 = len(replies[0])
    renderer = EpisodeRenderer(tokenizer)
    # budget inside the second turn: the turn is cut to the budget (a prefix of its sampled ids)
    traj = run_episode(env_of(3), {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(replies, []),
                       max_episode_tokens=r0 + suffix + 2)
    assert (traj.truncated, traj.reason, traj.turns) == (True, "max_episode_tokens", 2)
    assert traj.completion_ids.numel() == r0 + suffix + 2 and traj.segments[-1].ids.tolist() == replies[1][:2]
    # budget that leaves no room after the suffix: the suffix is dropped, the trajectory ends with the sampled turn
    traj = run_episode(env_of(3), {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(replies, []),
                       max_episode_tokens=r0 + suffix)
    assert (traj.reason, traj.turns, traj.completion_ids.tolist()) == ("max_episode_tokens", 1, replies[0])
    # the context: the next input would not fit
    prompt = renderer.prompt_ids([{"role": "user", "content": "Go"}]).numel()
    traj = run_episode(env_of(3), {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(replies, []),
                       max_input_length=prompt + r0 + suffix - 1)
    assert (traj.reason, traj.turns, traj.truncated) == ("max_context", 1, True)
    with pytest.raises(RolloutError, match=r"first render.*leaving no room to generate"):
        run_episode(env_of(1), {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(replies, []),
                    max_input_length=prompt - 1)


def test_environment_errors_are_loud_and_name_the_environment(tokenizer):
    renderer = EpisodeRenderer(tokenizer)
    reply = [tokenizer("x<|im_end|>", add_special_tokens=False)["input_ids"]] * 3

    class Broken(ScriptedEnv):
        def step(self, messages):
            raise KeyError("bug")
    with pytest.raises(RolloutError, match=r"environment Broken\.step raised KeyError: 'bug'"):
        run_episode(Broken([]), {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(reply, []))
    bad = ScriptedEnv([Step([{"role": "assistant", "content": "hi"}])])
    with pytest.raises(RolloutError, match=r"ScriptedEnv\.step must return a list of messages"):
        run_episode(bad, {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(reply, []))
    nan = ScriptedEnv([Step([], reward=float("nan"), done=True)])
    with pytest.raises(RolloutError, match=r"returned the reward nan"):
        run_episode(nan, {"prompt": "Go"}, renderer=renderer, generate=scripted_generate(reply, []))
    assert nan.closed


# ------------------------------------------------------------------------------------------- property tests
TEXT = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 .,!?", min_size=1, max_size=20).map(str.strip).filter(
    bool)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=4), system=st.booleans(),
       template=st.sampled_from([None, "chatml.jinja"]))
def test_property_trajectory_equals_history_and_mask_equals_assistant_mask(tokenizer, templates_dir, turns, system,
                                                                         template):
    """Any script of replies and feedback on a template that does not rewrite turns: the trajectory is the rendered
    History's ids and the loss mask its assistant mask; sampled turns and suffixes tile the completion."""
    template = None if template is None else templates_dir / template
    replies = [tokenizer(r + "<|im_end|>", add_special_tokens=False)["input_ids"] for r, _ in turns]
    steps = [Step([{"role": "user", "content": f}]) for _, f in turns[:-1]] + [Step([], done=True)]
    env = ScriptedEnv(steps, system="Be brief." if system else None)
    traj = run_episode(env, {"prompt": "Start"}, renderer=EpisodeRenderer(tokenizer, chat_template=template),
                       generate=scripted_generate(replies, []))
    assert torch.equal(torch.cat([s.ids for s in traj.segments]), traj.completion_ids)
    assert [s.ids.tolist() for s in traj.segments if s.source == "model"] == replies
    assert traj.loss_mask.sum() == sum(map(len, replies)) and traj.turns == len(turns)
    enc = History.from_chats(traj.messages).apply_chat_template(tokenizer, chat_template=template,
                                                                 return_assistant_tokens_mask=True,
                                                                     add_generation_prompt=False)
    full, lp = traj.full_ids.tolist(), traj.prompt_ids.numel()
    assert enc["input_ids"][:len(full)].tolist() == full
    assert torch.equal(enc["assistant_masks"][lp:len(full)], traj.loss_mask)
    assert not enc["assistant_masks"][:lp].any() and not enc["assistant_masks"][len(full):].any()


TAKES_TOOLS = {"qwen2.5-instruct.jinja", "stock-lfm2.jinja", "stock-llama3_1.jinja", "stock-llama3_2.jinja",
               "stock-qwen2_5.jinja", "stock-qwen3.jinja"}  # the templates that read a `tools` variable


def test_every_shared_template_renders_a_user_reply_suffix_or_names_itself(tokenizer, templates_dir):
    """A user reply after an assistant turn: its suffix holds the content and none of the anchor's turn (never a
    re-render), for every shared template; the templates that read ``tools`` are recognised."""
    from lit_llm.data.chat_template import template_takes_tools

    for path in sorted(templates_dir.glob("*.jinja")):
        r = EpisodeRenderer(tokenizer, chat_template=path)
        assert r.takes_tools == (path.name in TAKES_TOOLS) == template_takes_tools(path.read_text()), path.name
        text = r.suffix_text([{"role": "user", "content": "probe reply"}])
        assert "probe reply" in text and "Hello." not in text and "Hi." not in text, (path.name, text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6), feedback=st.integers(0, 6),
       budget=st.one_of(st.none(), st.integers(1, 80)), max_turns=st.integers(1, 6), cut_last=st.booleans())
def test_property_budgets_and_endings(tokenizer, lengths, feedback, budget, max_turns, cut_last):
    """Whatever the turn lengths, budgets and endings: the completion fits the budget, ends with a sampled turn,
    tiles into its segments; the loss mask is exactly the sampled segments; the ending reason matches the rules."""
    from lit_llm.rollouts.episodes import ENGINE_REASONS

    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    calls = []

    def generate(ids, seed):
        t = len(calls)
        calls.append(ids.numel())
        n = lengths[min(t, len(lengths) - 1)]
        out = [1000 + t] * (n - 1) + ([500] if cut_last and t == len(lengths) - 1 else [stop])
        return torch.tensor(out), fake_log_probs(out), out[-1] != stop
    env = ScriptedEnv([Step([{"role": "user", "content": f"fb {k}"}]) for k in range(feedback)]
                      + [Step([], reward=1.0, done=True)])
    traj = run_episode(env, {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer), generate=generate,
                       max_turns=max_turns, max_episode_tokens=budget)
    comp = traj.completion_ids
    assert budget is None or comp.numel() <= budget
    assert traj.segments[-1].source == "model" and torch.equal(torch.cat([s.ids for s in traj.segments]), comp)
    assert torch.equal(traj.loss_mask, torch.cat([torch.full((len(s.ids),), s.source == "model")
                                                  for s in traj.segments]))
    assert traj.turns == len(calls) == sum(s.source == "model" for s in traj.segments) <= max_turns
    assert calls == [traj.prompt_ids.numel() + sum(len(s.ids) for s in traj.segments[:2 * t]) for t in
                     range(traj.turns)]  # each turn saw the whole trajectory so far
    assert traj.truncated == (traj.reason in ENGINE_REASONS) and traj.truncated != traj.done
    if traj.done:
        assert traj.turns == feedback + 1 and traj.env_reward == 1.0
    elif traj.reason == "max_turns":
        assert traj.turns == max_turns
    elif traj.reason == "max_new_tokens":
        assert cut_last and traj.segments[-1].ids[-1] == 500
    else:
        assert traj.reason == "max_episode_tokens" and budget is not None


def test_public_names_importable_from_episodes():
    """The split into renderer / trajectory / loop modules keeps every public name where it was."""
    import lit_llm.rollouts as rollouts
    from lit_llm.rollouts import episode_loop, episode_renderer, episodes, trajectory

    homes = {"EpisodeRenderer": episode_renderer, "Segment": trajectory, "Trajectory": trajectory,
             "EPISODE_STAT_KEYS": trajectory, "run_episode": episode_loop, "turn_seed": episode_loop,
             "DEFAULT_MAX_TURNS": episode_loop, "DEFAULT_ENV_TIMEOUT": episode_loop, "ENGINE_REASONS": episode_loop}
    assert set(homes) < set(episodes.__all__)
    for name, home in homes.items():
        assert getattr(episodes, name) is getattr(home, name), name
    for name in ("EpisodeEngine", "EpisodeRenderer", "Trajectory", "run_episode", "turn_seed"):
        assert getattr(rollouts, name) is getattr(episodes, name)


def test_a_score_returning_none_fails_the_episode_naming_the_class(tokenizer):
    """Through the episode loop: a ToolEnv whose score returns None is a RolloutError naming <Class>.score."""
    from lit_llm.rollouts.envs import ToolEnv

    class NoneScore(ToolEnv):
        tools = [calculator]

        def score(self, answer, row):
            if answer == "right":
                return 1.0  # forgot the other path

    reply = [tokenizer("wrong<|im_end|>", add_special_tokens=False)["input_ids"]]
    with pytest.raises(RolloutError) as e:
        run_episode(NoneScore(), {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer),
                    generate=scripted_generate(reply, []))
    assert str(e.value) == (
        "environment NoneScore.step raised TypeError: NoneScore.score must return a real number (the reward of the "
        "final answer), got NoneType None for the answer 'wrong'; return a float (e.g. 1.0 for a correct answer, 0.0 "
        "otherwise) on every path. (environments report tool and model-output errors as messages; an exception is a "
        "bug of the environment)")


@pytest.mark.parametrize("max_turns", [0, -1, 1.5, True, None])
def test_max_turns_below_one_is_an_error(tokenizer, max_turns):
    env = env_of(1)
    with pytest.raises(RolloutError) as e:
        run_episode(env, {"prompt": "Go"}, renderer=EpisodeRenderer(tokenizer), generate=scripted_generate([], []),
                    max_turns=max_turns)
    assert str(e.value) == (f"run_episode: max_turns must be an int >= 1 (model turns per episode), got "
                            f"{max_turns!r}.")
    assert env.seen == [] and not env.closed  # checked before the environment is used


def test_rendered_ids_are_host_tensors_whatever_the_default_device(tokenizer):
    # issue 28: no tensor created on a default device (a default CUDA device would put each render on the GPU, row by
    # row); the meta device stands in for it
    r = EpisodeRenderer(tokenizer)
    with torch.device("meta"):
        ids = [r.prompt_ids([{"role": "user", "content": "Hi"}]),
               r.suffix_ids([{"role": "tool", "content": "echo <|im_end|>!"}]),
               r.suffix_ids([{"role": "user", "content": "ok"}])]
    assert [t.device.type for t in ids] == ["cpu"] * 3 and all(t.numel() > 0 for t in ids)
