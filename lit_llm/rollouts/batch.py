"""``RolloutBatch``: one layout for GRPO rollouts, from generation to the loss.

A batch of ``N`` completions of ``P <= N`` distinct prompts, kept in the **prompt/completion layout** that the
log-prob version scores directly (:meth:`~lit_llm.policy.TransformersWrapper.get_dist` on these keys runs each
distinct prompt through the backbone once and the completions on top of its KV cache): nothing is re-sliced or
re-padded between the rollout engine and the loss, only cut into micro-batches (:meth:`RolloutBatch.micro_batches`).

Fields (``N`` rows, ``P`` distinct prompts; ids are the sampled ids, never re-tokenised text, DESIGN.md property 1):

=====================  ===============  ==============================================================================
field                  shape / dtype    meaning
=====================  ===============  ==============================================================================
``prompt_ids``         [P, Lp] long     distinct prompts, **left**-padded with the pad id
``prompt_mask``        [P, Lp] bool     True on real prompt tokens
``completion_ids``     [N, Lc] long     sampled completions, **right**-padded with the pad id (stop token included)
``completion_mask``    [N, Lc] bool     True on real completion tokens (never inferred from ids: pad == eos)
``loss_mask``          [N, Lc] bool     completion tokens that enter the loss (all of them for single-turn rollouts;
                                        for episodes the sampled ids only, never environment ids; truncation masking
                                        is the objective's, ``mask_truncated_completions``)
``prompt_index``       [N] long         row -> its prompt in ``prompt_ids``
``old_log_probs``      [N, Lc] float32  the GRPO ratio's denominator: generation-time ``log p(c_t | prompt, c_<t)``
                                        (0.0 at padding) as built; replaced by the trainer's no-grad recompute with
                                        ``old_log_probs: recompute`` (:meth:`RolloutBatch.with_old_log_probs`)
``rollout_log_probs``  [N, Lc] float32  generation-time log-probs, never replaced (the sampler's side of the
                                        mismatch metrics and of the rollout correction)
``reward``             [N] float32      weighted total reward
``advantage``          [N] float32      group-relative advantage (TorchRL's key name)
``truncated``          [N] bool         the completion hit ``max_new_tokens`` without a stop token
``group``              [N] long         the prompt group (index of the prompt in the prompt batch)
``policy_version``     [N] long         optimizer steps of the weights that sampled the row
``rewards``            TensorDict       each reward function's unweighted ``[N]`` float32 rewards (NaN = ``None``)
``sample_id``          list[str]        the prompt's sample id, per row
``completion``         list[str]        decoded completion (``skip_special_tokens=True``), per row
``generation_time``    float            seconds of generation (wall clock)
``reward_time``        float            seconds of reward functions and advantages
``frac_reward_zero_std`` float          fraction of groups whose rewards are all equal
``episodes``           list[dict]|None  per-row episode statistics of multi-turn rollouts
                                        (:class:`~lit_llm.rollouts.episodes.EpisodeEngine`; keys in
                                        :data:`~lit_llm.rollouts.episodes.EPISODE_STAT_KEYS`); ``None`` for
                                        single-turn rollouts
=====================  ===============  ==============================================================================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorClass, TensorDict
from torch import Tensor

from lit_llm.policy.generation import pad_rows, rows_to_device

__all__ = ["RolloutBatch", "host_lists", "host_rows"]

_CPU = torch.device("cpu")


def _pad(rows: Sequence[Tensor], value: int | float | bool, side: str, dtype: torch.dtype) -> Tensor:
    return pad_rows([r.to(dtype) for r in rows], value, side=side) if rows else torch.zeros(0, 0, dtype=dtype,
                                                                                            device=_CPU)


def host_rows(rows: Sequence[Tensor]) -> list[Tensor]:
    """``rows`` detached and on the host, the ones on a device copied in one transfer per dtype
    (:func:`~lit_llm.policy.generation.rows_to_device`) instead of one ``.cpu()`` per row (each a device-to-host
    sync on CUDA).

    Returns:
        ``len(rows)`` host tensors with the rows' shapes and dtypes (rows already on the host: detached, not copied).
    """
    return rows_to_device([r.detach() for r in rows], _CPU)


def host_lists(rows: Sequence[Tensor]) -> list[list]:
    """``rows`` (1-D, one dtype) as Python lists, read in one host copy and one ``tolist`` (ids to decode, to give
    reward functions, to compare)."""
    host = host_rows(rows)
    flat = torch.cat([r.reshape(-1) for r in host]).tolist() if host else []
    ends = [0]
    for r in host:
        ends.append(ends[-1] + r.numel())
    return [flat[a:b] for a, b in zip(ends, ends[1:])]


class RolloutBatch(TensorClass["nocast"]):
    """GRPO rollouts in the prompt/completion layout (see the module docstring for every field).

    Build one with :meth:`from_rows`; cut it with :meth:`micro_batches` / :meth:`select_rows`; hand
    :meth:`policy_inputs` to the log-prob version's ``get_dist``. ``batch_size`` is ``[]`` (prompts and completions
    have different leading sizes); :attr:`num_rows` is ``N``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    loss_mask: Tensor
    prompt_index: Tensor
    old_log_probs: Tensor
    rollout_log_probs: Tensor
    reward: Tensor
    advantage: Tensor
    truncated: Tensor
    group: Tensor
    policy_version: Tensor
    rewards: TensorDict
    sample_id: list
    completion: list
    generation_time: float = 0.0
    reward_time: float = 0.0
    frac_reward_zero_std: float = 0.0
    episodes: list | None = None

    # ------------------------------------------------------------------------------------------------ building
    @classmethod
    def from_rows(cls, *, prompts: Sequence[Tensor], prompt_index: Sequence[int] | Tensor,
                  completions: Sequence[Tensor], old_log_probs: Sequence[Tensor], reward: Tensor,
                  advantage: Tensor, truncated: Sequence[bool] | Tensor, group: Sequence[int] | Tensor,
                  policy_version: int, pad_token_id: int, rewards: dict[str, Tensor] | None = None,
                  sample_id: Sequence[str] | None = None, completion: Sequence[str] | None = None,
                  loss_masks: Sequence[Tensor] | None = None, generation_time: float = 0.0,
                  reward_time: float = 0.0, frac_reward_zero_std: float = 0.0,
                  episodes: Sequence[dict] | None = None) -> RolloutBatch:
        """Pad per-row tensors into a :class:`RolloutBatch` (on the CPU).

        Args:
            prompts: ``P`` distinct 1-D long prompt ids (non-empty).
            prompt_index: ``N`` indices into ``prompts``.
            completions: ``N`` 1-D long sampled ids (stop token included unless truncated).
            old_log_probs: ``N`` 1-D float generation-time log-probs, one per completion token.
            reward, advantage: ``[N]`` float.
            truncated: ``N`` bools. group: ``N`` group ids. policy_version: version of the sampling weights.
            pad_token_id: id written at padding (read from the masks only, never from ids).
            rewards: per-function ``[N]`` rewards. sample_id, completion: ``N`` strings each.
            loss_masks: ``N`` 1-D bool masks over each completion (default: every completion token).
            generation_time, reward_time, frac_reward_zero_std: statistics of the rollout.
            episodes: ``N`` dicts of per-episode statistics (multi-turn rollouts), or ``None``.

        Raises:
            ValueError: lengths that do not line up (the message names the argument), an empty prompt, a
                ``prompt_index`` outside ``[0, P)``, or log-probs / loss masks of another length than their row.
        """
        n = len(completions)
        index = torch.as_tensor(prompt_index, dtype=torch.long, device=_CPU).reshape(-1)
        named = {"prompt_index": len(index), "old_log_probs": len(old_log_probs), "truncated": len(truncated),
                 "group": len(group), "reward": int(torch.as_tensor(reward).numel()),
                 "advantage": int(torch.as_tensor(advantage).numel())}
        if sample_id is not None:
            named["sample_id"] = len(sample_id)
        if completion is not None:
            named["completion"] = len(completion)
        if loss_masks is not None:
            named["loss_masks"] = len(loss_masks)
        if episodes is not None:
            named["episodes"] = len(episodes)
        bad = {k: v for k, v in named.items() if v != n}
        if n == 0 or bad:
            raise ValueError(f"RolloutBatch.from_rows: every per-row argument needs one entry per completion "
                             f"({n} completions); got {bad or 'no completion'}.")
        if not prompts or any(int(p.numel()) == 0 for p in prompts):
            raise ValueError("RolloutBatch.from_rows: prompts must be non-empty 1-D id tensors.")
        if int(index.min()) < 0 or int(index.max()) >= len(prompts):
            raise ValueError(f"RolloutBatch.from_rows: prompt_index must lie in [0, {len(prompts)}).")
        for i, (c, lp) in enumerate(zip(completions, old_log_probs)):
            if lp.numel() != c.numel() or (loss_masks is not None and loss_masks[i].numel() != c.numel()):
                raise ValueError(f"RolloutBatch.from_rows: row {i}: old_log_probs / loss_masks must have one entry "
                                 f"per completion token ({c.numel()}).")
        # every per-row tensor to the host in one copy per dtype (rows sampled on a GPU: no sync per row)
        host = host_rows([*completions, *old_log_probs, *prompts, *(loss_masks or [])])
        cpu = [c.long().reshape(-1) for c in host[:n]]
        lens = [torch.ones(int(c.numel()), dtype=torch.bool, device=_CPU) for c in cpu]
        gen_lp = _pad([lp.float().reshape(-1) for lp in host[n:2 * n]], 0.0, "right", torch.float32)
        host_prompts = host[2 * n:2 * n + len(prompts)]
        return cls(
            prompt_ids=_pad([p.long().reshape(-1) for p in host_prompts], pad_token_id, "left", torch.long),
            prompt_mask=_pad([torch.ones(int(p.numel()), dtype=torch.bool, device=_CPU) for p in prompts], False,
                             "left", torch.bool),
            completion_ids=_pad(cpu, pad_token_id, "right", torch.long),
            completion_mask=_pad(lens, False, "right", torch.bool),
            loss_mask=_pad(lens if loss_masks is None else [m.bool() for m in host[2 * n + len(prompts):]], False,
                           "right", torch.bool),
            prompt_index=index,
            old_log_probs=gen_lp, rollout_log_probs=gen_lp.clone(),
            reward=torch.as_tensor(reward, dtype=torch.float32, device=_CPU).reshape(-1),
            advantage=torch.as_tensor(advantage, dtype=torch.float32, device=_CPU).reshape(-1),
            truncated=torch.as_tensor(list(truncated) if not isinstance(truncated, Tensor) else truncated,
                                      dtype=torch.bool, device=_CPU).reshape(-1),
            group=torch.as_tensor(group, dtype=torch.long, device=_CPU).reshape(-1),
            policy_version=torch.full((n,), int(policy_version), dtype=torch.long, device=_CPU),
            rewards=TensorDict({k: torch.as_tensor(v, dtype=torch.float32, device=_CPU).reshape(-1)
                                for k, v in (rewards or {}).items()}, batch_size=[]),
            sample_id=[str(s) for s in (sample_id if sample_id is not None else [""] * n)],
            completion=[str(s) for s in (completion if completion is not None else [""] * n)],
            generation_time=float(generation_time), reward_time=float(reward_time),
            frac_reward_zero_std=float(frac_reward_zero_std),
            episodes=None if episodes is None else [dict(e) for e in episodes], batch_size=[],
        )

    # ------------------------------------------------------------------------------------------------ views
    @property
    def num_rows(self) -> int:
        """``N``, the number of completions."""
        return int(self.completion_ids.shape[0])

    @property
    def prompt_lengths(self) -> Tensor:
        """``[N]`` long: real prompt tokens of each row."""
        return self.prompt_mask.sum(-1)[self.prompt_index]

    @property
    def completion_lengths(self) -> Tensor:
        """``[N]`` long: real completion tokens of each row (stop token included)."""
        return self.completion_mask.sum(-1)

    def policy_inputs(self) -> TensorDict:
        """The keys the log-prob version's ``get_dist`` reads for this layout (``prompt_ids``, ``prompt_mask``,
        ``completion_ids``, ``completion_mask``, ``prompt_index``, ``loss_mask``), as a ``TensorDict`` of the same
        tensors (no copy)."""
        return TensorDict({"prompt_ids": self.prompt_ids, "prompt_mask": self.prompt_mask,
                           "completion_ids": self.completion_ids, "completion_mask": self.completion_mask,
                           "prompt_index": self.prompt_index, "loss_mask": self.loss_mask}, batch_size=[])

    def full_rows(self) -> list[Tensor]:
        """``N`` 1-D long tensors ``prompt ⊕ completion`` (real tokens only): the sequences as the model saw them."""
        p_len, c_len = self.prompt_lengths.tolist(), self.completion_lengths.tolist()
        width = self.prompt_ids.shape[1]
        return [torch.cat([self.prompt_ids[j, width - p:], self.completion_ids[i, :c]])
                for i, (j, p, c) in enumerate(zip(self.prompt_index.tolist(), p_len, c_len))]

    def with_old_log_probs(self, old_log_probs: Tensor) -> RolloutBatch:
        """A copy whose ``old_log_probs`` are ``old_log_probs`` (``[N, Lc]`` float, e.g. the trainer's no-grad
        recompute; detached, cast to float32, zeroed where ``completion_mask`` is False); every other field shared.

        Raises:
            ValueError: ``old_log_probs`` not of shape ``[N, Lc]``.
        """
        if tuple(old_log_probs.shape) != tuple(self.completion_ids.shape):
            raise ValueError(f"RolloutBatch.with_old_log_probs: expected shape {tuple(self.completion_ids.shape)} "
                             f"([N, Lc] like completion_ids), got {tuple(old_log_probs.shape)}.")
        lp = old_log_probs.detach().float()
        new = self.copy()
        new.old_log_probs = torch.where(self.completion_mask, lp, torch.zeros_like(lp))
        return new

    # ------------------------------------------------------------------------------------------------ cutting
    def select_rows(self, rows: Sequence[int] | Tensor) -> RolloutBatch:
        """The sub-batch of ``rows`` (in that order), keeping only their prompts and trimming the padding.

        Raises:
            ValueError: no row, or a row outside ``[0, N)``.
        """
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_index.device).reshape(-1)
        if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= self.num_rows:
            raise ValueError(f"RolloutBatch.select_rows: rows must be a non-empty list of indices in "
                             f"[0, {self.num_rows}); got {idx.tolist()[:16]}.")
        used, new_index = torch.unique(self.prompt_index[idx], sorted=True, return_inverse=True)
        p_mask = self.prompt_mask[used]
        lp = int(p_mask.sum(-1).max())
        c_mask = self.completion_mask[idx]
        lc = max(int(c_mask.sum(-1).max()), 1)
        ids = idx.tolist()
        return type(self)(
            prompt_ids=self.prompt_ids[used][:, -lp:], prompt_mask=p_mask[:, -lp:],
            completion_ids=self.completion_ids[idx][:, :lc], completion_mask=c_mask[:, :lc],
            loss_mask=self.loss_mask[idx][:, :lc], prompt_index=new_index,
            old_log_probs=self.old_log_probs[idx][:, :lc], rollout_log_probs=self.rollout_log_probs[idx][:, :lc],
            reward=self.reward[idx], advantage=self.advantage[idx],
            truncated=self.truncated[idx], group=self.group[idx], policy_version=self.policy_version[idx],
            rewards=TensorDict({k: v[idx] for k, v in self.rewards.items()}, batch_size=[]),
            sample_id=[self.sample_id[i] for i in ids], completion=[self.completion[i] for i in ids],
            generation_time=self.generation_time, reward_time=self.reward_time,
            frac_reward_zero_std=self.frac_reward_zero_std,
            episodes=None if self.episodes is None else [self.episodes[i] for i in ids], batch_size=[],
        )

    @classmethod
    def cat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """The rows of ``batches`` one after the other, as one batch: prompts re-padded on the left, completions
        (and their masks, log-probs) on the right to the widest; ``prompt_index`` offset; ``group`` offset so that
        groups of different batches stay apart; ``generation_time`` / ``reward_time`` summed,
        ``frac_reward_zero_std`` the first batch's (the caller knows what it selected). Padding ids are the first
        batch's pad id where it has padding (masks decide what is real, never ids).

        Raises:
            ValueError: no batch, or batches with different reward functions or episode / single-turn mixed.
        """
        if not batches:
            raise ValueError("RolloutBatch.cat: needs at least one batch.")
        first = batches[0]
        names = list(first.rewards.keys())
        if any(list(b.rewards.keys()) != names or (b.episodes is None) != (first.episodes is None) for b in batches):
            raise ValueError("RolloutBatch.cat: every batch needs the same reward functions and the same kind of "
                             "rollout (single-turn or episodes).")
        pads = first.prompt_ids[~first.prompt_mask]
        pad = int(pads[0]) if pads.numel() else 0
        lp = max(int(b.prompt_ids.shape[1]) for b in batches)
        lc = max(int(b.completion_ids.shape[1]) for b in batches)

        def left(t: Tensor, value: int | bool) -> Tensor:
            return torch.nn.functional.pad(t, (lp - t.shape[1], 0), value=value)

        def right(t: Tensor, value: int | float | bool) -> Tensor:
            return torch.nn.functional.pad(t, (0, lc - t.shape[1]), value=value)

        p_off = torch.tensor([0, *[int(b.prompt_ids.shape[0]) for b in batches]], device=first.group.device).cumsum(0)
        g_off = torch.tensor([0, *[int(b.group.max()) + 1 for b in batches]], device=first.group.device).cumsum(0)
        return cls(
            prompt_ids=torch.cat([left(b.prompt_ids, pad) for b in batches]),
            prompt_mask=torch.cat([left(b.prompt_mask, False) for b in batches]),
            completion_ids=torch.cat([right(b.completion_ids, pad) for b in batches]),
            completion_mask=torch.cat([right(b.completion_mask, False) for b in batches]),
            loss_mask=torch.cat([right(b.loss_mask, False) for b in batches]),
            prompt_index=torch.cat([b.prompt_index + p_off[i] for i, b in enumerate(batches)]),
            old_log_probs=torch.cat([right(b.old_log_probs, 0.0) for b in batches]),
            rollout_log_probs=torch.cat([right(b.rollout_log_probs, 0.0) for b in batches]),
            reward=torch.cat([b.reward for b in batches]), advantage=torch.cat([b.advantage for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
            group=torch.cat([b.group + g_off[i] for i, b in enumerate(batches)]),
            policy_version=torch.cat([b.policy_version for b in batches]),
            rewards=TensorDict({k: torch.cat([b.rewards[k] for b in batches]) for k in names}, batch_size=[]),
            sample_id=[s for b in batches for s in b.sample_id], completion=[c for b in batches for c in b.completion],
            generation_time=sum(float(b.generation_time) for b in batches),
            reward_time=sum(float(b.reward_time) for b in batches), frac_reward_zero_std=first.frac_reward_zero_std,
            episodes=None if first.episodes is None else [e for b in batches for e in b.episodes], batch_size=[],
        )

    def micro_batches(self, size: int) -> list[RolloutBatch]:
        """Cut into micro-batches of at most ``size`` rows, in group order.

        Order: groups by their longest row (prompt + completion), longest first, then by group id; rows within a
        group by completion length, longest first; consecutive rows fill each micro-batch. With ``size`` a multiple
        of the group size every group stays in one micro-batch, which then holds few distinct prompts (each runs
        through the backbone once); otherwise a group may straddle two micro-batches (correct, its prompt just
        runs twice).

        Raises:
            ValueError: ``size < 1``.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"RolloutBatch.micro_batches: size must be an int >= 1, got {size!r}.")
        group, c_len = self.group, self.completion_lengths
        total = self.prompt_lengths + c_len
        n_groups = int(group.max()) + 1
        group_len = torch.zeros(n_groups, dtype=torch.long, device=group.device).scatter_reduce(0, group, total, "amax")
        width = int(c_len.max()) + 1
        key = (-group_len[group] * n_groups + group) * width - c_len  # longest group first, then id, then length
        order = torch.argsort(key, stable=True)
        return [self.select_rows(order[s:s + size]) for s in range(0, self.num_rows, size)]
