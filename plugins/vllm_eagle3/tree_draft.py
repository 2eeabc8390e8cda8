"""EAGLE-2 dynamic trees for a vLLM batch: specplug.common.tree.dynamic drives, the dense
EAGLE-3 head expands each frontier against its request's committed head KV.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specplug.common.tree import Frontier, TreeBatch, dynamic, path_reduce, tree_depths
from specplug.vllm_eagle3.dense_head import Segment


class Root(NamedTuple):
    """One request's last committed position, as the head's catch-up step left it."""

    token: int  # the root token (last committed, not yet seen by the target)
    logprobs: torch.Tensor  # [draft_vocab] draft log-probs of the first draft token
    hidden: torch.Tensor  # [H] head pre-norm output: hidden input of the root's children
    position: int  # position of the root's KV entry (the last entry of the cache)
    key: torch.Tensor  # [S, kv_heads, head_dim] committed head KV, root's entry last
    value: torch.Tensor


def draft_trees(head, roots: list[Root], depth: int, topk: int, budget: int) -> TreeBatch:
    """EAGLE-2 trees (tree.dynamic) for a batch of roots; a node at depth d runs at
    position root.position + d and attends to its request's cache plus its ancestors."""
    expand = _Expander(head, roots)
    return dynamic(
        expand,
        torch.tensor([r.token for r in roots]),
        torch.stack([r.logprobs for r in roots]),  # [B, draft_vocab]
        depth=depth, topk=topk, budget=budget, token_map=head.token_map,
    )


class _Expander:
    """The expand callback: one head step per request over its frontier nodes."""

    def __init__(self, head, roots: list[Root]):
        self.head, self.roots = head, roots
        self.tree_kv = [(r.key[:0], r.value[:0]) for r in roots]  # frontier KV, in call order
        self.hidden = [r.hidden[None] for r in roots]  # [F_prev, H] the previous call's outputs

    def __call__(self, front: Frontier) -> torch.Tensor:
        batch, width = front.tokens.shape  # [B, F]
        segments = []
        for b, root in enumerate(self.roots):
            tree_key, tree_value = self.tree_kv[b]
            context = root.key.shape[0] - 1  # committed entries before the root's
            mask = torch.cat([front.expanded_mask[b].new_ones(width, context),
                              front.expanded_mask[b]], dim=1)  # [F, S + E - 1]
            segments.append(Segment(slice(b * width, (b + 1) * width), torch.cat([root.key, tree_key]),
                                    torch.cat([root.value, tree_value]), mask))
        parent_hidden = torch.cat([self.hidden[b][front.parent_slot[b]] for b in range(batch)])  # [B*F, H]
        positions = (torch.tensor([r.position for r in self.roots])[:, None] + front.positions).flatten()
        step = self.head.step(front.tokens.flatten(), parent_hidden, positions, segments)
        for b in range(batch):
            rows = slice(b * width, (b + 1) * width)
            tree_key, tree_value = self.tree_kv[b]
            self.tree_kv[b] = (torch.cat([tree_key, step.key[rows]]), torch.cat([tree_value, step.value[rows]]))
            self.hidden[b] = step.hidden[rows]
        return step.logprobs.view(batch, width, -1)  # [B, F, draft_vocab]


def full_budget(depth: int, topk: int, draft_vocab: int) -> int:
    """Nodes tree.dynamic drafts in all (root excluded): keeping all of them keeps every leaf."""
    k = min(topk, draft_vocab)
    return k + (depth - 1) * k * k


def best_chains(trees: TreeBatch, depth: int) -> torch.Tensor:
    """Long [B, depth]: the chain stage A hands vLLM. It is the root path with the largest
    expected accepted length under the draft's own probabilities (sum over its nodes of
    exp(cumulative log-prob)), at any depth; a path shorter than `depth` is padded by
    repeating its last token (vLLM schedules exactly `depth` drafts; verification stays
    exact whatever they are). Measured on the test bed this beats both the best-scoring
    deepest node (beam search) and requiring a full-depth path."""
    depths = tree_depths(trees.parents)  # [B, N]
    reach = torch.where(depths > 0, trees.scores.exp(), torch.zeros_like(trees.scores))
    expected = path_reduce(reach, trees.parents, torch.add)  # [B, N]
    node = expected.argmax(dim=1)  # [B]
    length = depths.gather(1, node[:, None]).squeeze(1)  # [B] path length, >= 1
    chain = torch.empty(trees.candidates.shape[0], depth, dtype=torch.long)
    for d in range(depth - 1, -1, -1):
        on_path = d < length  # [B] walk up only once position d is on the path
        chain[:, d] = trees.candidates.gather(1, node[:, None]).squeeze(1)
        node = torch.where(on_path, trees.parents.gather(1, node[:, None]).squeeze(1), node)
    return chain
