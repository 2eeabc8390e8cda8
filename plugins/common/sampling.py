"""Verification samplers: which drafted tokens the target accepts, and the bonus token.

One public entry point, :func:`verify`, batched over requests (see docs/core.md):

* ``"greedy"``: the accepted path is the deepest root path whose every token is the
  target's argmax (first maximal index) at its parent, ties to the lowest node id
  (so of two equal-token siblings the one with the longer agreeing subtree wins);
  bonus = argmax after the last accepted node.
* ``"rejection"`` without ``draft_probs`` (deterministic drafting, the EAGLE / SGLang
  "target-only" rule): at each node test its children in node-id order; accept child
  x when ``u < p_res(x) / sum(p_res)``; on rejection set ``p_res(x) = 0``; if no child
  is accepted the final token is drawn from ``p_res``. Lossless.
* ``"rejection"`` with ``draft_probs`` (Leviathan / Chen for chains, SpecInfer
  multi-draft for trees; children must be drawn i.i.d. from q): accept x when
  ``u * q(x) < p_res(x)``; on rejection ``p_res = norm(max(0, p_res - q))``. Lossless.
* ``"coupled"`` (deterministic drafting): the target samples the token after every
  node by inverse CDF, ``x_j = F_{p_j}^{-1}(u_d)`` with u_d the draw of the node's
  DEPTH d (``uniforms[:, d]``); a child is accepted when its token equals its parent's
  x; bonus = x of the last accepted node. Every emitted token is x of its position,
  an exact sample of p (lossless), and it never depends on the drafts: with
  :func:`position_uniforms` (a draw fixed by the request's seed and the token's
  position) a seeded request's output is the same whatever was drafted, batched or
  preempted. Acceptance equals the target-only rejection rule's (sum of p over the
  children), so it is that rule with reproducible randomness.
* ``"typical"``: Medusa-2 typical acceptance, LOSSY: accept x when
  ``p(x) > min(epsilon, delta * exp(-H(p)))``; keep the deepest accepted path.

Randomness is fully defined by ``uniforms`` [B, N+1] (``"coupled"``: column d is the
draw of depth d, see above) so that a CUDA kernel can
reproduce the torch path: ``uniforms[:, j]`` (j >= 1) is node j's acceptance draw,
``uniforms[:, 0]`` the draw for the final (bonus or recovered) token (column N is
spare: the contract reserves N+1 columns), sampled by
inverse CDF in vocabulary order: the first v with ``cumsum(p_final)[v] > u * total``,
``total`` = the last cumsum entry.

Additions beside the shared contract (all additive): ``verify(..., validate=True)``
(False skips the value checks on probabilities: one reduction pass and a host sync),
``randomness.draw_uniforms``, ``randomness.sample_inverse_cdf``,
``verify_result.VerifyResult.output_tokens``, ``target_probs.sampling_tensors``. On CUDA
tensors ``verify`` first offers the call to
``specplug.common.cuda.try_verify`` (greedy, rejection and coupled) after the uniforms are
drawn; ``num_nodes`` is always passed as a Long tensor [B].

Beside it: the target distribution p (``process_logits``, ``SamplingConfig``) in
:mod:`specplug.common.target_probs`, the randomness (``draw_uniforms``,
``position_uniforms``, ``sample_inverse_cdf``) in :mod:`specplug.common.randomness`, the
result type in :mod:`specplug.common.verify_result`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from specplug.common.target_probs import first_argmax
from specplug.common.tree import check_parents, children_table, earlier_siblings, path_reduce, tree_depths
from specplug.common.randomness import draw_uniforms, sample_inverse_cdf
from specplug.common.verify_result import VerifyResult

logger = logging.getLogger(__name__)

__all__ = [
    "METHODS",
    "TYPICAL_EPSILON",
    "TYPICAL_DELTA",
    "verify",
]

METHODS = ("greedy", "rejection", "coupled", "typical")
# Medusa-2 typical acceptance defaults (epsilon = hard threshold, delta = entropy factor);
# defined once here, the Medusa repo swaps them between two files.
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
# How far a row of probabilities may sum from 1 before verify rejects it.
SUM_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 2e-2}
DEFAULT_SUM_TOLERANCE = 1e-3


# --------------------------------------------------------------------------- input handling


class _Tree(NamedTuple):
    candidates: torch.Tensor  # [B, N]
    parents: torch.Tensor  # [B, N], padding -1
    num_nodes: torch.Tensor  # [B]
    real: torch.Tensor  # Bool [B, N]
    depth: torch.Tensor  # [B, N]
    max_depth: int


def flat_node_rows(num_nodes: torch.Tensor, width: int) -> torch.Tensor:
    """Long [B, width]: the flat row of node j of request b (request-major layout, b's
    num_nodes[b] rows consecutive); nodes past a request's last repeat its last row."""
    offsets = num_nodes.cumsum(0) - num_nodes  # [B]
    node = torch.arange(width, device=num_nodes.device)
    return offsets[:, None] + torch.minimum(node[None], num_nodes[:, None] - 1)


class _NodeRows:
    """Uniform access to per-node rows of [B, N, V] or flattened [sum(num_nodes), V]."""

    def __init__(self, x: torch.Tensor, tree: _Tree):
        self.x = x
        self.flat = x.dim() == 2
        bsz, n = tree.parents.shape
        self.batch = torch.arange(bsz, device=x.device)
        if self.flat:
            self.row = flat_node_rows(tree.num_nodes.to(x.device), n)  # [B, N]

    def per_node(self, fn):
        """fn reduces the vocab dim; result(s) laid out [B, N]."""
        if not self.flat:
            return fn(self.x)
        out = fn(self.x)
        return tuple(o[self.row] for o in out) if isinstance(out, tuple) else out[self.row]

    def rows(self, nodes: torch.Tensor, batch: torch.Tensor | None = None) -> torch.Tensor:
        """nodes Long [A] of requests ``batch`` [A] (default: all B) -> Float [A, V] (float32)."""
        batch = self.batch if batch is None else batch
        if self.flat:
            return self.x[self.row[batch, nodes]].float()
        return self.x[batch, nodes].float()

    def values(self, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """nodes, tokens Long [B, K] -> Float [B, K]: p at (node, token)."""
        if self.flat:
            return self.x[self.row.gather(1, nodes), tokens].float()
        return self.x[self.batch.unsqueeze(1), nodes, tokens].float()


def _check_tree(candidates, parents, num_nodes) -> _Tree:
    for name, t in (("candidates", candidates), ("parents", parents)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be a Long tensor [B, N], got {type(t).__name__} {getattr(t, 'dtype', '')}")
    if candidates.dim() != 2 or candidates.shape != parents.shape or candidates.numel() == 0:
        raise ValueError(
            f"candidates and parents must both be [B, N] with B, N >= 1, got {tuple(candidates.shape)} "
            f"and {tuple(parents.shape)}: stack trees with specplug.common.tree.stack_trees"
        )
    bsz, n = parents.shape
    parents = parents.long()
    if num_nodes is None:
        num_nodes = torch.full((bsz,), n, dtype=torch.long, device=parents.device)
    num_nodes = torch.as_tensor(num_nodes, device=parents.device).long()
    if num_nodes.shape != (bsz,) or bool(((num_nodes < 1) | (num_nodes > n)).any()):
        raise ValueError(f"num_nodes must be Long [B={bsz}] with 1 <= num_nodes <= N={n}, got {num_nodes.tolist()[:8]}")
    check_parents(parents, num_nodes)
    real = torch.arange(n, device=parents.device) < num_nodes.unsqueeze(1)
    parents = torch.where(real, parents, -1)
    depth = tree_depths(parents)
    return _Tree(candidates.long(), parents, num_nodes, real, depth, int(depth.max()))


def _check_probs(name: str, x: torch.Tensor | None, tree: _Tree, vocab: int | None = None) -> None:
    if x is None:
        return
    bsz, n = tree.parents.shape
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {type(x).__name__} {getattr(x, 'dtype', '')}")
    if x.dim() == 3 and x.shape[:2] == (bsz, n):
        pass
    elif x.dim() == 2 and x.shape[0] == int(tree.num_nodes.sum()):
        pass
    else:
        raise ValueError(
            f"{name} must be [B={bsz}, N={n}, V] or flattened [sum(num_nodes)={int(tree.num_nodes.sum())}, V], "
            f"got {tuple(x.shape)}: one row per tree node (pass num_nodes for the flattened layout)"
        )
    if vocab is not None and x.shape[-1] != vocab:
        raise ValueError(f"{name} has vocab {x.shape[-1]} but target_probs has {vocab}: use the same vocabulary")


def _check_tokens(tree: _Tree, vocab: int) -> None:
    drafted = tree.real & (tree.parents >= 0)
    bad = drafted & ((tree.candidates < 0) | (tree.candidates >= vocab))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(
            f"candidates[{b}, {j}] = {tree.candidates[b, j].item()} is outside the vocabulary [0, {vocab}) "
            f"of target_probs: draft tokens must be target token ids (map draft-vocab ids with d2t)"
        )


def _check_uniforms(uniforms: torch.Tensor, tree: _Tree) -> torch.Tensor:
    bsz, n = tree.parents.shape
    if uniforms.shape != (bsz, n + 1):
        raise ValueError(f"uniforms must be [B={bsz}, N+1={n + 1}], got {tuple(uniforms.shape)}")
    if bool(((uniforms < 0) | (uniforms >= 1) | uniforms.isnan()).any()):
        raise ValueError("uniforms must lie in [0, 1): draw them with torch.rand or draw_uniforms")
    return uniforms


def _check_sums(name: str, sums: torch.Tensor, rows: torch.Tensor, dtype) -> None:
    """sums Float [B, N] of rows that must be distributions (``rows`` Bool [B, N])."""
    tol = SUM_TOLERANCE.get(dtype, DEFAULT_SUM_TOLERANCE)
    bad = rows & ~((sums - 1.0).abs() <= tol)  # NaN / inf fail this test too
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} row of request {b}, node {j} sums to {sums[b, j].item():.6g} (NaN/inf or off 1 by more "
            f"than {tol}): pass probabilities from process_logits (for greedy, pass method='greedy')"
        )


# --------------------------------------------------------------------------- shared tree logic


def _earlier_siblings(tree: _Tree) -> torch.Tensor:
    """Bool [B, N, N]: [b, j, k] iff k < j are real siblings (padding parents are -1)."""
    return earlier_siblings(tree.parents)


def _duplicates(tree: _Tree, sib: torch.Tensor) -> torch.Tensor:
    """Bool [B, N]: node j repeats the token of an earlier sibling."""
    c = tree.candidates
    return (sib & (c.unsqueeze(2) == c.unsqueeze(1))).any(-1)


def _first_accepted(accept: torch.Tensor, sib: torch.Tensor) -> torch.Tensor:
    """Bool [B, N]: accepted and no earlier sibling accepted (children tested in id order)."""
    return accept & ~(sib & accept.unsqueeze(1)).any(-1)


def _deepest_path_end(chosen: torch.Tensor, tree: _Tree) -> torch.Tensor:
    """Last node [B] of the deepest root path whose every node is ``chosen``
    (ties: lowest node id)."""
    is_root = torch.zeros_like(chosen)
    is_root[:, 0] = True
    ok = path_reduce(chosen | is_root, tree.parents, torch.logical_and) & (tree.real | is_root)
    return torch.where(ok, tree.depth, -1).argmax(1)


def _parent_values(p: _NodeRows, tree: _Tree) -> torch.Tensor:
    """Float [B, N]: p at (parent of j, token of j); 0 at the root and padding."""
    drafted = tree.real & (tree.parents >= 0)
    vals = p.values(tree.parents.clamp(min=0), torch.where(drafted, tree.candidates, 0))
    return torch.where(drafted, vals, 0.0)


def _result(final: torch.Tensor, bonus: torch.Tensor, tree: _Tree) -> VerifyResult:
    bsz = final.shape[0]
    width = tree.max_depth + 1
    out = torch.full((bsz, width + 1), -1, dtype=torch.long, device=final.device)  # last column: scratch
    cur = final.clone()
    for _ in range(width):
        valid = cur >= 0
        col = torch.where(valid, tree.depth.gather(1, cur.clamp(min=0).unsqueeze(1)).squeeze(1), width)
        out.scatter_(1, col.unsqueeze(1), cur.unsqueeze(1))
        cur = torch.where(valid, tree.parents.gather(1, cur.clamp(min=0).unsqueeze(1)).squeeze(1), cur)
    num_accepted = tree.depth.gather(1, final.unsqueeze(1)).squeeze(1)
    return VerifyResult(out[:, :width], num_accepted, bonus)


# --------------------------------------------------------------------------- the methods


def _verify_greedy(p: _NodeRows, tree: _Tree, top: torch.Tensor):
    """top Float [B, N]: the max of each node's row. The accepted path is the deepest one
    agreeing with the argmax (first maximal index) everywhere (ties: lowest node id).

    One vectorised max pass over all rows; the first-maximal-index rule is then checked
    only on rows where a candidate hits the max, and argmax runs on the final rows only.
    """
    top_at_parent = top.gather(1, tree.parents.clamp(min=0))  # [B, N]
    hit = tree.real & (tree.parents >= 0) & (_parent_values(p, tree) == top_at_parent)
    b, j = hit.nonzero(as_tuple=True)
    if b.numel():
        first = first_argmax(p.rows(tree.parents[b, j], b))  # [K] first maximal index
        hit[b, j] = first == tree.candidates[b, j]
    final = _deepest_path_end(hit, tree)
    return final, first_argmax(p.rows(final))


def _target_only_accept(p: _NodeRows, tree: _Tree, p_sum: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Bool [B, N]: node j would be accepted when its earlier siblings were all rejected.

    p_res(x_j) = p[parent, x_j] (0 if an earlier sibling had the same token);
    sum(p_res) = rowsum(p[parent]) - sum of p over earlier distinct siblings.
    """
    sib = _earlier_siblings(tree)
    p_x = torch.where(_duplicates(tree, sib), 0.0, _parent_values(p, tree))  # [B, N]
    rejected_mass = (sib * p_x.unsqueeze(1)).sum(-1)  # [B, N]
    res_sum = p_sum.gather(1, tree.parents.clamp(min=0)) - rejected_mass
    ratio = torch.where(p_x > 0, p_x / torch.maximum(res_sum, p_x), 0.0)
    return _first_accepted(uniforms[:, : ratio.shape[1]] < ratio, sib)  # node j <-> column j


def _target_only_final(p: _NodeRows, tree: _Tree, final: torch.Tensor) -> torch.Tensor:
    """Float [B, V]: p after ``final`` with the tokens of all its children zeroed
    (they were all rejected); a leaf keeps its full row (the bonus distribution)."""
    row = p.rows(final)  # [B, V], a fresh copy
    b, j = (tree.real & (tree.parents == final.unsqueeze(1))).nonzero(as_tuple=True)  # children
    row[b, tree.candidates[b, j]] = 0.0
    return row


def _verify_target_only(p: _NodeRows, tree: _Tree, p_sum: torch.Tensor, uniforms: torch.Tensor):
    final = _deepest_path_end(_target_only_accept(p, tree, p_sum, uniforms), tree)
    dist = _target_only_final(p, tree, final)
    empty = ~(dist.sum(-1) > 0)  # rounding left no residual mass: use the unmodified row
    if bool(empty.any()):
        dist[empty] = p.rows(final[empty], p.batch[empty])
    return final, sample_inverse_cdf(dist, uniforms[:, 0])


def _verify_coupled(p: _NodeRows, tree: _Tree, uniforms: torch.Tensor):
    """x_j = inverse-CDF sample of p after node j with the draw of j's depth; accept the
    children equal to their parent's x; bonus = x at the deepest such path's end."""
    u = uniforms.gather(1, tree.depth)  # [B, N]: the draw for the token after node j
    b, j = tree.real.nonzero(as_tuple=True)
    x = torch.full_like(tree.candidates, -1)  # [B, N]
    x[b, j] = sample_inverse_cdf(p.rows(j, b), u[b, j])
    hit = tree.real & (tree.parents >= 0) & (tree.candidates == x.gather(1, tree.parents.clamp(min=0)))
    final = _deepest_path_end(hit, tree)
    return final, x.gather(1, final.unsqueeze(1)).squeeze(1)


def _specinfer_residual(p_res: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p_res - q)) per row [B, V]; keeps p_res where that is all zero (rounding)."""
    res = (p_res - q).clamp(min=0)
    total = res.sum(-1, keepdim=True)
    return torch.where(total > 0, res / total.clamp(min=1e-30), p_res)


def _verify_draft_probs(p: _NodeRows, q: _NodeRows, tree: _Tree, p_sum: torch.Tensor, uniforms: torch.Tensor):
    """SpecInfer multi-draft rejection (Leviathan for chains), one level at a time.

    Works on the still-walking rows only; a row stops at a node none of whose children
    is accepted (a leaf included) and draws its final token from its residual there.
    """
    table = children_table(tree.parents)  # [B, N, C]
    bsz = table.shape[0]
    cur = torch.zeros(bsz, dtype=torch.long, device=table.device)
    rows = torch.arange(bsz, device=table.device)  # [A] rows still walking
    final_dist = torch.empty(bsz, p.x.shape[-1], dtype=torch.float32, device=table.device)  # [B, V]
    p_res = p.rows(cur) / p_sum[rows, cur].unsqueeze(1)  # [A, V]
    for _ in range(tree.max_depth + 1):
        if rows.numel() == 0:
            break
        nxt, moved, p_res = _draft_probs_level(q, tree, table, rows, cur[rows], p_res, uniforms)
        final_dist[rows[~moved]] = p_res[~moved]
        cur[rows] = nxt
        rows, nodes = rows[moved], nxt[moved]
        p_res = p.rows(nodes, rows) / p_sum[rows, nodes].unsqueeze(1)
    return cur, sample_inverse_cdf(final_dist, uniforms[:, 0])


def _draft_probs_level(q: _NodeRows, tree: _Tree, table, rows, cur, p_res, uniforms):
    """Test the children of ``cur`` [A] (rows ``rows`` of the batch) in id order.

    Returns (next node [A], moved Bool [A], residual [A, V] where not moved)."""
    kids = table[rows, cur]  # [A, C]
    q_c = q.rows(cur, rows)  # [A, V]
    slot = torch.arange(rows.numel(), device=rows.device)
    moved = torch.zeros_like(rows, dtype=torch.bool)
    nxt = cur.clone()
    for s in range(kids.shape[1]):
        j = kids[:, s]
        testing = ~moved & (j >= 0)
        if not bool(testing.any()):
            break
        x = tree.candidates[rows, j.clamp(min=0)]
        u = uniforms[rows, j.clamp(min=0)]
        accept = testing & (u * q_c[slot, x] < p_res[slot, x])
        nxt = torch.where(accept, j, nxt)
        moved |= accept
        rejected = (testing & ~accept).nonzero().squeeze(1)
        if rejected.numel():
            p_res[rejected] = _specinfer_residual(p_res[rejected], q_c[rejected])
    return nxt, moved, p_res


def _verify_typical(p: _NodeRows, tree: _Tree, uniforms: torch.Tensor, epsilon: float, delta: float):
    """LOSSY Medusa-2 typical acceptance; deepest passing path, bonus ~ p[last]."""
    entropy = p.per_node(lambda x: -torch.special.xlogy(x.float(), x.float()).sum(-1))  # [B, N]
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)
    passes = (tree.real & (tree.parents >= 0)
              & (_parent_values(p, tree) > threshold.gather(1, tree.parents.clamp(min=0))))
    final = _deepest_path_end(passes, tree)
    return final, sample_inverse_cdf(p.rows(final), uniforms[:, 0])


def _try_cuda(candidates, parents, target_probs, draft_probs, method, num_nodes, uniforms):
    try:
        from specplug.common import cuda as _cuda

        try_verify = _cuda.try_verify
    except (ImportError, AttributeError):
        return None
    return try_verify(
        candidates, parents, target_probs, draft_probs, method=method, num_nodes=num_nodes, uniforms=uniforms
    )


def verify(
    candidates: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    method: str = "greedy",
    num_nodes: torch.Tensor | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    uniforms: torch.Tensor | None = None,
    typical_epsilon: float = TYPICAL_EPSILON,
    typical_delta: float = TYPICAL_DELTA,
    validate: bool = True,
) -> VerifyResult:
    """Verify a batch of draft trees against the target; see the module docstring.

    candidates, parents: Long [B, N] (node 0 = root; padding parents -1).
    target_probs: Float [B, N, V] or flattened [sum(num_nodes), V]: target
        distribution of the token AFTER each node, from :func:`process_logits`
        (greedy: logits are fine, argmax only).
    draft_probs: same layout, the distribution each node's children were drawn
        from i.i.d.; None = deterministic drafting (target-only rule). Used by
        "rejection" only.
    num_nodes: Long [B] real nodes per row (default all N).
    generators / uniforms: randomness, see :func:`draw_uniforms`; not drawn for greedy.
    validate: check probability rows (sum to 1 within tolerance, no NaN/inf).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    tree = _check_tree(candidates, parents, num_nodes)
    _check_probs("target_probs", target_probs, tree)
    _check_probs("draft_probs", draft_probs, tree, vocab=target_probs.shape[-1])
    _check_tokens(tree, target_probs.shape[-1])
    if method != "greedy":
        if uniforms is None:
            uniforms = draw_uniforms(*tree.parents.shape, generators, device=target_probs.device)
        uniforms = _check_uniforms(uniforms.to(target_probs.device), tree)
    p = _NodeRows(target_probs, tree)
    q = _NodeRows(draft_probs, tree) if method == "rejection" and draft_probs is not None else None
    reduced = _validate_values(p, q, tree, method) if validate else None
    if method == "coupled" and draft_probs is not None:
        raise ValueError('method "coupled" is for deterministic drafting (draft_probs None); drafts drawn '
                         'from q need method "rejection"')
    if target_probs.is_cuda and method in ("greedy", "rejection", "coupled"):
        result = _try_cuda(candidates, tree.parents, target_probs, None if q is None else draft_probs,
                           method, tree.num_nodes, uniforms)
        if result is not None:
            return result
    reduced = _reduce_rows(p, method) if reduced is None else reduced
    if method == "greedy":
        final, bonus = _verify_greedy(p, tree, reduced)
    elif method == "typical":
        final, bonus = _verify_typical(p, tree, uniforms, typical_epsilon, typical_delta)
    elif method == "coupled":
        final, bonus = _verify_coupled(p, tree, uniforms)
    elif q is None:
        final, bonus = _verify_target_only(p, tree, reduced, uniforms)
    else:
        final, bonus = _verify_draft_probs(p, q, tree, reduced, uniforms)
    return _result(final, bonus, tree)


def _reduce_rows(p: _NodeRows, method: str) -> torch.Tensor:
    """Float [B, N]: each row's max (greedy; NaN propagates) or its sum (float32)."""
    if method == "greedy":
        return p.per_node(lambda x: x.amax(-1).float())
    return p.per_node(lambda x: x.sum(-1, dtype=torch.float32))


def _validate_values(p: _NodeRows, q: _NodeRows | None, tree: _Tree, method: str) -> torch.Tensor:
    """Raise on NaN logits (greedy) or rows that are not distributions; returns
    :func:`_reduce_rows` of p, which the torch path reuses."""
    reduced = _reduce_rows(p, method)
    if method == "greedy":
        if bool((reduced.isnan() & tree.real).any()):
            raise ValueError("target_probs contains NaN: check the target's logits")
        return reduced
    _check_sums("target_probs", reduced, tree.real, p.x.dtype)
    if q is not None:
        has_child = torch.zeros_like(tree.real)
        has_child.scatter_(1, tree.parents.clamp(min=0), tree.real & (tree.parents >= 0))
        _check_sums("draft_probs", _reduce_rows(q, method), has_child, q.x.dtype)
    return reduced
