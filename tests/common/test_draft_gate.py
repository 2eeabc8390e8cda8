"""The draft gate (specplug.common.policy.draft_gate): per request, drafts only where they pay."""

import math

import torch

from specplug.common.path_choice import best_chains, best_chains_expected
from specplug.common.policy.draft_gate import DraftGate, best_prefix
from specplug.common.tree import TreeBatch


def linear(base, per_token):
    return lambda n: base + per_token * n


def test_best_prefix_takes_requests_while_they_raise_the_rate():
    """Step cost 30 + 2.7 n (ms): one request's 4 drafts add 10.8 ms to a 32.7 ms step,
    so they pay from E > 0.33; at batch 1 E = 0.5 drafts, E = 0.2 does not."""
    cost = linear(30.0, 2.7)
    assert best_prefix(torch.tensor([0.5]), 1, 4, cost) == 1
    assert best_prefix(torch.tensor([0.2]), 1, 4, cost) == 0
    # batch 3 (38.1 ms plain): the two likely chains pay, the third (E 0.05) would lower
    # the rate; E 0.9 would not pay beside 1.5 (4.5 / 48.9 ms beats 5.4 / 59.7 ms)
    assert best_prefix(torch.tensor([0.05, 1.5, 1.2]), 3, 4, cost) == 2
    assert best_prefix(torch.tensor([0.05, 1.5, 0.9]), 3, 4, cost) == 1


def test_best_prefix_free_drafts_always_pay_and_a_margin_holds_back():
    flat = lambda n: 1.0  # noqa: E731 - verifying more tokens costs nothing
    assert best_prefix(torch.tensor([0.01, 0.02]), 2, 4, flat) == 2
    assert best_prefix(torch.tensor([0.01, 0.02]), 2, 4, flat, margin=1.1) == 0


def _timed_gate(cost, sizes):
    gate = DraftGate()
    for n in sizes:
        gate.step_timed(n, cost(n))
    return gate


def test_gate_keeps_the_likely_requests_of_a_batch():
    gate = _timed_gate(linear(0.030, 0.0027), [3, 7, 11, 15])
    keep = gate.choose(torch.tensor([0.05, 1.5, 1.2], dtype=torch.float64), batch=3, drafts=4)
    assert keep.tolist() == [False, True, True]
    assert (gate.drafted, gate.withheld) == (2, 1)


def test_gate_explores_first_then_measures():
    """Nothing timed: draft (and measure). The plain step of a batch never timed: run it."""
    gate = DraftGate()
    assert gate.choose(torch.tensor([0.01]), batch=1, drafts=4).tolist() == [True]
    gate.step_timed(5, 0.040)
    assert gate.choose(torch.tensor([3.0]), batch=1, drafts=4).tolist() == [False]
    gate.step_timed(1, 0.030)
    assert gate.choose(torch.tensor([3.0]), batch=1, drafts=4).tolist() == [True]
    assert gate.choose(torch.tensor([0.1]), batch=1, drafts=4).tolist() == [False]


def test_unmeasured_larger_steps_are_taken_at_the_largest_cost_timed():
    """Optimism: 2 requests drafting 4 each (10 tokens) were never timed; T(10) = T(6), so
    the second chain (E 0.3) is tried; on the linear cost it would not pay."""
    cost = linear(0.030, 0.0027)
    gate = _timed_gate(cost, [2, 6])
    keep = gate.choose(torch.tensor([1.0, 0.3], dtype=torch.float64), batch=2, drafts=4)
    assert keep.tolist() == [True, True]
    assert best_prefix(torch.tensor([1.0, 0.3]), 2, 4, cost) == 1


def test_inf_expected_always_drafts_and_scale_learns_from_verify():
    gate = _timed_gate(linear(0.030, 0.0027), [1, 5])
    assert gate.choose(torch.tensor([math.inf]), batch=1, drafts=4).tolist() == [True]
    assert gate.scale == 1.0
    for _ in range(200):  # predicted 1.0 each, accepted 0.5 on average: E is halved
        gate.verified(1.0, 0)
        gate.verified(1.0, 1)
    assert abs(gate.scale - 0.5) < 0.05
    # E 0.6 scaled to ~0.3 no longer pays (needs > 0.33 at these costs)
    assert gate.choose(torch.tensor([0.6], dtype=torch.float64), batch=1, drafts=4).tolist() == [False]


def test_best_chains_expected_is_the_chosen_paths_summed_reach():
    """Root -> a (p .6) -> c (p .5 of a); root -> b (p .3). Best path a-c: .6 + .3 = .9."""
    parents = torch.tensor([[-1, 0, 0, 1]])
    tokens = torch.tensor([[9, 1, 2, 3]])
    scores = torch.tensor([[0.0, math.log(0.6), math.log(0.3), math.log(0.3)]])
    trees = TreeBatch(candidates=tokens, parents=parents, scores=scores, num_nodes=torch.tensor([4]))
    chains, expected = best_chains_expected(trees, 3)
    assert chains.tolist() == [[1, 3, 3]] == best_chains(trees, 3).tolist()
    assert abs(float(expected[0]) - 0.9) < 1e-6
