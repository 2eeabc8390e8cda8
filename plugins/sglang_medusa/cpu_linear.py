"""Opt-in: SGLang's fp32 CPU linear layers through oneDNN with prepacked weights.

On CPUs without AMX, SGLang 0.5.23 runs its linear layers and the LM head as plain
`F.linear` / `torch.matmul` (MKL sgemm on unpacked weights). There a matmul over a few
rows costs far more than over one: measured on the test bed's 2-core AVX2 CPU, the LM
head (49152 x 576, fp32) takes 10.7 ms for 1 row, 26 ms for 2, 39 ms for 3 and 21.5 ms
for 9, so a verify pass over 4-9 tree nodes costs ~1.6x a decode step and speculation
barely pays. oneDNN on weights packed once (`torch.ops.mkldnn._reorder_linear_weight`)
costs 4.5 ms for 1 row and 4.1 ms for 9. (With AMX, SGLang packs weights itself:
`sgl_kernel.weight_packed_linear`, and this module stays out of the way.)

`SPECPLUG_SGLANG_CPU_LINEAR=onednn` installs two AROUND hooks (patches.py), in every
SGLang process (with or without speculation, so a comparison stays fair): on
`UnquantizedLinearMethod.apply` and `LogitsProcessor._compute_lm_head`. They take over
only fp32 CPU tensors of layers without AMX packing, quantization or LoRA; every other
call runs SGLang's own code. Costs: one packed copy of every linear weight (the
model's linear weights in memory twice), made at the layer's first call; weights
changed in place after that (online weight updates) are not seen: leave the setting
off for such servers. Numerics: oneDNN sums in another order than
MKL, so outputs may differ from SGLang without it at fp32 near-ties; servers compared
with each other must both have it or both not.
"""

from __future__ import annotations

import logging
import os

import torch

from specplug.sglang_medusa.patches import LINEAR_APPLY, LM_HEAD

logger = logging.getLogger(__name__)

ENV = "SPECPLUG_SGLANG_CPU_LINEAR"
LINEAR_TARGET, LM_HEAD_TARGET = LINEAR_APPLY, LM_HEAD  # hooked AROUND (patches.py)
PACKED = "_specplug_onednn_weight"


def enabled(environ=os.environ) -> bool:
    """Whether SPECPLUG_SGLANG_CPU_LINEAR asks for oneDNN (ValueError on other values)."""
    value = environ.get(ENV, "").strip().lower()
    if value not in ("", "0", "off", "onednn"):
        raise ValueError(f"{ENV} must be 'onednn' or unset, got {value!r}: unset it or pass onednn")
    return value == "onednn"


def _eligible(layer, x: torch.Tensor) -> bool:
    weight = getattr(layer, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and x.device.type == "cpu"
            and weight.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not getattr(layer, "use_intel_amx_backend", False))


def packed_linear(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ layer.weight [out, in].T (+ bias) with the weight packed once per layer."""
    packed = layer.__dict__.get(PACKED)
    if packed is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        layer.__dict__[PACKED] = packed
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def linear_apply(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND UnquantizedLinearMethod.apply: eligible fp32 CPU calls through packed_linear."""
    if args or kwargs or not _eligible(layer, x):
        return original(method, layer, x, bias, *args, **kwargs)
    return packed_linear(layer, x, bias)


def lm_head_logits(original, processor, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    """AROUND LogitsProcessor._compute_lm_head: where SGLang would run its plain
    `hidden @ weight.T` on fp32 CPU tensors, packed_linear instead."""
    from sglang.srt.layers.logits_processor import should_apply_lm_head_quant_method

    plain = (hasattr(lm_head, "weight") and not hasattr(lm_head, "set_lora")
             and not should_apply_lm_head_quant_method(lm_head, getattr(lm_head, "quant_method", None))
             and not getattr(processor, "use_fp32_lm_head", False)
             and getattr(processor, "rl_on_policy_target", None) is None)
    if (args or kwargs.keys() - {"out"} or embedding_bias is not None or not plain
            or not _eligible(lm_head, hidden_states)):
        return original(processor, hidden_states, lm_head, embedding_bias, *args, **kwargs)
    return packed_linear(lm_head, hidden_states)


def not_installed_reason(environ=os.environ) -> str | None:
    """Why the two hooks are not installed (None: they are: SPECPLUG_SGLANG_CPU_LINEAR=onednn
    and a torch with oneDNN); ValueError on a bad setting."""
    if not enabled(environ):
        return f"opt-in: {ENV}=onednn is not set"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def announce(installed: bool, environ=os.environ) -> None:
    """One log line once register() applied (or not) the hooks: INFO when installed, a
    WARNING when asked for and not installed."""
    if installed:
        logger.info("specplug: %s=onednn: fp32 CPU linear layers and LM head through oneDNN with packed weights",
                    ENV)
    elif enabled(environ):
        logger.warning("specplug: %s=onednn ignored: %s", ENV, not_installed_reason(environ)
                       or "SGLang's linear methods are not the ones specplug hooks (see the WARNING above)")
