"""Weight-only int8 for a draft head's linear layers on a CPU.

At batch 1 a head step multiplies one or two rows by each of its weight matrices, right
after the target's forward has pushed them out of the cache, so the step is paid in
weight reads and in widening bf16, not in arithmetic. Stored as int8 with one scale per
output channel (symmetric: w[n, k] ~ scale[n] * q[n, k], q in [-127, 127]), the weights
are a quarter of fp32's bytes (half of bf16's), and torch's `_weight_int8pack_mm` widens
them in registers, with the activations rounded to bf16 for it: the EAGLE-3 test-bed
head's five linears after fc, one row, cache cold, 2.5 ms with vLLM-CPU's oneDNN fp32
GEMM against 1.05 ms (docs/tuning.md, "Head weights: int8 and int4").

Only drafts change: verification never sees the head, so output is unchanged; the
head's acceptance may move a little (measured in the same section).

Invariant: `int8_linear(x, quantize(w))` equals `x @ dequantize(quantize(w)).T` up to
rounding x to bf16, and every entry of `dequantize(quantize(w))` lies within half a
step (scale / 2) of w's.

This module also holds what both weight formats share (`int4` is the other): the platform
check and rounded-up bf16 scales, the EAGLE-3 roles, the check of a copy against its
layer, and `swap_linears`. A head section's "head_weights" is specplug.common.head_section's.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, NamedTuple

import torch
from torch import nn

from specplug.common.head_section import ENV_HEAD_INT8, ENV_HEAD_WEIGHTS, WEIGHT_FORMATS  # noqa: F401 (re-exported)

KERNEL_DTYPE = torch.bfloat16  # the activations' dtype inside the int8 kernel (fp32 there is 10x slower)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
K_MULTIPLE = 64  # torch 2.13's kernel reads K in blocks: K = 24, 40 crashed it (16, 48 did not); 64 is safe
QMAX = 127  # symmetric int8: -128 is never used, so negation stays exact
MAX_RELATIVE_ERROR = 0.05  # an int8 linear further than this from the layer it replaces is a wrong mapping

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


class Int8Weight(NamedTuple):
    """A linear layer's weight [N, K] as int8 rows and one scale per row."""

    weight: torch.Tensor  # Int8 [N, K]
    scale: torch.Tensor  # bf16 [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self)

    def max_relative_error(self) -> float:
        return MAX_RELATIVE_ERROR


def head_int8_flag(section: Mapping, environ: Mapping[str, str]) -> bool:
    """A head section's older "head_int8" (default false), SPECPLUG_HEAD_INT8 overriding
    (specplug.common.head_section reads it as "head_weights": "int8")."""
    from specplug.common import head_section

    return head_section.flag(section, "head_int8", environ, ENV_HEAD_INT8, "int8 head weights")


def head_weights(section: Mapping, environ: Mapping[str, str]) -> str:
    """How a head's linears run (one of WEIGHT_FORMATS): specplug.common.head_section's
    "head_weights" ("head_int8", SPECPLUG_HEAD_WEIGHTS, SPECPLUG_HEAD_INT8)."""
    from specplug.common import head_section

    return head_section.head_weights(section, environ)


def quantizer(fmt: str) -> Callable[[torch.Tensor], "Int8Weight | int4.Int4Weight"]:
    """The quantize function of weight format `fmt` ("int8" or "int4")."""
    from specplug.common.drafting import int4  # int4 reads this module's shared helpers

    return {"int8": quantize, "int4": int4.quantize}[fmt]


def format_reason(fmt: str, dtype: torch.dtype, device, shapes) -> str | None:
    """Why weights of format `fmt` cannot run for these weight shapes [(N, K)], or None."""
    if fmt == "int4":
        from specplug.common.drafting import int4

        return int4.unsupported_reason(dtype, device, shapes)
    return unsupported_reason(dtype, device, [k for _, k in shapes])


def platform_reason(fmt: str, dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why weights of format `fmt` cannot run for a head of `dtype` on `device` (both
    formats' kernels are CPU ones over bf16 activations), or None."""
    if torch.device(device).type != "cpu":
        return f"{fmt} head weights run on a CPU only (the head is on {device})"
    if dtype not in ACTIVATION_DTYPES:
        return f"{fmt} head weights need a bf16 or fp32 head (this one is {dtype})"
    return None


def unsupported_reason(dtype: torch.dtype, device: torch.device | str = "cpu", in_features=()) -> str | None:
    """Why int8 weights cannot run for activations of `dtype` on `device` with these
    input widths (K of each linear), or None. torch's packed int8 kernel is a CPU one,
    and it reads past a K that is not a multiple of its block (a segfault, not an error)."""
    reason = platform_reason("int8", dtype, device)
    if reason is not None:
        return reason
    if not hasattr(torch, "_weight_int8pack_mm"):
        return f"torch {torch.__version__} has no _weight_int8pack_mm"
    odd = sorted({k for k in in_features if k % K_MULTIPLE})
    if odd:
        return f"int8 head weights need input widths that are multiples of {K_MULTIPLE}, this head has {odd}"
    return None


def quantize(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] -> Int8Weight, each row scaled by its largest magnitude / QMAX."""
    w = weight.detach().float()
    scale = rounded_up((w.abs().amax(dim=1) / QMAX).clamp(min=torch.finfo(KERNEL_DTYPE).tiny))  # [N]
    q = torch.round(w / scale.float()[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale)


def rounded_up(scale: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
    """Float scales -> the smallest `dtype` values >= them: the kernel's own scales, and
    never smaller than needed, so no weight is clamped beyond half a step."""
    out = scale.to(dtype)
    low = out.float() < scale
    return torch.where(low, torch.nextafter(out, torch.full_like(out, float("inf"))), out)


def dequantize(w: Int8Weight) -> torch.Tensor:
    """Float [N, K]: the weight the int8 rows stand for."""
    return w.weight.float() * w.scale.float()[:, None]


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W = dequantize(w); x is rounded to bf16."""
    rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE).contiguous()
    out = torch._weight_int8pack_mm(rows, w.weight, w.scale)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


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


def swap_linears(module: nn.Module, names: Iterable[str], fmt: str = "int8") -> str | None:
    """Replace `module`'s nn.Linear submodules `names` with QuantLinear copies in format
    `fmt`, each first checked against its linear (`mismatch`); where one fails or the
    format cannot run, nothing changes. Returns None when swapped, else why not."""
    linears = {name: module.get_submodule(name) for name in names}
    weight = next(iter(linears.values())).weight
    shapes = [tuple(linear.weight.shape) for linear in linears.values()]
    reason = format_reason(fmt, weight.dtype, weight.device, shapes)
    if reason is not None:
        return reason
    swapped = {name: QuantLinear(quantizer(fmt)(linear.weight), linear.bias) for name, linear in linears.items()}
    for name, linear in linears.items():
        reason = mismatch(name, swapped[name].quantized, lambda x, w=linear.weight: nn.functional.linear(x, w),
                          weight.dtype)  # the weights alone: QuantLinear adds the same bias after
        if reason is not None:
            return reason
    for name, linear in swapped.items():
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, linear)
    return None
