"""Settings of specplug's SGLang algorithms: server arguments -> MedusaSettings (MEDUSA,
plus the heads' specplug section), Eagle3Settings (SPECPLUG_EAGLE3: see
eagle3_settings_from_server_args) or TokenDrafterSettings (RETRIEVAL and every other
registered token drafter, plus SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER; see
token_settings_from_server_args).

MEDUSA:

Server arguments read (everything else keeps SGLang's meaning):

  --speculative-draft-model-path DIR   Medusa heads (FasterDecoding or vLLM format). Required.
  --speculative-num-draft-tokens N     tree nodes INCLUDING the root (node budget N - 1).
  --speculative-num-steps D            maximum tree depth (at most the number of heads).
  --speculative-eagle-topk K           candidates per head (1 = a chain of top-1 tokens).
  --speculative-accept-threshold-single EPS  with a value < 1: typical acceptance (LOSSY)
  --speculative-accept-threshold-acc DELTA   with epsilon EPS / delta DELTA (Medusa-2).
  --disable-overlap-schedule           set for you: the worker runs synchronously.
  --speculative-adaptive               adaptive speculation (specplug's, see below).

Adaptive speculation (per step the tree budget, down to none, chosen by
specplug.common.policy.adaptive from costs and acceptance measured in the engine) is on when
the heads' section says `"adaptive": true` or `--speculative-adaptive` is given; the
environment variable SPECPLUG_ADAPTIVE=1/0 overrides both. (SGLang's own adaptive
mode supports only EAGLE and logs that it is disabled for MEDUSA; specplug's worker
reads the flag as given.)

Unset tree arguments come from the heads' config.json `specplug` section ("tree",
"verification", "head_accuracies"), then from TreeConfig's defaults. The tree SHAPE is
chosen by the environment variable SPECPLUG_MEDUSA_TREE (read in every SGLang process):
"optimal" (default: Medusa's optimal sparse tree for the heads' measured accuracies,
within the node budget), "chain", or explicit Medusa choices as JSON (`[[0], [1], [0, 0]]`)
or a path to a JSON file holding them.

Hybrid drafting, as for SPECPLUG_EAGLE3 and in vLLM: the section's "retrieval" / "drafter"
(SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER overriding) merges that token drafter's trees with
the heads' under the same node budget each greedy step.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from specplug.common.drafting.int8 import head_weights
from specplug.common.drafting.sampled import ENV_DRAFT_TEMPERATURE, draft_temperature
from specplug.common.policy.adaptive import adaptive_flag
from specplug.common.retrieval.config import ENV_RETRIEVAL, retrieval_override
from specplug.common.sampling import TYPICAL_DELTA, TYPICAL_EPSILON
from specplug.common.token_drafters import ENV_DRAFTER, DrafterChoice, check_choice, drafter_choice, env_choice
from specplug.common.tree import TreeConfig

logger = logging.getLogger(__name__)

TREE_ENV = "SPECPLUG_MEDUSA_TREE"
TREE_SHAPES = ("optimal", "chain")


@dataclass(frozen=True)
class MedusaSettings:
    """Everything the MEDUSA worker needs besides the heads' weights.

    tree: depth / topk / budget (budget = draft nodes, root excluded).
    choices: an explicit static tree (Medusa top-k index paths) or None.
    verification: "lossless" (greedy at T=0, target-only tree rejection sampling at
        T>0: the output distribution is exactly the target's) or "typical" (LOSSY).
    adaptive: choose each step's tree budget (down to none) from measured costs.
    """

    heads_path: str
    tree: TreeConfig = TreeConfig()
    choices: tuple[tuple[int, ...], ...] | None = None
    verification: str = "lossless"
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    head_accuracies: tuple[tuple[float, ...], ...] | None = None
    adaptive: bool = False
    draft_temperature: float | None = None  # batches with sampled requests: chains drawn from the heads' q
    drafter: DrafterChoice | None = None  # hybrid drafting: a token drafter's trees merged with the heads'

    @property
    def num_nodes(self) -> int:
        """Tree nodes including the root: SGLang's speculative_num_draft_tokens, the
        size of MedusaDrafter's template (TreeConfig.static_nodes)."""
        if self.choices is not None:
            return len(self.choices) + 1
        return self.tree.static_nodes + 1

    @property
    def method(self) -> str:
        """specplug.common.sampling.verify's method for sampled (T > 0) requests."""
        return "typical" if self.verification == "typical" else "rejection"


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
    return heads, config.get("specplug") or {}


def parse_choices(text: str) -> tuple[tuple[int, ...], ...]:
    """Explicit Medusa choices from inline JSON or a JSON file."""
    source = Path(text).read_text() if Path(text).is_file() else text
    try:
        choices = json.loads(source)
    except json.JSONDecodeError:
        choices = None
    if not isinstance(choices, list) or not all(isinstance(c, list) and c for c in choices):
        _fail(TREE_ENV, f"one of {TREE_SHAPES}, JSON Medusa choices like [[0], [1], [0, 0]], or a "
              "JSON file with them", text, "fix the environment variable")
    return tuple(tuple(int(i) for i in c) for c in choices)


def _given(value, default):
    return default if value is None else value


def _tree_config(cfg, section: dict, num_heads: int, shape: str) -> TreeConfig:
    base = TreeConfig.from_dict(section["tree"]) if "tree" in section else TreeConfig()
    depth = _given(cfg.speculative_num_steps, min(base.depth, num_heads))
    topk = 1 if shape == "chain" else _given(cfg.speculative_eagle_topk, base.topk)
    nodes = cfg.speculative_num_draft_tokens
    budget = base.budget if nodes is None else nodes - 1
    if shape == "chain":
        budget = depth
    for arg, value in (("--speculative-num-steps", depth), ("--speculative-eagle-topk", topk),
                       ("--speculative-num-draft-tokens minus one", budget)):
        _positive(arg, value)
    if depth > num_heads:
        _fail("--speculative-num-steps", f"at most the number of Medusa heads ({num_heads})", depth,
              f"pass --speculative-num-steps {num_heads} or fewer, or train more heads")
    return TreeConfig(depth=depth, topk=topk, budget=budget)


def _verification(cfg, section: dict) -> tuple[str, float, float]:
    eps, delta = cfg.speculative_accept_threshold_single, cfg.speculative_accept_threshold_acc
    for arg, value in (("--speculative-accept-threshold-single", eps),
                       ("--speculative-accept-threshold-acc", delta)):
        if not 0.0 < value <= 1.0:
            _fail(arg, "in (0, 1] (1 = off)", value, "pass a typical-acceptance threshold in (0, 1)")
    verification = section.get("verification", "lossless")
    if verification not in ("lossless", "typical"):
        _fail("specplug.verification in the heads' config.json", '"lossless" or "typical"', verification,
              "fix the heads' config.json")
    if eps < 1.0 or delta < 1.0:
        verification = "typical"
    return (verification, eps if eps < 1.0 else TYPICAL_EPSILON, delta if delta < 1.0 else TYPICAL_DELTA)


def settings_from_server_args(cfg, adaptive_arg: bool = False, environ=None) -> MedusaSettings:
    """Parse and check the arguments above; ValueError names the argument and the fix.
    adaptive_arg: --speculative-adaptive as the user gave it (SGLang resolves it to False
    for MEDUSA, so the caller passes the raw value)."""
    environ = os.environ if environ is None else environ
    if not cfg.speculative_draft_model_path:
        _fail("--speculative-draft-model-path", "the Medusa heads directory", None,
              "pass --speculative-draft-model-path MEDUSA_HEADS_DIR")
    num_heads, section = read_head_section(cfg.speculative_draft_model_path)
    shape = environ.get(TREE_ENV, "optimal").strip() or "optimal"
    choices = None if shape in TREE_SHAPES else parse_choices(shape)
    if choices is not None and max(len(c) for c in choices) > num_heads:
        _fail(TREE_ENV, f"choices no deeper than the number of heads ({num_heads})",
              max(len(c) for c in choices), "drop the deeper paths")
    verification, eps, delta = _verification(cfg, section)
    accuracies = section.get("head_accuracies")
    temperature = _draft_temperature(section, environ, "MEDUSA")
    if temperature is not None and verification == "typical":
        _fail("draft_temperature (sampled drafts)", "unset with typical acceptance", temperature,
              "typical acceptance never reads q: drop draft_temperature or use lossless verification")
    return MedusaSettings(
        heads_path=str(cfg.speculative_draft_model_path),
        tree=_tree_config(cfg, section, num_heads, "chain" if shape == "chain" else "optimal"),
        choices=choices, verification=verification, typical_epsilon=eps, typical_delta=delta,
        head_accuracies=None if accuracies is None else tuple(tuple(map(float, r)) for r in accuracies),
        adaptive=adaptive_flag({**section, "adaptive": section.get("adaptive", False) or bool(adaptive_arg)}, environ),
        draft_temperature=temperature, drafter=_hybrid_choice(section, environ, "MEDUSA"),
    )


def _hybrid_choice(section, environ, algorithm: str) -> DrafterChoice | None:
    """The token drafter merged with the heads' trees (token_drafters.drafter_choice:
    the section's "retrieval" / "drafter", SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER), checked."""
    try:
        drafter = drafter_choice(section, environ)
        if drafter is not None:
            check_choice(drafter)
    except ValueError as exc:
        raise ValueError(f"{algorithm}: {exc}") from exc
    return drafter


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


def token_settings_from_server_args(name: str, cfg, environ=None) -> TokenDrafterSettings:
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
DRAFT_TEMPERATURE_ENV = ENV_DRAFT_TEMPERATURE


@dataclass(frozen=True)
class Eagle3Settings:
    """What the SPECPLUG_EAGLE3 worker needs besides the head's weights: the head folder
    and its EAGLE-2 tree (depth, topk, budget = draft nodes, root excluded)."""

    head_path: str
    tree: TreeConfig = TreeConfig()
    drafter: DrafterChoice | None = None  # hybrid drafting: a token drafter's trees merged with the head's
    draft_temperature: float | None = None  # batches with sampled requests: trees drawn from q at this temperature
    head_weights: str = "float"  # "int8" / "int4": an EAGLE-3 head's linears quantized (specplug.common.drafting)

    @property
    def num_nodes(self) -> int:
        """Most tree nodes a step verifies, root included: SGLang's speculative_num_draft_tokens."""
        return self.tree.budget + 1


def eagle3_settings_from_server_args(cfg, environ=None) -> Eagle3Settings:
    """--speculative-draft-model-path HEAD (an EAGLE-3 head, any format specplug reads);
    the tree from --speculative-num-steps (depth), --speculative-eagle-topk (topk) and
    --speculative-num-draft-tokens N (budget N - 1), else the head's `specplug.tree`
    (stop_below from there only), else TreeConfig's defaults. Hybrid drafting as in vLLM:
    the section's "retrieval" / "drafter", SPECPLUG_RETRIEVAL / SPECPLUG_DRAFTER
    overriding (token_drafters.drafter_choice). Sampled drafts: the section's
    "draft_temperature", SPECPLUG_DRAFT_TEMPERATURE overriding; quantized head weights:
    the section's "head_weights" (or the older "head_int8"), SPECPLUG_HEAD_WEIGHTS
    overriding. ValueError names the argument and the fix."""
    environ = os.environ if environ is None else environ
    path = cfg.speculative_draft_model_path
    if not path or not (Path(path) / "config.json").is_file():
        _fail("--speculative-draft-model-path", "an EAGLE-3 head directory (config.json + safetensors)", path,
              "train one with `specplug train eagle3` or convert one with `specplug convert`", EAGLE3)
    section = json.loads((Path(path) / "config.json").read_text()).get("specplug") or {}
    base = TreeConfig.from_dict(section["tree"]) if "tree" in section else TreeConfig()
    depth = _positive("--speculative-num-steps", _given(cfg.speculative_num_steps, base.depth), EAGLE3)
    topk = _positive("--speculative-eagle-topk", _given(cfg.speculative_eagle_topk, base.topk), EAGLE3)
    nodes = cfg.speculative_num_draft_tokens
    budget = _positive("--speculative-num-draft-tokens minus one", base.budget if nodes is None else nodes - 1,
                       EAGLE3)
    tree = TreeConfig(depth=depth, topk=topk, budget=budget, stop_below=base.stop_below)
    drafter = _hybrid_choice(section, environ, EAGLE3)
    try:
        weights = head_weights(section, environ)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{EAGLE3}: {exc}") from exc
    return Eagle3Settings(str(path), tree, drafter, _draft_temperature(section, environ), weights)


def _draft_temperature(section: dict, environ, algorithm: str = EAGLE3) -> float | None:
    """specplug.common.drafting.sampled.draft_temperature, its error in SGLang's words."""
    try:
        return draft_temperature(section, environ)
    except ValueError as exc:
        raise ValueError(f"{algorithm}: {exc}") from exc


def _positive(arg: str, value, algorithm: str = "MEDUSA") -> int:
    if not isinstance(value, int) or value < 1:
        _fail(arg, "an int >= 1", value, "pass a positive value or leave it unset", algorithm)
    return value

