"""Test support (not product code): SGLang's Triton extend/verify attention kernel run under
Triton's interpreter on CPU tensors, for tests/sglang/test_triton_tree_mask.py.

Run as `TRITON_INTERPRET=1 python -m tests.support.triton_extend_attention CASES OUT`
(the variable must be set before triton is imported, hence a process of its own). CASES is
a torch.save'd list of dicts, each holding what SGLang's triton backend hands
`extend_attention_fwd` in a TARGET_VERIFY pass (triton_backend.py: qo_indptr = b * n,
kv_indptr / kv_indices over the committed prefix, custom_mask, mask_indptr, causal) plus
`tile` (None: the kernel's own CPU block sizes; k: k x k tiles, so a tree spans several)
and `skip_prefix_custom_mask`. OUT receives the list of outputs o [B*n, heads, head_dim].
The wrapper is called as is; only its block-size choice is replaced when `tile` is set.
"""

from __future__ import annotations

import os
import sys

import torch


def _tiles(k: int):
    """Block sizes (BLOCK_DMODEL, BLOCK_DPE, BLOCK_DV, BLOCK_M, BLOCK_N, num_warps) with k x k tiles."""
    import triton

    return lambda lq, lv: (triton.next_power_of_2(lq), 0, triton.next_power_of_2(lv), k, k, 4)


def run(case: dict) -> torch.Tensor:
    from sglang.kernels.ops.attention import extend_attention as ea

    original = ea._get_block_sizes_for_extend_attention
    if case["tile"] is not None:
        ea._get_block_sizes_for_extend_attention = _tiles(case["tile"])
    try:
        o = torch.empty_like(case["q"])
        ea.extend_attention_fwd(
            case["q"], case["k"], case["v"], o, case["k_buffer"], case["v_buffer"], case["qo_indptr"],
            case["kv_indptr"], case["kv_indices"], case["custom_mask"], True, case["mask_indptr"], case["n"],
            1.0, 1.0, sm_scale=case["sm_scale"], skip_prefix_custom_mask=case["skip_prefix_custom_mask"])
        return o
    finally:
        ea._get_block_sizes_for_extend_attention = original


def main(cases_path: str, out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this module (Triton reads it at import)")
    torch.save([run(case) for case in torch.load(cases_path)], out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
