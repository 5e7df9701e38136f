"""``lm_head_matmul_dtype`` (issue 28): the training modules' LM-head matmul dtype in the log-prob kernel, handed to
the policy's log-prob versions (trained, reference) and their distributions."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from lit_llm.lightning.grpo import GRPOModule
from lit_llm.lightning.sft import SFTModule
from lit_llm.policy.kernel import chunked_token_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")


def reward(completions, **kwargs):
    return [0.0 for _ in completions]


@pytest.mark.parametrize(("option", "dtype"), [("float32", None), ("bfloat16", torch.bfloat16)])
def test_the_option_reaches_every_log_prob_version_and_its_distributions(option, dtype):
    sft = SFTModule("tiny", lm_head_matmul_dtype=option, kl_coef=0.1)
    grpo = GRPOModule("tiny", reward_funcs=[reward], num_generations=2, beta=0.1, lm_head_matmul_dtype=option)
    versions = [m.versions.log_prob_version for m in (sft, grpo)] + [m.versions.reference_version for m in (sft, grpo)]
    assert [v.matmul_dtype for v in versions] == [dtype] * 4
    ids = torch.randint(5, 2000, (2, 7), generator=torch.Generator().manual_seed(0))
    td = {"tokens": {"full": ids}, "masks": {"all_attention_mask": torch.ones_like(ids, dtype=torch.bool)}}
    dist = sft.policy().get_generic_dist(TensorDict(td, batch_size=[2]))
    assert dist.matmul_dtype == dtype
    with torch.no_grad():
        expected = chunked_token_log_probs(dist.hidden, dist.weight, dist.tokens.masked_fill(~dist.mask, -100),
                                           matmul_dtype=dtype)
        assert torch.equal(dist.log_prob(dist.tokens), expected)


def test_a_bad_value_is_one_line():
    with pytest.raises(ValueError, match=r"^model\.lm_head_matmul_dtype='float16': use float32 \(default\) or "
                                         r"bfloat16\.$"):
        SFTModule("tiny", lm_head_matmul_dtype="float16")
