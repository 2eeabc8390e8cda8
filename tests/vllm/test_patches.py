"""Every vLLM patch in the registry (specplug.vllm_eagle3.patches) matches the installed
vLLM, applies, and undoes: the class- and module-level ones on vLLM itself, the
per-object ones on vLLM's own classes (objects made without an engine)."""

from __future__ import annotations

import pkgutil

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common.patches import INSTANCE, MARK, REGISTERED  # noqa: E402
from specplug.vllm_eagle3 import patches  # noqa: E402
from specplug.vllm_eagle3.patches import PATCHES  # noqa: E402

pytestmark = pytest.mark.vllm

ARGS = {patches.REFUSAL: ("specplug stays out (a test)",)}  # apply arguments, by patch name
RUNNER_PATCHES = (patches.PREPARE_INPUTS, patches.BUILD_ATTENTION_METADATA, patches.PROPOSE_DRAFT_TOKEN_IDS)


def vllm_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.mark.parametrize("name", [p.name for p in PATCHES])
def test_every_patch_matches_the_installed_vllm(name):
    state = PATCHES.check(name)
    if state.matched is None:  # only a platform condition may leave a patch out
        assert PATCHES[name].skip is not None and not vllm_cpu() and "vLLM-CPU only" in state.reason
    else:
        assert state.matched, state.reason


def observe(patch):
    """What the patch changes, as a test can see it."""
    target = pkgutil.resolve_name(patch.target)
    return target.get_path() if patch.kind == REGISTERED else target


@pytest.mark.parametrize("name", [p.name for p in PATCHES if p.kind != INSTANCE])
def test_class_and_module_patches_apply_and_undo(name):
    patch = PATCHES[name]
    if PATCHES.state(name).applied or PATCHES.check(name).matched is None:
        pytest.skip(f"{name}: applied by register() in this process already, or not on this platform")
    before = observe(patch)
    try:
        state = PATCHES.apply_one(name, *ARGS.get(name, ()))
        assert state.applied and state.matched, state.reason
        after = observe(patch)
        if patch.kind == REGISTERED:
            assert after == patches.TREE_ATTENTION and before == patches.CPU_ATTENTION
        else:
            assert after is not before and vars(after)[MARK] == name
        assert PATCHES.apply_one(name, *ARGS.get(name, ())) is state and observe(patch) == after  # once
    finally:
        PATCHES.undo(name)
    assert observe(patch) == before if patch.kind == REGISTERED else observe(patch) is before


def test_instance_patches_apply_to_vllms_objects_and_undo():
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from specplug.vllm_eagle3.runner_state import RunnerState

    enabled_here = [p.name for p in PATCHES if p.kind == INSTANCE and not PATCHES.state(p.name).applied]
    for name in enabled_here:
        assert PATCHES.apply_one(name).applied, PATCHES.state(name).reason
    runner = GPUModelRunner.__new__(GPUModelRunner)  # vLLM's class, no engine behind it
    own = runner.rejection_sampler = RejectionSampler.__new__(RejectionSampler)
    layer = LinearBase.__new__(LinearBase)
    layer.__dict__["quant_method"] = UnquantizedLinearMethod()
    try:
        seen = []
        state = RunnerState(runner)
        state.wrap_step_inputs(seen.append, seen.append)
        state.wrap_sample_hidden(lambda hidden, sample, metadata: sample)
        state.replace_rejection_sampler(lambda sampler: ("specplug's", sampler))
        assert runner.rejection_sampler == ("specplug's", own)
        assert all(vars(runner)[name.split(".")[1]].__specplug_patch__ == name for name in RUNNER_PATCHES)
        assert PATCHES.instance_refusal(patches.LINEAR_QUANT_METHOD, layer) is None
        assert "is not a vllm.model_executor.layers.linear.LinearBase" in PATCHES.instance_refusal(
            patches.LINEAR_QUANT_METHOD, runner)
        assert "found a str, expected a vllm.v1.sample.rejection_sampler.RejectionSampler" in PATCHES.instance_refusal(
            patches.REJECTION_SAMPLER, _with(GPUModelRunner, rejection_sampler="not a sampler"))
    finally:
        for name in enabled_here:
            PATCHES.undo(name)
    if enabled_here:
        assert runner.rejection_sampler is own
        assert not set(vars(runner)) & {"_prepare_inputs", "_build_attention_metadata", "propose_draft_token_ids"}


def _with(cls, **attributes):
    obj = cls.__new__(cls)
    vars(obj).update(attributes)
    return obj
