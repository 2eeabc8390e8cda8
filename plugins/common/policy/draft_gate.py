"""The draft gate: per request and per step, hand the engine a request's drafts only
when they are expected to pay for the time they add to the step.

A chain of K drafts adds K tokens to the target's step and is expected to add E tokens
to the request's output (E: its expected accepted length, from the drafter's node
scores). With T(n) the measured wall time of an engine step over n new tokens (the
target's forward, the sampler, the engine's work around them), a step over B requests
of which the m with the largest E draft yields

    rate(m) = (B + E_1 + ... + E_m) / T(B + m K)          tokens per second,

and the gate drafts for the prefix m that maximises it (m = 0: a plain step, every
request without drafts). Unlike a batch-level choice of depth (policy.adaptive), this
skips exactly the requests whose drafts are unlikely, and keeps the others.

T comes from the engine's own steps (`step_timed`); a token count beyond the largest
one timed is taken at the largest one's cost (optimism: drafting once measures it), and
a batch whose plain step was never timed runs one plain step first (which measures it).
E is the drafter's estimate scaled by how it has turned out so far (`verified`):
measured accepted / predicted over the drafted requests, shrunk towards 1.

Invariant: the gate only removes drafts; whatever it hands the engine is verified as
before, so the output is unchanged (lossless by construction). Under tensor parallelism
T is each rank's own wall clock, so the keep mask is rank 0's, broadcast (`ranks`,
specplug.common.parallel's rank rule).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specplug.common.parallel import ALONE, RankGroup
from specplug.common.policy.adaptive import Timings
from specplug.common.policy.cost import Curve

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateSettings:
    """Settings of the draft gate (defaults in one place)."""

    window: int = 16            # recent step timings kept per token count; median used
    margin: float = 1.0         # drafting must raise the step's tokens per second by this factor
    prior_weight: float = 8.0   # pseudo-tokens behind the drafter's own estimate (scale 1)
    decay: float = 0.995        # per-update decay of the measured accepted / predicted counts
    log_every: int = 2000       # request decisions between INFO lines (drafted / withheld)


def best_prefix(expected: torch.Tensor, batch: int, drafts: int, step_time, margin: float = 1.0) -> int:
    """How many requests (the largest E first) should draft: the m maximising
    (batch + sum of the m largest E) / step_time(batch + m * drafts); 0 unless that
    beats the plain step's rate by `margin`.

    expected  # [R] Float, E per request that could draft (R <= batch)
    """
    gains = torch.sort(expected.double(), descending=True).values.cumsum(0)  # [R]
    plain = batch / step_time(batch)
    best, best_rate = 0, plain * margin
    for m in range(1, len(gains) + 1):
        rate = (batch + float(gains[m - 1])) / step_time(batch + m * drafts)
        if rate > best_rate:
            best, best_rate = m, rate
    return best


class DraftGate:
    """Which requests' drafts a step hands the engine (see module doc). `ranks`: the
    engine's tensor-parallel group; every rank keeps rank 0's choice (default ALONE)."""

    def __init__(self, settings: GateSettings = GateSettings(), *, ranks: RankGroup = ALONE):
        self.settings = settings
        self.ranks = ranks
        self.step_times = Timings(settings.window)
        self._accepted = 0.0   # decayed accepted drafts of gated-in requests
        self._predicted = 0.0  # ... and what the drafter's E predicted for them
        self.drafted = 0       # requests handed drafts, over all steps
        self.withheld = 0      # requests whose drafts the gate dropped

    def step_timed(self, tokens: int, seconds: float) -> None:
        """One engine step over `tokens` new tokens (the whole batch) took `seconds`."""
        if tokens > 0:
            self.step_times.add(int(tokens), seconds)

    def verified(self, predicted: float, accepted: int) -> None:
        """A drafted request's E at drafting time and the drafts it had accepted."""
        d = self.settings.decay
        self._predicted = d * self._predicted + float(predicted)
        self._accepted = d * self._accepted + float(accepted)

    @property
    def scale(self) -> float:
        """Measured accepted / predicted, shrunk towards 1 by prior_weight."""
        w = self.settings.prior_weight
        return (self._accepted + w) / (self._predicted + w)

    def choose(self, expected: torch.Tensor, batch: int, drafts: int) -> torch.Tensor:
        """Bool [R]: which of R drafting requests keep their `drafts` drafts in a step of
        `batch` requests. expected [R]: each request's E (inf: always keep)."""
        keep = torch.zeros(len(expected), dtype=torch.bool)
        curve = self.step_times.curve()
        if curve is None:
            keep[:] = True  # nothing timed yet: draft, and measure
        elif self.step_times.count(batch) == 0:
            pass  # the plain step at this batch was never timed: run one, and measure it
        else:
            scaled = torch.where(expected.isinf(), expected, expected * self.scale)
            m = best_prefix(scaled.clamp(max=drafts), batch, drafts, _optimistic(curve), self.settings.margin)
            keep[torch.sort(scaled, descending=True, stable=True).indices[:m]] = True
        keep = self.ranks.decide_once(keep)
        self._count(keep)
        return keep

    def _count(self, keep: torch.Tensor) -> None:
        before = self.drafted + self.withheld
        self.drafted += int(keep.sum())
        self.withheld += int((~keep).sum())
        if (self.drafted + self.withheld) // self.settings.log_every > before // self.settings.log_every:
            logger.info("specplug gate: drafts handed the engine for %d request steps, withheld for %d "
                        "(accepted / predicted %.2f)", self.drafted, self.withheld, self.scale)


def _optimistic(curve: Curve):
    """T(n): the measured curve, held flat beyond the largest token count timed."""
    largest = curve.x[-1]
    return lambda n: curve(min(n, largest))
