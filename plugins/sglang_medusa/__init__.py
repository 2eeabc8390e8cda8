"""SGLang adapter: Medusa heads with tree verification (entry point `sglang.srt.plugins`).

`register()` runs in every SGLang process (SGLang's load_plugins()). It
- installs tree verification for the torch_native attention backend (tree_attention.py),
- registers the speculative algorithms "MEDUSA" (Medusa heads; worker.py),
  "SPECPLUG_EAGLE3" (EAGLE-3 heads with dynamic trees; eagle_worker.py) and one per
  registered token drafter (token_worker.py): "RETRIEVAL" (specplug's model-free
  retrieval drafter) and any a plugin adds; all verified by tree_worker.py (spec.py
  registers them),
- refuses structured-output requests on their servers with a 400 (admission.py),
- opt-in (SPECPLUG_SGLANG_CPU_LINEAR=onednn): fp32 CPU linears through oneDNN with packed
  weights, in every SGLang process (cpu_linear.py).
SGLang is imported only inside register(), so `import specplug` works without it.
"""

import logging

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.23"


def check_sglang_version(installed: str) -> None:
    """Raise RuntimeError unless `installed` is the SGLang the adapter was tested with: it
    hooks SGLang internals (docs/architecture.md lists them), so another version must not
    be patched. SGLang's load_plugins logs the error and starts without specplug."""
    if installed.split("+")[0] != SUPPORTED_SGLANG:
        raise RuntimeError(
            f"specplug's SGLang adapter supports sglang {SUPPORTED_SGLANG}, found {installed}: install it "
            "(pip install 'specplug[sglang]'), or skip the plugin with SGLANG_PLUGINS set to the other "
            "plugins you use")


def register() -> None:
    """Entry point run by SGLang's load_plugins() in every process; imports SGLang lazily."""
    from importlib.metadata import version

    from specplug.sglang_medusa import admission, cpu_linear, spec, tree_attention

    check_sglang_version(version("sglang"))
    tree_attention.install()
    admission.install()
    cpu_linear.install()  # opt-in: SPECPLUG_SGLANG_CPU_LINEAR=onednn
    spec.register_medusa()
    spec.register_eagle3()
    tokens = spec.register_token_drafters()
    logger.info("specplug: registered speculative algorithms MEDUSA, SPECPLUG_EAGLE3, %s and torch_native tree verification "
                "(AROUND hook on %s)", ", ".join(tokens), tree_attention.TARGET)
