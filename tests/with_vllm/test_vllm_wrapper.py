"""vLLMWrapper on the CPU build of vLLM (``tiny-vllm``, fp32, eager): the same outputs and log-probs as
TransformersWrapper on the same ids, the three input modes, stop semantics, per-row seeds, refusals."""

from __future__ import annotations

import threading

import pytest
import torch
from tensordict import TensorDict
from vllm_test_inputs import ENGINE_KWARGS, rows, token_prompts, tokens_td

from lit_llm.data.containers import ChatHistory, Text
from lit_llm.data.history import History
from lit_llm.policy import TransformersWrapper, vLLMWrapper

pytestmark = pytest.mark.vllm

ATOL = 1e-4  # fp32: vLLM's CPU kernels vs transformers' sdpa (measured max difference ~2e-6)
CHATS = [[{"role": "user", "content": "What is 12 + 30? Reply with the number."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "Count to three."}]]


@pytest.fixture(scope="module")
def engine():
    from lit_llm.policy.vllm_engine import make_engine

    llm = make_engine("tiny-vllm", **ENGINE_KWARGS)
    yield llm
    del llm


def scorer(hf_tiny, temperature: float = 1.0) -> TransformersWrapper:
    model, tok = hf_tiny
    return TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, temperature=temperature)


def history_td(chats) -> TensorDict:
    return TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=[len(chats)])


@pytest.mark.parametrize("kwargs, temperature", [({"temperature": 0.7}, 0.7), ({"do_sample": False}, 1.0),
                                                 ({"temperature": 1.0}, 1.0)])
def test_generate_log_probs_equal_transformers_log_prob_version(engine, hf_tiny, kwargs, temperature):
    prompts = token_prompts(3)
    policy = vLLMWrapper(engine, input_mode="tokens", num_samples=2,
                         generate_kwargs={"max_new_tokens": 10, **kwargs})
    out = policy(tokens_td(prompts, seeds=[1, 2, 3]))
    assert out.batch_size == torch.Size([3, 2])
    flat = out.reshape(-1)
    for b, (prompt, full, resp) in enumerate(zip(rows(flat, ("tokens", "prompt")), rows(flat, ("tokens", "full")),
                                                 rows(flat, ("tokens", "response")))):
        assert torch.equal(prompt, prompts[b // 2])
        assert torch.equal(full, torch.cat([prompt, resp]))
        assert resp.numel() == 10
    with torch.no_grad():
        ref = scorer(hf_tiny, temperature)(flat.select("tokens").copy())
    for got, want in zip(rows(flat, ("log_probs", "response")), rows(ref, ("log_probs", "response"))):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for got, n in zip(rows(flat, ("log_probs", "full")), [p.numel() for p in rows(flat, ("tokens", "prompt"))]):
        assert torch.equal(got[:n], torch.zeros(n))  # the prompt is not scored by the generate version
    assert out["truncated"].all()


def test_log_prob_version_equals_transformers_in_history_mode(engine, hf_tiny):
    model, tok = hf_tiny
    chats = [c + [{"role": "assistant", "content": a}] for c, a in zip(CHATS, ["42", "Blue.", "One, two, three."])]
    td = TensorDict(history=ChatHistory(full=History.from_chats(chats)), batch_size=[3])
    with torch.no_grad():
        want = TransformersWrapper(model, tokenizer=tok, generate=False)(td.copy())
    got = vLLMWrapper(engine, generate=False)(td.copy())
    for key in (("tokens", "full"), ("masks", "all_assistant_mask"), ("tokens", "response")):
        for g, w in zip(rows(got, key), rows(want, key)):
            assert torch.equal(g, w), key
    for g, w in zip(rows(got, ("log_probs", "full")), rows(want, ("log_probs", "full"))):
        assert g[0] == 0.0
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    assert [h.content[-1] for h in got["history", "response"].unbind(0)] == ["42", "Blue.", "One, two, three."]


def test_history_mode_prompt_is_our_render_and_eos_stays_in_the_response(engine, hf_tiny):
    _, tok = hf_tiny
    greedy = vLLMWrapper(engine, generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    out = greedy(history_td(CHATS[:1]))
    prompt = History.from_chats(CHATS[:1])[0].apply_chat_template(
        tok, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert torch.equal(rows(out, ("tokens", "prompt"))[0], prompt.long())
    assert out["text", "prompt"][0] == tok.decode(prompt.tolist())
    resp = rows(out, ("tokens", "response"))[0]
    assert out["truncated"].tolist() == [True] and resp.numel() == 8
    # make a token the model emits greedily the only eos id: the response must end with it, and keep it
    i = next((k for k in range(1, 8) if int(resp[k]) not in resp[:k].tolist()), 0)
    stop = int(resp[i])
    stopped = greedy.get_new_version(generate_kwargs={"max_new_tokens": 8, "do_sample": False,
                                                      "eos_token_id": [stop]})(history_td(CHATS[:1]))
    got = rows(stopped, ("tokens", "response"))[0]
    assert got.tolist() == resp[:i + 1].tolist()
    assert stopped["truncated"].tolist() == [False]
    before = rows(out, ("log_probs", "response"))[0]
    torch.testing.assert_close(rows(stopped, ("log_probs", "response"))[0], before[:i + 1])
    reply = stopped["history", "response"][0]
    assert reply.content[0] == tok.decode(resp[:i].tolist()) and reply.is_complete[0]
    assert rows(stopped, ("masks", "all_assistant_mask"))[0].tolist() == [False] * prompt.numel() + [True] * (i + 1)


def test_stop_string_ends_the_response_at_the_token_that_completes_it(engine, hf_tiny):
    _, tok = hf_tiny
    greedy = vLLMWrapper(engine, input_mode="text", generate_kwargs={"max_new_tokens": 8, "do_sample": False})
    td = TensorDict(text=Text(prompt=["Once upon a time"]), batch_size=[1]).copy()
    resp = rows(greedy(td.copy()), ("tokens", "response"))[0]
    stop_text = tok.decode(resp[3:5].tolist())
    stopped = greedy.get_new_version(generate_kwargs={"max_new_tokens": 8, "do_sample": False,
                                                      "stop_sequences": [stop_text]})(td.copy())
    got = rows(stopped, ("tokens", "response"))[0]
    assert stop_text in tok.decode(got.tolist()) and stop_text not in tok.decode(got[:-1].tolist())
    assert got.tolist() == resp[:got.numel()].tolist() and stopped["truncated"].tolist() == [False]


def test_text_and_tokens_modes(engine, hf_tiny):
    _, tok = hf_tiny
    texts = ["The capital of France is", "1, 2, 3,"]
    out = vLLMWrapper(engine, input_mode="text", generate_kwargs={"max_new_tokens": 5})(
        TensorDict(text=Text(prompt=texts), batch_size=[2]))
    for t, p, r, full, resp in zip(texts, rows(out, ("tokens", "prompt")), rows(out, ("tokens", "response")),
                                   out["text", "full"], out["text", "response"]):
        assert p.tolist() == tok(t, add_special_tokens=False)["input_ids"]
        assert resp == tok.decode(r.tolist()) and full == t + resp
    tokens = vLLMWrapper(engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 5})
    assert tokens.out_keys == ["masks", "tokens", "log_probs", "truncated"]
    again = tokens(tokens_td(rows(out, ("tokens", "prompt"))))
    for a, b in zip(rows(again, ("tokens", "response")), rows(out, ("tokens", "response"))):
        assert torch.equal(a, b)  # greedy (no temperature): the same ids from ids as from the text
    assert "text" not in again.keys()


def test_same_seed_same_outputs_and_rows_independent_of_the_batch(engine):
    policy = vLLMWrapper(engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "temperature": 1.0})
    prompts = token_prompts(3, seed=1)
    first = policy(tokens_td(prompts, seeds=[11, 12, 13]))
    second = policy(tokens_td(prompts, seeds=[11, 12, 13]))
    alone = policy(tokens_td(prompts[2:], seeds=[13]))
    other = policy(tokens_td(prompts[1:], seeds=[99, 13]))
    resp = rows(first, ("tokens", "response"))
    assert all(torch.equal(a, b) for a, b in zip(resp, rows(second, ("tokens", "response"))))
    assert torch.equal(rows(alone, ("tokens", "response"))[0], resp[2])
    assert torch.equal(rows(other, ("tokens", "response"))[1], resp[2])
    assert not torch.equal(rows(other, ("tokens", "response"))[0], resp[1])  # another seed, another sample
    torch.testing.assert_close(rows(alone, ("log_probs", "response"))[0], rows(first, ("log_probs", "response"))[2])
    # per-sample seeds ([B, n]): a sample is the one its seed gives a row of its own, whatever its sibling's seed
    pair = vLLMWrapper(engine, input_mode="tokens", num_samples=2,
                       generate_kwargs={"max_new_tokens": 6, "temperature": 1.0})
    td = tokens_td(prompts[2:])
    td["sampling_seed"] = torch.tensor([[5, 13]])
    assert torch.equal(rows(pair(td).reshape(-1), ("tokens", "response"))[1], resp[2])


def test_threaded_batcher_serves_seeded_rows_as_alone(engine):
    prompts = token_prompts(4, seed=2)
    kwargs = {"max_new_tokens": 5, "temperature": 1.0}
    alone = [rows(vLLMWrapper(engine, input_mode="tokens", generate_kwargs=kwargs)(tokens_td([p], seeds=[i])),
                  ("tokens", "response"))[0] for i, p in enumerate(prompts)]
    batched = vLLMWrapper(engine, input_mode="tokens", generate_kwargs=kwargs, batching=True, min_batch_size=4,
                          batching_timeout=30.0)
    results = [None] * 4

    def call(i):
        results[i] = rows(batched(tokens_td([prompts[i]], seeds=[i])), ("tokens", "response"))[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batched.cleanup_batching()
    assert all(torch.equal(r, a) for r, a in zip(results, alone))


def test_get_new_version_shares_the_engine(engine):
    policy = vLLMWrapper(engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 4})
    scorer_ = policy.get_new_version(generate=False)
    assert scorer_.model is engine and not scorer_.generate and scorer_.temperature == 1.0
    assert scorer_.input_key == ("tokens", "full")


def test_refusals_name_the_setting(engine, monkeypatch):
    with pytest.raises(ValueError) as e:
        vLLMWrapper(engine, generate_kwargs={"presence_penalty": 0.5})
    assert str(e.value).startswith("vLLMWrapper: generate_kwargs 'presence_penalty' has no mapping to vLLM's "
                                   "SamplingParams here; supported (TorchRL's standardised names): [")
    with pytest.raises(ValueError, match=r"^vLLMWrapper: generate_kwargs 'no_repeat_ngram_size' is not supported: "
                                         r"vLLM's SamplingParams has no n-gram blocking; drop it or use "
                                         r"TransformersWrapper\.$"):
        vLLMWrapper(engine, generate_kwargs={"no_repeat_ngram_size": 3})
    with pytest.raises(ValueError, match=r"^generate_kwargs: 'logprobs' is not supported: "):
        vLLMWrapper(engine, generate_kwargs={"logprobs": 1})
    with pytest.raises(ValueError) as e:
        vLLMWrapper(engine, generate=False, temperature=0.7)
    assert str(e.value) == ("vLLMWrapper (log-prob version): temperature=0.7 is not supported: vLLM's prompt "
                            "log-probs are untempered log_softmax(z). Pass temperature=1.0, or score tempered "
                            "log-probs with TransformersWrapper(...).get_new_version(generate=False).")
    sampler = vLLMWrapper(engine, generate_kwargs={"temperature": 0.7})
    with pytest.raises(ValueError, match=r"^vLLMWrapper \(log-prob version\): temperature \(from "
                                         r"generate_kwargs\['temperature'\]\)=0\.7 is not supported"):
        sampler.get_new_version(generate=False)
    assert sampler.get_new_version(generate=False, temperature=1.0).temperature == 1.0
    with pytest.raises(TypeError, match=r"^vLLMWrapper: unexpected keyword arguments \['chunk_size'\]; the wrapper "
                                        r"settings besides the named ones are \['batching', "):
        vLLMWrapper(engine, chunk_size=64)
    with pytest.raises(ValueError, match=r"^num_samples=3 contradicts generate_kwargs num_return_sequences/n=2; "):
        vLLMWrapper(engine, num_samples=3, generate_kwargs={"n": 2})
    assert vLLMWrapper(engine, generate_kwargs={"n": 2, "temperature": 1.0}).num_samples == 2
    with pytest.raises(ValueError, match=r"^pad_model_input=True is not supported by vLLMWrapper"):
        vLLMWrapper(engine, generate=False, pad_model_input=True)
    with pytest.raises(ValueError, match=r"^vLLMWrapper: engine_kwargs \['dtype'\] only apply when the wrapper "):
        vLLMWrapper(engine, engine_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ValueError, match=r"^vLLMWrapper: model must be a vllm.LLM, a model name or a local folder; "
                                         r"got Linear \(an HF model goes in TransformersWrapper\)\.$"):
        vLLMWrapper(torch.nn.Linear(2, 2))
    monkeypatch.setattr(engine.llm_engine.model_config, "logprobs_mode", "raw_logprobs")
    with pytest.raises(ValueError, match=r"^vLLMWrapper: the engine runs with logprobs_mode='raw_logprobs'"):
        vLLMWrapper(engine)


def test_prompt_longer_than_the_engine_context_is_refused(engine):
    policy = vLLMWrapper(engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 16})
    with pytest.raises(ValueError, match=r"^vLLMWrapper: prompt row 0 has 1020 tokens; with max_new_tokens=16 it "
                                         r"exceeds the model's context of 1024"):
        policy(tokens_td([torch.full((1020,), 7)]))


def test_dists_and_logits_raise_naming_transformers_wrapper(engine):
    scorer_ = vLLMWrapper(engine, input_mode="tokens", generate=False)
    td = TensorDict(tokens={"full": torch.tensor([[5, 6, 7]])}, batch_size=[1])
    why = ("vLLM returns the log-probs of given ids, not logits or hidden states, so there is no masked distribution "
           "to build; the loss needs TransformersWrapper's log-prob version (TransformersWrapper(model, "
           "...).get_new_version(generate=False)).")
    calls = {"get_dist": lambda: scorer_.get_dist(td), "get_sft_dist": lambda: scorer_.get_sft_dist(td),
             "get_rlhf_dist": lambda: scorer_.get_rlhf_dist(td),
             "get_generic_dist": lambda: scorer_.get_generic_dist(td),
             "head_mask": lambda: scorer_.head_mask(td, "generic"),
             "forward(logits_only=True)": lambda: scorer_(td, logits_only=True)}
    for name, call in calls.items():
        with pytest.raises(NotImplementedError) as e:
            call()
        assert str(e.value) == f"vLLMWrapper.{name} is not supported: {why}"
