"""specplug.common.drafting.session: the per-request drafting decisions both engines share."""

from __future__ import annotations

import pytest
import torch

from specplug.common.drafting.sampled import SampledDrafts
from specplug.common.drafting.session import DraftingSession, StepRecord, draws_from_q, in_batch_order
from specplug.common.token_drafters import TokenDrafterBase, pack_trees
from specplug.common.tree import TreeBatch, TreeConfig
from specplug.common.verify_step import RequestSampling

VOCAB = 6
GREEDY = RequestSampling(temperature=0.0)
SAMPLED = RequestSampling(temperature=0.7)
SEEDED = RequestSampling(temperature=0.7, seed=3)


class Root(int):
    """A root token with the draft log-probs after it (what _best_paths reads)."""

    logprobs = torch.zeros(VOCAB)


class RootDrafting:
    """A drafter whose trees depend only on each root: top-k trees root -> root + 1 ->
    root + 2 (a chain), or, with sampled drafts, a chain drawn from a uniform q with the
    request's own generator (seeded per request id)."""

    def __init__(self):
        self.calls = []

    def trees(self, roots, tree: TreeConfig, sampled=None, request_ids=None) -> TreeBatch:
        self.calls.append(("drawn" if sampled is not None and sampled.on else "top-k", list(request_ids or [])))
        depth = tree.depth
        if sampled is not None and sampled.on:
            rows = [torch.randint(VOCAB, (depth,), generator=torch.Generator().manual_seed(hash(r) % 1000))
                    for r in request_ids]
            candidates = torch.stack([torch.cat([torch.tensor([root]), row]) for root, row in zip(roots, rows)])
            q = torch.full((len(roots), depth + 1, VOCAB), 1.0 / VOCAB)
        else:
            candidates = torch.stack([torch.arange(root, root + depth + 1) % VOCAB for root in roots])
            q = None
        parents = torch.arange(-1, depth).expand(len(roots), depth + 1).clone()
        num_nodes = torch.full((len(roots),), depth + 1)
        scores = -torch.arange(depth + 1.0).expand(len(roots), depth + 1).clone()
        return TreeBatch(candidates, parents, num_nodes, scores, q)

    def forget(self, live):
        pass


def test_draws_from_q_only_for_unseeded_sampled_requests_with_sampled_drafts_on():
    on, off = SampledDrafts(0.8), SampledDrafts(None)
    assert draws_from_q(on, SAMPLED)
    assert not draws_from_q(on, GREEDY)
    assert not draws_from_q(on, SEEDED)  # coupled draws keep a seeded request reproducible
    assert not draws_from_q(on, None)
    assert not draws_from_q(off, SAMPLED)
    assert not draws_from_q(None, SAMPLED)


def test_a_mixed_batch_drafts_each_request_as_it_would_alone():
    """Per request, never per batch: a greedy request beside a sampled one keeps its top-k
    tree, and every request's tree equals the tree it gets drafted alone."""
    tree, sampled_tree = TreeConfig(2, 1, 2), TreeConfig(3, 1, 3)
    ids, roots, params = ["g", "s", "z"], [Root(1), Root(2), Root(3)], [GREEDY, SAMPLED, SEEDED]
    session = DraftingSession(RootDrafting(), sampled=SampledDrafts(0.8))
    mixed = session.trees(roots, ids, params, tree, sampled_tree)
    assert set(session.record.drawn) == {"s"}
    for b in range(3):
        alone = DraftingSession(RootDrafting(), sampled=SampledDrafts(0.8)).trees(
            [roots[b]], [ids[b]], [params[b]], tree, sampled_tree)
        n = int(alone.num_nodes[0])
        assert int(mixed.num_nodes[b]) == n
        assert mixed.candidates[b, :n].tolist() == alone.candidates[0, :n].tolist()
    assert int(mixed.num_nodes[0]) == tree.depth + 1 and int(mixed.num_nodes[1]) == sampled_tree.depth + 1


def test_chains_draw_from_q_per_request_and_record_q_for_the_verify():
    session = DraftingSession(RootDrafting(), sampled=SampledDrafts(0.8))
    chains, expected = session.chains([Root(1), Root(2)], ["g", "s"], 3, [GREEDY, SAMPLED], TreeConfig(3, 1, 3))
    assert chains.shape == (2, 3)
    assert expected[1].isinf() and expected[0].isfinite()
    candidates = torch.cat([torch.zeros(2, 1, dtype=torch.long), chains], dim=1)  # roots in column 0
    q = session.draft_q(["g", "s"], candidates, torch.tensor([4, 4]))
    assert set(q) == {1} and q[1].shape == (3, VOCAB)
    assert session.draft_q(["g", "s"], candidates, torch.tensor([4, 4])) == {}  # verified once


def test_the_step_record_leaves_out_rows_the_engine_changed():
    record = StepRecord()
    record.drawn["s"] = ((4, 5, 1), torch.ones(3, VOCAB))
    candidates = torch.tensor([[0, 4, 5, 1], [0, 4, 2, 1]])
    assert set(record.draft_q(["s", "t"], candidates, [4, 4])) == {0}
    assert set(record.draft_q(["x", "s"], candidates, [4, 4])) == set()  # s's tokens differ in row 1
    assert record.draft_q(["s", "t"], candidates, [3, 4])[0].shape == (2, VOCAB)  # cut: its first rows


class ListDrafter(TokenDrafterBase):
    """A token drafter proposing nothing (tests sync only)."""

    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None):
        return pack_trees([int(t) for t in root_tokens], [([], [], [])] * len(request_ids))[0]


@pytest.mark.parametrize("have, length", [(None, 3), (2, 5), (6, 4), (4, 4)])
def test_sync_tokens_makes_the_drafter_hold_exactly_the_committed_prefix(have, length):
    drafter = ListDrafter()
    known = [10, 11, 12, 13, 14, 15]
    if have is not None:
        drafter.prefill("r", known[:have])
    session = DraftingSession(None, token_drafter=drafter)
    assert session.sync_tokens("r", length, lambda: known)
    assert drafter.live["r"] == known[:length]
    assert not session.sync_tokens("new", 9, lambda: known)  # the engine lacks them


def test_sync_committed_holds_the_prefix_then_the_new_rows():
    """A request the drafter has not followed (steps without drafts) is filled from the
    engine's tokens up to its first new row's position, then extended by the new rows; one
    whose tokens the engine lacks is left out."""
    from specplug.common.drafting.eagle import Committed

    drafter = ListDrafter()
    known = {"r": [10, 11, 12, 13, 14, 15], "gone": []}
    drafter.prefill("r", known["r"][:2])
    session = DraftingSession(None, token_drafter=drafter)
    rows = [Committed("r", torch.tensor([14, 15]), torch.tensor([3, 4]), torch.zeros(2, 1)),
            Committed("gone", torch.tensor([7]), torch.tensor([5]), torch.zeros(1, 1))]
    session.sync_committed(rows, known.__getitem__)
    assert drafter.live["r"] == known["r"] and "gone" not in drafter.live


def test_in_batch_order_puts_each_part_at_its_rows():
    a = TreeBatch(torch.tensor([[7, 1]]), torch.tensor([[-1, 0]]), torch.tensor([2]))
    b = TreeBatch(torch.tensor([[8, 2, 3], [9, 0, 0]]), torch.tensor([[-1, 0, 1], [-1, -1, -1]]),
                  torch.tensor([3, 1]))
    out = in_batch_order([([1], a), ([0, 2], b)], 3)
    assert out.candidates[:, 0].tolist() == [8, 7, 9]
    assert out.num_nodes.tolist() == [3, 2, 1]


def test_stale_requests_are_freed_only_past_the_bound():
    """Up to max_live held requests nothing is freed; past it, every held request missing
    from the step's batch is (negative control: at the bound, none)."""
    from specplug.common.drafting.session import stale_requests

    assert stale_requests(["a", "b", "c"], ["a"], max_live=3) == []
    assert stale_requests(["a", "b", "c", "d"], ["a", "c"], max_live=3) == ["b", "d"]
    assert stale_requests({"a": 1, "b": 2}, {"b"}, max_live=1) == ["a"]


class CatchUpLog:
    """An EagleDrafting stand-in that records what the session asked of the head."""

    def __init__(self):
        self.deferred, self.caught_up = [], []

    def defer(self, requests):
        self.deferred.append(list(requests))

    def catch_up(self, requests):
        self.caught_up.append(list(requests))
        return [f"root of {r}" for r in requests]


class AloneFor:
    """A token drafter that drafts alone (chain of 7s) exactly when every request is in `ids`."""

    def __init__(self, ids):
        self.ids = set(ids)

    def alone(self, request_ids, depth):
        return torch.full((len(request_ids), depth), 7) if set(request_ids) <= self.ids else None


def test_catch_up_defers_the_head_when_it_does_not_draft():
    """No head step when a step drafts nothing or the token drafter drafts alone (the rows
    wait for one catch-up); the head catches up otherwise, and in stage tree (chains=False)
    even where the drafter could draft alone."""
    drafting = CatchUpLog()
    session = DraftingSession(drafting, token_drafter=AloneFor({"a"}))
    assert session.catch_up(["a", "b"], ["a", "b"], depth=0) == (None, None)
    roots, alone = session.catch_up(["a"], ["a"], depth=3)
    assert roots is None and alone.tolist() == [[7, 7, 7]] and session.drafted_alone == 1
    assert drafting.deferred == [["a", "b"], ["a"]] and not drafting.caught_up
    assert session.catch_up(["a", "b"], ["a", "b"], depth=2) == (["root of a", "root of b"], None)
    assert session.catch_up(["a"], ["a"], depth=2, chains=False) == (["root of a"], None)
    assert session.catch_up(["a"], [], depth=2) == (["root of a"], None)  # nothing kept: caught up all the same
    assert len(drafting.deferred) == 2 and len(drafting.caught_up) == 3
