"""Tree verification for SGLang's `torch_native` attention backend, which has no
TARGET_VERIFY path of its own: `forward_extend_tree`, AROUND
`TorchNativeAttnBackend.forward_extend` (patches.py), handles verify batches and defers
every other batch to the original.

A verify batch holds `n` nodes per request in KV slots req_to_token[req, seq_len :
seq_len + n]; node i attends to the committed prefix and to the nodes j with
custom_mask[i, j], tree-only or prefix-included (common.sglang_trees.request_masks).
"""

from __future__ import annotations

from specplug.common.attention_masks import tree_sdpa
from specplug.common.sglang_trees import request_masks
from specplug.sglang_medusa import patches

TARGET = patches.FORWARD_EXTEND  # hooked AROUND (patches.py)


def forward_extend_tree(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
    """AROUND hook: TARGET_VERIFY batches get tree attention, all others the original."""
    spec_info = forward_batch.spec_info
    if not forward_batch.forward_mode.is_target_verify() or getattr(spec_info, "custom_mask", None) is None:
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kw)
    if layer.is_cross_attention or getattr(layer, "sliding_window_size", None) not in (None, -1):
        raise NotImplementedError(
            f"specplug tree verification on torch_native supports causal self-attention "
            f"without a sliding window; layer {layer.layer_id} is not: use another attention backend")
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    n = spec_info.draft_token_num
    seq_lens = forward_batch.seq_lens.tolist()
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)  # [bs * n, heads, head_dim]
    o = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    # a single node (a step verifying only the root) sees its whole prefix: no mask needed
    masks = request_masks(spec_info.custom_mask, seq_lens, n) if n > 1 else [None] * len(seq_lens)
    for b, (req, seq_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(), seq_lens)):
        slots = req_to_token[req, : seq_len + n].long()
        o[b * n:(b + 1) * n] = tree_sdpa(
            q_[b * n:(b + 1) * n], k_cache, v_cache, slots, masks[b], layer.scaling,
            layer.tp_q_head_num != layer.tp_k_head_num)
    return o.reshape(q_.shape[0], -1)
