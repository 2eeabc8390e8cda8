"""Token drafters (specplug.common.token_drafters): how an engine chooses one, the state a
drafter keeps, and a third-party drafter found through its entry point."""

from __future__ import annotations

import pytest
import torch

from specplug.common import drafter_registry, hooks, token_drafters
from specplug.common.retrieval import RetrievalDrafter
from specplug.common.drafter_registry import DrafterChoice, drafter_choice
from specplug.common.token_drafters import TokenDrafterBase


@pytest.fixture(autouse=True)
def fresh_registry():
    hooks.reset_plugin_manager()  # the plugin folder is on sys.path (tests/conftest.py)
    yield
    hooks.reset_plugin_manager()


def test_the_entry_point_drafter_is_registered_and_built_by_name():
    assert {"retrieval", "lookup"} <= set(drafter_registry.token_drafter_names())
    drafter = drafter_registry.build(DrafterChoice("lookup", {"budget": 3, "ngram": 1}), vocab_size=100)
    drafter.prefill("a", [5, 6, 7, 5])
    tree = drafter.draft(["a"])
    assert tree.candidates.tolist() == [[5, 6, 7, 5]] and tree.parents.tolist() == [[-1, 0, 1, 2]]
    assert torch.allclose(tree.scores.exp(), torch.tensor([[1.0, 0.5, 0.25, 0.125]]))


@pytest.mark.parametrize("section, environ, expected", [
    ({}, {}, None),
    ({"retrieval": True}, {}, DrafterChoice("retrieval", {})),
    ({"retrieval": {"budget": 2}}, {}, DrafterChoice("retrieval", {"budget": 2})),
    ({"retrieval": True}, {"SPECPLUG_RETRIEVAL": "0"}, None),
    ({}, {"SPECPLUG_RETRIEVAL": '{"budget": 3}'}, DrafterChoice("retrieval", {"budget": 3})),
    ({"drafter": "lookup"}, {}, DrafterChoice("lookup", {})),
    ({"drafter": {"name": "lookup", "ngram": 3}}, {}, DrafterChoice("lookup", {"ngram": 3})),
    ({"retrieval": True}, {"SPECPLUG_DRAFTER": "lookup"}, DrafterChoice("lookup", {})),
    ({"retrieval": True}, {"SPECPLUG_DRAFTER": "0"}, None),
    ({}, {"SPECPLUG_DRAFTER": '{"name": "retrieval", "budget": 5}'}, DrafterChoice("retrieval", {"budget": 5})),
])
def test_choice_env_over_section(section, environ, expected):
    assert drafter_choice(section, environ) == expected


@pytest.mark.parametrize("section, environ, message", [
    ({"retrieval": True, "drafter": "lookup"}, {}, "both \"retrieval\" and \"drafter\""),
    ({"drafter": 3}, {}, "registered drafter's name"),
    ({}, {"SPECPLUG_DRAFTER": "{bad json"}, "SPECPLUG_DRAFTER must be"),
    ({}, {"SPECPLUG_DRAFTER": '{"ngram": 3}'}, "with \"name\""),
])
def test_bad_choices_are_named(section, environ, message):
    with pytest.raises(ValueError, match=message):
        drafter_choice(section, environ)


@pytest.mark.parametrize("choice, message", [
    (DrafterChoice("nope"), "unknown drafter 'nope'.*available"),
    (DrafterChoice("lookup", {"ngarm": 2}), "drafter 'lookup'.*ngarm"),
    (DrafterChoice("retrieval", {"bugdet": 2}), "unknown field"),
    (DrafterChoice("retrieval", {"datastore": "/no/such.npz"}), "specplug datastore build"),
])
def test_bad_settings_fail_before_anything_is_built(choice, message):
    with pytest.raises(ValueError, match=message):
        drafter_registry.check_choice(choice)


def test_retrieval_is_built_from_its_settings():
    drafter = drafter_registry.build(DrafterChoice("retrieval", {"budget": 3, "min_prob": 0.0}), vocab_size=100)
    assert isinstance(drafter, RetrievalDrafter) and drafter.budget == 3 and drafter.alone(["x"], 2) is None


def test_base_state_follows_the_engine():
    """prefill in chunks, extend, rollback, sync (append the new part / forget what the engine
    discarded), free; draft() is the subclass's only job."""
    d = TokenDrafterBase(budget=2, max_depth=2)
    d.prefill(1, [1, 2])
    d.prefill(1, torch.tensor([3]))
    d.extend(1, [4, 5])
    assert d.live[1] == [1, 2, 3, 4, 5]
    d.rollback(1, 3)
    assert d.length(1) == 3
    d.sync(1, [1, 2, 3], [4, 9])
    assert d.live[1] == [1, 2, 3, 4, 9]
    d.sync(1, [1, 2], [])
    assert d.live[1] == [1, 2]
    d.sync(2, [7], [8])
    assert d.live[2] == [7, 8]
    with pytest.raises(ValueError, match="rollback length"):
        d.rollback(1, 5)
    with pytest.raises(ValueError, match="call prefill"):
        d.extend(3, [1])
    d.free(1)
    d.free(99)  # unknown: no-op
    assert list(d.live) == [2] and d.alone([2], 3) is None
    with pytest.raises(NotImplementedError):
        d.draft([2])
    with pytest.raises(ValueError, match="budget must be an int"):
        TokenDrafterBase(budget=0)


def test_a_failing_drafter_costs_the_step_its_drafts_not_the_server(caplog):
    class Broken(TokenDrafterBase):
        def draft(self, request_ids, root_tokens=None, **overrides):
            raise RuntimeError("plugin bug")

    d = Broken()
    d.prefill("a", [1, 2])
    tree = token_drafters.draft_or_roots(d, ["a", "b"], [2, 7], max_depth=3)
    assert tree.candidates.tolist() == [[2], [7]] and tree.num_nodes.tolist() == [1, 1]
    assert "plugin bug" in caplog.text and "runs without its drafts" in caplog.text


def test_synced_token_drafter_syncs_before_drafting_and_drops_stale_requests():
    """drafting.session.SyncedTokenDrafter: each running request synced to the engine's tokens
    before it drafts; past max_live, requests missing from the batch are freed; a drafter
    that raises costs the step its drafts (the roots alone)."""
    from specplug.common.drafting.session import SyncedTokenDrafter

    class Recorder:
        def __init__(self):
            self.live, self.synced, self.freed, self.cleared = {}, [], [], False

        def sync(self, rid, prompt, output):
            self.live[rid] = list(prompt) + list(output)
            self.synced.append(rid)

        def free(self, rid):
            self.live.pop(rid, None)
            self.freed.append(rid)

        def clear_cache(self):
            self.cleared = True

        def draft(self, request_ids, roots, **overrides):
            raise RuntimeError("a drafter's bug")

    synced = SyncedTokenDrafter(Recorder(), max_live=2)
    synced.sync([("a", [1, 2], [3]), ("b", [4], [])])
    synced.sync([("c", [5], [])])  # three live, bound two: "a" and "b" left the batch
    assert synced.drafter.synced == ["a", "b", "c"] and set(synced.drafter.live) == {"c"}
    trees = synced.draft([("c", [5], [6])], [6])
    assert trees.candidates.tolist() == [[6]] and synced.drafter.live["c"] == [5, 6]
    synced.clear()
    assert not synced.drafter.live and synced.drafter.cleared
