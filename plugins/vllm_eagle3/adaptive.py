"""Adaptive speculation for the vLLM adapter: per engine step, how many tokens to draft.

The choice is specplug.common.cost.choose over chain options SpecOption(d, d),
d = 1..num_speculative_tokens (vLLM verifies a chain of d drafts), or None = draft
nothing this step. Its inputs are measured inside the engine:

- target step cost by tokens in the batch: the wall time from the end of one
  `propose` call to the start of the next (target forward + sampling + scheduling of
  the step whose tokens the next call receives), keyed by that step's token count;
- draft step cost by batch: the time of the tree drafting divided by its depth;
- per-depth acceptance: AcceptanceTracker, fed by the chain sampler's verify results.

Until a step size has been measured the model cannot compare it, so every
`explore_every`-th step at a batch size tries the least-measured option. Any choice
is lossless: vLLM verifies exactly the drafts it is handed, whatever their number.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from specplug.common.cost import AcceptanceTracker, AdaptiveConfig, Curve, SpecOption, StepCosts, choose

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdaptiveSettings:
    """Measurement settings of the vLLM adaptive mode (defaults in one place)."""

    window: int = 16          # recent timings kept per step size (median used)
    explore_every: int = 8    # every n-th step at a batch tries the least-measured option
    min_samples: int = 2      # timings a step size needs before it counts as measured


def chain_options(max_depth: int) -> tuple[SpecOption, ...]:
    """Chains of 1..max_depth drafts: vLLM verifies a chain, so nodes == depth."""
    if max_depth < 1:
        raise ValueError(f"adaptive speculation needs num_speculative_tokens >= 1, got {max_depth}")
    return tuple(SpecOption(d, d) for d in range(1, max_depth + 1))


class _Timings:
    """Recent wall times per integer key (tokens in a step, or batch size)."""

    def __init__(self, window: int):
        self._times: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))

    def add(self, key: int, seconds: float) -> None:
        self._times[key].append(seconds)

    def count(self, key: int) -> int:
        return len(self._times.get(key, ()))

    def curve(self) -> Curve | None:
        points = [(k, sorted(v)[len(v) // 2]) for k, v in self._times.items() if v]
        return Curve(points) if points else None


class AdaptiveController:
    """Chooses the draft depth of each step and learns from what the engine measured.

    Call order per engine step: `step_started(tokens)` on entering propose,
    `choose_depth(batch)`, `draft_timed(batch, depth, seconds)` after drafting,
    `step_finished()` on leaving propose; `record_verify(num_draft_tokens, num_accepted)`
    from the sampler. `costs_override` (a StepCosts) replaces the measured costs:
    no exploration then (used by tests to force a decision).
    """

    def __init__(self, max_depth: int, settings: AdaptiveSettings = AdaptiveSettings()):
        self.options = chain_options(max_depth)
        self.settings = settings
        self.tracker = AcceptanceTracker(AdaptiveConfig(options=self.options))
        self.costs_override: StepCosts | None = None
        self.depth_counts: dict[int, int] = defaultdict(int)  # chosen depth -> steps (0 = none)
        self._verify = _Timings(settings.window)
        self._draft = _Timings(settings.window)
        self._steps_at: dict[int, int] = defaultdict(int)
        self._left_at: float | None = None

    # -- measurement -------------------------------------------------------------------
    def step_started(self, tokens: int) -> None:
        """A target step over `tokens` new tokens ended just now (the propose call began)."""
        if self._left_at is not None and tokens > 0:
            self._verify.add(tokens, time.perf_counter() - self._left_at)

    def step_finished(self) -> None:
        self._left_at = time.perf_counter()

    def draft_timed(self, batch: int, depth: int, seconds: float) -> None:
        if depth > 0:
            self._draft.add(batch, seconds / depth)

    def record_verify(self, num_draft_tokens: list[int], num_accepted: torch.Tensor) -> None:
        """num_draft_tokens [B] as scheduled, num_accepted [B] from verify."""
        by_depth: dict[int, list[int]] = defaultdict(list)
        for d, a in zip(num_draft_tokens, num_accepted.tolist()):
            if d > 0:
                by_depth[int(d)].append(int(a))
        for d, accepted in by_depth.items():
            if d <= len(self.options):
                self.tracker.update(self.options[d - 1], torch.tensor(accepted))

    # -- decision ----------------------------------------------------------------------
    def costs(self) -> StepCosts | None:
        if self.costs_override is not None:
            return self.costs_override
        verify, draft = self._verify.curve(), self._draft.curve()
        return None if verify is None or draft is None else StepCosts(verify=verify, draft=draft)

    def choose_depth(self, batch: int) -> int:
        """Drafts to hand vLLM for every request of this step: 0..max_depth."""
        self._steps_at[batch] += 1
        depth = self._explore(batch)
        if depth is None:
            option = choose(batch, self.tracker, self.costs())
            depth = 0 if option is None else option.depth
        self.depth_counts[depth] += 1
        logger.debug("specplug adaptive: batch %d -> draft depth %d", batch, depth)
        return depth

    def _explore(self, batch: int) -> int | None:
        """The least-measured depth when this step explores (or nothing is measured yet)."""
        if self.costs_override is not None:
            return None
        costs = self.costs()
        if costs is not None and self._steps_at[batch] % self.settings.explore_every:
            return None
        counts = {d: self._verify.count(batch * (d + 1)) for d in range(len(self.options) + 1)}
        depth = min(counts, key=lambda d: (counts[d], -d))
        if costs is not None and counts[depth] >= self.settings.min_samples:
            return None
        return depth
