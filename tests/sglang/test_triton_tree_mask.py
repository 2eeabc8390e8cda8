"""SGLang's Triton verify attention reads specplug's prefix-included tree masks correctly.

The proof behind `--attention-backend triton` on a GPU (common.sglang_backends.GPU_TREE_BACKENDS): SGLang's
own `extend_attention_fwd` (sglang.kernels.ops.attention.extend_attention), called with the
arguments its triton backend builds for a TARGET_VERIFY pass (qo_indptr = b * n, kv_indptr /
kv_indices over the committed prefix, mask_indptr = cumsum(n * (seq_len + n)), causal) and
the mask specplug's builder makes from real specplug trees (common.sglang_trees.
prefix_included_masks over tree.ancestor_mask, trees padded with tree.pad_batch), run under
Triton's interpreter on CPU tensors (tests/support/triton_extend_attention.py, a process of
its own), equals specplug's torch_native tree attention (common.sglang_trees.request_masks +
common.attention_masks.tree_sdpa) over the same paged KV cache, every row, padding rows included: chains, several
tree shapes, trees padded to the reserved node count, mixed prefix lengths, batches of 4,
the kernel's own CPU tiles and 8 x 8 tiles (trees and prefixes spanning several tiles), and
with the prefix columns of the mask read too. Negative control: a chain (causal) mask over
the same branching trees must change the output.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specplug.common import tree as T
from specplug.common.dynamic_trees import dynamic
from specplug.common.attention_masks import tree_sdpa
from specplug.common.sglang_trees import mask_indptr, prefix_included_masks, request_masks
from specplug.common.static_trees import chain, from_choices

ROOT = Path(__file__).resolve().parents[2]
HEADS, KV_HEADS, DIM = 4, 2, 16  # GQA like the tiny Llama
SLOTS = 512  # paged KV cache: each request's prefix and nodes at scattered slots
SCALE = DIM ** -0.5
ATOL = RTOL = 1e-5  # float32 throughout


def _trees(parents_lists) -> T.TreeBatch:
    return T.stack_trees([T.DraftTree(torch.zeros(len(p), dtype=torch.long), torch.tensor(p)) for p in parents_lists])


def _dynamic_tree(budget: int, seed: int) -> T.TreeBatch:
    """One EAGLE-2 dynamic tree (dynamic_trees.dynamic) over random draft log-probs."""
    g = torch.Generator().manual_seed(seed)
    vocab = 50

    def expand(front):
        return torch.randn(1, front.tokens.shape[1], vocab, generator=g).log_softmax(-1)

    return dynamic(expand, torch.tensor([7]), torch.randn(1, vocab, generator=g).log_softmax(-1),
                   depth=3, topk=2, budget=budget)


def _random_parents(n: int, g: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, n)]


def _cases() -> dict[str, tuple[T.TreeBatch, list[int], int]]:
    """name -> (trees, seq_lens, reserved node count n)."""
    g = torch.Generator().manual_seed(1)
    medusa = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    shapes = T.stack_batches([
        T.stack_trees([medusa]),
        _trees([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 0, 0, 0], [-1, 0, 1, 1, 2, 3, 5, 5]])])
    padded = T.stack_batches([_trees([[-1], [-1, 0, 1], [-1, 0, 0, 1, 2, 2, 4]]), _dynamic_tree(5, 2)])
    tiles = _trees([_random_parents(n, g) for n in (20, 13, 17, 6)])
    return {
        "chains": (T.stack_trees([chain(4)] * 4), [3, 10, 1, 27], 5),
        "shapes": (shapes, [5, 12, 2, 33], 8),
        "padded": (padded, [1, 7, 19, 4], 10),
        "tiles": (tiles, [9, 30, 2, 16], 20),
    }


def _inputs(trees: T.TreeBatch, seq_lens: list[int], n: int, seed: int, masks=None) -> dict:
    """One verify pass as SGLang's triton backend hands it to extend_attention_fwd."""
    g = torch.Generator().manual_seed(seed)
    bs, lens = trees.candidates.shape[0], torch.tensor(seq_lens)
    masks = T.ancestor_mask(T.pad_batch(trees, n).parents) if masks is None else masks  # [B, n, n]
    slots = torch.randperm(SLOTS, generator=g)[: sum(seq_lens) + bs * n]
    prefix_slots, node_slots = slots[: sum(seq_lens)], slots[sum(seq_lens):]  # [sum s], [B*n]
    k_buffer, v_buffer = (torch.randn(SLOTS, KV_HEADS, DIM, generator=g) for _ in range(2))
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()])
    sglang_mask_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), (n * (lens + n)).cumsum(0)])  # as triton_backend
    assert torch.equal(sglang_mask_indptr, mask_indptr(lens, n))
    return dict(
        q=torch.randn(bs * n, HEADS, DIM, generator=g), k=k_buffer[node_slots], v=v_buffer[node_slots],
        k_buffer=k_buffer, v_buffer=v_buffer, qo_indptr=torch.arange(0, (bs + 1) * n, n, dtype=torch.int32),
        kv_indptr=kv_indptr, kv_indices=prefix_slots.long(), custom_mask=prefix_included_masks(masks, lens),
        mask_indptr=sglang_mask_indptr, n=n, sm_scale=SCALE, tile=None, skip_prefix_custom_mask=True,
        seq_lens=seq_lens, prefix_slots=prefix_slots, node_slots=node_slots)


def _torch_native(case: dict) -> torch.Tensor:
    """specplug's torch_native tree attention over the same cache: o [B*n, heads, head_dim]."""
    n, seq_lens = case["n"], case["seq_lens"]
    masks = request_masks(case["custom_mask"], seq_lens, n)  # [n, s + n] each
    prefixes = case["prefix_slots"].split(seq_lens)
    out = []
    for b, (mask, prefix) in enumerate(zip(masks, prefixes)):
        slots = torch.cat([prefix, case["node_slots"][b * n:(b + 1) * n]]).long()
        out.append(tree_sdpa(case["q"][b * n:(b + 1) * n], case["k_buffer"], case["v_buffer"], slots, mask,
                             SCALE, True))
    return torch.cat(out)


def _kernel(cases: list[dict], tmp_path: Path) -> list[torch.Tensor]:
    """SGLang's extend_attention_fwd under TRITON_INTERPRET=1, in a subprocess."""
    keys = ("q", "k", "v", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr", "kv_indices", "custom_mask",
            "mask_indptr", "n", "sm_scale", "tile", "skip_prefix_custom_mask")
    torch.save([{k: c[k] for k in keys} for c in cases], tmp_path / "cases.pt")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "tests.support.triton_extend_attention", str(tmp_path / "cases.pt"),
                           str(tmp_path / "out.pt")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """name -> (case, kernel output): every case through one interpreter process."""
    cases = {}
    for seed, (name, (trees, seq_lens, n)) in enumerate(_cases().items()):
        cases[name] = _inputs(trees, seq_lens, n, seed)
    cases["tiles"]["tile"] = 8
    cases["prefix columns read"] = dict(cases["shapes"], skip_prefix_custom_mask=False)
    trees, seq_lens, n = _cases()["shapes"]
    chain_masks = torch.ones(n, n, dtype=torch.bool).tril().expand(len(seq_lens), n, n)
    cases["control: chain mask"] = _inputs(trees, seq_lens, n, 1, masks=chain_masks)
    outputs = _kernel(list(cases.values()), tmp_path_factory.mktemp("triton"))
    return {name: (case, out) for (name, case), out in zip(cases.items(), outputs)}


@pytest.mark.parametrize("name", ["chains", "shapes", "padded", "tiles", "prefix columns read"])
def test_triton_verify_kernel_equals_torch_native_tree_attention(verified, name):
    case, kernel = verified[name]
    reference = _torch_native(case)
    assert kernel.shape == reference.shape == (len(case["seq_lens"]) * case["n"], HEADS, DIM)
    torch.testing.assert_close(kernel, reference, atol=ATOL, rtol=RTOL)


def test_chain_mask_over_trees_changes_the_kernel_output(verified):
    """The kernel reads the mask: the right (ancestor) mask's output differs from a chain mask's."""
    right, wrong = verified["shapes"][1], verified["control: chain mask"][1]
    assert (right - wrong).abs().max() > 1e-2
