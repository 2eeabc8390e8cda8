"""Tensor parallelism, engine-free: which dimensions of a head an engine shards over its
tensor-parallel ranks, and the rule that keeps those ranks in step.

Sharding. Both engines shard a head's layers the same way: the vocabulary of an embedding
or LM head is padded to a multiple of VOCAB_PADDING and split evenly into one slice per
rank; attention heads and the MLP's intermediate width are split evenly; key/value heads
are split when they divide by the TP size, or replicated when the TP size divides by them.
A dimension that does not divide makes the engine's layer fail while it is built (vLLM:
`AssertionError: 8192 is not divisible by 3`), so the adapters check a head with
`shard_problems` at start-up and refuse it with `shard_error`'s message instead.

The rank rule. The engine runs specplug's drafter on every rank of its tensor-parallel
group, and every sharded layer it calls is a collective, so the ranks must take the same
decisions in the same order: one rank skipping a head pass that another runs is a hang,
one rank drafting other tokens is a wrong output. Every drafting and verification
decision is therefore either
- a pure function of data every rank holds: the same committed tokens, the same logits
  after the engine's gather, the same per-request seeds; or
- taken once, on rank 0 of the group, and broadcast with `decide_once`: anything that
  comes from rank-local measurements or state, namely wall-clock costs, adaptive depth or
  budget, the draft gate's keep mask, and random draws not derived from a request's seed.
`check_same_on_ranks` enforces it while debugging: with SPECPLUG_CHECK_RANKS=1 it
all-gathers a hash of one step's decisions and raises when ranks differ. Adapters pass
the engine's own process group (a CPU/gloo group: the values are small host data);
`RankGroup` carries it to the policy objects, whose default, ALONE, decides locally.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

VOCAB_PADDING = 64  # vLLM's and SGLang's vocab-parallel layers pad the vocabulary to a multiple of this
VOCAB_FIELDS = ("vocab_size", "draft_vocab_size", "truncated_vocab_size")  # split by vocabulary
SPLIT_FIELDS = ("num_attention_heads", "intermediate_size")  # split evenly
KV_FIELD = "num_key_value_heads"  # split, or replicated when the TP size divides by it
MAX_SUGGESTED_TP = 8  # the largest TP size a message suggests
ENV_CHECK_RANKS = "SPECPLUG_CHECK_RANKS"  # 1: check_same_on_ranks compares every checked step across ranks


def _field(config: Any, name: str) -> int | None:
    """config[name] or config.name (a config.json dict or a transformers config), None when absent."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def padded_vocab(size: int, padding: int = VOCAB_PADDING) -> int:
    """The vocabulary a vocab-parallel layer splits: `size` rounded up to a multiple of `padding`."""
    return -(-size // padding) * padding


def shard_problems(config: Any, tp_size: int, padding: int = VOCAB_PADDING) -> list[str]:
    """One line per dimension of `config` (a head's config.json as a dict or a transformers
    config) that `tp_size` ranks cannot shard, naming the field and its numbers; [] when
    every sharded dimension divides (and always for tp_size 1)."""
    if tp_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
    problems = []
    for name in VOCAB_FIELDS:
        size = _field(config, name)
        if size is not None and padded_vocab(size, padding) % tp_size:
            padded = padded_vocab(size, padding)
            shown = f"{size}" if padded == size else f"{size} (padded to {padded})"
            problems.append(f"{name} {shown} is not divisible by {tp_size}")
    for name in SPLIT_FIELDS:
        size = _field(config, name)
        if size is not None and size % tp_size:
            problems.append(f"{name} {size} is not divisible by {tp_size}")
    kv = _field(config, KV_FIELD)
    if kv is not None and kv % tp_size and tp_size % kv:
        problems.append(f"{KV_FIELD} {kv} neither divides by {tp_size} nor divides it")
    return problems


def fitting_tp_sizes(config: Any, up_to: int = MAX_SUGGESTED_TP, padding: int = VOCAB_PADDING) -> list[int]:
    """The TP sizes 1..up_to at which every sharded dimension of `config` divides."""
    return [n for n in range(1, up_to + 1) if not shard_problems(config, n, padding)]


def fitting_vocab(size: int, tp_size: int, padding: int = VOCAB_PADDING) -> int:
    """The smallest vocabulary >= size whose padded size divides by tp_size."""
    step = math.lcm(padding, tp_size)
    return -(-size // step) * step


def shard_error(config: Any, tp_size: int, head: str, option: str, padding: int = VOCAB_PADDING) -> str | None:
    """The start-up refusal for a head that `tp_size` ranks cannot shard, None when they can.

    head: what to call the head ("the specplug head /path"); option: the engine's TP
    option as the user sets it ("tensor_parallel_size").
    """
    problems = shard_problems(config, tp_size, padding)
    if not problems:
        return None
    fits = fitting_tp_sizes(config, padding=padding)
    sizes = (f"{fits[0]} (the only size up to {MAX_SUGGESTED_TP} that divides them)" if len(fits) == 1 else
             f"one of {', '.join(map(str, fits))} (the sizes up to {MAX_SUGGESTED_TP} that divide them)")
    vocab = [f"{n} {fitting_vocab(s, tp_size, padding)}" for n in VOCAB_FIELDS
             if (s := _field(config, n)) is not None and padded_vocab(s, padding) % tp_size]
    if all(p.startswith("draft_vocab_size") for p in problems):  # the one dimension a conversion can pad
        return (f"{head} cannot be sharded over {option} {tp_size}: {problems[0]}. Fix: set {option} to {sizes}, "
                f"or pad the head's draft vocabulary to {vocab[0]}: specplug convert HEAD NEW_HEAD --to eagle3 "
                f"--tensor-parallel-size {tp_size}, and serve NEW_HEAD")
    example = f" (e.g. {', '.join(vocab)})" if vocab else ""
    return (f"{head} cannot be sharded over {option} {tp_size}: {'; '.join(problems)}. Fix: set {option} "
            f"to {sizes}, or train a head whose sharded dimensions divide by {tp_size}{example}")


# -- the rank rule ---------------------------------------------------------------------------

def group_size(group: Any = None) -> int:
    """Ranks in `group` (None: the default group) when torch.distributed is initialised, else 1."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _first_rank(group: Any) -> int:
    """The global rank of rank 0 of `group` (torch's broadcast takes global ranks)."""
    import torch.distributed as dist

    return 0 if group is None else dist.get_global_rank(group, 0)


def decide_once(values: Any, group: Any = None) -> Any:
    """`values` as rank 0 of `group` has them, on every rank of it: a tensor (the same shape
    and dtype on every rank, on the group's device) is broadcast, anything else (ints,
    floats, tuples, dicts) is pickled and broadcast. The identity without torch.distributed
    or on a group of one. Every rank of the group must call it, in the same order."""
    if group_size(group) == 1:
        return values
    import torch.distributed as dist

    if isinstance(values, torch.Tensor):
        out = values.detach().clone().contiguous()
        dist.broadcast(out, src=_first_rank(group), group=group)
        return out
    box = [values]
    dist.broadcast_object_list(box, src=_first_rank(group), group=group)
    return box[0]


def checking_ranks(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether SPECPLUG_CHECK_RANKS asks for the run-time rank check (1/true/yes/on)."""
    return environ.get(ENV_CHECK_RANKS, "").strip().lower() in ("1", "true", "yes", "on")


def decisions_digest(decisions: Any) -> int:
    """A signed 64-bit hash of a step's decisions: tensors by dtype, shape and bytes;
    mappings by sorted key; sequences in order; anything else by repr."""
    h = hashlib.sha256()
    _feed(h, decisions)
    return int.from_bytes(h.digest()[:8], "little", signed=True)


def _feed(h, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        h.update(b"M%d" % len(value))
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d" % len(value))
        for item in value:
            _feed(h, item)
    else:
        h.update(f"V{value!r}".encode())


def check_same_on_ranks(step: Any, decisions: Any, group: Any = None,
                        environ: Mapping[str, str] = os.environ) -> None:
    """With SPECPLUG_CHECK_RANKS=1 on a group of more than one rank: all-gather the hash of
    this step's decisions (decisions_digest) and raise RuntimeError on every rank, naming
    the step and the ranks whose decisions differ from rank 0's. A no-op otherwise.
    Every rank of the group must call it for the same steps."""
    if not checking_ranks(environ) or group_size(group) == 1:
        return
    import torch.distributed as dist

    digest = torch.tensor([decisions_digest(decisions)], dtype=torch.int64)
    gathered = [torch.zeros_like(digest) for _ in range(group_size(group))]
    dist.all_gather(gathered, digest, group=group)
    hashes = [int(t) for t in gathered]
    differ = [rank for rank, value in enumerate(hashes) if value != hashes[0]]
    if differ:
        raise RuntimeError(
            f"specplug rank check ({ENV_CHECK_RANKS}=1): the decisions of step {step} differ between the "
            f"tensor-parallel ranks: ranks {differ} differ from rank 0 (decision hashes by rank: {hashes}). A "
            "drafting or verification decision was taken from rank-local data: compute it from data every rank "
            "holds, or take it once with specplug.common.parallel.decide_once")


@dataclass(frozen=True)
class RankGroup:
    """The group a policy object decides with. alone: this process decides by itself (one
    rank, or an engine that gave no group); else `group` is the engine's tensor-parallel
    group (a torch.distributed process group) and decisions go through decide_once."""

    group: Any = None
    alone: bool = True

    def decide_once(self, values: Any) -> Any:
        return values if self.alone else decide_once(values, self.group)

    def check(self, step: Any, decisions: Any) -> None:
        if not self.alone:
            check_same_on_ranks(step, decisions, self.group)


ALONE = RankGroup()  # decide locally: the default of every policy object


def engine_group(group: Any) -> RankGroup:
    """The RankGroup of an engine's tensor-parallel process group."""
    return RankGroup(group, alone=False)


def threads_bind(tp_size: int, cores: int | None = None) -> str:
    """The engines' CPU thread binding (vLLM's VLLM_CPU_OMP_THREADS_BIND, SGLang's
    SGLANG_CPU_OMP_THREADS_BIND) for `tp_size` ranks on this host's cores, one core per
    rank round robin ("0|1|0": 3 ranks on 2 cores)."""
    cores = cores or os.cpu_count() or 1
    return "|".join(str(rank % cores) for rank in range(tp_size))
