"""Adaptive speculation, engine-free: which SpecOption (or none) each engine step runs,
learned from the timings and acceptance the adapter measures inside its engine.

An adapter reports, as its engine runs:
- `verify_timed(tokens, seconds)`: one target pass over `tokens` new tokens (the whole
  batch: B for a plain decode step, B * (nodes + 1) for a verify step);
- `draft_timed(batch, option, seconds)`: the drafting of one step (divided by the
  option's drafter passes);
- `accepted(option, num_accepted)`: the verify result, [batch] drafts accepted;
and asks `choose(batch)` before every step. An option is a chain depth (vLLM: nodes =
depth) or a tree budget (Medusa: one drafter pass, `nodes` = budget), whatever the
adapter listed; the controller only sees SpecOption(depth, nodes, draft_steps).

The choice is `specplug.common.policy.cost.choose` on the measured costs, with optimism for
what is not measured yet: the target-pass cost is known up to the largest token count
timed so far (`x_max`, interpolated below it). Options whose verify pass would run
more tokens than that are unknown; the smallest of them is offered at the optimistic
(lowest monotone) cost `T(x_max)`, the others not at all. So exploration climbs one
size at a time and stops as soon as a measured cost shows that the next size cannot
pay, which at a large batch means after one or two probes. A batch larger than
`x_max` runs plain (that measures its base cost). Every `refresh_every`-th step at a
batch re-times the next larger option when the model rates it close to the chosen one
(`refresh_band`), so one unlucky timing cannot lock an option out.

Under tensor parallelism every rank measures its own wall clock, so the choice is taken
from rank 0's measurements and broadcast (`ranks`, specplug.common.parallel's rank rule):
every rank runs the option rank 0 chose.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from specplug.common.parallel import ALONE, RankGroup
from specplug.common.policy.cost import (
    AcceptanceTracker, AdaptiveConfig, Curve, SpecOption, StepCosts, choose, modelled_speedup,
    tree_depth_alphas,
)
from specplug.common.tree import TreeConfig

logger = logging.getLogger(__name__)

ENV_ADAPTIVE = "SPECPLUG_ADAPTIVE"
ENV_COSTS = "SPECPLUG_ADAPTIVE_COSTS"


@dataclass(frozen=True)
class AdaptiveSettings:
    """Measurement settings of adaptive speculation (defaults in one place)."""

    window: int = 16           # recent timings kept per key (tokens, or batch); median used
    min_samples: int = 1       # timings a token count needs before it counts as measured
    refresh_every: int = 32    # every n-th step at a batch may re-time the next larger option
    refresh_band: float = 0.9  # ... when its modelled gain is >= this fraction of the chosen one's
    log_every: int = 500       # steps between INFO summaries of the choices


def chain_options(max_depth: int) -> tuple[SpecOption, ...]:
    """Chains of 1..max_depth drafts (an engine that verifies chains: nodes == depth)."""
    if max_depth < 1:
        raise ValueError(f"adaptive speculation needs num_speculative_tokens >= 1, got {max_depth}")
    return tuple(SpecOption(d, d) for d in range(1, max_depth + 1))


def tree_family(tree: TreeConfig) -> list[TreeConfig]:
    """The static trees adaptive speculation chooses among, smallest first, up to
    ``tree``: chains of 1..depth when topk == 1; else budgets 1, 2, 4, 8, ... below the
    tree's node count (TreeConfig.static_nodes) and that count itself."""
    if tree.topk == 1:
        return [TreeConfig(depth=d, topk=1, budget=d) for d in range(1, tree.depth + 1)]
    full = tree.static_nodes
    budgets = sorted({b for b in (2 ** i for i in range(full.bit_length())) if b < full} | {full})
    return [TreeConfig(depth=tree.depth, topk=tree.topk, budget=b) for b in budgets]


def tree_option(template, accuracies) -> SpecOption:
    """The SpecOption of a static Medusa tree: depth, draft nodes (root excluded), one
    drafter pass, and per-depth prior acceptance modelled from the heads' accuracies.

    template: DraftTree whose tokens are top-k ranks (static_trees.optimal_sparse / from_choices);
    accuracies: [heads, topk], accuracies[h][r] = P(head h's rank-r token is right).
    """
    acc = torch.as_tensor(accuracies, dtype=torch.float64)
    depth = template.depth  # [nodes]
    heads = (depth - 1).clamp(min=0, max=acc.shape[0] - 1)
    ranks = template.tokens.long().clamp(min=0, max=acc.shape[1] - 1)
    accept_prob = torch.where(depth > 0, acc[heads, ranks], torch.ones_like(acc[heads, ranks]))  # [nodes]
    alphas = tree_depth_alphas(template.parents, depth, accept_prob)
    return SpecOption(template.max_depth, template.num_nodes - 1, draft_steps=1, prior_alphas=alphas)


def pinned_costs(environ: Mapping[str, str]) -> StepCosts | None:
    """StepCosts from SPECPLUG_ADAPTIVE_COSTS, or None when unset.

    JSON `{"verify": [[tokens, seconds], ...], "draft": [[batch, seconds], ...]}`: cost
    curves measured offline (or made up, to force a decision) that replace the engine's
    own timings; "draft" may be left out (free drafting).
    """
    import json

    text = (environ.get(ENV_COSTS) or "").strip()
    if not text:
        return None
    try:
        spec = json.loads(text)
        verify = Curve([(float(x), float(y)) for x, y in spec["verify"]])
        draft = Curve([(float(x), float(y)) for x, y in spec.get("draft", [[1, 0.0]])])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f'{ENV_COSTS} must be JSON like {{"verify": [[1, 0.01], [64, 0.03]], '
                         f'"draft": [[1, 0.001]]}}, got {text!r}: {exc}') from exc
    return StepCosts(verify=verify, draft=draft)


class Timings:
    """Recent wall times per integer key (tokens in a pass, or batch size)."""

    def __init__(self, window: int):
        self._times: dict[int, deque] = defaultdict(lambda: deque(maxlen=window))

    def add(self, key: int, seconds: float) -> None:
        self._times[key].append(float(seconds))

    def count(self, key: int) -> int:
        return len(self._times.get(key, ()))

    def points(self, min_samples: int = 1) -> list[tuple[int, float]]:
        """(key, median seconds) of every key with at least min_samples timings, sorted."""
        return sorted((k, sorted(v)[len(v) // 2]) for k, v in self._times.items() if len(v) >= min_samples)

    def curve(self, min_samples: int = 1) -> Curve | None:
        points = self.points(min_samples)
        return Curve(points) if points else None


class AdaptiveController:
    """Chooses each step's option from measured costs and acceptance (see module doc).

    `costs_override` (a StepCosts) replaces the measured costs and turns exploration
    off: it pins the decision (tests, or cost curves measured offline).
    `choice_counts` counts steps per chosen option's `nodes` (0 = no speculation).
    `ranks`: the engine's tensor-parallel group; each choice is rank 0's (default ALONE:
    this process decides alone).
    """

    def __init__(self, options: Sequence[SpecOption], settings: AdaptiveSettings = AdaptiveSettings(),
                 config: AdaptiveConfig | None = None, *, ranks: RankGroup = ALONE):
        if not options:
            raise ValueError("AdaptiveController needs at least one SpecOption to choose from")
        self.options = tuple(sorted(options, key=lambda o: (o.nodes, o.depth)))
        self.settings = settings
        self.tracker = AcceptanceTracker(config or AdaptiveConfig(options=self.options))
        self.costs_override: StepCosts | None = None
        self.choice_counts: Counter = Counter()
        self.verify_times = Timings(settings.window)
        self.draft_times = Timings(settings.window)
        self._steps_at: Counter = Counter()
        self.ranks = ranks

    # -- measurement -------------------------------------------------------------------
    def verify_timed(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.verify_times.add(int(tokens), seconds)

    def draft_timed(self, batch: int, option: SpecOption, seconds: float) -> None:
        if batch > 0 and option.passes > 0:
            self.draft_times.add(int(batch), seconds / option.passes)

    def accepted(self, option: SpecOption, num_accepted: torch.Tensor) -> None:
        """num_accepted [requests]: drafts accepted in one verify step run with `option`."""
        if torch.as_tensor(num_accepted).numel():
            self.tracker.update(option, num_accepted)

    # -- decision ----------------------------------------------------------------------
    def measured_costs(self) -> StepCosts | None:
        """StepCosts from the timings so far (None until a target pass was timed); an
        unmeasured draft costs 0 (optimistic: the first drafting step measures it)."""
        verify = self.verify_times.curve(self.settings.min_samples)
        if verify is None:
            return None
        draft = self.draft_times.curve() or Curve([(1, 0.0)])
        return StepCosts(verify=verify, draft=draft)

    def choose(self, batch: int) -> SpecOption | None:
        """The option for a step of `batch` requests, or None (no speculation)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self._steps_at[batch] += 1
        option = self._agreed(self._decide(batch))
        self.choice_counts[0 if option is None else option.nodes] += 1
        if sum(self.choice_counts.values()) % self.settings.log_every == 0:
            logger.info("specplug adaptive: steps per chosen option (draft nodes, 0 = none): %s",
                        dict(sorted(self.choice_counts.items())))
        logger.debug("specplug adaptive: batch %d -> %s", batch, option)
        return option

    def _decide(self, batch: int) -> SpecOption | None:
        if self.costs_override is not None:
            return choose(batch, self.tracker, self.costs_override, self.options)
        costs = self.measured_costs()
        x_max = costs.verify.x[-1] if costs is not None else 0
        if batch > x_max:
            return None  # a plain step measures this batch's base cost first
        known = [o for o in self.options if batch * (o.nodes + 1) <= x_max]
        probe = next((o for o in self.options if batch * (o.nodes + 1) > x_max), None)
        offered = known + ([probe] if probe is not None else [])
        option = choose(batch, self.tracker, _optimistic(costs, x_max, probe, batch), offered)
        if option is None or option is probe:
            return option
        return self._refresh(batch, option, costs) or option

    def _agreed(self, option: SpecOption | None) -> SpecOption | None:
        """The option rank 0 of `ranks` chose (every rank timed its own steps)."""
        if self.ranks.alone:
            return option
        index = self.ranks.decide_once(-1 if option is None else self.options.index(option))
        return None if index < 0 else self.options[index]

    def _refresh(self, batch: int, option: SpecOption, costs: StepCosts) -> SpecOption | None:
        """Every refresh_every-th step at a batch: the next larger option, if rated close."""
        if self._steps_at[batch] % self.settings.refresh_every:
            return None
        larger = [o for o in self.options if o.nodes > option.nodes]
        if not larger:
            return None
        gain = self.gain(batch, option, costs)
        return larger[0] if self.gain(batch, larger[0], costs) >= self.settings.refresh_band * gain else None

    def gain(self, batch: int, option: SpecOption, costs: StepCosts) -> float:
        """Modelled speed-up of `option` over no speculation at `batch`."""
        return modelled_speedup(batch, option, self.tracker.alphas(option), costs)


def _optimistic(costs: StepCosts, x_max: float, probe: SpecOption | None, batch: int) -> StepCosts:
    """`costs` with the verify curve held flat from x_max to the probe's token count: the
    cheapest cost a monotone curve allows there (optimism for the one unmeasured option)."""
    if probe is None:
        return costs
    x_probe = batch * (probe.nodes + 1)
    points = list(zip(costs.verify.x, costs.verify.y)) + [(x_probe, costs.verify(x_max))]
    return StepCosts(verify=Curve(points), draft=costs.draft)
