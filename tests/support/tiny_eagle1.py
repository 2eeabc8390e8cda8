"""Test support: tiny EAGLE-1 heads (the EAGLE repo's layout) for the tiny targets.

An EAGLE-1 head reads the target's final hidden state h (after its norm) and scores its
output r with the target's lm_head. The "echo" head passes h through unchanged (fc keeps
the feature half, attention and MLP add zero), so its first draft is the target's own
prediction at the root's position, i.e. the root token again; deeper drafts repeat it.
On the constant target (tiny_eagle3.constant_target_dir) that is the target's greedy
token at every position, so every draft is accepted; on a random target it is accepted
where the target repeats itself. No fc bias: vLLM 0.32's EAGLE-1 model has none.

Everything is seeded and cached under $SPECPLUG_CACHE/tiny, next to the tiny targets.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.tiny_eagle3 import write_head
from tests.support.tiny_llama import cached_dir


def eagle1_config(target_dir: Path, *, specplug: dict | None = None) -> dict:
    """config.json of a one-layer EAGLE-1 head for the target in target_dir."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = {key: target[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "vocab_size", "max_position_embeddings",
                                           "rms_norm_eps")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  head_dim=target.get("head_dim", target["hidden_size"] // target["num_attention_heads"]),
                  rope_parameters=target.get("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"}),
                  hidden_act="silu", tie_word_embeddings=False, torch_dtype="float32")
    if specplug is not None:
        config["specplug"] = specplug
    return config


def eagle1_tensors(config: dict, *, echo: bool, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """EAGLE-1 tensors: random, or the echo head's (output = the feature it reads)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * std

    layer = "layers.0."
    tensors = {
        "fc.weight": rand(hidden, 2 * hidden),
        f"{layer}self_attn.q_proj.weight": rand(q_out, hidden),
        f"{layer}self_attn.k_proj.weight": rand(kv_out, hidden),
        f"{layer}self_attn.v_proj.weight": rand(kv_out, hidden),
        f"{layer}self_attn.o_proj.weight": rand(hidden, q_out),
        f"{layer}mlp.gate_proj.weight": rand(inter, hidden),
        f"{layer}mlp.up_proj.weight": rand(inter, hidden),
        f"{layer}mlp.down_proj.weight": rand(hidden, inter),
        f"{layer}post_attention_layernorm.weight": torch.ones(hidden),
    }
    if echo:
        tensors["fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)  # [e; h] -> h
        tensors[f"{layer}self_attn.o_proj.weight"].zero_()
        tensors[f"{layer}mlp.down_proj.weight"].zero_()
    return tensors


def eagle1_head_dir(target_dir: Path, *, echo: bool = False, specplug: dict | None = None, seed: int = 0) -> Path:
    """A tiny EAGLE-1 head for the target in target_dir (see the module docstring)."""
    spec = {"target": str(target_dir), "echo": echo, "specplug": specplug, "seed": seed}

    def write(tmp: Path):
        config = eagle1_config(target_dir, specplug=specplug)
        write_head(tmp, config, eagle1_tensors(config, echo=echo, seed=seed))

    return cached_dir("eagle1", spec, write)
