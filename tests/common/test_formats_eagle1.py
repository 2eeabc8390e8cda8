"""EAGLE-1 checkpoints (the EAGLE repo's layout): detection, loading, validation errors,
`specplug convert`, and a head saved in that layout, loaded and driven by the EAGLE
drafter through the reference loop: greedy output equals target.generate.

Synthetic checkpoints are hidden 16, vocab 64 (test_formats.py's sizes); the end-to-end
tests use the tiny Llama of tests/support/tiny_llama.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specplug.common import formats
from specplug.common.drafters import EagleDrafter
from specplug.common.formats import CheckpointError, convert, detect_format, load_head, save_head
from specplug.common.heads import Eagle1Head
from specplug.common.reference import generate
from specplug.common.tree import TreeConfig
from tests.common.test_drafters import random_eagle1_head, target  # noqa: F401
from tests.common.test_formats import (H, HEAD_DIM, HEADS, INTER, KV_HEADS, TARGET, VOCAB, eagle3_state,
                                       files_tensors, speculators_config, tensor_bytes, write_head)
from tests.common.test_reference import PROMPT, OracleEagle3Head, greedy_continuation, hf_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

L = "layers.0."


def eagle1_config(**overrides) -> dict:
    """An EAGLE-1 config.json as the EAGLE repo ships it (a LlamaConfig with one layer)."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 256, "hidden_act": "silu", "pretraining_tp": 1,
              "torch_dtype": "float32", "bias": True}
    config.update(overrides)
    return config


def eagle1_state(dtype=torch.float32, seed=0, bias=True, embed=True) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {f"{L}self_attn.q_proj.weight": (q, H), f"{L}self_attn.k_proj.weight": (kv, H),
              f"{L}self_attn.v_proj.weight": (kv, H), f"{L}self_attn.o_proj.weight": (H, q),
              f"{L}mlp.gate_proj.weight": (INTER, H), f"{L}mlp.up_proj.weight": (INTER, H),
              f"{L}mlp.down_proj.weight": (H, INTER), f"{L}post_attention_layernorm.weight": (H,),
              "fc.weight": (H, 2 * H)}
    if bias:
        shapes["fc.bias"] = (H,)
    if embed:
        shapes["embed_tokens.weight"] = (VOCAB, H)
    return {k: torch.randn(*s, generator=g).to(dtype) for k, s in shapes.items()}


def write_eagle1(path, config=None, state=None, weight_file="pytorch_model.bin"):
    return write_head(path, eagle1_config() if config is None else config,
                      eagle1_state() if state is None else state, weight_file)


# ---------------------------------------------------------------------------------------
# Detection, loading, converting
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight_file", ["pytorch_model.bin", "model.safetensors"])
def test_detects_and_loads_eagle1_in_canonical_form(tmp_path, weight_file):
    src = write_eagle1(tmp_path / "e", weight_file=weight_file)
    assert detect_format(src) == "eagle1"
    head = load_head(src, TARGET)
    assert (head.method, head.format) == ("eagle1", "eagle1")
    assert head.config == eagle1_config() and tensor_bytes(head.state_dict) == tensor_bytes(eagle1_state())


def test_speculators_layout_with_its_config_stays_speculators(tmp_path):
    """layers.0.* + fc.weight is speculators' layout too: its config.json decides."""
    state = {"layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k: v
             for k, v in eagle3_state().items()}
    assert detect_format(write_head(tmp_path / "s", speculators_config(), state)) == "speculators"


def test_bin_converts_to_safetensors_bit_exact_and_through_the_cli(tmp_path):
    src = write_eagle1(tmp_path / "e", state=eagle1_state(dtype=torch.bfloat16), config=eagle1_config(
        torch_dtype="bfloat16"))
    summary = convert(src, tmp_path / "out", "eagle1", target_config=TARGET)
    assert (summary["source_format"], summary["method"], summary["dropped"]) == ("eagle1", "eagle1", [])
    assert tensor_bytes(files_tensors(tmp_path / "out")) == tensor_bytes(eagle1_state(dtype=torch.bfloat16))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == eagle1_config(torch_dtype="bfloat16")
    out = subprocess.run([sys.executable, "-m", "specplug.cli", "convert", str(src), str(tmp_path / "cli"),
                          "--to", "eagle1", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["source_format"] == "eagle1"
    refused = subprocess.run([sys.executable, "-m", "specplug.cli", "convert", str(src), str(tmp_path / "x"),
                              "--to", "eagle3"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "holds eagle3 heads" in refused.stderr


def test_fc_bias_follows_the_bias_key_or_the_weights(tmp_path):
    no_key = {k: v for k, v in eagle1_config().items() if k != "bias"}
    load_head(write_eagle1(tmp_path / "a", no_key), TARGET)
    load_head(write_eagle1(tmp_path / "b", no_key, eagle1_state(bias=False)), TARGET)
    load_head(write_eagle1(tmp_path / "c", eagle1_config(bias=False), eagle1_state(bias=False)), TARGET)
    with pytest.raises(CheckpointError, match=r"missing \['fc.bias'\]"):
        load_head(write_eagle1(tmp_path / "d", eagle1_config(bias=True), eagle1_state(bias=False)))
    with pytest.raises(CheckpointError, match=r"unexpected \['fc.bias'\]"):
        load_head(write_eagle1(tmp_path / "e", eagle1_config(bias=False)))


def test_load_head_module_and_save_head_take_eagle1(tmp_path):
    module = formats.load_head_module(write_eagle1(tmp_path / "e"), TARGET, dtype=torch.float64)
    assert isinstance(module, Eagle1Head) and module.fc.weight.dtype == torch.float64
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, eagle1_state()[name].double()), name
    with pytest.raises(ValueError, match="set_target_lm_head"):
        module.compute_logits(torch.zeros(1, H, dtype=torch.float64))
    report = save_head(module, tmp_path / "saved", "eagle1")
    assert report.format == "eagle1" and detect_format(tmp_path / "saved") == "eagle1"
    with pytest.raises(ValueError, match="holds eagle3 heads"):
        save_head(module, tmp_path / "x", "speculators")


# ---------------------------------------------------------------------------------------
# Malformed checkpoints: each a CheckpointError naming the field, the file and the fix
# ---------------------------------------------------------------------------------------
def _without(state: dict, name: str) -> dict:
    return {k: v for k, v in state.items() if k != name}


MALFORMED = {
    "fc of an EAGLE-3 head": (eagle1_config(), {**eagle1_state(), "fc.weight": torch.zeros(H, 3 * H)}, None,
                              "tensor fc.weight shape"),
    "input_layernorm (EAGLE-3 layer)": (eagle1_config(), {**eagle1_state(), f"{L}input_layernorm.weight":
                                                          torch.ones(H)}, None, f"tensor {L}input_layernorm.weight"),
    "q_proj reads 2H": (eagle1_config(), {**eagle1_state(), f"{L}self_attn.q_proj.weight": torch.zeros(H, 2 * H)},
                        None, f"tensor {L}self_attn.q_proj.weight shape"),
    "two layers": (eagle1_config(num_hidden_layers=2), eagle1_state(), None, "num_hidden_layers"),
    "missing mlp": (eagle1_config(), _without(eagle1_state(), f"{L}mlp.up_proj.weight"), None, "missing"),
    "mixed dtypes": (eagle1_config(), {**eagle1_state(), "fc.bias": torch.zeros(H, dtype=torch.float16)}, None,
                     "one floating dtype"),
    "int8 weights": (eagle1_config(), {**eagle1_state(), "fc.weight": torch.zeros(H, 2 * H, dtype=torch.int8)},
                     None, "tensor fc.weight dtype"),
    "hidden size vs target": (eagle1_config(), eagle1_state(), {**TARGET, "hidden_size": 4096},
                              "head hidden_size: expected target hidden_size 4096"),
    "vocab vs target": (eagle1_config(), eagle1_state(), {**TARGET, "vocab_size": 32000}, "head vocab_size"),
    "hidden size vs weights": (eagle1_config(hidden_size=32, head_dim=16), eagle1_state(), None, "shape"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_eagle1_checkpoint_gives_a_clear_error(tmp_path, case):
    config, state, target_config, expected = MALFORMED[case]
    with pytest.raises(CheckpointError) as err:
        load_head(write_eagle1(tmp_path / "head", config, state), target_config)
    message = str(err.value)
    assert expected in message
    assert "expected" in message and "given" in message and "fix:" in message
    assert str(tmp_path / "head") in message


def test_hidden_size_mismatch_names_both_sizes_and_the_fix(tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_head(write_eagle1(tmp_path / "head"), {**TARGET, "hidden_size": 4096})
    assert "4096" in str(err.value) and f"given {H}" in str(err.value)
    assert err.value.fix == "train or convert a head for this target"


# ---------------------------------------------------------------------------------------
# End to end on the tiny Llama: EAGLE-1 folder -> detect -> load -> EagleDrafter -> generate
# ---------------------------------------------------------------------------------------
NEW = 24


@pytest.fixture(scope="module")
def eagle1_folder(target, tmp_path_factory):
    """A random EAGLE-1 head for the tiny Llama written the EAGLE repo's way: torch.save of
    the state dict (with the target's embed_tokens copied in) + a LlamaConfig config.json."""
    head = random_eagle1_head(target)
    state = {**head.state_dict(), "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone()}
    config = {**head.config.to_dict(), "torch_dtype": "float32"}
    return write_head(tmp_path_factory.mktemp("eagle1") / "head", config, state, "pytorch_model.bin")


@pytest.mark.parametrize("tree", [TreeConfig(depth=3, topk=1, budget=3), TreeConfig(depth=3, topk=3, budget=8)],
                         ids=["chain", "tree"])
def test_eagle1_folder_drives_the_reference_loop_greedy_equal(target, tiny_llama_path, eagle1_folder, tree):
    assert detect_format(eagle1_folder) == "eagle1"
    head = formats.load_head_module(eagle1_folder, str(tiny_llama_path))
    head.set_target(target)
    result = generate(target, EagleDrafter(head), PROMPT, NEW, tree=tree)
    assert result.tokens == hf_greedy(target, PROMPT, NEW)
    assert result.steps >= 1 and 1.0 <= result.tau <= tree.depth + 1


class OracleEagle1Head(Eagle1Head):
    """Test-only EAGLE-1 head that knows the target's greedy sequence: it carries the draft
    position through `normed`, and its logits point at the token 2 positions later."""

    def __init__(self, config, sequence):
        super().__init__(config)
        self.sequence = sequence

    def forward(self, input_ids, hidden, positions, attention_mask, past_kv=None):
        out = super().forward(input_ids, hidden, positions, attention_mask, past_kv)
        return out._replace(normed=positions[..., None].float().expand_as(out.hidden))

    compute_logits = OracleEagle3Head.compute_logits  # one-hot on sequence[position + 2]


@pytest.mark.parametrize("tree", [TreeConfig(depth=3, topk=1, budget=3), TreeConfig(depth=3, topk=3, budget=8)],
                         ids=["chain", "tree"])
def test_agreeing_eagle1_head_gets_every_draft_token_accepted(target, tree):
    """Draft ids ARE target ids for EAGLE-1 (identity token map over the whole vocabulary):
    a head that agrees with the target has every draft token accepted, tau = depth + 1."""
    sequence = greedy_continuation(target, PROMPT, NEW + 8)
    oracle = OracleEagle1Head(random_eagle1_head(target).config, sequence)
    oracle.set_target(target)
    result = generate(target, EagleDrafter(oracle.eval()), PROMPT, NEW, tree=tree, eos_token_id=[])
    assert result.tokens == sequence[len(PROMPT):len(PROMPT) + NEW].tolist()
    assert result.num_accepted == [tree.depth] * result.steps and result.tau == tree.depth + 1
