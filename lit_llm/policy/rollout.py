"""GRPO rollouts: prompts -> ``num_generations`` sampled completions -> rewards -> group advantages, as one TensorDict.

:class:`RolloutEngine` drives the **generate** version of a policy (a :class:`~lit_llm.policy.TransformersWrapper` in
``"tokens"`` input mode, ``generate=True``, sampling settings in its ``generate_kwargs``): every prompt of a batch is
repeated ``num_generations`` times (rows ``[k*G, (k+1)*G)`` are prompt ``k``'s group), completed, decoded (without
special tokens, as TRL) and scored by the reward functions (:class:`lit_llm.rewards.RewardFunctions`, TRL signature);
advantages come from :func:`lit_llm.objectives.compute_advantages`. The sampled ids are kept exactly: ``tokens.full``
is ``prompt ⊕ response`` as generated, never re-tokenised text (DESIGN.md property 1), and the generation-time
log-probs become the old log-probs of the GRPO ratio (so staleness is importance-corrected).

Two modes:

* **synchronous** (:meth:`RolloutEngine.rollout` on the trained model itself): with ``seed`` set, the sampling RNG is
  reseeded from ``(seed, step, rank)`` for every call inside ``torch.random.fork_rng`` (the caller's RNG stream is left
  untouched), so the rollouts of step ``s`` are a function of the weights, the prompts, ``seed``, ``s`` and the DDP
  rank only (every rank samples from its own stream): bit-reproducible, also after a checkpoint resume.
  Bit-reproducibility requires ``num_workers=1``.
* **asynchronous** (:class:`AsyncRollouts`): a background thread produces the next rollout batches from a separately
  held copy of the weights (an engine over ``copy.deepcopy(model)``), refreshed by :meth:`AsyncRollouts.sync_weights`
  (called every ``sync_every`` optimizer steps by a callback). A rollout generated with weights of version ``v`` and
  consumed when the trained policy is at version ``s`` has staleness ``s - v``; rollouts staler than ``max_staleness``
  are dropped and counted. Reproducible only up to thread timing (which weights a batch is generated with depends on
  when the sync lands); the sampling RNG is the process's global one (never reseeded from the background thread).

Rollout layout (:data:`ROLLOUT_KEYS`), a dense ``TensorDict`` with ``batch_size=[N]``, ``N = P * G``, sequences
**left**-padded like the padded :class:`~lit_llm.data.containers.Tokens` (padding read from the attention mask only:
SmolLM2's pad id is its end-of-turn id):

==============================  ==============  ========================================================================
key                             shape / dtype   meaning
==============================  ==============  ========================================================================
``("tokens", "full")``          [N, T] long     prompt ⊕ response ids as sampled, left-padded with the pad id
``("masks", "all_attention_mask")`` [N, T] bool True on real tokens
``("masks", "completion_mask")``  [N, T] bool   True on response tokens (stop token included)
``("log_probs", "full")``       [N, T] float32  generation-time ``log p(x_t | x_<t)`` at response positions, 0 elsewhere
``"advantage"``                 [N] float32     group-relative advantage (TorchRL's key name)
``"reward"``                    [N] float32     weighted total reward
``("rewards", <name>)``         [N] float32     each function's unweighted reward, NaN where it returned ``None``
``"truncated"``                 [N] bool        the completion hit ``max_new_tokens`` without a stop token
``"prompt_length"``             [N] long        prompt tokens
``"completion_length"``         [N] long        response tokens (stop token included)
``"group"``                     [N] long        index of the prompt in the batch
``"policy_version"``            [N] long        version (optimizer steps) of the weights that sampled the row
``"sample_id"``                 N str           the prompt's sample id
``"completion"``                N str           decoded response (``skip_special_tokens=True``)
==============================  ==============  ========================================================================

and non-tensor entries ``"generation_time"`` (s, wall clock of generation only), ``"reward_time"`` (s),
``"frac_reward_zero_std"``, ``"reward_group_std_mean"``.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import torch
from tensordict import NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from torch import Tensor

from lit_llm.objectives.grpo import compute_advantages
from lit_llm.policy.common import read_rows
from lit_llm.policy.generation import pad_rows

__all__ = [
    "ROLLOUT_KEYS",
    "AsyncRollouts",
    "RolloutEngine",
    "RolloutError",
    "policy_responses",
    "tokenize_prompts",
]

#: Prompt-batch keys the engine reads itself; every other key is a dataset column passed to the reward functions.
RESERVED_KEYS = frozenset({"prompt", "prompt_ids", "sample_id"})

#: Tensor keys of a rollout batch (see the module docstring).
ROLLOUT_KEYS = (
    ("tokens", "full"), ("masks", "all_attention_mask"), ("masks", "completion_mask"), ("log_probs", "full"),
    "advantage", "reward", "truncated", "prompt_length", "completion_length", "group", "policy_version",
)

RewardCallable = Callable[..., tuple[Tensor, dict[str, Tensor]]]


class RolloutError(ValueError):
    """A prompt batch or a rollout setting is unusable; the message names the key and the fix."""


def tokenize_prompts(prompts: Sequence[str | Sequence[Mapping[str, Any]]], tokenizer: Any, *,
                     chat_template: str | None = None) -> list[Tensor]:
    """Token ids the model continues for each prompt.

    Chat prompts (message lists) are rendered with ``add_generation_prompt=True`` through
    :meth:`lit_llm.data.history.History.apply_chat_template` (special-token strings in the content are refused,
    DESIGN.md property 8); text prompts are tokenised as they are (``add_special_tokens=False``).

    Args:
        prompts: ``P`` prompts, each a string or a list of ``{"role", "content"}`` messages.
        tokenizer: a Hugging Face tokenizer.
        chat_template: Jinja string or ``.jinja`` path (``None`` = the tokenizer's own).

    Returns:
        ``P`` 1-D ``torch.long`` tensors.

    Raises:
        RolloutError: a prompt that is neither a string nor a message list, or renders to no token.
    """
    from lit_llm.data.history import History

    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = torch.as_tensor(tokenizer(p, add_special_tokens=False)["input_ids"], dtype=torch.long)
        elif isinstance(p, Sequence) and p and all(isinstance(m, Mapping) for m in p):
            ids = History.from_chats([dict(m) for m in p]).apply_chat_template(
                tokenizer, chat_template=chat_template, add_generation_prompt=True, return_dict=False).long()
        else:
            raise RolloutError(f"prompt {i}: expected a string or a non-empty list of {{'role', 'content'}} messages, "
                               f"got {p!r:.120}. Fix the 'prompt' column of the prompt batch.")
        if ids.numel() == 0:
            raise RolloutError(f"prompt {i} renders to no token; give it some content.")
        out.append(ids.reshape(-1))
    return out


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


def policy_responses(policy: Any, prompts: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[bool]]:
    """Call a tokens-mode generate version on ``prompts`` and read its per-row outputs.

    Args:
        policy: a :class:`~lit_llm.policy.TransformersWrapper` with ``input_mode="tokens"``, ``generate=True``.
        prompts: ``N`` 1-D long id tensors (unpadded).

    Returns:
        ``(response_ids, response_log_probs, truncated)``: ``N`` 1-D long tensors, ``N`` 1-D float32 tensors and
        ``N`` bools.

    Raises:
        RolloutError: the policy wrote no ``tokens.response`` / ``log_probs.response``.
    """
    td = lazy_stack([TensorDict({("tokens", "prompt"): p}, batch_size=[]) for p in prompts])
    out = policy(td)
    resp = read_rows(out, ("tokens", "response"))
    lps = read_rows(out, ("log_probs", "response"))
    if resp is None or lps is None:
        raise RolloutError("the policy wrote no tokens.response / log_probs.response; use the generate version "
                           "with return_log_probs=True.")
    return resp, lps, [bool(t) for t in out.get("truncated").reshape(-1).tolist()]


class RolloutEngine:
    """Sample ``num_generations`` completions per prompt with a generate-version policy, reward them, build advantages.

    Args:
        policy: the generate version: a :class:`~lit_llm.policy.TransformersWrapper` with ``input_mode="tokens"``,
            ``generate=True`` and ``return_log_probs`` on; its ``generate_kwargs`` hold the sampling settings
            (``temperature``, ``max_new_tokens``, ``top_p``, ...). With ``batching=True`` on the wrapper, the
            ``num_workers`` calls of one rollout are served in shared forward passes by the threaded batcher.
        tokenizer: the policy's tokenizer (prompt rendering and completion decoding).
        reward_fn: ``fn(prompts, completions, completion_ids, **columns) -> (total [N], {name: [N]})``, e.g.
            :class:`lit_llm.rewards.RewardFunctions`.
        num_generations: completions per prompt ``G`` (>= 2: a group needs a std).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (see :func:`~lit_llm.objectives.compute_advantages`).
        seed: sampling seed of the synchronous mode (``None``: use the global RNG as it is, e.g. from a thread).
        chat_template: template for chat prompts without ``prompt_ids``.
        num_workers: threads that call the policy concurrently, each on a contiguous share of the ``N`` rows
            (1 = one call; > 1 is useful with the wrapper's batcher and is not bit-reproducible).
        version: initial policy version (optimizer steps of the weights the policy holds).
        rank: the process rank under data parallelism (DDP); mixed into the sampling seed so that the ranks draw
            from different streams (rank 0's stream is the single-process one). :class:`GRPOModule` sets it to
            ``trainer.global_rank``.

    Raises:
        RolloutError: ``num_generations < 2``, ``num_workers < 1``, a policy that is not a tokens-mode generate
            version with log-probs.
    """

    def __init__(self, policy: Any, *, tokenizer: Any, reward_fn: RewardCallable, num_generations: int,
                 scale_rewards: Literal["group", "batch", "none"] = "group", seed: int | None = 0,
                 chat_template: str | None = None, num_workers: int = 1, version: int = 0, rank: int = 0) -> None:
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
            raise RolloutError(f"num_generations must be an int >= 2 (GRPO compares completions within a group), got "
                               f"{num_generations!r}; set num_generations to 2 or more.")
        if num_workers < 1:
            raise RolloutError(f"num_workers must be >= 1, got {num_workers}.")
        if not getattr(policy, "generate", False) or getattr(policy, "input_mode", None) != "tokens" \
                or not getattr(policy, "return_log_probs", True):
            raise RolloutError("RolloutEngine needs the generate version of the policy in tokens mode with log-probs: "
                               "policy.get_new_version(generate=True, input_mode='tokens', return_log_probs=True).")
        self.policy, self.tokenizer, self.reward_fn = policy, tokenizer, reward_fn
        self.num_generations, self.scale_rewards, self.seed = num_generations, scale_rewards, seed
        self.chat_template, self.num_workers, self.version = chat_template, num_workers, version
        self.rank = int(rank)
        self.pad_token_id = int(policy.generation_config.pad_token_id)
        self.max_new_tokens = int(policy.generation_config.max_new_tokens)

    def sampling_seed(self, step: int) -> int | None:
        """The seed of the synchronous sampling stream at ``step`` on this :attr:`rank` (``None`` without ``seed``).

        A function of ``(seed, step, rank)`` only: runs (and resumed runs) are reproducible, and under DDP every rank
        samples from its own stream.
        """
        return None if self.seed is None else _mix_seed(self.seed, step, self.rank)

    @property
    def model(self) -> torch.nn.Module:
        """The model the policy samples from."""
        return self.policy.model

    # -------------------------------------------------------------------------------------------- generation
    def _call_policy(self, prompts: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[bool]]:
        return policy_responses(self.policy, prompts)

    def generate(self, prompts: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[bool]]:
        """Sample one response per row of ``prompts`` (already repeated per generation).

        Args:
            prompts: ``N`` 1-D long id tensors.

        Returns:
            ``(response_ids, response_log_probs, truncated)``: ``N`` 1-D long tensors (ending with the stop token
            unless truncated), ``N`` 1-D float32 tensors (``log_softmax(z / T)`` of each sampled id) and ``N`` bools.
        """
        model = self.model
        was_training = model.training
        model.eval()
        try:
            if self.num_workers == 1 or len(prompts) == 1:
                return self._call_policy(prompts)
            k = min(self.num_workers, len(prompts))
            bounds = [round(i * len(prompts) / k) for i in range(k + 1)]
            chunks = [prompts[a:b] for a, b in zip(bounds, bounds[1:])]
            with ThreadPoolExecutor(max_workers=k) as pool:
                results = list(pool.map(self._call_policy, chunks))
            return ([r for res in results for r in res[0]], [r for res in results for r in res[1]],
                    [r for res in results for r in res[2]])
        finally:
            model.train(was_training)

    # ---------------------------------------------------------------------------------------------- rollouts
    def rollout(self, batch: Mapping[str, Any], *, step: int = 0, version: int | None = None) -> TensorDict:
        """Build the rollout batch of ``P`` prompts (``N = P * num_generations`` rows, layout in the module docstring).

        Args:
            batch: the prompt batch: ``"prompt"`` (``P`` strings or message lists, required: the reward functions
                receive it), optional ``"prompt_ids"`` (``P`` 1-D long tensors: the rendered prompts, else rendered
                here), optional ``"sample_id"`` (``P`` strings) and any dataset columns (lists of ``P`` entries,
                e.g. ``"answer"``), repeated per generation for the reward functions.
            step: the training step; with ``seed`` set, the sampling RNG is seeded from ``(seed, step)``.
            version: version of the weights (default :attr:`version`), written to ``policy_version``.

        Returns:
            ``TensorDict`` ``[N]`` (see :data:`ROLLOUT_KEYS`).

        Raises:
            RolloutError: no ``"prompt"``, an empty batch, a column or ``prompt_ids`` of the wrong length.
            lit_llm.rewards.RewardError: a reward function raised or returned NaN / the wrong length (names it).
        """
        if "prompt" not in batch:
            raise RolloutError(f"prompt batch has no 'prompt' key (keys: {sorted(batch)}); the prompt datamodule must "
                               f"provide the prompts (strings or message lists) under 'prompt'.")
        prompts = list(batch["prompt"])
        n_prompts, g = len(prompts), self.num_generations
        if n_prompts == 0:
            raise RolloutError("prompt batch is empty; give at least one prompt.")
        ids = batch.get("prompt_ids")
        if ids is None:
            ids = tokenize_prompts(prompts, self.tokenizer, chat_template=self.chat_template)
        ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in ids]
        if len(ids) != n_prompts:
            raise RolloutError(f"prompt batch has {len(ids)} 'prompt_ids' for {n_prompts} prompts; give one each.")
        sample_ids = [str(s) for s in batch.get("sample_id", [f"prompt:{i}" for i in range(n_prompts)])]
        columns = _columns(batch, n_prompts)
        rep = [p for p in ids for _ in range(g)]

        t0 = time.perf_counter()
        if self.seed is None:
            resp, resp_lp, truncated = self.generate(rep)
        else:
            device = self.policy.device
            devices = [device] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(self.sampling_seed(step))
                resp, resp_lp, truncated = self.generate(rep)
        gen_time = time.perf_counter() - t0

        t1 = time.perf_counter()
        resp = [r.cpu() for r in resp]
        texts = [self.tokenizer.decode(r.tolist(), skip_special_tokens=True) for r in resp]
        chat = [not isinstance(p, str) for p in prompts]
        completions = [[{"role": "assistant", "content": t}] if chat[i // g] else t for i, t in enumerate(texts)]
        rep_prompts = [p for p in prompts for _ in range(g)]
        rep_columns = {k: [v for v in col for _ in range(g)] for k, col in columns.items()}
        total, per_fn = self.reward_fn(prompts=rep_prompts, completions=completions,
                                       completion_ids=[r.tolist() for r in resp], **rep_columns)
        total = torch.as_tensor(total, dtype=torch.float32).reshape(-1)
        advantages, stats = compute_advantages(total, g, scale_rewards=self.scale_rewards)
        reward_time = time.perf_counter() - t1

        full = [torch.cat([p, r]) for p, r in zip(rep, resp)]
        n = len(full)
        prompt_len = torch.tensor([p.numel() for p in rep], dtype=torch.long)
        comp_len = torch.tensor([r.numel() for r in resp], dtype=torch.long)
        attn = pad_rows([torch.ones(f.numel(), dtype=torch.bool) for f in full], False)
        width = attn.shape[1]
        pos = torch.arange(width)[None]
        completion_mask = attn & (pos >= width - comp_len[:, None])
        old_lp = pad_rows([torch.cat([torch.zeros(p.numel()), lp.float().cpu()]) for p, lp in zip(rep, resp_lp)],
                          0.0)
        td = TensorDict({
            ("tokens", "full"): pad_rows(full, self.pad_token_id),
            ("masks", "all_attention_mask"): attn,
            ("masks", "completion_mask"): completion_mask,
            ("log_probs", "full"): old_lp,
            "advantage": advantages.float(),
            "reward": total,
            "truncated": torch.tensor(truncated, dtype=torch.bool),
            "prompt_length": prompt_len,
            "completion_length": comp_len,
            "group": torch.arange(n_prompts).repeat_interleave(g),
            "policy_version": torch.full((n,), self.version if version is None else version, dtype=torch.long),
        }, batch_size=[n])
        for name, values in per_fn.items():
            td["rewards", name] = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        td["sample_id"] = NonTensorStack(*[s for s in sample_ids for _ in range(g)])
        td["completion"] = NonTensorStack(*texts)
        td.set_non_tensor("generation_time", gen_time)
        td.set_non_tensor("reward_time", reward_time)
        td.set_non_tensor("frac_reward_zero_std", float(stats["frac_reward_zero_std"]))
        td.set_non_tensor("reward_group_std_mean", float(stats["reward_group_std_mean"]))
        return td

    # ----------------------------------------------------------------------------------------------- weights
    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor], version: int) -> None:
        """Copy ``state_dict`` into the sampling model and set :attr:`version` (used by the asynchronous mode).

        Raises:
            RuntimeError: the state dict does not match the model (missing / unexpected keys, shapes).
        """
        self.model.load_state_dict(state_dict, strict=True)
        self.version = int(version)


def _mix_seed(seed: int, step: int, rank: int = 0) -> int:
    # rank 0 keeps the single-process value; other ranks are offset by a large odd constant (golden-ratio hash)
    return (int(seed) * 1_000_003 + int(step) * 7919 + int(rank) * 0x9E3779B97F4A7C15) % (2**63 - 1)


_STOP = object()


class AsyncRollouts:
    """Iterable of rollout batches produced on a background thread from a separately held copy of the weights.

    The producer thread iterates ``prompts`` (e.g. a prompt ``DataLoader``), and for each prompt batch loads the most
    recently staged weights (:meth:`sync_weights`) into its engine's model and calls
    :meth:`RolloutEngine.rollout`; at most ``queue_size`` finished batches wait. Iterating yields them in order;
    a batch whose staleness ``trainer_version - policy_version`` exceeds ``max_staleness`` is dropped and counted
    in :attr:`num_dropped`. The trainer side reports its version with :meth:`set_trainer_version` (and
    :meth:`sync_weights`). An exception in the producer is re-raised by the next ``next()`` with its traceback.

    Note: the engine must own its model (``copy.deepcopy`` of the trained one, see :meth:`from_policy`), and its
    ``seed`` should be ``None`` (reseeding the process RNG from a background thread would disturb the trainer).

    Args:
        engine: a :class:`RolloutEngine` over the copy of the weights.
        prompts: an iterable of prompt batches (re-iterated by every ``iter()``, i.e. every epoch).
        max_staleness: the largest accepted ``trainer_version - policy_version`` (0 = only rollouts from the current
            weights; note that a dataloader that prefetches one batch makes most rollouts at least 1 step old).
        queue_size: finished batches kept ahead (>= 1).

    Raises:
        RolloutError: ``max_staleness < 0`` or ``queue_size < 1``.
    """

    def __init__(self, engine: RolloutEngine, prompts: Iterable[Mapping[str, Any]], *, max_staleness: int = 1,
                 queue_size: int = 1) -> None:
        if max_staleness < 0 or queue_size < 1:
            raise RolloutError(f"AsyncRollouts: max_staleness must be >= 0 and queue_size >= 1, got {max_staleness}, "
                               f"{queue_size}.")
        self.engine, self.prompts = engine, prompts
        self.max_staleness, self.queue_size = max_staleness, queue_size
        self.trainer_version = engine.version
        self.num_dropped = 0
        self.num_produced = 0
        self._staged: tuple[dict[str, Tensor], int] | None = None
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_policy(cls, policy: Any, prompts: Iterable[Mapping[str, Any]], *, max_staleness: int = 1,
                    queue_size: int = 1, version: int = 0, **engine_kwargs: Any) -> AsyncRollouts:
        """Build an engine over a deep copy of ``policy.model`` (same wrapper settings) and wrap it.

        Args:
            policy: the generate version (see :class:`RolloutEngine`); its model is copied, not shared.
            prompts, max_staleness, queue_size: see the class.
            version: version of the weights being copied.
            **engine_kwargs: :class:`RolloutEngine` keyword arguments (``seed`` is forced to ``None``).
        """
        model = copy.deepcopy(policy.model).eval().requires_grad_(False)
        settings = {**policy._settings(), **policy._batching_settings()}
        twin = type(policy)(model, **settings)
        engine = RolloutEngine(twin, **{**engine_kwargs, "seed": None}, version=version)
        return cls(engine, prompts, max_staleness=max_staleness, queue_size=queue_size)

    def __len__(self) -> int:
        return len(self.prompts)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------- trainer side
    @torch.no_grad()
    def sync_weights(self, source: torch.nn.Module | Mapping[str, Tensor], version: int) -> None:
        """Stage a copy of the trained weights; the producer loads them before its next batch.

        Args:
            source: the trained model (or its state dict); tensors are cloned now, so training may go on.
            version: the trained policy's version (optimizer steps), also recorded as the trainer version.
        """
        state = source.state_dict() if isinstance(source, torch.nn.Module) else source
        staged = {k: v.detach().clone() for k, v in state.items()}
        with self._lock:
            self._staged = (staged, int(version))
        self.set_trainer_version(version)

    def set_trainer_version(self, version: int) -> None:
        """Record the trained policy's current version (staleness is measured against it)."""
        self.trainer_version = int(version)

    def staleness(self, rollout: TensorDictBase) -> int:
        """``trainer_version - policy_version`` of a rollout batch."""
        return self.trainer_version - int(rollout["policy_version"].max())

    # -------------------------------------------------------------------------------------------- producer
    def _produce(self, it: Iterator[Mapping[str, Any]], q: queue.Queue, stop: threading.Event) -> None:
        step = 0
        try:
            for batch in it:
                if stop.is_set():
                    return
                with self._lock:
                    staged, self._staged = self._staged, None
                if staged is not None:
                    self.engine.load_weights(*staged)
                td = self.engine.rollout(batch, step=step)
                step += 1
                self.num_produced += 1
                while not stop.is_set():
                    try:
                        q.put(td, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # handed to the consumer
            q.put(e)
            return
        q.put(_STOP)

    def __iter__(self) -> Iterator[TensorDict]:
        """Start a producer over a fresh ``iter(prompts)`` (stopping any previous one) and yield its batches."""
        self.close()
        stop, q = threading.Event(), queue.Queue(maxsize=self.queue_size)
        self._stop, self._queue = stop, q
        self._thread = threading.Thread(target=self._produce, args=(iter(self.prompts), q, stop),
                                        name="lit_llm-async-rollouts", daemon=True)
        self._thread.start()
        return self._consume(q)

    def _consume(self, q: queue.Queue) -> Iterator[TensorDict]:
        while True:
            item = q.get()
            if item is _STOP:
                return
            if isinstance(item, BaseException):
                raise item
            if self.staleness(item) > self.max_staleness:
                self.num_dropped += 1
                continue
            yield item

    def close(self) -> None:
        """Stop the producer thread (after its current batch) and forget the queue."""
        if self._thread is not None:
            self._stop.set()
            q = self._queue
            while self._thread.is_alive():
                if q is not None:
                    try:
                        q.get_nowait()
                    except queue.Empty:
                        pass
                self._thread.join(timeout=0.05)
            self._thread = None
        self._queue = None

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass

