"""torch_native tree verification (plugins/sglang_medusa/tree_attention.py) without an engine:
the hook over a paged KV cache against the per-path oracle of tests/common/test_tree_sdpa.py."""

from types import SimpleNamespace

import pytest
import torch

from specplug.sglang_medusa import tree_attention as ta
from tests.common.test_tree_sdpa import DIM, HEADS, KV_HEADS, _ancestors, _path_attention, _tree


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
