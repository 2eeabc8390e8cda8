"""The test bed builds offline from a clean cache, reloads, and answers sensibly."""

import json

import pytest

from specplug.cli import main
from specplug.common import testbed


@pytest.fixture(scope="module")
def clean_build(tmp_path_factory):
    """A test bed built from an EMPTY cache folder, with the model hub switched off."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    cache = tmp_path_factory.mktemp("testbed")
    try:
        yield cache, testbed.target_dir(cache)
    finally:
        mp.undo()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_builds_offline_from_a_clean_cache(clean_build):
    cache, target = clean_build
    assert target == cache / testbed.TARGET_NAME
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (target / "model.safetensors").stat().st_size > 500e6  # fp32, ~538 MB
    marker = json.loads((target / testbed.MARKER).read_text())
    assert "Paris" in marker["check"]["answer"]
    assert not list(cache.glob(".tmp-*"))  # the temporary build folder was renamed away


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cached_build_is_reused_and_cli_reports_it(clean_build, capsys):
    cache, target = clean_build
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert main(["testbed", "--cache", str(cache), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["target"] == str(target)
    assert info["prompt_sets"]["mtbench"] == 80 and info["prompt_sets"]["humaneval"] == 164
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_converted_model_uses_chatml(clean_build):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(clean_build[1])
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_cache_location_follows_specplug_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECPLUG_CACHE", str(tmp_path))
    assert testbed.testbed_root() == tmp_path / "testbed"
    assert testbed.testbed_root(tmp_path / "x") == tmp_path / "x"


def test_compact_medusa_head_is_materialised_once(tiny_llama_path, tmp_path, monkeypatch):
    """A committed compact Medusa head (residual blocks only) becomes a FasterDecoding folder."""
    import torch
    from safetensors.torch import save_file

    from specplug.common import formats
    from specplug.common.training.medusa import RESBLOCKS_FILE

    hidden = json.loads((tiny_llama_path / "config.json").read_text())["hidden_size"]
    vocab = json.loads((tiny_llama_path / "config.json").read_text())["vocab_size"]
    committed = tmp_path / "heads" / "tiny-medusa"
    committed.mkdir(parents=True)
    (committed / "config.json").write_text(json.dumps(
        {"medusa_num_heads": 2, "medusa_num_layers": 1, "hidden_size": hidden, "vocab_size": vocab}))
    blocks = {f"{k}.0.linear.{p}": torch.randn(*shape).to(torch.bfloat16)
              for k in range(2) for p, shape in (("weight", (hidden, hidden)), ("bias", (hidden,)))}
    save_file(blocks, str(committed / RESBLOCKS_FILE))
    monkeypatch.setattr(testbed, "COMMITTED_HEADS", tmp_path / "heads")
    assert testbed.committed_heads() == ["tiny-medusa"]
    out = testbed.head_dir("tiny-medusa", tmp_path / "cache", target=tiny_llama_path)
    assert out == tmp_path / "cache" / "heads" / "tiny-medusa"
    head = formats.load_head(out, str(tiny_llama_path))
    assert head.format == "medusa" and torch.equal(head.state_dict["1.0.linear.bias"], blocks["1.0.linear.bias"])
    stamp = (out / "medusa_lm_head.safetensors").stat().st_mtime_ns
    assert testbed.head_dir("tiny-medusa", tmp_path / "cache", target=tiny_llama_path) == out
    assert (out / "medusa_lm_head.safetensors").stat().st_mtime_ns == stamp  # cached
    with pytest.raises(ValueError, match="is not in"):
        testbed.head_dir("nope", tmp_path / "cache", target=tiny_llama_path)
