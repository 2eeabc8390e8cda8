"""Reads the specplug section of an EAGLE-3 head's config.json into adapter settings, and
checks the head against the target it is asked to draft for.

A head is "ours" when its config.json has a `specplug` section with method "eagle3";
without it vLLM's built-in EAGLE-3 path runs untouched. Tree settings come from the
section's `tree` dict; the environment variable SPECPLUG_TREE (a JSON object, e.g.
'{"topk": 2}') overrides single keys without editing the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

ENV_TREE_OVERRIDE = "SPECPLUG_TREE"
STAGES = ("chain",)


@dataclass(frozen=True)
class AdapterSettings:
    """How the specplug proposer drafts inside vLLM.

    topk: children expanded per frontier node and frontier width per depth (EAGLE-2).
    depth: draft depth; None means vLLM's num_speculative_tokens (stage "chain" must
      hand vLLM exactly that many tokens, so any other value is an error there).
    budget: nodes kept after reranking (stage B; recorded for stage A).
    stage: "chain" = stage A: the best root-to-leaf path is verified by vLLM's own
      rejection sampler (exact, lossless at any temperature).
    """

    topk: int = 4
    depth: int | None = None
    budget: int = 16
    verification: str = "lossless"
    stage: str = "chain"

    def __post_init__(self):
        for name in ("topk", "budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"specplug tree setting {name} must be an int >= 1, got {value!r}")
        if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 1):
            raise ValueError(f"specplug tree setting depth must be an int >= 1 or null, got {self.depth!r}")
        if self.verification != "lossless":
            raise ValueError(
                f"specplug verification {self.verification!r} is not supported by the vLLM adapter: "
                "it verifies losslessly only; set \"verification\": \"lossless\" in the head's config.json"
            )
        if self.stage not in STAGES:
            raise ValueError(f"specplug stage must be one of {STAGES}, got {self.stage!r}")


def specplug_section(hf_config: Any) -> dict | None:
    """The head config's specplug section if it marks an EAGLE-3 specplug head, else None."""
    section = getattr(hf_config, "specplug", None)
    if section is None and isinstance(hf_config, Mapping):
        section = hf_config.get("specplug")
    if not section:
        return None
    if not isinstance(section, Mapping):
        raise TypeError(f"config.json 'specplug' must be an object, got {type(section).__name__}")
    if section.get("method", "eagle3") != "eagle3":
        raise ValueError(
            f"the head's specplug section says method {section.get('method')!r}, but vLLM was asked "
            "for method 'eagle3': pass an EAGLE-3 head"
        )
    return dict(section)


def adapter_settings(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> AdapterSettings:
    """AdapterSettings from a specplug section, with SPECPLUG_TREE overrides applied."""
    values = dict(section.get("tree") or {})
    override = environ.get(ENV_TREE_OVERRIDE)
    if override:
        try:
            values.update(json.loads(override))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_TREE_OVERRIDE} must be a JSON object, got {override!r}: {exc}") from exc
    for key in ("verification", "stage"):
        if key in section and key not in values:
            values[key] = section[key]
    known = {f.name for f in dataclasses.fields(AdapterSettings)}
    return AdapterSettings(**{k: v for k, v in values.items() if k in known})


def check_head_matches_target(head_config: Any, target_config: Any, num_target_layers: int,
                              head_dir: str) -> None:
    """Raise ValueError naming the first field where the head cannot draft for the target."""
    eagle = getattr(head_config, "eagle_config", None) or {}
    checks = [
        ("target_hidden_size", getattr(head_config, "target_hidden_size", None) or head_config.hidden_size,
         "hidden_size", target_config.hidden_size),
        ("vocab_size", head_config.vocab_size, "vocab_size", target_config.vocab_size),
    ]
    for head_field, head_value, target_field, target_value in checks:
        if head_value != target_value:
            raise ValueError(
                f"head {head_field} {head_value} does not match target {target_field} {target_value} "
                f"(config.json of {head_dir}): train or convert a head for this target"
            )
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is not None:
        ids = [int(i) for i in layer_ids]
        if any(not 0 <= i < num_target_layers for i in ids) or ids != sorted(set(ids)):
            # vLLM captures aux layers as sorted(set(ids)) and concatenates them in that order.
            raise ValueError(
                f"head eagle_aux_hidden_state_layer_ids {ids} must be distinct ascending ids in "
                f"[0, {num_target_layers}) for this {num_target_layers}-layer target "
                f"(config.json of {head_dir}): train or convert a head for this target"
            )
