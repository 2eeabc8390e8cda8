"""What a verify call returns: :class:`VerifyResult` (the accepted path, how many draft
tokens it holds, the bonus token), shared by every verifier (``sampling.verify``,
``chains.verify_chains``, ``block_verify.verify_block``, the CUDA kernels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["VerifyResult"]


class VerifyResult(NamedTuple):
    """accepted_nodes Long [B, D+1] (root->last accepted, -1 padded; D = the batch's
    max tree depth), num_accepted Long [B] (draft tokens accepted, root excluded),
    bonus_token Long [B] (the target's token after the last accepted node)."""

    accepted_nodes: torch.Tensor
    num_accepted: torch.Tensor
    bonus_token: torch.Tensor

    def output_tokens(self, candidates: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Emitted tokens, Long [B, D+1] (or [B, width] when given): accepted draft tokens
        then the bonus, -1 padded (the chain-shaped layout vLLM's sampler output uses)."""
        nodes = self.accepted_nodes[:, 1:]  # [B, D]
        toks = torch.where(nodes >= 0, candidates.gather(1, nodes.clamp(min=0)), -1)
        pad = torch.full((toks.shape[0], 1 if width is None else width - toks.shape[1]), -1, dtype=toks.dtype,
                         device=toks.device)
        out = torch.cat([toks, pad], 1)  # [B, D+1]; D may be 0 (no request had drafts)
        return out.scatter_(1, self.num_accepted.unsqueeze(1), self.bonus_token.unsqueeze(1))

    def node_rows(self, starts: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Each accepted node's row in the step's flat logits, Long [B, D+1] (or [B, width]),
        -1 padded: request b's nodes own rows starts[b] (its root) onward."""
        nodes = self.accepted_nodes
        if width is not None:
            nodes = torch.cat([nodes, nodes.new_full((nodes.shape[0], width - nodes.shape[1]), -1)], 1)
        return torch.where(nodes >= 0, starts.to(nodes.device)[:, None] + nodes, -1)
