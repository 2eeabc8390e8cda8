"""One scale for hybrid draft trees: each source's node scores calibrated against the
acceptance measured in the engine.

Every drafting source scores a node with its own estimate of the probability that the
node's whole path is accepted: an EAGLE head its cumulative draft probability, the
retrieval drafter a shrunk continuation frequency. The estimates are not on one scale
(a head trained on little data is over-confident), so a merged tree that keeps the max
of them follows whichever source boasts most. `Calibration` learns, per source, what a
score is worth: nodes the engine verified are counted by score bin (verified, accepted,
exponentially decayed), each bin's rate is shrunk towards the bin's own score (the prior:
a source is taken at its word until measured), the rates are made non-decreasing (pool
adjacent violators) and interpolated between bin centres.

Invariant: the map is non-decreasing in the score and keeps the root at log 1, so in a
calibrated tree a child never outranks its parent (what `merge.merge_trees` needs).

`HybridScale` is what an engine adapter drives each step: `merge` the sources' trees on
the calibrated scale, `chose` the chains it hands the engine, `verified` with the
engine's verify result, `forget` finished requests.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from specplug.common.merge import merge_trees
from specplug.common.tree import TreeBatch

ENV_CALIBRATE = "SPECPLUG_CALIBRATE"  # "1"/"0": overrides a head section's "calibrate"

# bin edges over a node's own score (probability that its whole path is accepted)
EDGES = torch.tensor([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0], dtype=torch.float64)
CENTRES = (EDGES[1:] + EDGES[:-1]) / 2
KNOTS = torch.cat([EDGES[:1], CENTRES, EDGES[-1:]])  # where the map is interpolated: 0, centres, 1


def monotone(rates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Pool adjacent violators: the non-decreasing sequence closest to `rates` in
    weighted least squares. rates, weights: Float [K]."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for r, w in zip(rates.tolist(), weights.tolist()):
        blocks.append([r, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (r2, w2, n2), (r1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(r1 * w1 + r2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return torch.tensor([m for m, _, n in blocks for _ in range(n)], dtype=rates.dtype)


class Calibration:
    """Per source: verified and accepted counts per score bin, and the monotone map
    from a node's score to the measured acceptance of such nodes."""

    def __init__(self, sources: Sequence[str], prior_weight: float = 16.0, decay: float = 0.998):
        self.sources = list(sources)
        self.prior_weight, self.decay = prior_weight, decay
        bins = len(CENTRES)
        self.verified = torch.zeros(len(self.sources), bins, dtype=torch.float64)  # [S, K]
        self.accepted = torch.zeros(len(self.sources), bins, dtype=torch.float64)  # [S, K]
        self._maps: dict[str, torch.Tensor] = {}

    def rates(self, source: str) -> torch.Tensor:
        """Float64 [K]: calibrated acceptance at each bin centre, non-decreasing."""
        if source not in self._maps:
            s = self.sources.index(source)
            w = self.prior_weight
            raw = (self.accepted[s] + w * CENTRES) / (self.verified[s] + w)
            self._maps[source] = monotone(raw, self.verified[s] + w)
        return self._maps[source]

    def apply(self, source: str, trees: TreeBatch) -> TreeBatch:
        """`trees` with calibrated log scores; column 0 (each root) stays 0, padding -inf."""
        p = trees.scores.double().exp().clamp(0.0, 1.0)  # [B, N]
        rates = self.rates(source)
        y = torch.cat([torch.zeros(1, dtype=rates.dtype), rates, rates[-1:]])  # at KNOTS
        i = torch.searchsorted(KNOTS, p.contiguous(), right=True).clamp(1, len(KNOTS) - 1)  # [B, N] right knot
        t = (p - KNOTS[i - 1]) / (KNOTS[i] - KNOTS[i - 1])
        value = y[i - 1] + t * (y[i] - y[i - 1]) + 1e-6 * p  # strictly increasing where p is
        scores = value.log().to(trees.scores.dtype)
        scores[:, 0] = 0.0
        return trees._replace(scores=scores)

    def observe(self, source: str, scores: Sequence[float], accepted: Sequence[bool]) -> None:
        """Nodes of `source` the engine verified: their own log scores, and whether each
        node's path was accepted."""
        if not scores:
            return
        s = self.sources.index(source)
        p = torch.tensor(scores, dtype=torch.float64).exp().clamp(0.0, 1.0)
        k = (torch.searchsorted(EDGES, p, right=True) - 1).clamp(0, len(CENTRES) - 1)
        self.verified[s] *= self.decay
        self.accepted[s] *= self.decay
        self.verified[s].index_add_(0, k, torch.ones_like(p))
        self.accepted[s].index_add_(0, k, torch.tensor(accepted, dtype=torch.float64))
        self._maps.pop(source, None)


def path_scores(trees: TreeBatch, b: int) -> dict[tuple[int, ...], float]:
    """Request b's nodes as {path of draft tokens (root excluded): log score}."""
    n = int(trees.num_nodes[b])
    tokens, parents = trees.candidates[b, :n].tolist(), trees.parents[b, :n].tolist()
    scores = trees.scores[b, :n].tolist()
    paths: list[tuple[int, ...]] = [()]
    out = {}
    for i in range(1, n):
        paths.append(paths[parents[i]] + (tokens[i],))
        out[paths[i]] = scores[i]
    return out


class HybridScale:
    """Merges several sources' trees on the calibrated scale and learns the scale from the
    chains the engine verified. Per request, between `chose` and `verified` it keeps,
    for each position of the chain handed to the engine, the sources that drafted that
    path and their own scores for it."""

    def __init__(self, sources: Sequence[str], calibration: Calibration | None = None):
        self.sources = list(sources)
        self.calibration = calibration or Calibration(sources)
        self._offered: dict[Hashable, list[dict]] = {}  # request -> per source {path: own log score}
        self._pending: dict[Hashable, list[list[tuple[str, float]]]] = {}

    def merge(self, request_ids: Sequence[Hashable], trees: Sequence[TreeBatch], budget: int) -> TreeBatch:
        """One tree per request of at most `budget` nodes, ranked on the calibrated scale."""
        self._offered = {r: [path_scores(t, b) for t in trees] for b, r in enumerate(request_ids)}
        calibrated = [self.calibration.apply(name, t) for name, t in zip(self.sources, trees)]
        return merge_trees(calibrated, budget)

    def chose(self, request_ids: Sequence[Hashable], chains: torch.Tensor) -> None:
        """chains Long [B, depth]: the drafts each request hands the engine this step."""
        for b, rid in enumerate(request_ids):
            offered = self._offered.pop(rid, None)
            if offered is None:
                continue
            chain = tuple(chains[b].tolist())
            self._pending[rid] = [[(name, own[chain[:d + 1]]) for name, own in zip(self.sources, offered)
                                   if chain[:d + 1] in own] for d in range(len(chain))]
        self._offered = {}

    def verified(self, request_ids: Sequence[Hashable], num_drafts: Sequence[int], num_accepted: Sequence[int]):
        """The engine's verify step: drafts it verified and accepted per request."""
        for rid, drafts, accepted in zip(request_ids, num_drafts, num_accepted):
            pending = self._pending.pop(rid, None)
            if pending is None:
                continue
            by_source: dict[str, tuple[list, list]] = {name: ([], []) for name in self.sources}
            for d, offers in enumerate(pending[:int(drafts)]):
                for name, own in offers:
                    by_source[name][0].append(own)
                    by_source[name][1].append(d < int(accepted))
            for name, (scores, hits) in by_source.items():
                self.calibration.observe(name, scores, hits)

    def forget(self, live) -> None:
        """Drop what is kept for requests no longer live."""
        for rid in [r for r in self._pending if r not in live]:
            del self._pending[rid]
