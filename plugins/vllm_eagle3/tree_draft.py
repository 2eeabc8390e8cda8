"""EAGLE-2 dynamic trees for a vLLM batch: specplug.common.tree.dynamic drives, the dense
EAGLE-3 head expands each frontier against its request's committed head KV.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specplug.common.tree import Frontier, TreeBatch, dynamic
from specplug.vllm_eagle3.dense_head import Segment


class Root(NamedTuple):
    """One request's last committed position, as the head's catch-up step left it."""

    token: int  # the root token (last committed, not yet seen by the target)
    logprobs: torch.Tensor  # [draft_vocab] draft log-probs of the first draft token
    hidden: torch.Tensor  # [H] head pre-norm output: hidden input of the root's children
    position: int  # position of the root's KV entry (the last entry of the cache)
    key: torch.Tensor  # [S, kv_heads, head_dim] committed head KV, root's entry last
    value: torch.Tensor


def draft_trees(head, roots: list[Root], depth: int, topk: int, budget: int, stop_below: float = 0.0) -> TreeBatch:
    """EAGLE-2 trees (tree.dynamic) for a batch of roots; a node at depth d runs at
    position root.position + d and attends to its request's cache plus its ancestors."""
    expand = _Expander(head, roots)
    return dynamic(
        expand,
        torch.tensor([r.token for r in roots]),
        torch.stack([r.logprobs for r in roots]),  # [B, draft_vocab]
        depth=depth, topk=topk, budget=budget, token_map=head.token_map, stop_below=stop_below,
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
