"""Detection of a head folder's format, and each source format -> the canonical form of its method."""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path

import torch

from . import eagle1 as formats_eagle1
from .base import _FIX_FORMATS, CheckpointError, EAGLE3_ARCHITECTURE, METHOD_OF_FORMAT
from .files import _checkpoint_dir, _read_config, _tensor_names, _weight_files

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------
_MEDUSA_KEY = re.compile(r"^(?:medusa_head\.)?\d+\.\d+\.(?:linear\.)?(?:weight|bias)$")


def _format_from_names(names: list[str], config: dict) -> str | None:
    if any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if formats_eagle1.is_eagle1(names, config):
        return "eagle1"
    if any(n.startswith("layers.") for n in names) and "fc.weight" in names:
        return "speculators"
    if any(n.split(".")[0] in ("blocks", "lm_heads") or n.startswith("medusa_heads.") for n in names):
        return "vllm-medusa"
    if names and all(_MEDUSA_KEY.match(n) for n in names):
        return "medusa"
    return None


def _method_from_config(config: dict) -> str | None:
    arch = " ".join(config.get("architectures") or []).lower()
    if "speculators_model_type" in config or "eagle3" in arch:
        return "eagle3"
    if "medusa" in arch or config.get("model_type") == "medusa" or any("medusa" in k for k in config):
        return "medusa"
    return None


def detect_format(path: str | Path) -> str:
    """The format of the head checkpoint in directory `path` (one of FORMATS), from its
    tensor names, cross-checked against its config.json."""
    path = _checkpoint_dir(path)
    config = _read_config(path)
    kind = config.get("speculators_model_type")
    if kind is not None and kind != "eagle3":
        raise CheckpointError("speculators_model_type", '"eagle3"', repr(kind), f"config.json of {path}",
                              "only EAGLE-3 speculators checkpoints are supported")
    names = _tensor_names(_weight_files(path))
    fmt = _format_from_names(names, config)
    if fmt is None:
        raise CheckpointError("weights", "EAGLE-1, EAGLE-3 or Medusa tensor names", f"{sorted(names)[:6]} ...",
                              str(path), _FIX_FORMATS)
    declared = _method_from_config(config)
    if declared is not None and declared != METHOD_OF_FORMAT[fmt]:
        raise CheckpointError("config.json", f"a {METHOD_OF_FORMAT[fmt]} config (the tensors are {fmt})",
                              f"a {declared} config", str(path), "config.json and weights come from "
                              "different heads: put the matching config.json next to the weights")
    return fmt


# ---------------------------------------------------------------------------------------
# Format -> canonical
# ---------------------------------------------------------------------------------------
# speculators top-level keys that the canonical EAGLE-3 config carries at its top level.
_SPECULATORS_EAGLE_KEYS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                           "norm_before_fc", "fc_norm", "norm_output")
_SPECULATORS_IDENTITY = {"architectures", "speculators_model_type", "transformer_layer_config",
                         "eagle_aux_hidden_state_layer_ids", "specplug", *_SPECULATORS_EAGLE_KEYS}


def _from_eagle3(config: dict, tensors: dict) -> tuple[dict, dict, dict]:
    return copy.deepcopy(config), dict(tensors), {}


def _from_speculators(config: dict, tensors: dict, where: str) -> tuple[dict, dict, dict]:
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("transformer_layer_config", "a dict (the draft layer's Llama config)",
                              repr(layer), where, "re-export the head with speculators")
    canonical = {k: v for k, v in copy.deepcopy(layer).items() if k != "architectures"}
    canonical["architectures"] = [EAGLE3_ARCHITECTURE]
    for key in _SPECULATORS_EAGLE_KEYS:
        if config.get(key) is not None:
            canonical[key] = config[key]
    # vLLM reads a speculators head without the key as norm_before_residual=True.
    canonical["norm_before_residual"] = bool(config.get("norm_before_residual", True))
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        canonical["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), "use_aux_hidden_state": True}
    if "specplug" in config:
        canonical["specplug"] = copy.deepcopy(config["specplug"])
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
             for k, v in tensors.items()}
    return canonical, state, {}


def _medusa_layer_counts(config: dict, names: list[str]) -> tuple[int, int]:
    """(num_heads, num_layers) from FasterDecoding keys; config values win when given."""
    blocks = [m for m in map(re.compile(r"^(\d+)\.(\d+)\.").match, names) if m]
    heads = 1 + max((int(m.group(1)) for m in blocks), default=-1)
    lm_layer = [int(n.split(".")[1]) for n in names if re.match(r"^\d+\.\d+\.weight$", n)]
    return (config.get("medusa_num_heads", heads), config.get("medusa_num_layers", max(lm_layer, default=0)))


def _fill_shared_blocks(state: dict, heads: int, layers: int) -> list[str]:
    """Undo the Medusa repo's `[ResBlock] * n` bug (one block object repeated n times).

    Saved with torch.save, every layer name exists (equal tensors, shared storage); saved
    with safetensors' deduplicating save_model, each head keeps ONE layer. Both load as
    per-layer copies of the equal weights, which computes exactly what the buggy module
    did. Returns INFO lines describing what was found."""
    if not isinstance(heads, int) or not isinstance(layers, int) or layers < 2:
        return []
    present = {h: sorted({int(k.split(".")[1]) for k in state
                          if k.startswith(f"{h}.") and ".linear." in k}) for h in range(heads)}
    if present and all(len(p) == 1 for p in present.values()):
        for h, (kept,) in present.items():
            for kind in ("weight", "bias"):
                src = state.get(f"{h}.{kept}.linear.{kind}")
                for layer in range(layers):
                    if src is not None:
                        state[f"{h}.{layer}.linear.{kind}"] = src.clone()
        return [f"Medusa checkpoint saved with the shared-block bug ([ResBlock]*{layers}, deduplicated "
                f"on save): each head stores one residual block; loaded as {layers} equal per-layer copies"]
    if any(t.is_meta for t in state.values()):  # a shapes-only read (load_head weights=False) cannot compare
        return []
    shared = present and all(len(present[h]) == layers and all(
        torch.equal(state[f"{h}.0.linear.weight"], state[f"{h}.{j}.linear.weight"]) for j in range(layers))
        for h in range(heads))
    if shared:
        return [f"Medusa checkpoint written with the shared-block bug ([ResBlock]*{layers}): every head's "
                f"{layers} residual blocks hold identical weights; loaded faithfully as per-layer copies"]
    return []


def _unshare_storage(state: dict) -> dict:
    """Clone tensors that share storage (torch.save keeps aliasing; safetensors refuses it)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if ptr in seen and tensor.numel() else tensor
        seen.add(ptr)
    return out


def _from_medusa(config: dict, tensors: dict) -> tuple[dict, dict, dict]:
    state = {k[len("medusa_head."):] if k.startswith("medusa_head.") else k: v for k, v in tensors.items()}
    heads, layers = _medusa_layer_counts(config, list(state))
    for line in _fill_shared_blocks(state, heads, layers):
        logger.info(line)
    canonical = copy.deepcopy(config)
    canonical.setdefault("medusa_num_heads", heads)
    canonical.setdefault("medusa_num_layers", layers)
    lm = state.get(f"0.{layers}.weight")
    if lm is not None:
        canonical.setdefault("hidden_size", int(lm.shape[1]))
        canonical.setdefault("vocab_size", int(lm.shape[0]))
    return canonical, _unshare_storage(state), {}


_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")
_VLLM_LM = re.compile(r"^lm_heads\.(\d+)\.weight$")
# vLLM MedusaConfig keys with no FasterDecoding counterpart (or renamed ones).
_VLLM_MEDUSA_KEYS = ("architectures", "model_type", "num_heads", "num_hidden_layers", "medusa_fc_bias",
                     "truncated_vocab_size", "max_paths", "topk", "original_lm_head")


def _renamed_by_vllm(key: str) -> bool:
    """vLLM's MedusaConfig.from_pretrained renames EVERY key containing 'num' and
    'heads' (-> num_heads) or 'layers' (-> num_hidden_layers)."""
    return "num" in key and ("heads" in key or "layers" in key)


def _vllm_medusa_counts(config: dict, where: str) -> tuple[int, int]:
    counts = []
    for word, key in (("heads", "num_heads"), ("layers", "num_hidden_layers")):
        value = next((v for k, v in config.items() if "num" in k and word in k), None)
        if not isinstance(value, int) or value < 0:
            raise CheckpointError(key, "an int (vLLM MedusaConfig)", repr(value), where,
                                  f"set {key} in config.json")
        counts.append(value)
    return counts[0], counts[1]


def _from_vllm_medusa(config: dict, tensors: dict, where: str) -> tuple[dict, dict, dict]:
    if config.get("original_lm_head"):
        raise CheckpointError("original_lm_head", "false (one lm_head per Medusa head)", "true", where,
                              "heads that share one lm_head are not supported: train per-head lm_heads")
    heads, layers = _vllm_medusa_counts(config, where)
    state, extra_tensors, bias_seen = {}, {}, False
    for name, tensor in tensors.items():
        name = name[len("medusa_heads."):] if name.startswith("medusa_heads.") else name
        block, lm = _VLLM_BLOCK.match(name), _VLLM_LM.match(name)
        if block:
            h, layer, kind = block.groups()
            state[f"{h}.{layer}.linear.{kind}"] = tensor
            bias_seen |= kind == "bias"
        elif lm:
            state[f"{lm.group(1)}.{layers}.weight"] = tensor
        elif name == "token_map":
            extra_tensors[name] = tensor
        else:
            state[name] = tensor  # reported as unexpected by validation
    if not bias_seen and not config.get("medusa_fc_bias", False):
        _add_zero_biases(state)
    canonical = {k: copy.deepcopy(v) for k, v in config.items()
                 if k not in _VLLM_MEDUSA_KEYS and not _renamed_by_vllm(k)}
    canonical.update(medusa_num_heads=heads, medusa_num_layers=layers)
    lm = state.get(f"0.{layers}.weight")
    if lm is not None:  # vLLM's defaults (4096 / 32001) are never what the tensors say
        canonical.setdefault("hidden_size", int(lm.shape[1]))
        canonical.setdefault("vocab_size", int(lm.shape[0]))
    return canonical, state, extra_tensors


def _add_zero_biases(state: dict) -> None:
    """vLLM's residual blocks may be bias-free (medusa_fc_bias false); FasterDecoding's
    always have a bias. A zero bias computes the same function."""
    added = 0
    for name in [n for n in state if n.endswith(".linear.weight")]:
        weight = state[name]
        state[name[: -len("weight")] + "bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
        added += 1
    if added:
        logger.info("vLLM Medusa head has bias-free residual blocks (medusa_fc_bias false): "
                    "added %d zero biases (same function) for the canonical FasterDecoding form", added)


def _parse(fmt: str, config: dict, tensors: dict, where: str) -> tuple[dict, dict, dict]:
    if fmt == "eagle3":
        return _from_eagle3(config, tensors)
    if fmt == "speculators":
        return _from_speculators(config, tensors, where)
    if fmt == "eagle1":
        return formats_eagle1.parse(config, tensors)
    if fmt == "medusa":
        return _from_medusa(config, tensors)
    return _from_vllm_medusa(config, tensors, where)
