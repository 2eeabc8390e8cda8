"""Test support (not product code): specplug's tree attention Triton kernel
(specplug.common.cuda.tree_attention_triton) run under Triton's interpreter on CPU tensors,
for tests/vllm/test_tree_attention_triton.py and tests/cuda/test_tree_attention_triton.py.

Run as `TRITON_INTERPRET=1 python -m tests.support.triton_tree_attention CASES OUT` (the
variable must be set before triton is imported, hence a process of its own). CASES is a
torch.save'd list of dicts holding the kernel's arguments (query, key_cache, value_cache,
block_table, seq_lens, query_start_loc, mask, mask_start, scale, tile); OUT receives the list
of outputs [T, heads, head_dim].
"""

from __future__ import annotations

import os
import sys

import torch

ARGUMENTS = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc", "mask",
             "mask_start", "scale")


def main(cases_path: str, out_path: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 before running this module (Triton reads it at import)")
    from specplug.common.cuda.tree_attention_triton import tree_attention

    outputs = [tree_attention(*(case[k] for k in ARGUMENTS), tile=case["tile"]) for case in torch.load(cases_path)]
    torch.save(outputs, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
