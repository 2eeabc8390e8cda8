"""Reads and moves entries of vLLM-CPU's paged KV cache (stage "tree" only).

vLLM 0.32's CPU attention cache of one layer is [num_blocks, kv_heads, block_size,
2 * head_dim]; per (block, head) the memory holds a key region then a value region of
block_size * head_dim elements each. The value region is [block_size, head_dim]; on the
"vec" / "vec16" ISAs the key region is stored TRANSPOSED, [head_dim, block_size]. That
layout is private to vLLM's C++ kernels, so `check_layout` writes known keys with vLLM's
own op and reads them back before stage "tree" is used, and fails clearly if it changed.
Writes always go through vLLM's op (`cpu_attn_reshape_and_cache`), never by hand.
"""

from __future__ import annotations

import torch

SUPPORTED_ISAS = ("vec", "vec16")


def _regions(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, kv_heads, block_size, 2 * D] -> [num_blocks, kv_heads, 2, block_size * D]."""
    blocks, heads, block_size, two_d = kv_cache.shape
    return kv_cache.view(blocks, heads, 2, block_size * (two_d // 2))


def gather(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at `slots` (Long [n], slot = block * block_size + offset):
    two [n, kv_heads, head_dim] tensors (copies)."""
    blocks, heads, block_size, two_d = kv_cache.shape
    dim = two_d // 2
    regions = _regions(kv_cache)
    block, offset = slots // block_size, slots % block_size
    keys = regions[:, :, 0].view(blocks, heads, dim, block_size)[block, :, :, offset]  # [n, heads, D]
    values = regions[:, :, 1].view(blocks, heads, block_size, dim)[block, :, offset]  # [n, heads, D]
    return keys, values


def blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole cache blocks (Long [n] ids), copied in one index_select: keys
    [n, kv_heads, head_dim, block_size] (stored transposed) and values
    [n, kv_heads, block_size, head_dim] (views of one copy)."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    dim = two_d // 2
    chosen = torch.index_select(_regions(kv_cache), 0, block_ids)  # [n, heads, 2, block_size * D]
    n = block_ids.shape[0]
    return chosen[:, :, 0].view(n, heads, dim, block_size), chosen[:, :, 1].view(n, heads, block_size, dim)


def write(kv_cache: torch.Tensor, isa: str, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Store keys/values [n, kv_heads, head_dim] at `slots` with vLLM's own cache op."""
    from vllm import _custom_ops as ops

    blocks, heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


def copy_slots(kv_cache: torch.Tensor, isa: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache[dst[i]] = kv_cache[src[i]] for every i (all sources read before any write)."""
    keys, values = gather(kv_cache, src)
    write(kv_cache, isa, dst, keys.contiguous(), values.contiguous())


def check_layout(isa: str, dtype: torch.dtype = torch.float32, head_dim: int = 32, block_size: int = 32) -> None:
    """Start-up self-test: keys/values written by vLLM's op read back through `gather`.
    Raises RuntimeError naming the ISA when the private layout is not the one assumed."""
    if isa not in SUPPORTED_ISAS:
        raise RuntimeError(
            f"specplug stage \"tree\" reads vLLM-CPU's paged KV cache directly and supports the CPU "
            f"attention ISAs {SUPPORTED_ISAS}; this machine uses {isa!r}: use stage \"chain\" "
            "(SPECPLUG_STAGE=chain)"
        )
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(3, 2, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.tensor([0, 3, block_size + 1, 3 * block_size - 1])
    keys = torch.randn(len(slots), 2, head_dim, generator=gen).to(dtype)
    values = torch.randn(len(slots), 2, head_dim, generator=gen).to(dtype)
    write(cache, isa, slots, keys, values)
    got_keys, got_values = gather(cache, slots)
    block_keys, block_values = blocks(cache, slots // block_size)  # one block per written slot
    offsets = (slots % block_size).tolist()
    by_block = (torch.stack([block_keys[i, :, :, o] for i, o in enumerate(offsets)]),
                torch.stack([block_values[i, :, o] for i, o in enumerate(offsets)]))
    if not (torch.equal(got_keys, keys) and torch.equal(got_values, values)
            and torch.equal(by_block[0], keys) and torch.equal(by_block[1], values)):
        raise RuntimeError(
            f"specplug stage \"tree\": vLLM-CPU's KV cache layout on ISA {isa!r} is not the one "
            "specplug reads (keys [head_dim, block_size], values [block_size, head_dim] per block "
            "and head, vLLM 0.32.0); use stage \"chain\" (SPECPLUG_STAGE=chain) with this vLLM build"
        )
