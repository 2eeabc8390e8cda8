"""The shared adaptive controller: it learns step costs and acceptance from what an
engine reports and chooses per step a chain depth or tree budget, down to none."""

import pytest
import torch

from specplug.common.policy.adaptive import (
    AdaptiveController, AdaptiveSettings, Timings, pinned_costs, tree_option,
)
from specplug.common.policy.adaptive_chains import ChainAdaptiveController
from specplug.common.policy.cost import (
    Curve, SpecOption, StepCosts, chain_expected_tokens, tree_depth_alphas, tree_expected_tokens,
)
from specplug.common.static_trees import optimal_sparse

CHAINS = tuple(SpecOption(d, d) for d in range(1, 5))


def medusa_budgets(accuracies, budgets=(1, 2, 4, 8, 16)):
    """Medusa optimal sparse trees of each budget as options (one drafter pass each),
    with per-depth prior acceptance modelled from the head accuracies."""
    return tuple(tree_option(optimal_sparse(accuracies, b)[0], accuracies) for b in budgets)


STRONG = [[0.95, 0.03], [0.9, 0.05], [0.9, 0.05], [0.85, 0.05]]   # [heads, topk]
WEAK = [[0.2, 0.05], [0.1, 0.03], [0.05, 0.02], [0.05, 0.01]]
BUDGETS = medusa_budgets(WEAK)


def run(controller, batch, steps, verify_cost, draft_cost=lambda b: 0.0, accept=None, gen=None):
    """Drive `controller` like an engine for `steps` steps at `batch`: each step it times the
    target pass with verify_cost(tokens), the drafting with draft_cost(batch), and accepts a
    geometric number of drafts per request with per-depth acceptance `accept` (a number, or
    option -> per-depth list). Returns the options chosen, in order."""
    gen = gen or torch.Generator().manual_seed(0)
    per_depth = accept if callable(accept) else (lambda option: [accept] * option.depth)
    chosen = []
    for _ in range(steps):
        option = controller.choose(batch)
        chosen.append(option)
        nodes = 0 if option is None else option.nodes
        controller.verify_timed(batch * (nodes + 1), verify_cost(batch * (nodes + 1)))
        if option is not None:
            controller.draft_timed(batch, option, draft_cost(batch) * option.passes)
            alive = torch.ones(batch, dtype=torch.bool)
            accepted = torch.zeros(batch, dtype=torch.long)
            for alpha in per_depth(option):
                alive &= torch.rand(batch, generator=gen) < alpha
                accepted += alive.long()
            controller.accepted(option, accepted)
    return chosen


def linear(per_token=1e-3):
    return lambda tokens: per_token * tokens


def flat(seconds=0.01):
    return lambda tokens: seconds


def memory_bound_then_linear(knee=64, seconds=0.01):
    return lambda tokens: seconds * max(1.0, tokens / knee)


@pytest.mark.parametrize("options", [CHAINS, BUDGETS], ids=["chains", "tree-budgets"])
def test_chooses_none_when_verify_is_linear_and_acceptance_low(options):
    """Compute-bound everywhere (verify cost linear in tokens), acceptance 0.2: after at most
    one probe of the smallest option, every step at batch 64 is plain decoding."""
    controller = AdaptiveController(options)
    chosen = run(controller, 64, 40, linear(), accept=0.2)
    spec_steps = [o for o in chosen if o is not None]
    assert len(spec_steps) <= 1 and all(o == options[0] for o in spec_steps)
    assert chosen[-30:] == [None] * 30


@pytest.mark.parametrize("options", [CHAINS, medusa_budgets(STRONG)], ids=["chains", "tree-budgets"])
def test_largest_option_at_batch_one_with_high_acceptance(options):
    """Verify cost flat (memory-bound), high acceptance (0.95 per depth for chains; the
    strong heads' modelled acceptance for trees), cheap drafts: it climbs to the largest
    option and stays there."""
    controller = AdaptiveController(options)
    accept = 0.95 if options is CHAINS else (lambda option: option.prior_alphas)
    chosen = run(controller, 1, 60, memory_bound_then_linear(), draft_cost=lambda b: 1e-4, accept=accept)
    assert chosen[-20:] == [options[-1]] * 20


def test_exploration_climbs_one_size_at_a_time_and_stops_where_it_cannot_pay():
    """Nothing measured: a plain step first (base cost), then each larger option once, in
    order of size, while the optimistic cost lets it pay. With a verify cost that doubles
    from 2 tokens on and acceptance 0.3, the first probe shows that nothing larger pays."""
    controller = AdaptiveController(CHAINS)
    assert controller.choose(1) is None
    controller.verify_timed(1, 0.01)
    assert controller.choose(1) == CHAINS[0]  # optimistic: 2 tokens cost what 1 did
    controller.verify_timed(2, 0.02)          # measured: twice as dear
    controller.draft_timed(1, CHAINS[0], 0.001)
    controller.accepted(CHAINS[0], torch.tensor([0]))
    for _ in range(10):
        controller.accepted(CHAINS[0], torch.tensor([0, 0, 1]))
    assert controller.choose(1) is None       # CHAINS[1] would need 3 tokens >= cost(2): no gain
    assert controller.choice_counts == {0: 2, 1: 1}


def test_unmeasured_large_batch_runs_plain_first():
    controller = AdaptiveController(CHAINS)
    run(controller, 1, 30, flat(), accept=0.9)
    assert controller.choose(64) is None  # 64 tokens never timed: measure the base cost
    controller.verify_timed(64, 0.01)
    assert controller.choose(64) == CHAINS[0]  # now only the next size up is probed


def test_negative_control_without_optimism_bound_it_would_probe_the_largest():
    """The exploration bound matters: offering every unmeasured option at the optimistic
    cost would pick the LARGEST (most tokens for the same cost) — 64 x 17 tokens at batch 64."""
    from specplug.common.policy.adaptive import _optimistic
    from specplug.common.policy.cost import choose

    BUDGETS = medusa_budgets(STRONG)
    controller = AdaptiveController(BUDGETS)
    controller.verify_timed(64, 0.01)
    costs = _optimistic(controller.measured_costs(), 64, BUDGETS[-1], 64)
    assert choose(64, controller.tracker, costs, BUDGETS) == BUDGETS[-1]
    assert controller.choose(64) == BUDGETS[0]


def test_refresh_retimes_the_next_option_when_it_is_rated_close():
    settings = AdaptiveSettings(refresh_every=4)
    controller = AdaptiveController(CHAINS, settings)
    chosen = run(controller, 1, 40, memory_bound_then_linear(knee=3), draft_cost=lambda b: 1e-4, accept=0.6)
    assert len({o for o in chosen if o is not None}) >= 3  # several sizes timed, not one locked in


def test_costs_override_pins_the_decision_without_exploration():
    BUDGETS = medusa_budgets(STRONG)
    controller = AdaptiveController(BUDGETS)
    controller.costs_override = StepCosts(verify=Curve([(1, 1.0), (2, 2.0)]), draft=Curve([(1, 10.0)]))
    assert [controller.choose(b) for b in (1, 8, 64)] == [None, None, None]
    controller.costs_override = StepCosts(verify=Curve([(1, 1.0), (10_000, 1.0)]), draft=Curve([(1, 0.0)]))
    assert controller.choose(1) == BUDGETS[-1]


def test_tree_option_prior_is_the_modelled_tree_acceptance():
    parents, depth = torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2])
    accept = torch.tensor([1.0, 0.5, 0.2, 0.4])
    alphas = tree_depth_alphas(parents, depth, accept)
    assert chain_expected_tokens(alphas, 2) == pytest.approx(tree_expected_tokens(parents, accept))
    template, expected = optimal_sparse(STRONG, 8)
    option = tree_option(template, STRONG)
    assert (option.depth, option.nodes, option.passes) == (template.max_depth, 8, 1)
    assert chain_expected_tokens(option.prior_alphas, option.depth) == pytest.approx(expected)
    assert option == SpecOption(option.depth, 8, 1)  # the prior is not part of the option's identity


def test_measured_option_calibrates_the_modelled_priors_of_the_others():
    """Heads that accept half as often as their accuracies promise: once the small tree is
    measured, the large tree's prior is scaled down the same way (and without a measured
    option, the modelled prior stands)."""
    small, big = medusa_budgets(STRONG, (1, 8))
    controller = AdaptiveController([small, big])
    assert controller.tracker.alphas(big) == pytest.approx(list(big.prior_alphas))
    half = small.prior_alphas[0] / 2
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):  # 1600 draws at acceptance `half`: the estimate is within 0.05 (>5 sigma)
        controller.accepted(small, (torch.rand(8, generator=gen) < half).long())
    assert controller.tracker.alphas(small)[0] == pytest.approx(half, abs=0.05)
    assert controller.tracker.alphas(big)[0] == pytest.approx(big.prior_alphas[0] / 2, abs=0.05)


def test_timings_keep_a_window_and_use_the_median():
    timings = Timings(window=3)
    for seconds in (9.0, 1.0, 2.0, 3.0):
        timings.add(4, seconds)
    assert timings.count(4) == 3 and timings.points() == [(4, 2.0)]
    assert timings.points(min_samples=4) == []


def test_pinned_costs_from_env():
    assert pinned_costs({}) is None
    costs = pinned_costs({"SPECPLUG_ADAPTIVE_COSTS": '{"verify": [[1, 0.5], [3, 1.5]]}'})
    assert costs.verify(2) == pytest.approx(1.0) and costs.draft(8) == 0.0
    with pytest.raises(ValueError, match="SPECPLUG_ADAPTIVE_COSTS"):
        pinned_costs({"SPECPLUG_ADAPTIVE_COSTS": '{"draft": []}'})


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="at least one"):
        AdaptiveController([])
    with pytest.raises(ValueError, match="batch"):
        AdaptiveController(CHAINS).choose(0)
    with pytest.raises(ValueError, match="prior_alphas"):
        SpecOption(2, 2, prior_alphas=(0.5,))


def test_option_families_live_in_the_core():
    """Both engines take their adaptive options from here: vLLM chains of 1..k, SGLang
    static trees of doubling budgets up to the tree a TreeConfig builds."""
    from specplug.common.policy.adaptive import chain_options, tree_family
    from specplug.common.tree import TreeConfig

    assert [(o.depth, o.nodes) for o in chain_options(3)] == [(1, 1), (2, 2), (3, 3)]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        chain_options(0)
    assert [c.budget for c in tree_family(TreeConfig(depth=2, topk=2, budget=10))] == [1, 2, 4, 6]  # full tree: 6
    assert [c.budget for c in tree_family(TreeConfig(depth=3, topk=4, budget=8))] == [1, 2, 4, 8]
    assert [(c.depth, c.budget) for c in tree_family(TreeConfig(depth=3, topk=1, budget=9))] == [(1, 1), (2, 2), (3, 3)]
    assert TreeConfig(depth=2, topk=2, budget=10).static_nodes == 6
    assert TreeConfig(depth=3, topk=1, budget=9).static_nodes == 3


def test_verify_results_feed_the_acceptance_tracker():
    """Depth d of a chain counts as tried when all shallower drafts were accepted."""
    adaptive = ChainAdaptiveController(3)
    adaptive.record_verify([3, 3, 0], torch.tensor([3, 0, 0]))  # the 0-draft request is ignored
    option = adaptive.options[2]
    tried, accepted = adaptive.tracker._tried[option], adaptive.tracker._accepted[option]
    assert tried.tolist() == [2.0, 1.0, 1.0]
    assert accepted.tolist() == [1.0, 1.0, 1.0]


def test_controller_explores_upwards_then_uses_the_model():
    """A chain engine's calls drive the shared controller:
    nothing measured -> a plain step; then one size up at the optimistic cost; once the
    timings show a linear verify cost and dear drafts, no speculation."""
    adaptive = ChainAdaptiveController(2)
    assert adaptive.choose_depth(1) == 0
    adaptive.verify_timed(1, 1.0)  # a plain step of 1 token was timed
    assert adaptive.choose_depth(1) == 1
    for tokens in (1, 2, 3):  # batch 1 at depths 0, 1, 2
        adaptive.verify_timed(tokens, float(tokens))  # linear verify cost
    adaptive.draft_timed(1, 1, 10.0)
    assert adaptive.choose_depth(1) == 0  # linear verify, dear drafts: no speculation
    assert adaptive.depth_counts == {0: 2, 1: 1}
