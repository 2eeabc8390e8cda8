"""Plugin hooks: pluggy hook specs and the plugin manager (entry-point group "specplug").

Third-party packages extend specplug with drafters, tree builders and verification
samplers without touching its code. A plugin is a module (or object) with
``@hookimpl`` functions, advertised in its package metadata::

    # pyproject.toml of the third-party package
    [project.entry-points.specplug]
    my_plugin = "my_package.specplug_plugin"

    # my_package/specplug_plugin.py
    from specplug.common.hooks import hookimpl

    @hookimpl
    def specplug_samplers():
        return {"my-sampler": my_verify}

Every hook returns ``{name: object}``; names must be unique across plugins (a clash
raises ValueError naming both plugins). Built-in entries live under the same names
the rest of specplug uses ("chain", "from_choices", "optimal_sparse", "dynamic";
"greedy", "rejection", "coupled", "typical").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pluggy

logger = logging.getLogger(__name__)

PROJECT = "specplug"
ENTRY_POINT_GROUP = "specplug"
HOOKS = ("specplug_drafters", "specplug_tree_builders", "specplug_samplers")
BUILTIN_NAME = "specplug.builtins"  # also the name of specplug's own entry point in the group

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = [
    "PROJECT",
    "ENTRY_POINT_GROUP",
    "hookspec",
    "hookimpl",
    "SpecplugHooks",
    "make_plugin_manager",
    "plugin_manager",
    "reset_plugin_manager",
    "drafters",
    "tree_builders",
    "samplers",
    "get_drafter",
    "get_tree_builder",
    "get_sampler",
]


class SpecplugHooks:
    """Hook specifications. Each returns a dict from a unique name to a callable."""

    @hookspec
    def specplug_drafters(self) -> dict[str, Callable]:
        """Token drafters: name -> a class speaking specplug.common.token_drafters.TokenDrafter
        (``from_settings(settings, vocab_size)``, ``check_settings``, per-request state,
        ``draft`` -> TreeBatch). Both engines build them by name: vLLM merges their trees
        with the EAGLE-3 head's (section "drafter" / SPECPLUG_DRAFTER), SGLang runs each
        as ``--speculative-algorithm NAME`` (upper case). Subclass
        ``TokenDrafterBase`` and write ``draft``."""

    @hookspec
    def specplug_tree_builders(self) -> dict[str, Callable]:
        """Tree builders returning a ``DraftTree`` / ``TreeBatch`` (see specplug.common.tree)."""

    @hookspec
    def specplug_samplers(self) -> dict[str, Callable]:
        """Verification samplers with ``specplug.common.sampling.verify``'s signature
        (without ``method``), returning a ``VerifyResult``."""


class _Builtins:
    """specplug's own entries, registered like any plugin."""

    @hookimpl
    def specplug_drafters(self) -> dict[str, Callable]:
        from specplug.common.draft_model import DraftModelTokenDrafter, SelfSpecTokenDrafter
        from specplug.common.retrieval import RetrievalDrafter

        return {"retrieval": RetrievalDrafter, "draft_model": DraftModelTokenDrafter, "self_spec": SelfSpecTokenDrafter}

    @hookimpl
    def specplug_tree_builders(self) -> dict[str, Callable]:
        from specplug.common import merge
        from specplug.common.dynamic_trees import dynamic
        from specplug.common.static_trees import chain, from_choices, optimal_sparse

        return {
            "chain": chain,
            "from_choices": from_choices,
            "optimal_sparse": optimal_sparse,
            "dynamic": dynamic,
            "merge": merge.merge_trees,
        }

    @hookimpl
    def specplug_samplers(self) -> dict[str, Callable]:
        from specplug.common import sampling

        return {m: functools.partial(sampling.verify, method=m) for m in sampling.METHODS}


BUILTINS = _Builtins()


def make_plugin_manager(load_entrypoints: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hook specs, the built-ins and (by default) every plugin
    advertised under the entry-point group ``specplug``."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(SpecplugHooks)
    pm.register(BUILTINS, name=BUILTIN_NAME)  # before entry points: ours is then skipped
    if load_entrypoints:
        count = pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        if count:
            names = [n for n, _ in pm.list_name_plugin() if n != BUILTIN_NAME]
            logger.info("specplug: loaded %d plugin(s) from entry points: %s", count, ", ".join(names))
    return pm


_manager: pluggy.PluginManager | None = None  # the plugin registry (module state by design)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, built on first use."""
    global _manager
    if _manager is None:
        _manager = make_plugin_manager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (the next call rebuilds it, re-reading entry points)."""
    global _manager
    _manager = None


def _collect(hook_name: str, pm: pluggy.PluginManager | None) -> dict[str, Callable]:
    pm = pm or plugin_manager()
    merged: dict[str, Callable] = {}
    owner: dict[str, str] = {}
    for impl in getattr(pm.hook, hook_name).get_hookimpls():  # registration order
        result = impl.function()  # hooks take no arguments; object plugins give bound methods
        if result is None:
            continue
        if not isinstance(result, dict):
            raise TypeError(f"plugin {impl.plugin_name!r}: {hook_name} must return a dict name -> object, "
                            f"got {type(result).__name__}")
        for name, obj in result.items():
            if name in merged:
                raise ValueError(
                    f"{hook_name}: name {name!r} is provided by both {owner[name]!r} and "
                    f"{impl.plugin_name!r}: rename one of them"
                )
            merged[name], owner[name] = obj, impl.plugin_name
    return merged


def drafters(pm: pluggy.PluginManager | None = None) -> dict[str, Callable]:
    return _collect("specplug_drafters", pm)


def tree_builders(pm: pluggy.PluginManager | None = None) -> dict[str, Callable]:
    return _collect("specplug_tree_builders", pm)


def samplers(pm: pluggy.PluginManager | None = None) -> dict[str, Callable]:
    return _collect("specplug_samplers", pm)


def _get(kind: str, table: dict[str, Callable], name: str) -> Callable:
    if name not in table:
        raise ValueError(
            f"unknown {kind} {name!r}; available: {sorted(table)}: install the plugin that "
            f"provides it (entry-point group {ENTRY_POINT_GROUP!r}) or pick an available one"
        )
    return table[name]


def get_drafter(name: str, pm: pluggy.PluginManager | None = None) -> Callable:
    return _get("drafter", drafters(pm), name)


def get_tree_builder(name: str, pm: pluggy.PluginManager | None = None) -> Callable:
    return _get("tree builder", tree_builders(pm), name)


def get_sampler(name: str, pm: pluggy.PluginManager | None = None) -> Callable:
    return _get("sampler", samplers(pm), name)
