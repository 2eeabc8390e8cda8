"""Verification of a batch of CHAINS in a handful of vectorised ops.

An engine's chain stage hands over flat target rows, request-major: request b owns
num_drafts[b] + 1 consecutive rows, the distributions after its root and after each of
its drafts. For chains, `sampling.verify`'s "greedy" and "coupled" rules reduce to one
comparison: the target's own token after every node is fixed before looking at the
drafts (its argmax, or its inverse-CDF draw with the uniform of the node's depth), and
a chain is accepted up to its first draft that differs from the target's token at its
parent; the bonus is the target's token after the last accepted draft.

Invariant: `verify_chains(drafts, num_drafts, target, method, uniforms)` returns exactly
`sampling.verify(method=method)` on the same chains (tests/common/test_chains.py), so
the distribution proofs of `verify` carry over; it skips the tree bookkeeping (depths,
path reduction, sibling rules) that a chain does not need, which cost a bs-1 step on a
CPU about 1 ms.
"""

from __future__ import annotations

import torch

from specplug.common.randomness import sample_inverse_cdf
from specplug.common.sampling import DEFAULT_SUM_TOLERANCE, SUM_TOLERANCE, flat_node_rows
from specplug.common.target_probs import first_argmax
from specplug.common.verify_result import VerifyResult

CHAIN_METHODS = ("greedy", "coupled")


def target_tokens(target: torch.Tensor, num_nodes: torch.Tensor, method: str,
                  uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token after every flat row, Long [R]: the first maximal index of the
    logits ("greedy"), or the inverse-CDF draw of the probabilities with the uniform of
    the row's depth, uniforms[b, d] ("coupled"). Raises as `verify` does on NaN logits or
    rows that are not distributions."""
    if method == "greedy":
        tokens = first_argmax(target)  # [R]; a NaN is the maximum, so it shows at the argmax
        if bool(target.gather(1, tokens[:, None]).isnan().any()):
            raise ValueError("target_probs contains NaN: check the target's logits")
        return tokens
    sums = target.sum(-1, dtype=torch.float32)  # [R]
    tol = SUM_TOLERANCE.get(target.dtype, DEFAULT_SUM_TOLERANCE)
    if not bool(((sums - 1.0).abs() <= tol).all()):
        raise ValueError("target_probs has a row that does not sum to 1 (NaN/inf or off by more than "
                         f"{tol}): pass probabilities from process_logits (for greedy, pass method='greedy')")
    request = torch.arange(num_nodes.shape[0], device=target.device).repeat_interleave(num_nodes)  # [R]
    depth = torch.arange(target.shape[0], device=target.device) - (num_nodes.cumsum(0) - num_nodes)[request]
    return sample_inverse_cdf(target, uniforms.to(target.device)[request, depth])


def accept_prefix(drafts: torch.Tensor, num_drafts: torch.Tensor, tokens: torch.Tensor,
                  max_drafts: int | None = None) -> VerifyResult:
    """drafts Long [B, K] (b's first num_drafts[b] real), tokens Long [B, K + 1] the
    target's token after each node (node 0 the root): accepted = the longest prefix of
    drafts equal to the target's tokens at their parents; bonus = the token after it.
    max_drafts: num_drafts.max() when the caller knows it (accepted_nodes is then
    [B, max_drafts + 1] without reading num_drafts back: no host sync, so the call can be
    captured in a CUDA graph); None reads it."""
    k = drafts.shape[1]
    real = torch.arange(k, device=drafts.device)[None] < num_drafts[:, None]  # [B, K]
    agree = (drafts == tokens[:, :k]) & real
    num_accepted = agree.long().cumprod(1).sum(1)  # [B]
    bonus = tokens.gather(1, num_accepted[:, None]).squeeze(1)
    width = int(num_drafts.max()) if max_drafts is None else max_drafts
    node = torch.arange(width + 1, device=drafts.device)[None]  # [1, D + 1]
    accepted_nodes = torch.where(node <= num_accepted[:, None], node, -1)
    return VerifyResult(accepted_nodes, num_accepted, bonus)


def verify_chains(drafts: torch.Tensor, num_drafts: torch.Tensor, target: torch.Tensor, method: str = "greedy",
                  uniforms: torch.Tensor | None = None) -> VerifyResult:
    """`sampling.verify` for chains: drafts Long [B, K], num_drafts Long [B] (<= K),
    target Float [sum(num_drafts + 1), V] flat rows (logits for "greedy", probabilities
    from process_logits for "coupled"), uniforms Float [B, >= K + 1] ("coupled": column
    d the draw of depth d, as verify takes them)."""
    if method not in CHAIN_METHODS:
        raise ValueError(f"verify_chains supports {CHAIN_METHODS}, got {method!r}: use sampling.verify")
    if method == "coupled" and uniforms is None:
        raise ValueError('method "coupled" needs uniforms [B, K + 1] (randomness.draw_uniforms)')
    num_drafts = torch.as_tensor(num_drafts, device=drafts.device).long()
    num_nodes = num_drafts + 1
    if target.shape[0] != int(num_nodes.sum()):
        raise ValueError(f"target must hold sum(num_drafts + 1) = {int(num_nodes.sum())} rows, got {target.shape[0]}")
    flat = target_tokens(target, num_nodes.to(target.device), method, uniforms)  # [R]
    tokens = flat.to(drafts.device)[flat_node_rows(num_nodes, drafts.shape[1] + 1)]  # [B, K + 1]
    return accept_prefix(drafts.long(), num_drafts, tokens)
