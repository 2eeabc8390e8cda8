"""StepPolicy: one proposer's per-step draft depth, from adaptive or payoff control, and the
step timings it hands the cost models."""

from __future__ import annotations

import torch

from specplug.common.policy.step_policy import StepPolicy


class _Gate:
    """Records the step timings a draft gate is given."""

    def __init__(self):
        self.timed = []

    def step_timed(self, tokens, seconds):
        self.timed.append(tokens)


def test_without_control_every_step_drafts_the_full_depth():
    policy = StepPolicy(4, adaptive=False, payoff=False, all_or_none=False)
    assert policy.adaptive is None and policy.payoff is None
    policy.begin([1, 1])
    assert policy.depth(2) == 4 and policy.depth(0) == 4
    policy.verified([4, 4], torch.tensor([1, 2]))
    policy.end()


def test_payoff_control_chooses_among_its_arms_and_nothing_for_an_empty_batch():
    tree = StepPolicy(7, adaptive=False, payoff=True, all_or_none=True)
    assert tree.payoff.control.arms == (0, 7)
    assert tree.depth(0) == 0 and tree.depth(3) in (0, 7)
    chain = StepPolicy(3, adaptive=False, payoff=True, all_or_none=False)
    assert chain.payoff.control.arms == (0, 1, 2, 3)


def test_adaptive_replaces_payoff_control():
    policy = StepPolicy(3, adaptive=True, payoff=True, all_or_none=False)
    assert policy.payoff is None and policy.adaptive is not None
    assert policy.depth(0) == 0 and 0 <= policy.depth(2) <= 3


def test_the_step_between_two_calls_is_timed_with_its_tokens():
    gate = _Gate()
    policy = StepPolicy(3, adaptive=False, payoff=False, all_or_none=False, gate=gate)
    policy.begin([4, 1])
    assert gate.timed == []  # no step has been timed before the first call ends
    policy.end()
    policy.begin([4, 1])
    assert gate.timed == [5]
