"""Training data of `specplug train`: chat conversations -> token ids + a mask of the
assistant tokens (`Sample`), split into training and held-out samples, and batches of
them (`Batch`) in an order that is a pure function of the step (so --resume is exact).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import NamedTuple

import torch

from specplug.common.training.config import TrainConfig


# ---------------------------------------------------------------------------------------
# Data: conversations -> (input_ids, loss_mask) samples
# ---------------------------------------------------------------------------------------
class Sample(NamedTuple):
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token belongs to an assistant turn (incl. its end token)


def load_conversations(data: str) -> list[list[dict]]:
    """Conversations for `--data`: a prompt-set name (sharegpt) or a ShareGPT-style .json/.jsonl file."""
    from specplug.common.training import data as datasets

    path = Path(data)
    if data == "sharegpt":
        convs = datasets.conversations("sharegpt")
    elif path.is_file():
        try:
            convs = datasets.conversations("sharegpt", path)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"--data {data}: not ShareGPT-style JSON/JSONL ({exc}); expected records "
                             '{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}') from exc
    else:
        raise ValueError(f"--data {data!r}: expected 'sharegpt' or a path to a ShareGPT-style .json/.jsonl file")
    convs = [c for c in convs if any(m["role"] == "assistant" and m["content"].strip() for m in c)]
    if not convs:
        raise ValueError(f"--data {data}: no conversation with an assistant turn; nothing to train on")
    return convs


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> Sample | None:
    """Token ids of the chat-templated conversation and a mask of its assistant tokens.

    Assistant spans are found as character ranges: the template text up to the turn
    (with the generation prompt) and up to its end; tokens starting inside a span are
    masked in. None when no assistant token survives the cut to max_length.
    """
    from specplug.common.training.data import format_chat

    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    if not messages:
        return None
    text = format_chat(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(format_chat(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
            spans.append((start, len(format_chat(tokenizer, messages[: i + 1], add_generation_prompt=False))))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, truncation=True,
                    max_length=max_length)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    if sum(mask) == 0:
        return None
    return Sample(list(enc["input_ids"]), mask)


def build_samples(tokenizer, conversations: list[list[dict]], cfg: TrainConfig,
                  rewrite=None) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out): shuffled (seeded) tokenized samples; held-out ones are taken from
    the END of the shuffled order, training ones (at most cfg.max_samples) from its start.

    rewrite (e.g. `regenerate`'s): list of conversations -> list of the same length; when
    given, exactly the first heldout_samples / max_samples conversations of each order are
    rewritten (in one call) and then tokenized."""
    order = list(range(len(conversations)))
    random.Random(cfg.seed).shuffle(order)
    taken = len(conversations) - cfg.heldout_samples if len(conversations) > 2 * cfg.heldout_samples else None
    heldout_order, train_order = order[::-1], order[:taken]
    if rewrite is not None:
        heldout_order, train_order = heldout_order[: cfg.heldout_samples], train_order[: cfg.max_samples]
        chosen = sorted(set(heldout_order) | set(train_order))
        conversations = dict(zip(chosen, rewrite([conversations[i] for i in chosen])))
    heldout = _tokenize_some(tokenizer, conversations, heldout_order, cfg.heldout_samples, cfg.max_length)
    samples = _tokenize_some(tokenizer, conversations, train_order, cfg.max_samples, cfg.max_length)
    if not samples:
        raise ValueError("no usable training sample: every conversation lost its assistant tokens "
                         f"within --max-length {cfg.max_length}; raise it")
    return samples, heldout


def _tokenize_some(tokenizer, conversations, order, limit, max_length) -> list[Sample]:
    out: list[Sample] = []
    for idx in order:
        if limit is not None and len(out) >= limit:
            break
        sample = tokenize_conversation(tokenizer, conversations[idx], max_length)
        if sample is not None:
            out.append(sample)
    return out


def first_prompt(messages: list[dict]) -> list[dict]:
    """The messages before the conversation's first assistant turn (system + first user turn).

    Leading assistant turns are skipped first, as `tokenize_conversation` does; a
    conversation with nothing else has an empty first prompt."""
    while messages and messages[0]["role"] == "assistant":
        messages = messages[1:]
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            return messages[:i]
    return list(messages)


class Batch(NamedTuple):
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    loss_mask: torch.Tensor  # [B, T] 1 = assistant token (a label worth learning)


def collate(samples: list[Sample], pad_id: int) -> Batch:
    """Right-pad samples to the longest one."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(samples), width), dtype=torch.long)
    loss = torch.zeros((len(samples), width), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n] = torch.tensor(s.input_ids)
        attn[row, :n] = 1
        loss[row, :n] = torch.tensor(s.loss_mask)
    return Batch(ids, attn, loss)


def batch_indices(step: int, batch_size: int, num_samples: int, seed: int | None = None) -> list[int]:
    """Sample indices of the step-th batch of an endless pass (a pure function: resume is
    exact). seed None: the samples in order, wrapping around; an int: every epoch visits
    each sample once, in an order shuffled by (seed, epoch)."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(k, num_samples)
        out.append(pos if seed is None else _epoch_order(num_samples, seed, epoch)[pos])
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(num_samples) fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def batch_at(samples: list[Sample], step: int, batch_size: int, pad_id: int) -> Batch:
    """The step-th batch of an endless pass over samples (`batch_indices`, collated)."""
    return collate([samples[i] for i in batch_indices(step, batch_size, len(samples))], pad_id)


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padded with `fill` at the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out
