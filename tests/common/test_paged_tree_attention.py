"""The engine-free parts of tree verification over a paged KV cache: which rows a tree
recomputes, which scheduled nodes are still the recorded tree, which KV rows move after
verification. (The attention itself is tested against vLLM's cache in tests/vllm.)"""

from __future__ import annotations

import torch

from specplug.common.paged_tree_attention import compaction_moves, scheduled_parents, tree_rows

TREE = torch.tensor([-1, 0, 0, 1, 2])  # root, two children, one grandchild under each
TOKENS = torch.tensor([7, 11, 12, 13, 14])


def test_tree_rows_recompute_only_nodes_whose_ancestors_are_not_the_rows_before_them():
    rows = tree_rows(batch_row=3, root_row=10, parents=TREE)
    assert rows.rows.tolist() == [2, 3, 4]  # node 1 sees root+itself, as a chain would
    assert tree_rows(0, 0, torch.arange(-1, 4)).rows.numel() == 0  # a chain recomputes nothing


def test_scheduled_parents_keep_the_tree_only_when_the_engine_kept_its_first_drafts():
    assert torch.equal(scheduled_parents((TOKENS, TREE), TOKENS[1:4]), TREE[:4])
    assert torch.equal(scheduled_parents((TOKENS, TREE), torch.tensor([11, 99])), torch.arange(-1, 2))
    assert torch.equal(scheduled_parents(None, TOKENS[1:3]), torch.arange(-1, 2))
    assert torch.equal(scheduled_parents((TOKENS[:2], TREE[:2]), TOKENS[1:4]), torch.arange(-1, 3))


def test_compaction_moves_the_accepted_path_to_its_chain_rows():
    trees = [tree_rows(0, 0, TREE), tree_rows(1, 5, TREE)]
    accepted = torch.tensor([[0, 2, 4], [0, 1, 3]])  # row 0 takes 0-2-4, row 1 the chain-like 0-1-3
    src, dst = compaction_moves(trees, accepted, torch.tensor([2, 2]))
    assert src.tolist() == [2, 4, 8] and dst.tolist() == [1, 2, 7]  # node 1 of row 1 is in place
    src, dst = compaction_moves(trees, accepted, torch.tensor([0, 0]))
    assert src.numel() == dst.numel() == 0
