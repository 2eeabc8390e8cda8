"""How an engine chooses and builds a token drafter (specplug.common.token_drafters): a
head section's "drafter" / "retrieval" or SPECPLUG_DRAFTER as a DrafterChoice, the class
registered under its name (the ``specplug_drafters`` hook), its settings checked, built."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .hooks import drafters, get_drafter
from .retrieval.config import ENV_RETRIEVAL, retrieval_fields, retrieval_override
from .token_drafters import TokenDrafter

ENV_DRAFTER = "SPECPLUG_DRAFTER"  # a registered drafter's name, or {"name": ..., its fields}; "0" = off


@dataclass(frozen=True)
class DrafterChoice:
    """A registered token drafter's name and the settings it is built with."""

    name: str
    settings: Mapping[str, Any] = field(default_factory=dict)


def _parse_env(text: str):
    text = text.strip()
    if text.lower() in ("0", "false", "off"):
        return False
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV_DRAFTER} must be a drafter name or a JSON object, got {text!r}: {exc}") from exc
    return text


def _choice(value, where: str) -> DrafterChoice:
    """A "drafter" value (a name or {"name": ..., fields}) as a DrafterChoice."""
    if isinstance(value, str) and value:
        return DrafterChoice(value)
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return DrafterChoice(value["name"], {k: v for k, v in value.items() if k != "name"})
    raise ValueError(f"{where} must be a registered drafter's name or an object with \"name\" and its fields, "
                     f"got {value!r}: e.g. \"retrieval\" or {{\"name\": \"retrieval\", \"budget\": 4}}")


def env_choice(environ: Mapping[str, str] = os.environ, default_name: str | None = None):
    """SPECPLUG_DRAFTER as given: None (unset), False ("0" / "off") or a DrafterChoice (a
    name, or a JSON object of fields with "name"; without it, `default_name`)."""
    text = environ.get(ENV_DRAFTER, "").strip()
    if not text:
        return None
    value = _parse_env(text)
    if isinstance(value, Mapping) and "name" not in value and default_name is not None:
        value = {"name": default_name, **value}
    return value if value is False else _choice(value, ENV_DRAFTER)


def drafter_choice(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> DrafterChoice | None:
    """The token drafter a head's `specplug` section asks for, or None: SPECPLUG_DRAFTER
    if set, else SPECPLUG_RETRIEVAL / the section's "retrieval" (the built-in retrieval
    drafter: true or an object of its fields), else the section's "drafter"."""
    env = env_choice(environ)
    if env is not None:
        return env or None
    if "retrieval" in section and "drafter" in section:
        raise ValueError("the specplug section has both \"retrieval\" and \"drafter\": keep one "
                         "(\"retrieval\": {...} is \"drafter\": {\"name\": \"retrieval\", ...})")
    if retrieval_override(environ) is not None or "retrieval" in section:
        fields = retrieval_fields(section, environ)
        return None if fields is None else DrafterChoice("retrieval", fields)
    return None if section.get("drafter") in (None, False) else _choice(section["drafter"], "specplug \"drafter\"")


def check_choice(choice: DrafterChoice) -> None:
    """Raise ValueError when the drafter is not registered (get_drafter lists the registered
    ones) or its settings are wrong."""
    cls = get_drafter(choice.name)
    try:
        cls.check_settings(dict(choice.settings))
    except ValueError as exc:
        raise ValueError(f"drafter {choice.name!r}: {exc}") from exc


def build(choice: DrafterChoice, vocab_size: int) -> TokenDrafter:
    """The drafter `choice` names, built with its settings."""
    check_choice(choice)
    return get_drafter(choice.name).from_settings(dict(choice.settings), vocab_size)


def bind_target(drafter: TokenDrafter, target) -> None:
    """Hand the engine's loaded target (a drafting.engine_layers.EngineTarget) to a
    drafter that asks for it; every other drafter ignores it."""
    bind = getattr(drafter, "bind_target", None)
    if callable(bind):
        bind(target)


def token_drafter_names() -> list[str]:
    """Registered drafters that speak TokenDrafter (a from_settings classmethod)."""
    return sorted(name for name, obj in drafters().items() if callable(getattr(obj, "from_settings", None)))


# -- a token drafter run as an engine's own algorithm (SGLang's RETRIEVAL, DRAFT_MODEL ...) ----------

# RETRIEVAL's defaults over RetrievalConfig's in SGLang: a tree is verified whole (every
# node, min_prob 0) when its expected accepted length reaches 0.5, else the root alone
# (docs/sglang.md: on the CPU path a verify pass costs nearly the same for 4-9 nodes).
SGLANG_RETRIEVAL = {"min_prob": 0.0, "min_expected": 0.5}
DEFAULT_BUDGET = DEFAULT_DEPTH = 8  # a token drafter's tree size when no argument sets it


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
        """Most tree nodes a step verifies, root included (SGLang's speculative_num_draft_tokens)."""
        return self.budget + 1


def token_drafter_settings(name: str, environ: Mapping[str, str],
                           arguments: Mapping[str, tuple[str, Any]]) -> TokenDrafterSettings:
    """The settings of registered token drafter `name`, its algorithm named NAME.upper()
    in errors: for "retrieval", SGLANG_RETRIEVAL then SPECPLUG_RETRIEVAL's fields; then
    SPECPLUG_DRAFTER's fields; then the engine's `arguments` ({"budget" / "max_depth":
    (argument name, value)}, those given), else DEFAULT_BUDGET / DEFAULT_DEPTH. ValueError
    names the argument or variable and the fix."""
    label = name.upper()
    fields = {**(_retrieval_fields(environ) if name == "retrieval" else {}), **_drafter_fields(name, environ)}
    for key, (argument, value) in arguments.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label}: {argument} must be an int >= 1, got {value!r}: pass a positive value or "
                             "leave it unset")
        fields[key] = value
    choice = DrafterChoice(name, {"budget": DEFAULT_BUDGET, "max_depth": DEFAULT_DEPTH, **fields})
    try:
        check_choice(choice)
    except ValueError as exc:
        raise ValueError(f"{label}: {exc}") from exc
    return TokenDrafterSettings(choice)


def _retrieval_fields(environ: Mapping[str, str]) -> dict:
    override = retrieval_override(environ)
    if override is False:
        raise ValueError(f"RETRIEVAL: {ENV_RETRIEVAL} must be unset, 1 or a JSON object for RETRIEVAL, got "
                         f"{environ.get(ENV_RETRIEVAL)!r}: unset it: RETRIEVAL has no other drafter")
    return {**SGLANG_RETRIEVAL, **(override if isinstance(override, dict) else {})}


def _drafter_fields(name: str, environ: Mapping[str, str]) -> dict:
    """SPECPLUG_DRAFTER's fields, when it names this drafter (or gives no name)."""
    choice = env_choice(environ, default_name=name)
    if choice is None:
        return {}
    if choice is False or choice.name != name:
        other = "" if choice is False else choice.name.upper()
        raise ValueError(f"{name.upper()}: {ENV_DRAFTER} must be the fields of drafter {name!r} (a JSON object, "
                         f"\"name\" {name!r} or none), got {environ.get(ENV_DRAFTER)!r}: the algorithm chooses the "
                         f"drafter; set --speculative-algorithm {other or 'NAME'} or fix the variable")
    return dict(choice.settings)
