"""Real SmolLM2-135M-Instruct: generate-time log-probs equal the log-prob version's; the real <|im_end|> stops."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from lit_llm.data.containers import ChatHistory
from lit_llm.data.history import History
from lit_llm.policy import TransformersWrapper

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def test_real_model_generate_log_prob_agreement(real_model):
    model, tokenizer = real_model
    convs = [[{"role": "user", "content": "What is 2 + 3? Reply with just the number."}],
             [{"role": "system", "content": "You are concise."},
              {"role": "user", "content": "Name the capital of France in one word, please."}]]
    td = TensorDict(history=ChatHistory(prompt=History.from_chats(convs), batch_size=[2]), batch_size=[2])
    torch.manual_seed(0)
    pol = TransformersWrapper(model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 24, "temperature": 0.7})
    out = pol(td)
    scored = pol.get_new_version(generate=False)(out.copy())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for b in range(2):
        resp = out["tokens"][b].response
        torch.testing.assert_close(scored["log_probs"][b].response, out["log_probs"][b].response, atol=1e-4, rtol=0)
        assert torch.equal(scored["tokens"][b].full, out["tokens"][b].full)
        mask = scored["masks"][b].all_assistant_mask
        assert int(mask.sum()) == resp.numel() and bool(mask[-resp.numel():].all())
        if not out["truncated"][b]:
            assert int(resp[-1]) == eos  # the real end-of-turn token stops the row and stays in the response
            assert "<|im_end|>" not in out["history"][b].response.content[0]
    assert not bool(out["truncated"].all())  # SmolLM2 answers these within 24 tokens
