"""Tree verification attention over vLLM's GPU paged KV layout: a Triton kernel that reads a
per-request tree mask (stage "tree" on GPUs; proven under Triton's interpreter, not wired in).

vLLM's `triton_unified_attention` takes a query-query bias (`qq_bias`), but one shared by every
request of the batch (row = query position within its request, no per-request offset), so it
cannot hold a different tree per request. This kernel reads, per request b, its own packed
ancestor mask [n_b, n_b] over its n_b query rows (the tree's nodes, root first):

- cache: key_cache / value_cache [num_blocks, block_size, kv_heads, head_dim] (any strides:
  the FlashAttention [2, ...] and Triton [num_blocks, 2, ...] caches unbound), block_table
  [B, max_blocks], seq_lens [B] (committed prefix + this step's rows), query_start_loc [B + 1].
- query row i of request b (flat row query_start_loc[b] + i, key position seq_len_b - n_b + i)
  attends to the whole committed prefix and to the keys j <= i of its own rows where
  mask[b][i, j]; a request with mask_start[b] = -1 (prefill, plain decode, a chain) is causal.
- grid (num_tokens // BLOCK_Q + B, kv_heads): one program per block of BLOCK_Q query rows of
  one request and one KV head, with the head's GROUPS query heads stacked as BLOCK_M =
  BLOCK_Q * GROUPS rows (one K/V tile load serves all of them); the request of a program is
  found by binary search over query_start_loc (request b's blocks start at
  query_start_loc[b] // BLOCK_Q + b). Keys are read in tiles of TILE positions up to the
  block's last row (parents precede children, so no row sees a later one), block ids per
  key from the block table; softmax online in float32 (on a GPU, float32 inputs would take
  Triton's default TF32 dot, as vLLM's kernel does; it has not run on one).

`pack_tree_masks` builds the mask from the trees' parents (specplug.common.tree.ancestor_mask).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specplug.common.tree import ancestor_mask, check_parents


def pack_tree_masks(parents: list[torch.Tensor | None], query_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, its tree's parents (Long [n_b], root first, parents[0] = -1, every parent
    before its child; n_b = the request's query rows) or None (causal rows) -> the kernel's
    mask UInt8 [sum n_b^2] (each tree's ancestor-or-self mask, row-major) and mask_start
    Long [B] (offset of request b's mask, -1 for causal)."""
    if len(parents) != len(query_lens):
        raise ValueError(f"parents has {len(parents)} requests but query_lens {len(query_lens)}: give one "
                         "entry per request (None for a request without a tree)")
    masks, starts, offset = [], [], 0
    for b, (p, n) in enumerate(zip(parents, query_lens)):
        if p is None:
            starts.append(-1)
            continue
        p = p.cpu().long()
        if p.shape != (n,):
            raise ValueError(f"parents[{b}] has {p.shape[-1]} nodes but request {b} has {n} query rows: "
                             "give one node per query row, root first")
        check_parents(p, name=f"parents[{b}]")  # the kernel relies on parents preceding children
        masks.append(ancestor_mask(p).flatten())
        starts.append(offset)
        offset += n * n
    mask = torch.cat(masks).to(torch.uint8) if masks else torch.zeros(1, dtype=torch.uint8)
    return mask, torch.tensor(starts, dtype=torch.long)


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   mask: torch.Tensor, mask_start: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                   tile: int = 32) -> torch.Tensor:
    """Attention of query [T, heads, head_dim] over the paged cache with per-request tree masks
    (pack_tree_masks); writes and returns out [T, heads, head_dim]. All tensors on one device."""
    tokens, heads, dim = query.shape
    num_blocks, block_size, kv_heads, cache_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or cache_dim != dim:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} / value_cache {tuple(value_cache.shape)} must both be "
                         f"[num_blocks, block_size, kv_heads, {dim}] (query head_dim {dim})")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"key_cache / value_cache are {key_cache.dtype} / {value_cache.dtype} but query is "
                         f"{query.dtype}: this kernel reads an unquantized cache of the query's dtype")
    if query.stride(2) != 1 or (out is not None and (out.shape != query.shape or out.stride(2) != 1)):
        raise ValueError("query and out must be [T, heads, head_dim] with contiguous head_dim (stride 1)")
    if heads % kv_heads:
        raise ValueError(f"query has {heads} heads, not a multiple of the cache's {kv_heads} kv heads")
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,) or mask_start.shape != (batch,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} and mask_start {tuple(mask_start.shape)} "
                         f"must be [{batch + 1}] and [{batch}] for seq_lens [{batch}]")
    out = torch.empty_like(query) if out is None else out
    groups = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(groups))  # rows per program: >= 16 for tl.dot
    block_q = block_m // groups
    grid = (tokens // block_q + batch, kv_heads)
    _tree_attention_kernel[grid](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, mask, mask_start,
        scale, batch,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
        block_table.stride(0),
        GROUPS=groups, HEAD_DIM=dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile)
    return out


@triton.jit
def _request_of(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last request b whose first block (query_start[b] // BLOCK_Q + b) is <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tree_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, mask_ptr,
    mask_start_ptr, scale, num_seqs,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    k_stride_b, k_stride_s, k_stride_h, k_stride_d,
    v_stride_b, v_stride_s, v_stride_h, v_stride_d,
    block_table_stride,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _request_of(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    local_block = q_block - (query_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    mask_start = tl.load(mask_start_ptr + seq)  # -1: causal rows

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_t = tl.arange(0, TILE)
    query_pos = local_block * BLOCK_Q + offs_m // GROUPS  # [BLOCK_M] row within the request
    head = kv_head * GROUPS + offs_m % GROUPS
    row_valid = (offs_m < BLOCK_Q * GROUPS) & (query_pos < query_len)
    tree_rows = row_valid & (offs_m * 0 + mask_start >= 0)  # [BLOCK_M] rows that read a tree mask
    mask_start = tl.maximum(mask_start, 0)
    dim_valid = offs_d < HEAD_DIM
    q_rows = (query_start + query_pos).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    kv_end = tl.minimum(seq_len, context_len + (local_block + 1) * BLOCK_Q)  # no row sees a later one
    for start in range(0, kv_end, TILE):
        key_pos = start + offs_t  # [TILE]
        key_valid = key_pos < kv_end
        block = tl.load(block_table_ptr + seq * block_table_stride + key_pos // BLOCK_SIZE,
                        mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % BLOCK_SIZE
        k = tl.load(k_cache_ptr + block[None, :] * k_stride_b + slot[None, :] * k_stride_s
                    + kv_head * k_stride_h + offs_d[:, None] * k_stride_d,
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)  # [HEAD_DIM_PAD, TILE]
        v = tl.load(v_cache_ptr + block[:, None] * v_stride_b + slot[:, None] * v_stride_s
                    + kv_head * v_stride_h + offs_d[None, :] * v_stride_d,
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)  # [TILE, HEAD_DIM_PAD]
        scores = tl.dot(q, k) * scale  # [BLOCK_M, TILE] float32

        node = key_pos - context_len  # key's row within the request (< 0: committed prefix)
        causal = key_pos[None, :] <= (context_len + query_pos)[:, None]
        in_tree = tree_rows[:, None] & (node[None, :] >= 0) & causal & key_valid[None, :]
        ancestor = tl.load(mask_ptr + mask_start + query_pos[:, None] * query_len + node[None, :],
                           mask=in_tree, other=1)
        visible = causal & (ancestor != 0) & row_valid[:, None] & key_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new

    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * o_stride_t + head[:, None] * o_stride_h + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
