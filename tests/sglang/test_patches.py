"""Every SGLang patch in the registry (specplug.sglang_medusa.patches) matches the installed
SGLang, registers through SGLang's own API (HookRegistry, SpeculativeAlgorithm.register),
and undoes, where SGLang has not applied the hooks in this process yet."""

from __future__ import annotations

import pytest

from specplug.sglang_medusa import patches
from specplug.sglang_medusa.patches import PATCHES

ARGS = {  # apply arguments, by patch name
    patches.REFUSED_ALGORITHMS: ("specplug stays out (a test)",),
    patches.REFUSED_ALIAS: (("MEDUSA",), "specplug stays out (a test)"),
}
HOOKED = [p.name for p in PATCHES if p.via == patches.HOOKS]
ALGORITHMS = [p.name for p in PATCHES if p.via == patches.REGISTER_SITE]


@pytest.fixture
def onednn_asked(monkeypatch):
    monkeypatch.setenv("SPECPLUG_SGLANG_CPU_LINEAR", "onednn")  # the opt-in pair applies too


@pytest.mark.parametrize("name", [p.name for p in PATCHES])
def test_every_patch_matches_the_installed_sglang(name, onednn_asked):
    state = PATCHES.check(name)
    assert state.matched, state.reason


def test_the_opt_in_pair_does_not_apply_unasked(monkeypatch):
    monkeypatch.delenv("SPECPLUG_SGLANG_CPU_LINEAR", raising=False)
    for name in patches.CPU_LINEAR:
        state = PATCHES.check(name)
        assert state.applied or (state.matched is None and "CPU_LINEAR=onednn is not set" in state.reason)


@pytest.mark.parametrize("name", HOOKED)
def test_hooks_register_with_hookregistry_and_undo(name, onednn_asked):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    patch = PATCHES[name]
    if PATCHES.state(name).applied or patch.target in HookRegistry._patched:
        pytest.skip(f"{name}: registered by register() or hooked by SGLang in this process already")
    before = list(HookRegistry._hooks.get(patch.target, []))
    try:
        state = PATCHES.apply_one(name, *ARGS.get(name, ()))
        assert state.applied, state.reason
        target, hook = state.value
        assert target == patch.target and HookRegistry._hooks[target] == before + [(HookType.AROUND, hook, None)]
    finally:
        PATCHES.undo(name)
    assert HookRegistry._hooks.get(patch.target, []) == before


@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithms_register_and_undo(name):
    from sglang.srt.speculative.spec_registry import get_spec

    if PATCHES.state(name).applied:
        pytest.skip(f"{name}: registered by register() in this process already")
    free = get_spec("RETRIEVAL") is None
    state = PATCHES.apply_one(name, *ARGS.get(name, ()))
    try:
        assert state.applied, state.reason
        names = state.value
        assert all(get_spec(n) is not None for n in names)
        if name == "algorithm MEDUSA":
            assert names == ["MEDUSA"] and type(get_spec("MEDUSA")).__name__ == "SpecplugSpecAlgo"
        if name == patches.REFUSED_ALGORITHMS and free:
            assert "RETRIEVAL" in names and type(get_spec("RETRIEVAL")).__name__ == "CustomSpecAlgo"
    finally:
        PATCHES.undo(name)
    assert all(get_spec(n) is None for n in names)
