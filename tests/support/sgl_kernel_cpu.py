"""Test support: torch stand-ins for the CPU sgl-kernel ops SGLang's speculative path calls.

PyPI has no CPU build of sgl-kernel, so on a CPU without one SGLang's CPU engine cannot
import its speculative (and some decode) bookkeeping. These are slow, plain-torch
implementations of exactly the ops it calls, with the contracts of
`sglang/kernels/jit/include/sgl_kernel/speculative/eagle.cuh` and the Triton kernels
in `sglang/kernels/ops/speculative/*.py` (which SGLang 0.5.23 ships beside them), and
`murmur_hash32_cpu`, the hash of SGLang's seeded sampler (`sampling_seed`), registered as
the torch op `torch.ops.sgl_kernel.murmur_hash32_cpu` that sampler calls on CPU.
They exist only so the SGLang test suite runs here; specplug's product code never
imports them. Every op mutates its output arguments in place, like the kernel.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "murmur_hash32_cpu",
    "reconstruct_indices_from_tree_mask",
    "verify_tree_greedy_cpu",
]


def _segments(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """Per request (row, start, end, out_offset): requests are packed back to back."""
    out = 0
    for row, (start, end) in enumerate(zip(start_offset.tolist(), end_offset.tolist())):
        yield row, start, end, out
        out += end - start


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """out_cache_loc[packed] = req_to_token[req_pool_indices[b], start[b]:end[b]]."""
    for b, start, end, out in _segments(start_offset, end_offset):
        row = req_to_token[int(req_pool_indices[b])]
        out_cache_loc[out:out + end - start] = row[start:end].to(out_cache_loc.dtype)


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[packed] (inverse)."""
    for b, start, end, out in _segments(start_offset, end_offset):
        row = req_to_token[int(req_pool_indices[b])]
        row[start:end] = out_cache_loc[out:out + end - start].to(row.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (base address data_ptrs[i], strides[i] bytes per token slot),
    copy slot src_loc[j] to slot tgt_loc[j]. All sources are read before any write."""
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + int(s) * stride, stride) for s in src_loc.tolist()]
        for t, row in zip(tgt_loc.tolist(), rows):
            ctypes.memmove(base + int(t) * stride, row, stride)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact: the k-th non-negative entry src of accept_index (flattened) writes
    accept_out_cache_loc[k] = out_cache_loc[src]."""
    flat = accept_index.reshape(-1)
    kept = flat[flat >= 0]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[b] = accept_tokens[b * stride + accept_lens[b] - 1] (the last accepted)."""
    flat = accept_tokens.reshape(-1)
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    bonus_tokens.copy_(flat[rows * accept_stride + accept_lens.long() - 1].to(bonus_tokens.dtype))


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size,
                                       draft_token_num):
    """From a flat bool ancestor mask [bs, n, n] (mask[b, i, j]: j is i or an ancestor of
    i) write positions (seq_len + depth), retrieve_index (b*n + i), first child and next
    sibling of each node (-1 = none; roots have no sibling)."""
    n = draft_token_num
    order = torch.arange(n)
    for b in range(batch_size):
        m = tree_mask.reshape(batch_size, n, n)[b].bool().cpu()
        ancestors = m & (order[None, :] < order[:, None])  # [n, n] strict
        parents = torch.where(ancestors.any(1), (ancestors * order).argmax(1), -1)
        positions.view(batch_size, n)[b] = ancestors.sum(1).to(positions.dtype) + int(verified_seq_len[b])
        retrieve_index.view(batch_size, n)[b] = b * n + order
        first_child = torch.where(ancestors, order[:, None], n).min(0).values
        retrieve_next_token.view(batch_size, n)[b] = torch.where(first_child < n, first_child, -1)
        same = (parents[:, None] == parents[None, :]) & (order[:, None] > order[None, :])
        sibling = torch.where(same, order[:, None], n).min(0).values
        retrieve_next_sibling.view(batch_size, n)[b] = torch.where(
            (parents >= 0) & (sibling < n), sibling, -1)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy tree walk (SGLang's verify_tree_greedy): from the root follow the first child
    whose token equals the target's argmax after the current node; record accepted flat
    indices in accept_index[b, 1:], the count in accept_token_num[b], and write the target
    token after every accepted node (incl. the bonus after the last) into predicts."""
    bs, n = candidates.shape
    flat_target = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for j in range(1, accept_index.shape[1]):
            cur = int(retrive_next_token[b, cur])
            target_token = int(flat_target[last])
            while cur != -1 and int(candidates[b, cur]) != target_token:
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
            predicts[last] = target_token
            accepted += 1
            last = int(retrive_index[b, cur])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


_M32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One 4-byte block of MurmurHash3 (x86_32) on int64 tensors holding uint32 values
    (products wrap modulo 2**64; their low 32 bits are the uint32 product)."""
    k = _rotl32((k * 0xCC9E2D51) & _M32, 15)
    h = h ^ ((k * 0x1B873593) & _M32)
    return (_rotl32(h, 13) * 5 + 0xE6546B64) & _M32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's murmur_hash32 (kernels/ops/sampling/murmur_hash.py, its Triton kernel):
    UInt32 [n, m], row i col j the hash of the blocks (low 32 bits of seed[i] (uint64),
    its high 32 bits, positions[i] as uint32, col_indices[j] as uint32)."""
    seed = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.long()
    pos = positions.long() & _M32
    col = col_indices.long() & _M32
    h = torch.zeros_like(seed)
    h = _murmur3_mix(h, seed & _M32)
    h = _murmur3_mix(h, (seed >> 32) & _M32)
    h = _murmur3_mix(h, pos)[:, None]  # [n, 1]
    h = _murmur3_mix(h, col[None, :]) ^ 16  # [n, m]
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return (h ^ (h >> 16)).to(torch.uint32)


def _register_torch_ops() -> None:
    """torch.ops.sgl_kernel.murmur_hash32_cpu, as the CPU sgl-kernel build defines it."""
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    lib.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")
    _LIBRARIES.append(lib)  # a Library deregisters its ops when collected


_LIBRARIES: list = []
_register_torch_ops()
