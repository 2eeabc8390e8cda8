"""Weight-only int4 for a draft head's linear layers on a CPU: half of int8's bytes.

The same economics as `int8` (a head step at batch 1 is paid in weight reads right after
the target's forward has evicted them), one step further: four bits a weight, in groups
of GROUP input columns with their own scale and zero point (asymmetric:
w[n, k] ~ (q[n, k] - 8) * scale[g, n] + zero[g, n], g = k // GROUP, q in [0, 15]), read by
torch's `_weight_int4pack_mm_for_cpu` with the activations rounded to bf16. Outputs are
about 9% off the float layer on random rows (int8: 1%); on the test-bed EAGLE-3 head the
drafts barely move (docs/tuning.md, "Head weights: int8 and int4"). Only drafts change:
verification never sees the head.

Invariant: `int4_linear(x, quantize(w))` equals `x @ dequantize(w).T` up to rounding x
and the output to bf16, and every entry of `dequantize(w)` lies within half a step (its
group's scale / 2) of w's, plus the bf16 rounding of the zero point.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .platform import KERNEL_DTYPE, platform_reason, rounded_up

GROUP = 64  # input columns sharing a scale and zero point
N_MULTIPLE = 16  # torch's packing refuses other output widths
LEVELS = 15  # q in [0, LEVELS]; the kernel subtracts 8
MAX_RELATIVE_ERROR = 0.15  # random rows read ~0.09 off; a wrong mapping ~1.4


class Int4Weight(NamedTuple):
    """A linear layer's weight [N, K] in torch's packed int4 layout with its groups'
    scales and zero points."""

    packed: torch.Tensor  # torch's packed int4 [N, K]
    scales_zeros: torch.Tensor  # bf16 [K // GROUP, N, 2]: scale, zero point
    shape: tuple[int, int]  # (N, K)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self)

    def max_relative_error(self) -> float:
        return MAX_RELATIVE_ERROR


def unsupported_reason(dtype: torch.dtype, device: torch.device | str = "cpu", shapes=()) -> str | None:
    """Why int4 weights cannot run for activations of `dtype` on `device` with these
    weight shapes [(N, K)], or None."""
    reason = platform_reason("int4", dtype, device)
    if reason is not None:
        return reason
    if not hasattr(torch, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no _weight_int4pack_mm_for_cpu"
    odd = sorted({(n, k) for n, k in shapes if k % GROUP or n % N_MULTIPLE})
    if odd:
        return (f"int4 head weights need input widths that are multiples of {GROUP} and output widths "
                f"that are multiples of {N_MULTIPLE}, this head has {odd}")
    return None


def quantize(weight: torch.Tensor) -> Int4Weight:
    """weight [N, K] -> Int4Weight in torch's packed layout (`levels`)."""
    n, k = weight.shape
    q, scale, zero = levels(weight)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(n, k).contiguous(), 1)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [G, N, 2]
    return Int4Weight(packed, scales_zeros, (n, k))


def levels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q Int32 [N, G, GROUP] in [0, LEVELS], scale, zero bf16 [N, G]):
    each group of GROUP columns of a row spans its own range in LEVELS steps (scale
    rounded up to bf16, so no weight is clamped)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)  # [N, G]
    scale = rounded_up(((high - low) / LEVELS).clamp(min=torch.finfo(KERNEL_DTYPE).tiny), KERNEL_DTYPE)
    zero = (low + 8 * scale.float()).to(KERNEL_DTYPE)  # the kernel's w = (q - 8) * scale + zero
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8).clamp(0, LEVELS)
    return q.to(torch.int32), scale, zero


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W = dequantize(w); x is rounded to bf16."""
    rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE).contiguous()
    out = torch._weight_int4pack_mm_for_cpu(rows, w.packed, GROUP, w.scales_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """Float [N, K]: the weight that quantize(weight) stands for (torch's packed layout
    is not read back)."""
    q, scale, zero = levels(weight)
    return ((q.float() - 8) * scale.float()[..., None] + zero.float()[..., None]).view(weight.shape)
