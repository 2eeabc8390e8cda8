"""Model Runner V2 (vLLM's default on GPUs) has its own speculator, which specplug does
not drive: for a specplug head specplug makes vLLM select the V1 runner itself (vLLM logs
"Model Runner V2 does not yet support specplug heads ...; using the V1 model runner
instead"); other heads keep vLLM's choice. vLLM's selection logic is run here on the CPU
with the conditions of a GPU build forced (Triton present, no VLLM_USE_V2_MODEL_RUNNER)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

import vllm.config.vllm as vllm_config_module  # noqa: E402
from vllm.config.vllm import VllmConfig  # noqa: E402

from specplug.vllm_eagle3 import patches  # noqa: E402

pytestmark = pytest.mark.vllm
SELECTION = "VllmConfig._get_v2_model_runner_unsupported_features"


@pytest.fixture
def gpu_defaults(monkeypatch):
    """vLLM's selection as on a GPU build: Triton importable, no runner forced by the env,
    specplug's selection patch applied."""
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    # vLLM caches its environment once an engine has started: set the value it reads
    monkeypatch.setattr(vllm_config_module.envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)
    patches.PATCHES.apply_one(SELECTION)
    assert patches.PATCHES.state(SELECTION).applied, patches.PATCHES.state(SELECTION)


def _config(section: dict | None, method: str = "eagle3"):
    """A VllmConfig stand-in with just what the V2 selection reads."""
    hf_config = SimpleNamespace(**({"specplug": section} if section is not None else {}))
    spec = SimpleNamespace(method=method, parallel_drafting=False, use_heterogeneous_vocab=False,
                           draft_model_config=SimpleNamespace(hf_config=hf_config))
    config = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None), speculative_config=spec,
                             parallel_config=SimpleNamespace(distributed_executor_backend="mp",
                                                             pipeline_parallel_size=1, use_ubatching=False))
    config._get_v2_model_runner_unsupported_features = (
        lambda: VllmConfig._get_v2_model_runner_unsupported_features(config))
    return config


def use_v2(config) -> bool:
    return VllmConfig.use_v2_model_runner.fget(config)


def test_a_specplug_head_selects_the_v1_runner(gpu_defaults):
    config = _config({"method": "eagle3"})
    assert not use_v2(config)
    assert any("specplug heads" in f for f in VllmConfig._get_v2_model_runner_unsupported_features(config))


def test_other_heads_keep_vllms_choice_of_v2(gpu_defaults):
    """Negative control: the same selection without a specplug section picks V2."""
    assert use_v2(_config(None))


def test_an_explicit_v2_runner_is_still_vllms_choice(gpu_defaults, monkeypatch):
    monkeypatch.setattr(vllm_config_module.envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    assert use_v2(_config({"method": "eagle3"}))
