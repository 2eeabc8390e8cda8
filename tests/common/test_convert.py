"""`specplug convert` end to end, through the console entry point in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from specplug.common.formats import FORMATS, load_head
from tests.common.test_formats import (
    TARGET, files_tensors, tensor_bytes, vllm_medusa_config, vllm_medusa_state, write_eagle3, write_head,
    write_medusa,
)


def specplug(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specplug.cli", "convert", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_help_explains_every_format():
    out = specplug("--help")
    assert out.returncode == 0, out.stderr
    for name in FORMATS:
        assert name in out.stdout
    assert "--target MODEL_DIR" in out.stdout and "--json" in out.stdout
    assert "bit-exactly" in out.stdout and "weights_only=True" in out.stdout


def test_convert_json_summary_and_bit_exact_result(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**TARGET, "architectures": ["LlamaForCausalLM"]}))
    src = write_eagle3(tmp_path / "e")
    out = specplug(src, tmp_path / "s", "--to", "speculators", "--target", target, "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["source_format"], summary["format"], summary["method"]) == ("eagle3", "speculators", "eagle3")
    assert summary["dropped"] == [] and summary["files"] == ["config.json", "model.safetensors"]
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"] == {"name_or_path": str(target),
                                                      "architectures": ["LlamaForCausalLM"]}
    back = load_head(tmp_path / "s")
    assert tensor_bytes(back.state_dict) == tensor_bytes(files_tensors(src))


def test_human_output_prints_what_was_dropped(tmp_path):
    src = write_head(tmp_path / "v", vllm_medusa_config(truncated_vocab_size=32),
                     vllm_medusa_state(token_map=torch.arange(32)))
    out = specplug(src, tmp_path / "m", "--to", "medusa")
    assert out.returncode == 0, out.stderr
    assert "dropped: token_map" in out.stdout
    assert "dropped: max_paths=64" in out.stdout
    clean = specplug(write_medusa(tmp_path / "m0"), tmp_path / "v0", "--to", "vllm-medusa")
    assert "dropped: nothing" in clean.stdout


def test_bad_checkpoint_exits_2_with_the_error(tmp_path):
    src = write_eagle3(tmp_path / "e")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({**TARGET, "vocab_size": 99}))
    out = specplug(src, tmp_path / "x", "--to", "speculators", "--target", target, "--json")
    assert out.returncode == 2
    assert json.loads(out.stdout)["field"] == "head vocab_size"
    assert "fix:" in out.stderr and not (tmp_path / "x").exists()


def test_wrong_method_is_refused(tmp_path):
    out = specplug(write_eagle3(tmp_path / "e"), tmp_path / "x", "--to", "medusa")
    assert out.returncode != 0
    assert "holds medusa heads" in out.stderr
