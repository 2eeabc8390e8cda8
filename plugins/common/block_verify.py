"""Block verification of sampled chains (Sun et al. 2024, "Block Verification Accelerates
Speculative Decoding", arXiv 2403.10444): the acceptance rule for a chain of gamma drafts
x_1..x_gamma drawn from the drafter's q_1..q_gamma, judged as one block against the
target's p_1..p_{gamma+1} instead of token by token.

With P_i = p_i(x_i) and Q_i = q_i(x_i) (the target's and the drafter's probability of
draft i at its parent):

    weight_0 = 1,  weight_i = min(weight_{i-1} * P_i / Q_i, 1)                 i = 1..gamma
    residual_i(x) = max(weight_i * p_{i+1}(x) - q_{i+1}(x), 0)   (q_{gamma+1} = 0)
    h_i = sum(residual_i) / (sum(residual_i) + 1 - weight_i)     (h_0 = 1, h_gamma = weight_gamma)

The number of accepted drafts tau is the largest i in 0..gamma whose draw passes,
``eta_i < h_i`` (scanning i = gamma down to 0, the first success); the token after
them is drawn from norm(residual_tau): the target's own p_{gamma+1} when the whole
chain is accepted (the bonus), a recovered token otherwise.

Invariant: lossless, the emitted tokens followed by the target's own sampling are
distributed exactly as the target's autoregressive sampling; and the expected number
of accepted drafts is never below token-wise rejection sampling's (Leviathan) on the
same drafts (tests/common/test_block_verify.py: chi-square of the first three tokens
with a negative control, exact expectations by enumeration). Randomness is the row of
uniforms ``sampling.verify`` takes for "rejection": column i (1..gamma) is eta_i,
column 0 draws the final token by inverse CDF, so a request's result depends on its
own rows only, never on its batch companions. Torch only (no CUDA kernel): on CUDA
tensors it runs as torch ops on the tensors' device.
"""

from __future__ import annotations

import torch

from specplug.common.randomness import sample_inverse_cdf
from specplug.common.sampling import DEFAULT_SUM_TOLERANCE, SUM_TOLERANCE, flat_node_rows
from specplug.common.verify_result import VerifyResult

__all__ = ["verify_block", "stop_probabilities"]


class _ChainRows:
    """Row i of every request's chain, Float [B, V], from padded [B, K+1, V] or flat
    [sum(num_drafts + 1), V] rows (request-major)."""

    def __init__(self, x: torch.Tensor, num_drafts: torch.Tensor, width: int):
        self.x = x
        self.index = flat_node_rows(num_drafts + 1, width) if x.dim() == 2 else None  # [B, K+1]

    def __call__(self, i: int) -> torch.Tensor:
        return (self.x[:, i] if self.index is None else self.x[self.index[:, i]]).float()

    def at(self, nodes: torch.Tensor) -> torch.Tensor:
        """Row nodes[b] of request b, Float [B, V]."""
        batch = torch.arange(nodes.shape[0], device=nodes.device)
        return (self.x[batch, nodes] if self.index is None else self.x[self.index[batch, nodes]]).float()


def _next_weight(weight: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(weight * p(x) / q(x), 1), Float [B]; 0 where weight * p(x) is 0 (q(x) = 0 too)."""
    scaled = weight * p_x
    return torch.where(scaled >= q_x, (scaled > 0).float(), scaled / q_x)


def _stop_probability(weight: torch.Tensor, p_next: torch.Tensor, q_next: torch.Tensor) -> torch.Tensor:
    """h = sum(residual) / (sum(residual) + 1 - weight), Float [B]; 1 where both are 0."""
    residual = (weight[:, None] * p_next - q_next).clamp(min=0).sum(-1)  # [B]
    total = residual + (1.0 - weight)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), 1.0)


def stop_probabilities(drafts: torch.Tensor, num_drafts: torch.Tensor, p, q) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, h), Float [B, K+1] each: column i of the module docstring's weight_i and
    h_i (h_0 = 1; h_i = 0 past a request's gamma = num_drafts). drafts Long [B, K] (ids
    inside the vocabulary); ``p``, ``q``: i -> Float [B, V], the target's and the drafter's
    rows after node i of every chain."""
    bsz, k = drafts.shape
    weight = torch.ones(bsz, k + 1, device=drafts.device)
    h = torch.zeros(bsz, k + 1, device=drafts.device)
    p_prev = q_prev = None
    for i in range(k + 1):
        p_i, q_i = p(i), q(i)  # [B, V]: the target's and the drafter's rows after node i
        if i > 0:
            x = drafts[:, i - 1:i]  # [B, 1] draft i
            weight[:, i] = _next_weight(weight[:, i - 1], p_prev.gather(1, x)[:, 0], q_prev.gather(1, x)[:, 0])
        drafting = (i < num_drafts)[:, None]  # q_{i+1} exists: a draft follows node i
        h[:, i] = torch.where(i <= num_drafts, _stop_probability(weight[:, i], p_i, q_i * drafting), 0.0)
        p_prev, q_prev = p_i, q_i
    h[:, 0] = 1.0
    return weight, h


def verify_block(drafts: torch.Tensor, num_drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                 uniforms: torch.Tensor, *, validate: bool = True) -> VerifyResult:
    """Block verification of B chains (module docstring), the result as ``sampling.verify``
    gives it for chains (node i of a chain is its draft i; the root is node 0).

    drafts: Long [B, K] (request b's first num_drafts[b] real). num_drafts: Long [B].
    p: the target's rows after the root and each draft, Float [B, K+1, V] or flat
        [sum(num_drafts + 1), V] (request-major, an engine's layout), from process_logits.
    q: the same layout: row i the distribution draft i+1 was drawn from (row gamma unused).
    uniforms: Float [B, >= K+1] in [0, 1): column i (1..K) decides length i, column 0
        draws the final token.
    validate: check that p's rows and q's drafting rows sum to 1 and the inputs' ranges.
    """
    device = p.device
    drafts = drafts.to(device).long()
    num_drafts = torch.as_tensor(num_drafts, device=device).long()
    k = drafts.shape[1]
    if validate:
        _check(drafts, num_drafts, p, q, uniforms)
    p_rows, q_rows = _ChainRows(p, num_drafts, k + 1), _ChainRows(q.to(device), num_drafts, k + 1)
    weight, h = stop_probabilities(drafts.clamp(0, p.shape[-1] - 1), num_drafts, p_rows, q_rows)
    uniforms = uniforms.to(device)
    passes = uniforms[:, :k + 1] < h  # [B, K+1]; column 0 always (h_0 = 1)
    passes[:, 0] = True
    accepted = (passes.long() * torch.arange(k + 1, device=device)).amax(1)  # [B] tau
    token = sample_inverse_cdf(_final_distribution(accepted, num_drafts, weight, p_rows, q_rows), uniforms[:, 0])
    width = int(num_drafts.max()) + 1 if num_drafts.numel() else 1
    node = torch.arange(width, device=device)[None]  # [1, D+1]
    return VerifyResult(torch.where(node <= accepted[:, None], node, -1), accepted, token)


def _final_distribution(accepted, num_drafts, weight, p_rows: _ChainRows, q_rows: _ChainRows) -> torch.Tensor:
    """Float [B, V], unnormalised: residual_tau (the bonus row p_{gamma+1} when tau = gamma);
    the target's row where rounding left no residual mass."""
    p_t = p_rows.at(accepted)  # [B, V]
    q_t = q_rows.at(accepted) * (accepted < num_drafts)[:, None]
    dist = (weight.gather(1, accepted[:, None]) * p_t - q_t).clamp(min=0)
    empty = ~(dist.sum(-1) > 0)
    return torch.where(empty[:, None], p_t, dist)


def _check(drafts, num_drafts, p, q, uniforms) -> None:
    bsz, k = drafts.shape
    rows = int((num_drafts + 1).sum())
    for name, x in (("p", p), ("q", q)):
        if x.shape not in ((bsz, k + 1, p.shape[-1]), (rows, p.shape[-1])) or x.dim() != p.dim():
            raise ValueError(f"{name} must be Float [B={bsz}, K+1={k + 1}, V] or flat [sum(num_drafts + 1)={rows}, V] "
                             f"like p, got {tuple(x.shape)}: one row per chain node")
    if num_drafts.shape != (bsz,) or bool(((num_drafts < 0) | (num_drafts > k)).any()):
        raise ValueError(f"num_drafts must be Long [B={bsz}] in [0, K={k}], got {num_drafts.tolist()[:8]}")
    if uniforms.shape[0] != bsz or uniforms.shape[1] < k + 1 or bool(((uniforms < 0) | (uniforms >= 1)).any()):
        raise ValueError(f"uniforms must be Float [B={bsz}, >= K+1={k + 1}] in [0, 1), got {tuple(uniforms.shape)}")
    real = torch.arange(k, device=drafts.device)[None] < num_drafts[:, None]  # [B, K]
    if bool((real & ((drafts < 0) | (drafts >= p.shape[-1]))).any()):
        raise ValueError(f"drafts must be token ids in [0, {p.shape[-1]}): map draft-vocab ids with d2t")
    node = torch.arange(k + 1, device=drafts.device)[None]
    for name, x, used in (("p", p, node <= num_drafts[:, None]), ("q", q, node < num_drafts[:, None])):
        sums = x.sum(-1, dtype=torch.float32)
        sums = sums if x.dim() == 3 else sums[flat_node_rows(num_drafts + 1, k + 1)]  # [B, K+1]
        tol = SUM_TOLERANCE.get(x.dtype, DEFAULT_SUM_TOLERANCE)
        if bool((used & ~((sums - 1.0).abs() <= tol)).any()):
            raise ValueError(f"{name} has a row that does not sum to 1 (NaN/inf or off by more than {tol}): "
                             f"pass probabilities (process_logits for p, the drafter's q)")
