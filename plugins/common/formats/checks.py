"""Validation of a canonical head: its structure, dtypes and shapes, then against the target."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import eagle1 as formats_eagle1
from .base import NUM_AUX_HIDDEN_STATES, CheckpointError, LoadedHead, _config_int, _layer_dims, _where
from .files import _checkpoint_dir, _read_config

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Validation: the canonical structure, then the target
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetDims:
    """What a head must agree with, read from the target's (HF) config."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    dtype: str | None
    where: str


def target_dims(target_config: Any) -> TargetDims:
    """Read hidden size, vocab, layer count and dtype from a target config: a dict, a
    transformers PretrainedConfig, or a model directory (its config.json)."""
    where = "target config"
    if isinstance(target_config, (str, Path)):
        where = f"config.json of {target_config}"
        target_config = _read_config(_checkpoint_dir(target_config))
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    missing = [k for k in ("hidden_size", "vocab_size", "num_hidden_layers") if cfg.get(k) is None]
    if missing:
        raise CheckpointError(f"target {missing[0]}", "an int", "missing", where,
                              "pass the target model's own config (its config.json folder)")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return TargetDims(int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_hidden_layers"]),
                      str(dtype).replace("torch.", "") if dtype else None, where)


def _eagle3_aux_ids(config: dict) -> list[int] | None:
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    return None if ids is None else list(ids)


def _eagle3_expected(config: dict, where: str) -> tuple[dict, dict]:
    """(required, optional) canonical tensor name -> shape implied by an EAGLE-3 config."""
    layers = _config_int(config, "num_hidden_layers", where, 1)
    h, heads, kv, head_dim, inter, vocab = _layer_dims(config, where)
    draft = _config_int(config, "draft_vocab_size", where, vocab)
    ht = _config_int(config, "target_hidden_size", where, h)
    ids = _eagle3_aux_ids(config)
    fc_in = (len(ids) if ids else NUM_AUX_HIDDEN_STATES) * ht
    eagle = config.get("eagle_config") or {}
    if "norm_before_residual" in eagle and "norm_before_residual" in config \
            and bool(eagle["norm_before_residual"]) != bool(config["norm_before_residual"]):
        raise CheckpointError("norm_before_residual", "one value", f"{config['norm_before_residual']} at the top "
                              f"level, {eagle['norm_before_residual']} in eagle_config", where,
                              "keep one norm_before_residual (vLLM reads the top-level key)")
    if draft > vocab:
        raise CheckpointError("draft_vocab_size", f"<= vocab_size {vocab}", draft, where,
                              "the draft vocabulary is a subset of the target's: fix config.json")
    required = _llama_layer_expected("midlayer.", 2 * h, h, heads, kv, head_dim, inter)  # q/k/v read [embed; hidden]
    required.update({"midlayer.hidden_norm.weight": (h,), "fc.weight": (h, fc_in), "norm.weight": (h,),
                     "lm_head.weight": (draft, h)})
    for i in range(1, layers):  # vLLM's multi-layer EAGLE-3: plain decoder layers over H
        required.update(_llama_layer_expected(f"layers.{i}.", h, h, heads, kv, head_dim, inter))
    optional = {"embed_tokens.weight": (vocab, h), "t2d": (vocab,), "d2t": (draft,)}
    if draft != vocab:
        required["d2t"] = optional.pop("d2t")
    _eagle3_flagged(config, required, layers, h, heads, kv, head_dim, inter, ht, fc_in)
    return required, optional


def _llama_layer_expected(m: str, width, h, heads, kv, head_dim, inter) -> dict:
    """Tensor name -> shape of a Llama decoder layer named with prefix `m` whose q/k/v read
    `width` columns."""
    return {
        f"{m}self_attn.q_proj.weight": (heads * head_dim, width), f"{m}self_attn.k_proj.weight": (kv * head_dim, width),
        f"{m}self_attn.v_proj.weight": (kv * head_dim, width), f"{m}self_attn.o_proj.weight": (h, heads * head_dim),
        f"{m}mlp.gate_proj.weight": (inter, h), f"{m}mlp.up_proj.weight": (inter, h),
        f"{m}mlp.down_proj.weight": (h, inter), f"{m}input_layernorm.weight": (h,),
        f"{m}post_attention_layernorm.weight": (h,),
    }


def _eagle3_flagged(config, required, layers, h, heads, kv, head_dim, inter, ht, fc_in) -> None:
    """Tensors that config flags switch on (biases, the norm_before_fc / fc_norm variants)."""
    prefixes = ["midlayer."] + [f"layers.{i}." for i in range(1, layers)]
    for m in prefixes:
        if config.get("attention_bias"):
            for proj, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim), ("o", h)):
                required[f"{m}self_attn.{proj}_proj.bias"] = (rows,)
        if config.get("mlp_bias"):
            required.update({f"{m}mlp.gate_proj.bias": (inter,), f"{m}mlp.up_proj.bias": (inter,),
                             f"{m}mlp.down_proj.bias": (h,)})
    eagle = config.get("eagle_config") or {}
    if eagle.get("norm_before_fc", config.get("norm_before_fc")):
        required["input_norm.weight"] = (fc_in,)
    if config.get("fc_norm"):
        required.update({f"fc_norm.{i}.weight": (ht,) for i in range(fc_in // ht)})


def _medusa_expected(head: LoadedHead, where: str) -> tuple[dict, dict]:
    config = head.config
    heads = _config_int(config, "medusa_num_heads", where)
    layers = config.get("medusa_num_layers")
    if not isinstance(layers, int) or layers < 0:
        raise CheckpointError("medusa_num_layers", "an int >= 0", repr(layers), where,
                              "set medusa_num_layers in config.json")
    h = _config_int(config, "hidden_size", where)
    rows = _config_int(config, "vocab_size", where)
    rows = (head.extra or {}).get("truncated_rows") or rows
    _check_medusa_counts(head.state_dict, heads, layers, where)
    required = {}
    for i in range(heads):
        for j in range(layers):
            required[f"{i}.{j}.linear.weight"] = (h, h)
            required[f"{i}.{j}.linear.bias"] = (h,)
        required[f"{i}.{layers}.weight"] = (rows, h)
    return required, {}


def _check_medusa_counts(state: dict, heads: int, layers: int, where: str) -> None:
    """Head and layer counts in the tensors vs medusa_num_heads / medusa_num_layers."""
    found = sorted({int(m.group(1)) for m in map(re.compile(r"^(\d+)\.").match, state) if m})
    if found and found != list(range(heads)):
        raise CheckpointError("medusa_num_heads", f"{heads} heads (0..{heads - 1}) as config.json says",
                              f"tensors for heads {found}", where,
                              "set medusa_num_heads to the number of heads the weights hold, "
                              "or use the matching weights")
    lm = sorted({int(k.split(".")[1]) for k in state if re.match(r"^\d+\.\d+\.weight$", k)})
    if lm and lm != [layers]:
        raise CheckpointError("medusa_num_layers", f"{layers} residual blocks per head (vocab projection "
                              f"named {{head}}.{layers}.weight)", f"vocab projections at layer index {lm}",
                              where, "set medusa_num_layers to the number of residual blocks the weights hold")


def _check_keys(head: LoadedHead, required: dict, optional: dict) -> None:
    names = set(head.state_dict)
    missing = sorted(set(required) - names)
    if missing:
        raise CheckpointError("tensors", f"all of the {head.method} head's tensors", f"missing {missing}",
                              _where(head, missing[0]), "use the complete checkpoint (all shards), or fix "
                              "the config.json flags/counts that call for these tensors")
    unexpected = sorted(names - set(required) - set(optional))
    if unexpected:
        raise CheckpointError("tensors", f"only {head.method} head tensors (canonical names)",
                              f"unexpected {unexpected}", _where(head, unexpected[0]),
                              "these belong to another model or a variant specplug does not support: "
                              "remove them or convert with the right --to format")


def _check_shapes_and_dtypes(head: LoadedHead, expected: dict) -> None:
    for name, shape in expected.items():
        tensor = head.state_dict.get(name)
        if tensor is not None and tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name} shape", list(shape), list(tensor.shape), _where(head, name),
                                  "config.json and weights disagree: use the config the weights were saved with")
    float_dtypes = set()
    for name, tensor in head.state_dict.items():
        if name in ("d2t", "t2d"):
            continue
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name} dtype", "a floating dtype (float32/float16/bfloat16)",
                                  str(tensor.dtype), _where(head, name),
                                  "quantized heads are not supported: export the unquantized head")
        float_dtypes.add(tensor.dtype)
    if len(float_dtypes) > 1:
        raise CheckpointError("dtype", "one floating dtype for all weights", sorted(map(str, float_dtypes)),
                              _where(head), "cast the whole head to one dtype before saving")


def _check_vocab_maps(head: LoadedHead, target_vocab: int | None) -> None:
    """d2t: integer offsets with every i + d2t[i] in [0, vocab); t2d: bool/int mask."""
    d2t, t2d = head.state_dict.get("d2t"), head.state_dict.get("t2d")
    vocab = target_vocab or head.config.get("vocab_size")
    if d2t is not None:
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise CheckpointError("d2t dtype", "int64 offsets", str(d2t.dtype), _where(head, "d2t"),
                                  "save d2t as int64 (target id = i + d2t[i])")
        ids = torch.arange(d2t.numel()) + d2t.long()
        bad = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise CheckpointError("d2t", f"i + d2t[i] in [0, {vocab}) for every draft id i",
                                  f"draft id {i} -> target id {int(ids[i])} ({bad.numel()} ids out of range)",
                                  _where(head, "d2t"), "the vocab map was built for another tokenizer: "
                                  "rebuild d2t/t2d for this target's vocabulary")
    if t2d is not None and t2d.dtype.is_floating_point:
        raise CheckpointError("t2d dtype", "bool mask over the target vocab", str(t2d.dtype), _where(head, "t2d"),
                              "save t2d as bool")


def _check_target_dims(head: LoadedHead, target: TargetDims, hidden_key: str) -> None:
    """The head's width (hidden_key) and vocab against the target's."""
    cfg, where = head.config, _where(head)
    if cfg[hidden_key] != target.hidden_size:
        raise CheckpointError(f"head {hidden_key}", f"target hidden_size {target.hidden_size} ({target.where})",
                              cfg[hidden_key], where, "train or convert a head for this target")
    if cfg["vocab_size"] != target.vocab_size:
        raise CheckpointError("head vocab_size", f"target vocab_size {target.vocab_size} ({target.where})",
                              cfg["vocab_size"], where, "train a head for this target's tokenizer")


def _check_target_eagle3(head: LoadedHead, target: TargetDims) -> None:
    _check_target_dims(head, target, "target_hidden_size" if head.config.get("target_hidden_size") else "hidden_size")
    ids, layers = _eagle3_aux_ids(head.config), target.num_layers
    if ids is None and layers < 4:
        raise CheckpointError("eagle_config.eagle_aux_hidden_state_layer_ids", "explicit ids for a target with "
                              "fewer than 4 layers (the default is (2, L//2, L-3))", "none", _where(head),
                              "set eagle_config.eagle_aux_hidden_state_layer_ids to the layers the head was trained on")
    bad = [i for i in ids or () if not 0 <= int(i) < layers]
    if bad:
        raise CheckpointError("eagle_config.eagle_aux_hidden_state_layer_ids",
                              f"ids in [0, {layers}) for the {layers}-layer target of {target.where} "
                              "(id i = input of decoder layer i)", ids, _where(head),
                              "train a head for this target, or fix the ids in config.json")


def _head_dtype(head: LoadedHead) -> str | None:
    weight = next((t for t in head.state_dict.values() if t.dtype.is_floating_point), None)
    return None if weight is None else str(weight.dtype).replace("torch.", "")


def validate(head: LoadedHead, target_config: Any = None) -> None:
    """Check a canonical head's structure (config fields, tensor names, shapes, dtypes,
    d2t range) and, given a target config, its fit to that target (hidden size, vocab,
    aux layer ids). Raises CheckpointError on the first problem; a dtype that differs
    from the target's is only a WARNING (engines cast the head)."""
    target = None if target_config is None else target_dims(target_config)
    expected = (_eagle3_expected(head.config, _where(head)) if head.method == "eagle3"
                else formats_eagle1.expected(head) if head.method == "eagle1"
                else _medusa_expected(head, _where(head)))
    _check_keys(head, *expected)
    _check_shapes_and_dtypes(head, {**expected[0], **expected[1]})
    if target is not None and head.method == "eagle3":
        _check_target_eagle3(head, target)
    elif target is not None:  # EAGLE-1 and Medusa read the target's final hidden state
        _check_target_dims(head, target, "hidden_size")
    if head.method == "eagle3":
        _check_vocab_maps(head, target.vocab_size if target else None)
    dtype = _head_dtype(head)
    if target is not None and target.dtype and dtype and dtype != target.dtype:
        logger.warning("head dtype %s differs from target dtype %s (%s): engines cast the head to the "
                       "target's dtype", dtype, target.dtype, target.where)
