"""SGLang adapter (entry point `sglang.srt.plugins`): `register()` runs in every SGLang
process and applies the ACTIVE patches of patches.py (`PATCHES`, the one list of every
SGLang name specplug hooks or registers with): tree verification for torch_native
(tree_attention.py), the algorithms MEDUSA (worker.py), SPECPLUG_EAGLE3 (eagle_worker.py)
and one per registered token drafter (token_worker.py), all verified by tree_worker.py;
the refusal of structured-output requests (admission.py); opt-in oneDNN CPU linears
(cpu_linear.py).

On another SGLang version, or when a specplug module fails to import, specplug stays
out: one WARNING says why and only the STAY_OUT patches apply (specplug's algorithm names
refuse at start-up, naming the fix). `ACTIVATION` records what register() decided.
SGLang is imported only inside register(), so `import specplug` works without it.
"""

import logging

from specplug.common.activation import (
    Activation, decide, not_registered, sites_found, stay_out_reason, version_check,
)
from specplug.common.patches import ACTIVE
from specplug.sglang_medusa.patches import (
    CPU_LINEAR, FORWARD_EXTEND, PATCHES, REFUSED_ALGORITHMS, REFUSED_ALIAS, REGISTER_SITE,
    SUPPORTED_SGLANG,
)

logger = logging.getLogger(__name__)

VERSION_FIX = "pip install 'specplug[sglang]'"
# imported before anything is hooked: a module that fails to import keeps specplug out
ADAPTER_MODULES = tuple(f"specplug.sglang_medusa.{name}" for name in (
    "settings", "spec", "spec_algo", "admission", "cpu_linear", "tree_attention", "tree_worker", "worker",
    "eagle_worker", "token_worker"))
PATCH_SITES: tuple[str, ...] = PATCHES.sites()
ACTIVATION: Activation = not_registered("SGLang")
check_sglang_version = version_check("SGLang", (SUPPORTED_SGLANG,), VERSION_FIX)


def patch_sites_found() -> dict[str, bool]:
    """{PATCH_SITES name (every SGLang name the patches need): whether the installed SGLang
    has it}; hooks nothing."""
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
