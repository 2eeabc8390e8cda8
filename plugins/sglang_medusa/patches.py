"""Every SGLang name specplug hooks or registers with, declared once
(specplug.common.patches): `PATCHES`, in the order register() applies them, each with the
original it expects. AROUND hooks go through SGLang's `HookRegistry.register`, algorithms
through `SpeculativeAlgorithm.register`; hooks are named "module:name" and resolved only
when applied. Standard library only: the stay-out refusals below must work when
specplug's other modules fail to import.
"""

from __future__ import annotations

import importlib.metadata

from specplug.common.patches import REGISTERED, STAY_OUT, Expect, Patch, PatchSet, resolve

SUPPORTED_SGLANG = "0.5.23"
HOOKS = "sglang.srt.plugins.hook_registry.HookRegistry.register"  # SGLang's hook API
REGISTER_SITE = "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.register"
ALIAS_SITE = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
CONFIG_SITE = "sglang.srt.utils.hf_transformers.config.get_config"
FORWARD_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
VALIDATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
LINEAR_APPLY = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"
LM_HEAD = "sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head"
# specplug's algorithms (spec.py: NAME, EAGLE3; token drafters built into
# specplug.common.token_drafters, upper case), refused by name when specplug stays out
ALGORITHMS = ("MEDUSA", "SPECPLUG_EAGLE3", "RETRIEVAL", "DRAFT_MODEL", "SELF_SPEC")
CPU_LINEAR = ("UnquantizedLinearMethod.apply", "LogitsProcessor._compute_lm_head")  # the opt-in pair
TOKEN_DRAFTERS = "algorithms of token drafters"
REFUSED_ALGORITHMS = "refusing algorithms"
REFUSED_ALIAS = "refusing alias resolver"
VERSIONS = (SUPPORTED_SGLANG,)


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def around(target: str, hook_ref):
    """A REGISTERED replacement: `hook_ref` (resolved when applied) AROUND `target`; token (target, hook)."""

    def register(original, *args):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        hook = resolve(hook_ref)
        HookRegistry.register(target, hook, HookType.AROUND)
        return target, hook

    return register


def unhook(token) -> None:
    """Undo of around(): the hook taken out of HookRegistry, before SGLang applies it
    (RuntimeError after: SGLang has no way to unhook a target)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    target, hook = token
    if target in HookRegistry._patched:
        raise RuntimeError(f"{target} is hooked already (HookRegistry.apply_hooks ran): SGLang cannot unhook it")
    kept = [entry for entry in HookRegistry._hooks.get(target, []) if entry[1] is not hook]
    if kept:
        HookRegistry._hooks[target] = kept
    else:
        HookRegistry._hooks.pop(target, None)


def unregister_algorithms(names) -> None:
    """Undo of an algorithm registration (SGLang's registry has no unregister: its private dict)."""
    from sglang.srt.speculative import spec_registry

    for name in names or ():
        spec_registry._REGISTRY.pop(name, None)
    try:
        from specplug.sglang_medusa.spec import TOKEN_ALGORITHMS
    except ImportError:
        return
    TOKEN_ALGORITHMS.difference_update(names or ())


# -- the stay-out refusals ---------------------------------------------------------------------

def refusal(algorithm: str | None, reason: str) -> RuntimeError:
    """The start-up error of a server asked for a specplug algorithm while specplug stays out."""
    return RuntimeError(f"--speculative-algorithm {algorithm} is specplug's, but specplug is not active in this "
                        f"SGLang: {reason}")


def refusing_algorithms(register, reason: str) -> list[str]:
    """Register each specplug algorithm name SGLang does not know with a validation that
    raises the refusal; returns the names refused."""
    from sglang.srt.speculative.spec_registry import get_spec

    def refuse(server_args):
        raise refusal(getattr(server_args, "speculative_algorithm", None), reason)

    refused = []
    for name in algorithm_names():
        if get_spec(name) is not None:
            continue  # another plugin's algorithm of that name
        try:
            register(name, validate_server_args=refuse)(refuse)
        except ValueError:  # a name this SGLang reserves for its own algorithms
            continue
        refused.append(name)
    return refused


def refusing_alias(resolve_alias_original, names: tuple[str, ...], reason: str):
    """AROUND the algorithm-alias resolver (which fails on a Medusa head folder before any
    algorithm's validation): `names` refused first."""

    def resolve_alias(original, speculative_algorithm, *args, **kwargs):
        if str(speculative_algorithm or "").upper() in names:
            raise refusal(speculative_algorithm, reason)
        return original(speculative_algorithm, *args, **kwargs)

    return around(ALIAS_SITE, resolve_alias)(resolve_alias_original)


def algorithm_names() -> tuple[str, ...]:
    """ALGORITHMS plus the token drafters third-party plugins add, where specplug's drafter
    registry still loads (it may be what failed)."""
    try:
        from specplug.common.drafter_registry import token_drafter_names

        extra = tuple(name.upper() for name in token_drafter_names())
    except Exception:  # a broken install or plugin: the built-in names are still refused
        extra = ()
    return tuple(dict.fromkeys(ALGORITHMS + extra))


def _method(target: str, *params: str) -> Expect:
    module, qualname = target.rsplit(".", 2)[0], ".".join(target.rsplit(".", 2)[1:])
    return Expect(qualname=qualname, module=module, params=("self", *params))


def _function(target: str, *params: str) -> Expect:
    module, qualname = target.rsplit(".", 1)
    return Expect(qualname=qualname, module=module, params=params)


_REGISTER = Expect(qualname="SpeculativeAlgorithm.register", module="sglang.srt.speculative.spec_info",
                   params=("cls", "name"))


def _hook(name: str, target: str, hook: str, expect: Expect, does: str, files: str, **kw) -> Patch:
    return Patch(name, target, REGISTERED, around(target, hook), expect, does, files, via=HOOKS, unregister=unhook,
                 **kw)


def _algorithm(name: str, replacement, does: str, files: str = "spec.py, spec_algo.py", **kw) -> Patch:
    return Patch(name, REGISTER_SITE, REGISTERED, replacement, _REGISTER, does, files, via=REGISTER_SITE,
                 unregister=unregister_algorithms, **kw)


PATCHES = PatchSet("SGLang", sglang_version, [
    _hook("TorchNativeAttnBackend.forward_extend", FORWARD_EXTEND,
          "specplug.sglang_medusa.tree_attention:forward_extend_tree",
          _method(FORWARD_EXTEND, "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
          "AROUND: TARGET_VERIFY batches get tree attention, all others SGLang's", "tree_attention.py",
          versions=VERSIONS),
    _hook("TokenizerManager._validate_one_request", VALIDATE_REQUEST,
          "specplug.sglang_medusa.admission:validate_one_request", _method(VALIDATE_REQUEST, "obj"),
          "AROUND: specplug algorithms' servers refuse structured-output requests with a 400", "admission.py",
          versions=VERSIONS),
    _hook(CPU_LINEAR[0], LINEAR_APPLY, "specplug.sglang_medusa.cpu_linear:linear_apply",
          _method(LINEAR_APPLY, "layer", "x", "bias"),
          "AROUND: fp32 CPU linears through oneDNN with packed weights", "cpu_linear.py", versions=VERSIONS,
          when="SPECPLUG_SGLANG_CPU_LINEAR=onednn", skip="specplug.common.cpu_linear:not_installed_reason"),
    _hook(CPU_LINEAR[1], LM_HEAD, "specplug.sglang_medusa.cpu_linear:lm_head_logits",
          _method(LM_HEAD, "hidden_states", "lm_head", "embedding_bias"),
          "AROUND: the fp32 CPU LM head through oneDNN with packed weights", "cpu_linear.py", versions=VERSIONS,
          when="SPECPLUG_SGLANG_CPU_LINEAR=onednn", skip="specplug.common.cpu_linear:not_installed_reason"),
    _hook("_resolve_speculative_algorithm_alias", ALIAS_SITE,
          "specplug.sglang_medusa.spec:skip_draft_config_for_medusa", _function(ALIAS_SITE, "speculative_algorithm"),
          "AROUND: MEDUSA and SPECPLUG_EAGLE3 are not aliased (their head folders are no transformers config)",
          "spec.py", versions=VERSIONS),
    _hook("get_config", CONFIG_SITE, "specplug.sglang_medusa.spec:config_for_medusa_heads",
          _function(CONFIG_SITE, "model"),
          "AROUND: a Medusa heads folder (no model_type) reads as a plain PretrainedConfig", "spec.py",
          versions=VERSIONS),
    _algorithm("algorithm MEDUSA", "specplug.sglang_medusa.spec_algo:register_medusa",
               "MEDUSA: Medusa heads, tree verification (worker.py)", versions=VERSIONS),
    _algorithm("algorithm SPECPLUG_EAGLE3", "specplug.sglang_medusa.spec_algo:register_eagle3",
               "SPECPLUG_EAGLE3: EAGLE-3 heads with dynamic trees (eagle_worker.py)", versions=VERSIONS),
    _algorithm(TOKEN_DRAFTERS, "specplug.sglang_medusa.spec_algo:register_token_drafters",
               "one per token drafter: RETRIEVAL, DRAFT_MODEL, SELF_SPEC and plugins' (token_worker.py)",
               versions=VERSIONS),
    _algorithm(REFUSED_ALGORITHMS, refusing_algorithms,
               "refusing stubs of specplug's algorithm names: a server asked for one refuses before any model "
               "loads, naming why specplug stays out and the fix", "patches.py", group=STAY_OUT),
    Patch(REFUSED_ALIAS, ALIAS_SITE, REGISTERED, refusing_alias,
          Expect(qualname="_resolve_speculative_algorithm_alias", params=("speculative_algorithm",)),
          "AROUND: the refused names fail before the resolver reads a Medusa head folder", "patches.py",
          group=STAY_OUT, via=HOOKS, unregister=unhook),
])
