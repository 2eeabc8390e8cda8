"""Medusa heads with a specplug section in vLLM (method "medusa"), without importing vLLM:
their settings, their tree's size, and the drafter on vLLM's loaded heads.

medusa_proposer.py runs them; `specplug doctor` reads them to say what vLLM would do with
a head. Refused by name: what Medusa heads in vLLM do not offer (adaptive speculation,
hybrid drafting, sampled drafts). The section itself (its tree, its shape: "choices" or
SPECPLUG_MEDUSA_TREE, its head_accuracies) is specplug.common.head_section's, as in SGLang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import torch

from specplug.common.drafters import MedusaDrafter
from specplug.common.head_section import read_section
from specplug.vllm_eagle3.settings import AdapterSettings, adapter_settings


class LoadedMedusaHeads:
    """The core's Medusa heads seam on vLLM's loaded `Medusa` model: hidden [B, 1, H] ->
    logits [K, B, 1, V] (what specplug.common.heads.medusa.MedusaHeads returns)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self.model = None  # vLLM's Medusa module, bound by the proposer's load_model

    def eval(self) -> "LoadedMedusaHeads":
        return self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden[:, 0]  # [B, H]
        return torch.stack(self.model.compute_logits(self.model(flat)))[:, :, None]  # [K, B, 1, V]


def medusa_settings(section: dict, num_heads: int | None = None,
                    environ: Mapping[str, str] = os.environ) -> AdapterSettings:
    """AdapterSettings of a Medusa head's section (its tree within `num_heads` heads when
    given); ValueError for what Medusa heads in vLLM do not offer (adaptive, hybrid
    drafting, sampled drafts), naming the key to drop."""
    settings = adapter_settings(section, environ, method="medusa", num_heads=num_heads)
    unsupported = {"adaptive": settings.adaptive, "drafter / retrieval": settings.drafter is not None,
                   "draft_temperature": settings.draft_temperature is not None}
    for key, on in unsupported.items():
        if on:
            raise ValueError(f"specplug Medusa heads in vLLM do not support {key!r} (stages \"chain\" and "
                             f"\"tree\" only): drop it from the head's specplug section (or its SPECPLUG_* "
                             "variable), or serve the heads in SGLang (--speculative-algorithm MEDUSA)")
    return settings


def heads_in_checkpoint(head_dir: str) -> int:
    """The number of heads the checkpoint holds (vLLM sets the config's num_heads to
    num_speculative_tokens, which for a tree is its node count)."""
    config = json.loads((Path(head_dir) / "config.json").read_text())
    return int(config.get("num_heads", config.get("medusa_num_heads", 0)))


def medusa_drafter(section: dict, num_heads: int) -> MedusaDrafter:
    """The core's drafter for a head's section (its tree's shape and head_accuracies), its
    heads to be bound to vLLM's module."""
    medusa = medusa_settings(section, num_heads).medusa
    return MedusaDrafter(LoadedMedusaHeads(num_heads), choices=medusa.choices, head_accuracies=medusa.head_accuracies)


def tree_nodes(head_dir: str) -> int:
    """The Medusa tree's non-root nodes for this head's section: vLLM's
    num_speculative_tokens in stage "tree"."""
    section, num_heads = read_section(head_dir), heads_in_checkpoint(head_dir)
    drafter = medusa_drafter(section, num_heads)
    return drafter.template(medusa_settings(section, num_heads).tree).num_nodes - 1
