"""Path choice: the chain verified from a drafted tree (pure torch, core)."""

import math

import pytest
import torch

from specplug.common.tree import TreeBatch
from specplug.common.path_choice import best_chains, full_budget, pad_chains

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
