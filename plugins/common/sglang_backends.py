"""Which SGLang attention backends verify specplug's trees, and which tree-mask layout each
reads (sglang_trees): what every specplug algorithm checks on SGLang's server arguments
before any model loads, and its worker on the resolved device."""

from __future__ import annotations

import os

# Attention backends whose TARGET_VERIFY pass reads specplug's tree masks correctly.
# torch_native: specplug's hook (sglang_medusa/tree_attention.py) on any device. triton: SGLang's own
# extend kernel reading the prefix-included mask (common.sglang_trees), proven equal to
# the hook by tests/sglang/test_triton_tree_mask.py under Triton's interpreter.
CPU_TREE_BACKENDS = ("torch_native",)
GPU_TREE_BACKENDS = ("triton", "torch_native")
# The backends that read a tree-only mask with any node count per step (the hook);
# every other proven one gets the prefix-included mask over speculative_num_draft_tokens nodes.
TREE_ONLY_BACKENDS = ("torch_native",)
ENV_PREFIX_MASKS = "SPECPLUG_SGLANG_PREFIX_MASKS"


def check_attention_backends(device: str, backends: dict[str, str | None], algorithm: str = "MEDUSA") -> None:
    """Refuse an attention backend not proven to verify specplug's trees on `device`.

    backends: option name -> value ("--attention-backend": "fa3", ...); None = not set.
    Invariant: after this returns, every backend a TARGET_VERIFY pass may run on is in
    CPU_TREE_BACKENDS ("cpu") or GPU_TREE_BACKENDS (any other device)."""
    proven = CPU_TREE_BACKENDS if str(device) == "cpu" else GPU_TREE_BACKENDS
    for option, backend in backends.items():
        if backend is not None and backend not in proven:
            raise ValueError(
                f"{algorithm} on {device} verifies trees only with the attention backends proven to read "
                f"its tree mask ({', '.join(proven)}), got {option} {backend}: pass "
                + " or ".join(f"--attention-backend {b}" for b in proven)
                + (" and drop --prefill-attention-backend / --decode-attention-backend"
                   if option != "--attention-backend" else ""))


def prefix_masks_needed(backends: dict[str, str | None]) -> bool:
    """Whether a verify step hands SGLang prefix-included masks over speculative_num_draft_tokens
    nodes (what its GPU backends read) rather than tree-only masks over the nodes drafted:
    True unless every backend set is in TREE_ONLY_BACKENDS, or when ENV_PREFIX_MASKS is "1"
    (the torch_native hook reads both layouts, so a CPU engine can run the GPU one)."""
    if os.environ.get(ENV_PREFIX_MASKS, "0") == "1":
        return True
    return any(b is not None and b not in TREE_ONLY_BACKENDS for b in backends.values())


def server_attention_backends(cfg) -> dict[str, str | None]:
    """The attention-backend server arguments (SGLang's ServerArgs) a TARGET_VERIFY pass may run on."""
    return {f"--{name.replace('_', '-')}": getattr(cfg, name, None)
            for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")}
