"""The plugin is found through vLLM's entry point, switches on only for specplug heads,
and refuses heads that do not fit the target at engine start."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common.tree import TreeConfig
from specplug.vllm_eagle3 import check_vllm_version
from specplug.vllm_eagle3.bench_runner import spec_decode_stats, stats_from_outputs
from specplug.common.head_section import HeadSettings
from specplug.vllm_eagle3.settings import adapter_settings, specplug_section
from tests.vllm.conftest import PROMPTS, SPECPLUG_TREE, drafter_of
from tests.support.tiny_eagle3 import tiny_head_dir

pytestmark = pytest.mark.vllm


def greedy(max_tokens=16):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_entry_point_is_declared():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("specplug_eagle3") == "specplug.vllm_eagle3:register"


def test_version_guard_names_the_supported_version():
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match="supports vLLM 0.32.0, found 0.31.1"):
        check_vllm_version("0.31.1")


def test_settings_from_section_and_env_override():
    section = specplug_section({"specplug": SPECPLUG_TREE})
    assert adapter_settings(section, environ={}) == HeadSettings(TreeConfig(topk=3))
    assert adapter_settings(section, environ={"SPECPLUG_TREE": '{"topk": 1}'}).tree.topk == 1
    assert specplug_section({"architectures": ["LlamaForCausalLMEagle3"]}) is None
    with pytest.raises(ValueError, match="verification 'typical'"):
        adapter_settings({"verification": "typical"}, environ={})
    with pytest.raises(ValueError, match="SPECPLUG_TREE must be a JSON object"):
        adapter_settings(section, environ={"SPECPLUG_TREE": "topk=1"})


def test_specplug_head_switches_the_plugin_on(engine, target, specplug_head, specplug_log):
    llm = engine(target, specplug_head)
    drafter = drafter_of(llm)
    assert type(drafter).__name__ == "SpecplugEagleProposer"
    assert drafter.specplug == HeadSettings(TreeConfig(topk=3), payoff=False)  # the suite's SPECPLUG_PAYOFF=0
    assert any("specplug EAGLE-3 proposer active" in m for m in specplug_log.messages)


def test_plain_head_runs_vllm_builtin_eagle3(engine, target, plain_head):
    llm = engine(target, plain_head)
    assert drafter_of(llm).specplug is None
    outputs = llm.generate(PROMPTS[:4], greedy())
    assert token_ids(outputs) == token_ids(engine(target).generate(PROMPTS[:4], greedy()))
    assert stats_from_outputs(outputs).num_steps > 0


def test_prometheus_counters_give_tau(engine, constant_target, agreeing_head):
    """vLLM's own vllm:spec_decode_* counters see specplug's drafts (read right after
    the run: creating another engine resets the process-wide Prometheus registry)."""
    llm = engine(constant_target, agreeing_head)
    before = spec_decode_stats(llm.get_metrics())
    llm.generate(PROMPTS[:2], greedy(13))
    run = spec_decode_stats(llm.get_metrics()) - before
    assert run.num_steps == 2 * 3 and run.tau == 4.0


@pytest.mark.parametrize("field, overrides", [
    ("target_hidden_size", {"target_hidden_size": 64}),
    ("vocab_size", {"vocab_size": 1000}),
    ("eagle_aux_hidden_state_layer_ids", {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [1, 2, 7], "use_aux_hidden_state": True}}),
    ("eagle_aux_hidden_state_layer_ids", {"eagle_config": {
        "eagle_aux_hidden_state_layer_ids": [3, 1, 2], "use_aux_hidden_state": True}}),
])
def test_mismatched_head_fails_at_start_naming_the_field(target, field, overrides):
    from vllm import LLM

    head = tiny_head_dir(target, specplug=SPECPLUG_TREE, **overrides)
    with pytest.raises(Exception, match=field) as info:
        LLM(model=str(target), dtype="float32", max_model_len=512, enforce_eager=True,
            distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20,
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    assert "train" in str(info.value)  # the fix
