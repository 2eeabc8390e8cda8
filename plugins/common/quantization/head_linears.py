"""Which linears of an EAGLE-3 head run with quantized weights, and the swap.

`swap_checked` installs quantized weights in an engine's layers, each first checked
against its layer (`mismatch`); where one fails, nothing changes. `swap_linears` does it
for a module's nn.Linear layers with QuantLinear copies in int8 or int4
(specplug.common.quantization.int8 / int4).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping

import torch
from torch import nn

from . import int4, int8

# The EAGLE-3 head's linears by role -> canonical checkpoint tensors (specplug.common.formats),
# concatenated along the output dimension in the order engines fuse them (q|k|v, gate|up).
# Not fc: it reads the target's aux states, whose few huge dimensions its rows answer with a
# few huge weights (largest / mean magnitude per row ~77 on the test-bed head, ~5 elsewhere),
# so one scale per row leaves the rest a level or two: relative error 0.08 on random rows,
# against 0.01 for the others.
EAGLE3_LINEARS = {
    "qkv": ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"),
    "o": ("midlayer.self_attn.o_proj.weight",),
    "gate_up": ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"),
    "down": ("midlayer.mlp.down_proj.weight",),
    "lm_head": ("lm_head.weight",),
}

# The same linears as modules of specplug's own Eagle3Head (specplug.common.heads.eagle3).
EAGLE3_MODULES = tuple(name.removesuffix(".weight") for names in EAGLE3_LINEARS.values() for name in names)


def quantizer(fmt: str) -> Callable[[torch.Tensor], "int8.Int8Weight | int4.Int4Weight"]:
    """The quantize function of weight format `fmt` ("int8" or "int4")."""
    return {"int8": int8.quantize, "int4": int4.quantize}[fmt]


def format_reason(fmt: str, dtype: torch.dtype, device, shapes) -> str | None:
    """Why weights of format `fmt` cannot run for these weight shapes [(N, K)], or None."""
    if fmt == "int4":
        return int4.unsupported_reason(dtype, device, shapes)
    return int8.unsupported_reason(dtype, device, [k for _, k in shapes])


def eagle3_weights(state: Mapping[str, torch.Tensor], fmt: str = "int8", dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> dict:
    """The EAGLE-3 head's linears {role: quantized weight} (EAGLE3_LINEARS) in format
    `fmt` from a canonical state dict, for a head running in `dtype` on `device`.
    ValueError, before anything is quantized, when the state dict lacks a linear or the
    format cannot run (format_reason: int4's packing raises on widths it cannot take)."""
    weights = _eagle3_linears(state)
    reason = format_reason(fmt, dtype, device, [tuple(w.shape) for w in weights.values()])
    if reason is not None:
        raise ValueError(reason)
    return {role: quantizer(fmt)(w) for role, w in weights.items()}


def eagle3_reason(state: Mapping[str, torch.Tensor], fmt: str, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> str | None:
    """Why the EAGLE-3 head of a canonical state dict cannot run its linears with `fmt`
    weights in `dtype` on `device` (format_reason on their shapes), or None. Reads shapes
    only: meta tensors (formats.load_head(..., weights=False)) do."""
    return format_reason(fmt, dtype, device, [tuple(w.shape) for w in _eagle3_linears(state).values()])


def _eagle3_linears(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{role: weight} of EAGLE3_LINEARS, each role's tensors concatenated along the output dim."""
    missing = [name for names in EAGLE3_LINEARS.values() for name in names if name not in state]
    if missing:
        raise ValueError(f"the head's state dict lacks {missing}: pass a canonical EAGLE-3 state dict "
                         "(specplug.common.formats.load_head(...).state_dict)")
    return {role: torch.cat([state[n] for n in names]) for role, names in EAGLE3_LINEARS.items()}


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """||out - reference|| / ||reference|| (Frobenius), in fp32."""
    reference = reference.float()
    return float((out.float() - reference).norm() / reference.norm().clamp(min=1e-12))


class QuantLinear(nn.Module):
    """An nn.Linear's forward over int8 or int4 weights (`swap_linears` puts it in the
    linear's place)."""

    def __init__(self, weight, bias: torch.Tensor | None = None):
        super().__init__()
        self.quantized = weight  # Int8Weight or int4.Int4Weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quantized.apply(x)
        return out if self.bias is None else out + self.bias


def mismatch(name: str, weight, layer: Callable[[torch.Tensor], torch.Tensor],
             dtype: torch.dtype) -> str | None:
    """Why `weight` (Int8Weight or int4.Int4Weight) cannot stand in for `layer` (a
    callable [3, K] -> [3, >= N]; an engine's lm_head may be padded past N): it does not
    take K inputs, has another output width, or is further than its format's
    max_relative_error off on 3 random rows (outlier weights, or not the same weights).
    None when it can."""
    n, k = weight.shape
    x = torch.randn(3, k, dtype=dtype)
    try:
        with torch.no_grad():
            reference = layer(x)[..., :n]
    except RuntimeError as exc:  # another input width
        return f"{name} does not take the quantized weight's {k} inputs ({exc}): left as loaded"
    if reference.shape[-1] != n:
        return (f"quantized {name} has {n} outputs, its layer {reference.shape[-1]}: not the same weights, "
                "left as loaded")
    error = relative_error(weight.apply(x), reference)
    if error > weight.max_relative_error():
        return (f"quantized {name} is {error:.3f} off its float layer (outlier weights, or not the same weights): "
                "left as loaded")
    return None


def use_head_weights(kind: str, fmt: str, swap: Callable[[], str | None], head: str, who: str,
                     logger: logging.Logger) -> None:
    """A head's "head_weights" `fmt` ("int8" / "int4"): `swap()`, the engine's way to run an
    EAGLE-3 head's linears with those weights (None when done, else why not), for an
    EAGLE-3 head only; then one log line from `who`: what runs, or a warning naming why
    the head runs as loaded."""
    reason = f"an EAGLE-1 head has no {fmt} path" if kind != "EAGLE-3" else swap()
    if reason is None:
        logger.info("%s: head %s runs its linears with %s weights (\"head_weights\")", who, head, fmt)
    else:
        logger.warning("%s: \"head_weights\" is %s but the head runs as loaded: %s", who, fmt, reason)


def swap_checked(layers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], weights: Mapping, dtype: torch.dtype,
                 install: Callable[[str, object], None]) -> str | None:
    """All or nothing: each quantized weight (by name) checked against the layer it replaces
    (`mismatch`); only when every one passes, install(name, weight) for each. Returns None
    when swapped, else why not (nothing changed)."""
    for name, layer in layers.items():
        reason = mismatch(name, weights[name], layer, dtype)
        if reason is not None:
            return reason
    for name, weight in weights.items():
        install(name, weight)
    return None


def swap_linears(module: nn.Module, names: Iterable[str], fmt: str = "int8") -> str | None:
    """Replace `module`'s nn.Linear submodules `names` with QuantLinear copies in format
    `fmt` (swap_checked: each checked first, all or nothing). Returns None when swapped,
    else why not."""
    linears = {name: module.get_submodule(name) for name in names}
    weight = next(iter(linears.values())).weight
    shapes = [tuple(linear.weight.shape) for linear in linears.values()]
    reason = format_reason(fmt, weight.dtype, weight.device, shapes)
    if reason is not None:
        return reason

    def install(name: str, quantized) -> None:
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, QuantLinear(quantized, linears[name].bias))

    floats = {name: lambda x, w=linear.weight: nn.functional.linear(x, w)  # no bias: QuantLinear adds the same
              for name, linear in linears.items()}
    return swap_checked(floats, {name: quantizer(fmt)(linear.weight) for name, linear in linears.items()},
                        weight.dtype, install)
