"""Policy layer: LLM wrappers (generate and log-prob versions), the token log-prob kernel, generation settings."""

from lit_llm.policy.common import LLMWrapperBase
from lit_llm.policy.generation import GenerationConfig, resolve_generation_config, standardize_generate_kwargs
from lit_llm.policy.transformers_wrapper import TransformersWrapper

__all__ = [
    "GenerationConfig",
    "LLMWrapperBase",
    "TransformersWrapper",
    "resolve_generation_config",
    "standardize_generate_kwargs",
]
