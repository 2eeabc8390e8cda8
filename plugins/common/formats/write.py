"""Loading (validated), canonical -> each format, saving, converting, and building the head module."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch

from . import eagle1 as formats_eagle1
from .base import (
    CANONICAL_FORMAT, CheckpointError, DEFAULT_SPECULATIVE_TOKENS, FORMATS, LoadedHead, MEDUSA_HEAD_FILE,
    METHOD_OF_FORMAT, SAFETENSORS_METADATA, SaveReport,
)
from .files import _checkpoint_dir, _read_config, _read_tensors, _weight_files
from .parse import (
    _parse, _renamed_by_vllm, _SPECULATORS_EAGLE_KEYS, _SPECULATORS_IDENTITY, _unshare_storage,
    _VLLM_MEDUSA_KEYS, detect_format,
)
from .checks import _eagle3_aux_ids, _where, validate
from .shards import pad_draft_vocab

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------
def load_head(path: str | Path, target_config: Any = None, *, weights: bool = True) -> LoadedHead:
    """Load the head in directory `path` (any of FORMATS, auto-detected) in canonical form,
    validated (and checked against `target_config` when given) before it is returned.

    weights=False is a dry run (`specplug doctor`): safetensors files are read from their
    headers only, as shape-only tensors on the meta device (the vocab maps d2t / t2d /
    token_map in full), and validated the same way; such a head cannot run or be saved."""
    path = _checkpoint_dir(path)
    fmt = detect_format(path)
    config = _read_config(path)
    tensors, origin = _read_tensors(_weight_files(path), weights)
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
        h, layer, *rest = name.split(".")
        if rest[0] == "linear":
            if rest[1] == "weight" or keep_bias:
                out[f"blocks.{h}.layers.{layer}.{rest[1]}"] = tensor
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
            overwrite: bool = False, tensor_parallel_size: int = 1) -> dict:
    """Convert the head in `src` to format `to` in `dst` (validated against
    `target_config` when given), its draft vocabulary padded so that `tensor_parallel_size`
    ranks can shard it (formats.shards). Returns a JSON-ready summary."""
    head = load_head(src, target_config)
    head, padding = pad_draft_vocab(head, tensor_parallel_size)
    report = save_head(head, dst, to, target_config=target_config, overwrite=overwrite)
    report.notes[:0] = padding
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
