"""Whether an engine adapter is active in a process, and why not: the record an adapter's
`register()` leaves (`Activation`), the import check it runs before it patches anything
(`import_error`), and the look-up of the engine names it patches (`sites_found`).

Standard library only, and engine-free: the adapters import it before anything else, so
an adapter whose other modules fail to import can still say why it stayed out.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

FIELDS = ("active", "reason", "engine_version")
IMPORT_FIX = "reinstall specplug (pip install --force-reinstall --no-deps specplug)"


@dataclass(frozen=True)
class Activation:
    """What an adapter's register() decided in this process.

    active: specplug's hooks are installed in the engine.
    reason: why not (None when active): the installed and the supported engine versions,
      or the import that failed, each with its fix.
    engine_version: the engine version register() saw ("" before register() ran).
    Reads as a mapping too: `activation["active"]`, `dict(activation)`.
    """

    active: bool
    reason: str | None
    engine_version: str

    def keys(self) -> tuple[str, ...]:
        return FIELDS

    def __getitem__(self, key: str):
        if key not in FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def as_dict(self) -> dict:
        return asdict(self)


def version_check(engine: str, supported: tuple[str, ...], fix: str) -> Callable[[str], None]:
    """A check that raises RuntimeError unless a version (local suffix "+cpu" ignored) is
    one of `supported`, the versions the adapter was tested with, naming them and `fix`."""

    def check(version: str) -> None:
        if version.split("+")[0] not in supported:
            raise RuntimeError(f"specplug's {engine} adapter supports {engine} {', '.join(supported)}, "
                               f"found {version}: install a supported version: {fix}")

    return check


class _ToEngineLog(logging.Handler):
    """Hands specplug's records to the engine's logger, whose handlers the engine configures."""

    def __init__(self, engine_logger: str):
        super().__init__()
        self.engine_logger = engine_logger

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(self.engine_logger).handle(record)


def log_like_engine(engine_logger: str) -> None:
    """Make specplug's INFO lines appear in the engine's log, formatted like its own."""
    ours = logging.getLogger("specplug")
    if not any(isinstance(h, _ToEngineLog) for h in ours.handlers):
        ours.addHandler(_ToEngineLog(engine_logger))
        if ours.level == logging.NOTSET:
            ours.setLevel(logging.INFO)
        ours.propagate = False


def not_registered(engine: str) -> Activation:
    """The record before register() runs (a process the engine has not loaded plugins in)."""
    return Activation(active=False, reason=f"{engine} has not run specplug's register() in this process",
                      engine_version="")


def stay_out_reason(engine: str, version: str, check_version: Callable[[str], None],
                    modules: Iterable[str]) -> str | None:
    """Why an adapter must not patch `engine` at `version` (None: it may): check_version's
    RuntimeError, else the first of `modules` that fails to import, with the fix."""
    try:
        check_version(version)
    except RuntimeError as exc:
        return str(exc)
    error = import_error(modules)
    return None if error is None else f"specplug's {engine} adapter could not load: {error}: {IMPORT_FIX}"


def decide(version: str, reason: str | None, activate: Callable[[], None],
           stay_out: Callable[[str], None]) -> Activation:
    """Run `activate()` when there is no `reason` to stay out, else `stay_out(reason)`;
    the record of what was decided."""
    if reason is not None:
        stay_out(reason)
        return Activation(active=False, reason=reason, engine_version=version)
    activate()
    return Activation(active=True, reason=None, engine_version=version)


def import_error(modules: Iterable[str]) -> str | None:
    """Import every module in turn; None when all import, else which one failed and how."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a broken install can raise anything at import time
            return f"import {name} failed ({type(exc).__name__}: {exc})"
    return None


def sites_found(sites: Iterable[str]) -> dict[str, bool]:
    """{dotted name: whether it resolves} for "module.attr" / "module.Class.attr" names,
    importing the modules they name and nothing else."""
    return {site: _resolves(site) for site in sites}


def _resolves(site: str) -> bool:
    try:
        pkgutil.resolve_name(site)
    except Exception:  # ImportError, AttributeError, or whatever a module raises on import
        return False
    return True


def refuse_specplug_head(engine: str, model, config, reason: str) -> None:
    """Raise RuntimeError when a draft model has a `specplug` section: in `config` (a dict or
    a transformers config), or when config is None in `model`'s local config.json."""
    if config is None:
        config = _local_config(model)
    section = config.get("specplug") if isinstance(config, dict) else getattr(config, "specplug", None)
    if section:
        raise RuntimeError(f"{model} is a specplug head (its config.json has a 'specplug' section), but specplug "
                           f"is not active in this {engine}: {reason}")


def _local_config(model) -> dict | None:
    """The config.json of a local draft model folder, else None (the engine reports an
    unreadable one itself)."""
    if not isinstance(model, str) or not (Path(model) / "config.json").is_file():
        return None
    try:
        return json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
