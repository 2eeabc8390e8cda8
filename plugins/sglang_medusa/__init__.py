"""SGLang adapter: Medusa heads with tree verification (entry point `sglang.srt.plugins`).

`register()` runs in every SGLang process (SGLang's load_plugins()). On the supported
SGLang, with every specplug module importable, it
- installs tree verification for the torch_native attention backend (tree_attention.py),
- registers the speculative algorithms "MEDUSA" (Medusa heads; worker.py),
  "SPECPLUG_EAGLE3" (EAGLE-3 heads with dynamic trees; eagle_worker.py) and one per
  registered token drafter (token_worker.py): "RETRIEVAL" (specplug's model-free
  retrieval drafter), "DRAFT_MODEL", "SELF_SPEC" and any a plugin adds; all verified by
  tree_worker.py (spec.py registers them),
- refuses structured-output requests on their servers with a 400 (admission.py),
- opt-in (SPECPLUG_SGLANG_CPU_LINEAR=onednn): fp32 CPU linears through oneDNN with packed
  weights, in every SGLang process (cpu_linear.py).
Each is a patch of group ACTIVE in patches.py (`PATCHES`, the one list of every SGLang
name specplug hooks or registers with). PATCH_SITES (derived from PATCHES) lists the
SGLang names they need; `patch_sites_found()` says which the installed SGLang has.

On another SGLang version, or when one of specplug's modules fails to import (all are
imported before any hook is registered), specplug stays out: SGLang runs as without it,
one WARNING says why, and only the STAY_OUT patches are applied: specplug's algorithm
names are registered as refusing stubs (plus an AROUND hook on the algorithm-alias
resolver, which reads a Medusa head folder before any algorithm's validation): a server
started with one of them refuses before any model loads, naming the installed and
supported versions (or the failed import) and the fix. `ACTIVATION` records what register() decided.
SGLang is imported only inside register(), so `import specplug` works without it.
"""

import logging

from specplug.common.activation import Activation, decide, not_registered, sites_found, stay_out_reason
from specplug.common.patches import ACTIVE
from specplug.sglang_medusa.patches import (
    CPU_LINEAR, FORWARD_EXTEND, PATCHES, REFUSED_ALGORITHMS, REFUSED_ALIAS, REGISTER_SITE,
    SUPPORTED_SGLANG,
)

logger = logging.getLogger(__name__)

VERSION_FIX = "pip install 'specplug[sglang]'"
# specplug's modules register(), its hooks and the schedulers' workers need, imported
# before anything is hooked (the workers add ~40 ms to a process that has SGLang loaded)
ADAPTER_MODULES = (
    "specplug.sglang_medusa.settings",
    "specplug.sglang_medusa.spec",
    "specplug.sglang_medusa.spec_algo",
    "specplug.sglang_medusa.admission",
    "specplug.sglang_medusa.cpu_linear",
    "specplug.sglang_medusa.tree_attention",
    "specplug.sglang_medusa.tree_worker",
    "specplug.sglang_medusa.worker",
    "specplug.sglang_medusa.eagle_worker",
    "specplug.sglang_medusa.token_worker",
)
# Every SGLang name the patches need (patches.py: hook targets, HookRegistry.register,
# SpeculativeAlgorithm.register; docs/architecture.md has the names specplug reads and
# subclasses too).
PATCH_SITES: tuple[str, ...] = PATCHES.sites()
ACTIVATION: Activation = not_registered("SGLang")


def check_sglang_version(installed: str) -> None:
    """Raise RuntimeError unless `installed` is the SGLang the adapter was tested with: it
    hooks SGLang internals (docs/architecture.md lists them), so another version must not
    be patched (register() then stays out)."""
    if installed.split("+")[0] != SUPPORTED_SGLANG:
        raise RuntimeError(
            f"specplug's SGLang adapter supports sglang {SUPPORTED_SGLANG}, found {installed}: install it "
            f"({VERSION_FIX})")


def patch_sites_found() -> dict[str, bool]:
    """{PATCH_SITES name: whether the installed SGLang has it}; imports only the SGLang
    modules named, hooks nothing."""
    return sites_found(PATCH_SITES)


def register() -> None:
    """Entry point run by SGLang's load_plugins() in every process; imports SGLang lazily,
    never raises for an unsupported SGLang or a broken specplug install (it stays out)."""
    global ACTIVATION
    installed = _installed_sglang()
    reason = stay_out_reason("SGLang", installed, check_sglang_version, ADAPTER_MODULES)
    ACTIVATION = decide(installed, reason, _activate, _stay_out)


def _installed_sglang() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown (no sglang distribution metadata)"


def _activate() -> None:
    """Register the hooks and algorithms (the version is supported and every module imported)."""
    from specplug.sglang_medusa import cpu_linear, spec

    PATCHES.apply(ACTIVE)  # one INFO line names every patch applied
    cpu_linear.announce(all(PATCHES.state(name).applied for name in CPU_LINEAR))
    tokens = sorted(spec.TOKEN_ALGORITHMS)
    logger.info("specplug: registered speculative algorithms MEDUSA, SPECPLUG_EAGLE3, %s and torch_native tree "
                "verification (AROUND hook on %s)", ", ".join(tokens), FORWARD_EXTEND)


def _stay_out(reason: str) -> None:
    """Leave SGLang as it is, but for refusing stubs of specplug's algorithms; one WARNING says why."""
    try:
        state = PATCHES.apply_one(REFUSED_ALGORITHMS, reason, log=False)
        refused = state.value if state.applied else None
        if refused:
            PATCHES.apply_one(REFUSED_ALIAS, tuple(refused), reason, log=False)
        missing = (f"{REGISTER_SITE}: {state.reason}" if not state.applied else
                   "SGLang or another plugin has them all")
    except Exception as exc:  # staying out must never break the engine: say so and go on
        refused, missing = None, f"registering them failed: {type(exc).__name__}: {exc}"
    logger.warning(
        "specplug stays out of this SGLang process, which runs as without specplug: %s. %s", reason,
        f"Servers started with --speculative-algorithm {' / '.join(refused)} refuse to start." if refused else
        f"Its algorithm names are not refused either ({missing}).")
