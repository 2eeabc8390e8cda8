"""What both weight formats need from the machine, and their bf16 scales."""

from __future__ import annotations

import torch

KERNEL_DTYPE = torch.bfloat16  # the activations' dtype inside both kernels (fp32 there is 10x slower)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)


def platform_reason(fmt: str, dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why weights of format `fmt` cannot run for a head of `dtype` on `device` (both
    formats' kernels are CPU ones over bf16 activations), or None."""
    if torch.device(device).type != "cpu":
        return f"{fmt} head weights run on a CPU only (the head is on {device})"
    if dtype not in ACTIVATION_DTYPES:
        return f"{fmt} head weights need a bf16 or fp32 head (this one is {dtype})"
    return None


def rounded_up(scale: torch.Tensor, dtype: torch.dtype = KERNEL_DTYPE) -> torch.Tensor:
    """Float scales -> the smallest `dtype` values >= them: the kernel's own scales, and
    never smaller than needed, so no weight is clamped beyond half a step."""
    out = scale.to(dtype)
    low = out.float() < scale
    return torch.where(low, torch.nextafter(out, torch.full_like(out, float("inf"))), out)
