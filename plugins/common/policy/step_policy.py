"""How many tokens each engine step drafts, decided from costs measured on the running
engine: adaptive depth (ChainAdaptiveController) or payoff control (PayoffControl, driven
by a CycleClock), with the draft gate's step timing. An engine's proposer calls, per
step: `begin` on entering its drafting call, `depth` for the kept requests, `drafted`
after drafting, `end` on leaving; its sampler's verify result goes to `verified`. Every
decision is taken on rank 0 of `ranks` and broadcast (specplug.common.parallel).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from specplug.common.parallel import ALONE, RankGroup
from specplug.common.policy.adaptive_chains import ChainAdaptiveController, StepClock
from specplug.common.policy.draft_gate import DraftGate
from specplug.common.policy.throughput import CycleClock, PayoffControl

logger = logging.getLogger(__name__)

PAYOFF_OFF = "\"payoff\": false or SPECPLUG_PAYOFF=0 turns it off"


def payoff_clock(k: int, ranks: RankGroup = ALONE, *, all_or_none: bool, drafts: str = "drafts") -> CycleClock:
    """Payoff control over depth `k`, logged once: each step drafts the depth 0..k with the
    most tokens per second measured at its batch size, or with `all_or_none` either its
    `drafts` (a tree, a head's fixed drafts: arm k) or none (arm 0)."""
    if all_or_none:
        logger.info("specplug payoff control on: each step verifies the %s or none, whichever has delivered "
                    "more tokens per second at its batch size (%s)", drafts, PAYOFF_OFF)
        return CycleClock(PayoffControl.all_or_none(k, ranks))
    logger.info("specplug payoff control on: each step drafts the depth (0..%d) that has delivered the most tokens "
                "per second at its batch size in this engine (%s)", k, PAYOFF_OFF)
    return CycleClock(PayoffControl(k, ranks=ranks))


class StepPolicy:
    """One proposer's speculation policy across steps (module docstring). With neither
    adaptive nor payoff control every step drafts `max_depth`."""

    def __init__(self, max_depth: int, *, adaptive: bool, payoff: bool, all_or_none: bool,
                 gate: DraftGate | None = None, ranks: RankGroup = ALONE, drafts: str = "drafts"):
        self.max_depth = max_depth
        self.clock = StepClock()  # the engine step between two drafting calls
        self.gate = gate
        self.adaptive = ChainAdaptiveController(max_depth, ranks=ranks) if adaptive else None
        if self.adaptive is not None:
            logger.info("specplug adaptive speculation on: each step drafts 0..%d tokens, chosen by "
                        "specplug.common.policy.cost from step costs and acceptance measured in this engine",
                        max_depth)
        on = payoff and self.adaptive is None
        self.payoff = payoff_clock(max_depth, ranks, all_or_none=all_or_none, drafts=drafts) if on else None

    def begin(self, query_lens: Sequence[int]) -> None:
        """Entering a drafting call: the engine step since the last one ran query_lens [B]
        tokens per request (1 + its drafts for a decode); time it for the cost models."""
        seconds = self.clock.lap()
        if seconds is not None:
            tokens = sum(query_lens)
            if self.adaptive is not None:
                self.adaptive.verify_timed(tokens, seconds)
            if self.gate is not None:
                self.gate.step_timed(tokens, seconds)
        if self.payoff is not None:
            self.payoff.lap(query_lens)

    def depth(self, batch: int) -> int:
        """This step's draft depth for `batch` drafting requests (0: none drafts)."""
        if self.adaptive is not None:
            return self.adaptive.choose_depth(batch) if batch else 0
        if self.payoff is not None:
            return self.payoff.control.choose(batch) if batch else 0
        return self.max_depth

    def drafted(self, batch: int, depth: int, started: float) -> None:
        """Drafting `batch` requests `depth` deep began at perf_counter() `started`."""
        if self.adaptive is not None:
            self.adaptive.draft_timed(batch, depth, time.perf_counter() - started)

    def verified(self, num_draft_tokens, num_accepted) -> None:
        """The sampler's verify result: Long [B] drafts scheduled and accepted per row."""
        if self.payoff is not None:
            self.payoff.verified(num_draft_tokens, num_accepted.tolist())
        if self.adaptive is not None:
            self.adaptive.record_verify(num_draft_tokens, num_accepted)

    def end(self) -> None:
        """Leaving the drafting call: the engine step starts."""
        self.clock.stop()
