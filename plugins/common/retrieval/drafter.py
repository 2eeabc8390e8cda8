"""The retrieval drafters: :class:`RetrievalDrafter` (per-request state, lookup, drafting) and
:class:`ReferenceDrafter` (it behind the reference loop's Drafter protocol).

The longest suffix of a request's tokens (``min_match`` to ``max_match`` tokens) that
occurred before is looked up in the request's own tokens, the cache of finished
requests and the optional static datastore. The continuations after every occurrence
(at most ``max_occurrences``, own ones most recent first, then the cache's, then the
datastore's) are merged into a trie whose ``budget`` best nodes form the draft tree
(see :func:`~.trees.continuation_tree`).

Drafter interface (per request id, engine-shaped): ``prefill`` (chunked, appends),
``extend`` (committed tokens), ``rollback`` (to a length), ``free`` (finished: into
the cache), ``draft`` -> TreeBatch. Drafting is deterministic: verify with the
target-only rule (``draft_probs=None``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..path_choice import pad_chains
from ..token_drafters import pack_trees, sync_tokens, token_list
from ..tree import TreeBatch, TreeConfig
from .config import RetrievalConfig, config_from_fields
from .datastore import Datastore, load_datastore
from .index import _RecentCache, _Sequence
from .trees import best_path, continuation_tree

logger = logging.getLogger(__name__)


class RetrievalDrafter:
    """Retrieval drafting for a batch of live requests (see the module docstring).

    State per request id: its committed tokens (prompt + accepted + bonus), indexed.
    ``draft`` never changes state; a request's tree is rooted at its last committed token.
    """

    def __init__(self, config: RetrievalConfig = RetrievalConfig(), datastore: Datastore | None = None):
        self.config = config
        self._fill_config = dataclasses.replace(config, min_prob=0.0)  # continuation(): every node
        self.datastore = datastore
        self.live: dict[Hashable, _Sequence] = {}
        self.cache = _RecentCache(config.cache_requests, config.cache_tokens)
        self._before_clear: set[Hashable] = set()  # live at the last clear_cache: never cached
        logger.info("retrieval drafter: %s; datastore %s", dataclasses.asdict(config),
                    "none" if datastore is None else datastore.summary())

    @classmethod
    def check_settings(cls, settings) -> None:
        """ValueError naming a bad field of RetrievalConfig's fields (+ "datastore": a file)."""
        _, datastore = config_from_fields(settings)
        if datastore is not None and not Path(datastore).is_file():
            raise ValueError(f"retrieval \"datastore\" {datastore!r} is not a file: build one with "
                             "`specplug datastore build` or drop the field")

    @classmethod
    def from_settings(cls, settings, vocab_size: int) -> "RetrievalDrafter":
        """The registry's constructor: RetrievalConfig fields plus an optional "datastore" file."""
        cls.check_settings(settings)
        config, datastore = config_from_fields(settings)
        store = None if datastore is None else load_datastore(datastore, vocab_size=vocab_size)
        return cls(config, store)

    @property
    def budget(self) -> int:
        return self.config.budget

    # -- state -----------------------------------------------------------------------
    def prefill(self, request_id: Hashable, prompt_tokens) -> None:
        """Add a prompt chunk: starts the request if its id is new, else appends (chunked prefill)."""
        seq = self.live.get(request_id)
        if seq is None:
            seq = self.live[request_id] = _Sequence(self.config.min_match, self.config.max_match)
        seq.append(token_list(prompt_tokens))

    def extend(self, request_id: Hashable, tokens) -> None:
        """Append committed tokens (accepted drafts + bonus) to a prefilled request."""
        self._live(request_id).append(token_list(tokens))

    def rollback(self, request_id: Hashable, length: int) -> None:
        """Forget every token beyond the first ``length`` (the engine discarded them)."""
        seq = self._live(request_id)
        if isinstance(length, (bool, float)) or not isinstance(length, (int, np.integer)) \
                or not 0 <= length <= len(seq.tokens):
            raise ValueError(f"rollback length must be an int in [0, {len(seq.tokens)}] for request "
                             f"{request_id!r}, got {length!r}: pass the number of tokens to keep")
        seq.truncate(int(length))

    def sync(self, request_id: Hashable, *parts: Sequence[int]) -> None:
        """Hold exactly the concatenation of `parts` (an engine's committed tokens, e.g.
        prompt and output so far), of which what the request holds is a prefix: append
        what is new (starting the request if its id is new), forget what the engine
        discarded. Slices only the new tokens, not the whole sequence."""
        sync_tokens(self, request_id, parts, len(self.live[request_id].tokens) if request_id in self.live else 0)

    def free(self, request_id: Hashable) -> None:
        """The request finished: its sequence moves into the bounded cache (unknown ids:
        no-op), unless it was live at the last clear_cache."""
        seq = self.live.pop(request_id, None)
        if seq is None:
            logger.debug("free(%r): unknown request, nothing to do", request_id)
        elif request_id in self._before_clear:
            self._before_clear.discard(request_id)
        elif seq.tokens and self.config.cache_requests > 0 and self.config.cache_tokens > 0:
            self.cache.add(seq)

    def clear_cache(self) -> None:
        """Forget the finished requests' sequences. Live requests keep theirs for drafting
        but never join the cache: an engine may free a request only at its next step, after
        a caller cleared the cache between two runs (the benchmark does)."""
        self.cache = _RecentCache(self.config.cache_requests, self.config.cache_tokens)
        self._before_clear = set(self.live)

    def length(self, request_id: Hashable) -> int:
        return len(self._live(request_id).tokens)

    def tokens(self, request_id: Hashable) -> list[int]:
        return list(self._live(request_id).tokens)

    def _live(self, request_id: Hashable) -> _Sequence:
        seq = self.live.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} has no retrieval state: call prefill() for it first")
        return seq

    # -- lookup ----------------------------------------------------------------------
    def _datastore_ranges(self, seqs: list[_Sequence | None]) -> list[dict[int, tuple[int, int]]]:
        """Per request: n -> datastore entry range of its last n tokens (batched search)."""
        store, cfg = self.datastore, self.config
        out: list[dict[int, tuple[int, int]]] = [{} for _ in seqs]
        if store is None:
            return out
        asked = [(b, n, seq.suffix_key(n)) for b, seq in enumerate(seqs) if seq is not None
                 for n in range(max(cfg.min_match, store.min_match), min(cfg.max_match, store.max_match) + 1)
                 if n <= len(seq.tokens)]
        if asked:
            lo, hi = store.ranges([key for _, _, key in asked])
            for (b, n, _), a, z in zip(asked, lo, hi):
                if z > a:
                    out[b][n] = (a, z)
        return out

    def _continuations(self, seq: _Sequence, depth: int,
                       ranges: dict[int, tuple[int, int]]) -> tuple[int, list[list[int]]]:
        """(n, continuations) of the longest suffix pattern (n tokens) found in any source;
        (0, []) when none."""
        cfg = self.config
        for n in range(min(cfg.max_match, len(seq.tokens)), cfg.min_match - 1, -1):
            found = seq.continuations(n, depth, cfg.max_occurrences)
            if len(found) < cfg.max_occurrences and (len(self.cache) or n in ranges):
                pattern = seq.tokens[len(seq.tokens) - n:]
                if len(self.cache):
                    found += self.cache.continuations(seq.suffix_key(n), pattern, depth,
                                                      cfg.max_occurrences - len(found))
                if n in ranges and len(found) < cfg.max_occurrences:
                    found += self.datastore.continuations(*ranges[n], pattern, depth,
                                                          cfg.max_occurrences - len(found))
            found = [c for c in found if c]
            if found:
                return n, found
        return 0, []

    def _gather(self, request_ids, root_tokens, depth: int):
        """-> (roots [B] ints, (match length, continuations) per request)."""
        if root_tokens is not None and len(root_tokens) != len(request_ids):
            raise ValueError(f"root_tokens has {len(root_tokens)} entries for {len(request_ids)} request_ids: "
                             "pass one per request, in request_ids order")
        seqs = [self.live.get(rid) for rid in request_ids]
        roots = [self._root(rid, seq, root_tokens, b) for b, (rid, seq) in enumerate(zip(request_ids, seqs))]
        ranges = self._datastore_ranges(seqs)
        found = [(0, []) if seq is None else self._continuations(seq, depth, ranges[b]) for b, seq in enumerate(seqs)]
        return roots, found

    @staticmethod
    def _root(rid, seq: _Sequence | None, root_tokens, b: int) -> int:
        given = None if root_tokens is None else int(root_tokens[b])
        if seq is None or not seq.tokens:
            if given is None:
                raise ValueError(f"request {rid!r} has no committed tokens: call prefill() first or pass root_tokens")
            return given
        if given is not None and given != seq.tokens[-1]:
            raise ValueError(f"request {rid!r}: root_tokens[{b}] = {given} but the last committed token is "
                             f"{seq.tokens[-1]}: call extend() with the committed tokens before draft()")
        return seq.tokens[-1]

    # -- drafting --------------------------------------------------------------------
    def draft_scored(self, request_ids: Sequence[Hashable], root_tokens=None, *, budget: int | None = None,
                     max_depth: int | None = None, min_prob: float | None = None) -> tuple[TreeBatch, torch.Tensor]:
        """Draft trees and the estimated acceptance probability of every node.

        Returns (TreeBatch, probs): candidates / parents Long [B, N], num_nodes Long [B],
        TreeBatch.scores Float [B, N] = log of each node's score (root 0, padding -inf,
        like dynamic_trees.dynamic's cumulative log-probs) and probs Float [B, N] = each node's
        score, the estimated probability that the verifier accepts it (root 1, padding
        0): comparable with a head's path probabilities. A request without any match
        gets the root alone.
        ``root_tokens`` (Long [B], optional) must equal each request's last committed
        token; it supplies the root of a request with no tokens yet. ``budget``,
        ``max_depth`` and ``min_prob`` override the config for this call (min_prob 0:
        every continuation node, e.g. to fill draft slots an engine verifies anyway).
        """
        cfg = self.config if min_prob is None else dataclasses.replace(self.config, min_prob=min_prob)
        budget = cfg.budget if budget is None else budget
        depth = cfg.max_depth if max_depth is None else max_depth
        roots, found = self._gather(request_ids, root_tokens, depth)
        trees = [continuation_tree(conts, budget, cfg, n) for n, conts in found]
        return pack_trees(roots, [t if sum(t[2]) >= cfg.min_expected else ([], [], []) for t in trees])

    def draft(self, request_ids: Sequence[Hashable], root_tokens=None, **overrides) -> TreeBatch:
        """Draft trees (see :meth:`draft_scored`); TreeBatch.scores are log-scores."""
        return self.draft_scored(request_ids, root_tokens, **overrides)[0]

    def best_chain(self, request_ids: Sequence[Hashable], k: int | None = None, root_tokens=None
                   ) -> tuple[TreeBatch, torch.Tensor]:
        """Per request the chain of at most k (default max_depth) tokens with the largest
        expected accepted length (the sum of its scores): (TreeBatch of chains, scores
        Float [B, N], N = 1 + the longest chain); as :meth:`draft_scored` otherwise.
        ``batch.candidates[b, 1:batch.num_nodes[b]]`` are request b's draft tokens."""
        cfg = self.config
        k = cfg.max_depth if k is None else k
        roots, found = self._gather(request_ids, root_tokens, k)
        chains = []
        for n, conts in found:
            tokens, probs = best_path(conts, k, cfg, n)
            chains.append((tokens, list(range(len(tokens))), probs))
        return pack_trees(roots, chains)

    def continuation(self, request_id: Hashable, path: Sequence[int], k: int) -> list[int]:
        """The best chain of at most k tokens after the request's committed tokens followed
        by `path` (drafts not yet verified), every node kept whatever its score (min_prob
        0: it fills slots an engine verifies anyway); [] when nothing matches. The state
        is restored: only committed tokens stay."""
        seq = self._live(request_id)
        have = len(seq.tokens)
        seq.append(list(path))
        try:
            n, found = self._continuations(seq, k, self._datastore_ranges([seq])[0])
            return best_path(found, k, self._fill_config, n)[0]
        finally:
            seq.truncate(have)

    def alone(self, request_ids: Sequence[Hashable], depth: int) -> torch.Tensor | None:
        """Long [B, depth]: each request's best chain (padded by its last token) when the
        retrieval alone is confident enough for every request (RetrievalConfig.head_skip),
        else None: hybrid drafting then runs the head."""
        if self.config.head_skip is None:
            return None
        chains, probs = self.best_chain(request_ids, k=depth)
        return pad_chains(chains, depth) if self.config.skip_head(probs) else None


class ReferenceDrafter:
    """The `specplug.common.drafters.Drafter` protocol (prefill / draft / commit / release
    with hidden states, which retrieval ignores) over a RetrievalDrafter, so the reference
    loop drives it: ``reference.generate(target, ReferenceDrafter(), prompt, n, tree=...)``.
    The tree's ``budget`` is the draft's budget; its ``depth`` the draft's max_depth
    unless ``depth`` is given (a retrieval chain may run deeper than a head's tree, as
    the engines' hybrid drafting lets it)."""

    def __init__(self, drafter: RetrievalDrafter | None = None, depth: int | None = None):
        self.drafter = drafter or RetrievalDrafter()
        self.depth = depth

    def target_hidden_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """One entry (the loop needs some; retrieval ignores hidden states)."""
        return (num_target_layers,)

    def prefill(self, request_ids, prompt_ids, hidden, first_tokens) -> None:
        for rid, prompt, first in zip(request_ids, prompt_ids, token_list(first_tokens)):
            self.drafter.prefill(rid, token_list(prompt) + [first])

    def commit(self, request_ids, accepted_tokens, hidden, bonus) -> None:
        for rid, accepted, root in zip(request_ids, accepted_tokens, token_list(bonus)):
            self.drafter.extend(rid, token_list(accepted) + [root])

    def draft(self, request_ids, tree: TreeConfig = TreeConfig()) -> TreeBatch:
        return self.drafter.draft(request_ids, budget=tree.budget, max_depth=self.depth or tree.depth)

    def release(self, request_ids) -> None:
        for rid in request_ids:
            self.drafter.free(rid)
