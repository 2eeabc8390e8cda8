"""Test support (not product code): random verify inputs for the CUDA parity tests and
bench/gpu_bench.py: ragged trees with planted agreeing paths, and "dyadic"
probabilities whose float32 sums are exact in any order, so that two correct
implementations with different reduction orders must return identical tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Trees(NamedTuple):
    candidates: torch.Tensor  # [B, N] Long, padding 0
    parents: torch.Tensor  # [B, N] Long, root and padding -1
    num_nodes: torch.Tensor  # [B] Long


def random_trees(gen: torch.Generator, batch: int, max_nodes: int, vocab: int, *, chain: bool = False,
                 min_nodes: int = 1) -> Trees:
    """Ragged random trees (chains with ``chain``): node i's parent is uniform in [0, i)."""
    num_nodes = torch.randint(min_nodes, max_nodes + 1, (batch,), generator=gen)
    num_nodes[0] = max_nodes  # the padded width is always used
    ids = torch.arange(max_nodes)
    if chain:
        parents = (ids - 1).expand(batch, max_nodes).clone()
    else:
        parents = (torch.rand(batch, max_nodes, generator=gen) * ids).long()
    real = ids < num_nodes.unsqueeze(1)
    parents = torch.where(real & (ids > 0), parents, -1)
    candidates = torch.where(real, torch.randint(0, vocab, (batch, max_nodes), generator=gen), 0)
    return Trees(candidates, parents, num_nodes)


def plant(gen: torch.Generator, trees: Trees, next_token: torch.Tensor, rate: float,
          duplicate_rate: float = 0.1) -> Trees:
    """Sets each real child's token to ``next_token[b, parent]`` (Long [B, N]) with
    probability ``rate``, then copies an earlier sibling's token with probability
    ``duplicate_rate`` (repeated siblings exercise the tie rules)."""
    cand, par, num = trees.candidates.clone(), trees.parents, trees.num_nodes
    batch, nodes = cand.shape
    for b in range(batch):
        for i in range(1, int(num[b])):
            p = int(par[b, i])
            if float(torch.rand((), generator=gen)) < rate:
                cand[b, i] = next_token[b, p]
            siblings = [j for j in range(1, i) if int(par[b, j]) == p]
            if siblings and float(torch.rand((), generator=gen)) < duplicate_rate:
                cand[b, i] = cand[b, siblings[int(torch.randint(len(siblings), (), generator=gen))]]
    return Trees(cand, par, num)


def dyadic_probs(logits: torch.Tensor, dtype: torch.dtype, bits: int = 20) -> torch.Tensor:
    """softmax(logits) made exactly summable in float32, in ``dtype``.

    float32: multiples of 2**-bits summing to exactly 1. bfloat16 / float16: the rounded
    softmax with entries below 2**-16 (bf16) / 2**-13 (fp16) set to 0, so every entry is
    a multiple of 2**-23 and every partial sum (< 2) is exact in float32; rows then sum
    to 1 within ~1e-2 for peaked logits (scale >= 5).
    """
    p = torch.softmax(logits.double(), dim=-1)
    if dtype == torch.float32:
        scale = 2.0**bits
        counts = torch.floor(p * scale)
        deficit = scale - counts.sum(-1, keepdim=True)
        counts.scatter_add_(-1, p.argmax(-1, keepdim=True), deficit)
        return (counts / scale).float()
    q = p.to(dtype)
    floor = 2.0**-16 if dtype == torch.bfloat16 else 2.0**-13
    return torch.where(q.double() < floor, torch.zeros_like(q), q)


def flatten(x: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N, V] -> [sum(num_nodes), V]: the real rows, request after request."""
    return torch.cat([x[b, : int(n)] for b, n in enumerate(num_nodes)])


def sample_rows(gen: torch.Generator, probs: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, N, V] -> Long [B, N]."""
    batch, nodes, vocab = probs.shape
    flat = probs.reshape(-1, vocab).float()
    return torch.multinomial(flat, 1, generator=gen).view(batch, nodes)
