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
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .platform import KERNEL_DTYPE, platform_reason, rounded_up

K_MULTIPLE = 64  # torch 2.13's kernel reads K in blocks: K = 24, 40 crashed it (16, 48 did not); 64 is safe
QMAX = 127  # symmetric int8: -128 is never used, so negation stays exact
MAX_RELATIVE_ERROR = 0.05  # an int8 linear further than this from the layer it replaces is a wrong mapping


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


def dequantize(w: Int8Weight) -> torch.Tensor:
    """Float [N, K]: the weight the int8 rows stand for."""
    return w.weight.float() * w.scale.float()[:, None]


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W = dequantize(w); x is rounded to bf16."""
    rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE).contiguous()
    out = torch._weight_int8pack_mm(rows, w.weight, w.scale)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
