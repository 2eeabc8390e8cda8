"""Draft-tree structure: parents, depth, tokens, masks, positions, paths, padding and batching.

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

Builders live beside it: :mod:`specplug.common.static_trees` (chain, Medusa static trees,
optimal_sparse) and :mod:`specplug.common.dynamic_trees` (EAGLE-2 dynamic, sampled from q);
SGLang's verify layouts in :mod:`specplug.common.sglang_trees`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "TreeConfig",
    "DraftTree",
    "TreeBatch",
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


def full_tree_nodes(topk: int, depth: int) -> int:
    """Draft nodes of the complete topk-ary tree of ``depth`` levels, root excluded."""
    return sum(topk ** d for d in range(1, depth + 1))


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
    drawn i.i.d. from q (:func:`specplug.common.dynamic_trees.sampled`): row j is the q node j's children were drawn
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
