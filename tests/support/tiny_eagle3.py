"""Test support: tiny EAGLE-3 draft heads in vLLM's checkpoint format, and a target/head
pair built so the draft always agrees with the target.

Everything is seeded and cached under $SPECPLUG_CACHE/tiny, next to the tiny targets.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_llama import cached_dir, tiny_llama_dir

TINY_AUX_LAYER_IDS = [1, 2, 3]  # the tiny target has 4 layers: (2, 2, 1) would collapse
# vLLM's CPU attention supports head_dim >= 32: hidden 128 with 4 query / 2 KV heads.
TINY_TARGET = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}


def tiny_target_dir() -> Path:
    """The tiny random Llama the vLLM tests serve (GQA 4/2, head_dim 32, 4 layers)."""
    return tiny_llama_dir(**TINY_TARGET)


def head_config(target_dir: Path, *, draft_vocab_size: int | None = None,
                aux_layer_ids=TINY_AUX_LAYER_IDS, specplug: dict | None = None) -> dict:
    """config.json of an EAGLE-3 head for the target in target_dir (vLLM's format)."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim", target["hidden_size"] // target["num_attention_heads"]),
        "num_hidden_layers": 1,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab_size or target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target["rms_norm_eps"],
        "rope_parameters": target.get("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"}),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                         "use_aux_hidden_state": True},
    }
    if specplug is not None:
        config["specplug"] = specplug
    return config


def random_head_tensors(config: dict, seed: int = 0, std: float = 0.2) -> dict[str, torch.Tensor]:
    """Random weights with EAGLE / SpecForge tensor names for a head config."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    draft_vocab = config["draft_vocab_size"]
    num_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * std

    tensors = {
        "midlayer.self_attn.q_proj.weight": rand(q_out, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_out, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q_out),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": rand(hidden, num_aux * config["target_hidden_size"]),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=gen),
    }
    for i in range(1, config.get("num_hidden_layers", 1)):  # vLLM's multi-layer EAGLE-3: layers.1+ read H
        m = f"layers.{i}."
        tensors.update({
            f"{m}self_attn.q_proj.weight": rand(q_out, hidden), f"{m}self_attn.k_proj.weight": rand(kv_out, hidden),
            f"{m}self_attn.v_proj.weight": rand(kv_out, hidden), f"{m}self_attn.o_proj.weight": rand(hidden, q_out),
            f"{m}mlp.gate_proj.weight": rand(inter, hidden), f"{m}mlp.up_proj.weight": rand(inter, hidden),
            f"{m}mlp.down_proj.weight": rand(hidden, inter), f"{m}input_layernorm.weight": torch.ones(hidden),
            f"{m}post_attention_layernorm.weight": torch.ones(hidden)})
    if draft_vocab != config["vocab_size"]:
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # draft id i -> target id i
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
        tensors["t2d"][:draft_vocab] = True
    return tensors


def write_head(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def tiny_head_dir(target_dir: Path | None = None, *, specplug: dict | None = None,
                  seed: int = 0, **config_overrides) -> Path:
    """A random EAGLE-3 head for the tiny target; `specplug` adds the specplug section."""
    target_dir = Path(target_dir or tiny_target_dir())
    spec = {"target": str(target_dir), "specplug": specplug, "seed": seed, **config_overrides}

    def write(tmp: Path):
        config = head_config(target_dir, specplug=specplug)
        config.update(config_overrides)
        write_head(tmp, config, random_head_tensors(config, seed))

    return cached_dir("eagle3", spec, write)


AGREE_TOKEN = 100  # the constant target's most likely token, and the agreeing head's only draft
# logit / sqrt(hidden) of the tokens the constant target can emit; every other token gets -1
CONSTANT_TARGET_LOGITS = {100: 0.12, 101: 0.10, 102: 0.08}


def constant_target_dir() -> Path:
    """A tiny Llama whose next-token distribution is the same after every prefix.

    Its decoder layers add nothing (o_proj and down_proj are zero), every embedding has a
    large positive coordinate 0, the final norm keeps only coordinate 0 (about
    sqrt(hidden) after normalisation), and lm_head column 0 holds CONSTANT_TARGET_LOGITS:
    greedy always emits AGREE_TOKEN; sampling draws i.i.d. tokens from a fixed p.
    """
    base = tiny_target_dir()

    def write(tmp: Path):
        for f in base.iterdir():
            if f.name not in ("model.safetensors", ".complete"):
                shutil.copy(f, tmp / f.name)
        tensors = load_file(str(base / "model.safetensors"))
        for name in tensors:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                tensors[name].zero_()
        tensors["model.embed_tokens.weight"][:, 0] = 10.0
        tensors["model.norm.weight"].zero_()
        tensors["model.norm.weight"][0] = 1.0
        tensors["lm_head.weight"].zero_()
        tensors["lm_head.weight"][:, 0] = -1.0
        for token, logit in CONSTANT_TARGET_LOGITS.items():
            tensors["lm_head.weight"][token, 0] = logit
        save_file(tensors, str(tmp / "model.safetensors"))

    spec = {"base": str(base), "logits": CONSTANT_TARGET_LOGITS}
    return cached_dir("llama-constant", spec, write)


def agreeing_head_dir(target_dir: Path, *, specplug: dict | None = None) -> Path:
    """An EAGLE-3 head whose draft vocabulary is the single token AGREE_TOKEN (via d2t)."""
    spec = {"target": str(target_dir), "specplug": specplug, "agree": AGREE_TOKEN}

    def write(tmp: Path):
        config = head_config(target_dir, draft_vocab_size=1, specplug=specplug)
        tensors = random_head_tensors(config)
        tensors["d2t"] = torch.tensor([AGREE_TOKEN], dtype=torch.long)  # target id = 0 + d2t[0]
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
        tensors["t2d"][AGREE_TOKEN] = True
        write_head(tmp, config, tensors)

    return cached_dir("eagle3-agree", spec, write)


TWO_DRAFT_TOKENS = (100, 101)  # the two most likely tokens of the constant target


def two_token_head_dir(target_dir: Path, *, specplug: dict | None = None) -> Path:
    """An EAGLE-3 head whose draft vocabulary is TWO_DRAFT_TOKENS (via d2t), with random
    preferences between them: with topk 2 its trees branch at every node."""
    spec = {"target": str(target_dir), "specplug": specplug, "two": TWO_DRAFT_TOKENS}

    def write(tmp: Path):
        config = head_config(target_dir, draft_vocab_size=len(TWO_DRAFT_TOKENS), specplug=specplug)
        tensors = random_head_tensors(config)
        tensors["d2t"] = torch.tensor([t - i for i, t in enumerate(TWO_DRAFT_TOKENS)], dtype=torch.long)
        tensors["t2d"] = torch.zeros(config["vocab_size"], dtype=torch.bool)
        tensors["t2d"][list(TWO_DRAFT_TOKENS)] = True
        write_head(tmp, config, tensors)

    return cached_dir("eagle3-two", spec, write)
