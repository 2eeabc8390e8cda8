"""Medusa heads' trees per engine step (specplug.common.drafting.medusa), engine-free: the
static template for greedy requests, chains drawn from q for unseeded sampled ones, the
adaptive family and its choice of none."""

import pytest
import torch

from specplug.common.drafters import MedusaDrafter
from specplug.common.drafting.medusa import MedusaDrafting, budget_configs
from specplug.common.head_section import HeadSettings, MedusaTree
from specplug.common.heads.medusa import MedusaConfig, MedusaHeads
from specplug.common.sglang_trees import root_only_batch
from specplug.common.tree import TreeConfig
from specplug.common.verify_step import RequestSampling

TREE = TreeConfig(depth=3, topk=2, budget=7)
GREEDY, SAMPLED = RequestSampling(temperature=0.0), RequestSampling(temperature=0.8)


def test_budget_family_and_flag():
    optimal = HeadSettings(tree=TREE)
    assert [c.budget for c in budget_configs(optimal)] == [1, 2, 4, 7]
    chain = HeadSettings(tree=TreeConfig(depth=3, topk=1, budget=3))
    assert [(c.depth, c.budget) for c in budget_configs(chain)] == [(1, 1), (2, 2), (3, 3)]
    fixed = HeadSettings(medusa=MedusaTree(shape="choices", choices=((0,), (1,), (0, 0))))
    assert budget_configs(fixed) == [fixed.tree]


def _drafting(settings: HeadSettings, requests=(0, 1, 2)) -> MedusaDrafting:
    torch.manual_seed(0)
    drafter = MedusaDrafter(MedusaHeads(MedusaConfig(3, 1, 16, 40)).eval())
    drafter.prefill(list(requests), [None] * len(requests), torch.randn(len(requests), 1, 16),
                    torch.arange(len(requests)))
    return MedusaDrafting(drafter, settings, drafter.template(settings.tree).num_nodes, environ={})


def _draft(drafting, params, synced=None):
    roots = torch.tensor([11, 12, 13])[:len(params)]
    return drafting.draft(list(range(len(params))), roots, params, lambda: synced.append(1), lambda started: 0.001)


def test_greedy_requests_share_the_static_template():
    drafting = _drafting(HeadSettings(tree=TREE))
    tree, shared = _draft(drafting, [GREEDY] * 3)
    assert shared == TREE and tree.candidates.shape == (3, drafting.template.num_nodes)
    assert tree.candidates[:, 0].tolist() == [11, 12, 13]
    assert torch.equal(tree.parents[0], drafting.template.parents)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        MedusaDrafting(drafting.drafter, HeadSettings(tree=TREE), 3)


def test_sampled_requests_draw_chains_from_q_and_share_nothing():
    drafting = _drafting(HeadSettings(tree=TREE, draft_temperature=1.0))
    tree, shared = _draft(drafting, [GREEDY, SAMPLED, GREEDY])
    assert shared is None and tree.candidates[:, 0].tolist() == [11, 12, 13]
    assert set(drafting.session.draft_q([0, 1, 2], tree.candidates, tree.num_nodes)) == {1}  # only row 1 drew


def test_adaptive_chooses_a_budget_or_the_roots_alone():
    drafting = _drafting(HeadSettings(tree=TREE, adaptive=True))
    assert [o.nodes for o in drafting.adaptive.options] == [1, 2, 4, 7]
    tree, shared = _draft(drafting, [GREEDY] * 3)
    assert tree is None and shared is None  # nothing measured at this batch: a plain step first
    drafting.verified(root_only_batch(torch.tensor([11, 12, 13])), torch.zeros(3, dtype=torch.long), 0.01)
    tree, shared = _draft(drafting, [GREEDY] * 3)  # the plain step measured: the smallest tree is tried next
    assert shared in budget_configs(drafting.settings) and tree.candidates.shape[1] == shared.budget + 1
