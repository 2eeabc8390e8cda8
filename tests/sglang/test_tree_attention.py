"""torch_native tree verification (plugins/sglang_medusa/tree_attention.py) without an engine.

The oracle: node i of a draft tree must see exactly what a plain decode of its
root->i path would see, i.e. attention over the prefix followed by the path's keys."""

from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from specplug.common.tree import DraftTree
from specplug.sglang_medusa import tree_attention as ta

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
    mask = ta.request_masks(tree.attention_mask().flatten(), [prefix_len], n)[0]
    out = ta.tree_sdpa(query, keys, values, slots, mask, None, True)
    for i in range(n):
        ref = _path_attention(query[i:i + 1], keys, values, prefix_len, _ancestors(tree, i))
        torch.testing.assert_close(out[i:i + 1], ref, rtol=1e-5, atol=1e-6)
    # negative control: a causal (chain) mask over the same nodes is wrong for a tree
    chain = ta.request_masks(torch.ones(n, n).tril().bool().flatten(), [prefix_len], n)[0]
    wrong = ta.tree_sdpa(query, keys, values, slots, chain, None, True)
    assert not torch.allclose(wrong, out, atol=1e-4)


def test_root_only_step_needs_no_mask():
    """A verify step of the root alone (adaptive speculation choosing none) runs unmasked:
    the same as plain attention over prefix + root, i.e. a decode step's attention."""
    torch.manual_seed(3)
    keys, values, query = torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM), torch.randn(1, HEADS, DIM)
    out = ta.tree_sdpa(query, keys, values, torch.arange(6), None, None, True)
    torch.testing.assert_close(out, _path_attention(query, keys, values, 5, torch.tensor([0])), rtol=1e-5, atol=1e-6)


def test_request_masks_reads_both_layouts():
    tree = _tree()
    n, seq_lens = tree.num_nodes, [3, 5]
    tree_only = tree.attention_mask().flatten().repeat(2)
    with_prefix = torch.cat([torch.cat([torch.ones(n, s, dtype=torch.bool), tree.attention_mask()], 1).flatten()
                             for s in seq_lens])
    for a, b in zip(ta.request_masks(tree_only, seq_lens, n), ta.request_masks(with_prefix, seq_lens, n)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="custom_mask has"):
        ta.request_masks(torch.ones(10, dtype=torch.bool), seq_lens, n)


def _fake_verify_call(prefix_len, tree):
    """A backend / layer / forward batch just rich enough for forward_extend_tree."""
    n = tree.num_nodes
    total = prefix_len + n
    k_cache, v_cache = torch.zeros(32, KV_HEADS, DIM), torch.zeros(32, KV_HEADS, DIM)
    slots = torch.randperm(32)[:total]  # paged: slots need not be contiguous
    k_cache[slots[:prefix_len]] = torch.randn(prefix_len, KV_HEADS, DIM)
    v_cache[slots[:prefix_len]] = torch.randn(prefix_len, KV_HEADS, DIM)

    def set_kv_buffer(layer, loc, k, v):
        k_cache[loc.loc if hasattr(loc, "loc") else loc[0]] = k.view(-1, KV_HEADS, DIM)
        v_cache[loc.loc if hasattr(loc, "loc") else loc[0]] = v.view(-1, KV_HEADS, DIM)

    pool = SimpleNamespace(set_kv_buffer=set_kv_buffer, get_key_buffer=lambda i: k_cache,
                           get_value_buffer=lambda i: v_cache)
    backend = SimpleNamespace(token_to_kv_pool=pool, swa_out_cache_loc=None,
                              req_to_token_pool=SimpleNamespace(req_to_token=slots.view(1, -1)))
    layer = SimpleNamespace(is_cross_attention=False, sliding_window_size=-1, layer_id=0, tp_q_head_num=HEADS,
                            tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM, scaling=None)
    mode = SimpleNamespace(is_target_verify=lambda: True)
    batch = SimpleNamespace(forward_mode=mode, out_cache_loc=slots[prefix_len:], seq_lens=torch.tensor([prefix_len]),
                            req_pool_indices=torch.tensor([0]),
                            spec_info=SimpleNamespace(custom_mask=tree.attention_mask().flatten(), draft_token_num=n))
    return backend, layer, batch, k_cache, v_cache, slots


def test_forward_extend_tree_writes_kv_and_attends_over_paged_cache(monkeypatch):
    import sglang.srt.mem_cache.memory_pool as memory_pool

    monkeypatch.setattr(memory_pool, "KVWriteLoc", lambda loc, swa: (loc, swa))
    torch.manual_seed(0)
    tree = _tree()
    n, prefix = tree.num_nodes, 6
    backend, layer, batch, k_cache, v_cache, slots = _fake_verify_call(prefix, tree)
    q, k, v = torch.randn(n, HEADS * DIM), torch.randn(n, KV_HEADS * DIM), torch.randn(n, KV_HEADS * DIM)
    out = ta.forward_extend_tree(lambda *a, **kw: pytest.fail("original called"), backend, q, k, v, layer, batch)
    assert torch.equal(k_cache[slots[prefix:]], k.view(n, KV_HEADS, DIM))
    keys, values = k_cache[slots], v_cache[slots]
    for i in range(n):
        ref = _path_attention(q.view(n, HEADS, DIM)[i:i + 1], keys, values, prefix, _ancestors(tree, i))
        torch.testing.assert_close(out.view(n, HEADS, DIM)[i:i + 1], ref, rtol=1e-5, atol=1e-6)


def test_forward_extend_tree_defers_non_verify_batches():
    calls = []
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False), spec_info=None)
    result = ta.forward_extend_tree(lambda *a, **kw: calls.append(a) or "original", "backend", 1, 2, 3, "layer",
                                    batch, save_kv_cache=False)
    assert result == "original" and calls == [("backend", 1, 2, 3, "layer", batch, False)]
