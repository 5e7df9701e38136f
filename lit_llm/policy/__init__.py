"""Policy layer: LLM wrappers (generate and log-prob versions), the token log-prob kernel, generation settings,
the threaded batcher; ``vLLMWrapper`` is the same policy on a vLLM engine (optional)."""

from lit_llm.policy.common import LLMWrapperBase
from lit_llm.policy.generation import GenerationConfig, resolve_generation_config, standardize_generate_kwargs
from lit_llm.policy.logprobs import (
    chunked_token_log_probs,
    completion_hidden_states,
    completion_log_probs,
    model_token_log_probs,
    naive_token_log_probs,
    token_hidden_states,
)
from lit_llm.policy.masked_dist import ChunkedLLMMaskedCategorical
from lit_llm.policy.transformers_wrapper import TransformersWrapper
from lit_llm.policy.vllm_wrapper import vLLMWrapper  # vLLM itself is imported on first use (make setup-vllm)

__all__ = [
    "ChunkedLLMMaskedCategorical",
    "GenerationConfig",
    "LLMWrapperBase",
    "TransformersWrapper",
    "chunked_token_log_probs",
    "completion_hidden_states",
    "completion_log_probs",
    "model_token_log_probs",
    "naive_token_log_probs",
    "resolve_generation_config",
    "standardize_generate_kwargs",
    "token_hidden_states",
    "vLLMWrapper",
]
