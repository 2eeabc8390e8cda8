"""The randomness of verification: the uniforms of one verify call, drawn from per-request
generators (:func:`draw_uniforms`) or fixed by a request's seed and each token's position
(:func:`position_uniforms`), and the inverse-CDF draw that consumes one
(:func:`sample_inverse_cdf`). See :mod:`specplug.common.sampling` for which column
decides what.
"""

from __future__ import annotations

import torch

__all__ = ["draw_uniforms", "position_uniforms", "sample_inverse_cdf"]


def draw_uniforms(batch: int, nodes: int, generators=None, device=None) -> torch.Tensor:
    """Uniforms Float [batch, nodes + 1] in [0, 1), the randomness of one verify call.

    With ``generators`` (one ``torch.Generator`` or None per request) row b is
    ``torch.rand(nodes + 1, generator=generators[b])``, so a fixed seed reproduces a
    request regardless of its batch mates. Without, one ``torch.rand(batch, nodes + 1)``.
    """
    if generators is None:
        return torch.rand(batch, nodes + 1, device=device)
    if len(generators) != batch:
        raise ValueError(f"generators must have one entry per request ({batch}), got {len(generators)}")
    rows = [
        torch.rand(nodes + 1, generator=g, device=g.device if g is not None else device)
        for g in generators
    ]
    return torch.stack([r.to(device) for r in rows]) if rows else torch.zeros(0, nodes + 1, device=device)


_GOLDEN = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 bits (multiplication wraps modulo 2**64)."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX[0])
    z = (z ^ _shr(z, 27)) * _signed(_MIX[1])
    return z ^ _shr(z, 31)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """Float32 [B, width] in [0, 1): u[b, d] is a fixed function of (seeds[b],
    positions[b] + d) only (the top 24 bits of splitmix64, so exactly representable
    and < 1 in float32, like torch.rand), the draw of the request's token at that
    sequence position. With method "coupled" this makes a seeded request's output
    independent of drafts, batch mates and preemption."""
    seeds, positions = seeds.long(), positions.long()
    t = positions.unsqueeze(1) + torch.arange(width, device=positions.device)  # [B, width]
    z = _mix64(_mix64(seeds.unsqueeze(1)) + (t + 1) * _signed(_GOLDEN))
    return _shr(z, 40).float() * 2.0 ** -24


def sample_inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """dist Float [B, V] (non-negative, unnormalised ok), u [B] -> Long [B]: the first v
    with ``cumsum(dist)[v] > u * cumsum(dist)[-1]``."""
    cdf = dist.float().cumsum(-1)  # [B, V]
    target = u.float().unsqueeze(-1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=dist.shape[-1] - 1)
