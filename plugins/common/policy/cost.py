"""The speculation cost model: expected tokens per step, step costs, and the choice of
how much to speculate (down to none) for the batch at hand.

Decode is memory-bound at small batch, so verifying n drafted tokens costs about as
much as decoding one; at large batch it turns compute-bound and every drafted token
costs real time. The model compares, per engine step,

    speed-up(option) = E[tokens per step | option] * T_verify(batch)
                       / (T_draft(batch, depth) + T_verify(batch * (nodes + 1)))

against 1.0 (no speculation), from two measured inputs:
- `StepCosts`: wall time of a target pass as a function of the tokens in the batch,
  and of one draft step as a function of the batch, both interpolated from
  measurements taken inside the engine (`measure_curve`);
- `AcceptanceTracker`: running per-depth acceptance rates alpha_d (the chance the
  draft token at depth d is accepted given depth d-1 was), kept per option.

`choose(...)` returns the option with the largest modelled speed-up, or None
(speculation off) when no option beats plain decoding by the hysteresis margin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class SpecOption:
    """One speculation setting: draft `depth` levels, verify `nodes` drafted tokens.

    draft_steps: drafter passes the option costs (None = `depth`, one pass per tree
        level as in EAGLE; Medusa's heads draft every level in 1 pass).
    prior_alphas: per-depth acceptance predicted for this option (e.g. from a Medusa
        tree's head accuracies), used as its prior until measured; None = the
        tracker's shared prior. Not part of the option's identity.
    """

    depth: int
    nodes: int
    draft_steps: int | None = None
    prior_alphas: tuple[float, ...] | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.depth < 1 or self.nodes < self.depth:
            raise ValueError(
                f"SpecOption needs depth >= 1 and nodes >= depth, got depth={self.depth}, "
                f"nodes={self.nodes}: a tree of depth d has at least d drafted nodes")
        if self.draft_steps is not None and self.draft_steps < 0:
            raise ValueError(f"SpecOption draft_steps must be >= 0 or None (= depth), got {self.draft_steps}")
        if self.prior_alphas is not None and len(self.prior_alphas) != self.depth:
            raise ValueError(f"SpecOption prior_alphas needs one value per depth ({self.depth}), "
                             f"got {len(self.prior_alphas)}")

    @property
    def passes(self) -> int:
        """Drafter passes per step (draft_steps, or depth when unset)."""
        return self.depth if self.draft_steps is None else self.draft_steps


@dataclass(frozen=True)
class AdaptiveConfig:
    """Settings of adaptive speculation; the defaults live here and nowhere else."""

    options: tuple[SpecOption, ...] = (
        SpecOption(1, 1), SpecOption(2, 2), SpecOption(3, 3), SpecOption(4, 8),
        SpecOption(5, 16), SpecOption(6, 32),
    )
    margin: float = 1.02          # an option must beat plain decoding by 2% to be used
    decay: float = 0.99           # per-update decay of the acceptance counts
    prior_alpha: float = 0.6      # per-depth acceptance assumed before any measurement
    prior_weight: float = 4.0     # pseudo-count of that prior


def chain_expected_tokens(alphas: Sequence[float], depth: int) -> float:
    """E[tokens per step] for a chain of `depth` drafts with per-depth acceptance alphas.

    Tokens = accepted drafts + 1 bonus; the draft at depth d is reached only if all
    shallower ones were accepted: E = 1 + sum_{i<=depth} prod_{d<=i} alpha_d.
    For constant alpha this is (1 - alpha^(k+1)) / (1 - alpha).
    """
    expected, reach = 1.0, 1.0
    for d in range(depth):
        reach *= alphas[min(d, len(alphas) - 1)] if alphas else 0.0
        expected += reach
    return expected


def tree_expected_tokens(parents: torch.Tensor, accept_prob: torch.Tensor) -> float:
    """E[tokens per step] for one tree: 1 + sum over drafted nodes of P(path accepted).

    parents      # [nodes] parents[0] = -1 (root), parents[i] < i
    accept_prob  # [nodes] P(node accepted | its parent accepted); entry 0 ignored
    Exact when acceptances along a path are independent and siblings are exclusive
    events (at most one child of a node is accepted).
    """
    return 1.0 + float(_reach(parents, accept_prob)[1:].sum())


def tree_depth_alphas(parents: torch.Tensor, depth: torch.Tensor, accept_prob: torch.Tensor) -> tuple[float, ...]:
    """Per-depth acceptance alpha_d of a tree: P(some node at depth d is accepted | depth
    d-1 was) = R_d / R_(d-1), R_d the summed path probability of the depth-d nodes.

    parents, depth, accept_prob  # [nodes] each, as in tree_expected_tokens
    chain_expected_tokens(alphas, max depth) then equals tree_expected_tokens exactly.
    """
    reach = _reach(parents, accept_prob)
    max_depth = int(depth.max()) if len(depth) else 0
    by_depth = torch.zeros(max_depth + 1, dtype=torch.float64).index_add_(0, depth.long().cpu(), reach)
    return tuple(float(by_depth[d] / by_depth[d - 1]) if by_depth[d - 1] > 0 else 0.0
                 for d in range(1, max_depth + 1))


def _reach(parents: torch.Tensor, accept_prob: torch.Tensor) -> torch.Tensor:
    """P(path to node i accepted) for every node, [nodes] float64 (root: 1)."""
    reach = torch.ones(len(parents), dtype=torch.float64)
    for i in range(1, len(parents)):
        reach[i] = reach[int(parents[i])] * float(accept_prob[i])
    return reach


class Curve:
    """Monotone piecewise-linear interpolation of measured (x, seconds) points.

    Beyond the last point it extrapolates with the slope of the last segment, so a
    large batch is never modelled as cheaper than the largest one measured.
    """

    def __init__(self, points: Sequence[tuple[float, float]]):
        if not points:
            raise ValueError("Curve needs at least one measured (x, seconds) point")
        pts = sorted(points)
        self.x = [float(p[0]) for p in pts]
        y, best = [], 0.0
        for _, sec in pts:  # enforce monotonicity: more tokens never cost less
            best = max(best, float(sec))
            y.append(best)
        self.y = y

    def __call__(self, x: float) -> float:
        xs, ys = self.x, self.y
        if len(xs) == 1:
            return ys[0] * max(x, 1.0) / max(xs[0], 1.0)
        if x <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if x <= xs[i]:
                t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])


@dataclass
class StepCosts:
    """Measured step costs: target pass by tokens in the batch, draft step by batch."""

    verify: Curve    # seconds of one target forward over N new tokens (whole batch)
    draft: Curve     # seconds of one draft step (one tree level) for a batch of B

    def step_time(self, batch: int, option: SpecOption | None) -> float:
        if option is None:
            return self.verify(batch)
        return option.passes * self.draft(batch) + self.verify(batch * (option.nodes + 1))


@dataclass
class AcceptanceTracker:
    """Running per-depth acceptance rates, one set of counts per SpecOption.

    update() takes how many drafts each request had accepted in one verify step;
    depth d counts as tried when all depths < d were accepted, and as accepted when
    num_accepted >= d. Counts decay geometrically so the estimate follows drift.
    """

    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    _tried: dict = field(default_factory=dict)
    _accepted: dict = field(default_factory=dict)

    def update(self, option: SpecOption, num_accepted: torch.Tensor) -> None:
        num_accepted = torch.as_tensor(num_accepted).reshape(-1).to(torch.float64)
        depths = torch.arange(1, option.depth + 1, dtype=torch.float64)   # [depth]
        tried = (num_accepted[:, None] >= depths - 1).sum(0)              # [depth]
        accepted = (num_accepted[:, None] >= depths).sum(0)               # [depth]
        d = self.config.decay
        self._tried[option] = d * self._tried.get(option, torch.zeros_like(tried)) + tried
        self._accepted[option] = d * self._accepted.get(option, torch.zeros_like(tried)) + accepted

    def alphas(self, option: SpecOption) -> list[float]:
        """Posterior-mean acceptance per depth for `option`: its own counts, shrunk
        towards `prior(option)` with weight `config.prior_weight`."""
        prior = self.prior(option)
        return self._posterior(option, prior)

    def prior(self, option: SpecOption) -> list[float]:
        """What `option` is expected to accept before its own counts say otherwise.

        The base prior is the option's `prior_alphas` (e.g. modelled from a Medusa
        tree's head accuracies) or `config.prior_alpha` at every depth. The option
        measured most (if another) informs it per depth: its posterior replaces a flat
        base prior, and rescales a modelled one by measured / modelled, so one
        well-measured setting calibrates the others.
        """
        base = self._base_prior(option)
        ref = self._most_measured()
        if ref is None or ref == option:
            return base
        ref_base = self._base_prior(ref)
        ref_post = self._posterior(ref, ref_base)
        out = list(base)
        for d in range(min(option.depth, ref.depth)):
            if option.prior_alphas is None:
                out[d] = ref_post[d]
            elif ref_base[d] > 0:
                out[d] = min(1.0, base[d] * ref_post[d] / ref_base[d])
        return out

    def _base_prior(self, option: SpecOption) -> list[float]:
        if option.prior_alphas is not None:
            return list(option.prior_alphas)
        return [self.config.prior_alpha] * option.depth

    def _posterior(self, option: SpecOption, prior: Sequence[float]) -> list[float]:
        w = self.config.prior_weight
        tried = self._tried.get(option)
        accepted = self._accepted.get(option)
        out = []
        for d in range(option.depth):
            t = float(tried[d]) if tried is not None else 0.0
            a = float(accepted[d]) if accepted is not None else 0.0
            out.append((a + prior[d] * w) / (t + w))
        return out

    def _most_measured(self):
        if not self._tried:
            return None
        return max(self._tried, key=lambda k: float(self._tried[k][0]))


def modelled_speedup(batch: int, option: SpecOption, alphas: Sequence[float],
                     costs: StepCosts) -> float:
    """Throughput with `option` over throughput without speculation, for one step."""
    tokens = chain_expected_tokens(alphas, option.depth)
    return tokens * costs.step_time(batch, None) / costs.step_time(batch, option)


def choose(batch: int, tracker: AcceptanceTracker, costs: StepCosts,
           options: Sequence[SpecOption] | None = None) -> SpecOption | None:
    """The option with the best modelled speed-up for this batch, or None (no speculation).

    None whenever no option beats plain decoding by `config.margin`, which is what
    keeps a busy, compute-bound server from being slowed down by speculation.
    `options` restricts the choice (default: all of `tracker.config.options`).
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    best, best_gain = None, tracker.config.margin
    for option in tracker.config.options if options is None else options:
        gain = modelled_speedup(batch, option, tracker.alphas(option), costs)
        if gain > best_gain:
            best, best_gain = option, gain
    return best


def measure_curve(step: Callable[[int], object], sizes: Sequence[int], *,
                  repeats: int = 3, warmup: int = 1) -> Curve:
    """Time `step(n)` for each n in sizes (median of `repeats`) and return the Curve.

    `step` must run one complete pass (and synchronise its device) before returning.
    """
    points = []
    for n in sizes:
        for _ in range(warmup):
            step(n)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step(n)
            times.append(time.perf_counter() - start)
        points.append((n, sorted(times)[len(times) // 2]))
    return Curve(points)
