"""Tree attention over a paged KV cache (attention_masks.tree_sdpa) under SGLang's verify
masks (sglang_trees.request_masks). The oracle: node i of a draft tree must see exactly what
a plain decode of its root->i path would see, i.e. attention over the prefix followed by
the path's keys."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from specplug.common.attention_masks import tree_sdpa
from specplug.common.sglang_trees import request_masks
from specplug.common.tree import DraftTree

HEADS, KV_HEADS, DIM = 4, 2, 8  # GQA like the tiny Llama


def _tree():
    return DraftTree(torch.zeros(7, dtype=torch.long), torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


def _path_attention(q_i, keys, values, prefix_len, path):
    """Reference for one node: plain attention over prefix + the node's root->i path."""
    idx = torch.cat([torch.arange(prefix_len), prefix_len + path])
    k = keys[idx].movedim(0, 1).unsqueeze(0)
    v = values[idx].movedim(0, 1).unsqueeze(0)
    out = scaled_dot_product_attention(q_i.movedim(0, 1).unsqueeze(0), k, v, enable_gqa=True)
    return out.squeeze(0).movedim(1, 0)


def _ancestors(tree, i):
    path, node = [], i
    while node >= 0:
        path.append(node)
        node = int(tree.parents[node])
    return torch.tensor(path[::-1])


@pytest.mark.parametrize("prefix_len", [1, 9])
def test_tree_sdpa_equals_per_path_attention(prefix_len):
    torch.manual_seed(prefix_len)
    tree = _tree()
    n = tree.num_nodes
    keys, values = torch.randn(prefix_len + n, KV_HEADS, DIM), torch.randn(prefix_len + n, KV_HEADS, DIM)
    query = torch.randn(n, HEADS, DIM)
    slots = torch.arange(prefix_len + n)
    mask = request_masks(tree.attention_mask().flatten(), [prefix_len], n)[0]
    out = tree_sdpa(query, keys, values, slots, mask, None, True)
    for i in range(n):
        ref = _path_attention(query[i:i + 1], keys, values, prefix_len, _ancestors(tree, i))
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-6)
    # negative control: a causal (chain) mask over the same nodes is wrong for a tree
    chain = request_masks(torch.ones(n, n).tril().bool().flatten(), [prefix_len], n)[0]
    wrong = tree_sdpa(query, keys, values, slots, chain, None, True)
    assert not torch.allclose(wrong, out, atol=1e-4)


def test_root_only_step_needs_no_mask():
    """A verify step of the root alone (adaptive speculation choosing none) runs unmasked:
    the same as plain attention over prefix + root, i.e. a decode step's attention."""
    torch.manual_seed(3)
    keys, values, query = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM), torch.randn(1, HEADS, DIM)
    out = tree_sdpa(query, keys, values, torch.arange(6), None, None, True)
    torch.testing.assert_close(out, _path_attention(query, keys, values, 5, torch.tensor([0])), rtol=1e-5, atol=1e-6)


def test_request_masks_reads_both_layouts():
    tree = _tree()
    n, seq_lens = tree.num_nodes, [3, 5]
    tree_only = tree.attention_mask().flatten().repeat(2)
    with_prefix = torch.cat([torch.cat([torch.ones(n, s, dtype=torch.bool), tree.attention_mask()], 1).flatten()
                             for s in seq_lens])
    for a, b in zip(request_masks(tree_only, seq_lens, n), request_masks(with_prefix, seq_lens, n)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="custom_mask has"):
        request_masks(torch.ones(10, dtype=torch.bool), seq_lens, n)
