"""MEDUSA, SPECPLUG_EAGLE3 and RETRIEVAL are found through the entry point, and bad arguments fail
before any model loads."""

import importlib.metadata
import subprocess
import sys

import pytest

from specplug.sglang_medusa.settings import eagle3_settings, medusa_settings
from tests.sglang.conftest import ENGINE_ARGS


def test_entry_point_registers_medusa_and_tree_attention():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert names.get("specplug_medusa") == "specplug.sglang_medusa:register"
    load_plugins()
    algo = SpeculativeAlgorithm.from_string("medusa")
    assert algo.name == "MEDUSA" and algo.is_speculative() and not algo.is_eagle()
    assert not algo.need_topk() and not algo.carries_draft_hidden_states() and not algo.has_draft_kv()
    assert "TorchNativeAttnBackend.forward_extend" in " ".join(HookRegistry._patched)
    retrieval = SpeculativeAlgorithm.from_string("retrieval")
    assert retrieval.name == "RETRIEVAL" and not retrieval.has_draft_kv() and not retrieval.need_topk()
    eagle3 = SpeculativeAlgorithm.from_string("specplug_eagle3")
    assert eagle3.name == "SPECPLUG_EAGLE3" and not eagle3.is_eagle() and not eagle3.has_draft_kv()


def _settings(**kw):
    from types import SimpleNamespace

    base = dict(speculative_draft_model_path=None, speculative_num_steps=None, speculative_eagle_topk=None,
                speculative_num_draft_tokens=None, speculative_accept_threshold_single=1.0,
                speculative_accept_threshold_acc=1.0)
    return medusa_settings(SimpleNamespace(**{**base, **kw}))


def test_settings_come_from_the_heads_section_then_arguments(medusa_heads, monkeypatch):
    monkeypatch.delenv("SPECPLUG_MEDUSA_TREE", raising=False)
    s = _settings(speculative_draft_model_path=str(medusa_heads))
    assert (s.tree.depth, s.tree.topk, s.tree.budget, s.medusa_nodes) == (3, 2, 7, 8)
    assert s.verification.method == "lossless" and s.verification.rule == "rejection"
    assert s.medusa.head_accuracies is not None
    s = _settings(speculative_draft_model_path=str(medusa_heads), speculative_num_draft_tokens=5,
                  speculative_accept_threshold_single=0.2)
    assert s.medusa_nodes == 5 and s.verification.rule == "typical" and s.verification.typical_epsilon == 0.2
    assert s.verification.typical_delta == 0.3  # the Medusa-2 default where no value is given
    monkeypatch.setenv("SPECPLUG_MEDUSA_TREE", "chain")
    assert _settings(speculative_draft_model_path=str(medusa_heads)).medusa_nodes == 4  # 3 heads + root
    monkeypatch.setenv("SPECPLUG_MEDUSA_TREE", "[[0], [1], [0, 0]]")
    s = _settings(speculative_draft_model_path=str(medusa_heads))
    assert s.medusa.choices == ((0,), (1,), (0, 0)) and s.medusa_nodes == 4
    for value, on in (("1", True), ("0", False)):  # the schema's payoff switch, as in vLLM
        monkeypatch.setenv("SPECPLUG_PAYOFF", value)
        assert _settings(speculative_draft_model_path=str(medusa_heads)).payoff is on


def test_medusa_draft_temperature(medusa_heads, monkeypatch):
    """Sampled drafts: SPECPLUG_DRAFT_TEMPERATURE (or the section's "draft_temperature");
    refused with typical acceptance, which never reads q."""
    assert _settings(speculative_draft_model_path=str(medusa_heads)).draft_temperature is None
    monkeypatch.setenv("SPECPLUG_DRAFT_TEMPERATURE", "0.7")
    assert _settings(speculative_draft_model_path=str(medusa_heads)).draft_temperature == 0.7
    with pytest.raises(ValueError, match="MEDUSA: draft_temperature .* typical acceptance never reads q"):
        _settings(speculative_draft_model_path=str(medusa_heads), speculative_accept_threshold_single=0.2)
    monkeypatch.setenv("SPECPLUG_DRAFT_TEMPERATURE", "hot")
    with pytest.raises(ValueError, match="MEDUSA: SPECPLUG_DRAFT_TEMPERATURE must be a temperature > 0"):
        _settings(speculative_draft_model_path=str(medusa_heads))


def test_medusa_hybrid_drafter(medusa_heads, monkeypatch):
    """Hybrid MEDUSA: SPECPLUG_RETRIEVAL (or the section's "retrieval" / "drafter"), as
    for SPECPLUG_EAGLE3; a misspelt field is named with the algorithm."""
    monkeypatch.delenv("SPECPLUG_RETRIEVAL", raising=False)
    assert _settings(speculative_draft_model_path=str(medusa_heads)).drafter is None
    monkeypatch.setenv("SPECPLUG_RETRIEVAL", "1")
    assert _settings(speculative_draft_model_path=str(medusa_heads)).drafter.name == "retrieval"
    monkeypatch.setenv("SPECPLUG_RETRIEVAL", '{"ngarm": 3}')
    with pytest.raises(ValueError, match="MEDUSA: .*ngarm"):
        _settings(speculative_draft_model_path=str(medusa_heads))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "--speculative-draft-model-path"),
    ({"speculative_num_steps": 9}, "at most the number of Medusa heads"),
    ({"speculative_eagle_topk": 0}, "--speculative-eagle-topk"),
    ({"speculative_accept_threshold_single": 1.5}, "--speculative-accept-threshold-single"),
])
def test_bad_arguments_are_named(medusa_heads, kwargs, message):
    kwargs.setdefault("speculative_draft_model_path", None if not kwargs else str(medusa_heads))
    with pytest.raises(ValueError, match=message):
        _settings(**kwargs)


def _eagle3(head, environ=None, **kw):
    from types import SimpleNamespace

    base = dict(speculative_draft_model_path=str(head), speculative_num_steps=None, speculative_eagle_topk=None,
                speculative_num_draft_tokens=None)
    return eagle3_settings(SimpleNamespace(**{**base, **kw}), environ or {})


@pytest.fixture(scope="module")
def eagle3_head(sgl_model):
    from tests.support.tiny_eagle3 import tiny_head_dir

    return tiny_head_dir(sgl_model, specplug={"version": 1, "method": "eagle3", "retrieval": True,
                                              "tree": {"depth": 3, "topk": 2, "budget": 6, "stop_below": 0.1}})


def test_eagle3_settings_come_from_the_heads_section_then_arguments(eagle3_head):
    s = _eagle3(eagle3_head)
    assert (s.tree.depth, s.tree.topk, s.tree.budget, s.tree.stop_below) == (3, 2, 6, 0.1)
    assert _eagle3(eagle3_head, {"SPECPLUG_PAYOFF": "on"}).payoff
    assert s.drafter.name == "retrieval" and s.draft_temperature is None
    s = _eagle3(eagle3_head, {"SPECPLUG_RETRIEVAL": "0", "SPECPLUG_DRAFT_TEMPERATURE": "0.7"},
                speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=9)
    assert (s.tree.depth, s.tree.topk, s.tree.budget, s.drafter, s.draft_temperature) == (5, 1, 8, None, 0.7)
    assert _eagle3(eagle3_head, {"SPECPLUG_DRAFT_TEMPERATURE": " 0.0"}).draft_temperature is None
    assert not _eagle3(eagle3_head, {"SPECPLUG_PAYOFF": "off"}).payoff


def test_sampled_trees_fit_the_node_budget():
    from specplug.common.tree import TreeConfig
    from specplug.common.drafting.sampled import sampled_tree

    for depth, budget in ((4, 15), (6, 4), (3, 3), (1, 1)):
        tree = sampled_tree(TreeConfig(depth=depth, topk=2, budget=budget))
        assert tree.depth * tree.topk <= budget and tree.depth <= depth


@pytest.mark.parametrize("environ, kwargs, message", [
    ({}, {"speculative_eagle_topk": 0}, "SPECPLUG_EAGLE3: --speculative-eagle-topk"),
    ({"SPECPLUG_DRAFT_TEMPERATURE": "-1"}, {}, "SPECPLUG_DRAFT_TEMPERATURE must be a temperature > 0"),
    ({"SPECPLUG_DRAFT_TEMPERATURE": "warm"}, {}, "SPECPLUG_DRAFT_TEMPERATURE"),
    ({"SPECPLUG_RETRIEVAL": '{"ngarm": 3}'}, {}, "SPECPLUG_EAGLE3: .*ngarm"),
    ({"SPECPLUG_ADAPTIVE": "1"}, {}, "SPECPLUG_EAGLE3 in SGLang does not support 'adaptive'.*unset SPECPLUG_ADAPTIVE"),
    ({"SPECPLUG_GATE": "1"}, {}, "SPECPLUG_EAGLE3 in SGLang does not support 'gate'.*serve the head in vLLM"),
])
def test_bad_eagle3_settings_are_named(eagle3_head, environ, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _eagle3(eagle3_head, environ, **kwargs)


def test_engine_rejects_bad_arguments_before_model_load(sgl_model, medusa_heads, tmp_path):
    """The error is raised in the calling process by validate_server_args: no scheduler
    process (which loads the model) is ever started."""
    import sglang

    from tests.support.tiny_llama import tiny_llama_dir
    from tests.support.tiny_medusa import medusa_heads_dir

    other_target = tiny_llama_dir(hidden_size=64, num_heads=2, num_kv_heads=1)
    foreign_heads = medusa_heads_dir(other_target, tmp_path / "foreign", fit_steps=0)
    cases = [
        (dict(speculative_num_steps=7), "at most the number of Medusa heads"),
        (dict(speculative_draft_model_path=str(tmp_path / "missing")), "--speculative-draft-model-path"),
        (dict(speculative_draft_model_path=str(foreign_heads)), "hidden_size"),
    ]
    for extra, message in cases:
        kwargs = {**ENGINE_ARGS, "speculative_algorithm": "MEDUSA",
                  "speculative_draft_model_path": str(medusa_heads), **extra}
        with pytest.raises(ValueError, match=message):
            sglang.Engine(model_path=str(sgl_model), **kwargs)
    for head, message in ((medusa_heads, "holds a medusa head, not EAGLE-3"), (tmp_path / "missing", "EAGLE-3 head")):
        kwargs = {**ENGINE_ARGS, "speculative_algorithm": "SPECPLUG_EAGLE3", "speculative_draft_model_path": str(head)}
        with pytest.raises(ValueError, match=message):
            sglang.Engine(model_path=str(sgl_model), **kwargs)


def test_launch_server_rejects_bad_arguments_before_model_load(sgl_model, medusa_heads):
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sgl_model), "--device", "cpu",
           "--attention-backend", "torch_native", "--speculative-algorithm", "MEDUSA",
           "--speculative-draft-model-path", str(medusa_heads), "--speculative-num-steps", "9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "at most the number of Medusa heads" in proc.stderr + proc.stdout
    assert "Load weight begin" not in proc.stderr + proc.stdout


def test_another_sglang_version_is_refused_by_name():
    from specplug.sglang_medusa import check_sglang_version

    check_sglang_version("0.5.23")
    with pytest.raises(RuntimeError, match="supports SGLang 0.5.23, found 0.5.24: install a supported version"):
        check_sglang_version("0.5.24")
