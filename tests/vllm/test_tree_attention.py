"""Stage "tree" attention: the recomputed rows (tree_attention._tree_rows over whole cache
blocks) equal plain grouped-query attention over the context plus each node's ancestors,
with keys and values written by vLLM's own cache op; a chain mask would differ."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

import torch

from specplug.common.tree import ancestor_mask
from specplug.vllm_eagle3 import paged_kv
from specplug.common.paged_tree_attention import TreeRows, pad_trees
from specplug.vllm_eagle3.tree_attention import TreeCPUAttentionImpl

pytestmark = pytest.mark.vllm

BLOCK, KV_HEADS, GROUPS, DIM = 32, 2, 3, 32
PARENTS = torch.tensor([-1, 0, 0, 1, 2, 0])  # root, two branches, a third child: rows 2-5 differ from a chain


def _requests():
    """Two requests: (batch row, context length, block table), contexts crossing blocks."""
    return [(0, 21, [7, 3, 0]), (1, 70, [5, 1, 8])]


def _setup():
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(10, KV_HEADS, BLOCK, 2 * DIM)
    n = PARENTS.shape[0]
    keys, values, trees, seq_lens, query_rows = {}, {}, [], [], 0
    for row, context, table in _requests():
        length = context + n
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // BLOCK] * BLOCK + positions % BLOCK
        k = torch.randn(length, KV_HEADS, DIM, generator=gen)
        v = torch.randn(length, KV_HEADS, DIM, generator=gen)
        paged_kv.write(cache, "vec", slots, k, v)
        keys[row], values[row] = k, v
        mask = ancestor_mask(PARENTS)
        differs = (mask != torch.ones_like(mask).tril()).any(dim=1).nonzero().flatten()
        trees.append(TreeRows(row, query_rows, mask, differs))
        seq_lens.append(length)
        query_rows += n
    metadata = SimpleNamespace(seq_lens=torch.tensor(seq_lens),
                               block_table=torch.tensor([table for _, _, table in _requests()], dtype=torch.int32))
    query = torch.randn(query_rows, KV_HEADS * GROUPS, DIM, generator=gen)
    return cache, keys, values, trees, metadata, query


def _reference(q, k, v, visible, scale):
    """Plain attention of q [heads, D] over keys/values [S, kv_heads, D] where visible Bool [S]."""
    k, v = k[visible].repeat_interleave(GROUPS, 1), v[visible].repeat_interleave(GROUPS, 1)  # [S', heads, D]
    weights = torch.softmax(torch.einsum("hd,shd->hs", q, k) * scale, -1)
    return torch.einsum("hs,shd->hd", weights, v).flatten()


def test_recomputed_rows_equal_attention_over_context_and_ancestors():
    cache, keys, values, trees, metadata, query = _setup()
    impl = TreeCPUAttentionImpl.__new__(TreeCPUAttentionImpl)
    impl.scale = DIM ** -0.5
    output = torch.zeros(query.shape[0], KV_HEADS * GROUPS * DIM)
    batch = pad_trees(trees, metadata, BLOCK, KV_HEADS, GROUPS, torch.float32)
    impl._tree_rows(batch, query, cache, output)
    chain = torch.ones(PARENTS.shape[0], PARENTS.shape[0], dtype=torch.bool).tril()
    checked = 0
    for tree, (_, context, _) in zip(trees, _requests()):
        for node in range(PARENTS.shape[0]):
            got = output[tree.root_row + node]
            if node not in tree.rows.tolist():
                assert not got.any(), "a row vLLM's kernel computes exactly must be left alone"
                continue
            row_keys, row_values = keys[tree.batch_row], values[tree.batch_row]
            visible = torch.cat([torch.ones(context, dtype=torch.bool), tree.mask[node]])
            expected = _reference(query[tree.root_row + node], row_keys, row_values, visible, impl.scale)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            as_chain = torch.cat([torch.ones(context, dtype=torch.bool), chain[node]])  # negative control
            assert not torch.allclose(got, _reference(query[tree.root_row + node], row_keys, row_values,
                                                      as_chain, impl.scale), atol=1e-3)
            checked += 1
    assert checked == 8  # rows 2-5 of both trees
