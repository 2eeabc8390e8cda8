"""Static draft trees: chains, Medusa's trees from top-k index paths (from_choices, filled
per request by fill_static) and the Medusa paper's optimal sparse tree (optimal_sparse).

The trees follow :mod:`specplug.common.tree`'s conventions (node 0 the root, parents
before children, siblings tested in node-id order, so the best rank comes first).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from specplug.common.tree import DraftTree, full_tree_nodes

__all__ = ["chain", "from_choices", "fill_static", "optimal_sparse"]


def chain(k: int, tokens: Sequence[int] | torch.Tensor | None = None) -> DraftTree:
    """A chain of ``k`` draft tokens: node i has parent i - 1 (k + 1 nodes, root included).

    ``tokens`` (length k + 1, root first) defaults to zeros (structure only).
    """
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"chain length k must be an int >= 0, got {k!r}")
    toks = torch.zeros(k + 1, dtype=torch.long) if tokens is None else torch.as_tensor(tokens)
    return DraftTree(toks, torch.arange(-1, k, dtype=torch.long))


def _normalise_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    paths = [tuple(int(i) for i in c) for c in choices]
    seen = set()
    for c in paths:
        if len(c) == 0 or any(i < 0 for i in c):
            raise ValueError(f"choices entries must be non-empty lists of top-k ranks >= 0, got {list(c)}")
        if c in seen:
            raise ValueError(f"choices contains {list(c)} twice: list each tree path once")
        seen.add(c)
    for c in paths:
        if len(c) > 1 and c[:-1] not in seen:
            raise ValueError(
                f"choices is not closed under parents: {list(c)} is listed but its parent "
                f"{list(c[:-1])} is not: add the parent path"
            )
    return sorted(paths, key=lambda c: (len(c), c))


def from_choices(
    choices: Sequence[Sequence[int]],
    head_tokens: torch.Tensor | None = None,
    root_token: int = 0,
) -> DraftTree:
    """Medusa static tree from top-k index paths, e.g. ``[[0], [1], [0, 0], [0, 1]]``.

    Path ``[i1, ..., id]`` is the node reached by taking head 1's rank-i1 token, then
    head 2's rank-i2 token, ... Nodes are ordered by (depth, path) as Medusa orders
    them, so siblings are tested best rank first.

    head_tokens: optional Long [heads, topk], rank-r token of head h; fills the node
    tokens (node = head_tokens[depth - 1, rank]). Without it the tree is a TEMPLATE:
    ``tokens[i]`` is node i's top-k rank (root: 0); :func:`fill_static` turns a
    template plus per-request head outputs into candidates.
    """
    paths = _normalise_choices(choices)
    index = {(): 0}
    parents = [-1]
    ranks = [0]
    for i, c in enumerate(paths, start=1):
        index[c] = i
        parents.append(index[c[:-1]])
        ranks.append(c[-1])
    tree = DraftTree(torch.tensor(ranks, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    if head_tokens is None:
        return tree
    candidates = fill_static(tree, torch.tensor([root_token]), torch.as_tensor(head_tokens).unsqueeze(0))
    return tree.with_tokens(candidates[0])


def fill_static(template: DraftTree, root_tokens: torch.Tensor, head_tokens: torch.Tensor) -> torch.Tensor:
    """Candidates of a static tree for a batch: -> Long [B, N].

    template:    tree from :func:`from_choices` without head tokens (tokens = ranks).
    root_tokens: Long [B], the last committed token of each request.
    head_tokens: Long [B, heads, topk], rank-r token of head h for each request.
    """
    heads, topk = head_tokens.shape[-2:]
    depth, ranks = template.depth, template.tokens
    if template.max_depth > heads or int(ranks.max()) >= topk:
        raise ValueError(
            f"head_tokens has shape [B, {heads}, {topk}] but the tree needs depth "
            f"{template.max_depth} and rank {int(ranks.max())}: give at least that many heads / top-k"
        )
    flat = (depth - 1).clamp(min=0) * topk + ranks  # [N] index into heads*topk
    candidates = head_tokens.reshape(head_tokens.shape[0], heads * topk)[:, flat]
    candidates[:, 0] = root_tokens
    return candidates


def optimal_sparse(accuracies, budget: int) -> tuple[DraftTree, float]:
    """Medusa paper section 3.1: the ``budget``-node tree with the largest expected acceptance.

    accuracies: [heads, topk] (nested lists or tensor); accuracies[h][r] = measured
    probability that head h's rank-r prediction is the correct token.
    A node's path (r1, ..., rd) is accepted with probability prod_h accuracies[h][r_h]
    (heads treated independently, as the paper does). Grow the tree greedily: each
    time add the node, among children of nodes already in the tree, with the largest
    expected acceptance. Because a child's value never exceeds its parent's, this
    picks the ``budget`` best paths overall, i.e. the optimum over trees closed under
    parents.

    Returns the template tree (tokens = ranks, see :func:`from_choices`) and its
    expected acceptance length ``1 + sum of node values`` (tokens per step, bonus
    included).
    """
    acc = torch.as_tensor(accuracies, dtype=torch.float64)
    if acc.dim() != 2 or acc.numel() == 0:
        raise ValueError(f"accuracies must be [heads, topk], got shape {tuple(acc.shape)}")
    if bool(((acc < 0) | (acc > 1) | acc.isnan()).any()):
        raise ValueError("accuracies must lie in [0, 1] (probabilities that a head's rank-r token is right)")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (draft nodes, root excluded), got {budget!r}")
    heads, topk = acc.shape
    budget = min(budget, full_tree_nodes(topk, heads))
    chosen: list[tuple[int, ...]] = []
    values: list[float] = []
    # max-heap on value; ties broken by (depth, path) so parents win over children
    frontier = [(-float(acc[0, r]), (r,)) for r in range(topk)]
    heapq.heapify(frontier)
    while frontier and len(chosen) < budget:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        values.append(-neg)
        if len(path) < heads:
            for r in range(topk):
                heapq.heappush(frontier, (neg * float(acc[len(path), r]), path + (r,)))
    return from_choices(chosen), 1.0 + sum(values)
