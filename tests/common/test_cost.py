"""The cost model chooses speculation from measured costs and acceptance, down to none."""

import math

import pytest
import torch

from specplug.common.policy.cost import (
    AcceptanceTracker, AdaptiveConfig, Curve, SpecOption, StepCosts, chain_expected_tokens,
    choose, measure_curve, modelled_speedup, tree_expected_tokens,
)


def memory_bound_then_linear(knee: float = 64.0) -> Curve:
    """A target pass costs 10 ms flat up to `knee` tokens, then grows linearly."""
    return Curve([(1, 0.010), (knee, 0.010), (4 * knee, 0.040), (16 * knee, 0.160)])


def linear_costs() -> StepCosts:
    """Verify cost strictly linear in tokens (compute-bound everywhere)."""
    return StepCosts(verify=Curve([(1, 0.001), (1000, 1.0)]), draft=Curve([(1, 0.0005), (64, 0.002)]))


def tracker_with(alpha: float, config: AdaptiveConfig = AdaptiveConfig()) -> AcceptanceTracker:
    """A tracker whose every option has measured per-depth acceptance exactly `alpha`."""
    tracker = AcceptanceTracker(config)
    gen = torch.Generator().manual_seed(0)
    for option in config.options:
        for _ in range(400):
            # geometric number of accepted drafts, capped at the option's depth
            accepted = torch.zeros(8, dtype=torch.long)
            alive = torch.ones(8, dtype=torch.bool)
            for _d in range(option.depth):
                alive &= torch.rand(8, generator=gen) < alpha
                accepted += alive.long()
            tracker.update(option, accepted)
    return tracker


def test_chain_expected_tokens_matches_closed_form():
    for alpha in (0.0, 0.3, 0.8):
        for k in range(6):
            closed = (1 - alpha ** (k + 1)) / (1 - alpha)
            assert chain_expected_tokens([alpha] * k, k) == pytest.approx(closed)


def test_tree_expected_tokens_of_a_chain_equals_chain_formula():
    parents = torch.tensor([-1, 0, 1, 2])
    probs = torch.tensor([1.0, 0.5, 0.5, 0.5])
    assert tree_expected_tokens(parents, probs) == pytest.approx(chain_expected_tokens([0.5] * 3, 3))


def test_tree_expected_tokens_adds_sibling_paths():
    parents = torch.tensor([-1, 0, 0, 1])      # two children of the root, one grandchild
    probs = torch.tensor([1.0, 0.6, 0.3, 0.5])
    assert tree_expected_tokens(parents, probs) == pytest.approx(1 + 0.6 + 0.3 + 0.6 * 0.5)


def test_tracker_recovers_per_depth_acceptance():
    tracker = tracker_with(0.7)
    alphas = tracker.alphas(SpecOption(4, 8))
    assert all(abs(a - 0.7) < 0.05 for a in alphas), alphas


def test_curve_is_monotone_and_extrapolates_upward():
    curve = Curve([(1, 1.0), (10, 0.5), (20, 2.0)])   # a noisy dip at 10 is flattened
    assert curve(10) >= curve(1)
    assert curve(40) > curve(20)


def test_no_speculation_when_verify_is_linear_and_acceptance_low():
    assert choose(64, tracker_with(0.2), linear_costs()) is None
    assert choose(1, tracker_with(0.2), linear_costs()) is None


def test_largest_budget_at_batch_one_with_high_acceptance():
    costs = StepCosts(verify=memory_bound_then_linear(), draft=Curve([(1, 0.0002), (64, 0.001)]))
    chosen = choose(1, tracker_with(0.95), costs)
    assert chosen == max(AdaptiveConfig().options, key=lambda o: o.nodes)


def test_speculation_switches_off_as_batch_grows():
    costs = StepCosts(verify=memory_bound_then_linear(), draft=Curve([(1, 0.0005), (64, 0.004)]))
    tracker = tracker_with(0.7)
    assert choose(1, tracker, costs) is not None
    assert choose(256, tracker, costs) is None
    # modelled gains fall monotonically with batch for a fixed option
    option = SpecOption(4, 8)
    gains = [modelled_speedup(b, option, tracker.alphas(option), costs) for b in (1, 8, 32, 128)]
    assert gains == sorted(gains, reverse=True)


def test_unmeasured_option_borrows_measured_acceptance():
    tracker = AcceptanceTracker()
    tracker.update(SpecOption(2, 2), torch.tensor([2, 2, 2, 2]))
    assert tracker.alphas(SpecOption(3, 3))[0] > AdaptiveConfig().prior_alpha


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="nodes >= depth"):
        SpecOption(3, 2)
    with pytest.raises(ValueError, match="batch"):
        choose(0, AcceptanceTracker(), linear_costs())
    with pytest.raises(ValueError, match="point"):
        Curve([])


def test_measure_curve_times_each_size():
    calls = []
    curve = measure_curve(lambda n: calls.append(n), [1, 4], repeats=2, warmup=1)
    assert calls == [1, 1, 1, 4, 4, 4]
    assert curve.x == [1.0, 4.0] and all(math.isfinite(y) for y in curve.y)
