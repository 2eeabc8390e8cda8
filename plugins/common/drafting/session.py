"""A drafting session: one engine's per-request drafting decisions, in one place for both engines.

`DraftingSession` wraps a model drafter (`EagleDrafting`, or anything with its
``trees(roots, TreeConfig, sampled, request_ids)``) and owns, per request:

- the **sampled-draft policy** (`draws_from_q`): a request that samples (T > 0) without a
  seed draws its drafts from the head's q when sampled drafts are on; greedy and seeded
  requests keep top-k drafts (a seeded request's "coupled" draws make it reproducible);
- the head's **catch-up and defer** (`catch_up`): no head step when a step drafts
  nothing or the token drafter drafts alone; the rows wait for the next catch-up;
- the **hybrid strategy** with a token drafter: the drafter alone where it offers a chain
  (`alone`), else its trees merged with the head's (trie merge; calibrated merge on
  measured acceptance when a `HybridScale` is given), chains lengthened past a short
  path by the drafter's continuation;
- the **token drafter's copy** of each request's committed tokens (`sync_committed`) and
  its release when the request leaves (`forget`);
- the **step record** (`StepRecord`): drafts drawn from q (their tokens and q rows) and
  the expected accepted lengths of the chains the draft gate let through. The verifier
  reads it (`StepRecord.draft_q`) and reports back (`verified`), which feeds the gate
  and the hybrid calibration.

Invariant: a request's drafts depend only on its own state, its own sampling settings
and its own random stream, never on its batch companions (a batch is drafted as the
rows of its requests, each by the same rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch

from ..merge import merge_trees
from ..parallel import ALONE, RankGroup
from ..path_choice import best_chain_paths, best_merged_chains, full_budget, lengthen_chains
from ..token_drafters import draft_or_roots, sync_tokens
from ..tree import DraftTree, TreeBatch, TreeConfig, stack_trees
from ..policy.calibration import HybridScale
from ..policy.draft_gate import DraftGate
from .sampled import SampledDrafts

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (vLLM's and SGLang's rule)


def draws_from_q(sampled: SampledDrafts | None, params) -> bool:
    """Whether a request's drafts are drawn from q: sampled drafts on, and the request
    (a SamplingConfig-like object with temperature and seed; None: unknown) samples
    without a seed."""
    return (sampled is not None and sampled.on and params is not None
            and params.temperature >= GREEDY_BELOW and params.seed is None)


@dataclass
class StepRecord:
    """What one drafting step handed the engine, for the verify that follows it.

    drawn: request -> (draft tokens of nodes 1.., q Float [k, V]): drafts drawn from q,
        q row j the distribution node j's children were drawn from.
    expected: request -> expected accepted length of the chain the draft gate kept.
    """

    drawn: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)

    def draw(self, request_ids: Sequence[Hashable], trees: TreeBatch) -> None:
        """Record trees drawn from q (TreeBatch.draft_probs set), one per request."""
        for b, rid in enumerate(request_ids):
            n = int(trees.num_nodes[b])
            self.drawn[rid] = (tuple(trees.candidates[b, 1:n].tolist()), trees.draft_probs[b, :max(n - 1, 1)])

    def draft_q(self, request_ids: Sequence[Hashable], candidates: torch.Tensor, num_nodes) -> dict:
        """{batch row: q Float [n - 1, V]} for the rows of a verify step whose nodes are
        the drafts drawn from q as recorded (candidates [B, N], num_nodes [B]); a row the
        engine changed (cut, reordered) is left out and verified by the target-only rule."""
        rows = {}
        for b, rid in enumerate(request_ids if self.drawn else ()):
            n = int(num_nodes[b])
            if rid in self.drawn and n > 1:
                tokens, q = self.drawn[rid]
                if tuple(candidates[b, 1:n].tolist()) == tokens[:n - 1]:
                    rows[b] = q[:n - 1]
        return rows


def stale_requests(held, current, max_live: int) -> list:
    """Requests to free for an engine that does not report every finished request (one
    that ends at prefill, an abort): past `max_live` held, every held one not in `current`
    (the step's batch, which holds every running request). One that comes back starts
    over from the engine's tokens; drafts stay verified, so this costs acceptance only."""
    if len(held) <= max_live:
        return []
    current = set(current)
    return [rid for rid in held if rid not in current]


def in_batch_order(parts: Sequence[tuple[list[int], TreeBatch]], batch: int) -> TreeBatch:
    """One TreeBatch of `batch` requests from (rows, trees of those rows) parts covering
    every row once (draft_probs dropped: drawn drafts travel in the StepRecord)."""
    out: list[DraftTree | None] = [None] * batch
    for rows, trees in parts:
        for i, t in zip(rows, trees.unbind()):
            out[i] = t
    return stack_trees(out)


class DraftingSession:
    """Per-request drafting across steps (module docstring). ``token_drafter``: a
    specplug.common.token_drafters drafter for hybrid drafting, or None; ``scale``: a
    HybridScale (calibrated merge), or None (trie merge); ``gate``: a DraftGate, or None."""

    def __init__(self, drafting, *, token_drafter=None, sampled: SampledDrafts | None = None, scale=None,
                 gate=None):
        self.drafting, self.token_drafter, self.scale, self.gate = drafting, token_drafter, scale, gate
        self.sampled = sampled or SampledDrafts(None)
        self.record = StepRecord()
        self.drafted_alone = 0  # steps drafted by the token drafter alone

    @classmethod
    def for_settings(cls, settings, drafting=None, *, token_drafter=None, chains: bool,
                     ranks: RankGroup = ALONE) -> "DraftingSession":
        """A session as a head's HeadSettings ask, for an engine that verifies `chains`
        (else trees): drafts drawn from q at "draft_temperature"; for chains, the draft
        gate where "gate" is on and the calibrated merge (HybridScale) for a hybrid drafter
        with "calibrate" (trees take the trie merge); `ranks` decide the gate as one."""
        scale = HybridScale(["head", "tokens"]) if chains and token_drafter is not None and settings.calibrate else None
        gate = DraftGate(ranks=ranks) if chains and settings.gate else None
        return cls(drafting, token_drafter=token_drafter, scale=scale, gate=gate,
                   sampled=SampledDrafts(settings.draft_temperature))

    # ------------------------------------------------------------------ per-request state

    def begin_step(self) -> StepRecord:
        """Start a step's record; returns the previous one (drafts are verified in the
        step after they were drafted, never later)."""
        previous, self.record = self.record, StepRecord()
        return previous

    def forget(self, live) -> None:
        """Drop everything kept for requests not in `live` (the token drafter frees them:
        retrieval adds their tokens to its cache of recent requests)."""
        if self.drafting is not None:
            self.drafting.forget(live)
        if self.scale is not None:
            self.scale.forget(live)
        if self.token_drafter is not None:
            for rid in [r for r in self.token_drafter.live if r not in live]:
                self.token_drafter.free(rid)

    def sync_tokens(self, request_id: Hashable, length: int, known: Callable[[], Sequence[int]]) -> bool:
        """Make the token drafter hold exactly the request's first `length` committed
        tokens: roll back what the engine discarded, else fill from `known()` (the
        engine's committed tokens). False when the engine's state lacks them."""
        drafter = self.token_drafter
        have = drafter.length(request_id) if request_id in drafter.live else 0
        if have >= length:
            drafter.rollback(request_id, length)
            return True
        tokens = known()
        if len(tokens) < length or min(tokens[:length], default=0) < 0:
            return False
        sync_tokens(drafter, request_id, [tokens[:length]], have)
        return True

    def sync_committed(self, requests: Sequence, known: Callable[[Hashable], Sequence[int]]) -> None:
        """The token drafter's copy of each request brought to this step's committed rows
        (`requests`, drafting.eagle.Committed: the tokens after positions p..p+n-1): synced
        to the first p + 1 tokens (sync_tokens; known(request id) = the engine's committed
        tokens, read only when the drafter lacks some, such as after steps without drafts),
        then extended by the rows' tokens. A request the engine cannot fill is left out."""
        for request in requests:
            rid = request.req_id
            if self.sync_tokens(rid, int(request.positions[0]) + 1, lambda rid=rid: known(rid)):
                self.token_drafter.extend(rid, request.shifted)

    def draws_from_q(self, params) -> bool:
        return draws_from_q(self.sampled, params)

    def draft_q(self, request_ids, candidates: torch.Tensor, num_nodes) -> dict:
        """StepRecord.draft_q of the step being verified; the drawn drafts are then
        forgotten (verified once, in the step after they were drafted)."""
        rows = self.record.draft_q(request_ids, candidates, num_nodes)
        self.record.drawn = {}
        return rows

    # ------------------------------------------------------------------ the head's catch-up

    def catch_up(self, requests: list, kept_ids, depth: int, chains: bool = True):
        """(the head's Roots, None) or (None, the token drafter's chains Long [len(kept_ids),
        depth]) for an engine that hands the head each step's committed rows (`requests`,
        drafting.eagle.Committed) and drafts for the requests `kept_ids`:
        - depth 0 (no drafts this step): the rows wait for the next step that drafts with
          the head, caught up in one go (None, None);
        - `chains` and the token drafter drafts alone for the kept requests (`alone`): the
          rows wait likewise (None, chains);
        - else the head catches up over every request's rows: (a Root per request, None)."""
        if depth == 0:
            self.drafting.defer(requests)
            return None, None
        alone = self.alone(kept_ids, depth) if kept_ids and chains else None
        if alone is not None:
            self.drafting.defer(requests)
            return None, alone
        return (self.drafting.catch_up(requests) if requests else []), None

    # ------------------------------------------------------------------ chains (one path per request)

    def alone(self, request_ids, depth: int) -> torch.Tensor | None:
        """The token drafter's chains Long [B, depth] when it drafts alone this step, else None."""
        if self.token_drafter is None:
            return None
        chains = self.token_drafter.alone(request_ids, depth)
        if chains is not None:
            self.drafted_alone += 1
        return chains

    def chains(self, roots, request_ids, depth: int, params: Sequence, tree: TreeConfig):
        """(Long [B, depth], Float [B]): each request's chain and its expected accepted
        length: the best path of its (hybrid) tree, or a chain drawn from q where
        `draws_from_q` (expected unknown: inf; recorded for the verifier)."""
        drawn, top_k = self.split(params)
        chains = torch.zeros(len(roots), depth, dtype=torch.long)
        expected = torch.full((len(roots),), float("inf"))
        if top_k:
            chains[top_k], expected[top_k] = self._best_paths(
                [roots[i] for i in top_k], [request_ids[i] for i in top_k], depth, tree)
        rows = drawn
        if rows:
            chains[rows] = self._drawn_chains([roots[i] for i in rows], [request_ids[i] for i in rows], depth)
        return chains, expected

    def gated(self, drafts: torch.Tensor, expected: torch.Tensor, request_ids, batch: int) -> torch.Tensor:
        """Bool [R]: which of R drafting requests keep their chains (DraftGate.choose on
        each chain's expected accepted length); the kept expectations are recorded."""
        keep = self.gate.choose(expected, batch, drafts.shape[1])
        for i in torch.nonzero(keep).flatten().tolist():
            if bool(expected[i].isfinite()):  # chains drawn from q have no estimate to check
                self.record.expected[request_ids[i]] = float(expected[i])
        return keep

    def _best_paths(self, roots, request_ids, depth: int, tree: TreeConfig):
        """Each root's best path Long [R, depth] and its expected accepted length [R], of
        the head's tree, merged with the token drafter's when hybrid. A path shorter than
        `depth` keeps the full length (engines verify every slot): the drafter's
        continuation fills it, else its last token repeats."""
        budget = full_budget(depth, tree.topk, roots[0].logprobs.shape[-1])
        trees = self.drafting.trees(roots, TreeConfig(depth, tree.topk, budget, tree.stop_below))
        if self.token_drafter is None:
            chains, expected, lengths = best_chain_paths(trees, depth)
        elif self.scale is None:  # the merged tree's best path, straight from the trie
            found = self._token_trees(trees, request_ids, depth, None)
            chains, expected, lengths = best_merged_chains([trees, found], depth)
        else:
            chains, expected, lengths = best_chain_paths(self.merged(trees, request_ids, depth, None), depth)
        if self.token_drafter is not None:
            chains = lengthen_chains(self.token_drafter, request_ids, chains, lengths)
        if self.scale is not None:
            self.scale.chose(request_ids, chains)
        return chains, expected

    def _drawn_chains(self, roots, request_ids, depth: int) -> torch.Tensor:
        """One chain per root drawn from the head's q (Leviathan), Long [R, depth], recorded."""
        trees = self.drafting.trees(roots, TreeConfig(depth, 1, depth), self.sampled, request_ids)
        self.record.draw(request_ids, trees)
        return trees.candidates[:, 1:]

    # ------------------------------------------------------------------ trees (verified whole)

    def trees(self, roots, request_ids, params: Sequence, tree: TreeConfig, sampled_tree: TreeConfig,
              budget: int | None = None) -> TreeBatch:
        """One tree per request: drawn from q (shape `sampled_tree`, recorded) where
        `draws_from_q`, else the head's top-k tree (`tree`) merged with the token
        drafter's into at most `budget` draft nodes (None: tree.budget)."""
        drawn, top_k = self.split(params)
        parts = []
        if drawn:
            trees = self.drafting.trees([roots[i] for i in drawn], sampled_tree, self.sampled,
                                        [request_ids[i] for i in drawn])
            self.record.draw([request_ids[i] for i in drawn], trees)
            parts.append((drawn, trees))
        if top_k:
            ids = [request_ids[i] for i in top_k]
            parts.append((top_k, self._top_k_trees([roots[i] for i in top_k], ids, tree, budget)))
        return parts[0][1] if len(parts) == 1 else in_batch_order(parts, len(roots))

    def split(self, params: Sequence) -> tuple[list[int], list[int]]:
        """(rows drawing from q, rows drafting top-k) of a batch with these sampling settings."""
        drawn = [self.draws_from_q(p) for p in params]
        return [i for i, d in enumerate(drawn) if d], [i for i, d in enumerate(drawn) if not d]

    def _top_k_trees(self, roots, request_ids, tree: TreeConfig, budget: int | None) -> TreeBatch:
        trees = self.drafting.trees(roots, tree)
        return self.merged(trees, request_ids, None if budget is None else tree.depth,
                           tree.budget if budget is None else budget)

    # ------------------------------------------------------------------ hybrid merge

    def merged(self, trees: TreeBatch, request_ids, depth: int | None, budget: int | None) -> TreeBatch:
        """The head's trees merged with the token drafter's (same roots) into one tree per
        request: `budget` best nodes (None: every node), paths at most `depth` deep (None:
        the drafter's own max_depth); `trees` itself without a token drafter."""
        if self.token_drafter is None:
            return trees
        found = self._token_trees(trees, request_ids, depth, budget)
        keep = budget if budget is not None else int(trees.num_nodes.max() + found.num_nodes.max())
        if self.scale is not None and budget is None:
            return self.scale.merge(request_ids, [trees, found], keep)
        return merge_trees([trees, found], keep)

    def _token_trees(self, trees: TreeBatch, request_ids, depth: int | None, budget: int | None) -> TreeBatch:
        """The token drafter's trees from the head trees' roots. For chains (`budget`
        None) it keeps nodes below its min_prob too: engines verify all `depth` slots
        whatever they hold, so a weak continuation of the best path beats padding."""
        roots = trees.candidates[:, 0]
        if budget is None:
            return draft_or_roots(self.token_drafter, request_ids, roots, max_depth=depth, min_prob=0.0,
                                  budget=max(self.token_drafter.budget, 2 * depth))
        return draft_or_roots(self.token_drafter, request_ids, roots, max_depth=depth)

    # ------------------------------------------------------------------ feedback

    def verified(self, request_ids, num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
        """The verify result of the last drafted step: drafts verified and accepted per
        request (hybrid calibration, the draft gate's accepted / predicted scale)."""
        if self.scale is not None:
            self.scale.verified(request_ids, num_drafts, num_accepted)
        if self.gate is not None:
            expected, self.record.expected = self.record.expected, {}
            for rid, drafts, accepted in zip(request_ids, num_drafts, num_accepted):
                if int(drafts) > 0 and rid in expected:
                    self.gate.verified(expected[rid], int(accepted))


class SyncedTokenDrafter:
    """A token drafter kept in step with an engine's requests: before drafting, each
    request's copy is synced to the engine's committed tokens (TokenDrafter.sync appends
    what is new and forgets what the engine discarded, such as a retracted request's
    recomputation); requests the engine never reported finished (e.g. aborted) are dropped
    past `max_live` (stale_requests; one that comes back is synced again)."""

    def __init__(self, drafter, max_live: int):
        self.drafter, self.max_live = drafter, max_live

    def sync(self, requests: Sequence[tuple[Hashable, Sequence[int], Sequence[int]]]) -> None:
        """requests: (request id, prompt ids, committed output ids) of every running request."""
        for rid, prompt, output in requests:
            self.drafter.sync(rid, prompt, output)
        for rid in stale_requests(self.drafter.live, [r[0] for r in requests], self.max_live):
            self.drafter.free(rid)

    def draft(self, requests, roots: Sequence[int], **overrides) -> TreeBatch:
        """Each request's tree [B, n] rooted at its last committed token (`roots`), after
        sync(requests); the roots alone if the drafter raises (draft_or_roots)."""
        self.sync(requests)
        return draft_or_roots(self.drafter, [r[0] for r in requests], roots, **overrides)

    def free(self, request_id) -> None:
        self.drafter.free(request_id)

    def clear(self) -> None:
        """Everything the drafter keeps, across requests too (an engine's cache flush)."""
        for rid in list(self.drafter.live):
            self.drafter.free(rid)
        self.drafter.clear_cache()
