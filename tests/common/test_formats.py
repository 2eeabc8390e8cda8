"""Checkpoint formats: detection, bit-exact round trips, the Medusa shared-block bug,
validation errors for malformed checkpoints, and refusal of unsafe pickles.

All checkpoints are small synthetic ones written into tmp dirs (hidden 16, vocab 64).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specplug.common import formats
from specplug.common.formats import CheckpointError, convert, detect_format, load_head, save_head

H, VOCAB, DRAFT_VOCAB, HEADS, KV_HEADS, HEAD_DIM, INTER = 16, 64, 32, 2, 1, 8, 32
TARGET = {"hidden_size": H, "vocab_size": VOCAB, "num_hidden_layers": 8, "torch_dtype": "float32"}


# ---------------------------------------------------------------------------------------
# Synthetic checkpoints (also used by test_convert.py)
# ---------------------------------------------------------------------------------------
def eagle3_config(**overrides) -> dict:
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB,
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_act": "silu",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}}
    config.update(overrides)
    return config


def eagle3_state(dtype=torch.float32, seed=0, embed=True) -> dict:
    g = torch.Generator().manual_seed(seed)
    m = "midlayer."
    shapes = {f"{m}self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
              f"{m}self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
              f"{m}self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
              f"{m}self_attn.o_proj.weight": (H, HEADS * HEAD_DIM), f"{m}mlp.gate_proj.weight": (INTER, H),
              f"{m}mlp.up_proj.weight": (INTER, H), f"{m}mlp.down_proj.weight": (H, INTER),
              f"{m}hidden_norm.weight": (H,), f"{m}input_layernorm.weight": (H,),
              f"{m}post_attention_layernorm.weight": (H,), "fc.weight": (H, 3 * H), "norm.weight": (H,),
              "lm_head.weight": (DRAFT_VOCAB, H)}
    if embed:
        shapes["embed_tokens.weight"] = (VOCAB, H)
    state = {k: torch.randn(*s, generator=g).to(dtype) for k, s in shapes.items()}
    keep = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values  # draft vocab = a target subset
    state["d2t"] = keep - torch.arange(DRAFT_VOCAB)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    state["t2d"][keep] = True
    return state


def medusa_config(heads=3, layers=2, **overrides) -> dict:
    config = {"medusa_num_heads": heads, "medusa_num_layers": layers,
              "base_model_name_or_path": "tiny-target", "version": "2", "hidden_size": H, "vocab_size": VOCAB}
    config.update(overrides)
    return config


def medusa_state(heads=3, layers=2, dtype=torch.float32, seed=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = torch.randn(H, H, generator=g).to(dtype)
            state[f"{i}.{j}.linear.bias"] = torch.randn(H, generator=g).to(dtype)
        state[f"{i}.{layers}.weight"] = torch.randn(VOCAB, H, generator=g).to(dtype)
    return state


def write_head(path: Path, config: dict | None, state: dict, weight_file: str = "model.safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if weight_file.endswith(".safetensors"):
        save_file(state, str(path / weight_file), metadata={"format": "pt"})
    else:
        torch.save(state, path / weight_file)
    return path


def write_eagle3(path: Path, **kw) -> Path:
    return write_head(path, eagle3_config(), eagle3_state(**kw))


def write_medusa(path: Path, heads=3, layers=2, **kw) -> Path:
    return write_head(path, medusa_config(heads, layers), medusa_state(heads, layers, **kw),
                      "medusa_lm_head.safetensors")


def speculators_config() -> dict:
    """A speculators EAGLE-3 config.json shaped like the library's exports."""
    layer = {k: v for k, v in eagle3_config().items()
             if k not in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0", "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": False,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
            "embed_requires_grad": False, "transformer_layer_config": layer,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                   "verifier": {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}}}


def write_speculators(path: Path) -> Path:
    state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in eagle3_state().items()}
    return write_head(path, speculators_config(), state)


def vllm_medusa_config(heads=3, layers=2, **overrides) -> dict:
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": H, "vocab_size": VOCAB,
              "num_heads": heads, "num_hidden_layers": layers, "truncated_vocab_size": VOCAB,
              "max_paths": 64, "topk": 10, "medusa_fc_bias": True}
    config.update(overrides)
    return config


def vllm_medusa_state(heads=3, layers=2, bias=True, lm_rows=VOCAB, token_map=None) -> dict:
    state = {}
    for name, t in medusa_state(heads, layers).items():
        h, layer, *rest = name.split(".")
        if rest[0] == "linear":
            if rest[1] == "weight" or bias:
                state[f"blocks.{h}.layers.{layer}.{rest[1]}"] = t
        else:
            state[f"lm_heads.{h}.weight"] = t[:lm_rows].clone()
    if token_map is not None:
        state["token_map"] = token_map
    return state


def tensor_bytes(state: dict) -> dict:
    """name -> raw bytes (bit-exact comparison, NaN payloads included)."""
    return {k: v.contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()}


def files_tensors(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------------------------------
# Detection and loading
# ---------------------------------------------------------------------------------------
def test_detect_format_for_all_four(tmp_path):
    assert detect_format(write_eagle3(tmp_path / "e")) == "eagle3"
    assert detect_format(write_speculators(tmp_path / "s")) == "speculators"
    assert detect_format(write_medusa(tmp_path / "m")) == "medusa"
    assert detect_format(write_head(tmp_path / "v", vllm_medusa_config(), vllm_medusa_state())) == "vllm-medusa"


def test_eagle_pytorch_model_bin_loads_with_weights_only(tmp_path):
    """The original EAGLE repo ships pytorch_model.bin; it loads through weights_only."""
    src = write_head(tmp_path / "e", eagle3_config(), eagle3_state(), "pytorch_model.bin")
    head = load_head(src, TARGET)
    assert head.format == "eagle3" and head.method == "eagle3"
    assert tensor_bytes(head.state_dict) == tensor_bytes(eagle3_state())


def test_target_config_as_pretrained_config_and_dir(tmp_path):
    from transformers import LlamaConfig
    src = write_eagle3(tmp_path / "e")
    load_head(src, LlamaConfig(hidden_size=H, vocab_size=VOCAB, num_hidden_layers=8,
                               num_attention_heads=2, intermediate_size=INTER))
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps({**TARGET, "num_hidden_layers": 4}))
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids") as err:
        load_head(src, target_dir)
    assert str(target_dir) in str(err.value)


# ---------------------------------------------------------------------------------------
# Round trips (bit-exact)
# ---------------------------------------------------------------------------------------
def test_eagle3_speculators_round_trip_is_bit_exact(tmp_path):
    original = eagle3_state(dtype=torch.bfloat16)
    src = write_head(tmp_path / "e", eagle3_config(), original)
    summary = convert(src, tmp_path / "s", "speculators", target_config=TARGET)
    assert summary["source_format"] == "eagle3" and summary["dropped"] == []
    spec = json.loads((tmp_path / "s" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["transformer_layer_config"]["hidden_size"] == H
    assert spec["norm_before_residual"] is False  # explicit: vLLM defaults a missing key to True
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert any(k.startswith("layers.0.") for k in files_tensors(tmp_path / "s"))
    convert(tmp_path / "s", tmp_path / "e2", "eagle3")
    assert tensor_bytes(files_tensors(tmp_path / "e2")) == tensor_bytes(original)
    back = json.loads((tmp_path / "e2" / "config.json").read_text())
    for key in ("hidden_size", "draft_vocab_size", "eagle_config", "num_key_value_heads", "head_dim"):
        assert back[key] == eagle3_config()[key]


def test_speculators_round_trip_keeps_its_config_and_names_what_eagle3_drops(tmp_path, caplog):
    src = write_speculators(tmp_path / "s")
    source_tensors = files_tensors(src)
    with caplog.at_level(logging.WARNING, logger="specplug.common.formats"):
        summary = convert(src, tmp_path / "e", "eagle3")
    assert any("speculators_config" in d and "org/target" in d for d in summary["dropped"])
    assert "speculators_config" in caplog.text
    save_head(load_head(src), tmp_path / "s2", "speculators")
    assert tensor_bytes(files_tensors(tmp_path / "s2")) == tensor_bytes(source_tensors)
    again = json.loads((tmp_path / "s2" / "config.json").read_text())
    original = speculators_config()
    assert again["speculators_config"] == original["speculators_config"]
    assert again["transformer_layer_config"] == original["transformer_layer_config"]


def test_speculators_without_target_notes_the_verifier_and_default_tokens(tmp_path):
    summary = convert(write_eagle3(tmp_path / "e"), tmp_path / "s", "speculators")
    assert any("verifier.name_or_path" in n for n in summary["notes"])
    assert any("speculative_tokens" in n for n in summary["notes"])


def test_medusa_vllm_medusa_round_trip_is_bit_exact(tmp_path):
    original = medusa_state(dtype=torch.float16)
    src = write_head(tmp_path / "m", medusa_config(), original, "medusa_lm_head.safetensors")
    summary = convert(src, tmp_path / "v", "vllm-medusa", target_config=TARGET)
    assert summary["dropped"] == []
    cfg = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["medusa_fc_bias"]) == (3, 2, True)
    assert "blocks.2.layers.1.bias" in files_tensors(tmp_path / "v")
    convert(tmp_path / "v", tmp_path / "m2", "medusa")
    assert tensor_bytes(load_file(str(tmp_path / "m2" / "medusa_lm_head.safetensors"))) == tensor_bytes(original)
    # medusa_fc_bias: true is added so vLLM, reading a FasterDecoding head, keeps the biases
    assert json.loads((tmp_path / "m2" / "config.json").read_text()) == {**medusa_config(), "medusa_fc_bias": True}


def test_random_bit_patterns_survive_every_conversion(tmp_path):
    """bf16 tensors holding arbitrary bit patterns (NaN payloads, denormals) come back
    byte-identical: nothing is cast or recomputed on the way."""
    g = torch.Generator().manual_seed(7)
    state = {k: torch.randint(-2**15, 2**15, v.shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
             for k, v in medusa_state().items()}
    src = write_head(tmp_path / "m", medusa_config(), state, "medusa_lm_head.safetensors")
    convert(src, tmp_path / "v", "vllm-medusa")
    convert(tmp_path / "v", tmp_path / "m2", "medusa")
    assert tensor_bytes(files_tensors(tmp_path / "m2")) == tensor_bytes(state)


def test_vllm_medusa_token_map_round_trip_and_drop(tmp_path, caplog):
    token_map = torch.arange(0, VOCAB, 2)
    src = write_head(tmp_path / "v", vllm_medusa_config(truncated_vocab_size=VOCAB // 2),
                     vllm_medusa_state(token_map=token_map))
    save_head(load_head(src), tmp_path / "v2", "vllm-medusa")
    assert tensor_bytes(files_tensors(tmp_path / "v2")) == tensor_bytes(files_tensors(src))
    assert json.loads((tmp_path / "v2" / "config.json").read_text()) == vllm_medusa_config(
        truncated_vocab_size=VOCAB // 2)
    with caplog.at_level(logging.WARNING, logger="specplug.common.formats"):
        summary = convert(src, tmp_path / "m", "medusa")
    assert any("token_map" in d for d in summary["dropped"])
    assert any(d.startswith("max_paths") for d in summary["dropped"])
    assert "token_map" in caplog.text


def test_truncated_vllm_medusa_cannot_become_fasterdecoding(tmp_path):
    token_map = torch.arange(0, VOCAB, 2)
    src = write_head(tmp_path / "v", vllm_medusa_config(truncated_vocab_size=VOCAB // 2),
                     vllm_medusa_state(lm_rows=VOCAB // 2, token_map=token_map))
    head = load_head(src, TARGET)
    assert head.extra["truncated_rows"] == VOCAB // 2
    with pytest.raises(CheckpointError, match="keep this head in vllm-medusa"):
        save_head(head, tmp_path / "m", "medusa")
    save_head(head, tmp_path / "v2", "vllm-medusa")
    assert tensor_bytes(files_tensors(tmp_path / "v2")) == tensor_bytes(files_tensors(src))


def test_bias_free_vllm_medusa_gets_zero_biases_and_round_trips(tmp_path):
    src = write_head(tmp_path / "v", vllm_medusa_config(medusa_fc_bias=False), vllm_medusa_state(bias=False))
    head = load_head(src)
    assert not head.state_dict["0.1.linear.bias"].any()
    save_head(head, tmp_path / "v2", "vllm-medusa")
    assert tensor_bytes(files_tensors(tmp_path / "v2")) == tensor_bytes(files_tensors(src))
    convert(src, tmp_path / "m", "medusa")
    assert "0.0.linear.bias" in files_tensors(tmp_path / "m")


def test_norm_before_residual_is_written_where_vllm_reads_it(tmp_path):
    """specplug's heads keep the flag in eagle_config; vLLM reads only the top-level key."""
    config = eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                                         "use_aux_hidden_state": True, "norm_before_residual": True})
    report = save_head((config, eagle3_state()), tmp_path / "e", "eagle3")
    assert json.loads((tmp_path / "e" / "config.json").read_text())["norm_before_residual"] is True
    assert any("SGLang" in n for n in report.notes)
    convert(tmp_path / "e", tmp_path / "s", "speculators")
    assert json.loads((tmp_path / "s" / "config.json").read_text())["norm_before_residual"] is True


def test_save_head_takes_config_and_state_pair(tmp_path):
    report = save_head((eagle3_config(), eagle3_state()), tmp_path / "e", "eagle3")
    assert report.files == ["config.json", "model.safetensors"]
    assert tensor_bytes(files_tensors(tmp_path / "e")) == tensor_bytes(eagle3_state())


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_full_draft_vocab_writes_no_identity_vocab_maps(tmp_path, fmt):
    """vLLM refuses d2t/t2d for a head whose draft vocabulary is the target's."""
    state = eagle3_state()
    state["lm_head.weight"] = torch.randn(VOCAB, H)
    state["d2t"] = torch.zeros(VOCAB, dtype=torch.long)
    state["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    report = save_head((eagle3_config(draft_vocab_size=VOCAB), state), tmp_path / "e", fmt)
    written = files_tensors(tmp_path / "e")
    assert "d2t" not in written and "t2d" not in written
    assert any("identity" in note for note in report.notes)
    assert load_head(tmp_path / "e", TARGET).state_dict["lm_head.weight"].shape == (VOCAB, H)


def test_save_head_refuses_other_method_nonempty_destination_and_source(tmp_path):
    head = load_head(write_eagle3(tmp_path / "e"))
    with pytest.raises(ValueError, match="holds medusa heads"):
        save_head(head, tmp_path / "x", "medusa")
    with pytest.raises(CheckpointError, match="other than the source"):
        save_head(head, tmp_path / "e", "speculators", overwrite=True)
    write_eagle3(tmp_path / "taken")
    with pytest.raises(CheckpointError, match="overwrite"):
        save_head(head, tmp_path / "taken", "speculators")
    save_head(head, tmp_path / "taken", "speculators", overwrite=True)
    assert detect_format(tmp_path / "taken") == "speculators"


# ---------------------------------------------------------------------------------------
# The Medusa repo's [ResBlock]*n bug
# ---------------------------------------------------------------------------------------
def _shared_block_state(heads=2, layers=3) -> dict:
    """What torch.save writes for nn.Sequential(*([ResBlock(H)] * layers), Linear)."""
    state = {}
    for i in range(heads):
        block = torch.nn.Linear(H, H)
        for j in range(layers):
            state[f"{i}.{j}.linear.weight"] = block.weight.data  # same storage for every layer
            state[f"{i}.{j}.linear.bias"] = block.bias.data
        state[f"{i}.{layers}.weight"] = torch.randn(VOCAB, H)
    return state


def test_shared_block_bug_torch_save_loads_as_equal_copies(tmp_path, caplog):
    state = _shared_block_state()
    src = write_head(tmp_path / "m", medusa_config(2, 3), state, "medusa_lm_head.pt")
    with caplog.at_level(logging.INFO, logger="specplug.common.formats"):
        head = load_head(src, TARGET)
    assert "shared-block bug" in caplog.text
    w = [head.state_dict[f"1.{j}.linear.weight"] for j in range(3)]
    assert all(torch.equal(w[0], x) for x in w)
    assert len({x.untyped_storage().data_ptr() for x in w}) == 3  # independent per-layer copies
    save_head(head, tmp_path / "m2", "medusa")  # safetensors accepts it: nothing shared
    assert tensor_bytes(files_tensors(tmp_path / "m2")) == tensor_bytes(state)


def test_shared_block_bug_deduplicated_save_is_filled_in(tmp_path, caplog):
    """safetensors' save_model keeps one name per shared tensor: one block per head."""
    state = {k: v.clone() for k, v in _shared_block_state().items() if k.split(".")[1] not in ("0", "2")
             or k.endswith(f".{3}.weight")}
    src = write_head(tmp_path / "m", medusa_config(2, 3), state, "medusa_lm_head.safetensors")
    with caplog.at_level(logging.INFO, logger="specplug.common.formats"):
        head = load_head(src, TARGET)
    assert "deduplicated" in caplog.text
    for j in range(3):
        assert torch.equal(head.state_dict[f"0.{j}.linear.weight"], state["0.1.linear.weight"])


def test_distinct_blocks_are_not_reported_as_the_bug(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="specplug.common.formats"):
        load_head(write_medusa(tmp_path / "m"), TARGET)
    assert "shared-block" not in caplog.text


# ---------------------------------------------------------------------------------------
# Unsafe pickles
# ---------------------------------------------------------------------------------------
class _Exploit:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(eagle3_config()))
    torch.save({"fc.weight": _Exploit(str(marker))}, src / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only") as err:
        load_head(src)
    assert "never unpickles" in str(err.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------
# Malformed checkpoints: each a CheckpointError naming the field, the file and the fix
# ---------------------------------------------------------------------------------------
def _eagle(tmp, config=None, state=None, weight="model.safetensors"):
    return write_head(tmp, eagle3_config() if config is None else config,
                      eagle3_state() if state is None else state, weight)


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _bad_d2t():
    s = eagle3_state()
    s["d2t"][5] = VOCAB  # draft id 5 -> target id >= vocab
    return s


def _mixed_dtypes():
    s = eagle3_state()
    s["norm.weight"] = s["norm.weight"].half()
    return s


def _int8_weight():
    s = eagle3_state()
    s["fc.weight"] = s["fc.weight"].to(torch.int8)
    return s


def _float_d2t():
    s = eagle3_state()
    s["d2t"] = s["d2t"].float()
    return s


def _shards(tmp):
    s = eagle3_state()
    path = write_head(tmp, eagle3_config(), s, "model-00001-of-00002.safetensors")
    save_file({"fc.weight": s["fc.weight"]}, str(path / "model-00002-of-00002.safetensors"))
    return path


MALFORMED = {
    "target hidden size": (lambda t: _eagle(t), {**TARGET, "hidden_size": 32}, "head target_hidden_size"),
    "target vocab": (lambda t: _eagle(t), {**TARGET, "vocab_size": 128}, "head vocab_size"),
    "d2t out of range": (lambda t: _eagle(t, state=_bad_d2t()), TARGET, "d2t"),
    "d2t past a smaller target vocab": (lambda t: _eagle(t), {**TARGET, "vocab_size": 48}, "head vocab_size"),
    "aux layer id >= layers": (lambda t: _eagle(t), {**TARGET, "num_hidden_layers": 5},
                               "eagle_aux_hidden_state_layer_ids"),
    "missing tensor": (lambda t: _eagle(t, state=_without(eagle3_state(), "midlayer.mlp.up_proj.weight")),
                       None, "missing ['midlayer.mlp.up_proj.weight']"),
    "missing d2t with a draft vocab": (lambda t: _eagle(t, state=_without(eagle3_state(), "d2t")),
                                       None, "missing ['d2t']"),
    "unexpected tensor": (lambda t: _eagle(t, state={**eagle3_state(), "midlayer.self_attn.q_norm.weight":
                                                     torch.ones(HEAD_DIM)}), None, "unexpected"),
    "wrong shape": (lambda t: _eagle(t, config=eagle3_config(draft_vocab_size=40)), None,
                    "tensor lm_head.weight shape"),
    "mixed dtypes": (lambda t: _eagle(t, state=_mixed_dtypes()), None, "one floating dtype"),
    "quantized weight": (lambda t: _eagle(t, state=_int8_weight()), None, "tensor fc.weight dtype"),
    "float d2t": (lambda t: _eagle(t, state=_float_d2t()), None, "d2t dtype"),
    "conflicting norm_before_residual": (lambda t: _eagle(t, config=eagle3_config(
        norm_before_residual=True, eagle_config={"norm_before_residual": False})), None, "norm_before_residual"),
    "default aux ids on a 3-layer target": (lambda t: _eagle(t, config=_without(eagle3_config(), "eagle_config")),
                                            {**TARGET, "num_hidden_layers": 3}, "explicit ids"),
    "two decoder layers, tensors of one": (lambda t: _eagle(t, config=eagle3_config(num_hidden_layers=2)), None,
                                           "layers.1.self_attn.q_proj.weight"),
    "zero decoder layers": (lambda t: _eagle(t, config=eagle3_config(num_hidden_layers=0)), None,
                            "num_hidden_layers"),
    "draft vocab > vocab": (lambda t: _eagle(t, config=eagle3_config(draft_vocab_size=100)), None,
                            "draft_vocab_size"),
    "missing config field": (lambda t: _eagle(t, config=_without(eagle3_config(), "hidden_size")), None,
                             "hidden_size: expected a positive int"),
    "config of another method": (lambda t: _eagle(t, config=medusa_config()), None, "config.json"),
    "no weights": (lambda t: (t.mkdir(), (t / "config.json").write_text("{}"), t)[-1], None, "weights"),
    "unknown tensors": (lambda t: write_head(t, {}, {"foo.weight": torch.ones(2)}), None, "weights"),
    "duplicate across shards": (_shards, None, "tensor fc.weight"),
    "speculators without layer config": (lambda t: write_head(t, _without(speculators_config(),
                                         "transformer_layer_config"), files_tensors(write_speculators(
                                             t.parent / "ok"))), None, "transformer_layer_config"),
    "medusa head count": (lambda t: write_head(t, medusa_config(heads=4), medusa_state(3),
                                               "medusa_lm_head.safetensors"), None, "medusa_num_heads"),
    "medusa layer count": (lambda t: write_head(t, medusa_config(layers=1), medusa_state(layers=2),
                                                "medusa_lm_head.safetensors"), None, "medusa_num_layers"),
    "medusa hidden vs target": (lambda t: write_medusa(t), {**TARGET, "hidden_size": 8}, "head hidden_size"),
    "medusa vocab vs tensors": (lambda t: write_head(t, medusa_config(vocab_size=50), medusa_state(),
                                                     "medusa_lm_head.safetensors"), None, "shape"),
    "vllm medusa without num_heads": (lambda t: write_head(t, _without(vllm_medusa_config(), "num_heads"),
                                                           vllm_medusa_state()), None, "num_heads"),
    "not a directory": (lambda t: t / "nope", None, "path"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_gives_a_clear_error(tmp_path, case):
    build, target, expected = MALFORMED[case]
    path = build(tmp_path / "head")
    with pytest.raises(CheckpointError) as err:
        load_head(path, target)
    message = str(err.value)
    assert expected in message
    assert "expected" in message and "given" in message and "fix:" in message
    assert str(tmp_path / "head") in message  # names the checkpoint (file or folder)
    assert isinstance(err.value, ValueError)


def test_at_least_ten_distinct_malformed_cases():
    fields = {expected for _, _, expected in MALFORMED.values()}
    assert len(fields) >= 10


def test_dtype_mismatch_with_target_only_warns(tmp_path, caplog):
    src = write_head(tmp_path / "e", eagle3_config(), eagle3_state(dtype=torch.bfloat16))
    with caplog.at_level(logging.WARNING, logger="specplug.common.formats"):
        load_head(src, TARGET)
    assert "bfloat16 differs from target dtype float32" in caplog.text


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------
def test_load_head_module_builds_eagle3_head(tmp_path):
    pytest.importorskip("specplug.common.heads.eagle3")
    src = write_head(tmp_path / "e", eagle3_config(), eagle3_state())
    module = formats.load_head_module(src, TARGET, dtype=torch.float64)
    assert type(module).__name__ == "Eagle3Head"
    assert module.fc.weight.dtype == torch.float64
    state = eagle3_state()
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def test_two_layer_eagle3_loads_and_round_trips_through_speculators(tmp_path):
    """layers.1.* (vLLM's multi-layer EAGLE-3 names) load into the head's later layer and
    survive eagle3 -> speculators -> eagle3 bit for bit."""
    pytest.importorskip("specplug.common.heads.eagle3")
    one = formats.load_head_module(write_eagle3(tmp_path / "one"), TARGET)
    two = formats.load_head_module(write_eagle3(tmp_path / "one"), TARGET)
    from specplug.common.training.eagle3 import grown
    original = dict(grown(two, 2).state_dict())
    save_head(two, tmp_path / "e", "eagle3")
    assert json.loads((tmp_path / "e" / "config.json").read_text())["num_hidden_layers"] == 2
    convert(tmp_path / "e", tmp_path / "s", "speculators", target_config=TARGET)
    convert(tmp_path / "s", tmp_path / "e2", "eagle3")
    back = formats.load_head_module(tmp_path / "e2", TARGET)
    assert back.config.num_hidden_layers == 2 and len(back.later_layers()) == 1
    assert tensor_bytes(back.state_dict()) == tensor_bytes(original)
    assert set(original) - set(one.state_dict()) == {k for k in original if k.startswith("layers.1.")}


def test_load_head_module_builds_medusa_heads(tmp_path):
    pytest.importorskip("specplug.common.heads.medusa")
    module = formats.load_head_module(write_medusa(tmp_path / "m"), TARGET)
    state = medusa_state()
    assert set(module.state_dict()) == set(state)
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_save_head_takes_head_modules(tmp_path):
    """A module from specplug.common.heads saves straight to any format of its method."""
    pytest.importorskip("specplug.common.heads.medusa")
    eagle = formats.load_head_module(write_eagle3(tmp_path / "e"), TARGET)
    save_head(eagle, tmp_path / "s", "speculators")
    assert tensor_bytes(load_head(tmp_path / "s").state_dict) == tensor_bytes(eagle3_state())
    medusa = formats.load_head_module(write_medusa(tmp_path / "m"), TARGET)
    save_head(medusa, tmp_path / "v", "vllm-medusa")
    assert tensor_bytes(load_head(tmp_path / "v").state_dict) == tensor_bytes(medusa_state())


def test_heads_made_for_a_real_hf_target_validate_against_its_folder(tmp_path, tiny_llama_path, caplog):
    """Heads shaped by specplug.common.heads for the tiny Llama (a transformers-5
    config.json: `dtype`, `rope_parameters`) pass validation against that folder, and the
    speculators output records it as the verifier."""
    heads = pytest.importorskip("specplug.common.heads.medusa")
    from specplug.common.heads.eagle3 import Eagle3Config, Eagle3Head
    target = json.loads((Path(tiny_llama_path) / "config.json").read_text())
    eagle = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=100, aux_layer_ids=(1, 2, 3)))
    medusa = heads.MedusaHeads(heads.MedusaConfig(medusa_num_heads=2, medusa_num_layers=1,
                                                  hidden_size=target["hidden_size"], vocab_size=target["vocab_size"]))
    save_head(eagle, tmp_path / "e", "eagle3")
    save_head(medusa, tmp_path / "m", "medusa")
    with caplog.at_level(logging.WARNING, logger="specplug.common.formats"):
        summary = convert(tmp_path / "e", tmp_path / "s", "speculators", target_config=tiny_llama_path)
        load_head(tmp_path / "m", tiny_llama_path)
    assert "differs from target dtype" not in caplog.text
    verifier = json.loads((tmp_path / "s" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(tiny_llama_path) and summary["dropped"] == []
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        save_head(Eagle3Head(Eagle3Config.for_target(target, aux_layer_ids=(1, 2, 4))), tmp_path / "bad", "eagle3")
        load_head(tmp_path / "bad", tiny_llama_path)
