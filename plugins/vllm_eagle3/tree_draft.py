"""EAGLE-2 dynamic tree drafting for one request with the dense EAGLE-3 head.

Each depth expands the `topk` best frontier nodes (by cumulative draft log-prob) into
their `topk` best children; only expanded nodes run the head. The tree's nodes are the
root (the last committed token) plus every scored child; parents[0] = -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftedTree:
    tokens: torch.Tensor  # [N] node 0 = root token
    parents: torch.Tensor  # [N] parents[0] = -1, parents[i] < i
    scores: torch.Tensor  # [N] cumulative draft log-prob (root 0)
    depth: torch.Tensor  # [N] root 0

    def best_path_tokens(self, depth: int) -> torch.Tensor:
        """Draft tokens [depth] on the path to the best-scoring node at `depth`."""
        deepest = (self.depth == depth).nonzero().flatten()
        node = int(deepest[self.scores[deepest].argmax()])
        path = []
        while node > 0:
            path.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return torch.tensor(path[::-1], dtype=torch.long)


def draft_tree(head, root, cache, base_position: int, depth: int, topk: int) -> DraftedTree:
    """root = (logprobs [vocab], hidden [H], token) of the last committed position; cache has
    the request's committed head KV; a node at depth d runs at position base_position + d - 1."""
    root_logprobs, root_hidden, root_token = root
    tokens, parents, scores, depths = [root_token], [-1], [0.0], [0]
    # frontier: node ids whose children are scored next, with their logprobs/hidden
    frontier, frontier_logprobs, frontier_hidden = [0], root_logprobs[None], root_hidden[None]
    tree_key, tree_value = cache.key.new_zeros(0, *cache.key.shape[1:]), cache.value.new_zeros(0, *cache.value.shape[1:])
    tree_rows: list[int] = []  # node id of each row of tree_key / tree_value
    for d in range(1, depth + 1):
        child_parent, child_token, child_score = _top_children(
            frontier, frontier_logprobs, torch.tensor([scores[f] for f in frontier]), topk)
        first_new = len(tokens)
        for p, t, s in zip(child_parent, child_token, child_score):
            tokens.append(t), parents.append(p), scores.append(s), depths.append(d)
        new_nodes = list(range(first_new, len(tokens)))
        if d == depth or not new_nodes:
            break
        expand = new_nodes[:topk]  # children are sorted by score: the best topk are expanded
        parent_rows = [frontier.index(parents[n]) for n in expand]
        mask = _tree_mask(expand, parents, tree_rows, cache.length)
        step = head.step(torch.tensor([tokens[n] for n in expand]), frontier_hidden[parent_rows],
                         torch.full((len(expand),), base_position + d - 1, dtype=torch.long),
                         torch.cat([cache.key, tree_key]), torch.cat([cache.value, tree_value]), mask)
        tree_key, tree_value = torch.cat([tree_key, step.key]), torch.cat([tree_value, step.value])
        tree_rows += expand
        frontier, frontier_logprobs, frontier_hidden = expand, step.logprobs, step.hidden
    return DraftedTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores), torch.tensor(depths))


def _top_children(frontier, logprobs, frontier_scores, topk):
    """The topk best (parent, token, cumulative score) over all frontier children, best first.
    logprobs [F, vocab]; children with -inf log-prob (outside the draft vocab) are dropped."""
    k = min(topk, logprobs.shape[-1])
    child_lp, child_tok = logprobs.topk(k, dim=-1)  # [F, k]
    cum = frontier_scores[:, None] + child_lp  # [F, k]
    best = cum.flatten().topk(min(topk, cum.numel()))
    out = []
    for score, flat in zip(best.values.tolist(), best.indices.tolist()):
        if score == float("-inf"):
            continue
        row, col = divmod(flat, k)
        out.append((frontier[row], int(child_tok[row, col]), score))
    return ([p for p, _, _ in out], [t for _, t, _ in out], [s for _, _, s in out])


def _tree_mask(rows, parents, tree_rows, committed):
    """Bool [len(rows), committed + len(tree_rows) + len(rows)]: every committed position,
    the processed ancestors of each row, and the row itself."""
    mask = torch.zeros(len(rows), committed + len(tree_rows) + len(rows), dtype=torch.bool)
    mask[:, :committed] = True
    column = {node: committed + i for i, node in enumerate(tree_rows)}
    for r, node in enumerate(rows):
        mask[r, committed + len(tree_rows) + r] = True
        ancestor = parents[node]
        while ancestor > 0:
            mask[r, column[ancestor]] = True
            ancestor = parents[ancestor]
    return mask
