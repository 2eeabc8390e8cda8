"""fp32 CPU linear layers through oneDNN with the weight packed once per layer (opt-in:
SPECPLUG_SGLANG_CPU_LINEAR=onednn; docs/sglang.md has what it is worth and costs).

Invariant: packed_linear equals F.linear up to summation order; a layer's weight is packed
at its first call and later in-place changes to it are not seen."""

from __future__ import annotations

import os

import torch

ENV = "SPECPLUG_SGLANG_CPU_LINEAR"
PACKED = "_specplug_onednn_weight"  # the packed weight, kept in the layer's __dict__


def enabled(environ=os.environ) -> bool:
    """Whether SPECPLUG_SGLANG_CPU_LINEAR asks for oneDNN (ValueError on other values)."""
    value = environ.get(ENV, "").strip().lower()
    if value not in ("", "0", "off", "onednn"):
        raise ValueError(f"{ENV} must be 'onednn' or unset, got {value!r}: unset it or pass onednn")
    return value == "onednn"


def eligible(layer, x: torch.Tensor) -> bool:
    """An fp32 CPU call of a layer with a plain 2-D weight and no AMX packing of its own."""
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


def not_installed_reason(environ=os.environ) -> str | None:
    """Why the hooks are not installed (None: they are: SPECPLUG_SGLANG_CPU_LINEAR=onednn
    and a torch with oneDNN); ValueError on a bad setting."""
    if not enabled(environ):
        return f"opt-in: {ENV}=onednn is not set"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None
