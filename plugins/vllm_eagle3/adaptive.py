"""Adaptive speculation for the vLLM adapter: per engine step, how many tokens to draft.

The controller is specplug.common.policy.adaptive.AdaptiveController over chain options
SpecOption(d, d), d = 1..num_speculative_tokens (vLLM verifies a chain of d drafts; one
head pass per level), or None = draft nothing this step. This module only translates
what the proposer sees into the controller's measurements:

- target pass cost by tokens in the batch: the wall time from the end of one `propose`
  call to the start of the next (`StepClock`: target forward + sampling + scheduling of
  the step whose tokens the next call receives), keyed by that step's token count;
- draft cost by batch: the time of the tree drafting, per level;
- per-depth acceptance: fed by the chain sampler's verify results.

Any choice is lossless: vLLM verifies exactly the drafts it is handed, whatever their number.
Under tensor parallelism every rank builds a controller and times its own steps; each
depth is rank 0's choice, broadcast over vLLM's TP group (ranks.tp_ranks).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specplug.common.policy.adaptive import AdaptiveController as _Controller
from specplug.common.policy.adaptive import AdaptiveSettings, chain_options
from specplug.common.parallel import RankGroup

__all__ = ["AdaptiveController", "AdaptiveSettings", "StepClock", "chain_options"]


class StepClock:
    """The engine step between two `propose` calls: from leaving one (`stop`) to entering
    the next (`lap`), which is the target's forward, the sampler and vLLM's scheduling."""

    def __init__(self):
        self._left_at: float | None = None

    def lap(self) -> float | None:
        """Seconds since the last `stop` (None before the first)."""
        return None if self._left_at is None else time.perf_counter() - self._left_at

    def stop(self) -> None:
        self._left_at = time.perf_counter()


class AdaptiveController(_Controller):
    """The shared controller, driven by the proposer's calls.

    Call order per engine step: `verify_timed(tokens, seconds)` with the StepClock's lap
    on entering propose, `choose_depth(batch)`, `draft_timed(batch, depth, seconds)` after
    drafting; `record_verify(num_draft_tokens, num_accepted)` from the sampler.
    `costs_override` (a StepCosts) pins the decision (tests). `ranks`: the group whose
    rank 0 chooses (None: vLLM's TP group, ranks.tp_ranks).
    """

    def __init__(self, max_depth: int, settings: AdaptiveSettings = AdaptiveSettings(),
                 ranks: RankGroup | None = None):
        from specplug.vllm_eagle3.ranks import tp_ranks

        super().__init__(chain_options(max_depth), settings, ranks=tp_ranks() if ranks is None else ranks)

    @property
    def depth_counts(self) -> dict[int, int]:
        """Steps per chosen draft depth (0 = no speculation)."""
        return dict(self.choice_counts)

    def draft_timed(self, batch: int, depth: int, seconds: float) -> None:
        """The drafting of a `depth`-level chain for `batch` requests took `seconds`."""
        if 0 < depth <= len(self.options):
            super().draft_timed(batch, self.options[depth - 1], seconds)

    def choose_depth(self, batch: int) -> int:
        """Drafts to hand vLLM for every request of this step: 0..max_depth."""
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
