"""Adaptive speculation for an engine that verifies chains (vLLM): per engine step, how
many tokens to draft.

The controller is specplug.common.policy.adaptive.AdaptiveController over chain options
SpecOption(d, d), d = 1..num_speculative_tokens (the engine verifies a chain of d drafts;
one head pass per level), or None = draft nothing this step. This module translates what
a proposer sees into the controller's measurements:

- target pass cost by tokens in the batch: the wall time from the end of one drafting
  call to the start of the next (`StepClock`: target forward + sampling + scheduling of
  the step whose tokens the next call receives), keyed by that step's token count;
- draft cost by batch: the time of the tree drafting, per level;
- per-depth acceptance: fed by the verify results.

Any choice is lossless: the engine verifies exactly the drafts it is handed, whatever
their number. Under tensor parallelism every rank builds a controller and times its own
steps; each depth is rank 0's choice, broadcast (`ranks`).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specplug.common.parallel import ALONE, RankGroup
from specplug.common.policy.adaptive import AdaptiveController, AdaptiveSettings, chain_options


class StepClock:
    """The engine step between two drafting calls: from leaving one (`stop`) to entering
    the next (`lap`), which is the target's forward, the sampler and the engine's scheduling."""

    def __init__(self):
        self._left_at: float | None = None

    def lap(self) -> float | None:
        """Seconds since the last `stop` (None before the first)."""
        return None if self._left_at is None else time.perf_counter() - self._left_at

    def stop(self) -> None:
        self._left_at = time.perf_counter()


class ChainAdaptiveController(AdaptiveController):
    """The shared controller over chains, driven by a chain engine's calls.

    Call order per engine step: `verify_timed(tokens, seconds)` with the StepClock's lap
    on entering propose, `choose_depth(batch)`, `draft_timed(batch, depth, seconds)` after
    drafting; `record_verify(num_draft_tokens, num_accepted)` from the sampler.
    `costs_override` (a StepCosts) pins the decision (tests). `ranks`: the group whose
    rank 0 chooses (the engine's tensor-parallel ranks).
    """

    def __init__(self, max_depth: int, settings: AdaptiveSettings = AdaptiveSettings(), ranks: RankGroup = ALONE):
        super().__init__(chain_options(max_depth), settings, ranks=ranks)

    @property
    def depth_counts(self) -> dict[int, int]:
        """Steps per chosen draft depth (0 = no speculation)."""
        return dict(self.choice_counts)

    def draft_timed(self, batch: int, depth: int, seconds: float) -> None:
        """The drafting of a `depth`-level chain for `batch` requests took `seconds`."""
        if 0 < depth <= len(self.options):
            super().draft_timed(batch, self.options[depth - 1], seconds)

    def choose_depth(self, batch: int) -> int:
        """Drafts to hand the engine for every request of this step: 0..max_depth."""
        option = self.choose(batch)
        return 0 if option is None else option.depth

    def record_verify(self, num_draft_tokens: list[int], num_accepted: torch.Tensor) -> None:
        """num_draft_tokens [B] as scheduled, num_accepted [B] from verify."""
        by_depth: dict[int, list[int]] = defaultdict(list)
        for d, a in zip(num_draft_tokens, num_accepted.tolist()):
            if 0 < int(d) <= len(self.options):
                by_depth[int(d)].append(int(a))
        for d, accepted in by_depth.items():
            self.accepted(self.options[d - 1], torch.tensor(accepted))
