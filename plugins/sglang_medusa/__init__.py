"""SGLang adapter: Medusa heads with tree verification (entry point `sglang.srt.plugins`).

`register()` runs in every SGLang process (SGLang's load_plugins()). It
- installs tree verification for the torch_native attention backend (tree_attention.py),
- registers the speculative algorithms "MEDUSA" (Medusa heads; worker.py) and one per
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


def register() -> None:
    """Entry point run by SGLang's load_plugins() in every process; imports SGLang lazily."""
    from importlib.metadata import version

    from specplug.sglang_medusa import admission, cpu_linear, spec, tree_attention

    installed = version("sglang")
    if installed != SUPPORTED_SGLANG:
        logger.warning("specplug's SGLang plugin is built for sglang==%s, found %s: internal APIs "
                       "may differ", SUPPORTED_SGLANG, installed)
    tree_attention.install()
    admission.install()
    cpu_linear.install()  # opt-in: SPECPLUG_SGLANG_CPU_LINEAR=onednn
    spec.register_medusa()
    tokens = spec.register_token_drafters()
    logger.info("specplug: registered speculative algorithms MEDUSA, %s and torch_native tree verification "
                "(AROUND hook on %s)", ", ".join(tokens), tree_attention.TARGET)
