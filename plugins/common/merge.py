"""Hybrid draft trees: candidates of several drafters merged into one tree under one budget.

Each source (an EAGLE-3 or Medusa head, the retrieval drafter, ...) proposes a tree
whose `scores` are log estimated acceptance of each node's whole path (root 0). The
merged tree holds every distinct path of any source once (a trie over tokens) with the
best score any source gives it, and keeps the `budget` best nodes. Invariants: a
node's score never exceeds its parent's in any source, so it never does after the max
either, and the kept nodes (best first, shallower first on ties) always include their
parents; node ids are such that parents precede children. One target pass verifies the
result like any other tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from specplug.common.tree import DraftTree, TreeBatch, stack_trees


def merge_trees(sources: Sequence[TreeBatch], budget: int) -> TreeBatch:
    """Merge per-request trees of several sources (same batch order, same roots) into one
    TreeBatch of at most `budget` draft nodes per request; scores Float [B, N] log."""
    if not sources:
        raise ValueError("merge_trees needs at least one source tree batch")
    if any(s.scores is None for s in sources):
        raise ValueError("every source must carry scores (log estimated acceptance per node)")
    return stack_trees([_merge_one([_request(s, b) for s in sources], budget)
                        for b in range(len(sources[0].num_nodes))])


def _request(batch: TreeBatch, b: int):
    """(tokens, parents, log scores) lists of request b's real nodes."""
    n = int(batch.num_nodes[b])
    return (batch.candidates[b, :n].tolist(), batch.parents[b, :n].tolist(), batch.scores[b, :n].tolist())


def _merge_one(trees, budget: int) -> DraftTree:
    """One request: trie of all paths with the max score, then the `budget` best nodes."""
    root = trees[0][0][0]
    nodes = {(): 0.0}  # path tokens -> best log score
    for tokens, parents, scores in trees:
        paths = [()]
        for i in range(1, len(tokens)):
            path = paths[parents[i]] + (tokens[i],)
            paths.append(path)
            nodes[path] = max(nodes.get(path, float("-inf")), scores[i])
    kept = sorted((p for p in nodes if p), key=lambda p: (-nodes[p], len(p)))[:budget]
    index = {(): 0}
    out_tokens, out_parents, out_scores = [root], [-1], [0.0]
    for path in kept:  # parents come first: a parent's score >= its child's, ties shallower first
        if path[:-1] not in index:  # a source broke monotone scores: never keep an orphan
            continue
        index[path] = len(out_tokens)
        out_tokens.append(path[-1])
        out_parents.append(index[path[:-1]])
        out_scores.append(nodes[path])
    return DraftTree(out_tokens, out_parents, out_scores)
