"""Reading a head folder: config.json and weight files (safetensors, or torch.load with weights_only=True)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Mapping

import torch

from .base import CheckpointError, MEDUSA_HEAD_FILE

# A shapes-only read (weights=False) still reads these in full: validation checks their values.
VOCAB_MAPS = ("d2t", "t2d", "token_map")
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}

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


def _read_file(file: Path, weights: bool = True) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        if not weights:
            return read_header(file)
        from safetensors.torch import load_file
        return load_file(str(file))
    return _torch_load(file)


def read_header(file: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors from its header alone: shape-only tensors on the meta
    device (name, shape, dtype; no weight is read), except VOCAB_MAPS and tensors of a
    dtype not listed here, which are read in full."""
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            part = f.get_slice(name)
            dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
            if name in VOCAB_MAPS or dtype is None:
                tensors[name] = f.get_tensor(name)
            else:
                tensors[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    return tensors


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


def _read_tensors(files: list[Path], weights: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of `files` and each name's file; duplicate names are an error.
    weights=False: safetensors files' tensors as shape-only meta tensors (read_header)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        for name, tensor in _read_file(file, weights).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name}", "one copy", f"copies in {origin[name]} and {file.name}",
                                      str(file.parent), "remove the stale weight file")
            tensors[name], origin[name] = tensor, file.name
    return tensors, origin
