"""The patch registry (specplug.common.patches) on a tiny module made here: patches apply
once, refuse an original that is not the expected one or an engine version they were not
written for, log one line, and undo; and the adapters' declarations (engine-free) match
docs/architecture.md's generated table."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import pytest

from specplug.common import patches
from specplug.patch_list import adapter_patch_sets
from specplug.common.patches import (
    ACTIVE, INSTANCE, REGISTERED, REPLACE, STAY_OUT, WRAP, Expect, Patch, PatchRefused, PatchSet, value,
)

ROOT = Path(__file__).resolve().parents[2]
MODULE = "fake_engine_46"


def fake_module() -> types.ModuleType:
    """A module with a class, a method, a subclass inheriting it and a module function."""
    module = types.ModuleType(MODULE)
    exec(  # noqa: S102 - the test's own source, so that __module__ and __qualname__ are real
        "class Runner:\n"
        "    def step(self, batch, size):\n"
        "        return ('engine', batch, size)\n"
        "class CpuRunner(Runner):\n"
        "    pass\n"
        "class Sampler:\n"
        "    pass\n"
        "def version(name):\n"
        "    return name\n", module.__dict__)
    return module


@pytest.fixture
def engine(monkeypatch):
    module = fake_module()
    monkeypatch.setitem(sys.modules, MODULE, module)
    return module


def counting_wrapper(calls: list):
    def wrap(step):
        def wrapped(self, batch, size):
            calls.append(batch)
            return ("specplug",) + step(self, batch, size)[1:]
        return wrapped
    return wrap


STEP = Expect(qualname="Runner.step", module=MODULE, params=("self", "batch", "size"))


def patch_set(*declared: Patch, version: str = "1.0+cpu") -> PatchSet:
    return PatchSet("Fake", lambda: version, declared)


def step_patch(calls: list, **kw) -> Patch:
    return Patch("Runner.step", f"{MODULE}.Runner.step", WRAP, counting_wrapper(calls), kw.pop("expect", STEP),
                 "counts steps", "test", **{"versions": ("1.0",), **kw})


def test_apply_wraps_once_and_logs_one_line(engine, caplog):
    calls = []
    registry = patch_set(step_patch(calls), Patch("Sampler", f"{MODULE}.Sampler", REPLACE, value(dict),
                                                   Expect(qualname="Sampler", module=MODULE), "a dict", "test"))
    with caplog.at_level(logging.DEBUG, logger="specplug.common.patches"):
        states = registry.apply(ACTIVE)
    assert [s.applied for s in states] == [True, True] and engine.Sampler is dict
    assert engine.Runner().step(1, 2) == ("specplug", 1, 2) and calls == [1]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == ["specplug patched Fake (active): Runner.step (wrap), Sampler (replace)"]
    wrapper = engine.Runner.step
    registry.apply(ACTIVE)  # once per process: nothing wrapped twice
    assert engine.Runner.step is wrapper and engine.Runner().step(3, 4) == ("specplug", 3, 4) and calls == [1, 3]
    assert registry.check("Runner.step").applied


def test_an_unexpected_original_is_refused_and_left_alone(engine, caplog):
    def foreign(self, batch, size):  # another plugin's replacement, not the engine's method
        return "foreign"

    engine.Runner.step = foreign
    registry = patch_set(step_patch([]))
    with caplog.at_level(logging.WARNING, logger="specplug.common.patches"):
        state = registry.apply_one("Runner.step")
    assert not state.applied and state.matched is False and engine.Runner.step is foreign
    assert state.reason == (f"found {__name__}.test_an_unexpected_original_is_refused_and_left_alone.<locals>.foreign, "
                            "expected Runner.step")
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "Runner.step" in caplog.records[0].getMessage()


@pytest.mark.parametrize("expect, found", [
    (Expect(qualname="Runner.step", module="other_engine"), f"defined in {MODULE}"),
    (Expect(qualname="Runner.step", params=("self", "batch", "sizes")),
     "step(self, batch, size), expected (self, batch, sizes"),
    (Expect(instance_of=f"{MODULE}.Sampler"), "found a function, expected a fake_engine_46.Sampler"),
])
def test_module_signature_and_type_are_checked(engine, expect, found):
    state = patch_set(step_patch([], expect=expect)).apply_one("Runner.step", log=False)
    assert state.matched is False and found in state.reason
    assert engine.Runner().step(1, 2) == ("engine", 1, 2)


def test_version_guard(engine):
    registry = patch_set(step_patch([]), version="1.1")
    state = registry.apply_one("Runner.step", log=False)
    assert not state.applied and state.reason == "written for Fake 1.0, this is 1.1"
    assert engine.Runner().step(1, 2) == ("engine", 1, 2)
    assert patch_set(step_patch([], versions=None), version="9.9").apply_one("Runner.step").applied  # any version


def test_undo_restores_own_and_inherited_attributes(engine):
    calls = []
    own = engine.Runner.__dict__["step"]
    inherited = Patch("CpuRunner.step", f"{MODULE}.CpuRunner.step", WRAP, counting_wrapper(calls), STEP, "-", "test")
    registry = patch_set(inherited, step_patch(calls))  # the subclass first: it must find the engine's method
    registry.apply(ACTIVE, log=False)
    assert "step" in engine.CpuRunner.__dict__ and engine.CpuRunner().step(5, 6) == ("specplug", 5, 6)
    registry.undo_all()
    assert engine.Runner.__dict__["step"] is own and "step" not in engine.CpuRunner.__dict__
    assert engine.CpuRunner().step(5, 6) == ("engine", 5, 6)
    assert not registry.state("Runner.step").applied
    assert registry.apply_one("Runner.step").applied  # and can be applied again


def test_skip_and_missing_target(engine, caplog):
    registry = patch_set(step_patch([], skip=lambda: "CPU builds only"),
                         Patch("Runner.gone", f"{MODULE}.Runner.gone", WRAP, counting_wrapper([]), STEP, "-", "test"),
                         Patch("nowhere", "fake_engine_46_absent.Runner.step", WRAP, counting_wrapper([]), STEP, "-",
                               "test"))
    with caplog.at_level(logging.WARNING, logger="specplug.common.patches"):
        skipped, gone, nowhere = registry.apply(ACTIVE)
    assert skipped.matched is None and skipped.reason == "CPU builds only" and not skipped.applied
    assert gone.matched is False and gone.reason == f"{MODULE}.Runner has no attribute 'gone'"
    assert nowhere.matched is False and "fake_engine_46_absent.Runner not found (ModuleNotFoundError" in nowhere.reason
    assert len(caplog.records) == 2  # the two refusals; the skipped patch only at DEBUG
    rows = {row["name"]: row for row in registry.report()}
    assert rows["Runner.step"]["matched"] is None and rows["Runner.gone"]["matched"] is False


def test_registered_through_an_engine_api(engine):
    hooks = []

    def register(original, extra):
        hooks.append((original, extra))
        return len(hooks) - 1

    declared = Patch("hook", f"{MODULE}.version", REGISTERED, register, Expect(qualname="version", module=MODULE),
                     "-", "test", group=STAY_OUT, via=f"{MODULE}.Runner", unregister=lambda token: hooks.pop(token))
    registry = patch_set(declared)
    assert registry.apply(ACTIVE) == []  # another group
    state = registry.apply_one("hook", "why")
    assert state.applied and state.value == 0 and hooks == [(engine.version, "why")]
    assert engine.version("x") == "x"  # registered, not replaced
    assert registry.apply_one("hook", "why") is state and len(hooks) == 1
    registry.undo("hook")
    assert hooks == []
    assert declared.sites == (f"{MODULE}.version", f"{MODULE}.Runner")
    no_undo = patch_set(Patch("hook", f"{MODULE}.version", REGISTERED, register, Expect(), "-", "test", via="x.y"))
    no_undo.apply_one("hook", "why")
    with pytest.raises(RuntimeError, match="hook cannot be undone: x.y has no way to unregister"):
        no_undo.undo("hook")


def test_instance_patches_shadow_one_object(engine):
    def after(step, note):
        return lambda batch, size: (note,) + step(batch, size)

    shadow = Patch("runner.step", f"{MODULE}.Runner.step", INSTANCE, after, STEP, "-", "test")
    swap = Patch("runner.sampler", f"{MODULE}.Runner.sampler", INSTANCE, lambda own, make: make(own),
                 Expect(instance_of=f"{MODULE}.Sampler"), "-", "test")
    registry = patch_set(shadow, swap)
    runner, other = engine.CpuRunner(), engine.Runner()
    with pytest.raises(PatchRefused, match="runner.step .* is not applied: Fake's patches were not applied"):
        registry.on("runner.step", runner, "hooked")
    registry.apply(ACTIVE, log=False)
    assert engine.Runner.step is engine.Runner.__dict__["step"]  # the class is untouched
    registry.on("runner.step", runner, "hooked")
    assert runner.step(1, 2) == ("hooked", "engine", 1, 2) and other.step(1, 2) == ("engine", 1, 2)
    runner.sampler, other.sampler = engine.Sampler(), "not a sampler"
    own = runner.sampler
    assert registry.on("runner.sampler", runner, lambda s: ("wrapped", s)) == ("wrapped", own)
    assert "found a str, expected a fake_engine_46.Sampler" in registry.instance_refusal("runner.sampler", other)
    with pytest.raises(PatchRefused, match="Sampler is not a fake_engine_46.Runner"):
        registry.on("runner.step", engine.Sampler(), "x")
    assert swap.sites == (f"{MODULE}.Runner", f"{MODULE}.Sampler") and shadow.sites == (f"{MODULE}.Runner.step",)
    registry.undo_all()
    assert runner.step(1, 2) == ("engine", 1, 2) and "step" not in vars(runner) and runner.sampler is own


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="kind 'monkey'"):
        Patch("x", "a.b", "monkey", value(1), Expect(), "-", "test")
    with pytest.raises(ValueError, match="names the engine API"):
        Patch("x", "a.b", REGISTERED, value(1), Expect(), "-", "test")
    with pytest.raises(ValueError, match="two Fake patches are named 'x'"):
        patch_set(Patch("x", "a.b", REPLACE, value(1), Expect(), "-", "test"),
                  Patch("x", "a.c", REPLACE, value(1), Expect(), "-", "test"))


def test_adapters_derive_their_patch_sites_from_the_registry():
    from specplug import sglang_medusa, vllm_eagle3

    for adapter in (vllm_eagle3, sglang_medusa):
        assert adapter.PATCH_SITES == adapter.PATCHES.sites()
        assert {p.group for p in adapter.PATCHES} >= {ACTIVE, STAY_OUT}
    assert vllm_eagle3.REFUSAL_SITE in vllm_eagle3.PATCH_SITES
    assert [p.name for p in vllm_eagle3.PATCHES.group(STAY_OUT)] == ["SpeculativeConfig.__post_init__"]


def test_docs_table_is_the_registry():
    """docs/architecture.md's patch tables are generated: rerun
    `python -m specplug.patch_list --update docs/architecture.md` after changing a patch."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert patches.docs_block(text) == patches.markdown(adapter_patch_sets()), (
        "docs/architecture.md's patch table differs from the registry: run "
        "python -m specplug.patch_list --update docs/architecture.md")
    assert patches.with_block(text, patches.docs_block(text)) == text
