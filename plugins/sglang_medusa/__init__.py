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
PATCH_SITES lists every SGLang name hooked or registered; `patch_sites_found()` says
which the installed SGLang has.

On another SGLang version, or when one of specplug's modules fails to import (all are
imported before any hook is registered), specplug stays out: SGLang runs as without it,
one WARNING says why, and specplug's algorithm names are registered as refusing stubs
(plus an AROUND hook on the algorithm-alias resolver, which reads a Medusa head folder
before any algorithm's validation): a server started with one of them refuses before any
model loads, naming the installed and supported versions (or the failed import) and the
fix. `ACTIVATION` records what register() decided.
SGLang is imported only inside register(), so `import specplug` works without it.
"""

import logging

from specplug.common.activation import Activation, import_error, not_registered, sites_found

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.23"
VERSION_FIX = "pip install 'specplug[sglang]'"
IMPORT_FIX = "reinstall specplug (pip install --force-reinstall --no-deps specplug)"
# specplug's algorithms (spec.py: NAME, EAGLE3; token drafters built into
# specplug.common.hooks, upper case), refused by name when specplug stays out
ALGORITHMS = ("MEDUSA", "SPECPLUG_EAGLE3", "RETRIEVAL", "DRAFT_MODEL", "SELF_SPEC")
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
ALIAS_SITE = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
REGISTER_SITE = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.register"
# Every SGLang name specplug hooks (HookRegistry targets: tree_attention.TARGET,
# admission.TARGET, cpu_linear's two, spec.ALIAS_TARGET / CONFIG_TARGET) or registers with
# (docs/architecture.md has the names it reads and subclasses too).
PATCH_SITES: tuple[str, ...] = (
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
    "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",  # opt-in
    "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",  # opt-in
    ALIAS_SITE,
    "sglang.srt.utils.hf_transformers.config.get_config",
    REGISTER_SITE,  # the algorithms above (or their refusing stubs)
    "sglang.srt.plugins.hook_registry.HookRegistry.register",
)
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
    reason = _stay_out_reason(installed)
    if reason is not None:
        ACTIVATION = Activation(active=False, reason=reason, engine_version=installed)
        _stay_out(reason)
        return
    _activate()
    ACTIVATION = Activation(active=True, reason=None, engine_version=installed)


def _installed_sglang() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown (no sglang distribution metadata)"


def _stay_out_reason(installed: str) -> str | None:
    """Why specplug must not hook this SGLang (None: it may): the version, or a failed import."""
    try:
        check_sglang_version(installed)
    except RuntimeError as exc:
        return str(exc)
    error = import_error(ADAPTER_MODULES)
    if error is None:
        return None
    return f"specplug's SGLang adapter could not load: {error}: {IMPORT_FIX}"


def _activate() -> None:
    """Register the hooks and algorithms (the version is supported and every module imported)."""
    from specplug.sglang_medusa import admission, cpu_linear, spec, tree_attention

    tree_attention.install()
    admission.install()
    cpu_linear.install()  # opt-in: SPECPLUG_SGLANG_CPU_LINEAR=onednn
    spec.register_medusa()
    spec.register_eagle3()
    tokens = spec.register_token_drafters()
    logger.info("specplug: registered speculative algorithms MEDUSA, SPECPLUG_EAGLE3, %s and torch_native tree verification "
                "(AROUND hook on %s)", ", ".join(tokens), tree_attention.TARGET)


def _stay_out(reason: str) -> None:
    """Leave SGLang as it is, but for refusing stubs of specplug's algorithms; one WARNING says why."""
    try:
        refused = _refuse_specplug_algorithms(reason)
        missing = f"{REGISTER_SITE} not found" if refused is None else "SGLang or another plugin has them all"
    except Exception as exc:  # staying out must never break the engine: say so and go on
        refused, missing = None, f"registering them failed: {type(exc).__name__}: {exc}"
    logger.warning(
        "specplug stays out of this SGLang process, which runs as without specplug: %s. %s", reason,
        f"Servers started with --speculative-algorithm {' / '.join(refused)} refuse to start." if refused else
        f"Its algorithm names are not refused either ({missing}).")


def _refuse_specplug_algorithms(reason: str) -> list[str] | None:
    """Register each specplug algorithm name SGLang does not know with a validation that
    raises the refusal, and hook the alias resolver (which reads a Medusa head folder
    first); SGLang's public plugin API only. Returns the names refused (None without the API)."""
    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import get_spec
    except ImportError:
        return None

    def refuse(server_args):
        raise _refusal(getattr(server_args, "speculative_algorithm", None), reason)

    refused = []
    for name in _algorithm_names():
        if get_spec(name) is not None:
            continue  # another plugin's algorithm of that name
        try:
            SpeculativeAlgorithm.register(name, validate_server_args=refuse)(refuse)
        except ValueError:  # a name this SGLang reserves for its own algorithms
            continue
        refused.append(name)
    _refuse_before_alias(tuple(refused), reason)
    return refused


def _refusal(algorithm: str | None, reason: str) -> RuntimeError:
    """The start-up error of a server asked for a specplug algorithm while specplug stays out."""
    return RuntimeError(f"--speculative-algorithm {algorithm} is specplug's, but specplug is not active in this "
                        f"SGLang: {reason}")


def _refuse_before_alias(names: tuple[str, ...], reason: str) -> None:
    """AROUND hook on SGLang's algorithm-alias resolver, which parses --speculative-draft-model-path
    as a transformers config (failing for a Medusa head folder) before any algorithm's
    validation runs. Skipped where SGLang has no such resolver."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        pkgutil.resolve_name(ALIAS_SITE)
    except (ImportError, AttributeError):
        return

    def resolve_alias(original, speculative_algorithm, *args, **kwargs):
        if str(speculative_algorithm or "").upper() in names:
            raise _refusal(speculative_algorithm, reason)
        return original(speculative_algorithm, *args, **kwargs)

    HookRegistry.register(ALIAS_SITE, resolve_alias, HookType.AROUND)


def _algorithm_names() -> tuple[str, ...]:
    """ALGORITHMS plus the token drafters third-party plugins add, where specplug's drafter
    registry still loads (it may be what failed)."""
    try:
        from specplug.common.token_drafters import token_drafter_names

        extra = tuple(name.upper() for name in token_drafter_names())
    except Exception:  # a broken install or plugin: the built-in names are still refused
        extra = ()
    return tuple(dict.fromkeys(ALGORITHMS + extra))
