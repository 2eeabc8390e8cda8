"""Retrieval drafting settings: :class:`RetrievalConfig`, its ONE set of defaults and their checks."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_RETRIEVAL = "SPECPLUG_RETRIEVAL"  # 0 / 1 / a JSON object of RetrievalConfig fields (+ "datastore")


def _check_int(owner: str, name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}: pass an int >= {low}")


@dataclass(frozen=True)
class RetrievalConfig:
    """Retrieval drafting settings; the defaults here are the project's ONE set of defaults.

    max_depth:       longest drafted path (continuation tokens after the root).
    budget:          draft nodes kept, root excluded. Small by default: on the 2-core
                     CPU a verify pass costs ~30 ms + 2.7 ms per node, so a node pays
                     when its acceptance probability exceeds ~0.1 (hence ``min_prob``).
    min_match:       shortest suffix pattern looked up (tokens).
    max_match:       longest suffix pattern looked up; the longest one found wins.
    max_occurrences: occurrences of the matched pattern gathered (own most recent
                     first, then the cache's, then the datastore's): the sample size
                     of the probabilities.
    cache_requests:  finished requests' sequences kept for later requests (0 = off).
    cache_tokens:    ... and at most this many tokens in all, the oldest requests
                     evicted first. Memory: ~300 bytes per cached token measured
                     in isolation, ~600 in a serving engine's heap (~40 MiB at the
                     default); ~500 per live token. A bound by requests alone let a
                     server's cache grow to ~250 MiB with 1,700-token prompts.
    min_count:       a node needs at least this many supporting occurrences.
    min_prob:        a node needs at least this score (estimated acceptance).
    prior:           pseudo-count of a 1-token match; an n-token match uses prior / n.
                     A node's score is the product along its path of
                     count(child) / (count(parent) + prior / n). 0 gives the raw share
                     of occurrences, which over-trusts few occurrences (one scores 1 at
                     every depth). Measured on 198 held-out ShareGPT replies (SmolLM2
                     tokenizer, a 1000-conversation datastore): a lone occurrence's
                     next token was accepted 0.25 / 0.30 / 0.33 / 0.42 / 0.70 of the
                     time after a 1 / 2 / 3 / 4-7 / 8-token match (prior 4 predicts
                     0.20 / 0.33 / 0.43 / 0.50-0.64 / 0.67), and all nodes' scores
                     were off their acceptance rate by 0.05 on average (raw: 0.10).
    lengthen:        score deeper nodes as longer matches: the pseudo-count of a node at
                     depth d is prior / (n + d - 1), n the matched pattern's length, since
                     the path's own d - 1 tokens, if accepted, lengthen the match (off:
                     prior / n at every depth, which decays a lone occurrence's chain
                     0.33 / 0.11 / 0.04 after a 2-token match, while vLLM's ngram
                     measured conditional acceptance 0.63 / 0.81 / 0.90 at positions 2-4).
    min_expected:    a request drafts only when its tree's expected accepted length (the
                     sum of its nodes' scores) reaches this; otherwise its root alone.
                     0 = off. For engines whose verify pass costs much more per step
                     with drafts than without (SGLang's CPU path: ~75 ms for the root
                     alone, ~105-120 ms for 4-9 nodes).
    head_skip:       hybrid drafting: a step whose every request's best retrieval chain
                     expects at least this many accepted tokens (sum of its nodes'
                     scores) drafts from retrieval alone, without running the head
                     (whose catch-up is deferred to the next step that needs it).
                     None = always run the head.
    """

    max_depth: int = 8
    budget: int = 8
    min_match: int = 1
    max_match: int = 8
    max_occurrences: int = 32
    cache_requests: int = 256
    cache_tokens: int = 65536
    min_count: int = 1
    min_prob: float = 0.1
    prior: float = 4.0
    lengthen: bool = False
    min_expected: float = 0.0
    head_skip: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_depth", "budget", "min_match", "max_match", "max_occurrences", "min_count"):
            _check_int("RetrievalConfig", name, getattr(self, name), 1)
        _check_int("RetrievalConfig", "cache_requests", self.cache_requests, 0)
        _check_int("RetrievalConfig", "cache_tokens", self.cache_tokens, 0)
        if self.max_match < self.min_match:
            raise ValueError(f"RetrievalConfig.max_match {self.max_match} < min_match {self.min_match}: "
                             "pass max_match >= min_match")
        if not 0.0 <= float(self.min_prob) <= 1.0:
            raise ValueError(f"RetrievalConfig.min_prob must lie in [0, 1], got {self.min_prob!r}")
        if not float(self.min_expected) >= 0.0:
            raise ValueError(f"RetrievalConfig.min_expected must be >= 0, got {self.min_expected!r}: pass an "
                             "expected accepted length >= 0 (0 = off)")
        if not float(self.prior) >= 0.0:
            raise ValueError(f"RetrievalConfig.prior must be >= 0, got {self.prior!r}: pass a pseudo-count >= 0")
        if self.head_skip is not None and not float(self.head_skip) > 0.0:
            raise ValueError(f"RetrievalConfig.head_skip must be > 0 (expected accepted tokens) or None, "
                             f"got {self.head_skip!r}")

    def skip_head(self, chain_probs) -> bool:
        """Whether a step drafts from retrieval alone: chain_probs Float [B, N] are the
        estimated acceptance of each request's best chain nodes (root 1 at column 0,
        padding 0); True when head_skip is set and every request expects >= head_skip."""
        if self.head_skip is None or chain_probs.shape[0] == 0:
            return False
        return bool((chain_probs[:, 1:].sum(1) >= self.head_skip).all())

    @property
    def levels(self) -> int:
        """n-gram lengths indexed per position: max_match - min_match + 1."""
        return self.max_match - self.min_match + 1


def retrieval_fields(section: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> dict | None:
    """A head's `specplug` section's "retrieval" value (true / false / an object of
    RetrievalConfig fields and an optional "datastore" path), SPECPLUG_RETRIEVAL
    overriding it, as a dict of fields (None: off). Both engines read it here."""
    value = section.get("retrieval")
    override = retrieval_override(environ)
    if override is not None:
        value = override
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise ValueError(f"specplug \"retrieval\" must be true, false or an object of RetrievalConfig fields, "
                         f"got {value!r}: fix the head's specplug section or {ENV_RETRIEVAL}")
    return dict(value)


def config_from_fields(fields: Mapping[str, Any]) -> tuple[RetrievalConfig, str | None]:
    """(RetrievalConfig, datastore path or None) from a dict of its fields and "datastore"."""
    fields = dict(fields)
    datastore = fields.pop("datastore", None)
    try:
        return RetrievalConfig(**fields), datastore
    except TypeError as exc:
        raise ValueError(f"specplug \"retrieval\" has an unknown field ({exc}): use fields of "
                         "specplug.common.retrieval.RetrievalConfig or \"datastore\"") from exc


def retrieval_override(environ: Mapping[str, str] = os.environ):
    """SPECPLUG_RETRIEVAL as given: None (unset), False ("0"), True ("1") or a dict (JSON)."""
    text = environ.get(ENV_RETRIEVAL, "").strip()
    if not text:
        return None
    if text.lower() in ("0", "false", "off"):
        return False
    if text.lower() in ("1", "true", "on"):
        return True
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_RETRIEVAL} must be 0, 1 or a JSON object, got {text!r}: {exc}") from exc
