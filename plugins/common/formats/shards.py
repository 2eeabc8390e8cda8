"""An EAGLE-3 head made shardable over a tensor-parallel size: its draft vocabulary padded.

vLLM splits a head's draft vocabulary (`lm_head.weight` rows, `d2t`) into one equal slice
per rank after rounding it up to a multiple of 64, so a head trained with 8192 draft tokens
cannot run at tensor_parallel_size 3 (specplug.common.parallel.shard_error refuses it).
`pad_draft_vocab` adds rows until the padded vocabulary divides: each new draft id stands
for a target token outside the draft vocabulary (the smallest such ids, one each, so no
target token is mapped twice) and has an all-zero `lm_head` row, so its draft logit is 0.
A drafted padding token is verified like any other draft, so output stays lossless; it
enters the head's top-k only where fewer than k of the head's own tokens score above 0. Attention heads and
the MLP width cannot be padded without retraining; those are refused with the numbers.
"""

from __future__ import annotations

import copy

import torch

from specplug.common.parallel import fitting_vocab, padded_vocab, shard_problems

from .base import CheckpointError, LoadedHead, _where


def pad_draft_vocab(head: LoadedHead, tp_size: int) -> tuple[LoadedHead, list[str]]:
    """(head, notes): `head` with its draft vocabulary padded so that `tp_size` ranks
    can shard it, and what changed (no change, [] notes, when it already shards).
    CheckpointError when another dimension does not divide by `tp_size`, or the target
    vocabulary has too few tokens outside the draft vocabulary to stand for the new ids."""
    if tp_size <= 1:
        return head, []
    if head.method != "eagle3":
        raise CheckpointError("tensor_parallel_size", "an EAGLE-3 head (the draft vocabulary is what pads)",
                              f"a {head.method} head", _where(head), "convert without --tensor-parallel-size")
    _refuse_unpaddable(head, tp_size)
    size = int(head.config.get("draft_vocab_size") or head.config["vocab_size"])
    if padded_vocab(size) % tp_size == 0:
        return head, []
    new_size = fitting_vocab(size, tp_size)
    state = dict(head.state_dict)
    state["lm_head.weight"] = _padded_rows(_lm_head(head), new_size)
    state["d2t"] = _padded_d2t(head, size, new_size)
    if "t2d" in state:  # [vocab] bool: the target ids the draft vocabulary now covers
        state["t2d"] = state["t2d"].clone()
        state["t2d"][torch.arange(new_size) + state["d2t"]] = True
    config = copy.deepcopy(head.config)
    config["draft_vocab_size"] = new_size
    padded = LoadedHead(method=head.method, format=head.format, config=config, state_dict=state,
                        extra=head.extra, path=head.path, tensor_files=head.tensor_files)
    return padded, [f"draft_vocab_size {size} -> {new_size} for tensor_parallel_size {tp_size}: "
                    f"{new_size - size} draft ids with zero lm_head rows, each standing for a target token "
                    "outside the draft vocabulary (drafted only where they outscore the head's own tokens; "
                    "verification keeps output lossless)"]


def _refuse_unpaddable(head: LoadedHead, tp_size: int) -> None:
    problems = [p for p in shard_problems(head.config, tp_size) if not p.startswith("draft_vocab_size")]
    if problems:
        raise CheckpointError("tensor_parallel_size", f"dimensions that divide by {tp_size} (only the draft "
                              "vocabulary can be padded)", "; ".join(problems), _where(head),
                              f"serve at a tensor_parallel_size these divide by, or train a head whose "
                              f"dimensions divide by {tp_size}")


def _lm_head(head: LoadedHead) -> torch.Tensor:
    if "lm_head.weight" not in head.state_dict:
        raise CheckpointError("lm_head.weight", "the head's own draft LM head", "none (it uses the target's)",
                              _where(head), "a head without its own lm_head shards with the target's vocabulary")
    return head.state_dict["lm_head.weight"]


def _padded_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [V_draft, H] -> [rows, H], the new rows zero."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


def _padded_d2t(head: LoadedHead, size: int, rows: int) -> torch.Tensor:
    """d2t [size] -> [rows]: new draft id i maps to the i-th smallest target id that no
    draft id maps to (target id = i + d2t[i])."""
    vocab = int(head.config["vocab_size"])
    d2t = head.state_dict.get("d2t")
    d2t = torch.zeros(size, dtype=torch.long) if d2t is None else d2t.long()
    covered = torch.zeros(vocab, dtype=torch.bool)
    covered[torch.arange(size) + d2t] = True
    free = (~covered).nonzero().flatten()[: rows - size]  # [rows - size] target ids
    if free.numel() < rows - size:
        raise CheckpointError("draft_vocab_size", f"at most {vocab - (rows - size)} to pad to {rows}",
                              size, _where(head), "train a head whose draft vocabulary divides by the TP size")
    return torch.cat([d2t, free - torch.arange(size, rows)])
