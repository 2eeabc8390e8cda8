"""EAGLE-1 checkpoints (the EAGLE repo's layout) for specplug.common.formats: the tensors
a config implies, the EAGLE-3 names that must not be there, the torch module.

Layout (format "eagle1", also the canonical EAGLE-1 form): a Llama config.json with
`num_hidden_layers: 1` (architectures usually ["LlamaForCausalLM"], optional `bias`
= fc bias, optional `qkv_bias`), weights in pytorch_model.bin or *.safetensors:

  fc.weight [H, 2H]  (+ fc.bias [H])              fuses [embedding ; feature]
  layers.0.self_attn.{q,k,v,o}_proj.weight         q/k/v read H (not 2H as in EAGLE-3)
  layers.0.mlp.{gate,up,down}_proj.weight
  layers.0.post_attention_layernorm.weight         NO input_layernorm in layer 0
  embed_tokens.weight [vocab, H]                   optional (the target's otherwise)

No lm_head, no final norm: the draft logits are the TARGET's lm_head over the head's
output. specplug.common.formats owns reading files and the generic checks; this module only knows
what is specific to EAGLE-1. (It reads formats' names only inside functions: the two
modules import each other.)
"""

from __future__ import annotations

import copy
from .base import CheckpointError, LoadedHead, _layer_dims, _where

LAYER = "layers.0."
# Names only an EAGLE-3 layer has; in an EAGLE-1 layout they mean a mislabelled checkpoint.
_EAGLE3_NAMES = (f"{LAYER}input_layernorm.weight", f"{LAYER}hidden_norm.weight")


def is_eagle1(names: list[str], config: dict) -> bool:
    """layers.* + fc.weight without a speculators config or an EAGLE-3 midlayer (a
    multi-layer EAGLE-3 head has layers.1.*): the EAGLE repo's layout."""
    return ("fc.weight" in names and any(n.startswith("layers.") for n in names)
            and not any(n.startswith("midlayer.") for n in names) and "speculators_model_type" not in config)


def parse(config: dict, tensors: dict) -> tuple[dict, dict, dict]:
    """The EAGLE-1 layout is its own canonical form: (config, tensors, no extra tensors)."""
    return copy.deepcopy(config), dict(tensors), {}


def expected(head: LoadedHead) -> tuple[dict, dict]:
    """(required, optional) tensor name -> shape implied by an EAGLE-1 config."""
    config, where = head.config, _where(head)
    if config.get("num_hidden_layers", 1) != 1:
        raise CheckpointError("num_hidden_layers", 1, config["num_hidden_layers"], where,
                                   "specplug's EAGLE-1 head has one decoder layer (layers.0); use a 1-layer head")
    _refuse_eagle3_names(head)
    h, heads, kv, head_dim, inter, vocab = _layer_dims(config, where)
    required = {f"{LAYER}self_attn.q_proj.weight": (heads * head_dim, h),
                f"{LAYER}self_attn.k_proj.weight": (kv * head_dim, h),
                f"{LAYER}self_attn.v_proj.weight": (kv * head_dim, h),
                f"{LAYER}self_attn.o_proj.weight": (h, heads * head_dim),
                f"{LAYER}mlp.gate_proj.weight": (inter, h), f"{LAYER}mlp.up_proj.weight": (inter, h),
                f"{LAYER}mlp.down_proj.weight": (h, inter), f"{LAYER}post_attention_layernorm.weight": (h,),
                "fc.weight": (h, 2 * h)}
    optional = {"embed_tokens.weight": (vocab, h)}
    bias = config.get("bias")
    if bias is None:
        optional["fc.bias"] = (h,)  # no `bias` key: the weights decide
    elif bias:
        required["fc.bias"] = (h,)
    if config.get("qkv_bias"):
        for proj, rows in (("q", heads), ("k", kv), ("v", kv)):
            required[f"{LAYER}self_attn.{proj}_proj.bias"] = (rows * head_dim,)
    _check_fc(head, h)
    return required, optional


def _refuse_eagle3_names(head: LoadedHead) -> None:
    found = [n for n in _EAGLE3_NAMES if n in head.state_dict]
    if found:
        raise CheckpointError(
            f"tensor {found[0]}", "absent: EAGLE-1's layer 0 reads fc's output with no input norm",
            "present (an EAGLE-3 layer name)", _where(head, found[0]),
            "an EAGLE-3 head in speculators layout needs its speculators config.json "
            "(speculators_model_type) next to the weights; other EAGLE-1 variants are not supported")


def _check_fc(head: LoadedHead, h: int) -> None:
    """fc.weight [H, 2H]: a [H, 3H] fc is an EAGLE-3 head in the wrong folder or config."""
    fc = head.state_dict.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (h, 2 * h):
        raise CheckpointError(
            "tensor fc.weight shape", f"[{h}, {2 * h}] (EAGLE-1 fuses [embedding ; feature] of hidden_size {h})",
            list(fc.shape), _where(head, "fc.weight"),
            "use the config.json the head was trained with; an fc over 3 hidden states is an EAGLE-3 head")


def build_module(head: LoadedHead):
    """The Eagle1Head of a validated head (attach the target with `set_target(model)`)."""
    from specplug.common.heads.eagle1 import Eagle1Config, Eagle1Head
    return Eagle1Head.from_state_dict(Eagle1Config.from_dict(head.config), head.state_dict)
