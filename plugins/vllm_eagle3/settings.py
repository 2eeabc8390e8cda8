"""Reads the specplug section of an EAGLE head's config.json into adapter settings, and
checks the head against the target it is asked to draft for.

A head is "ours" when its config.json has a `specplug` section: method "eagle3" for
vLLM's method "eagle3", "eagle1" for vLLM's method "eagle" (EAGLE-1 heads); without it
vLLM's built-in EAGLE path runs untouched. Tree settings come from the
section's `tree` dict; the environment variable SPECPLUG_TREE (a JSON object, e.g.
'{"topk": 2}') overrides single keys without editing the checkpoint. Adaptive
speculation (adaptive.py) is off unless the section says `"adaptive": true`; the
environment variable SPECPLUG_ADAPTIVE ("1"/"true" or "0"/"false") overrides it. The
verification stage comes from the section's `"stage"` ("chain" when absent); the
environment variable SPECPLUG_STAGE ("chain" or "tree") overrides it. Hybrid drafting
(head + a token drafter's candidates merged into one tree) is on when the section has
`"retrieval": true` or an object of specplug.common.retrieval.RetrievalConfig fields
(plus an optional "datastore" path), SPECPLUG_RETRIEVAL ("0"/"1" or such a JSON
object) overriding it, or `"drafter": NAME` / `{"name": NAME, fields}` for any
registered token drafter, SPECPLUG_DRAFTER overriding both
(specplug.common.token_drafters.drafter_choice). `"calibrate": true` ranks hybrid
candidates on measured acceptance (SPECPLUG_CALIBRATE overrides); `"draft_temperature": T`
draws sampled requests' chains from the head's q at T, verified with q
(SPECPLUG_DRAFT_TEMPERATURE overrides). `"gate": true` hands vLLM a request's chain only
when its expected accepted length pays for the tokens it adds to the step
(specplug.common.policy.payoff; SPECPLUG_GATE overrides; stage "chain").
`"head_weights": "int8"` or `"int4"` runs an EAGLE-3 head's linears with quantized weights
(specplug.common.drafting.int8 / int4; the older `"head_int8": true` is "int8";
SPECPLUG_HEAD_WEIGHTS overrides).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from specplug.common.policy.adaptive import ENV_ADAPTIVE as ENV_ADAPTIVE_OVERRIDE
from specplug.common.drafting.int8 import ENV_HEAD_INT8, ENV_HEAD_WEIGHTS, head_weights
from specplug.common.drafting.sampled import ENV_DRAFT_TEMPERATURE, draft_temperature
from specplug.common.policy.adaptive import adaptive_flag, section_flag
from specplug.common.policy.calibration import ENV_CALIBRATE
from specplug.common.retrieval.config import ENV_RETRIEVAL
from specplug.common.token_drafters import ENV_DRAFTER, DrafterChoice, check_choice, drafter_choice
from specplug.common.tree import TreeConfig

ENV_TREE_OVERRIDE = "SPECPLUG_TREE"
ENV_STAGE_OVERRIDE = "SPECPLUG_STAGE"
ENV_GATE = "SPECPLUG_GATE"
STAGES = ("chain", "tree")


@dataclass(frozen=True)
class AdapterSettings:
    """How the specplug proposer drafts inside vLLM.

    tree: EAGLE-2 settings (specplug.common.tree.TreeConfig: depth, topk, budget).
      In stage "chain" vLLM's num_speculative_tokens is the draft depth (the chain vLLM
      verifies has exactly that many tokens) and every drafted node is kept. In stage
      "tree" the depth is tree.depth and num_speculative_tokens must equal tree.budget
      (every kept node is one vLLM draft token; see check_num_speculative_tokens).
    verification: "lossless" only (vLLM never runs lossy typical acceptance here).
    stage: "chain" = stage A: the tree's best root-to-leaf path is verified as vLLM's
      chain, by specplug's sampler (specplug.common.sampling.verify). "tree" = stage B:
      the whole tree is verified in one target pass (tree_verify.py).
    adaptive: per engine step, draft 0..num_speculative_tokens tokens as chosen by
      specplug.common.policy.cost from costs and acceptance measured in the engine (adaptive.py).
    drafter: hybrid drafting: the token drafter (specplug.common.token_drafters; the
      built-in "retrieval" or any registered one) whose candidates are merged with the
      head's tree (specplug.common.merge) before path choice; None = head only.
    calibrate: hybrid drafting ranks the head's and the token drafter's nodes on the
      acceptance measured for each source in this engine
      (specplug.common.policy.calibration), not on their own scores; stage "chain".
    draft_temperature: sampled drafts: a request that samples (T > 0, no seed) gets a
      chain drawn from the head's q = softmax(draft log-probs / draft_temperature),
      verified with q (rejection sampling, lossless); None = argmax drafts for all.
      Stage "chain" only.
    gate: per request and step, drafts only where their expected accepted length pays
      for the tokens they add to the step, on step costs measured in this engine
      (specplug.common.policy.payoff.DraftGate); the others run a plain step. Stage "chain".
    head_weights: "float" (as loaded), "int8" (one scale per output channel,
      specplug.common.drafting.int8) or "int4" (groups of 64 inputs,
      specplug.common.drafting.int4): the EAGLE-3 head's linears after fc run with
      weight-only quantized weights where the head is bf16 or fp32 on a CPU; drafts only,
      so output is unchanged. Elsewhere (or for EAGLE-1) the head runs as loaded.
    """

    tree: TreeConfig = TreeConfig()
    verification: str = "lossless"
    stage: str = "chain"
    adaptive: bool = False
    drafter: DrafterChoice | None = None
    calibrate: bool = False
    draft_temperature: float | None = None
    gate: bool = False
    head_weights: str = "float"

    def __post_init__(self):
        if self.verification != "lossless":
            raise ValueError(
                f"specplug verification {self.verification!r} is not supported by the vLLM adapter: "
                "it verifies losslessly only; set \"verification\": \"lossless\" in the head's config.json"
            )
        if self.draft_temperature is not None and self.stage != "chain":
            raise ValueError(f"specplug \"draft_temperature\" (sampled drafts) needs stage \"chain\", the head says "
                             f"stage {self.stage!r}: drop \"draft_temperature\" (or unset {ENV_DRAFT_TEMPERATURE}), "
                             f"or use stage \"chain\"")
        if self.gate and self.stage != "chain":
            raise ValueError(f"specplug \"gate\" needs stage \"chain\", the head says stage {self.stage!r}: "
                             f"drop \"gate\" (or set {ENV_GATE}=0), or use stage \"chain\"")
        if self.stage not in STAGES:
            raise ValueError(f"specplug stage must be one of {STAGES}, got {self.stage!r}: set \"stage\" in the "
                             f"head's specplug section or {ENV_STAGE_OVERRIDE} to \"chain\" or \"tree\"")


# vLLM's speculative method -> the method a specplug head's section names
HEAD_METHOD = {"eagle3": "eagle3", "eagle": "eagle1", "medusa": "medusa"}
VLLM_METHOD = {head: vllm for vllm, head in HEAD_METHOD.items()}  # and back


def specplug_section(hf_config: Any, vllm_method: str = "eagle3") -> dict | None:
    """The head config's specplug section if it marks a specplug head for `vllm_method`
    ("eagle3": an EAGLE-3 head, "eagle": an EAGLE-1 head, "medusa": Medusa heads), else None."""
    section = getattr(hf_config, "specplug", None)
    if section is None and isinstance(hf_config, Mapping):
        section = hf_config.get("specplug")
    if not section or vllm_method not in HEAD_METHOD:
        return None
    if not isinstance(section, Mapping):
        raise TypeError(f"config.json 'specplug' must be an object, got {type(section).__name__}")
    expected = HEAD_METHOD[vllm_method]
    given = section.get("method", expected)
    if given != expected:
        fix = VLLM_METHOD.get(given)
        raise ValueError(
            f"the head's specplug section says method {given!r}, but vLLM was asked for method {vllm_method!r}: "
            + (f"pass \"method\": \"{fix}\" in --speculative-config" if fix else
               f"set \"method\": \"{expected}\" in the section of an {expected.upper()} head")
        )
    return dict(section)


def adapter_settings(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> AdapterSettings:
    """AdapterSettings from a specplug section, with SPECPLUG_TREE overrides applied."""
    tree = dict(section.get("tree") or {})
    override = environ.get(ENV_TREE_OVERRIDE)
    if override:
        try:
            tree.update(json.loads(override))
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise ValueError(f"{ENV_TREE_OVERRIDE} must be a JSON object, got {override!r}: {exc}") from exc
    drafter = drafter_choice(section, environ)
    if drafter is not None:
        check_choice(drafter)
    return AdapterSettings(
        tree=TreeConfig.from_dict(tree),
        verification=section.get("verification", "lossless"),
        stage=environ.get(ENV_STAGE_OVERRIDE) or section.get("stage", "chain"),
        adaptive=adaptive_flag(section, environ),
        drafter=drafter,
        calibrate=section_flag(section, "calibrate", environ, ENV_CALIBRATE, "calibrated hybrid scores"),
        draft_temperature=draft_temperature(section, environ),
        gate=section_flag(section, "gate", environ, ENV_GATE, "the draft gate"),
        head_weights=head_weights(section, environ),
    )


# Where each AdapterSettings field (but tree) is read: (keys of the specplug section,
# environment variables that override them, first one set wins).
SOURCES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "verification": (("verification",), ()),
    "stage": (("stage",), (ENV_STAGE_OVERRIDE,)),
    "adaptive": (("adaptive",), (ENV_ADAPTIVE_OVERRIDE,)),
    "drafter": (("drafter", "retrieval"), (ENV_DRAFTER, ENV_RETRIEVAL)),
    "calibrate": (("calibrate",), (ENV_CALIBRATE,)),
    "draft_temperature": (("draft_temperature",), (ENV_DRAFT_TEMPERATURE,)),
    "gate": (("gate",), (ENV_GATE,)),
    "head_weights": (("head_weights", "head_int8"), (ENV_HEAD_WEIGHTS, ENV_HEAD_INT8)),
}


def setting_sources(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Where adapter_settings(section, environ) takes each value from: "env NAME",
    "config.json" or "default"; tree fields as "tree.depth" ... (SPECPLUG_TREE's keys)."""
    sources = {}
    for name, (keys, envs) in SOURCES.items():
        env = next((e for e in envs if (environ.get(e) or "").strip()), None)
        sources[name] = f"env {env}" if env else "config.json" if any(k in section for k in keys) else "default"
    try:
        overridden = json.loads(environ.get(ENV_TREE_OVERRIDE) or "{}")
    except json.JSONDecodeError:
        overridden = {}
    tree = section.get("tree") or {}
    for name in (f.name for f in fields(TreeConfig)):
        sources[f"tree.{name}"] = (f"env {ENV_TREE_OVERRIDE}" if name in overridden else
                                   "config.json" if name in tree else "default")
    return sources


def check_num_speculative_tokens(settings: AdapterSettings, num_speculative_tokens: int) -> None:
    """Stage "tree" hands vLLM every kept tree node as a draft token, so vLLM must
    reserve exactly tree.budget draft slots per request; raise ValueError otherwise.
    Adaptive speculation drafts chains of chosen depth: not combined with stage "tree"."""
    if settings.stage != "tree":
        return
    if settings.adaptive:
        raise ValueError("specplug stage \"tree\" cannot be combined with \"adaptive\": true "
                         f"(adaptive speculation chooses chain depths); unset {ENV_ADAPTIVE_OVERRIDE} "
                         "or set \"adaptive\": false, or use stage \"chain\"")
    budget = settings.tree.budget
    if num_speculative_tokens != budget:
        raise ValueError(
            f"specplug stage \"tree\" verifies tree.budget={budget} draft nodes per step as vLLM draft "
            f"tokens, but num_speculative_tokens is {num_speculative_tokens}: set "
            f"\"num_speculative_tokens\": {budget} in vLLM's speculative_config (or change the head's "
            f"tree budget, e.g. {ENV_TREE_OVERRIDE}='{{\"budget\": {num_speculative_tokens}}}')"
        )


def check_head_matches_target(head_dir: str, target_config: Any, vllm_method: str = "eagle3", *,
                              weights: bool = True) -> None:
    """Raise ValueError naming the first field where the head cannot draft for the target:
    specplug.common.formats' validation (hidden size, vocab, aux layer ids, shapes), the
    head's kind against vLLM's method, plus vLLM's own constraints: aux layer ids
    ascending (vLLM captures sorted(set(ids)) and concatenates them in that order); no fc
    bias in an EAGLE-1 head (vLLM 0.32's EAGLE-1 model has none to load it into).
    weights=False reads the head's safetensors headers only (formats.load_head)."""
    from specplug.common import formats

    head = formats.load_head(head_dir, target_config, weights=weights)
    expected = HEAD_METHOD[vllm_method]
    if head.method != expected:
        kind = {"eagle3": "EAGLE-3", "eagle1": "EAGLE-1", "medusa": "Medusa"}.get(head.method, head.method)
        method = VLLM_METHOD.get(head.method)
        raise ValueError(f"{head_dir} holds {kind} heads ({head.format} format), but vLLM was asked for method "
                         f"{vllm_method!r}: " + (f"pass \"method\": \"{method}\" in --speculative-config" if method
                                                  else "serve them in SGLang (--speculative-algorithm MEDUSA)"))
    if head.method == "eagle1" and "fc.bias" in head.state_dict:
        raise ValueError(f"{head_dir}: the EAGLE-1 head has an fc bias (fc.bias), which vLLM 0.32's EAGLE-1 model "
                         "cannot load: serve it in SGLang with --speculative-algorithm SPECPLUG_EAGLE3, or use "
                         "a head trained without fc bias")
    ids = (head.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and list(ids) != sorted(set(ids)):
        raise ValueError(
            f"head eagle_aux_hidden_state_layer_ids {list(ids)} must be distinct and ascending: "
            f"vLLM concatenates the aux hidden states in ascending layer order (config.json of "
            f"{head_dir}); fix: train or convert a head for this target with sorted ids"
        )
