"""Tensor parallelism, engine-free: which dimensions of a head an engine shards over its
tensor-parallel ranks, and whether they divide.

Both engines shard a head's layers the same way: the vocabulary of an embedding or LM
head is padded to a multiple of VOCAB_PADDING and split evenly into one slice per rank;
attention heads and the MLP's intermediate width are split evenly; key/value heads are
split when they divide by the TP size, or replicated when the TP size divides by them.
A dimension that does not divide makes the engine's layer fail while it is built (vLLM:
`AssertionError: 8192 is not divisible by 3`), so the adapters check a head with
`shard_problems` at start-up and refuse it with `shard_error`'s message instead.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

VOCAB_PADDING = 64  # vLLM's and SGLang's vocab-parallel layers pad the vocabulary to a multiple of this
VOCAB_FIELDS = ("vocab_size", "draft_vocab_size", "truncated_vocab_size")  # split by vocabulary
SPLIT_FIELDS = ("num_attention_heads", "intermediate_size")  # split evenly
KV_FIELD = "num_key_value_heads"  # split, or replicated when the TP size divides by it
MAX_SUGGESTED_TP = 8  # the largest TP size a message suggests


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
    example = f" (e.g. {', '.join(vocab)})" if vocab else ""
    return (f"{head} cannot be sharded over {option} {tp_size}: {'; '.join(problems)}. Fix: set {option} "
            f"to {sizes}, or train or convert a head "
            f"whose sharded dimensions divide by {tp_size}{example}")
