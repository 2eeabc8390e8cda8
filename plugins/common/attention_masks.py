"""Attention masks in the form Hugging Face models take, and attention over a paged KV
cache under a Bool mask (tree_sdpa)."""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [T, S] -> the additive 4-D mask Hugging Face models take, [1, 1, T, S]:
    0 where allowed, the dtype's minimum elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


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
