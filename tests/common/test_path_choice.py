"""Path choice: the chain verified from a drafted tree (pure torch, core)."""

import math

import pytest
import torch

from specplug.common.merge import merge_trees
from specplug.common.tree import DraftTree, TreeBatch, stack_trees
from specplug.common.path_choice import (
    best_chain_paths, best_chains, best_merged_chains, full_budget, lengthen_chains, pad_chains,
)
from specplug.common.retrieval.drafter import RetrievalDrafter

#             root  a    b    a->c  b->d  d->e
CANDIDATES = [[9,   1,   2,   3,    4,    5]]
PARENTS = [[-1, 0, 0, 1, 2, 4]]


def tree(probs):
    scores = torch.tensor([[math.log(p) for p in probs]])
    return TreeBatch(torch.tensor(CANDIDATES), torch.tensor(PARENTS), torch.tensor([6]), scores)


def test_short_likely_path_beats_long_unlikely_one_and_is_padded():
    # a, c: expected 0.6 + 0.3 = 0.9 > b, d, e: 0.3 + 0.27 + 0.243
    assert best_chains(tree([1, .6, .3, .3, .27, .243]), 3).tolist() == [[1, 3, 3]]


def test_long_path_wins_when_it_expects_more():
    # b, d, e: 0.35 + 0.34 + 0.33 > a, c: 0.4 + 0.05
    assert best_chains(tree([1, .4, .35, .05, .34, .33]), 3).tolist() == [[2, 4, 5]]


def test_full_budget_counts_every_drafted_node():
    assert full_budget(depth=4, topk=4, draft_vocab=100) == 4 + 3 * 16
    assert full_budget(depth=3, topk=4, draft_vocab=1) == 3


def test_pad_chains_repeats_the_last_token():
    chains = TreeBatch(torch.tensor([[9, 1, 2], [8, 0, 0]]), torch.tensor([[-1, 0, 1], [-1, -1, -1]]),
                       torch.tensor([3, 1]), None)
    assert pad_chains(chains, 4).tolist() == [[1, 2, 2, 2], [8, 8, 8, 8]]


def test_best_chain_paths_counts_the_path_tokens():
    chains, _, lengths = best_chain_paths(tree([1, .6, .3, .3, .27, .243]), 3)
    assert chains.tolist() == [[1, 3, 3]] and lengths.tolist() == [2]


def _retrieval(tokens):
    drafter = RetrievalDrafter()
    drafter.prefill("r", tokens)
    return drafter


def test_lengthen_chains_continues_the_path_after_the_committed_tokens():
    # committed 5 6 7 8 2 5 | path 6: the suffix "5 6" occurred before, followed by 7 8 2
    drafter = _retrieval([5, 6, 7, 8, 2, 5])
    chains = torch.tensor([[6, 6, 6, 6]])
    out = lengthen_chains(drafter, ["r"], chains, torch.tensor([1]))
    assert out.tolist() == [[6, 7, 8, 2]]
    assert drafter.tokens("r") == [5, 6, 7, 8, 2, 5]  # state restored


def test_lengthen_chains_keeps_full_paths_and_unknown_requests():
    drafter = _retrieval([5, 6, 7, 8, 2, 5])
    chains = torch.tensor([[6, 7, 8, 2], [3, 3, 3, 3]])
    assert lengthen_chains(drafter, ["r", "other"], chains, torch.tensor([4, 1])).tolist() == chains.tolist()


def test_lengthen_chains_repeats_the_continuations_last_token():
    drafter = _retrieval([5, 6, 7, 5])  # path 6 -> context ... 5 6: continues with 7 5 6, then nothing
    assert lengthen_chains(drafter, ["r"], torch.tensor([[6] * 6]), torch.tensor([1])).tolist() == [[6, 7, 5, 6, 6, 6]]


def test_lengthen_chains_leaves_drafters_without_continuation_alone():
    class Plain:
        live = {"r": None}

    chains = torch.tensor([[6, 6]])
    assert lengthen_chains(Plain(), ["r"], chains, torch.tensor([1])) is chains


def test_lengthen_chains_keeps_the_padding_where_nothing_continues():
    drafter = _retrieval([5, 6, 7])
    out = lengthen_chains(drafter, ["r"], torch.tensor([[9, 9, 9]]), torch.tensor([1]))
    assert out.tolist() == [[9, 9, 9]] and drafter.tokens("r") == [5, 6, 7]


def test_lengthen_chains_survives_a_failing_drafter():
    class Broken(RetrievalDrafter):
        def continuation(self, *args, **kwargs):
            raise RuntimeError("boom")

    drafter = Broken()
    drafter.prefill("r", [5, 6, 7])
    chains = torch.tensor([[6, 6]])
    assert lengthen_chains(drafter, ["r"], chains, torch.tensor([1])).tolist() == [[6, 6]]
    assert drafter.tokens("r") == [5, 6, 7]


def _random_source(rng: torch.Generator, root: int, nodes: int, vocab: int, depth: int) -> DraftTree:
    """A scored tree at most `depth` deep: few tokens (so sources share paths), log
    scores falling along each path, some of them -inf."""
    parents, depths, tokens, scores = [-1], [0], [root], [0.0]
    for _ in range(1, nodes):
        open_nodes = [i for i, d in enumerate(depths) if d < depth]
        parent = open_nodes[int(torch.randint(len(open_nodes), (1,), generator=rng))]
        drop = float(torch.rand(1, generator=rng)) * 2 if float(torch.rand(1, generator=rng)) < 0.9 else float("inf")
        parents.append(parent)
        depths.append(depths[parent] + 1)
        tokens.append(int(torch.randint(vocab, (1,), generator=rng)))
        scores.append(scores[parent] - drop)
    return DraftTree(tokens, parents, scores)


@pytest.mark.parametrize("seed", range(40))
def test_best_merged_chains_equals_best_chain_paths_of_the_merged_tree(seed):
    rng = torch.Generator().manual_seed(seed)
    batch, depth = 1 + seed % 4, 1 + seed % 5
    roots = torch.randint(50, (batch,), generator=rng).tolist()
    sources = [stack_trees([_random_source(rng, r, 1 + int(torch.randint(9, (1,), generator=rng)), 3, depth)
                            for r in roots])
               for _ in range(2)]
    merged = merge_trees(sources, int(sum(s.num_nodes.max() for s in sources)))
    want = best_chain_paths(merged, depth)
    got = best_merged_chains(sources, depth)
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1], want[1])
    assert got[2].tolist() == want[2].tolist()
