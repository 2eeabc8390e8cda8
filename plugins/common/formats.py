"""Draft-head checkpoint formats: detect, load (validated), save and convert.

Five on-disk formats, three methods. Each is mapped onto ONE canonical form per method:

  method   format         layout (config.json + weights)                      canonical?
  eagle3   "eagle3"       EAGLE / SpecForge `LlamaForCausalLMEagle3`: midlayer.*,  yes
                          fc.weight, norm.weight, lm_head.weight, d2t, t2d,
                          optional embed_tokens.weight (model.safetensors or
                          pytorch_model.bin)
  eagle3   "speculators"  vllm speculators: speculators_model_type "eagle3",
                          nested transformer_layer_config / speculators_config,
                          layers.0.* instead of midlayer.*
  eagle1   "eagle1"       the EAGLE repo's EAGLE-1 heads: Llama config.json, fc.weight  yes
                          [H, 2H], layers.0.* without input_layernorm (formats_eagle1.py)
  medusa   "medusa"       FasterDecoding: medusa_lm_head.safetensors (or .pt),     yes
                          medusa_num_heads / medusa_num_layers,
                          {head}.{layer}.linear.weight|bias, {head}.{L}.weight
  medusa   "vllm-medusa"  vLLM's MedusaModel: blocks.{i}.layers.{j}.weight|bias,
                          lm_heads.{i}.weight, num_heads, num_hidden_layers,
                          truncated_vocab_size, optional token_map

`LoadedHead.config` is the canonical config.json dict and `LoadedHead.state_dict` holds
the canonical tensor names, so the head modules (specplug.common.heads) never see any
other format. What the canonical form cannot carry (speculators' extra config, vLLM
Medusa's token_map ...) rides along in `LoadedHead.extra`; writing to the source format
puts it back, writing to another format names it in `SaveReport.dropped` (and a WARNING).

Invariants: tensors are never cast, so a conversion between formats that carry the same
tensors is bit-exact; weights are read only with safetensors or
`torch.load(weights_only=True)`; every malformed checkpoint raises `CheckpointError`
(a ValueError) naming the field, what was expected, what was given, the file and the fix,
before any weight is used.
"""

from __future__ import annotations

import copy
import json
import logging
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from . import formats_eagle1

logger = logging.getLogger(__name__)

METHOD_OF_FORMAT = {"eagle3": "eagle3", "speculators": "eagle3", "eagle1": "eagle1",
                    "medusa": "medusa", "vllm-medusa": "medusa"}
FORMATS = tuple(METHOD_OF_FORMAT)
CANONICAL_FORMAT = {"eagle3": "eagle3", "eagle1": "eagle1", "medusa": "medusa"}
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
NUM_AUX_HIDDEN_STATES = 3            # EAGLE-3 fuses low / mid / high target layers
DEFAULT_SPECULATIVE_TOKENS = 3       # speculators_config needs one; used when nothing says
MEDUSA_HEAD_FILE = "medusa_lm_head"  # FasterDecoding's weights file stem
SAFETENSORS_METADATA = {"format": "pt"}
_FIX_FORMATS = f"pass a checkpoint in one of the formats {list(FORMATS)} (see docs/formats.md)"


class CheckpointError(ValueError):
    """A malformed or mismatched checkpoint: names the field, the expected and given
    values, the file, and the fix."""

    def __init__(self, field: str, expected: Any, given: Any, where: str, fix: str):
        self.field, self.expected, self.given, self.where, self.fix = field, expected, given, where, fix
        super().__init__(f"{field}: expected {expected}, given {given} ({where}); fix: {fix}")


@dataclass
class LoadedHead:
    """A head in canonical form. `extra` = {"format": source format, "config": the source
    config.json as read, "tensors": source-only tensors}; `tensor_files` maps canonical
    tensor names to the file they came from (for error messages)."""

    method: str
    format: str
    config: dict
    state_dict: dict[str, torch.Tensor]
    extra: dict = field(default_factory=dict)
    path: str | None = None
    tensor_files: dict[str, str] = field(default_factory=dict)


@dataclass
class SaveReport:
    """What `save_head` wrote, dropped (lost information) and assumed (notes)."""

    format: str
    path: str
    files: list[str]
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------
def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("path", "a checkpoint directory (config.json + weights)", str(path),
                              str(path), "pass the folder that holds the head's config.json")
    return path


def _read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError("config.json", "valid JSON", f"a parse error ({exc})", str(file),
                              "repair or re-export the config.json") from exc
    if not isinstance(config, dict):
        raise CheckpointError("config.json", "a JSON object", type(config).__name__, str(file),
                              "repair or re-export the config.json")
    return config


def _weight_files(path: Path) -> list[Path]:
    """The weight files to read: FasterDecoding's medusa_lm_head.* first, else every
    *.safetensors, else pickled *.bin / *.pt (read with weights_only=True)."""
    for name in (f"{MEDUSA_HEAD_FILE}.safetensors", f"{MEDUSA_HEAD_FILE}.pt"):
        if (path / name).is_file():
            return [path / name]
    files = sorted(path.glob("*.safetensors")) or sorted([*path.glob("*.bin"), *path.glob("*.pt")])
    if not files:
        raise CheckpointError("weights", "*.safetensors, pytorch_model.bin or medusa_lm_head.pt",
                              "no weight file", str(path), "copy the head's weight files next to its config.json")
    return files


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: tensors and plain containers only, never code."""
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError) as exc:
        raise CheckpointError(
            "weights", "a tensors-only file (safetensors, or torch.save of a state dict)",
            f"a pickle that torch.load(weights_only=True) refuses ({str(exc).splitlines()[0][:200]})",
            str(file), "re-save the state dict as safetensors in a trusted environment; "
            "specplug never unpickles arbitrary objects") from exc
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError("weights", "a flat dict of name -> tensor", type(obj).__name__, str(file),
                              "save model.state_dict() (not the model or a training state)")
    return dict(obj)


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(file))
    return _torch_load(file)


def _tensor_names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        else:
            names.extend(_torch_load(file))
    return names


def _read_tensors(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of `files` and each name's file; duplicate names are an error."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        for name, tensor in _read_file(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name}", "one copy", f"copies in {origin[name]} and {file.name}",
                                      str(file.parent), "remove the stale weight file")
            tensors[name], origin[name] = tensor, file.name
    return tensors, origin


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
            h, l, kind = block.groups()
            state[f"{h}.{l}.linear.{kind}"] = tensor
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


def _config_int(config: dict, key: str, where: str, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(key, "a positive int", repr(value), where,
                              f"set {key} in config.json (copy it from the config the head was trained with)")
    return value


def _eagle3_aux_ids(config: dict) -> list[int] | None:
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
    return None if ids is None else list(ids)


def _eagle3_expected(config: dict, where: str) -> tuple[dict, dict]:
    """(required, optional) canonical tensor name -> shape implied by an EAGLE-3 config."""
    if config.get("num_hidden_layers", 1) != 1:
        raise CheckpointError("num_hidden_layers", 1, config["num_hidden_layers"], where,
                              "specplug's EAGLE-3 head has one decoder layer (midlayer); use a 1-layer head")
    h = _config_int(config, "hidden_size", where)
    heads = _config_int(config, "num_attention_heads", where)
    kv = _config_int(config, "num_key_value_heads", where, heads)
    head_dim = _config_int(config, "head_dim", where, h // heads)
    inter = _config_int(config, "intermediate_size", where)
    vocab = _config_int(config, "vocab_size", where)
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
    m = "midlayer."
    required = {
        f"{m}self_attn.q_proj.weight": (heads * head_dim, 2 * h), f"{m}self_attn.k_proj.weight": (kv * head_dim, 2 * h),
        f"{m}self_attn.v_proj.weight": (kv * head_dim, 2 * h), f"{m}self_attn.o_proj.weight": (h, heads * head_dim),
        f"{m}mlp.gate_proj.weight": (inter, h), f"{m}mlp.up_proj.weight": (inter, h),
        f"{m}mlp.down_proj.weight": (h, inter), f"{m}hidden_norm.weight": (h,),
        f"{m}input_layernorm.weight": (h,), f"{m}post_attention_layernorm.weight": (h,),
        "fc.weight": (h, fc_in), "norm.weight": (h,), "lm_head.weight": (draft, h),
    }
    optional = {"embed_tokens.weight": (vocab, h), "t2d": (vocab,), "d2t": (draft,)}
    if draft != vocab:
        required["d2t"] = optional.pop("d2t")
    _eagle3_flagged(config, required, h, heads, kv, head_dim, inter, ht, fc_in)
    return required, optional


def _eagle3_flagged(config, required, h, heads, kv, head_dim, inter, ht, fc_in) -> None:
    """Tensors that config flags switch on (biases, the norm_before_fc / fc_norm variants)."""
    if config.get("attention_bias"):
        for proj, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim), ("o", h)):
            required[f"midlayer.self_attn.{proj}_proj.bias"] = (rows,)
    if config.get("mlp_bias"):
        required.update({"midlayer.mlp.gate_proj.bias": (inter,), "midlayer.mlp.up_proj.bias": (inter,),
                         "midlayer.mlp.down_proj.bias": (h,)})
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
                              "set medusa_num_heads to the number of heads the weights hold, or use the matching weights")
    lm = sorted({int(k.split(".")[1]) for k in state if re.match(r"^\d+\.\d+\.weight$", k)})
    if lm and lm != [layers]:
        raise CheckpointError("medusa_num_layers", f"{layers} residual blocks per head (vocab projection "
                              f"named {{head}}.{layers}.weight)", f"vocab projections at layer index {lm}",
                              where, "set medusa_num_layers to the number of residual blocks the weights hold")


def _where(head: LoadedHead, name: str | None = None) -> str:
    base = head.path or "in-memory head"
    if name is None:
        return f"config.json of {base}"
    return f"{head.tensor_files.get(name, 'weights')} of {base}"


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
                              f"fewer than 4 layers (the default is (2, L//2, L-3))", "none", _where(head),
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


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------
def load_head(path: str | Path, target_config: Any = None) -> LoadedHead:
    """Load the head in directory `path` (any of FORMATS, auto-detected) in canonical form,
    validated (and checked against `target_config` when given) before it is returned."""
    path = _checkpoint_dir(path)
    fmt = detect_format(path)
    config = _read_config(path)
    tensors, origin = _read_tensors(_weight_files(path))
    where = f"config.json of {path}"
    canonical, state, extra_tensors = _parse(fmt, config, tensors, where)
    files = {name: origin.get(name, next(iter(origin.values()), "weights")) for name in state}
    head = LoadedHead(method=METHOD_OF_FORMAT[fmt], format=fmt, config=canonical, state_dict=state,
                      extra={"format": fmt, "config": config, "tensors": extra_tensors},
                      path=str(path), tensor_files=files)
    _mark_truncated(head)
    validate(head, target_config)
    logger.info("loaded %s head from %s (%s format, %d tensors)", head.method, path, fmt, len(state))
    return head


def _mark_truncated(head: LoadedHead) -> None:
    """vLLM Medusa heads whose lm_heads hold only truncated_vocab_size rows (token_map):
    records the row count in extra["truncated_rows"]."""
    token_map = head.extra["tensors"].get("token_map")
    lm = head.state_dict.get(f"0.{head.config.get('medusa_num_layers')}.weight")
    if token_map is not None and lm is not None and lm.shape[0] == token_map.shape[0] != head.config["vocab_size"]:
        head.extra["truncated_rows"] = int(token_map.shape[0])


# ---------------------------------------------------------------------------------------
# Canonical -> format
# ---------------------------------------------------------------------------------------
def _source(head: LoadedHead, fmt: str) -> dict | None:
    """The source config.json when `head` was read from `fmt` (to write it back as it was)."""
    extra = head.extra or {}
    return copy.deepcopy(extra.get("config")) if extra.get("format") == fmt else None


def _dropped_source_keys(head: LoadedHead, carried: set[str]) -> list[str]:
    """Top-level source config keys (of another format) that the destination cannot carry."""
    extra = head.extra or {}
    if extra.get("format") in (None, "eagle3", "medusa"):
        return []
    cfg = extra.get("config") or {}
    return [_describe(k, cfg[k]) for k in cfg if k not in carried]


def _describe(key: str, value: Any) -> str:
    if key == "speculators_config" and isinstance(value, dict):
        verifier = (value.get("verifier") or {}).get("name_or_path")
        tokens = [m.get("speculative_tokens") for m in value.get("proposal_methods") or []]
        return f"speculators_config (verifier name_or_path={verifier!r}, speculative_tokens={tokens})"
    return f"{key}={json.dumps(value)[:80]}"


def _norm_before_residual(config: dict) -> bool:
    """Top-level key (what vLLM reads) or eagle_config's (what specplug's heads write)."""
    eagle = config.get("eagle_config") or {}
    return bool(config.get("norm_before_residual", eagle.get("norm_before_residual", False)))


def _vllm_loadable_vocab_maps(config: dict, state: dict, report: SaveReport) -> dict:
    """Drop identity d2t/t2d when the draft vocabulary IS the target's: vLLM builds no
    draft_id_to_target_id parameter for such heads and refuses a checkpoint carrying one."""
    d2t = state.get("d2t")
    if d2t is None or config.get("draft_vocab_size", config.get("vocab_size")) != config.get("vocab_size"):
        return state
    if bool((d2t == 0).all()):
        report.notes.append("d2t/t2d not written: the draft vocabulary is the target's (identity map), "
                            "and vLLM refuses these tensors for such heads")
        return {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    report.notes.append("d2t is not the identity although draft_vocab_size == vocab_size: vLLM will refuse "
                        "this head (it has no draft_id_to_target_id parameter for a full draft vocabulary)")
    return state


def _to_eagle3(head: LoadedHead, report: SaveReport, target: Any) -> tuple[dict, dict]:
    config = copy.deepcopy(head.config)
    if _norm_before_residual(config):
        config["norm_before_residual"] = True  # vLLM reads only the top-level key
        report.notes.append("norm_before_residual=true: vLLM honours it; SGLang 0.5.23's eagle3 has no such "
                            "option and would run this head with the norm after the residual")
    if head.extra.get("format") == "speculators":
        report.dropped += _dropped_source_keys(head, _SPECULATORS_IDENTITY | {
            "speculators_version", "transformers_version", "auto_map", "has_no_defaults_at_init"})
    return config, _vllm_loadable_vocab_maps(config, dict(head.state_dict), report)


def _speculative_tokens(config: dict) -> int | None:
    tree = (config.get("specplug") or {}).get("tree") or {}
    return tree.get("depth")


def _speculators_skeleton(head: LoadedHead, report: SaveReport, target: Any) -> dict:
    tokens = _speculative_tokens(head.config)
    if tokens is None:
        tokens = DEFAULT_SPECULATIVE_TOKENS
        report.notes.append(f"speculators_config.proposal_methods[0].speculative_tokens set to the default "
                            f"{tokens} (no specplug.tree.depth in the head's config)")
    verifier = {"name_or_path": None, "architectures": []}
    if isinstance(target, (str, Path)):
        verifier = {"name_or_path": str(target), "architectures": _read_config(Path(target)).get("architectures", [])}
    else:
        report.notes.append("speculators_config.verifier.name_or_path is null: pass --target MODEL_DIR to record "
                            "the verifier")
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens,
                                                         "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                   "verifier": verifier}}


def _to_speculators(head: LoadedHead, report: SaveReport, target: Any) -> tuple[dict, dict]:
    canonical = head.config
    out = _source(head, "speculators") or _speculators_skeleton(head, report, target)
    layer = {k: copy.deepcopy(v) for k, v in canonical.items()
             if k not in (*_SPECULATORS_EAGLE_KEYS, "architectures", "eagle_config", "specplug")}
    layer.setdefault("model_type", "llama")
    source_layer = out.get("transformer_layer_config") or {}
    if "architectures" in source_layer:
        layer["architectures"] = source_layer["architectures"]
    out["transformer_layer_config"] = layer
    for key in _SPECULATORS_EAGLE_KEYS:
        if canonical.get(key) is not None:
            out[key] = canonical[key]
    out["norm_before_residual"] = _norm_before_residual(canonical)  # explicit: vLLM's default here is True
    ids = _eagle3_aux_ids(canonical)
    if ids is not None:
        out["eagle_aux_hidden_state_layer_ids"] = ids
    if "specplug" in canonical:
        out["specplug"] = copy.deepcopy(canonical["specplug"])
    report.dropped += _eagle_config_dropped(canonical)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in _vllm_loadable_vocab_maps(canonical, head.state_dict, report).items()}
    return out, state


def _eagle_config_dropped(canonical: dict) -> list[str]:
    eagle = canonical.get("eagle_config") or {}
    known = {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc"}
    dropped = [f"eagle_config.{k}={json.dumps(v)}" for k, v in eagle.items() if k not in known]
    if eagle.get("use_aux_hidden_state") is False:
        dropped.append("eagle_config.use_aux_hidden_state=false (speculators heads always use aux states)")
    return dropped


def _truncated_error(head: LoadedHead, where_to: str) -> CheckpointError:
    rows = head.extra["truncated_rows"]
    return CheckpointError(
        "lm_heads rows", f"vocab_size {head.config['vocab_size']} ({where_to} scores the whole vocabulary)",
        f"truncated_vocab_size {rows} rows + token_map", _where(head),
        "keep this head in vllm-medusa format (no FasterDecoding tensor can express a truncated "
        "vocabulary), or train a full-vocabulary head")


def _to_medusa(head: LoadedHead, report: SaveReport, target: Any) -> tuple[dict, dict]:
    if (head.extra or {}).get("truncated_rows"):
        raise _truncated_error(head, "a FasterDecoding Medusa head")
    if head.extra.get("format") == "vllm-medusa":
        source = head.extra["config"]
        report.dropped += [_describe(k, source[k]) for k in ("max_paths", "topk") if k in source]
        if "token_map" in head.extra.get("tensors", {}):
            report.dropped.append(f"token_map + truncated_vocab_size={source.get('truncated_vocab_size')} "
                                  f"(draft-vocab truncation): the heads keep all {head.config['vocab_size']} "
                                  "rows, so drafting scores every token")
    config = copy.deepcopy(head.config)
    # Harmless to FasterDecoding; without it vLLM builds bias-free blocks and silently skips the biases.
    config["medusa_fc_bias"] = True
    return config, dict(head.state_dict)


def _to_vllm_medusa(head: LoadedHead, report: SaveReport, target: Any) -> tuple[dict, dict]:
    cfg = head.config
    layers = cfg["medusa_num_layers"]
    source = _source(head, "vllm-medusa")
    out = source or {"architectures": ["MedusaModel"], "model_type": "medusa"}
    for key, value in cfg.items():
        if key in ("medusa_num_heads", "medusa_num_layers"):
            continue
        if key in ("architectures", "model_type", "medusa_fc_bias"):
            continue  # the format's identity (MedusaModel / medusa) and a flag set below
        if _renamed_by_vllm(key) or key in _VLLM_MEDUSA_KEYS:
            report.dropped.append(f"{_describe(key, value)} (vLLM's MedusaConfig reads this name as its "
                                  "own setting or as the Medusa head/layer count)")
            continue
        out[key] = copy.deepcopy(value)
    out.update(num_heads=cfg["medusa_num_heads"], num_hidden_layers=layers)
    out.setdefault("truncated_vocab_size", cfg["vocab_size"])
    keep_bias = not (source is not None and not source.get("medusa_fc_bias", False) and _biases_zero(head))
    if keep_bias:
        out["medusa_fc_bias"] = True
    state = _vllm_medusa_state(head.state_dict, layers, keep_bias)
    if source is not None:
        state.update(head.extra.get("tensors", {}))
    return out, state


def _biases_zero(head: LoadedHead) -> bool:
    return all(not t.any() for k, t in head.state_dict.items() if k.endswith(".linear.bias"))


def _vllm_medusa_state(state: dict, layers: int, keep_bias: bool) -> dict:
    out = {}
    for name, tensor in state.items():
        h, l, *rest = name.split(".")
        if rest[0] == "linear":
            if rest[1] == "weight" or keep_bias:
                out[f"blocks.{h}.layers.{l}.{rest[1]}"] = tensor
        else:
            out[f"lm_heads.{h}.weight"] = tensor
    return out


def _to_eagle1(head: LoadedHead, report: SaveReport, target: Any) -> tuple[dict, dict]:
    """EAGLE-1 -> EAGLE-1 (e.g. pytorch_model.bin -> model.safetensors): nothing changes."""
    return copy.deepcopy(head.config), dict(head.state_dict)


_WRITERS = {"eagle3": _to_eagle3, "speculators": _to_speculators, "eagle1": _to_eagle1,
            "medusa": _to_medusa, "vllm-medusa": _to_vllm_medusa}
_WEIGHT_FILE = {"eagle3": "model.safetensors", "speculators": "model.safetensors", "eagle1": "model.safetensors",
                "medusa": f"{MEDUSA_HEAD_FILE}.safetensors", "vllm-medusa": "model.safetensors"}


def _as_loaded(obj: Any) -> LoadedHead:
    """A LoadedHead from a LoadedHead, a (config, state_dict) pair, or a head module with
    `.config` (a dict or an object with to_dict()) and state_dict()."""
    if isinstance(obj, LoadedHead):
        return obj
    if isinstance(obj, tuple) and len(obj) == 2:
        config, state = obj
    elif hasattr(obj, "state_dict") and hasattr(obj, "config"):
        config, state = obj.config, obj.state_dict()
    else:
        raise TypeError(f"save_head needs a LoadedHead, a (config, state_dict) pair or a head module, "
                        f"got {type(obj).__name__}: load it with load_head first")
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    state = {k: v.detach() for k, v in state.items()}
    method = ("medusa" if "medusa_num_heads" in config
              else "eagle1" if formats_eagle1.is_eagle1(list(state), config) else "eagle3")
    return LoadedHead(method=method, format=CANONICAL_FORMAT[method], config=config, state_dict=state)


def _check_destination(path: Path, overwrite: bool, source: str | None) -> None:
    if source is not None and path.resolve() == Path(source).resolve():
        raise CheckpointError("destination", "a folder other than the source", str(path), str(path),
                              "write the converted head to a new folder")
    taken = [p.name for p in path.glob("*") if p.suffix in (".json", ".safetensors", ".bin", ".pt")] \
        if path.is_dir() else []
    if taken and not overwrite:
        raise CheckpointError("destination", "an empty or new folder", f"a folder holding {sorted(taken)}",
                              str(path), "choose a new folder, or pass overwrite=True (--overwrite)")


def save_head(head_or_parts: Any, path: str | Path, format: str, *, target_config: Any = None,
              overwrite: bool = False) -> SaveReport:
    """Write a head in `format` to directory `path` (config.json + one safetensors file).

    `head_or_parts`: a LoadedHead, (canonical config, canonical state_dict), or a head
    module. The head is validated first. Information the format cannot carry is listed
    in the returned report's `dropped` (and logged as WARNING); assumptions in `notes`.
    `target_config` (a model directory) fills speculators' verifier fields."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}: pick the engine's format")
    head = _as_loaded(head_or_parts)
    if METHOD_OF_FORMAT[format] != head.method:
        raise ValueError(f"format {format!r} holds {METHOD_OF_FORMAT[format]} heads, the head is "
                         f"{head.method}: choose one of {[f for f, m in METHOD_OF_FORMAT.items() if m == head.method]}")
    validate(head, None)
    path = Path(path)
    _check_destination(path, overwrite, head.path)
    report = SaveReport(format=format, path=str(path), files=["config.json", _WEIGHT_FILE[format]])
    config, state = _WRITERS[format](head, report, target_config)
    _write(path, config, state, _WEIGHT_FILE[format], overwrite)
    for line in report.dropped:
        logger.warning("%s format cannot carry %s: dropped", format, line)
    for line in report.notes:
        logger.warning("%s", line)
    return report


def _write(path: Path, config: dict, state: dict, weight_file: str, overwrite: bool) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    if overwrite:
        for stale in [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.pt")]:
            stale.unlink()
    tensors = {k: v.contiguous() for k, v in _unshare_storage(state).items()}
    save_file(tensors, str(path / weight_file), metadata=SAFETENSORS_METADATA)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def convert(src: str | Path, dst: str | Path, to: str, *, target_config: Any = None,
            overwrite: bool = False) -> dict:
    """Convert the head in `src` to format `to` in `dst` (validated against
    `target_config` when given). Returns a JSON-ready summary."""
    head = load_head(src, target_config)
    report = save_head(head, dst, to, target_config=target_config, overwrite=overwrite)
    return {"source": str(src), "source_format": head.format, "destination": str(dst), "format": to,
            "method": head.method, "tensors": len(head.state_dict), "files": report.files,
            "dropped": report.dropped, "notes": report.notes}


# ---------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------
def load_head_module(path: str | Path, target_config: Any = None, *, device: Any = "cpu",
                     dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Load, validate and build the head's torch module (Eagle3Head, Eagle1Head or
    MedusaHeads) on `device`, cast to `dtype` when given (the checkpoint's dtype
    otherwise). An Eagle1Head still needs `set_target(target_model)` (its lm_head)."""
    head = load_head(path, target_config)
    if head.method == "eagle1":
        module = formats_eagle1.build_module(head)
    elif head.method == "eagle3":
        from specplug.common.heads.eagle3 import Eagle3Config, Eagle3Head
        module = Eagle3Head.from_state_dict(Eagle3Config.from_dict(head.config), head.state_dict)
    else:
        if head.extra.get("truncated_rows"):
            raise _truncated_error(head, "specplug's MedusaHeads")
        from specplug.common.heads.medusa import MedusaConfig, MedusaHeads
        module = MedusaHeads.from_state_dict(MedusaConfig.from_dict(head.config), head.state_dict)
    return module.to(device=device, dtype=dtype) if dtype is not None else module.to(device)
