"""A token drafter run as an engine's own algorithm (SGLang's RETRIEVAL and the like):
its settings from the defaults, SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER and the engine's tree
arguments (specplug.common.drafter_registry.token_drafter_settings), and each error."""

from __future__ import annotations

import pytest

from specplug.common.drafter_registry import token_drafter_settings
from specplug.common.head_section import Argument


def _retrieval(environ=None, name="retrieval", speculative_num_draft_tokens=None, speculative_num_steps=None):
    """As SGLang's adapter calls it: --speculative-num-draft-tokens N is budget N - 1."""
    arguments = {}
    if speculative_num_draft_tokens is not None:
        arguments["budget"] = Argument("--speculative-num-draft-tokens minus one", speculative_num_draft_tokens - 1)
    if speculative_num_steps is not None:
        arguments["max_depth"] = Argument("--speculative-num-steps", speculative_num_steps)
    return token_drafter_settings(name, environ or {}, arguments)


def test_retrieval_settings_come_from_the_defaults_then_environment_then_arguments(tmp_path):
    s = _retrieval()
    f = s.choice.settings
    assert (s.budget, s.num_nodes, s.max_depth, f["min_prob"], f["min_expected"]) == (8, 9, 8, 0, .5)
    s = _retrieval({"SPECPLUG_RETRIEVAL": '{"budget": 4, "min_prob": 0.2}'})
    assert (s.budget, s.choice.settings["min_prob"], s.choice.settings["min_expected"], s.num_nodes) == (4, 0.2, 0.5, 5)
    s = _retrieval({"SPECPLUG_RETRIEVAL": '{"budget": 4}'}, speculative_num_draft_tokens=7, speculative_num_steps=3)
    assert (s.budget, s.max_depth, s.choice.settings.get("datastore")) == (6, 3, None)
    s = _retrieval({"SPECPLUG_DRAFTER": '{"prior": 2.0}'})
    assert s.choice.settings["prior"] == 2.0


def test_a_plugin_drafters_settings_come_from_specplug_drafter_then_arguments():
    s = _retrieval({"SPECPLUG_DRAFTER": '{"name": "lookup", "ngram": 3}'}, name="lookup", speculative_num_steps=4)
    assert (s.choice.name, dict(s.choice.settings)) == ("lookup", {"budget": 8, "max_depth": 4, "ngram": 3})


@pytest.mark.parametrize("environ, kwargs, message", [
    ({"SPECPLUG_RETRIEVAL": "0"}, {}, "RETRIEVAL has no other drafter"),
    ({"SPECPLUG_RETRIEVAL": '{"budgte": 3}'}, {}, "unknown field"),
    ({"SPECPLUG_RETRIEVAL": '{"datastore": "/no/such.npz"}'}, {}, "specplug datastore build"),
    ({}, {"speculative_num_draft_tokens": 1}, "--speculative-num-draft-tokens minus one"),
    ({}, {"speculative_num_steps": 0}, "--speculative-num-steps"),
    ({"SPECPLUG_DRAFTER": "lookup"}, {}, "the algorithm chooses the drafter.*LOOKUP"),
    ({"SPECPLUG_DRAFTER": '{"ngarm": 1}'}, {"name": "lookup"}, "LOOKUP: drafter 'lookup'.*ngarm"),
])
def test_bad_retrieval_settings_are_named(environ, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _retrieval(environ, **kwargs)
