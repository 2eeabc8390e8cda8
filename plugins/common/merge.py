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
    check_sources(sources)
    return stack_trees([_merge_one(trees, budget) for trees in zip(*(requests(s) for s in sources))])


def check_sources(sources: Sequence[TreeBatch]) -> None:
    """Refuse what no merge can use: no source, or a source without scores."""
    if not sources:
        raise ValueError("merge_trees needs at least one source tree batch")
    if any(s.scores is None for s in sources):
        raise ValueError("every source must carry scores (log estimated acceptance per node)")


def requests(batch: TreeBatch) -> list[tuple[list, list, list]]:
    """(tokens, parents, log scores) lists of each request's real nodes (one host copy
    per field for the whole batch)."""
    candidates, parents, scores = batch.candidates.tolist(), batch.parents.tolist(), batch.scores.tolist()
    return [(candidates[b][:n], parents[b][:n], scores[b][:n]) for b, n in enumerate(batch.num_nodes.tolist())]


def trie(trees) -> dict[tuple, float]:
    """Every distinct root path (a tuple of tokens; () the root) of one request's trees
    [(tokens, parents, log scores)] with the best score any of them gives it."""
    nodes = {(): 0.0}  # path tokens -> best log score
    for tokens, parents, scores in trees:
        paths = [()]
        for i in range(1, len(tokens)):
            path = paths[parents[i]] + (tokens[i],)
            paths.append(path)
            nodes[path] = max(nodes.get(path, float("-inf")), scores[i])
    return nodes


def ranked(nodes: dict[tuple, float], budget: int | None = None) -> list[tuple]:
    """The `budget` best draft paths of a trie (None: all), best first, shallower first
    on ties, each after its parent: a path ranked before its parent (a source broke
    monotone scores) is dropped, never kept as an orphan. merge_trees numbers its nodes
    in this order."""
    kept, out = {()}, []
    for path in sorted((p for p in nodes if p), key=lambda p: (-nodes[p], len(p)))[:budget]:
        if path[:-1] in kept:
            kept.add(path)
            out.append(path)
    return out


def _merge_one(trees, budget: int) -> DraftTree:
    """One request: trie of all paths with the max score, then the `budget` best nodes."""
    nodes = trie(trees)
    index = {(): 0}
    out_tokens, out_parents, out_scores = [trees[0][0][0]], [-1], [0.0]
    for path in ranked(nodes, budget):
        index[path] = len(out_tokens)
        out_tokens.append(path[-1])
        out_parents.append(index[path[:-1]])
        out_scores.append(nodes[path])
    return DraftTree(out_tokens, out_parents, out_scores)


class MergedDrafter:
    """The hybrid drafting of the engines for the reference loop: several
    `specplug.common.drafters.Drafter`s (a head, the retrieval drafter) given the same
    prefill and commits, their trees merged each step under the tree's budget.

    Invariant: every source sees the same committed tokens, so their trees share each
    request's root (the last committed token). Hidden states are the first source's
    (`target_hidden_layers`); a source that ignores them (retrieval) is given them too.
    """

    def __init__(self, drafters: Sequence):
        if not drafters:
            raise ValueError("MergedDrafter needs at least one drafter")
        self.drafters = list(drafters)

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        return self.drafters[0].target_hidden_layers(num_target_layers)

    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        for d in self.drafters:
            d.prefill(request_ids, prompt_ids, hidden, first_tokens)

    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        for d in self.drafters:
            d.commit(request_ids, accepted_tokens, hidden, bonus)

    def draft(self, request_ids, tree) -> TreeBatch:
        """Each source's tree for `tree`, merged into `tree.budget` nodes per request."""
        return merge_trees([d.draft(request_ids, tree) for d in self.drafters], tree.budget)

    def release(self, request_ids) -> None:
        for d in self.drafters:
            d.release(request_ids)
