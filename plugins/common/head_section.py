"""The `specplug` section of a head's config.json: its one schema (HeadSettings and its
parts), parsed once, with the environment's overrides and an engine's arguments, for
both engines.

A head's config.json may carry a `specplug` object (written by `specplug train` and
`specplug convert`; docs/heads.md, "The specplug section"). `parse(section, environ,
arguments=...)` reads it into HeadSettings and says where each value came from. For each
value the first source that sets it wins:

    engine argument  >  environment (SPECPLUG_*)  >  config.json  >  default

The defaults are HeadSettings' and its parts' (the tree's in specplug.common.tree.TreeConfig,
typical acceptance's in specplug.common.sampling.TYPICAL_*), nowhere else. An adapter maps
only its engine's arguments onto the schema (`Argument`: SGLang's --speculative-num-steps
is "tree.depth" ...; vLLM maps none) and refuses, by name, what its engine cannot run.

Rules both engines share: every value the section and the environment give is checked,
whatever overrides it; an empty environment variable counts as unset; typical acceptance
(lossy) comes from an engine argument only, never from a head's file or the environment,
and is logged as a WARNING.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from specplug.common.drafting.sampled import ENV_DRAFT_TEMPERATURE
from specplug.common.policy.adaptive import ENV_ADAPTIVE
from specplug.common.policy.calibration import ENV_CALIBRATE
from specplug.common.retrieval.config import ENV_RETRIEVAL
from specplug.common.sampling import TYPICAL_DELTA, TYPICAL_EPSILON
from specplug.common.drafter_registry import ENV_DRAFTER, DrafterChoice, check_choice, drafter_choice
from specplug.common.tree import TreeConfig

logger = logging.getLogger(__name__)

FILE = "config.json"  # a value's source: the head's section
DEFAULT = "default"  # a value's source: the schema's default
METHODS = ("eagle3", "eagle1", "medusa")  # a section's "method": the kind of head
STAGES = ("chain", "tree")
VERIFICATIONS = ("lossless", "typical")
WEIGHT_FORMATS = ("float", "int8", "int4")  # "head_weights"
MEDUSA_SHAPES = ("optimal", "chain", "choices")
ENV_TREE = "SPECPLUG_TREE"  # a JSON object of TreeConfig fields, over the section's "tree"
ENV_STAGE = "SPECPLUG_STAGE"  # chain / tree
ENV_GATE = "SPECPLUG_GATE"  # 1 / 0
ENV_PAYOFF = "SPECPLUG_PAYOFF"  # 1 / 0, over "payoff" (default on)
ENV_HEAD_WEIGHTS = "SPECPLUG_HEAD_WEIGHTS"  # float / int8 / int4, over "head_weights"
ENV_HEAD_INT8 = "SPECPLUG_HEAD_INT8"  # the older switch (1 / 0), over "head_int8"
ENV_MEDUSA_TREE = "SPECPLUG_MEDUSA_TREE"  # Medusa heads: optimal / chain / JSON choices / a JSON file of them
BOOLS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
TREE_KEYS = tuple(f.name for f in fields(TreeConfig))
KEYS = ("version", "method", "tree", "verification", "stage", "adaptive", "retrieval", "drafter", "calibrate",
        "draft_temperature", "gate", "payoff", "head_weights", "head_int8", "head_accuracies", "choices")
# true / false fields: (key, variable, what it turns on)
FLAGS = (("adaptive", ENV_ADAPTIVE, "adaptive speculation"), ("calibrate", ENV_CALIBRATE, "calibrated hybrid scores"),
         ("gate", ENV_GATE, "the draft gate"), ("payoff", ENV_PAYOFF, "payoff control"))
# fields an engine argument may set (Argument), besides "tree.<key>"
ARGUMENT_FIELDS = ("verification.typical_epsilon", "verification.typical_delta", "adaptive")


class SettingTypeError(ValueError, TypeError):
    """A section value of the wrong type (a string where true / false belongs ...): a
    ValueError like every bad setting, and the TypeError it always was."""


class Argument(NamedTuple):
    """An engine argument an adapter maps onto a field: its name as the user spells it
    ("--speculative-num-steps") and the value given."""

    name: str
    value: Any


class Value(NamedTuple):
    """A field's value and where it came from."""

    value: Any
    source: str  # FILE, DEFAULT, "env NAME" or "argument NAME"


# -- the checks every source's value goes through ----------------------------------------


def _fail(where: str, expected: str, given, fix: str, error: type = ValueError):
    raise error(f"{where} must be {expected}, got {given!r}: {fix}")


def _verification_method(value, where: str, from_file: bool = False) -> str:
    if value == "typical" and from_file:
        raise ValueError(
            f"specplug verification 'typical' in {FILE} is refused: typical acceptance is lossy, and a head's file "
            "never turns it on; set \"verification\": \"lossless\", and ask the engine for typical acceptance "
            "where it offers it (SGLang MEDUSA: --speculative-accept-threshold-single EPS < 1; vLLM: none)")
    if value not in VERIFICATIONS:
        _fail(where, f"one of {list(VERIFICATIONS)}", value, 'set "verification": "lossless" (typical acceptance, '
              "lossy, is an engine argument only)")
    return value


def _threshold(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        _fail(where, "a typical-acceptance threshold in (0, 1)", value,
              "pass a threshold in (0, 1), or leave it unset for lossless verification")
    return float(value)


def _stage(value, source: str) -> str:
    if value not in STAGES:
        raise ValueError(f"specplug stage must be one of {STAGES}, got {value!r} (from {source}): set \"stage\" in "
                         f"the head's specplug section or {ENV_STAGE} to \"chain\" or \"tree\"")
    return value


def _temperature(value, where: str) -> float:
    """A draft temperature: > 0, or 0 (off)."""
    try:
        temperature = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        temperature = math.nan
    if temperature != 0 and not (temperature > 0 and math.isfinite(temperature)):
        _fail(where, "a temperature > 0 (or 0 / unset: top-k trees)", value, "fix or unset it")
    return temperature


def _weights(value, where: str) -> str:
    if value not in WEIGHT_FORMATS:
        _fail(where, f"one of {list(WEIGHT_FORMATS)}", value, "\"float\" runs the head as loaded")
    return value


# -- the schema ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Verification:
    """How a step's drafts are verified. "lossless": the longest path matching the
    target's argmax at T = 0, rejection sampling at T > 0 (the output follows the target's
    distribution). "typical": Medusa-2 typical acceptance with typical_epsilon and
    typical_delta (LOSSY); only an engine argument asks for it."""

    method: str = "lossless"
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA

    def __post_init__(self) -> None:
        _verification_method(self.method, "Verification.method")
        for name in ("typical_epsilon", "typical_delta"):
            _threshold(getattr(self, name), f"Verification.{name}")

    @property
    def rule(self) -> str:
        """specplug.common.verify_step's rule for sampled requests: "typical" (LOSSY) for
        method "typical", else "rejection" (each request's own lossless rule)."""
        return "typical" if self.method == "typical" else "rejection"


@dataclass(frozen=True)
class MedusaTree:
    """A Medusa head's static tree (Medusa heads only). shape "optimal": Medusa's optimal
    sparse tree within tree.budget for head_accuracies (a prior when None); "chain": each
    head's top-1 (tree.topk 1, tree.budget = tree.depth); "choices": these explicit Medusa
    choices (top-k index paths)."""

    shape: str = "optimal"
    choices: tuple[tuple[int, ...], ...] | None = None
    head_accuracies: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.shape not in MEDUSA_SHAPES or (self.shape == "choices") != (self.choices is not None):
            raise ValueError(f"MedusaTree.shape must be one of {MEDUSA_SHAPES}, \"choices\" exactly when choices "
                             f"are given, got {self.shape!r} with choices {self.choices!r}: pass both or neither")


@dataclass(frozen=True)
class HeadSettings:
    """What a head's specplug section asks for, after the environment and the engine's
    arguments: the defaults here are the project's ONE set (docs/heads.md).

    tree: the draft tree (TreeConfig: depth, topk, budget = draft nodes, root excluded,
      stop_below). vLLM stage "chain" drafts num_speculative_tokens deep instead.
    verification: Verification ("lossless"; "typical" from an engine argument only).
    stage: vLLM only: "chain" (the tree's best path verified as vLLM's chain) or "tree"
      (the whole tree verified in one target pass). SGLang always verifies whole trees.
    adaptive: per step, choose how much to draft (down to nothing) from costs and
      acceptance measured in the engine (specplug.common.policy.adaptive).
    drafter: hybrid drafting: the token drafter whose candidates are merged with the
      head's (specplug.common.token_drafters; "retrieval" or a registered one); None = head only.
    calibrate: vLLM stage "chain": rank hybrid candidates on acceptance measured per source.
    draft_temperature: sampled drafts: requests that sample get drafts drawn from the
      head's q at this temperature, verified with q (lossless); None = top-k drafts.
    gate: vLLM stage "chain": draft for a request only when the chain pays for itself.
    payoff: per step, draft the depth (down to none; stage "tree" and Medusa heads: all
      or none) that has delivered the most tokens per second at this batch size
      (specplug.common.policy.throughput); "adaptive" replaces it when set.
    head_weights: "float", "int8" or "int4": an EAGLE-3 head's linears with weight-only
      quantized weights where they can run (bf16 / fp32 on a CPU); drafts only.
    medusa: MedusaTree (Medusa heads: the static tree's shape, choices, head accuracies).
    """

    tree: TreeConfig = TreeConfig()
    verification: Verification = Verification()
    stage: str = "chain"
    adaptive: bool = False
    drafter: DrafterChoice | None = None
    calibrate: bool = False
    draft_temperature: float | None = None
    gate: bool = False
    payoff: bool = True
    head_weights: str = "float"
    medusa: MedusaTree = MedusaTree()

    def __post_init__(self) -> None:
        _stage(self.stage, "HeadSettings.stage")
        _weights(self.head_weights, "HeadSettings.head_weights")
        if self.draft_temperature is not None:
            _temperature(self.draft_temperature, "HeadSettings.draft_temperature")

    @property
    def medusa_nodes(self) -> int:
        """A Medusa head's static tree size, root included (MedusaDrafter's template: the
        explicit choices, else TreeConfig.static_nodes): SGLang's speculative_num_draft_tokens."""
        choices = self.medusa.choices
        return len(choices) + 1 if choices is not None else self.tree.static_nodes + 1


# a feature an engine path may lack -> (whether HeadSettings turn it on, the variable that sets it)
FEATURES = {
    "adaptive": (lambda s: s.adaptive, ENV_ADAPTIVE),
    "gate": (lambda s: s.gate, ENV_GATE),
    "draft_temperature": (lambda s: s.draft_temperature is not None, ENV_DRAFT_TEMPERATURE),
    "drafter": (lambda s: s.drafter is not None, f"{ENV_DRAFTER} / {ENV_RETRIEVAL}"),
}


def refuse_unsupported(settings: HeadSettings, path: str, unsupported, fix: str) -> None:
    """ValueError for the first FEATURES key in `unsupported` that `settings` turn on, which
    `path` (e.g. 'vLLM stage "tree"') does not run: it names the key and its variable to
    drop, then `fix` (where the feature does run)."""
    for key in unsupported:
        on, env = FEATURES[key]
        if on(settings):
            raise ValueError(f"specplug {path} does not support {key!r}: drop it from the head's specplug section "
                             f"(or unset {env}), or {fix}")


@dataclass(frozen=True)
class ParsedSection:
    """parse()'s answer: the effective settings and each value's source, by field name
    ("tree.depth", "verification.method", "stage", "medusa.choices" ...)."""

    settings: HeadSettings
    sources: Mapping[str, str]
    method: str | None = None  # the head's kind ("eagle3", "eagle1", "medusa"), when known

    def rows(self) -> list[dict]:
        """[{name, value, source}] per field, parts flattened ("tree.depth"), JSON-ready
        (a drafter as {"name": ..., its settings}); the medusa part for Medusa heads only."""
        rows = []
        for name, source in self.sources.items():
            if name.startswith("medusa.") and self.method != "medusa":
                continue
            rows.append({"name": name, "value": _plain(self.value(name), name), "source": source})
        return rows

    def value(self, name: str) -> Any:
        """A field's effective value by its dotted name."""
        value = self.settings
        for part in name.split("."):
            value = getattr(value, part)
        return value


def _plain(value, name: str = ""):
    if name == "medusa.head_accuracies" and value is not None:  # a table: its size
        return f"{len(value)} heads x {max(map(len, value))} ranks"
    if isinstance(value, DrafterChoice):
        return {"name": value.name, **dict(value.settings)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


# -- reading a head's section -------------------------------------------------------------


def read_section(head_dir) -> dict:
    """The `specplug` section of HEAD_DIR/config.json, {} when it has none."""
    config_file = Path(head_dir) / "config.json"
    section = json.loads(config_file.read_text()).get("specplug")
    return dict(checked_section(section, config_file) or {})


def checked_section(section, where="config.json"):
    """`section` as given (None included); SettingTypeError unless None or a mapping."""
    if section is not None and not isinstance(section, Mapping):
        raise SettingTypeError(f"{where} 'specplug' must be an object, got {type(section).__name__}: make it a "
                               "JSON object of specplug settings (docs/heads.md), or remove it")
    return section


def parse(section: Mapping[str, Any] | None, environ: Mapping[str, str] = os.environ, *, method: str | None = None,
          arguments: Mapping[str, Argument] | None = None, num_heads: int | None = None,
          label: str | None = None) -> ParsedSection:
    """The effective settings of a head's `specplug` section (None: the head has none)
    and their sources: engine `arguments` ({field: Argument}, only those given) over the
    environment over the section over HeadSettings' defaults. `method`: the kind of head
    the engine serves (else the section's "method"); Medusa heads read their tree's shape
    (SPECPLUG_MEDUSA_TREE) and, with `num_heads`, keep the tree within the heads. Raises
    ValueError naming the field, what was expected, what was given, where, and the fix,
    prefixed with `label` (the engine's name for the algorithm) when given; a
    SettingTypeError stays one."""
    try:
        return _parse(section, environ, method, arguments, num_heads)
    except ValueError as exc:
        if label is None:
            raise
        raise (SettingTypeError if isinstance(exc, TypeError) else ValueError)(f"{label}: {exc}") from exc


def _parse(section, environ, method, arguments, num_heads) -> ParsedSection:
    section = dict(checked_section(section) or {})
    arguments = dict(arguments or {})
    _check_arguments(arguments)
    unknown = sorted(set(section) - set(KEYS))
    if unknown:
        logger.warning("the head's specplug section has unknown keys %s, ignored: known keys are %s (check their "
                       "spelling)", unknown, list(KEYS))
    method = _method(section, method)
    found: dict[str, Value] = {}
    found.update(_tree(section, environ, arguments))
    if method == "medusa":
        found.update(_medusa(section, environ, num_heads, found, arguments))
    found.update(_verification(section, arguments))
    found["stage"] = _first((_env_text(environ, ENV_STAGE), f"env {ENV_STAGE}"), (section.get("stage"), FILE))
    if found["stage"]:
        _stage(*found["stage"])
    for key, env, what in FLAGS:
        argument = arguments.get(key)
        found[key] = _first((None if argument is None else bool(argument.value), _arg_source(argument)),
                            (_env_flag(environ, env, what), f"env {env}"), (_file_flag(section, key), FILE))
    found["drafter"] = _drafter(section, environ)
    found["draft_temperature"] = _draft_temperature(section, environ)
    found["head_weights"] = _head_weights(section, environ)
    return _settings(found, method)


_PARTS = {"tree": TreeConfig, "verification": Verification, "medusa": MedusaTree}  # HeadSettings' dataclass fields


def _settings(found: dict[str, Value | None], method: str | None) -> ParsedSection:
    """HeadSettings from the values found (the rest at their defaults), with every
    field's source."""
    kwargs = {}
    for name, cls in _PARTS.items():
        kwargs[name] = cls(**{f.name: found[f"{name}.{f.name}"].value for f in fields(cls)
                              if found.get(f"{name}.{f.name}")})
    for f in fields(HeadSettings):
        if f.name not in kwargs and found.get(f.name):
            kwargs[f.name] = found[f.name].value
    if kwargs.get("draft_temperature") == 0:  # set to 0: off
        kwargs["draft_temperature"] = None
    if kwargs.get("drafter") is False:  # turned off
        kwargs["drafter"] = None
    settings = HeadSettings(**kwargs)
    if settings.draft_temperature is not None and settings.verification.method == "typical":
        raise ValueError(f"draft_temperature (sampled drafts, from {found['draft_temperature'].source}) must be "
                         f"unset with typical acceptance, got {settings.draft_temperature!r}: typical acceptance "
                         f"never reads q: drop draft_temperature (or unset {ENV_DRAFT_TEMPERATURE}) or use "
                         "lossless verification")
    sources = {}
    for f in fields(HeadSettings):
        names = [f"{f.name}.{g.name}" for g in fields(_PARTS[f.name])] if f.name in _PARTS else [f.name]
        for name in names:
            sources[name] = found[name].source if found.get(name) else DEFAULT
    return ParsedSection(settings, MappingProxyType(sources), method)


def _check_arguments(arguments: Mapping[str, Argument]) -> None:
    allowed = {f"tree.{k}" for k in TREE_KEYS} | set(ARGUMENT_FIELDS)
    wrong = sorted(set(arguments) - allowed)
    if wrong:
        raise ValueError(f"engine arguments given for fields {wrong}: an adapter maps arguments onto "
                         f"{sorted(allowed)} only")


def _first(*candidates: tuple[Any, str]) -> Value | None:
    """The first candidate (value, source) whose value is set (not None or "")."""
    for value, source in candidates:
        if value is not None and value != "":
            return Value(value, source)
    return None


def _arg_source(argument: Argument | None) -> str:
    return "" if argument is None else f"argument {argument.name}"


def _method(section: Mapping, method: str | None) -> str | None:
    given = section.get("method")
    if given is not None and given not in METHODS:
        _fail('specplug "method" in config.json', f"one of {list(METHODS)}", given,
              "write the kind of head this is (specplug train / specplug convert write it)")
    if method is not None and given is not None and given != method:
        raise ValueError(f"the head's specplug section says method {given!r}, but it is served as a {method!r} head: "
                         f"serve it as a {given!r} head, or fix \"method\" in its config.json")
    return method or given


# -- the fields ---------------------------------------------------------------------------


def _env_text(environ: Mapping[str, str], env: str) -> str:
    return (environ.get(env) or "").strip()


def _file_flag(section: Mapping, key: str) -> bool | None:
    if key not in section:
        return None
    value = section[key]
    if not isinstance(value, bool):
        _fail(f'specplug "{key}" in config.json', "true or false", value, f"write true or false, or drop \"{key}\"",
              SettingTypeError)
    return value


def _env_flag(environ: Mapping[str, str], env: str, what: str) -> bool | None:
    text = _env_text(environ, env).lower()
    if not text:
        return None
    if text not in BOOLS:
        _fail(env, "1/true/yes or 0/false/no", text, f"set it to 1 to turn {what} on, 0 to turn it off")
    return BOOLS[text]


def flag(section: Mapping, key: str, environ: Mapping[str, str], env: str, what: str, default: bool = False) -> bool:
    """A true / false key of a head's section (`default` unless set), the environment
    variable `env` (1/true/yes/on or 0/false/no/off) overriding it; both checked."""
    found = _first((_env_flag(environ, env, what), ""), (_file_flag(section, key), ""))
    return default if found is None else found.value


def payoff_flag(environ: Mapping[str, str] = os.environ) -> bool:
    """"payoff" for a drafter without a head section (SGLang's token drafters): on unless
    SPECPLUG_PAYOFF turns it off, checked as for a head."""
    return flag({}, "payoff", environ, ENV_PAYOFF, "payoff control", default=True)


def _tree(section: Mapping, environ: Mapping[str, str], arguments: Mapping[str, Argument]) -> dict[str, Value]:
    file = section.get("tree")
    if file is None:
        file = {}
    if not isinstance(file, Mapping):
        _fail('specplug "tree" in config.json', "an object of TreeConfig fields", file,
              'e.g. {"depth": 4, "topk": 4, "budget": 15}', SettingTypeError)
    _known_tree_keys(file, 'specplug "tree" in config.json')
    env = _env_tree(environ)
    found = {}
    for key in TREE_KEYS:
        argument = arguments.get(f"tree.{key}")
        candidates = [(None if argument is None else argument.value, _arg_source(argument), argument and argument.name),
                      (env.get(key), f"env {ENV_TREE}", f'{ENV_TREE} "{key}"'),
                      (file.get(key), FILE, f"specplug tree.{key} in config.json")]
        for value, _, where in candidates:
            if value is not None:
                _tree_value(key, value, where, argument is not None and where == argument.name)
        value = _first(*[(v, s) for v, s, _ in candidates])
        if value is not None:
            found[f"tree.{key}"] = value
    return found


def _known_tree_keys(tree: Mapping, where: str) -> None:
    unknown = sorted(set(tree) - set(TREE_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; expected a subset of {sorted(TREE_KEYS)}: remove the "
                         "extra keys")


def _env_tree(environ: Mapping[str, str]) -> dict:
    text = _env_text(environ, ENV_TREE)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_TREE} must be a JSON object, got {text!r}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{ENV_TREE} must be a JSON object, got {text!r}: e.g. '{{\"topk\": 2}}'")
    _known_tree_keys(value, ENV_TREE)
    return value


def _tree_value(key: str, value, where: str, argument: bool) -> None:
    if key == "stop_below":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            _fail(where, "a probability in [0, 1)", value, "0 turns early stopping off")
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(where, "an int >= 1", value, "pass a positive value or leave it unset" if argument else
              f"pass a positive {key}")


def _medusa(section: Mapping, environ: Mapping[str, str], num_heads: int | None, found: dict[str, Value],
            arguments: Mapping[str, Argument]) -> dict[str, Value]:
    """The medusa part, and the tree kept within the heads: a depth from anywhere but an
    argument is cut to num_heads, an argument's is refused; shape "chain" sets topk 1 and
    budget = depth."""
    medusa = {}
    accuracies = section.get("head_accuracies")
    if accuracies is not None:
        medusa["medusa.head_accuracies"] = Value(_accuracies(accuracies), FILE)
    file = section.get("choices")
    if file is not None:
        file = _choices(file, 'specplug "choices" in config.json')
    text = _env_text(environ, ENV_MEDUSA_TREE)
    env_source = f"env {ENV_MEDUSA_TREE}"
    if text in ("optimal", "chain"):
        medusa["medusa.shape"] = Value(text, env_source)
    elif text:
        medusa["medusa.shape"] = Value("choices", env_source)
        medusa["medusa.choices"] = Value(_env_choices(text), env_source)
    elif file is not None:
        medusa["medusa.shape"] = Value("choices", FILE)
        medusa["medusa.choices"] = Value(file, FILE)
    choices = medusa.get("medusa.choices")
    if num_heads is not None and choices is not None and max(map(len, choices.value)) > num_heads:
        where = ENV_MEDUSA_TREE if choices.source == env_source else 'specplug "choices" in config.json'
        _fail(where, f"choices no deeper than the number of heads ({num_heads})", max(map(len, choices.value)),
              "drop the deeper paths")
    depth = found.get("tree.depth")
    if num_heads is not None:
        argument = arguments.get("tree.depth")
        if argument is not None and argument.value > num_heads:
            _fail(argument.name, f"at most the number of Medusa heads ({num_heads})", argument.value,
                  f"pass {argument.name} {num_heads} or fewer, or train more heads")
        if (depth.value if depth else TreeConfig.depth) > num_heads:
            found["tree.depth"] = depth = Value(num_heads, depth.source if depth else DEFAULT)
    if medusa.get("medusa.shape", Value("optimal", "")).value == "chain":
        found["tree.topk"] = Value(1, env_source)
        found["tree.budget"] = Value(depth.value if depth else TreeConfig.depth, env_source)
    return medusa


def _accuracies(value) -> tuple[tuple[float, ...], ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(row, list) and row and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in row)
        for row in value)
    if not ok:
        _fail('specplug "head_accuracies" in config.json', "a list per head of its top-k accuracies (numbers)", value,
              "measure them again (specplug train writes them), or drop the key (a prior is used)")
    return tuple(tuple(float(a) for a in row) for row in value)


def _choices(value, where: str) -> tuple[tuple[int, ...], ...]:
    ok = isinstance(value, list) and value and all(
        isinstance(c, list) and c and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in c)
        for c in value)
    if not ok:
        _fail(where, "Medusa choices: a list of top-k index paths like [[0], [1], [0, 0]]", value,
              "fix the paths, or drop them for Medusa's optimal tree")
    return tuple(tuple(c) for c in value)


def _env_choices(text: str) -> tuple[tuple[int, ...], ...]:
    """SPECPLUG_MEDUSA_TREE's choices: inline JSON or a JSON file holding them."""
    source = Path(text).read_text() if Path(text).is_file() else text
    try:
        value = json.loads(source)
    except json.JSONDecodeError:
        value = None
    try:
        return _choices(value, ENV_MEDUSA_TREE)
    except ValueError:
        _fail(ENV_MEDUSA_TREE, f"one of {MEDUSA_SHAPES[:2]}, JSON Medusa choices like [[0], [1], [0, 0]], or a JSON "
              "file with them", text, "fix the environment variable")


def _verification(section: Mapping, arguments: Mapping[str, Argument]) -> dict[str, Value]:
    found = {}
    if section.get("verification") is not None:
        method = _verification_method(section["verification"], f'specplug "verification" in {FILE}', from_file=True)
        found["verification.method"] = Value(method, FILE)
    for name in ("typical_epsilon", "typical_delta"):
        argument = arguments.get(f"verification.{name}")
        if argument is not None:
            found[f"verification.{name}"] = Value(_threshold(argument.value, argument.name), _arg_source(argument))
    asked = next((found[k] for k in ("verification.typical_epsilon", "verification.typical_delta") if k in found), None)
    if asked is not None:
        found["verification.method"] = Value("typical", asked.source)
        logger.warning("typical acceptance (LOSSY) asked by %s: accepted drafts no longer follow the target's "
                       "distribution at T > 0", asked.source.removeprefix("argument "))
    return found


def _drafter(section: Mapping, environ: Mapping[str, str]) -> Value | None:
    """Hybrid drafting (drafter_registry.drafter_choice: SPECPLUG_DRAFTER over SPECPLUG_RETRIEVAL
    over the section's "retrieval" / "drafter"); the section's value checked even when
    overridden, the effective drafter against the registry."""
    drafter_choice(section, {})
    choice = drafter_choice(section, environ)
    env = next((e for e in (ENV_DRAFTER, ENV_RETRIEVAL) if _env_text(environ, e)), None)
    source = f"env {env}" if env else FILE if ("drafter" in section or "retrieval" in section) else None
    if source is None:
        return None
    if choice is not None:
        try:
            check_choice(choice)
        except ValueError as exc:
            raise ValueError(f"specplug drafter (from {source}): {exc}") from exc
    return Value(False if choice is None else choice, source)


def _draft_temperature(section: Mapping, environ: Mapping[str, str]) -> Value | None:
    file = section.get("draft_temperature")
    if file is not None and file != "":
        file = _temperature(file, "specplug.draft_temperature in the head's config.json")
    env = _env_text(environ, ENV_DRAFT_TEMPERATURE)
    if env:
        _temperature(env, ENV_DRAFT_TEMPERATURE)
        env = float(env)
    return _first((env, f"env {ENV_DRAFT_TEMPERATURE}"), (file, FILE))


def _head_weights(section: Mapping, environ: Mapping[str, str]) -> Value | None:
    """SPECPLUG_HEAD_WEIGHTS > SPECPLUG_HEAD_INT8 > the section's "head_weights" > its
    older "head_int8" (true = "int8", false = "float")."""
    file = section.get("head_weights")
    if file is not None:
        _weights(file, 'specplug "head_weights" in config.json')
    env = _env_text(environ, ENV_HEAD_WEIGHTS).lower()
    if env:
        _weights(env, ENV_HEAD_WEIGHTS)
    as_format = {True: "int8", False: "float", None: None}
    return _first((env, f"env {ENV_HEAD_WEIGHTS}"),
                  (as_format[_env_flag(environ, ENV_HEAD_INT8, "int8 head weights")], f"env {ENV_HEAD_INT8}"),
                  (file, FILE), (as_format[_file_flag(section, "head_int8")], FILE))
