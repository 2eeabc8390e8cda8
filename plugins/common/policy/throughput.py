"""Payoff control: per engine step, how many tokens to draft (0 = none), chosen from what
each choice costs on this engine at this batch size and what the drafts yield.

An arm is a draft depth d (0: a plain step, nothing drafted): 0..max_depth for an engine
that verifies chains of any length (vLLM), or 0 and the drafter's tree depth for one that
drafts a fixed tree (SGLang: the tree or the root alone). A cycle is
one drafting call and the engine step that verifies its drafts; the adapter reports each
cycle's wall time with the drafts and accepted drafts of every request (`cycle_done`).
The control keeps, per batch bucket and arm, the seconds of the last `window` clean
cycles (decode only: no prefill joined the step), and, pooled over all cycles, the
acceptance of each draft position (alpha_i: accepted given reached, decayed). The rate
of arm d at batch B is

    rate(d) = B * (1 + alpha_1 + alpha_1 alpha_2 + ... + alpha_1...alpha_d) / T(bucket, d)

with T the arm's mean measured cycle time: drafting, the verify pass, the sampler and
the engine's work around them, all in it. The best rate runs; a drafting arm must beat
the plain step by `margin`. Timings are the engine's own, so a drafting arm that loses
to the plain step runs only for its measurements.

Exploration: at a new bucket the arms are timed shallowest first, `min_samples` cycles
each (one for a drafting arm whose first timing puts it under `clear_loss` of the plain
rate at the acceptance seen so far), and a deeper arm is skipped when even at its cost
floor its tokens could not beat the best rate so far: the floor is the cost of the arm
before it, or the plain step's cost times the arm's cost ratio measured at the nearest
smaller bucket (an arm that loses at batch 4 is not explored at batch 8). Then a
neighbour of the best arm (the one timed longest ago) is re-timed `probe_every` cycles
later, and again after twice as many cycles each time the best arm stays the same (up to
`max_probe_every`; back to `probe_every` when it changes), so the choice follows changes
in load and acceptance while a settled choice pays for almost no probes. A probed depth
drops its earlier timings and is timed afresh (`min_samples` cycles, one where it loses
clearly), so a timing taken while the host ran slow cannot outlive the probes. The first
drafting cycle after plain ones carries the head's deferred catch-up: it is not timed,
and any switch from plain to drafting runs one cycle more, which is timed.

Invariant: any choice is lossless (the engine verifies exactly the drafts it is handed),
and the choice is a function of the recorded timings and acceptance only. Under tensor
parallelism each rank measures its own wall clock, so the depth is rank 0's, broadcast
(`ranks`, specplug.common.parallel's rank rule).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from typing import Sequence

from specplug.common.parallel import ALONE, RankGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PayoffSettings:
    """Settings of payoff control (defaults in one place)."""

    window: int = 16         # recent clean cycles timed per (batch bucket, depth)
    min_samples: int = 3     # timed cycles a depth needs at a bucket before it competes
    probe_every: int = 32    # cycles at a bucket before re-timing a neighbour of the best depth ...
    max_probe_every: int = 1024  # ... doubling while the best depth stays, up to this
    margin: float = 1.02     # a drafting depth must beat the plain step's rate by this factor
    decay: float = 0.998     # per-cycle decay of the acceptance counts
    prior: float = 2.0       # pseudo-counts of acceptance 1 per position (optimism before evidence)
    floor_slack: float = 0.8  # share of a smaller batch's extra cost of a depth assumed at a larger one
    clear_loss: float = 0.9  # a depth whose first timing is below this share of the plain rate is timed once
    log_every: int = 1000    # cycles between INFO summaries


def batch_bucket(batch: int) -> int:
    """Batches timed together: each size up to 8, then powers of two (9-16 -> 16, ...)."""
    return batch if batch <= 8 else 2 ** math.ceil(math.log2(batch))


class Acceptance:
    """Per draft position i = 1..max_depth: decayed counts of requests that reached it
    (drafted at least i, accepted the i - 1 before) and of those that accepted it."""

    def __init__(self, max_depth: int, settings: PayoffSettings):
        self.settings = settings
        self.reached = [settings.prior] * max_depth
        self.accepted = [settings.prior] * max_depth

    def update(self, drafts: Sequence[int], accepted: Sequence[int]) -> None:
        d = self.settings.decay
        self.reached = [r * d for r in self.reached]
        self.accepted = [a * d for a in self.accepted]
        for k, a in zip(drafts, accepted):
            for i in range(min(int(k), int(a) + 1, len(self.reached))):
                self.reached[i] += 1
                self.accepted[i] += i < int(a)

    def tokens_per_request(self, depth: int) -> float:
        """1 + the expected accepted drafts of a chain of `depth`."""
        total, reach = 1.0, 1.0
        for i in range(depth):
            reach *= self.accepted[i] / self.reached[i]
            total += reach
        return total


class PayoffControl:
    """The depth of each engine step (module docstring). Call order per step:
    `cycle_done(seconds, drafts, accepted, clean)` for the cycle just finished (ignored
    before the first choice), then `choose(batch)`."""

    def __init__(self, max_depth: int, settings: PayoffSettings = PayoffSettings(), ranks: RankGroup = ALONE,
                 arms: Sequence[int] | None = None):
        if max_depth < 1:
            raise ValueError(f"payoff control needs num_speculative_tokens >= 1, got {max_depth}")
        self.arms = tuple(range(max_depth + 1)) if arms is None else tuple(sorted({0, *arms}))
        if self.arms[-1] > max_depth:
            raise ValueError(f"payoff control arms must be depths 0..{max_depth}, got {list(arms)}")
        self.max_depth, self.settings, self.ranks = max_depth, settings, ranks
        self.acceptance = Acceptance(max_depth, settings)
        self.times: dict[tuple[int, int], deque] = defaultdict(lambda: deque(maxlen=settings.window))
        self.timed_at: dict[tuple[int, int], int] = {}  # (bucket, depth) -> cycle of its last timing
        self.cycles: Counter = Counter()  # per bucket
        self.choice_counts: Counter = Counter()  # per depth
        self._in_flight: tuple[int, int, int, bool] | None = None  # bucket, batch, depth, timed?
        self._previous: int | None = None
        self._held: list[tuple[int, int]] = []  # (bucket, depth) forced next at that bucket (a probe's 2nd cycle)
        self._next_probe: dict[int, int] = {}  # bucket -> the cycle of its next probe
        self._probe_every: dict[int, int] = {}  # bucket -> cycles between its probes now
        self._best_at_probe: dict[int, int] = {}  # bucket -> the best depth at its last probe
        self._earlier: dict[tuple[int, int], float] = {}  # (bucket, depth) -> mean cost before its last re-timing

    @classmethod
    def all_or_none(cls, depth: int, ranks: RankGroup = ALONE) -> "PayoffControl":
        """Two arms, the whole tree or chain `depth` deep and no drafts: for steps that verify
        a drafter's fixed tree (stage tree, Medusa, SGLang's workers)."""
        return cls(depth, arms=(depth,), ranks=ranks)

    def cycle_done(self, seconds: float, drafts: Sequence[int], accepted: Sequence[int], clean: bool = True) -> None:
        """The last chosen cycle took `seconds`; drafts [B] and accepted [B] per request of
        the step that verified it; `clean`: no prefill and no request change disturbed it."""
        in_flight, self._in_flight = self._in_flight, None
        if any(drafts):
            self.acceptance.update(drafts, accepted)
        if in_flight is None or not clean or seconds <= 0:
            return
        bucket, _, depth, timed = in_flight
        if timed:
            self.times[(bucket, depth)].append(seconds)
            self.timed_at[(bucket, depth)] = self.cycles[bucket]

    def choose(self, batch: int) -> int:
        """The depth of this step, one of `arms` (rank 0's choice under TP)."""
        bucket = batch_bucket(batch)
        self.cycles[bucket] += 1
        depth = int(self.ranks.decide_once(self._decide(bucket, batch)))
        catching_up = depth > 0 and self._previous == 0
        self._in_flight = (bucket, batch, depth, not catching_up)
        self._previous = depth
        self.choice_counts[depth] += 1
        self._log(bucket, batch)
        return depth

    def cost(self, bucket: int, depth: int) -> float | None:
        """Mean seconds of a cycle of `depth` at `bucket` (timed_cost); while a probe re-times
        it, the mean of its earlier timings; None until its first timings are in."""
        timed = self.timed_cost(bucket, depth)
        return self._earlier.get((bucket, depth)) if timed is None else timed

    def timed_cost(self, bucket: int, depth: int) -> float | None:
        """Mean seconds of the current timings of `depth` at `bucket`, None before
        min_samples of them (one is enough for a drafting depth that loses clearly:
        _loses_clearly)."""
        samples = self.times.get((bucket, depth), ())
        if not samples:
            return None
        mean = sum(samples) / len(samples)
        if len(samples) >= self.settings.min_samples or (depth and self._loses_clearly(bucket, depth, mean)):
            return mean
        return None

    def _loses_clearly(self, bucket: int, depth: int, cost: float) -> bool:
        """Whether `depth` at `cost` seconds a cycle delivers under `clear_loss` of the plain
        step's rate at the acceptance measured so far: timing it twice more would cost more
        than it could tell (a probe re-times it later)."""
        plain = self.cost(bucket, 0)
        tokens = self.acceptance.tokens_per_request(depth)
        return plain is not None and tokens / cost < self.settings.clear_loss / plain

    def rate(self, bucket: int, batch: int, depth: int, cost: float | None = None) -> float | None:
        """Expected tokens per second of `depth` for `batch` requests (at `cost` seconds a
        cycle; None: its measured cost), None when not timed."""
        cost = self.cost(bucket, depth) if cost is None else cost
        return None if cost is None else batch * self.acceptance.tokens_per_request(depth) / cost

    def best(self, bucket: int, batch: int) -> int:
        """The timed depth with the best rate (drafting ones discounted by the margin)."""
        rates = {d: self.rate(bucket, batch, d) for d in self.arms}
        timed = [d for d, r in rates.items() if r is not None]
        return max(timed, key=lambda d: rates[d] / (self.settings.margin if d else 1.0))

    def _decide(self, bucket: int, batch: int) -> int:
        held, self._held = self._held, []  # a switch's timed cycle, unless the batch moved to another bucket
        if held and held[0][0] == bucket:
            return held[0][1]
        depth = self._pick(bucket, batch)
        if depth > 0 and self._previous == 0:
            self._hold(bucket, depth)
        return depth

    def _hold(self, bucket: int, depth: int) -> None:
        """Run `depth` for one more cycle: the first drafting cycle after plain ones carries the
        head's catch-up and is not timed, so a switch (a probe, exploration or a new best)
        runs one cycle more and is timed in it; else a depth whose timing is stale could be
        switched to and away from again and again without ever being timed afresh."""
        self._held.append((bucket, depth))

    def _pick(self, bucket: int, batch: int) -> int:
        """This cycle's depth: an untimed depth that could win, else the best, or every so
        often a neighbour of the best re-timed (a probe)."""
        untimed = [d for d in self.arms if self.timed_cost(bucket, d) is None]
        if untimed and (untimed[0] == 0 or self._could_win(bucket, batch, untimed[0])):
            return untimed[0]
        best = self.best(bucket, batch)
        if not self._probe_due(bucket, best):
            return best
        i = self.arms.index(best)
        neighbours = [d for d in self.arms[max(i - 1, 0):i + 2] if d < best or (
            d > best and self._could_win(bucket, batch, d))]
        if not neighbours:
            return best
        probe = min(neighbours, key=lambda d: self.timed_at.get((bucket, d), -1))
        self._retime(bucket, probe)
        return probe

    def _retime(self, bucket: int, depth: int) -> None:
        """A probed depth is timed afresh: its earlier timings, taken at another load or host
        speed, are dropped, so it competes with the best depth's recent ones (min_samples
        cycles, or one where it loses clearly; until then `cost` reads the earlier mean)."""
        timed = self.timed_cost(bucket, depth)
        if timed is not None:
            self._earlier[(bucket, depth)] = timed
        self.times[(bucket, depth)].clear()

    def _probe_due(self, bucket: int, best: int) -> bool:
        """Whether this cycle re-times a neighbour of `best`; schedules the next probe."""
        cycle, settings = self.cycles[bucket], self.settings
        if cycle < self._next_probe.setdefault(bucket, cycle + settings.probe_every):
            return False
        every = self._probe_every.get(bucket, settings.probe_every)
        every = min(2 * every, settings.max_probe_every) if self._best_at_probe.get(bucket) == best else \
            settings.probe_every
        self._probe_every[bucket], self._best_at_probe[bucket] = every, best
        self._next_probe[bucket] = cycle + every
        return True

    def _could_win(self, bucket: int, batch: int, depth: int) -> bool:
        """Whether `depth`, at its cost floor (_cost_floor), could beat the best rate."""
        floor = self._cost_floor(bucket, depth)
        if floor is None:
            return True
        best = self.best(bucket, batch)
        return self.rate(bucket, batch, depth, cost=floor) > self.rate(bucket, batch, best) * self.settings.margin

    def _cost_floor(self, bucket: int, depth: int) -> float | None:
        """A lower bound on a cycle of `depth` at `bucket`: the arm below's cost here, or a
        plain step's cost here times `depth`'s measured cost ratio to a plain step at the
        nearest smaller bucket (discounted by `floor_slack`), whichever is larger. The ratio
        grows with the batch (each drafted token adds more to a fuller step), so an arm that
        loses at a smaller batch is not explored at a larger one."""
        below = self.cost(bucket, self.arms[self.arms.index(depth) - 1])
        plain = self.cost(bucket, 0)
        smaller = sorted({b for b, _ in self.times if b < bucket and self.cost(b, 0) is not None
                          and self.cost(b, depth) is not None}, reverse=True)
        if plain is None or not smaller:
            return below
        ratio = self.cost(smaller[0], depth) / self.cost(smaller[0], 0)
        scaled = plain * (1 + (ratio - 1) * self.settings.floor_slack)
        return scaled if below is None else max(below, scaled)

    def _log(self, bucket: int, batch: int) -> None:
        if sum(self.choice_counts.values()) % self.settings.log_every:
            return
        rates = {d: self.rate(bucket, batch, d) for d in self.arms}
        logger.info("specplug payoff control: steps per draft depth %s; at batch %d, tokens/s by depth %s",
                    dict(sorted(self.choice_counts.items())), batch,
                    {d: None if r is None else round(r, 1) for d, r in rates.items()})


class CycleClock:
    """Payoff control driven from an engine's step loop: `step(batch)` at the start of each
    decode step reports the cycle that just ended (clean when its verify result came in
    and no prefill step ran in it) and returns this step's depth (an engine that chooses
    only on some steps calls `lap()` every step and `control.choose` when it drafts);
    `verified(drafts, accepted)` after the verify, per request; `disturbed()` when a
    prefill step runs."""

    def __init__(self, control: PayoffControl):
        self.control = control
        self.depth = 0  # this step's depth, as step() returned it
        self._started: float | None = None
        self._verified: tuple[list[int], list[int]] | None = None
        self._disturbed = False

    def step(self, batch: int, query_lens: Sequence[int] | None = None) -> int:
        """`lap(query_lens)`, then this step's depth for `batch` requests."""
        self.lap(query_lens)
        self.depth = self.control.choose(batch)
        return self.depth

    def lap(self, query_lens: Sequence[int] | None = None) -> None:
        """Report the cycle that just ended and start the next. `query_lens` [B]: tokens each
        request ran in the step that just ended, for an engine that mixes prefill chunks
        into decode steps (vLLM): the cycle is clean only where each ran 1 + its drafts."""
        now = time.perf_counter()
        if self._started is not None:
            drafts, accepted = self._verified or ([], [])
            clean = self._verified is not None and not self._disturbed and (
                query_lens is None or list(query_lens) == [1 + d for d in drafts])
            self.control.cycle_done(now - self._started, drafts, accepted, clean)
        self._started, self._verified, self._disturbed = now, None, False

    def verified(self, drafts: Sequence[int], accepted: Sequence[int]) -> None:
        self._verified = (list(drafts), list(accepted))

    def disturbed(self) -> None:
        self._disturbed = True
