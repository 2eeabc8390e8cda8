"""Payoff control (specplug.common.policy.throughput) against simulated engines whose
best depth is known: it settles on that depth at each batch size, and what it delivers
stays within 2% of the best fixed depth, exploration included."""

from __future__ import annotations

import random

import pytest

from specplug.common.parallel import RankGroup
from specplug.common.policy.throughput import CycleClock, PayoffControl, PayoffSettings, batch_bucket

MAX_DEPTH = 4
ALPHA = 0.7  # per-position acceptance of the simulated drafter


class SimulatedEngine:
    """A step over n tokens costs base + per_token * n seconds; drafting depth d costs
    draft * d; a request emits 1 + ALPHA + ... + ALPHA^d tokens a cycle on average (the
    accepted counts drawn per request); timings carry 3% noise."""

    def __init__(self, base: float, per_token: float, draft: float, seed: int = 0):
        self.base, self.per_token, self.draft = base, per_token, draft
        self.random = random.Random(seed)

    def cycle(self, batch: int, depth: int) -> tuple[float, list[int], list[int]]:
        """(seconds, drafts [B], accepted [B]) of one cycle."""
        seconds = (self.base + self.per_token * batch * (1 + depth) + self.draft * depth)
        seconds *= 1 + 0.03 * self.random.uniform(-1, 1)
        accepted = []
        for _ in range(batch):
            a = 0
            while a < depth and self.random.random() < ALPHA:
                a += 1
            accepted.append(a)
        return seconds, [depth] * batch, accepted

    def expected_rate(self, batch: int, depth: int) -> float:
        tokens = batch * sum(ALPHA ** i for i in range(depth + 1))
        return tokens / (self.base + self.per_token * batch * (1 + depth) + self.draft * depth)


def run(control: PayoffControl, engine: SimulatedEngine, batch: int, cycles: int) -> tuple[float, list[int]]:
    """Tokens per second over `cycles` cycles at `batch`, and the depths chosen."""
    seconds = tokens = 0.0
    chosen = []
    for _ in range(cycles):
        depth = control.choose(batch)
        s, drafts, accepted = engine.cycle(batch, depth)
        control.cycle_done(s, drafts, accepted)
        seconds, tokens = seconds + s, tokens + batch + sum(accepted)
        chosen.append(depth)
    return tokens / seconds, chosen


# a CPU-like engine: memory-bound base, a few ms per verified token, ~3 ms per head level
CPU_LIKE = dict(base=0.030, per_token=0.0015, draft=0.003)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 64])
def test_it_delivers_within_two_percent_of_the_best_fixed_depth(batch):
    engine = SimulatedEngine(**CPU_LIKE, seed=batch)
    rate, chosen = run(PayoffControl(MAX_DEPTH), engine, batch, 600)
    best = max(range(MAX_DEPTH + 1), key=lambda d: engine.expected_rate(batch, d))
    assert rate >= 0.98 * engine.expected_rate(batch, best)
    settled = [d for d in set(chosen[-200:]) if chosen[-200:].count(d) >= 20]  # probes aside
    assert all(engine.expected_rate(batch, d) >= 0.97 * engine.expected_rate(batch, best) for d in settled)


def test_it_drafts_at_batch_one_and_runs_plain_where_drafting_loses():
    engine = SimulatedEngine(**CPU_LIKE)
    control = PayoffControl(MAX_DEPTH)
    _, small = run(control, engine, 1, 300)
    _, large = run(control, engine, 64, 300)
    assert small[-100:].count(0) < 10  # batch 1 speculates
    assert large[-100:].count(0) > 90  # batch 64 runs plain (drafting costs more than it yields)
    assert control.best(1, 1) > 0 and control.best(64, 64) == 0


def test_the_first_drafting_cycle_after_plain_ones_and_unclean_cycles_are_not_timed():
    control = PayoffControl(2, PayoffSettings(min_samples=1))
    plain, one = [0] * 4, [1] * 4
    assert control.choose(4) == 0  # shallowest first
    control.cycle_done(1.0, plain, plain)
    assert control.choose(4) == 1  # could win (acceptance unknown: optimistic)
    control.cycle_done(10.0, one, one)  # carries the head's catch-up: not timed
    assert control.cost(4, 1) is None
    assert control.choose(4) == 1
    control.cycle_done(1.0, one, one, clean=False)  # a prefill joined the step: not timed
    assert control.cost(4, 1) is None
    assert control.choose(4) == 1
    control.cycle_done(1.5, one, one)
    assert control.cost(4, 1) == 1.5


def test_a_deeper_depth_that_cannot_win_is_never_timed():
    """At the cost of depth 1, depth 2's tokens cannot beat plain steps: it is skipped."""
    control = PayoffControl(2, PayoffSettings(min_samples=1))
    for seconds, drafts, accepted in ((1.0, 0, 0), (9.0, 1, 0), (3.0, 1, 0), (1.0, 0, 0)):
        control.choose(8)
        control.cycle_done(seconds, [drafts] * 8, [accepted] * 8)
    assert control.cost(8, 2) is None and control.best(8, 8) == 0
    assert control.choose(8) == 0


def test_a_depth_that_loses_clearly_is_timed_once():
    """At batch 64 on the CPU-like engine, one timed cycle of depth 2 or 3 shows them under 90%
    of the plain rate at the acceptance seen so far: each is timed once, not min_samples
    times. Negative control: with clear_loss 0 each runs min_samples cycles."""
    def deep_cycles(settings):
        _, chosen = run(PayoffControl(MAX_DEPTH, settings), SimulatedEngine(**CPU_LIKE), 64, 40)
        assert chosen[-20:] == [0] * 20  # plain steps win either way
        return sum(d >= 2 for d in chosen)

    assert deep_cycles(PayoffSettings()) <= 2
    assert deep_cycles(PayoffSettings(clear_loss=0.0)) >= 2 * PayoffSettings().min_samples


def test_a_depth_that_loses_at_a_smaller_batch_is_not_explored_at_a_larger_one():
    """The cost ratio of a depth to a plain step grows with the batch: once drafting loses
    at batch 4, batch 8 runs plain steps from its first timed cycle, without exploring."""
    engine = SimulatedEngine(base=0.030, per_token=0.0015, draft=0.030)  # a slow drafter
    control = PayoffControl(1, arms=(1,))
    run(control, engine, 4, 40)
    assert control.best(4, 4) == 0  # trees lose at batch 4 on this engine ...
    _, large = run(control, engine, 8, 40)
    assert large == [0] * 40  # ... so batch 8 never drafts
    assert control.cost(8, 1) is None
    fresh = PayoffControl(1, arms=(1,))
    _, alone = run(fresh, engine, 8, 40)
    assert 1 in alone  # without the smaller batch's timings, batch 8 explores


def test_probes_from_plain_run_two_cycles_and_grow_rarer_while_the_best_stays():
    control = PayoffControl(1, PayoffSettings(min_samples=1, probe_every=5, max_probe_every=20))
    none, one = [0] * 8, [1] * 8
    chosen = []
    for _ in range(120):
        depth = control.choose(8)
        chosen.append(depth)
        control.cycle_done(2.0 if depth else 1.0, one if depth else none, none)  # drafting never pays
    assert control.best(8, 8) == 0
    probes = [i for i in range(3, 120) if chosen[i] == 1 and chosen[i - 1] == 0]
    assert probes and all(chosen[i + 1] == 1 for i in probes if i + 1 < 120)  # a probe's catch-up, then its timing
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 20  # 5, 10, 20, 20, ... cycles apart


class FirstRankSays(RankGroup):
    """A rank group whose rank 0 chose `depth` (what decide_once returns on every rank)."""

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth

    def decide_once(self, values):
        return self.depth


def test_every_rank_runs_rank_zeros_depth():
    control = PayoffControl(MAX_DEPTH, ranks=FirstRankSays(2))
    assert [control.choose(4) for _ in range(5)] == [2] * 5


def test_two_arms_the_tree_or_the_root_alone():
    """An engine drafting a fixed tree: arms 0 and its depth; the yield of depth 4 is
    estimated per position from the accepted lengths."""
    engine = SimulatedEngine(**CPU_LIKE)
    control = PayoffControl.all_or_none(4)
    _, small = run(control, engine, 1, 200)
    _, large = run(control, engine, 64, 200)
    assert set(small) | set(large) == {0, 4}
    assert small[-50:].count(4) > 45 and large[-50:].count(0) > 45


def test_batch_buckets_and_bad_arguments():
    assert [batch_bucket(b) for b in (1, 5, 8, 9, 16, 17, 64)] == [1, 5, 8, 16, 16, 32, 64]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PayoffControl(0)
    with pytest.raises(ValueError, match="arms"):
        PayoffControl(2, arms=(3,))


def test_the_cycle_clock_times_each_cycle_it_was_told_about():
    """CycleClock (an engine's step loop): a cycle without its verify result, or with a
    prefill step in it, is not timed; the others are, with their acceptance."""
    control = PayoffControl(2, PayoffSettings(min_samples=1), arms=(2,))
    clock = CycleClock(control)
    assert clock.step(4) == 0  # nothing before it
    clock.verified([0] * 4, [0] * 4)
    assert clock.step(4) == 2  # the plain cycle was timed: the tree next (catch-up: not timed)
    assert control.cost(4, 0) is not None
    clock.verified([2] * 4, [1] * 4)
    clock.step(4)
    clock.disturbed()  # a prefill ran in this cycle
    clock.verified([2] * 4, [2] * 4)
    clock.step(4)
    assert control.cost(4, 2) is None
    clock.verified([2] * 4, [2] * 4)
    clock.step(4)
    assert control.cost(4, 2) is not None


def test_the_cycle_clock_skips_steps_that_ran_more_than_their_drafts():
    """With `query_lens` (vLLM: prefill chunks share decode steps) a cycle is timed only
    where every request ran 1 + its drafts."""
    control = PayoffControl(2, PayoffSettings(min_samples=1), arms=(2,))
    clock = CycleClock(control)
    clock.step(2)
    clock.verified([0, 0], [0, 0])
    clock.step(2, query_lens=[1, 7])  # a prefill chunk rode along
    assert control.cost(2, 0) is None
    clock.verified([0, 0], [0, 0])
    clock.step(2, query_lens=[1, 1])
    assert control.cost(2, 0) is not None


def test_requests_without_drafts_in_a_drafting_step_count_as_rejections():
    """SGLang reports every request at the step's depth (CycleClock.depth): a drafter that
    finds nothing for most requests (retrieval without matches) is judged by what the step
    yields (6 tokens in 1.5x a plain step's time: a loss), not by the one request that
    drafted (3 tokens each would be a win)."""
    def settle(per_request: bool) -> list[int]:
        control = PayoffControl(2, PayoffSettings(min_samples=2), arms=(2,))
        chosen = []
        for _ in range(80):
            depth = control.choose(4)
            chosen.append(depth)
            drafts = ([0, 0, 0, 2] if per_request else [depth] * 4) if depth else [0] * 4
            control.cycle_done(1.5 if depth else 1.0, drafts, [0, 0, 0, 2] if depth else [0] * 4)
        return chosen[-40:]

    assert settle(per_request=False).count(0) >= 36
    assert settle(per_request=True).count(2) >= 36  # the negative control: judged by its drafters alone
    clock = CycleClock(PayoffControl(2, arms=(2,)))
    assert clock.step(4) == clock.depth == 0


class SlowSpellEngine(SimulatedEngine):
    """SimulatedEngine whose host runs 30% slower during cycles [start, end)."""

    def __init__(self, start: int, end: int, **costs):
        super().__init__(**costs)
        self.cycles, self.start, self.end = 0, start, end

    def cycle(self, batch, depth):
        self.cycles += 1
        seconds, drafts, accepted = super().cycle(batch, depth)
        return seconds * (1.3 if self.start <= self.cycles < self.end else 1.0), drafts, accepted


class KeepsOldTimings(PayoffControl):
    """Negative control: probes add to a depth's old timings instead of timing it afresh."""

    def _retime(self, bucket, depth):
        pass


def test_a_probe_times_a_depth_afresh_so_a_slow_spell_does_not_keep_drafting_at_a_loss():
    """Plain steps win by ~3.5% on this engine at batch 8, but the host runs 30% slower
    while they are first timed: depth 1, timed after the spell, looks better. The first
    probe re-times plain steps afresh and they win again; with probes adding to the old
    timings instead, drafting goes on at a loss for the rest of the run."""
    costs = dict(base=0.060, per_token=0.003, draft=0.040)
    assert SimulatedEngine(**costs).expected_rate(8, 0) > 1.03 * SimulatedEngine(**costs).expected_rate(8, 1)
    for control, drafting in ((PayoffControl(MAX_DEPTH), False), (KeepsOldTimings(MAX_DEPTH), True)):
        _, chosen = run(control, SlowSpellEngine(1, 4, **costs), 8, 600)
        assert chosen[:3] == [0, 0, 0] and 1 in chosen[3:10]  # plain timed in the spell, then depth 1
        share = sum(d > 0 for d in chosen[200:]) / len(chosen[200:])
        assert (share > 0.9) if drafting else (share < 0.1), share


class HoldsProbesOnly(PayoffControl):
    """Negative control: only a probe from plain steps runs a timed cycle after its
    catch-up; exploration and a new best run the untimed catch-up cycle alone."""

    def _decide(self, bucket, batch):
        held, self._held = self._held, []
        if held and held[0][0] == bucket:
            return held[0][1]
        return self._pick(bucket, batch)

    def _retime(self, bucket, depth):
        super()._retime(bucket, depth)
        if depth > 0 and self._previous == 0:
            self._hold(bucket, depth)


def test_a_switch_to_drafting_is_timed_after_its_catch_up_so_it_cannot_flip_back_untimed():
    """The tree loses clearly on its one timing. The host then runs twice as slow, so the
    plain step's new timings no longer leave the tree's fast one clearly losing: it is
    explored again. Its first cycle carries the head's catch-up and is not timed; held for
    one timed cycle, the tree is timed at the host's new speed and plain steps run until
    the probe. Run for its catch-up cycle alone, the tree loses clearly again on the
    acceptance that cycle brought, flips back, and the next drift repeats it: an untimed
    tree cycle every other step, its timing never refreshed."""
    def run(control):
        chosen = []
        for cycle in range(36):  # the first probe comes 32 cycles after the arms are timed
            depth = control.choose(4)
            seconds = (2.0 if cycle >= 6 else 1.0) * (2.6 if depth else 1.0)
            control.cycle_done(seconds, [depth] * 4, [1, 0, 0, 0] if depth else [0] * 4)
            chosen.append(depth)
        return chosen, [i for i in range(1, len(chosen)) if chosen[i] and not chosen[i - 1]]

    chosen, switches = run(PayoffControl.all_or_none(4))
    assert all(chosen[i + 1] == 4 for i in switches)  # the catch-up cycle, then a timed one
    assert len(switches) == 2  # exploration, then one on the stale timing, timed afresh
    _, untimed = run(HoldsProbesOnly.all_or_none(4))
    assert len(untimed) >= 5
