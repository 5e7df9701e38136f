""":func:`call_with_timeout` (defined in :mod:`lit_llm.imports`, shared with the reward functions): a call on a daemon
thread, waited for at most a timeout. Used by a tool's call (:class:`lit_llm.rollouts.envs.tools.Tool`) and an
environment's ``reset`` / ``step`` (:mod:`lit_llm.rollouts.episode_loop`); re-exported by
:mod:`lit_llm.rollouts.envs.base`."""

from __future__ import annotations

from lit_llm.imports import call_with_timeout

__all__ = ["call_with_timeout"]
