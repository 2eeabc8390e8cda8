"""Draft-tree structure: parents, depth, tokens, masks, positions, paths, and builders.

Conventions (the shared core contract, see docs/core.md):

* Node 0 is the root: the last token already committed. ``parents[0] == -1`` and
  ``parents[i] < i`` for every other node, so node ids are a topological order.
* Children of a node are tested by the verifier in increasing node-id order, so
  builders put the sibling they trust most first.
* ``budget`` counts DRAFT nodes, root excluded: a tree has ``budget + 1`` nodes.
  SGLang's ``speculative_num_draft_tokens`` is ``budget + 1``; vLLM's
  ``num_speculative_tokens`` for a chain is ``budget``.
* Batched trees are padded to a common node count ``N`` with ``parents = -1`` and
  ``num_nodes [B]`` saying how many nodes of each row are real.

Builders: :func:`chain`, :func:`from_choices` (Medusa static trees),
:func:`optimal_sparse` (Medusa paper section 3.1) and :func:`dynamic` (EAGLE-2).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "TreeConfig",
    "DraftTree",
    "TreeBatch",
    "Frontier",
    "chain",
    "from_choices",
    "fill_static",
    "optimal_sparse",
    "dynamic",
    "sampled",
    "stack_trees",
    "stack_batches",
    "check_parents",
    "tree_depths",
    "path_reduce",
    "sibling_rank",
    "earlier_siblings",
    "children_table",
    "ancestor_mask",
    "retrieve_paths",
    "pad_batch",
]


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class TreeConfig:
    """Draft-tree settings; the defaults here are the project's ONE set of defaults.

    depth:  maximum draft depth (a chain of ``depth`` tokens at most).
    topk:   children expanded per frontier node and frontier width (EAGLE-2), or
            top-k candidates per Medusa head.
    budget: draft nodes kept, root excluded (tree has ``budget + 1`` nodes).
    stop_below: EAGLE-2 drafting stops expanding once no frontier node's cumulative
            draft probability reaches it (0: always draft ``depth`` levels); saves the
            draft steps whose children would almost surely be rejected.

    Defaults suit a 2-core CPU (a 16-node verify pass costs about a 4-token pass
    there); GPU deployments use larger budgets (EAGLE-2: depth 6, topk 10, budget 60).
    """

    depth: int = 4
    topk: int = 4
    budget: int = 15
    stop_below: float = 0.0

    def __post_init__(self) -> None:
        for name in ("depth", "topk", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TreeConfig.{name} must be an int >= 1, got {value!r}: "
                    f"pass a positive {name}"
                )
        if not isinstance(self.stop_below, (int, float)) or not 0.0 <= self.stop_below < 1.0:
            raise ValueError(f"TreeConfig.stop_below must be a probability in [0, 1), got {self.stop_below!r}: "
                             "0 turns early stopping off")

    @property
    def num_nodes(self) -> int:
        """Nodes in a full tree, root included (SGLang's num_draft_tokens)."""
        return self.budget + 1

    @property
    def static_nodes(self) -> int:
        """Draft nodes (root excluded) of the static tree built from per-depth top-k
        candidates (Medusa): a chain of ``depth`` when topk == 1, else ``budget`` capped
        at the full tree, which is all optimal_sparse can fill."""
        if self.topk == 1:
            return self.depth
        return min(self.budget, full_tree_nodes(self.topk, self.depth))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TreeConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(
                f"TreeConfig got unknown keys {sorted(unknown)}; expected a subset of "
                f"{sorted(known)}: remove the extra keys"
            )
        return cls(**data)


# --------------------------------------------------------------------------- batched structure helpers


def _as_long(name: str, x) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}: pass token/node ids as torch.long")
    return t.long()


def check_parents(parents: torch.Tensor, num_nodes: torch.Tensor | None = None, name: str = "parents") -> None:
    """Raise ValueError unless ``parents`` [..., N] describes valid trees.

    Invariants checked on the first ``num_nodes`` nodes of every row: node 0 has
    parent -1, every other node i has 0 <= parent < i. Padding nodes are not checked.
    """
    if parents.dim() < 1 or parents.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., N] with N >= 1, got {tuple(parents.shape)}")
    n = parents.shape[-1]
    ids = torch.arange(n, device=parents.device)
    real = torch.ones_like(parents, dtype=torch.bool)
    if num_nodes is not None:
        real = ids < num_nodes.unsqueeze(-1)
    if bool((parents[..., 0] != -1).any()):
        given = parents[..., 0].flatten()[:8].tolist()
        raise ValueError(f"{name}[..., 0] must be -1 (node 0 is the root), got {given}")
    bad = real[..., 1:] & ((parents[..., 1:] < 0) | (parents[..., 1:] >= ids[1:]))
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} is not a tree: node {where[-1] + 1} at index {where[:-1]} has parent "
            f"{parents[tuple(where[:-1]) + (where[-1] + 1,)].item()}; every node i >= 1 needs "
            f"0 <= parent < i (number nodes in topological order, root = 0)"
        )


def _steps_for(n: int) -> int:
    """Pointer-jumping rounds that cover any path in an n-node tree."""
    return max(1, math.ceil(math.log2(max(n, 2))) + 1)


def path_reduce(values: torch.Tensor, parents: torch.Tensor, op) -> torch.Tensor:
    """Reduce ``op`` over each node and all its ancestors: [..., N] -> [..., N].

    ``op`` must be associative (torch.add, torch.minimum, torch.logical_and, ...).
    Pointer jumping: O(log N) gathers, no host sync. Padding nodes (parent -1)
    keep their own value.
    """
    val = values.clone()
    jump = parents.clone()
    for _ in range(_steps_for(parents.shape[-1])):
        valid = jump >= 0
        safe = jump.clamp(min=0)
        val = torch.where(valid, op(val, val.gather(-1, safe)), val)
        jump = torch.where(valid, jump.gather(-1, safe), jump)
    return val


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, root 0: parents [..., N] -> depth [..., N] (long).

    Padding nodes (parent -1) get depth 0.
    """
    return path_reduce((parents >= 0).long(), parents, torch.add)


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self mask: parents [..., N] -> Bool [..., N, N].

    ``mask[..., i, j]`` is True iff j == i or j is an ancestor of i (row i may attend
    to column j). Padding nodes attend only to themselves.
    """
    ids = torch.arange(parents.shape[-1], device=parents.device)
    mask = ids.unsqueeze(-1) == ids  # [N, N] self
    cur = parents
    for _ in range(parents.shape[-1]):
        if not bool((cur >= 0).any()):
            break
        mask = mask | (cur.unsqueeze(-1) == ids)  # -1 matches no column
        cur = torch.where(cur >= 0, parents.gather(-1, cur.clamp(min=0)), cur)
    return mask.expand(*parents.shape, parents.shape[-1]).clone()


def retrieve_paths(parents: torch.Tensor) -> torch.Tensor:
    """Root->leaf node ids of one tree: parents [N] -> Long [leaves, max_depth + 1], -1 padded.

    Leaves are listed in increasing node id.
    """
    n = parents.shape[0]
    has_child = torch.zeros(n, dtype=torch.bool)
    has_child[parents[parents >= 0]] = True
    leaves = (~has_child).nonzero().flatten()
    depth = tree_depths(parents)
    paths = torch.full((len(leaves), int(depth.max()) + 1), -1, dtype=torch.long)
    cur = leaves.clone()
    while bool((cur >= 0).any()):
        valid = cur >= 0
        rows = valid.nonzero().flatten()
        paths[rows, depth[cur[rows]]] = cur[rows]
        cur = torch.where(valid, parents[cur.clamp(min=0)], cur)
    return paths


def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """Bool [..., N, N]: ``[..., j, k]`` iff k < j and both have the same parent (>= 0)."""
    n = parents.shape[-1]
    same = (parents.unsqueeze(-1) == parents.unsqueeze(-2)) & (parents.unsqueeze(-1) >= 0)
    return same & torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)


def sibling_rank(parents: torch.Tensor) -> torch.Tensor:
    """Rank of each node among its siblings in node-id order: [..., N] -> [..., N] (root 0)."""
    return earlier_siblings(parents).sum(-1)


def children_table(parents: torch.Tensor) -> torch.Tensor:
    """Children of every node in id order: parents [B, N] -> Long [B, N, C], -1 padded
    (C = the largest fan-out in the batch, at least 1)."""
    rank = sibling_rank(parents)  # [B, N]
    child = parents >= 0
    fan_out = int(rank[child].max()) + 1 if bool(child.any()) else 1
    bsz, n = parents.shape
    table = torch.full((bsz, n + 1, fan_out), -1, dtype=torch.long, device=parents.device)
    slot = torch.where(child, parents, n)  # roots and padding go to scratch row n
    ids = torch.arange(n, device=parents.device).expand(bsz, n)
    table[torch.arange(bsz, device=parents.device).unsqueeze(1), slot, rank.clamp(max=fan_out - 1)] = ids
    return table[:, :n]


# --------------------------------------------------------------------------- one tree


@dataclass(frozen=True)
class DraftTree:
    """One request's draft tree.

    tokens:  Long [N], token at each node (node 0: the root = last committed token).
    parents: Long [N], parents[0] = -1, 0 <= parents[i] < i.
    scores:  optional Float [N], cumulative draft log-prob of each node (root 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = _as_long("tokens", self.tokens)
        parents = _as_long("parents", self.parents)
        if tokens.dim() != 1 or parents.shape != tokens.shape:
            raise ValueError(
                f"tokens and parents must both have shape [N], got {tuple(tokens.shape)} and "
                f"{tuple(parents.shape)}: pass one request's tree (use stack_trees for a batch)"
            )
        check_parents(parents)
        if self.scores is not None and torch.as_tensor(self.scores).shape != tokens.shape:
            given = tuple(torch.as_tensor(self.scores).shape)
            raise ValueError(f"scores must have shape {tuple(tokens.shape)}, got {given}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @functools.cached_property
    def depth(self) -> torch.Tensor:
        """Long [N], root 0."""
        return tree_depths(self.parents)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def attention_mask(self) -> torch.Tensor:
        """Bool [N, N]: row i may attend to column j iff j is i or an ancestor of i."""
        return ancestor_mask(self.parents)

    def positions(self, offset: int = 0) -> torch.Tensor:
        """Long [N] = offset + depth (offset = position of the root token)."""
        return self.depth + offset

    def retrieve_paths(self) -> torch.Tensor:
        """Long [leaves, max_depth + 1]: node ids root->leaf, -1 padded."""
        return retrieve_paths(self.parents)

    def choices(self) -> list[list[int]]:
        """Medusa choices of a TEMPLATE tree (tokens = top-k ranks): the rank path of
        every draft node in node order; ``from_choices(t.choices())`` rebuilds ``t``."""
        toks, pars = self.tokens.tolist(), self.parents.tolist()
        paths: list[list[int]] = [[]]
        for i in range(1, self.num_nodes):
            paths.append(paths[pars[i]] + [toks[i]])
        return paths[1:]

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def with_tokens(self, tokens: torch.Tensor) -> "DraftTree":
        return DraftTree(tokens, self.parents, self.scores)


class TreeBatch(NamedTuple):
    """Padded batch of trees: candidates/parents Long [B, N], num_nodes Long [B].

    scores: optional Float [B, N] (cumulative draft log-probs).
    draft_probs: optional Float [B, N, V], set only by drafters whose children are
    drawn i.i.d. from q (:func:`sampled`): row j is the q node j's children were drawn
    from; verify with ``method="rejection"`` and these ``draft_probs``.
    """

    candidates: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    scores: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None

    def unbind(self) -> list[DraftTree]:
        out = []
        for b in range(self.candidates.shape[0]):
            n = int(self.num_nodes[b])
            s = None if self.scores is None else self.scores[b, :n]
            out.append(DraftTree(self.candidates[b, :n], self.parents[b, :n], s))
        return out


def stack_trees(trees: Sequence[DraftTree]) -> TreeBatch:
    """list[DraftTree] -> (candidates [B, N], parents [B, N], num_nodes [B]), padded with -1 parents.

    Padding candidates are 0. Scores, when every tree has them, are padded with -inf.
    """
    if not trees:
        raise ValueError("stack_trees needs at least one DraftTree, got an empty list")
    n = max(t.num_nodes for t in trees)
    bsz = len(trees)
    candidates = torch.zeros(bsz, n, dtype=torch.long)
    parents = torch.full((bsz, n), -1, dtype=torch.long)
    have_scores = all(t.scores is not None for t in trees)
    scores = torch.full((bsz, n), -math.inf) if have_scores else None
    for b, t in enumerate(trees):
        candidates[b, : t.num_nodes] = t.tokens
        parents[b, : t.num_nodes] = t.parents
        if scores is not None:
            scores[b, : t.num_nodes] = torch.as_tensor(t.scores, dtype=scores.dtype)
    num_nodes = torch.tensor([t.num_nodes for t in trees], dtype=torch.long)
    return TreeBatch(candidates, parents, num_nodes, scores)


def pad_batch(batch: TreeBatch, width: int) -> TreeBatch:
    """``batch`` with N widened to ``width`` >= N: padding nodes have parents -1, candidates 0,
    scores -inf and draft_probs 0, and num_nodes is unchanged, so verification never
    accepts them and ``ancestor_mask`` lets each see only itself."""
    n = batch.candidates.shape[1]
    if width < n:
        raise ValueError(f"pad_batch width {width} is below the batch's {n} nodes: pass width >= {n}")

    def pad(x: torch.Tensor | None, value: float):
        if x is None or width == n:
            return x
        trailing = [0, 0] * (x.dim() - 2)  # F.pad lists the last dim first: pad only dim 1
        return torch.nn.functional.pad(x, trailing + [0, width - n], value=value)

    return TreeBatch(pad(batch.candidates, 0), pad(batch.parents, -1), batch.num_nodes,
                     pad(batch.scores, -math.inf), pad(batch.draft_probs, 0.0))


def stack_batches(batches: Sequence[TreeBatch]) -> TreeBatch:
    """Concatenate TreeBatches along the batch, padding N (:func:`pad_batch`);
    scores / draft_probs kept only when every batch has them."""
    if not batches:
        raise ValueError("stack_batches needs at least one TreeBatch, got an empty list")
    n = max(b.candidates.shape[1] for b in batches)
    padded = [pad_batch(b, n) for b in batches]

    def cat(name: str):
        parts = [getattr(b, name) for b in padded]
        return None if any(p is None for p in parts) else torch.cat(parts)

    return TreeBatch(cat("candidates"), cat("parents"), cat("num_nodes"), cat("scores"), cat("draft_probs"))


def chain_batch(num_drafts: Sequence[int], draft_tokens: torch.Tensor) -> TreeBatch:
    """Flat chains as a padded TreeBatch: request b's num_drafts[b] draft tokens follow
    those of the requests before it in draft_tokens Long [sum(num_drafts)] (an engine's
    chain layout). Node 0 is the root, whose token verify never reads (0 here)."""
    num_drafts = list(num_drafts)
    if num_drafts and all(n == num_drafts[0] for n in num_drafts):  # one length: a reshape
        batch, k = len(num_drafts), num_drafts[0]
        candidates = torch.cat([torch.zeros(batch, 1, dtype=torch.long),
                                draft_tokens.to(torch.long).cpu().view(batch, k)], 1)
        return TreeBatch(candidates, torch.arange(-1, k).repeat(batch, 1), torch.full((batch,), k + 1))
    num_nodes = torch.as_tensor(num_drafts, dtype=torch.long) + 1
    node = torch.arange(int(num_nodes.max()))
    real = node[None] < num_nodes[:, None]  # [B, N]
    parents = torch.where(real, node[None] - 1, -1)  # chain: node i's parent is i - 1
    candidates = torch.zeros(real.shape, dtype=torch.long)
    candidates[:, 1:][real[:, 1:]] = draft_tokens.to(torch.long).cpu()
    return TreeBatch(candidates, parents, num_nodes)


def is_chain(parents: torch.Tensor) -> bool:
    """parents Long [n]: node i's parent is i - 1 for every i."""
    return bool(torch.equal(parents, torch.arange(-1, parents.shape[0] - 1)))


def pad_parents(parents: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """Per-tree parents (Long [n_b] each, n_b <= width) as Long [B, width], padded with -1."""
    out = torch.full((len(parents), width), -1, dtype=torch.long)
    for b, p in enumerate(parents):
        out[b, : p.shape[0]] = p
    return out


# --------------------------------------------------------------------------- static builders


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


def full_tree_nodes(topk: int, depth: int) -> int:
    """Draft nodes of the complete topk-ary tree of ``depth`` levels, root excluded."""
    return sum(topk ** d for d in range(1, depth + 1))


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
