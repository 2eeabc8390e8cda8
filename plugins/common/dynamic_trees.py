"""Trees grown from the drafter's outputs: EAGLE-2 dynamic trees (top-k children by
cumulative draft log-prob, reranked to a node budget, :func:`dynamic`) and trees sampled
from the draft distribution q (SpecInfer, :func:`sampled`).

Both call the drafter back once per depth with a :class:`Frontier` and return a
:class:`specplug.common.tree.TreeBatch`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from specplug.common.tree import TreeBatch, TreeConfig, path_reduce

__all__ = ["Frontier", "dynamic", "sampled"]


# --------------------------------------------------------------------------- EAGLE-2 dynamic trees


class Frontier(NamedTuple):
    """What :func:`dynamic` hands the drafter at each expansion (batched, F = frontier width).

    depth:        depth of the frontier nodes (1 at the first call; root = 0).
    tokens:       Long [B, F] target-vocab token of each frontier node: the drafter's input.
    node_ids:     Long [B, F] ids of the frontier nodes among ``tree_tokens``.
    parent_slot:  Long [B, F] index, in the PREVIOUS call's frontier, of each node's
                  parent (0 at depth 1, where the previous "frontier" was the root).
                  EAGLE drafters feed the hidden state their previous call produced
                  at that slot together with the token.
    tree_tokens:  Long [B, n] every node drafted so far (root first), n = nodes so far.
    tree_parents: Long [B, n] their parents (-1 for the root).
    expanded_mask: Bool [B, F, E] over the nodes the drafter has RUN so far, in call
                  order: column 0 = root, then each earlier call's F frontier nodes,
                  then this call's F nodes (E = 1 + depth * F). True where the
                  column is the row's ancestor or itself. A drafter that appends each
                  call's frontier to its KV cache uses this as the tree part of the
                  attention mask (context columns are all True).
    positions:    Long [B, F] depth of each frontier node (add the root's position).
    """

    depth: int
    tokens: torch.Tensor
    node_ids: torch.Tensor
    parent_slot: torch.Tensor
    tree_tokens: torch.Tensor
    tree_parents: torch.Tensor
    expanded_mask: torch.Tensor
    positions: torch.Tensor


Expand = Callable[[Frontier], torch.Tensor]


def _topk_children(logprobs: torch.Tensor, k: int, token_map: torch.Tensor | None):
    """logprobs [B, F, V] -> (tokens [B, F*k], logp [B, F*k]) ordered (slot, rank)."""
    logp, idx = logprobs.topk(k, dim=-1)  # [B, F, k]
    tokens = idx if token_map is None else token_map[idx]
    return tokens.flatten(1), logp.flatten(1)


def _validate_dynamic(root_tokens, root_logprobs, depth, topk, budget):
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (draft nodes, root excluded), got {budget!r}")
    for name, v in (("depth", depth), ("topk", topk)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if root_tokens.dim() != 1 or root_logprobs.dim() != 2 or root_logprobs.shape[0] != root_tokens.shape[0]:
        raise ValueError(
            f"root_tokens must be [B] and root_logprobs [B, V], got {tuple(root_tokens.shape)} "
            f"and {tuple(root_logprobs.shape)}"
        )
    if bool(root_logprobs.isnan().any()):
        raise ValueError("root_logprobs contains NaN: check the drafter's output")


def dynamic(
    expand: Expand,
    root_tokens: torch.Tensor,
    root_logprobs: torch.Tensor,
    depth: int = TreeConfig.depth,
    topk: int = TreeConfig.topk,
    budget: int = TreeConfig.budget,
    token_map: torch.Tensor | None = None,
    stop_below: float = TreeConfig.stop_below,
) -> TreeBatch:
    """EAGLE-2 dynamic draft trees for a batch of requests.

    root_tokens:   Long [B], last committed token per request.
    root_logprobs: Float [B, V'] draft log-probs of the token after the root (the
                   drafter's first forward, run by the caller).
    expand:        callback ``expand(frontier: Frontier) -> Float [B, F, V']`` giving
                   the draft log-probs of the token after each frontier node; called
                   ``depth - 1`` times, with F = min(topk, V') nodes each time.
    token_map:     optional Long [V'] target token id of each draft-vocab index
                   (EAGLE-3: ``arange(V') + d2t``); tree tokens are target ids.

    Algorithm: the root's top-k children form depth 1. At each further depth every
    frontier node gets its top-k children (k*k candidates, score = parent score +
    log-prob) and the k best by score become the next frontier. Finally all drafted
    nodes are reranked by score and the ``budget`` best kept (at most all drafted).
    Ranking uses ``min(score, parent's rank score)`` with ties broken by drafting
    order, so the kept set is closed under parents even if a drafter returns
    unnormalised scores. Kept nodes keep their drafting order, so parents precede
    children and siblings come best-rank first. With ``stop_below`` > 0 expansion stops
    early once every frontier node of every request has cumulative draft probability
    below it (a child is never likelier than its parent), so trees may be shallower.

    Returns a TreeBatch with N = kept + 1 nodes per request and ``scores`` [B, N].
    """
    _validate_dynamic(root_tokens, root_logprobs, depth, topk, budget)
    k = min(topk, root_logprobs.shape[-1])
    tokens, scores = _topk_children(root_logprobs.unsqueeze(1), k, token_map)  # [B, k]
    if depth == 1 or _stops(scores, stop_below):
        return _star(root_tokens, tokens, scores, min(budget, k))  # no expansion: the root's children
    front, tree_scores = _first_frontier(root_tokens, tokens, scores)
    for _ in range(1, depth):
        if _stops(tree_scores.gather(1, front.node_ids), stop_below):
            break  # no frontier node is likely enough to be worth drafting children for
        logprobs = expand(front)
        if logprobs.shape[:2] != front.tokens.shape:
            raise ValueError(f"expand must return [B, F] + [V] = {tuple(front.tokens.shape)} + [V], "
                             f"got {tuple(logprobs.shape)}")
        front, tree_scores = _next_frontier(front, tree_scores, logprobs, token_map)
    return _rerank(front.tree_tokens, front.tree_parents, tree_scores, budget)


def sampled(
    expand: Expand,
    root_tokens: torch.Tensor,
    q_root: torch.Tensor,
    depth: int = TreeConfig.depth,
    width: int = TreeConfig.topk,
    generators: Sequence[torch.Generator | None] | None = None,
    token_map: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> TreeBatch:
    """Trees sampled from the draft distribution q (SpecInfer): the root's ``width``
    children are drawn i.i.d. from ``q_root`` [B, V]; every deeper node gets ONE child
    drawn from ``expand(frontier)`` [B, F, V] (probabilities), down to ``depth``. So a
    tree is ``width`` sampled chains sharing the root (width 1: a Leviathan chain).

    Returns N = 1 + width * depth nodes and ``draft_probs`` [B, N, V]: row j is the q
    node j's children were drawn from (zeros at leaves). Verifying with
    ``sampling.verify(method="rejection", draft_probs=...)`` is lossless at any q.
    The frontiers handed to ``expand`` follow :class:`Frontier` (as :func:`dynamic`).
    With a draft vocabulary (EAGLE-3), q is over it and ``token_map`` [V'] maps its ids
    to target ids; ``draft_probs`` are then scattered into ``vocab_size`` target columns.
    """
    _validate_dynamic(root_tokens, q_root, depth, width, 1)
    to_target = functools.partial(_q_in_target_vocab, token_map=token_map, vocab_size=vocab_size)
    tokens = _mapped(_draw(q_root.unsqueeze(1), width, generators).flatten(1), token_map)  # [B, width]
    front, _ = _first_frontier(root_tokens, tokens, torch.zeros(tokens.shape, device=tokens.device))
    q_rows = [to_target(q_root.unsqueeze(1))]  # per node, in node order: [B, 1, V], then [B, F, V] per depth
    for _ in range(1, depth):
        q = expand(front)  # [B, F, V']
        q_rows.append(to_target(q))
        front = _chain_frontier(front, _mapped(_draw(q, 1, generators)[..., 0], token_map))
    bsz = root_tokens.shape[0]
    q_rows.append(q_rows[0].new_zeros(bsz, width, q_rows[0].shape[-1]))  # leaves draw nothing
    num_nodes = torch.full((bsz,), front.tree_tokens.shape[1], dtype=torch.long, device=tokens.device)
    return TreeBatch(front.tree_tokens, front.tree_parents, num_nodes, None, torch.cat(q_rows, 1))


def _mapped(draft_ids: torch.Tensor, token_map: torch.Tensor | None) -> torch.Tensor:
    return draft_ids if token_map is None else token_map[draft_ids]


def _q_in_target_vocab(q: torch.Tensor, token_map: torch.Tensor | None, vocab_size: int | None) -> torch.Tensor:
    """q [B, F, V'] over the draft vocabulary -> [B, F, vocab_size] (zeros off the map)."""
    if token_map is None:
        return q
    if vocab_size is None:
        raise ValueError("sampled trees with a token_map need vocab_size (the target's vocabulary size)")
    out = q.new_zeros(*q.shape[:-1], vocab_size)
    out[..., token_map] = q
    return out


def _draw(q: torch.Tensor, n: int, generators) -> torch.Tensor:
    """q [B, F, V] -> Long [B, F, n] i.i.d. draws per row; row b from generators[b]
    (all None: one batched draw from torch's default generator)."""
    bsz, width, vocab = q.shape
    if generators is None or all(g is None for g in generators):
        return torch.multinomial(q.reshape(-1, vocab).float(), n, replacement=True).view(bsz, width, n)
    return torch.stack([torch.multinomial(q[b].float(), n, replacement=True, generator=generators[b])
                        for b in range(bsz)])


def _chain_frontier(front: Frontier, child_tokens: torch.Tensor) -> Frontier:
    """One child per frontier node (child_tokens Long [B, F]): the next frontier."""
    bsz, width = child_tokens.shape
    n0 = front.tree_tokens.shape[1]
    slots = torch.arange(width, device=child_tokens.device).expand(bsz, width)
    return Frontier(
        depth=front.depth + 1,
        tokens=child_tokens,
        node_ids=slots + n0,
        parent_slot=slots,
        tree_tokens=torch.cat([front.tree_tokens, child_tokens], 1),
        tree_parents=torch.cat([front.tree_parents, front.node_ids], 1),
        expanded_mask=torch.cat([front.expanded_mask, _self_mask(bsz, width, child_tokens.device)], 2),
        positions=torch.full_like(slots, front.depth + 1),
    )


def _stops(front_scores: torch.Tensor, stop_below: float) -> bool:
    """Whether expansion stops: every frontier node's cumulative log-prob is below log(stop_below)."""
    return stop_below > 0 and float(front_scores.max()) < math.log(stop_below)


def _star(root_tokens, tokens, scores, keep: int) -> TreeBatch:
    """The tree of depth 1: the root's first `keep` children (tokens, scores [B, k], best
    first), what _rerank keeps of them (drafting order = rank order), without the frontier."""
    bsz = tokens.shape[0]
    dev = tokens.device
    parents = torch.zeros(bsz, keep + 1, dtype=torch.long, device=dev)
    parents[:, 0] = -1
    return TreeBatch(torch.cat([root_tokens.view(bsz, 1), tokens[:, :keep]], 1), parents,
                     torch.full((bsz,), keep + 1, dtype=torch.long, device=dev),
                     torch.cat([scores.new_zeros(bsz, 1), scores[:, :keep]], 1))


def _first_frontier(root_tokens, tokens, scores) -> tuple[Frontier, torch.Tensor]:
    """Depth 1: the root's top-k children (tokens, scores [B, k]); also all scores [B, 1 + k]."""
    bsz, k = tokens.shape
    dev = tokens.device
    node_ids = torch.arange(1, k + 1, device=dev).expand(bsz, k)
    root_col = torch.ones(bsz, k, 1, dtype=torch.bool, device=dev)
    front = Frontier(
        depth=1,
        tokens=tokens,
        node_ids=node_ids,
        parent_slot=torch.zeros(bsz, k, dtype=torch.long, device=dev),
        tree_tokens=torch.cat([root_tokens.view(bsz, 1), tokens], 1),
        tree_parents=torch.cat([torch.full((bsz, 1), -1, device=dev), torch.zeros_like(node_ids)], 1),
        expanded_mask=torch.cat([root_col, _self_mask(bsz, k, dev)], 2),  # [B, k, 1 + k]
        positions=torch.ones_like(node_ids),
    )
    return front, torch.cat([torch.zeros(bsz, 1, dtype=scores.dtype, device=dev), scores], 1)


def _self_mask(bsz: int, k: int, dev) -> torch.Tensor:
    return torch.eye(k, dtype=torch.bool, device=dev).expand(bsz, k, k)


def _next_frontier(front: Frontier, tree_scores, logprobs, token_map) -> tuple[Frontier, torch.Tensor]:
    """Draft top-k children of every frontier node (logprobs [B, F, V']); the k best by
    cumulative score form the next frontier. Returns it and the scores of all nodes."""
    bsz, k = front.tokens.shape
    child_tokens, child_logp = _topk_children(logprobs, k, token_map)  # [B, k*k], (slot, rank) order
    child_scores = tree_scores.gather(1, front.node_ids).repeat_interleave(k, 1) + child_logp
    n0 = front.tree_tokens.shape[1]
    best = child_scores.topk(k, dim=1).indices.sort(1).values  # [B, k] in drafting order
    parent_slot = best // k
    inherited = front.expanded_mask.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, front.expanded_mask.shape[-1]))
    nxt = Frontier(
        depth=front.depth + 1,
        tokens=child_tokens.gather(1, best),
        node_ids=best + n0,
        parent_slot=parent_slot,
        tree_tokens=torch.cat([front.tree_tokens, child_tokens], 1),
        tree_parents=torch.cat([front.tree_parents, front.node_ids.repeat_interleave(k, 1)], 1),
        expanded_mask=torch.cat([inherited, _self_mask(bsz, k, best.device)], 2),  # parent's row + self
        positions=torch.full_like(best, front.depth + 1),
    )
    return nxt, torch.cat([tree_scores, child_scores], 1)


def _rerank(tree_tokens, tree_parents, tree_scores, budget) -> TreeBatch:
    """Keep the ``budget`` best drafted nodes (closed under parents), root first."""
    bsz, n = tree_tokens.shape
    keep = min(budget, n - 1)
    rank_score = path_reduce(tree_scores, tree_parents, torch.minimum)  # parents rank >= children
    order = rank_score[:, 1:].sort(dim=1, descending=True, stable=True).indices[:, :keep] + 1
    kept = torch.cat([torch.zeros(bsz, 1, dtype=torch.long, device=order.device), order.sort(1).values], 1)
    new_id = torch.full((bsz, n), -1, dtype=torch.long, device=kept.device)
    new_id.scatter_(1, kept, torch.arange(keep + 1, device=kept.device).expand(bsz, -1))
    old_parents = tree_parents.gather(1, kept)
    parents = torch.where(old_parents >= 0, new_id.gather(1, old_parents.clamp(min=0)), old_parents)
    num_nodes = torch.full((bsz,), keep + 1, dtype=torch.long, device=kept.device)
    return TreeBatch(tree_tokens.gather(1, kept), parents, num_nodes, tree_scores.gather(1, kept))
