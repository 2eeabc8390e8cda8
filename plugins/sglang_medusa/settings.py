"""SGLang's server arguments as fields of specplug's settings schema (the parsing, defaults
and checks are the core's: specplug.common.head_section for heads, drafter_registry for
token drafters; docs/sglang.md tables every argument)."""

from __future__ import annotations

import os
from pathlib import Path

from specplug.common.drafter_registry import TokenDrafterSettings, token_drafter_settings
from specplug.common.head_section import Argument, HeadSettings, parse, read_section, refuse_unsupported
from specplug.common.heads.medusa import medusa_head_count

# schema field -> (SGLang's argument, its attribute); SGLang's node count includes the root
TREE_ARGUMENTS = {"tree.depth": ("--speculative-num-steps", "speculative_num_steps"),
                  "tree.topk": ("--speculative-eagle-topk", "speculative_eagle_topk"),
                  "tree.budget": ("--speculative-num-draft-tokens minus one", "speculative_num_draft_tokens")}
# typical acceptance (LOSSY) when either is given other than 1, SGLang's "off"
TYPICAL_ARGUMENTS = {"verification.typical_epsilon": ("--speculative-accept-threshold-single",
                                                      "speculative_accept_threshold_single"),
                     "verification.typical_delta": ("--speculative-accept-threshold-acc",
                                                    "speculative_accept_threshold_acc")}
GATE_FIX = "serve an EAGLE head in vLLM (stage \"chain\"), where the draft gate runs"
TOKEN_ARGUMENTS = {"budget": TREE_ARGUMENTS["tree.budget"], "max_depth": TREE_ARGUMENTS["tree.depth"]}


def arguments(cfg, table: dict[str, tuple[str, str]], off=None) -> dict[str, Argument]:
    """The fields of `table` whose argument is given (not None or `off`)."""
    given = {}
    for field, (name, attr) in table.items():
        value = getattr(cfg, attr)
        if attr == "speculative_num_draft_tokens" and isinstance(value, int):
            value -= 1
        if value is not None and value != off:
            given[field] = Argument(name, value)
    return given


def _head_dir(cfg, algorithm: str, expected: str, fix: str) -> str:
    path = cfg.speculative_draft_model_path
    if not path or not (Path(path) / "config.json").is_file():
        raise ValueError(f"{algorithm}: --speculative-draft-model-path must be {expected}, got {path!r}: {fix}")
    return path


def medusa_settings(cfg, adaptive_arg: bool = False, environ=None) -> HeadSettings:
    """The Medusa heads' section with SGLang's arguments applied. adaptive_arg:
    --speculative-adaptive as the user gave it (SGLang resolves it to False for MEDUSA)."""
    path = _head_dir(cfg, "MEDUSA", "a directory with Medusa heads (config.json + safetensors)",
                     "train heads with `specplug train` or convert them with `specplug convert`")
    given = {**arguments(cfg, TREE_ARGUMENTS), **arguments(cfg, TYPICAL_ARGUMENTS, off=1.0)}
    if adaptive_arg:
        given["adaptive"] = Argument("--speculative-adaptive", True)
    settings = parse(read_section(path), os.environ if environ is None else environ, method="medusa",
                     arguments=given, num_heads=medusa_head_count(path), label="MEDUSA").settings
    refuse_unsupported(settings, "MEDUSA in SGLang", ("gate",), GATE_FIX)
    return settings


def eagle3_settings(cfg, environ=None) -> HeadSettings:
    """An EAGLE-3 or EAGLE-1 head's section with SGLang's tree arguments applied."""
    path = _head_dir(cfg, "SPECPLUG_EAGLE3", "an EAGLE-3 head directory (config.json + safetensors)",
                     "train one with `specplug train eagle3` or convert one with `specplug convert`")
    settings = parse(read_section(path), os.environ if environ is None else environ,
                     arguments=arguments(cfg, TREE_ARGUMENTS), label="SPECPLUG_EAGLE3").settings
    refuse_unsupported(settings, "SPECPLUG_EAGLE3 in SGLang", ("adaptive", "gate"),
                       "serve the head in vLLM (stage \"chain\"); here payoff control chooses the tree or none")
    return settings


def token_settings(name: str, cfg, environ=None) -> TokenDrafterSettings:
    """Registered token drafter `name`'s settings (--speculative-algorithm NAME.upper())."""
    return token_drafter_settings(name, os.environ if environ is None else environ, arguments(cfg, TOKEN_ARGUMENTS))
