"""specplug.common.merge: one tree from several sources' trees under one budget."""

from __future__ import annotations

import math

import pytest
import torch

from specplug.common.merge import merge_trees
from specplug.common.path_choice import best_merged_chains
from specplug.common.tree import TreeBatch, check_parents


def batch(tokens, parents, probs) -> TreeBatch:
    """One request's tree as a TreeBatch with log scores."""
    return TreeBatch(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([len(tokens)]),
                     torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]]))


def paths(tree: TreeBatch, b: int = 0) -> dict[tuple, float]:
    n = int(tree.num_nodes[b])
    tokens, parents = tree.candidates[b, :n].tolist(), tree.parents[b, :n].tolist()
    out, keys = {}, [()]
    for i in range(1, n):
        keys.append(keys[parents[i]] + (tokens[i],))
        out[keys[i]] = math.exp(float(tree.scores[b, i]))
    return out


HEAD = batch([9, 1, 2, 3, 4], [-1, 0, 0, 1, 1], [1, 0.6, 0.3, 0.4, 0.1])  # 9 -> 1 -> {3, 4}; 9 -> 2
RETRIEVAL = batch([9, 1, 3, 5, 7], [-1, 0, 1, 2, 3], [1, 0.9, 0.8, 0.7, 0.6])  # 9 -> 1 -> 3 -> 5 -> 7


def test_shared_paths_are_merged_with_the_best_score():
    merged = merge_trees([HEAD, RETRIEVAL], budget=16)
    got = paths(merged)
    assert got == pytest.approx({(1,): 0.9, (2,): 0.3, (1, 3): 0.8, (1, 4): 0.1, (1, 3, 5): 0.7,
                                 (1, 3, 5, 7): 0.6})
    check_parents(merged.parents, merged.num_nodes)


def test_budget_keeps_the_best_nodes_and_their_parents():
    merged = merge_trees([HEAD, RETRIEVAL], budget=4)
    assert set(paths(merged)) == {(1,), (1, 3), (1, 3, 5), (1, 3, 5, 7)}
    assert int(merged.num_nodes[0]) == 5
    check_parents(merged.parents, merged.num_nodes)
    parents = merged.parents[0].tolist()
    assert all(parents[i] < i for i in range(1, 5))  # parents precede children


def test_a_source_with_nothing_leaves_the_other_unchanged():
    root_only = batch([9], [-1], [1])
    merged = merge_trees([HEAD, root_only], budget=4)
    assert paths(merged) == pytest.approx(paths(HEAD))


def test_batches_merge_per_request():
    two = TreeBatch(torch.tensor([[9, 1, 0], [8, 5, 6]]), torch.tensor([[-1, 0, -1], [-1, 0, 1]]),
                    torch.tensor([2, 3]), torch.log(torch.tensor([[1, 0.5, 0], [1, 0.5, 0.25]])))
    other = TreeBatch(torch.tensor([[9, 2], [8, 5]]), torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([2, 2]),
                      torch.log(torch.tensor([[1, 0.7], [1, 0.9]])))
    merged = merge_trees([two, other], budget=8)
    assert paths(merged, 0) == pytest.approx({(1,): 0.5, (2,): 0.7})
    assert paths(merged, 1) == pytest.approx({(5,): 0.9, (5, 6): 0.25})


def test_sources_without_scores_are_refused():
    with pytest.raises(ValueError, match="scores"):
        merge_trees([HEAD._replace(scores=None)], budget=4)
    with pytest.raises(ValueError, match="scores"):
        best_merged_chains([HEAD._replace(scores=None)], 4)


class FixedDrafter:
    """A source that drafts one fixed tree and records what it was given."""

    def __init__(self, trees: TreeBatch):
        self.trees, self.calls = trees, []

    def target_hidden_layers(self, num_target_layers):
        return (num_target_layers,)

    def prefill(self, request_ids, prompt_ids, hidden, first_tokens):
        self.calls.append(("prefill", list(request_ids)))

    def commit(self, request_ids, accepted_tokens, hidden, bonus):
        self.calls.append(("commit", list(request_ids)))

    def draft(self, request_ids, tree):
        return self.trees

    def release(self, request_ids):
        self.calls.append(("release", list(request_ids)))


def test_merged_drafter_feeds_every_source_and_merges_under_the_budget():
    from specplug.common.merge import MergedDrafter
    from specplug.common.tree import TreeConfig

    head, retrieval = FixedDrafter(HEAD), FixedDrafter(RETRIEVAL)
    drafter = MergedDrafter([head, retrieval])
    drafter.prefill(["r"], [[1]], [None], [9])
    drafter.commit(["r"], [[]], [None], [9])
    tree = drafter.draft(["r"], TreeConfig(depth=4, topk=4, budget=3))
    assert paths(tree) == pytest.approx(paths(merge_trees([HEAD, RETRIEVAL], budget=3)))
    assert int(tree.num_nodes[0]) == 4  # the root and 3 nodes
    drafter.release(["r"])
    assert head.calls == retrieval.calls == [("prefill", ["r"]), ("commit", ["r"]), ("release", ["r"])]
    assert drafter.target_hidden_layers(30) == (30,)
    with pytest.raises(ValueError, match="at least one drafter"):
        MergedDrafter([])
