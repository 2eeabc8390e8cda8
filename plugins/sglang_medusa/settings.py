"""Settings of specplug's SGLang algorithms, from SGLang's server arguments:

- MEDUSA (medusa_settings) and SPECPLUG_EAGLE3 (eagle3_settings): the heads' `specplug`
  section as specplug.common.head_section parses it, the same schema, defaults, checks
  and SPECPLUG_* variables as in vLLM (docs/heads.md, "The specplug section"). This module
  maps SGLang's arguments onto it (they override the environment, which overrides the
  section): --speculative-num-steps (tree.depth), --speculative-eagle-topk (tree.topk),
  --speculative-num-draft-tokens N (tree.budget N - 1: SGLang counts the root), for MEDUSA
  --speculative-accept-threshold-single / -acc other than 1 (typical acceptance, LOSSY) and
  --speculative-adaptive. docs/sglang.md tables every argument and its default.
- RETRIEVAL and every other registered token drafter (token_settings): the drafter's
  fields from SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER, then the tree arguments.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specplug.common.head_section import (
    ENV_DRAFT_TEMPERATURE, Argument, HeadSettings, ParsedSection, SettingTypeError, parse, read_section,
)
from specplug.common.retrieval.config import ENV_RETRIEVAL, retrieval_override
from specplug.common.drafter_registry import ENV_DRAFTER, DrafterChoice, check_choice, env_choice


def medusa_nodes(settings: HeadSettings) -> int:
    """MEDUSA's tree nodes including the root: SGLang's speculative_num_draft_tokens, the
    size of MedusaDrafter's template (TreeConfig.static_nodes, or the explicit choices)."""
    choices = settings.medusa.choices
    return len(choices) + 1 if choices is not None else settings.tree.static_nodes + 1


def verify_method(settings: HeadSettings) -> str:
    """specplug.common.verify_step's rule for sampled requests: "typical" (LOSSY) when the
    section or SGLang's thresholds ask for it, else "rejection" (the request's own rule)."""
    return "typical" if settings.verification.method == "typical" else "rejection"


def _fail(arg: str, expected: str, given, fix: str, algorithm: str = "MEDUSA") -> None:
    raise ValueError(f"{algorithm}: {arg} must be {expected}, got {given!r}: {fix}")


def read_head_section(heads_path: str) -> tuple[int, dict]:
    """(number of Medusa heads, the `specplug` section or {}) from DIR/config.json."""
    config_file = Path(heads_path) / "config.json"
    if not config_file.is_file():
        _fail("--speculative-draft-model-path", "a directory with Medusa heads (config.json + "
              "safetensors)", heads_path, "train heads with `specplug train` or convert them "
              "with `specplug convert`")
    config = json.loads(config_file.read_text())
    heads = config.get("medusa_num_heads", config.get("num_heads"))
    if not isinstance(heads, int) or heads < 1:
        _fail(f"medusa_num_heads in {config_file}", "an int >= 1", heads,
              "this is not a Medusa head checkpoint; point --speculative-draft-model-path at one")
    return heads, read_section(heads_path)


def tree_arguments(cfg) -> dict[str, Argument]:
    """SGLang's tree arguments as the schema's fields, those given: --speculative-num-steps
    (tree.depth), --speculative-eagle-topk (tree.topk), --speculative-num-draft-tokens N
    (tree.budget N - 1: SGLang counts the root)."""
    given = {"tree.depth": Argument("--speculative-num-steps", cfg.speculative_num_steps),
             "tree.topk": Argument("--speculative-eagle-topk", cfg.speculative_eagle_topk)}
    nodes = cfg.speculative_num_draft_tokens
    if nodes is not None:
        given["tree.budget"] = Argument("--speculative-num-draft-tokens minus one",
                                        nodes - 1 if isinstance(nodes, int) else nodes)
    return {name: arg for name, arg in given.items() if arg.value is not None}


def typical_arguments(cfg) -> dict[str, Argument]:
    """--speculative-accept-threshold-single / -acc with a value other than 1 (SGLang's
    "off"): typical acceptance's epsilon / delta, which ask for it."""
    given = {"verification.typical_epsilon": Argument("--speculative-accept-threshold-single",
                                                      cfg.speculative_accept_threshold_single),
             "verification.typical_delta": Argument("--speculative-accept-threshold-acc",
                                                    cfg.speculative_accept_threshold_acc)}
    return {name: arg for name, arg in given.items() if arg.value is not None and arg.value != 1.0}


def parse_section(section: dict, environ, algorithm: str, **kwargs) -> ParsedSection:
    """specplug.common.head_section.parse, its errors in SGLang's words (the algorithm first)."""
    try:
        return parse(section, environ, **kwargs)
    except ValueError as exc:
        raise (SettingTypeError if isinstance(exc, TypeError) else ValueError)(f"{algorithm}: {exc}") from exc


def medusa_settings(cfg, adaptive_arg: bool = False, environ=None) -> HeadSettings:
    """The Medusa heads' section (--speculative-draft-model-path) with SGLang's arguments
    (module docstring) applied, checked; ValueError names the argument and the fix. adaptive_arg:
    --speculative-adaptive as the user gave it (SGLang resolves it to False for MEDUSA, so
    the caller passes the raw value)."""
    environ = os.environ if environ is None else environ
    if not cfg.speculative_draft_model_path:
        _fail("--speculative-draft-model-path", "the Medusa heads directory", None,
              "pass --speculative-draft-model-path MEDUSA_HEADS_DIR")
    num_heads, section = read_head_section(cfg.speculative_draft_model_path)
    arguments = {**tree_arguments(cfg), **typical_arguments(cfg)}
    if adaptive_arg:
        arguments["adaptive"] = Argument("--speculative-adaptive", True)
    return parse_section(section, environ, "MEDUSA", method="medusa", arguments=arguments,
                         num_heads=num_heads).settings


@dataclass(frozen=True)
class TokenDrafterSettings:
    """What a token drafter's worker needs: the registered drafter and its settings, with
    "budget" (draft nodes, root excluded) and "max_depth" always fixed."""

    choice: DrafterChoice

    @property
    def budget(self) -> int:
        return self.choice.settings["budget"]

    @property
    def max_depth(self) -> int:
        return self.choice.settings["max_depth"]

    @property
    def num_nodes(self) -> int:
        """Most tree nodes a step verifies, root included: SGLang's speculative_num_draft_tokens."""
        return self.budget + 1


# RETRIEVAL's defaults over RetrievalConfig's: a tree is verified whole (every node,
# min_prob 0) when its expected accepted length reaches 0.5, else the root alone.
# Measured on the test bed's SGLang CPU path (docs/sglang.md): a verify pass costs ~77 ms
# for the root alone and ~120 ms for 4-9 nodes, nearly flat in between.
SGLANG_RETRIEVAL = {"min_prob": 0.0, "min_expected": 0.5}
DEFAULT_BUDGET = DEFAULT_DEPTH = 8  # a token drafter's tree size when no argument sets it


def token_settings(name: str, cfg, environ=None) -> TokenDrafterSettings:
    """The settings of registered token drafter `name` (run as --speculative-algorithm
    NAME.upper()): for "retrieval", SGLANG_RETRIEVAL then SPECPLUG_RETRIEVAL's fields;
    then SPECPLUG_DRAFTER's fields; then --speculative-num-draft-tokens N (budget N - 1)
    and --speculative-num-steps D (max_depth), else DEFAULT_BUDGET / DEFAULT_DEPTH.
    ValueError names the argument and the fix."""
    environ = os.environ if environ is None else environ
    algorithm = name.upper()
    fields = {**(_retrieval_fields(environ) if name == "retrieval" else {}), **_drafter_fields(name, environ)}
    if cfg.speculative_num_draft_tokens is not None:
        fields["budget"] = _positive("--speculative-num-draft-tokens minus one", cfg.speculative_num_draft_tokens - 1,
                                     algorithm)
    if cfg.speculative_num_steps is not None:
        fields["max_depth"] = _positive("--speculative-num-steps", cfg.speculative_num_steps, algorithm)
    choice = DrafterChoice(name, {"budget": DEFAULT_BUDGET, "max_depth": DEFAULT_DEPTH, **fields})
    try:
        check_choice(choice)
    except ValueError as exc:
        raise ValueError(f"{algorithm}: {exc}") from exc
    return TokenDrafterSettings(choice)


def _retrieval_fields(environ) -> dict:
    override = retrieval_override(environ)
    if override is False:
        _fail(ENV_RETRIEVAL, "unset, 1 or a JSON object for RETRIEVAL", environ.get(ENV_RETRIEVAL),
              "unset it: RETRIEVAL has no other drafter", "RETRIEVAL")
    return {**SGLANG_RETRIEVAL, **(override if isinstance(override, dict) else {})}


def _drafter_fields(name: str, environ) -> dict:
    """SPECPLUG_DRAFTER's fields, when it names this drafter (or gives no name)."""
    choice = env_choice(environ, default_name=name)
    if choice is None:
        return {}
    if choice is False or choice.name != name:
        other = "" if choice is False else choice.name.upper()
        _fail(ENV_DRAFTER, f"the fields of drafter {name!r} (a JSON object, \"name\" {name!r} or none)",
              environ.get(ENV_DRAFTER), f"the algorithm chooses the drafter; set --speculative-algorithm "
              f"{other or 'NAME'} or fix the variable", name.upper())
    return dict(choice.settings)


# -- SPECPLUG_EAGLE3: EAGLE-3 heads with dynamic trees ------------------------------------

EAGLE3 = "SPECPLUG_EAGLE3"
DRAFT_TEMPERATURE_ENV = ENV_DRAFT_TEMPERATURE  # what the bench sets for sampled drafts


def eagle3_settings(cfg, environ=None) -> HeadSettings:
    """--speculative-draft-model-path HEAD (an EAGLE-3 or EAGLE-1 head, any format specplug
    reads) and its specplug section (specplug.common.head_section): the tree from
    --speculative-num-steps (depth), --speculative-eagle-topk (topk) and
    --speculative-num-draft-tokens N (budget N - 1), else SPECPLUG_TREE, else the section's
    "tree", else TreeConfig's defaults; hybrid drafting, sampled drafts, payoff control and
    quantized head weights from the environment, else the section. The most nodes a step
    verifies (SGLang's speculative_num_draft_tokens) is tree.budget + 1. ValueError names
    the argument and the fix."""
    environ = os.environ if environ is None else environ
    path = cfg.speculative_draft_model_path
    if not path or not (Path(path) / "config.json").is_file():
        _fail("--speculative-draft-model-path", "an EAGLE-3 head directory (config.json + safetensors)", path,
              "train one with `specplug train eagle3` or convert one with `specplug convert`", EAGLE3)
    return parse_section(read_section(path), environ, EAGLE3, arguments=tree_arguments(cfg)).settings


def _positive(arg: str, value, algorithm: str = "MEDUSA") -> int:
    if not isinstance(value, int) or value < 1:
        _fail(arg, "an int >= 1", value, "pass a positive value or leave it unset", algorithm)
    return value

