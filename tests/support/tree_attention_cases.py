"""Test support (not product code): verify passes for specplug's stage-tree Triton kernel
(specplug.common.cuda.tree_attention_triton) built without any engine, and their float64
torch reference.

A pass is a paged KV cache in vLLM's Triton-backend layout ([num_blocks, 2, block_size,
kv_heads, head_dim], unbound into key / value views) with shuffled block tables over random
blocks, queries, and per-request trees packed by `pack_tree_masks` (None: causal rows). Used by
tests/cuda/test_tree_attention_triton.py (the kernel on a GPU and under Triton's interpreter),
tests/vllm/test_tree_attention_triton.py (which adds vLLM's CPU cache over the same blocks) and
bench/gpu_tree_attention.py (timings against dense attention).
"""

from __future__ import annotations

import torch

from specplug.common import tree as T
from specplug.common.dynamic_trees import dynamic
from specplug.common.static_trees import chain, from_choices
from specplug.common.cuda.tree_attention_triton import pack_tree_masks

KV_HEADS, DIM, NUM_BLOCKS = 2, 32, 40
# The kernel's arguments in a case dict, in tree_attention's order (then `tile`).
KERNEL_ARGUMENTS = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc", "mask",
                    "mask_start", "scale")


def random_parents(n: int, g: torch.Generator) -> torch.Tensor:
    """A random tree of n nodes, root first: node i's parent uniform over 0..i-1."""
    return torch.tensor([-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)])


def dynamic_tree() -> torch.Tensor:
    """One EAGLE-2 dynamic tree's parents (dynamic_trees.dynamic over random draft log-probs)."""
    g = torch.Generator().manual_seed(2)
    vocab = 50

    def expand(front):
        return torch.randn(1, front.tokens.shape[1], vocab, generator=g).log_softmax(-1)

    batch = dynamic(expand, torch.tensor([7]), torch.randn(1, vocab, generator=g).log_softmax(-1),
                      depth=3, topk=2, budget=6)
    return batch.parents[0, : int(batch.num_nodes[0])]


def _tree(context: int, parents: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    return context, parents, parents.shape[0]


def cases() -> dict[str, dict]:
    """name -> requests [(context length, parents or None: causal, query rows)], block size, tile, heads:
    chains, a Medusa static tree, an EAGLE-2 dynamic tree, hand-made and random trees, mixed prefill /
    decode / tree batches of 4, GQA 4/2 and 6/2, tiles spanning blocks and blocks spanning tiles."""
    g = torch.Generator().manual_seed(1)
    medusa = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]).parents
    shapes = [_tree(5, medusa), _tree(33, torch.tensor([-1, 0, 0, 1, 1, 2, 3])), _tree(2, dynamic_tree()),
              _tree(50, random_parents(20, g))]  # 20 rows: several query blocks
    mixed = [(0, None, 23), _tree(70, random_parents(12, g)), (30, None, 1), _tree(9, torch.tensor([-1, 0, 0, 0, 0]))]
    chains = [_tree(3, chain(4).parents), _tree(40, chain(2).parents), _tree(17, chain(7).parents),
              _tree(1, chain(0).parents)]
    return {
        "chains": dict(requests=chains, block_size=16, tile=32, heads=4),
        "shapes": dict(requests=shapes, block_size=16, tile=16, heads=4),
        "mixed": dict(requests=mixed, block_size=32, tile=16, heads=4),
        "groups 3": dict(requests=shapes, block_size=16, tile=32, heads=6),
    }


def paged_inputs(spec: dict, seed: int, causal: bool = False, *, kv_heads: int = KV_HEADS, dim: int = DIM,
                 num_blocks: int | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:
    """One verify pass of `spec` (as in cases()): the kernel's arguments (KERNEL_ARGUMENTS, `tile`) on
    `device` plus `parents` (per request; None: causal). causal=True packs causal masks instead of the
    trees (a negative control). num_blocks: the cache's blocks (default NUM_BLOCKS, or just enough + 8
    when that is too few). Queries and cache are drawn in float32 and rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    block_size, heads = spec["block_size"], spec["heads"]
    requests = spec["requests"]
    seq_lens = [c + n for c, _, n in requests]
    needed = sum(-(-s // block_size) for s in seq_lens)
    num_blocks = num_blocks or (NUM_BLOCKS if needed <= NUM_BLOCKS else needed + 8)
    width = max(-(-s // block_size) for s in seq_lens) + 1
    order = torch.randperm(num_blocks, generator=g)  # every request's blocks distinct, shuffled
    block_table = torch.randint(num_blocks, (len(requests), width), generator=g, dtype=torch.int32)  # padding: any
    used = 0
    for b, s in enumerate(seq_lens):
        count = -(-s // block_size)
        block_table[b, :count] = order[used:used + count].int()
        used += count
    device_g = torch.Generator(device).manual_seed(seed)
    kv_cache = torch.randn(num_blocks, 2, block_size, kv_heads, dim, generator=device_g, device=device)  # vLLM Triton
    query_lens = [n for _, _, n in requests]
    parents = [None if causal else p for _, p, _ in requests]
    mask, mask_start = pack_tree_masks(parents, query_lens)
    key_cache, value_cache = kv_cache.to(dtype).unbind(1)
    query = torch.randn(sum(query_lens), heads, dim, generator=device_g, device=device).to(dtype)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int().to(device),
                mask=mask.to(device), mask_start=mask_start.to(device), scale=dim ** -0.5, tile=spec["tile"],
                parents=[p for _, p, _ in requests])


def visible(parents: torch.Tensor | None, context: int, n: int) -> torch.Tensor:
    """Bool [n, context + n]: the keys each of a request's query rows sees (its committed prefix, then
    its ancestors and itself; the rows before it and itself without a tree)."""
    tree = torch.ones(n, n, dtype=torch.bool).tril() if parents is None else T.ancestor_mask(parents.cpu())
    return torch.cat([torch.ones(n, context, dtype=torch.bool), tree], 1)


def reference(case: dict) -> torch.Tensor:
    """Float64 attention of every row over its request's prefix + ancestors (causal without a tree),
    computed on CPU copies; returned as float32 [T, heads, head_dim] on the CPU."""
    q, keys_all, values_all = (case[k].detach().cpu().double() for k in ("query", "key_cache", "value_cache"))
    groups = q.shape[1] // keys_all.shape[2]
    block_size = keys_all.shape[1]
    starts = case["query_start_loc"].tolist()
    block_table = case["block_table"].cpu()
    out = torch.empty_like(q)
    for b, (parents, s) in enumerate(zip(case["parents"], case["seq_lens"].tolist())):
        n = starts[b + 1] - starts[b]
        positions = torch.arange(s)
        blocks = block_table[b, positions // block_size].long()
        k = keys_all[blocks, positions % block_size].repeat_interleave(groups, 1)  # [s, heads, D]
        v = values_all[blocks, positions % block_size].repeat_interleave(groups, 1)
        scores = torch.einsum("nhd,shd->hns", q[starts[b]:starts[b + 1]], k) * case["scale"]
        weights = scores.masked_fill(~visible(parents, s - n, n), float("-inf")).softmax(-1)
        out[starts[b]:starts[b + 1]] = torch.einsum("hns,shd->nhd", weights, v)
    return out.float()


def branching_rows(case: dict) -> list[int]:
    """Flat query rows whose visible keys differ from causal ones (rows with a sibling among their
    would-be causal predecessors): where a tree mask and a causal mask give different outputs."""
    starts = case["query_start_loc"].tolist()
    rows = []
    for b, parents in enumerate(case["parents"]):
        if parents is not None:
            mask = T.ancestor_mask(parents.cpu())
            rows += [starts[b] + int(r) for r in (mask != torch.ones_like(mask).tril()).any(1).nonzero().flatten()]
    return rows
