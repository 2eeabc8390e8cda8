"""Stage "tree" attention for vLLM's GPU paged KV layout (tree_attention_triton.py), proven
under Triton's interpreter on CPU tensors.

The kernel runs in a process of its own with TRITON_INTERPRET=1 (tests/support/
triton_tree_attention.py) over a GPU-layout cache (vLLM's Triton-backend cache [num_blocks, 2,
block_size, kv_heads, head_dim], unbound into key / value views) with shuffled block tables over
random blocks. The same keys and values are written with vLLM's own CPU cache op into a CPU-layout
cache with the same block tables. Every query row equals a float64 torch reference (attention over
the committed prefix plus the row's ancestors and itself; causal for requests without a tree), and
every row specplug's CPU tree attention recomputes (TreeCPUAttentionImpl._tree_rows) equals it:
chains, a Medusa static tree, an EAGLE-2 dynamic tree, hand-made and random trees, mixed prefill /
decode / tree batches of 4, GQA 4/2 and 6/2, tiles spanning blocks and blocks spanning tiles.
Negative control: the same inputs with causal masks instead of the trees differ.
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
from specplug.common.dynamic_trees import dynamic  # noqa: E402
from specplug.common.static_trees import chain, from_choices  # noqa: E402
from specplug.vllm_eagle3 import paged_kv  # noqa: E402
from specplug.vllm_eagle3.tree_attention import TreeCPUAttentionImpl, TreeRows, pad_trees  # noqa: E402
from specplug.common.cuda.tree_attention_triton import pack_tree_masks  # noqa: E402
from tests.support.triton_interpreter import run_interpreted  # noqa: E402

pytestmark = pytest.mark.vllm

KV_HEADS, DIM, NUM_BLOCKS = 2, 32, 40
ATOL = RTOL = 1e-5  # float32 kernel against a float64 reference


def _random_parents(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)])


def _dynamic_tree() -> torch.Tensor:
    """One EAGLE-2 dynamic tree's parents (dynamic_trees.dynamic over random draft log-probs)."""
    g = torch.Generator().manual_seed(2)
    vocab = 50

    def expand(front):
        return torch.randn(1, front.tokens.shape[1], vocab, generator=g).log_softmax(-1)

    batch = dynamic(expand, torch.tensor([7]), torch.randn(1, vocab, generator=g).log_softmax(-1),
                    depth=3, topk=2, budget=6)
    return batch.parents[0, : int(batch.num_nodes[0])]


def _tree(context: int, parents: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    return context, parents, parents.shape[0]


def _cases() -> dict[str, dict]:
    """name -> requests [(context length, parents or None: causal, query rows)], block size, tile, heads."""
    g = torch.Generator().manual_seed(1)
    medusa = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]).parents
    shapes = [_tree(5, medusa), _tree(33, torch.tensor([-1, 0, 0, 1, 1, 2, 3])), _tree(2, _dynamic_tree()),
              _tree(50, _random_parents(20, g))]  # 20 rows: several query blocks
    mixed = [(0, None, 23), _tree(70, _random_parents(12, g)), (30, None, 1), _tree(9, torch.tensor([-1, 0, 0, 0, 0]))]
    chains = [_tree(3, chain(4).parents), _tree(40, chain(2).parents), _tree(17, chain(7).parents),
              _tree(1, chain(0).parents)]
    return {
        "chains": dict(requests=chains, block_size=16, tile=32, heads=4),
        "shapes": dict(requests=shapes, block_size=16, tile=16, heads=4),
        "mixed": dict(requests=mixed, block_size=32, tile=16, heads=4),
        "groups 3": dict(requests=shapes, block_size=16, tile=32, heads=6),
    }


def _inputs(spec: dict, seed: int, causal: bool = False) -> dict:
    """One verify pass: queries, both caches (GPU and CPU layouts, same blocks), the trees."""
    g = torch.Generator().manual_seed(seed)
    block_size, heads = spec["block_size"], spec["heads"]
    requests = spec["requests"]
    seq_lens = [c + n for c, _, n in requests]
    width = max(-(-s // block_size) for s in seq_lens) + 1
    order = torch.randperm(NUM_BLOCKS, generator=g)  # every request's blocks distinct, shuffled
    block_table = torch.randint(NUM_BLOCKS, (len(requests), width), generator=g, dtype=torch.int32)  # padding: any
    used = 0
    for b, s in enumerate(seq_lens):
        count = -(-s // block_size)
        block_table[b, :count] = order[used:used + count].int()
        used += count
    kv_cache = torch.randn(NUM_BLOCKS, 2, block_size, KV_HEADS, DIM, generator=g)  # vLLM's Triton backend layout
    cpu_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, block_size, 2 * DIM)
    for b, s in enumerate(seq_lens):
        positions = torch.arange(s)
        blocks, offsets = block_table[b, positions // block_size].long(), positions % block_size
        keys, values = kv_cache[blocks, 0, offsets], kv_cache[blocks, 1, offsets]  # [s, kv_heads, D]
        paged_kv.write(cpu_cache, "vec", blocks * block_size + offsets, keys.contiguous(), values.contiguous())
    query_lens = [n for _, _, n in requests]
    parents = [None if causal else p for _, p, _ in requests]
    mask, mask_start = pack_tree_masks(parents, query_lens)
    key_cache, value_cache = kv_cache.unbind(1)
    return dict(query=torch.randn(sum(query_lens), heads, DIM, generator=g), key_cache=key_cache,
                value_cache=value_cache, block_table=block_table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int(),
                mask=mask, mask_start=mask_start, scale=DIM ** -0.5, tile=spec["tile"],
                parents=[p for _, p, _ in requests], cpu_cache=cpu_cache)


def _reference(case: dict) -> torch.Tensor:
    """Float64 attention of every row over its request's prefix + ancestors (causal without a tree)."""
    q, keys_all, values_all = case["query"].double(), case["key_cache"].double(), case["value_cache"].double()
    groups = q.shape[1] // KV_HEADS
    block_size = keys_all.shape[1]
    starts = case["query_start_loc"].tolist()
    out = torch.empty_like(q)
    for b, (parents, s) in enumerate(zip(case["parents"], case["seq_lens"].tolist())):
        n = starts[b + 1] - starts[b]
        positions = torch.arange(s)
        blocks = case["block_table"][b, positions // block_size].long()
        k = keys_all[blocks, positions % block_size].repeat_interleave(groups, 1)  # [s, heads, D]
        v = values_all[blocks, positions % block_size].repeat_interleave(groups, 1)
        tree = torch.ones(n, n, dtype=torch.bool).tril() if parents is None else T.ancestor_mask(parents)
        visible = torch.cat([torch.ones(n, s - n, dtype=torch.bool), tree], 1)  # [n, s]
        scores = torch.einsum("nhd,shd->hns", q[starts[b]:starts[b + 1]], k) * case["scale"]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[starts[b]:starts[b + 1]] = torch.einsum("hns,shd->nhd", weights, v)
    return out.float()


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


def _kernel(cases: list[dict], tmp_path: Path) -> list[torch.Tensor]:
    """The Triton kernel under TRITON_INTERPRET=1, every case in one subprocess."""
    keys = ("query", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc", "mask", "mask_start",
            "scale", "tile")
    return run_interpreted("tests.support.triton_tree_attention", [{k: c[k] for k in keys} for c in cases], tmp_path)


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """name -> (case, kernel output): every case through one interpreter process."""
    specs = _cases()
    cases = {name: _inputs(spec, seed) for seed, (name, spec) in enumerate(specs.items())}
    cases["control: causal"] = _inputs(specs["shapes"], list(specs).index("shapes"), causal=True)
    outputs = _kernel(list(cases.values()), tmp_path_factory.mktemp("triton"))
    return {name: (case, out) for (name, case), out in zip(cases.items(), outputs)}


@pytest.mark.parametrize("name", ["chains", "shapes", "mixed", "groups 3"])
def test_kernel_equals_torch_reference_every_row(verified, name):
    case, kernel = verified[name]
    reference = _reference(case)
    assert kernel.shape == reference.shape == case["query"].shape
    torch.testing.assert_close(kernel, reference, atol=ATOL, rtol=RTOL)


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
