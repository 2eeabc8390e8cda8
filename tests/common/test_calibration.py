"""specplug.common.policy.calibration: hybrid trees ranked on measured acceptance."""

from __future__ import annotations

import math

import pytest
import torch

from specplug.common.path_choice import best_chains
from specplug.common.policy.calibration import Calibration, HybridScale, monotone, path_scores
from specplug.common.tree import TreeBatch, check_parents


def batch(tokens, parents, probs) -> TreeBatch:
    """One request's tree as a TreeBatch with log scores."""
    return TreeBatch(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([len(tokens)]),
                     torch.tensor([[math.log(p) if p > 0 else float("-inf") for p in probs]]))


HEAD = batch([9, 1, 2, 3], [-1, 0, 0, 1], [1, 0.9, 0.05, 0.8])  # over-confident: 9 -> 1 -> 3; 9 -> 2
# 9 -> 2 -> 5, padded
RETRIEVAL = batch([9, 2, 5, 0], [-1, 0, 1, -1], [1, 0.6, 0.5, 0])._replace(num_nodes=torch.tensor([3]))


def test_pool_adjacent_violators():
    got = monotone(torch.tensor([0.1, 0.5, 0.3, 0.4, 0.9], dtype=torch.float64),
                   torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0], dtype=torch.float64))
    assert got.tolist() == pytest.approx([0.1, 0.4, 0.4, 0.4, 0.9])
    assert monotone(torch.tensor([0.2, 0.3], dtype=torch.float64), torch.ones(2, dtype=torch.float64)).tolist() \
        == pytest.approx([0.2, 0.3])


def test_unmeasured_sources_keep_their_scores():
    """Before any observation the map is the identity (up to the top bin), the root stays
    log 1, padding stays -inf, children stay below their parents."""
    out = Calibration(["head", "retrieval"]).apply("retrieval", RETRIEVAL)
    assert out.scores[0, 0] == 0.0 and out.scores[0, 3] == float("-inf")
    assert out.scores[0, 1:3].exp().tolist() == pytest.approx([0.6, 0.5], abs=1e-5)
    assert Calibration(["head"]).apply("head", HEAD).scores[0, 1].exp() == pytest.approx(0.9, abs=1e-5)


def test_an_over_confident_source_is_scaled_down_monotonically():
    calibration = Calibration(["head", "retrieval"])
    for _ in range(50):  # the head's 0.9-scored nodes are accepted 3 times in 10
        calibration.observe("head", [math.log(0.9)] * 10, [True] * 3 + [False] * 7)
    rates = calibration.rates("head")
    assert (rates[1:] >= rates[:-1]).all()
    head = calibration.apply("head", HEAD).scores[0].exp()
    assert head[1] == pytest.approx(0.3, abs=0.1)  # pooled with the unmeasured 0.85 bin below
    assert head[3] <= head[1] and head[2] <= head[1]
    assert calibration.apply("retrieval", RETRIEVAL).scores[0, 1].exp() == pytest.approx(0.6, abs=1e-5)


def test_the_merged_tree_follows_the_calibrated_source():
    """Uncalibrated, the head's 0.9 path wins; once measured at 0.3, retrieval's 0.6 does."""
    scale = HybridScale(["head", "retrieval"])
    assert best_chains(scale.merge(["r"], [HEAD, RETRIEVAL], budget=8), 2).tolist() == [[1, 3]]
    for _ in range(50):
        scale.calibration.observe("head", [math.log(0.9)] * 10, [True] * 3 + [False] * 7)
    merged = scale.merge(["r"], [HEAD, RETRIEVAL], budget=8)
    check_parents(merged.parents, merged.num_nodes)
    assert best_chains(merged, 2).tolist() == [[2, 5]]


def test_verified_chains_are_counted_per_source_and_position():
    """chose + verified: every source that drafted a verified path counts it once, as
    accepted up to num_accepted; positions past the verified drafts are not counted."""
    scale = HybridScale(["head", "retrieval"])
    scale.merge(["a", "b"], [stack(HEAD, HEAD), stack(RETRIEVAL, RETRIEVAL)], budget=8)
    scale.chose(["a", "b"], torch.tensor([[2, 5], [1, 3]]))
    scale.verified(["b", "a", "c"], [2, 1, 4], [1, 1, 0])  # any order; "c" drafted nothing
    verified, accepted = scale.calibration.verified.sum(1), scale.calibration.accepted.sum(1)  # [head, retrieval]
    # a: (2,) by both sources, accepted; b: the head's (1,) accepted and (1, 3) rejected
    assert verified.tolist() == pytest.approx([3, 1], abs=0.02)
    assert accepted.tolist() == pytest.approx([2, 1], abs=0.02)
    scale.verified(["a"], [2], [2])
    assert float(scale.calibration.verified.sum()) == pytest.approx(4, abs=0.02)  # nothing pending any more


def test_finished_requests_are_forgotten():
    scale = HybridScale(["head", "retrieval"])
    scale.merge(["a"], [HEAD, RETRIEVAL], budget=8)
    scale.chose(["a"], torch.tensor([[1, 3]]))
    scale.forget(live=set())
    scale.verified(["a"], [2], [2])
    assert float(scale.calibration.verified.sum()) == 0


def test_path_scores():
    assert path_scores(RETRIEVAL, 0) == pytest.approx({(2,): math.log(0.6), (2, 5): math.log(0.5)})


def stack(*trees: TreeBatch) -> TreeBatch:
    width = max(t.candidates.shape[1] for t in trees)

    def pad(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return TreeBatch(torch.cat([pad(t.candidates, 0) for t in trees]), torch.cat([pad(t.parents, -1) for t in trees]),
                     torch.cat([t.num_nodes for t in trees]),
                     torch.cat([pad(t.scores, float("-inf")) for t in trees]))
