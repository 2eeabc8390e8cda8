"""The checkpoint formats' shared names: the formats, CheckpointError, LoadedHead, SaveReport."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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


def _config_int(config: dict, key: str, where: str, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(key, "a positive int", repr(value), where,
                              f"set {key} in config.json (copy it from the config the head was trained with)")
    return value


def _layer_dims(config: dict, where: str) -> tuple[int, int, int, int, int, int]:
    """(hidden_size, attention heads, KV heads, head_dim, intermediate_size, vocab_size) of
    a head's decoder layer, read from its config.json (KV heads default to the attention
    heads, head_dim to hidden_size / heads)."""
    h = _config_int(config, "hidden_size", where)
    heads = _config_int(config, "num_attention_heads", where)
    kv = _config_int(config, "num_key_value_heads", where, heads)
    head_dim = _config_int(config, "head_dim", where, h // heads)
    return (h, heads, kv, head_dim, _config_int(config, "intermediate_size", where),
            _config_int(config, "vocab_size", where))


def _where(head: LoadedHead, name: str | None = None) -> str:
    base = head.path or "in-memory head"
    if name is None:
        return f"config.json of {base}"
    return f"{head.tensor_files.get(name, 'weights')} of {base}"
