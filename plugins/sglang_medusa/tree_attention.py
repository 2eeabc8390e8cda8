"""Tree verification for SGLang's `torch_native` attention backend (TARGET_VERIFY).

SGLang 0.5.23's TorchNativeAttnBackend has no TARGET_VERIFY path: its extend kernel
ignores `spec_info.custom_mask` and needs `extend_prefix_lens`, which a verify batch
does not carry. `forward_extend_tree` is installed AROUND
`TorchNativeAttnBackend.forward_extend` (through SGLang's HookRegistry, in
`register()`: patch "TorchNativeAttnBackend.forward_extend" in patches.py); it handles
verify batches and defers every other batch to the original.

A verify batch holds `n` draft-tree nodes per request, written to KV slots
req_to_token[req, seq_len : seq_len + n]. Node i attends to the whole committed prefix
and to the tree nodes j with custom_mask[i, j] (itself and its ancestors). The mask
comes either tree-only (`[bs * n * n]`, what SGLang builds on CPU) or with the prefix
columns included (`[sum(n * (seq_len + n))]`, what it builds on GPU); both are read.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from specplug.sglang_medusa import patches

TARGET = patches.FORWARD_EXTEND  # hooked AROUND (patches.py)


def request_masks(custom_mask: torch.Tensor, seq_lens: list[int], n: int) -> list[torch.Tensor]:
    """Split a verify batch's flat custom_mask into per-request Bool [n, seq_len + n]
    (True = may attend), accepting the tree-only and the prefix-included layouts."""
    bs = len(seq_lens)
    flat = custom_mask.reshape(-1).bool()
    if flat.numel() == bs * n * n:  # tree-only: the prefix is always visible
        trees = flat.view(bs, n, n)
        return [torch.cat([trees.new_ones(n, s), trees[b]], dim=1) for b, s in enumerate(seq_lens)]
    sizes = [n * (s + n) for s in seq_lens]
    if flat.numel() < sum(sizes):
        raise ValueError(
            f"custom_mask has {flat.numel()} entries; expected {bs * n * n} (tree only) or "
            f"at least {sum(sizes)} (prefix + tree) for seq_lens {seq_lens} and {n} draft "
            "tokens per request: the speculative worker built an inconsistent verify batch")
    return [m.view(n, s + n) for m, s in zip(flat[: sum(sizes)].split(sizes), seq_lens)]


def tree_sdpa(query, k_cache, v_cache, token_slots, mask, scaling, enable_gqa):
    """Attention for one request's tree nodes over prefix + tree.

    query [n, heads, head_dim]; k_cache/v_cache [slots, kv_heads, head_dim];
    token_slots Long [seq_len + n] (KV slot of every visible position); mask Bool
    [n, seq_len + n], or None when every node sees every position. Returns [n, heads, head_dim].
    """
    key = k_cache[token_slots].movedim(0, 1).to(query.dtype)  # [kv_heads, L, head_dim]
    value = v_cache[token_slots].movedim(0, 1).to(query.dtype)
    out = scaled_dot_product_attention(
        query.movedim(0, 1).unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
        attn_mask=None if mask is None else mask.unsqueeze(0).unsqueeze(0), scale=scaling, enable_gqa=enable_gqa,
    )  # [1, heads, n, head_dim]
    return out.squeeze(0).movedim(1, 0)


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
