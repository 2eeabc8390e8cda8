"""Stage "tree" attention for vLLM's GPU paged KV layout (tree_attention_triton.py), proven
under Triton's interpreter on CPU tensors.

The kernel runs in a process of its own with TRITON_INTERPRET=1 (tests/support/
triton_tree_attention.py) over a GPU-layout cache (vLLM's Triton-backend cache [num_blocks, 2,
block_size, kv_heads, head_dim], unbound into key / value views) with shuffled block tables over
random blocks; the passes and the float64 reference come from tests/support/
tree_attention_cases.py (tests/cuda/test_tree_attention_triton.py runs them engine-free, on a
GPU too). The same keys and values are written with vLLM's own CPU cache op into a CPU-layout
cache with the same block tables. Every query row equals the float64 torch reference (attention
over the committed prefix plus the row's ancestors and itself; causal for requests without a
tree), and every row specplug's CPU tree attention recomputes (TreeCPUAttentionImpl._tree_rows)
equals it: chains, a Medusa static tree, an EAGLE-2 dynamic tree, hand-made and random trees,
mixed prefill / decode / tree batches of 4, GQA 4/2 and 6/2, tiles spanning blocks and blocks
spanning tiles. Negative control: the same inputs with causal masks instead of the trees differ.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton (the vLLM environment has it)", allow_module_level=True)

import torch  # noqa: E402

from specplug.common import tree as T  # noqa: E402
from specplug.vllm_eagle3 import paged_kv  # noqa: E402
from specplug.common.paged_tree_attention import TreeRows, pad_trees  # noqa: E402
from specplug.vllm_eagle3.tree_attention import TreeCPUAttentionImpl  # noqa: E402
from specplug.common.cuda.tree_attention_triton import pack_tree_masks  # noqa: E402
from tests.support.tree_attention_cases import (  # noqa: E402
    DIM, KERNEL_ARGUMENTS, KV_HEADS, cases, paged_inputs, reference)
from tests.support.triton_interpreter import run_interpreted  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL = RTOL = 1e-5  # float32 kernel against a float64 reference


def _inputs(spec: dict, seed: int, causal: bool = False) -> dict:
    """One verify pass (tests/support/tree_attention_cases.py) plus vLLM's CPU-layout cache holding
    the same keys and values in the same blocks, written with vLLM's own CPU cache op."""
    case = paged_inputs(spec, seed, causal)
    block_size = spec["block_size"]
    cpu_cache = torch.zeros(case["key_cache"].shape[0], KV_HEADS, block_size, 2 * DIM)
    for b, s in enumerate(case["seq_lens"].tolist()):
        positions = torch.arange(s)
        blocks, offsets = case["block_table"][b, positions // block_size].long(), positions % block_size
        keys, values = case["key_cache"][blocks, offsets], case["value_cache"][blocks, offsets]  # [s, kv_heads, D]
        paged_kv.write(cpu_cache, "vec", blocks * block_size + offsets, keys.contiguous(), values.contiguous())
    return dict(case, cpu_cache=cpu_cache)


def _cpu_tree_rows(case: dict) -> tuple[torch.Tensor, list[int]]:
    """specplug's CPU tree attention (TreeCPUAttentionImpl._tree_rows) over the CPU-layout cache:
    output [T, heads * D] and the rows it recomputes (those whose ancestors differ from a chain)."""
    q = case["query"]
    starts = case["query_start_loc"].tolist()
    trees = []
    for b, parents in enumerate(case["parents"]):
        if parents is not None:
            mask = T.ancestor_mask(parents)
            rows = (mask != torch.ones_like(mask).tril()).any(dim=1).nonzero().flatten()
            if rows.numel():
                trees.append(TreeRows(b, starts[b], mask, rows))
    output = torch.zeros(q.shape[0], q.shape[1] * DIM)
    if not trees:
        return output, []
    impl = TreeCPUAttentionImpl.__new__(TreeCPUAttentionImpl)
    impl.scale = case["scale"]
    metadata = type("Metadata", (), dict(seq_lens=case["seq_lens"], block_table=case["block_table"]))
    block_size = case["key_cache"].shape[1]
    batch = pad_trees(trees, metadata, block_size, KV_HEADS, q.shape[1] // KV_HEADS, torch.float32)
    impl._tree_rows(batch, q, case["cpu_cache"], output)
    return output, sorted(int(t.root_row + r) for t in trees for r in t.rows)


def _kernel(passes: list[dict], tmp_path: Path) -> list[torch.Tensor]:
    """The Triton kernel under TRITON_INTERPRET=1, every pass in one subprocess."""
    keys = KERNEL_ARGUMENTS + ("tile",)
    return run_interpreted("tests.support.triton_tree_attention", [{k: c[k] for k in keys} for c in passes], tmp_path)


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """name -> (case, kernel output): every case through one interpreter process."""
    specs = cases()
    passes = {name: _inputs(spec, seed) for seed, (name, spec) in enumerate(specs.items())}
    passes["control: causal"] = _inputs(specs["shapes"], list(specs).index("shapes"), causal=True)
    outputs = _kernel(list(passes.values()), tmp_path_factory.mktemp("triton"))
    return {name: (case, out) for (name, case), out in zip(passes.items(), outputs)}


@pytest.mark.parametrize("name", ["chains", "shapes", "mixed", "groups 3"])
def test_kernel_equals_torch_reference_every_row(verified, name):
    case, kernel = verified[name]
    expected = reference(case)
    assert kernel.shape == expected.shape == case["query"].shape
    torch.testing.assert_close(kernel, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", ["shapes", "mixed", "groups 3"])
def test_kernel_equals_cpu_tree_attention_on_the_rows_it_recomputes(verified, name):
    case, kernel = verified[name]
    cpu, rows = _cpu_tree_rows(case)
    assert len(rows) >= 10  # branching rows of several trees
    torch.testing.assert_close(kernel.flatten(1)[rows], cpu[rows], atol=ATOL, rtol=RTOL)


def test_causal_masks_over_the_trees_change_the_branching_rows(verified):
    """The kernel reads the tree mask: with causal masks the rows whose ancestors are not the rows
    before them differ from the tree reference, the others (chain-like) do not."""
    (case, right), (_, wrong) = verified["shapes"], verified["control: causal"]
    _, rows = _cpu_tree_rows(case)
    others = [r for r in range(right.shape[0]) if r not in rows]
    assert (right.flatten(1)[rows] - wrong.flatten(1)[rows]).abs().amax(1).min() > 1e-3
    torch.testing.assert_close(wrong[others], right[others], atol=ATOL, rtol=RTOL)


def test_pack_tree_masks_refuses_a_parent_after_its_child():
    with pytest.raises(ValueError, match=r"parents\[1\] is not a tree"):
        pack_tree_masks([None, torch.tensor([-1, 2, 0])], [4, 3])
    with pytest.raises(ValueError, match="has 3 nodes but request 0 has 4 query rows"):
        pack_tree_masks([torch.tensor([-1, 0, 0])], [4])
