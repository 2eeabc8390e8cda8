"""Medusa heads with a specplug section in vLLM (method "medusa"), without importing vLLM:
their settings (specplug.common.head_section's, refused where vLLM's Medusa path lacks a
feature), their tree's size, and the drafter on vLLM's loaded heads. `specplug doctor`
reads them too.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from specplug.common.drafters import MedusaDrafter
from specplug.common.head_section import HeadSettings, read_section, refuse_unsupported
from specplug.common.heads.medusa import medusa_head_count
from specplug.vllm_eagle3.settings import adapter_settings


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
                    environ: Mapping[str, str] = os.environ) -> HeadSettings:
    """HeadSettings of a Medusa head's section (its tree within `num_heads` heads when
    given); ValueError for what Medusa heads in vLLM do not offer (adaptive, the gate,
    hybrid drafting, sampled drafts), naming the key to drop."""
    settings = adapter_settings(section, environ, method="medusa", num_heads=num_heads)
    refuse_unsupported(settings, "Medusa heads in vLLM", ("adaptive", "gate", "drafter", "draft_temperature"),
                       "serve the heads in SGLang (--speculative-algorithm MEDUSA)")
    return settings


def medusa_drafter(settings: HeadSettings, num_heads: int) -> MedusaDrafter:
    """The core's drafter for the heads' settings (its tree's shape and head_accuracies),
    its heads to be bound to vLLM's module."""
    return MedusaDrafter(LoadedMedusaHeads(num_heads), choices=settings.medusa.choices,
                         head_accuracies=settings.medusa.head_accuracies)


def tree_nodes(head_dir: str) -> int:
    """The Medusa tree's non-root nodes for this head's section (HeadSettings.medusa_nodes):
    vLLM's num_speculative_tokens in stage "tree"."""
    return medusa_settings(read_section(head_dir), medusa_head_count(head_dir)).medusa_nodes - 1
