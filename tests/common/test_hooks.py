"""Plugin hooks: built-ins, entry-point discovery, name clashes."""

import textwrap

import pytest
import torch

from specplug.common import hooks
from specplug.common.verify_result import VerifyResult

PLUGIN_SOURCE = textwrap.dedent(
    """
    from specplug.common.hooks import hookimpl

    def toy_drafter(**kwargs):
        return ("toy drafter", kwargs)

    @hookimpl
    def specplug_drafters():
        return {"toy": toy_drafter}

    @hookimpl
    def specplug_samplers():
        return {"always-reject": lambda *a, **k: "rejected"}
    """
)


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A third-party distribution on sys.path whose entry point (group 'specplug') names a module."""
    (tmp_path / "specplug_toy_plugin.py").write_text(PLUGIN_SOURCE)
    dist = tmp_path / "specplug_toy_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specplug-toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[specplug]\ntoy = specplug_toy_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks.reset_plugin_manager()
    yield
    hooks.reset_plugin_manager()


def test_builtins_are_registered():
    pm = hooks.make_plugin_manager(load_entrypoints=False)
    assert set(hooks.tree_builders(pm)) == {"chain", "from_choices", "optimal_sparse", "dynamic", "merge"}
    assert set(hooks.samplers(pm)) == {"greedy", "rejection", "coupled", "typical"}
    greedy = hooks.get_sampler("greedy", pm)
    res = greedy(torch.tensor([[0, 1]]), torch.tensor([[-1, 0]]), torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]))
    assert isinstance(res, VerifyResult) and res.num_accepted.tolist() == [1]
    assert hooks.get_tree_builder("chain", pm)(2).num_nodes == 3


def test_entry_point_plugin_is_found(installed_plugin):
    pm = hooks.plugin_manager()
    assert "toy" in dict(pm.list_name_plugin())
    assert hooks.get_drafter("toy")(width=3) == ("toy drafter", {"width": 3})
    assert hooks.get_sampler("always-reject")() == "rejected"
    assert "rejection" in hooks.samplers()  # built-ins stay


def test_unknown_name_lists_what_is_available():
    pm = hooks.make_plugin_manager(load_entrypoints=False)
    with pytest.raises(ValueError, match=r"unknown sampler 'nope'; available: \['coupled', 'greedy'"):
        hooks.get_sampler("nope", pm)


def test_name_clash_names_both_plugins():
    class Clash:
        @hooks.hookimpl
        def specplug_samplers(self):
            return {"greedy": None}

    pm = hooks.make_plugin_manager(load_entrypoints=False)
    pm.register(Clash(), name="clashing-plugin")
    with pytest.raises(ValueError, match="specplug.builtins.*clashing-plugin"):
        hooks.samplers(pm)


def test_hook_must_return_a_dict():
    class Bad:
        @hooks.hookimpl
        def specplug_drafters(self):
            return ["not", "a", "dict"]

    pm = hooks.make_plugin_manager(load_entrypoints=False)
    pm.register(Bad(), name="bad")
    with pytest.raises(TypeError, match="'bad'.*dict"):
        hooks.drafters(pm)


def test_pyproject_declares_the_group_and_our_entry_point_is_not_loaded_twice(tmp_path, monkeypatch):
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    group = pyproject["project"]["entry-points"][hooks.ENTRY_POINT_GROUP]
    assert group[hooks.BUILTIN_NAME] == "specplug.common.hooks:BUILTINS"
    # an installed copy of that entry point must be skipped, not registered a second time
    dist = tmp_path / "specplug_again-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: specplug-again\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[specplug]\n{hooks.BUILTIN_NAME} = specplug.common.hooks:BUILTINS\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = hooks.make_plugin_manager()
    assert set(hooks.samplers(pm)) >= {"greedy", "rejection", "typical"}


def test_builtin_retrieval_drafter_and_merge_are_registered():
    from specplug.common.hooks import get_drafter, get_tree_builder, make_plugin_manager
    from specplug.common.merge import merge_trees
    from specplug.common.retrieval import RetrievalDrafter

    pm = make_plugin_manager(load_entrypoints=False)
    assert get_drafter("retrieval", pm) is RetrievalDrafter
    assert get_tree_builder("merge", pm) is merge_trees
