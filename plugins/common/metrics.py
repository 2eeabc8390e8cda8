"""Acceptance metrics: per-position acceptance and the mean acceptance length tau.

Definitions (the ones engines and papers use, spelled out once):

* a *step* is one verify call for one request; it emits ``num_accepted + 1`` tokens.
* ``tau`` = mean tokens emitted per step = 1 + mean accepted draft tokens (EAGLE's
  "average acceptance length", SGLang's ``accept_length`` + 1).
* ``accepted_per_pos[d]`` = steps that accepted at least d + 1 draft tokens, i.e.
  accepted a token at draft position d (vLLM's ``num_accepted_tokens_per_pos``).
* ``acceptance_per_pos[d]`` = accepted_per_pos[d] / steps (vLLM's per-position rate).
* ``conditional_acceptance[d]`` = accepted_per_pos[d] / accepted_per_pos[d - 1] (steps
  for d = 0): acceptance at position d given position d - 1 was accepted; the
  per-head "alpha" the cost model and ``optimal_sparse`` reason with.
* ``draft_acceptance_rate`` = accepted draft tokens / draft tokens proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["AcceptanceStats", "tau"]


def tau(num_accepted: torch.Tensor) -> float:
    """Mean tokens per step for accepted counts Long [steps]."""
    if num_accepted.numel() == 0:
        raise ValueError("tau of zero steps is undefined: pass at least one num_accepted value")
    return float(num_accepted.double().mean()) + 1.0


def _accepted_counts(num_accepted) -> torch.Tensor:
    acc = getattr(num_accepted, "num_accepted", num_accepted)  # VerifyResult or tensor
    acc = torch.as_tensor(acc).flatten().long().cpu()
    if acc.numel() and int(acc.min()) < 0:
        raise ValueError(f"num_accepted must be >= 0, got {acc.min().item()}")
    return acc


@dataclass
class AcceptanceStats:
    """Running acceptance totals over verify steps (a mutable accumulator).

    ``update`` after every verify call; add two with ``+`` to merge workers.
    """

    num_steps: int = 0
    num_accepted: int = 0
    num_draft_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def update(self, num_accepted, num_draft_tokens=None) -> "AcceptanceStats":
        """num_accepted: Long [B] or a VerifyResult; num_draft_tokens: int or Long [B]
        draft nodes offered in these steps (root excluded), if known."""
        acc = _accepted_counts(num_accepted)
        self.num_steps += acc.numel()
        self.num_accepted += int(acc.sum())
        if num_draft_tokens is not None:
            self.num_draft_tokens += int(torch.as_tensor(num_draft_tokens).sum())
        if acc.numel() and int(acc.max()) > 0:
            # steps reaching position d = #(acc >= d + 1)
            reach = torch.bincount(acc, minlength=int(acc.max()) + 1).flip(0).cumsum(0).flip(0)[1:]
            self._add_per_pos(reach.tolist())
        return self

    @classmethod
    def from_histograms(cls, histograms, draft_tokens_per_step: int | None = None) -> "AcceptanceStats":
        """Merge per-request histograms (h[i] = verify steps that accepted exactly i draft
        tokens, SGLang's `spec_correct_drafts_histogram`; None or empty skipped) into one.
        draft_tokens_per_step: tree nodes minus the root, if known."""
        stats = cls()
        for histogram in histograms:
            if not histogram:
                continue
            counts = torch.as_tensor(histogram, dtype=torch.long)
            num_accepted = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # [steps]
            proposed = None if draft_tokens_per_step is None else draft_tokens_per_step * num_accepted.numel()
            stats.update(num_accepted, proposed)
        return stats

    def _add_per_pos(self, counts: list[int]) -> None:
        if len(counts) > len(self.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(counts) - len(self.accepted_per_pos)))
        for d, c in enumerate(counts):
            self.accepted_per_pos[d] += int(c)

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        out = AcceptanceStats(
            self.num_steps + other.num_steps,
            self.num_accepted + other.num_accepted,
            self.num_draft_tokens + other.num_draft_tokens,
            list(self.accepted_per_pos),
        )
        out._add_per_pos(other.accepted_per_pos)
        return out

    def __sub__(self, earlier: "AcceptanceStats") -> "AcceptanceStats":
        """The steps since `earlier`, a snapshot of the same cumulative counters."""
        out = AcceptanceStats(
            self.num_steps - earlier.num_steps,
            self.num_accepted - earlier.num_accepted,
            self.num_draft_tokens - earlier.num_draft_tokens,
            list(self.accepted_per_pos),
        )
        out._add_per_pos([-c for c in earlier.accepted_per_pos])
        return out

    @property
    def tau(self) -> float:
        """Mean tokens per step (0.0 before any step)."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [c / self.num_steps for c in self.accepted_per_pos] if self.num_steps else []

    @property
    def conditional_acceptance(self) -> list[float]:
        prev = [self.num_steps] + self.accepted_per_pos[:-1]
        return [c / p if p else 0.0 for c, p in zip(self.accepted_per_pos, prev)]

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else None

    def as_dict(self) -> dict:
        return {
            "num_steps": self.num_steps,
            "num_accepted": self.num_accepted,
            "num_draft_tokens": self.num_draft_tokens,
            "tau": self.tau,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_per_pos": self.acceptance_per_pos,
            "conditional_acceptance": self.conditional_acceptance,
            "draft_acceptance_rate": self.draft_acceptance_rate,
        }
