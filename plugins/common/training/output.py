"""A run's output folder: its layout, the checkpoint's reader, and the `specplug` section of
the config of a head written into it.

Layout of an output folder:
  OUT/config.json + weights     the head in its method's default (or --format) format
  OUT/training.json             settings, losses, accuracies, tokens/s per epoch
  OUT/checkpoint/               training state: head.safetensors (fp32 trainable
                                tensors + fixed buffers), optimizer.pt, rng.pt, state.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CHECKPOINT = "checkpoint"


def read_checkpoint_state(ckpt: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(state.json, head tensors, head_config.json) of a checkpoint folder."""
    from safetensors.torch import load_file

    state = json.loads((ckpt / "state.json").read_text())
    return state, load_file(str(ckpt / "head.safetensors")), json.loads((ckpt / "head_config.json").read_text())


def specplug_section(method: str, **extra: Any) -> dict:
    """The `specplug` config section of a head made here (tree defaults from TreeConfig)."""
    from specplug.common.tree import TreeConfig

    section = {"version": 1, "method": method, "tree": TreeConfig().to_dict(), "verification": "lossless"}
    section.update(extra)
    return section
