"""Medusa heads (Cai et al. 2024) as a torch module, with FasterDecoding's tensor names.

Head k (0-based) reads the target's last hidden state h_t (after the final norm) and
predicts the token at t + k + 2: h -> ResBlock^num_layers -> Linear(H -> V, no bias),
ResBlock(x) = x + SiLU(Linear(x)). The target's own lm_head predicts t + 1.

The Medusa repo builds its blocks as `[ResBlock(H)] * num_layers`, which shares ONE
block across all layers of a head. specplug gives each layer its own weights; a
checkpoint written by the buggy code simply holds equal tensors under every layer
name and loads as such (or, deduplicated by safetensors, with only layer 0 present:
pass `fill_shared_layers=True`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .eagle3 import check_state_dict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MedusaConfig:
    """A Medusa head set in FasterDecoding's config.json format. `hidden_size` and
    `vocab_size` may be None in old checkpoints (then taken from the weights).
    `specplug` is the optional specplug section (tree, verification, head_accuracies);
    `extra` keeps every other key so a round trip loses nothing."""

    medusa_num_heads: int
    medusa_num_layers: int = 1
    hidden_size: int | None = None
    vocab_size: int | None = None
    base_model_name_or_path: str | None = None
    specplug: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.medusa_num_heads < 1 or self.medusa_num_layers < 0:
            raise ValueError(
                f"medusa_num_heads must be >= 1 and medusa_num_layers >= 0, got "
                f"{self.medusa_num_heads} and {self.medusa_num_layers}: fix the head's config.json"
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "MedusaConfig":
        if "medusa_num_heads" not in config:
            raise ValueError(
                f"config.json has no medusa_num_heads (keys: {sorted(config)}): not a FasterDecoding "
                "Medusa config; convert it with `specplug convert`"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            medusa_num_heads=int(config["medusa_num_heads"]),
            medusa_num_layers=int(config.get("medusa_num_layers", 1)),
            hidden_size=config.get("hidden_size"),
            vocab_size=config.get("vocab_size"),
            base_model_name_or_path=config.get("base_model_name_or_path"),
            specplug=config.get("specplug"),
            extra={k: v for k, v in config.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update(medusa_num_heads=self.medusa_num_heads, medusa_num_layers=self.medusa_num_layers,
                   hidden_size=self.hidden_size, vocab_size=self.vocab_size,
                   base_model_name_or_path=self.base_model_name_or_path)
        if self.specplug is not None:
            out["specplug"] = self.specplug
        return out


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)); state_dict key `linear.weight|bias`."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """K Medusa heads; a ModuleList of per-head Sequentials, so the state_dict keys are
    FasterDecoding's with no prefix: `{k}.{j}.linear.weight|bias` (residual block j of
    head k) and `{k}.{num_layers}.weight` (head k's vocab projection [V, H])."""

    def __init__(self, config: MedusaConfig):
        super().__init__()
        if config.hidden_size is None or config.vocab_size is None:
            raise ValueError("MedusaConfig needs hidden_size and vocab_size to build heads "
                             "(use MedusaHeads.from_state_dict to infer them from weights)")
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.extend(
            nn.Sequential(*[ResBlock(h) for _ in range(config.medusa_num_layers)], nn.Linear(h, v, bias=False))
            for _ in range(config.medusa_num_heads)
        )

    @property
    def num_heads(self) -> int:
        return self.config.medusa_num_heads

    @classmethod
    def from_state_dict(cls, config: MedusaConfig, state_dict: Mapping[str, torch.Tensor], *,
                        fill_shared_layers: bool = False) -> "MedusaHeads":
        """Build heads from FasterDecoding-named tensors with strict key checking.
        Missing hidden_size / vocab_size are read from head 0's vocab projection.
        `fill_shared_layers`: copy layer 0's residual block into missing layers 1..n-1
        (checkpoints of the `[ResBlock]*n` bug saved with duplicates removed)."""
        given = dict(state_dict)
        proj = given.get(f"0.{config.medusa_num_layers}.weight")
        if proj is not None and (config.hidden_size is None or config.vocab_size is None):
            config = dataclasses.replace(config, vocab_size=config.vocab_size or proj.shape[0],
                                         hidden_size=config.hidden_size or proj.shape[1])
        if fill_shared_layers:
            given = _fill_shared_layers(given, config)
        heads = cls(config)
        check_state_dict(heads.state_dict(), given, "Medusa heads")
        heads.to(next(iter(given.values())).dtype)
        heads.load_state_dict(given, strict=True)
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] (target's last hidden state, after its final norm) ->
        logits [K, B, T, V]; head k predicts the token k + 2 positions ahead."""
        hidden = hidden.to(self[0][-1].weight)  # the heads' dtype and device
        return torch.stack([head(hidden) for head in self])


def _fill_shared_layers(given: dict, config: MedusaConfig) -> dict:
    out = dict(given)
    for k in range(config.medusa_num_heads):
        for j in range(1, config.medusa_num_layers):
            for p in ("weight", "bias"):
                src, dst = f"{k}.0.linear.{p}", f"{k}.{j}.linear.{p}"
                if dst not in out and src in out:
                    out[dst] = out[src]
                    logger.info("Medusa head %d layer %d: filled from shared layer 0 (%s)", k, j, p)
    return out


def medusa_head_count(head_dir) -> int:
    """The number of heads in HEAD_DIR/config.json: FasterDecoding's "medusa_num_heads"
    (MedusaConfig's key, what specplug writes), else vLLM's "num_heads" (a checkpoint in
    vLLM's Medusa format). ValueError when neither is an int >= 1."""
    config_file = Path(head_dir) / "config.json"
    config = json.loads(config_file.read_text())
    heads = config.get("medusa_num_heads", config.get("num_heads"))
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"medusa_num_heads in {config_file} must be an int >= 1, got {heads!r}: this is not a "
                         "Medusa head checkpoint; train heads with `specplug train` or convert them with "
                         "`specplug convert`")
    return heads


def faster_decoding_config(head_dir) -> dict | None:
    """HEAD_DIR/config.json when it is a FasterDecoding Medusa config ("medusa_num_heads",
    no "model_type": transformers' AutoConfig refuses it), else None."""
    config_file = Path(str(head_dir)) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    return config if "medusa_num_heads" in config and "model_type" not in config else None
