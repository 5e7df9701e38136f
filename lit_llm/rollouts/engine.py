"""GRPO rollouts: prompts -> ``num_generations`` sampled completions -> rewards -> group advantages, as one
:class:`~lit_llm.rollouts.batch.RolloutBatch`.

:class:`RolloutEngine` drives the **generate** version of a policy (a :class:`~lit_llm.policy.TransformersWrapper` in
``"tokens"`` input mode, ``generate=True``, sampling settings in its ``generate_kwargs``). Every prompt of a batch is
one *group* of ``num_generations`` rows; with ``batching`` on (the default of :class:`~lit_llm.lightning.grpo.
GRPOModule`) one **rollout worker thread per group** (or ``num_workers`` threads sharing the groups) calls the
generate version, and the wrapper's threaded batcher serves all of them in shared forward passes. The completions are
decoded (without special tokens, as TRL), scored by the reward functions (:class:`lit_llm.rewards.RewardFunctions`,
TRL signature) and turned into advantages by :func:`lit_llm.objectives.compute_advantages` (``advantage_estimator``).
The sampled ids are kept exactly (DESIGN.md property 1) and the generation-time log-probs become the old log-probs of
the GRPO ratio (and, always, its ``rollout_log_probs``).

Reproducibility: with ``seed`` set, every row samples from its **own generator** seeded from
``(seed, step, rank, prompt index, generation index)`` (:func:`row_seeds`; the wrapper's ``"sampling_seed"`` input),
so a row's sample never depends on the global RNG or on which rows share its forward pass. With batching, the
batcher waits for all rows of the call (``min_batch_size`` = the call's rows) and orders them by worker
(``batch_order``), so the shared batch is the one a single call would build: rollouts are bit-reproducible with the
batcher on, also after a resume and under DDP (each rank has its own stream; rank 0's is the single-process one).
``seed=None`` samples from the global RNG.

The engine neither switches the model's mode nor owns its weights: :class:`~lit_llm.lightning.versions.
PolicyVersionSwitch` does (eval mode, no grad, in sync mode the trained weights; in async mode
:class:`~lit_llm.rollouts.producer.AsyncRollouts` holds a copy).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack
from torch import Tensor

from lit_llm.data.prompts import tokenize_prompts
from lit_llm.objectives.advantages import compute_advantages
from lit_llm.policy.batching import caller_context, in_context
from lit_llm.policy.rows import read_rows
from lit_llm.policy.sampling import splitmix64
from lit_llm.rewards import TrainerState
from lit_llm.rollouts.batch import RolloutBatch, host_lists, host_rows
from lit_llm.rollouts.settings import RolloutError, RolloutSettings

__all__ = ["RESERVED_KEYS", "RolloutEngine", "RolloutError", "distinct_prompts", "mix_seed", "policy_responses",
           "read_prompt_batch", "row_seeds"]

#: Prompt-batch keys the engine reads itself; every other key is a dataset column passed to the reward functions.
RESERVED_KEYS = frozenset({"prompt", "prompt_ids", "sample_id"})

#: Seconds the batcher waits for every row of a rollout call before running what it has (a safety net only: the
#: workers submit within milliseconds; running early would still be correct, only not bit-reproducible).
ROLLOUT_BATCHING_TIMEOUT = 300.0

RewardCallable = Callable[..., tuple[Tensor, dict[str, Tensor]]]


def mix_seed(seed: int, step: int, rank: int = 0) -> int:
    """Seed of ``(seed, step, rank)``; rank 0 keeps the single-process value, other ranks are offset by a large odd
    constant (golden-ratio hash)."""
    return (int(seed) * 1_000_003 + int(step) * 7919 + int(rank) * 0x9E3779B97F4A7C15) % (2**63 - 1)


def row_seeds(seed: int, step: int, rank: int, num_prompts: int, num_generations: int,
              sampling_round: int = 0) -> Tensor:
    """Per-row sampling seeds of one rollout: row ``k * G + g`` (prompt ``k``, generation ``g``) gets
    ``splitmix64(base ⊕ hash(k, g)) mod 2**63`` with ``base = mix_seed(seed, step, rank)`` in round 0 and
    ``splitmix64(base ⊕ splitmix64(2**40 + sampling_round))`` in the later rounds of dynamic sampling (extra prompt
    batches of the same step: their own streams, round 0 unchanged).

    Returns:
        ``[num_prompts * num_generations]`` int64 tensor of seeds in ``[0, 2**63)``.
    """
    base = mix_seed(seed, step, rank)
    if sampling_round:
        base = splitmix64(base ^ splitmix64((1 << 40) + int(sampling_round)))
    out = [splitmix64(base ^ splitmix64((k << 20) + g)) & ((1 << 63) - 1)
           for k in range(num_prompts) for g in range(num_generations)]
    return torch.tensor(out, dtype=torch.long, device="cpu")


def _columns(batch: Mapping[str, Any], num_prompts: int) -> dict[str, list]:
    cols = {}
    for k, v in batch.items():
        if k in RESERVED_KEYS:
            continue
        if isinstance(v, Tensor):
            v = v.tolist()
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or len(v) != num_prompts:
            raise RolloutError(f"prompt batch column {k!r} must be a list with one entry per prompt ({num_prompts}), "
                               f"got {v!r:.120}. Fix the prompt datamodule's collate.")
        cols[k] = list(v)
    return cols


def read_prompt_batch(batch: Mapping[str, Any]) -> tuple[list, list[str], dict[str, list]]:
    """The prompts, sample ids and dataset columns of a prompt batch (see :meth:`RolloutEngine.rollout`).

    Returns:
        ``(prompts, sample_ids, columns)``: ``P`` prompts (strings or message lists), ``P`` sample ids (default
        ``"prompt:<i>"``) and every other non-reserved key as a list of ``P`` entries.

    Raises:
        RolloutError: no ``"prompt"``, an empty batch, a column that is not a list of ``P`` entries.
    """
    if "prompt" not in batch:
        raise RolloutError(f"prompt batch has no 'prompt' key (keys: {sorted(batch)}); the prompt datamodule must "
                           f"provide the prompts (strings or message lists) under 'prompt'.")
    prompts = list(batch["prompt"])
    if not prompts:
        raise RolloutError("prompt batch is empty; give at least one prompt.")
    sample_ids = [str(s) for s in batch.get("sample_id", [f"prompt:{i}" for i in range(len(prompts))])]
    return prompts, sample_ids, _columns(batch, len(prompts))


def distinct_prompts(prompts: Sequence[Tensor]) -> tuple[list[Tensor], list[int]]:
    """Identical prompt ids share one row of ``prompt_ids``: ``(unique prompts in first-seen order, index of each
    prompt's row)``."""
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(p), len(distinct)) for p in host_lists(prompts)]
    unique: list[Tensor] = [torch.empty(0, dtype=torch.long, device="cpu")] * len(distinct)
    for p, j in zip(prompts, index):
        unique[j] = p
    return unique, index


def policy_responses(policy: Any, prompts: list[Tensor], *, seeds: Tensor | None = None,
                     batch_order: int | None = None) -> tuple[list[Tensor], list[Tensor], list[bool]]:
    """Call a tokens-mode generate version on ``prompts`` and read its per-sample outputs.

    Args:
        policy: a :class:`~lit_llm.policy.TransformersWrapper` with ``input_mode="tokens"``, ``generate=True``;
            with ``num_samples = n`` every prompt gets ``n`` samples (its prompt prefilled once).
        prompts: ``N`` 1-D long id tensors (unpadded).
        seeds: optional int64 sampling seeds (the wrapper's ``"sampling_seed"`` input): ``[N]`` one base per prompt,
            or with ``num_samples`` ``[N, n]`` one per sample.
        batch_order: the caller's place in a shared batch of the threaded batcher (rollout workers).

    Returns:
        ``(response_ids, response_log_probs, truncated)``: ``N * n`` 1-D long tensors, ``N * n`` 1-D float32
        tensors and ``N * n`` bools, prompt-major (``n = 1`` without ``num_samples``).

    Raises:
        RolloutError: the policy wrote no ``tokens.response`` / ``log_probs.response``.
    """
    rows = []
    for i, p in enumerate(prompts):
        row = TensorDict({("tokens", "prompt"): p}, batch_size=[])
        if seeds is not None:
            row["sampling_seed"] = seeds[i]
        rows.append(row)
    td = lazy_stack(rows)
    out = policy(td) if batch_order is None else policy(td, batch_order=batch_order)
    if out.batch_dims == 2:  # num_samples: [N, n] -> N * n rows, prompt-major
        out = lazy_stack([out[i, k] for i in range(out.batch_size[0]) for k in range(out.batch_size[1])])
    resp = read_rows(out, ("tokens", "response"))
    lps = read_rows(out, ("log_probs", "response"))
    if resp is None or lps is None:
        raise RolloutError("the policy wrote no tokens.response / log_probs.response; use the generate version "
                           "with return_log_probs=True.")
    return resp, lps, [bool(t) for t in out.get("truncated").reshape(-1).tolist()]


def resolve_settings(settings: RolloutSettings | None, options: Mapping[str, Any]) -> RolloutSettings:
    """``settings``, or a :class:`RolloutSettings` of the keyword ``options`` (its fields).

    Raises:
        RolloutError: both given; an unknown option; an invalid setting.
    """
    if settings is not None:
        if options:
            raise RolloutError(f"give either settings or its fields as options, not both (options: {sorted(options)}).")
        return settings
    try:
        return RolloutSettings(**options)
    except TypeError as e:
        raise RolloutError(f"{e}; the options are RolloutSettings' fields.") from e


class RolloutEngine:
    """Sample ``num_generations`` completions per prompt with a generate-version policy, reward them, build advantages.

    Args:
        policy: the generate version: a :class:`~lit_llm.policy.TransformersWrapper` with ``input_mode="tokens"``,
            ``generate=True`` and ``return_log_probs`` on; its ``generate_kwargs`` hold the sampling settings.
        tokenizer: the policy's tokenizer (prompt rendering and completion decoding).
        reward_fn: ``fn(prompts, completions, completion_ids, trainer_state, **columns) -> (total [N],
            {name: [N]})``, e.g. :class:`lit_llm.rewards.RewardFunctions`.
        settings: the :class:`~lit_llm.rollouts.settings.RolloutSettings` (group size ``num_generations``,
            ``scale_rewards``, ``advantage_estimator``, ``seed``, chat template of prompts without ``prompt_ids``,
            ``batching``, ``num_workers``), taken whole; or give its fields as keyword ``options`` instead.
        version: initial policy version (optimizer steps of the weights the policy holds).
        rank: the process rank under DDP, mixed into the seeds (the version switch sets it).
        trainer_state_fn: returns the :class:`~lit_llm.rewards.TrainerState` the reward functions receive (the
            trainer's progress when a rollout starts; set by :class:`~lit_llm.lightning.versions.
            PolicyVersionSwitch`). ``None``: ``TrainerState(global_step=step)`` of :meth:`rollout`'s ``step``.
        **options: :class:`RolloutSettings` fields, when ``settings`` is not given.

    With ``batching`` the generate version is served through the threaded batcher (a version of ``policy`` with
    ``min_batch_size`` = the rows of the call, built once per row count); otherwise one direct call.

    Raises:
        RolloutError: an invalid setting (:class:`RolloutSettings`), both ``settings`` and ``options``, a policy
            that is not a tokens-mode generate version with log-probs.
    """

    def __init__(self, policy: Any, *, tokenizer: Any, reward_fn: RewardCallable | None,
                 settings: RolloutSettings | None = None, version: int = 0, rank: int = 0,
                 trainer_state_fn: Callable[[], TrainerState] | None = None, **options: Any) -> None:
        self.settings = resolve_settings(settings, options)
        if not getattr(policy, "generate", False) or getattr(policy, "input_mode", None) != "tokens" \
                or not getattr(policy, "return_log_probs", True):
            raise RolloutError("RolloutEngine needs the generate version of the policy in tokens mode with log-probs: "
                               "policy.get_new_version(generate=True, input_mode='tokens', return_log_probs=True).")
        self.policy, self.tokenizer, self.reward_fn = policy, tokenizer, reward_fn
        # the prompts of a rollout go to the generate version once each, with the group size: each prompt is
        # prefilled once for its num_generations samples (nothing re-discovers the groups from the ids)
        self.group_policy = policy.get_new_version(num_samples=self.settings.num_generations)
        self.version, self.rank = version, int(rank)
        self.trainer_state_fn = trainer_state_fn
        self.pad_token_id = int(policy.generation_config.pad_token_id)
        self.max_new_tokens = int(policy.generation_config.max_new_tokens)
        self._batched: dict[tuple, Any] = {}  # (rows, timeout, max rows, group size) -> batching version
        self._lock = threading.Lock()
        self.num_policy_calls = 0  # calls of the generate version (one per worker and rollout)

    # the settings the rollout reads, by their own names
    num_generations = property(lambda self: self.settings.num_generations, doc="Completions per prompt ``G``.")
    scale_rewards = property(lambda self: self.settings.scale_rewards, doc="The advantages' divisor.")
    advantage_estimator = property(lambda self: self.settings.advantage_estimator, doc="The advantages' baseline.")
    seed = property(lambda self: self.settings.seed, doc="Base sampling seed (``None``: the global RNG).")
    chat_template = property(lambda self: self.settings.chat_template, doc="Template of prompts without ids.")
    chat_template_kwargs = property(lambda self: self.settings.chat_template_kwargs, doc="Its variables.")
    batching = property(lambda self: self.settings.batching, doc="Workers served by the threaded batcher.")
    num_workers = property(lambda self: self.settings.num_workers, doc="Rollout worker threads (``None``: one/group).")

    def twin_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that build a twin of this engine (same class) over another generate version: the
        tokenizer, reward functions, settings (whole), rank and ``trainer_state_fn`` (the asynchronous producer's copy
        of the weights, the greedy evaluation)."""
        return {"tokenizer": self.tokenizer, "reward_fn": self.reward_fn, "settings": self.settings,
                "rank": self.rank, "trainer_state_fn": self.trainer_state_fn}

    @property
    def model(self) -> torch.nn.Module:
        """The model the policy samples from."""
        return self.policy.model

    def sampling_seed(self, step: int) -> int | None:
        """The base seed of ``step`` on this :attr:`rank` (``None`` without ``seed``); rows mix in their prompt and
        generation index (:func:`row_seeds`)."""
        return None if self.seed is None else mix_seed(self.seed, step, self.rank)

    def batched_policy(self, rows: int, *, timeout: float = ROLLOUT_BATCHING_TIMEOUT,
                       max_batch_size: int | None = None, group_size: int | None = None) -> Any:
        """The version of :attr:`policy` whose batcher runs once ``rows`` rows are queued, or once the oldest queued
        row has waited ``timeout`` seconds, at most ``max_batch_size`` rows per forward, with ``group_size`` samples
        per row (TorchRL's ``num_samples``; ``None``: one) (built once per setting).

        Rows are the callers' rows before ``num_samples``: :meth:`generate` queues each prompt once with
        ``group_size = num_generations``; episodes queue one row per turn."""
        key = (rows, float(timeout), max_batch_size, group_size)
        with self._lock:
            version = self._batched.get(key)
            if version is None:
                version = self.policy.get_new_version(batching=True, min_batch_size=rows, num_samples=group_size,
                                                      max_batch_size=max_batch_size, batching_timeout=timeout)
                self._batched[key] = version
            return version

    # -------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[Tensor], seeds: Tensor | None = None) -> tuple[list[Tensor], list[Tensor],
                                                                                  list[bool]]:
        """Sample ``num_generations`` responses per prompt: the generate version gets each prompt once with the group
        size (:attr:`group_policy`; each prompt prefilled once for its group). Rows ``[k*G, (k+1)*G)`` of the result
        are prompt ``k``'s.

        With :attr:`batching`, the prompts are shared among the worker threads (contiguous, in order) and each worker
        calls the batching version with its place as ``batch_order``; otherwise one direct call.

        Args:
            prompts: ``P`` 1-D long id tensors, one per group.
            seeds: optional ``[P * G]`` int64 per-sample seeds (prompt-major).

        Returns:
            ``(response_ids, response_log_probs, truncated)``: ``P * G`` 1-D long tensors (ending with the stop token
            unless truncated), ``P * G`` 1-D float32 tensors (``log_softmax(z / T)`` of each sampled id) and
            ``P * G`` bools.
        """
        g = self.num_generations
        grouped = None if seeds is None else seeds.reshape(len(prompts), g)
        n_prompts = len(prompts)
        k = min(self.num_workers or n_prompts, n_prompts)
        if not self.batching:
            self.num_policy_calls += 1
            return policy_responses(self.group_policy, prompts, seeds=grouped)
        policy = self.batched_policy(n_prompts, group_size=g)
        bounds = [round(i * n_prompts / k) for i in range(k)] + [n_prompts]
        device_type = policy.device.type
        context = caller_context(device_type)  # grad mode and autocast are thread-local: the workers take ours

        def work(i: int) -> tuple[list[Tensor], list[Tensor], list[bool]]:
            a, b = bounds[i], bounds[i + 1]
            with self._lock:
                self.num_policy_calls += 1
            with in_context(context, device_type):
                return policy_responses(policy, prompts[a:b], seeds=None if grouped is None else grouped[a:b],
                                        batch_order=i)

        with ThreadPoolExecutor(max_workers=k, thread_name_prefix="lit_llm-rollout-worker") as pool:
            results = list(pool.map(work, range(k)))
        return ([r for res in results for r in res[0]], [r for res in results for r in res[1]],
                [r for res in results for r in res[2]])

    # ---------------------------------------------------------------------------------------------- rollouts
    def rollout(self, batch: Mapping[str, Any], *, step: int = 0, version: int | None = None,
                trainer_state: TrainerState | None = None, sampling_round: int = 0) -> RolloutBatch:
        """Build the :class:`RolloutBatch` of ``P`` prompts (``N = P * num_generations`` rows).

        Args:
            batch: the prompt batch: ``"prompt"`` (``P`` strings or message lists, required: the reward functions
                receive it), optional ``"prompt_ids"`` (``P`` 1-D long tensors: the rendered prompts, else rendered
                here), optional ``"sample_id"`` (``P`` strings) and any dataset columns (lists of ``P`` entries,
                e.g. ``"answer"``), repeated per generation for the reward functions.
            step: the training step (mixed into the per-row seeds).
            version: version of the weights (default :attr:`version`), written to ``policy_version``.
            trainer_state: passed to the reward functions as ``trainer_state`` (TRL); default:
                :attr:`trainer_state_fn`'s, else ``TrainerState(global_step=step)``.
            sampling_round: dynamic sampling's round of this step (0 = the step's own prompt batch; extra batches
                get their own seeds, :func:`row_seeds`).

        Raises:
            RolloutError: no ``"prompt"``, an empty batch, a column or ``prompt_ids`` of the wrong length, a prompt
                that renders to nothing.
            lit_llm.rewards.RewardError: a reward function raised or returned NaN / the wrong length (names it).
        """
        prompts, sample_ids, columns = read_prompt_batch(batch)
        n_prompts, g = len(prompts), self.num_generations
        ids = batch.get("prompt_ids")
        if ids is None:
            try:
                ids = tokenize_prompts(prompts, self.tokenizer, chat_template=self.chat_template,
                                       chat_template_kwargs=self.chat_template_kwargs)
            except ValueError as e:
                raise RolloutError(str(e)) from e
        # the prompt ids on the host (Lightning may have moved the batch to the GPU): one copy, not one per row
        ids = [p.reshape(-1).long() for p in host_rows([p if isinstance(p, Tensor) else
                                                         torch.as_tensor(p, dtype=torch.long, device="cpu")
                                                         for p in ids])]
        if len(ids) != n_prompts:
            raise RolloutError(f"prompt batch has {len(ids)} 'prompt_ids' for {n_prompts} prompts; give one each.")
        if trainer_state is None:  # taken before generating: the progress the rollout was generated at
            trainer_state = self.current_trainer_state(step)
        seeds = None if self.seed is None else row_seeds(self.seed, step, self.rank, n_prompts, g, sampling_round)

        t0 = time.perf_counter()
        resp, resp_lp, truncated = self.generate(ids, seeds)
        gen_time = time.perf_counter() - t0

        t1 = time.perf_counter()
        resp, resp_lp = host_rows(resp), host_rows(resp_lp)  # one device-to-host copy each, not one per row
        resp_lists = host_lists(resp)
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in resp_lists]
        chat = [not isinstance(p, str) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if chat[i // g] else t for i, t in enumerate(texts)]
        rep_prompts = [p for p in prompts for _ in range(g)]
        rep_columns = {k: [v for v in col for _ in range(g)] for k, col in columns.items()}
        total, per_fn = self.reward_fn(prompts=rep_prompts, completions=completions,
                                       completion_ids=resp_lists, trainer_state=trainer_state,
                                       **rep_columns)
        total = torch.as_tensor(total, dtype=torch.float32, device="cpu").reshape(-1)
        advantages, stats = compute_advantages(total, g, scale_rewards=self.scale_rewards,
                                               advantage_estimator=self.advantage_estimator)
        reward_time = time.perf_counter() - t1

        unique, prompt_of_group = distinct_prompts(ids)
        return RolloutBatch.from_rows(
            prompts=unique, prompt_index=[j for j in prompt_of_group for _ in range(g)], completions=resp,
            old_log_probs=resp_lp, reward=total, advantage=advantages, truncated=truncated,
            group=torch.arange(n_prompts, device="cpu").repeat_interleave(g),
            policy_version=self.version if version is None else version, pad_token_id=self.pad_token_id,
            rewards=dict(per_fn.items()), sample_id=[s for s in sample_ids for _ in range(g)], completion=texts,
            generation_time=gen_time, reward_time=reward_time,
            frac_reward_zero_std=float(stats["frac_reward_zero_std"]))

    def current_trainer_state(self, step: int) -> TrainerState:
        """The :class:`~lit_llm.rewards.TrainerState` a rollout of ``step`` passes to the reward functions when the
        caller gives none: :attr:`trainer_state_fn`'s, else ``TrainerState(global_step=step)``."""
        return self.trainer_state_fn() if self.trainer_state_fn is not None else TrainerState(global_step=int(step))

    # ----------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor], version: int, *, strict: bool = True) -> None:
        """Copy ``state_dict`` into the sampling model and set :attr:`version` (the asynchronous mode).

        Args:
            state_dict: the weights (every key of the model's state dict, or with ``strict=False`` a subset, e.g. the
                LoRA adapter weights over a frozen base the sampling model already holds).
            version: their version (optimizer steps).
            strict: every key of the model required.

        Raises:
            RuntimeError: the state dict does not match the model (missing keys when ``strict``, unexpected keys,
                shapes).
        """
        result = self.model.load_state_dict(state_dict, strict=strict)
        if result.unexpected_keys:
            raise RuntimeError(f"RolloutEngine.load_weights: the sampling model has no {result.unexpected_keys[:5]}.")
        self.version = int(version)
