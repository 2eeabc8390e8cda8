"""The n-gram keys and the live chained indexes: one request's tokens, finished requests' cache.

Every sequence keeps, for each position p and n-gram length n, a 64-bit polynomial
hash of the n-gram ending at p and a link to the previous slot with the same hash
(hash chains, as in LZ77 matchers), so appending is O(levels) per token and rollback
undoes the links in reverse. Every occurrence found by hash is verified against the
tokens, so a hash collision never yields a draft that is not in the text.
"""

from __future__ import annotations

import itertools
from array import array
from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np

MASK64 = (1 << 64) - 1
HASH_BASE = 0x100000001B3  # polynomial base of the n-gram hash (odd, FNV-1 64-bit prime)
HASH_MIX = 0x9E3779B97F4A7C15  # Fibonacci multiplier: datastore key = high 32 bits of hash * MIX
NO_NGRAM = -2  # prev-link value of a slot whose n-gram does not exist (p < n - 1)
SLOT_BITS = 40  # a cached slot's global id: sequence uid << SLOT_BITS | slot
SLOT_MASK = (1 << SLOT_BITS) - 1


def ngram_keys(tokens: Sequence[int], end: int, max_match: int) -> list[int]:
    """64-bit keys of the n-grams ending at ``end``, n = 1 .. min(max_match, end + 1).

    key_n = (key_{n-1} * HASH_BASE + tokens[end - n + 1] + 1) mod 2**64, key_0 = 0:
    the same recurrence :func:`build_datastore` runs vectorised in numpy.
    """
    keys, h = [], 0
    for n in range(1, min(max_match, end + 1) + 1):
        h = (h * HASH_BASE + tokens[end - n + 1] + 1) & MASK64
        keys.append(h)
    return keys


def _key32(key: int) -> int:
    """Datastore key of a 64-bit n-gram key: the high 32 bits of key * HASH_MIX."""
    return ((key * HASH_MIX) & MASK64) >> 32


def _np_key32(keys: np.ndarray) -> np.ndarray:
    return ((keys * np.uint64(HASH_MIX)) >> np.uint64(32)).astype(np.uint32)


class _Sequence:
    """One request's tokens with a chained n-gram index.

    Slot ``s = p * W + j`` is the n-gram of length ``n = min_match + j`` ending at
    position p (W = levels). ``keys[s]`` is its 64-bit key (0 when p < n - 1),
    ``prev[s]`` the slot of the previous occurrence of that key (-1: none; NO_NGRAM:
    no n-gram there), ``head[key]`` the latest slot. Invariant: keys / prev / head
    describe exactly ``tokens``; :meth:`truncate` undoes links in reverse order, so
    rollback then extend equals never having added the rolled-back tokens.
    """

    __slots__ = ("tokens", "keys", "prev", "head", "min_match", "max_match")

    def __init__(self, min_match: int, max_match: int):
        self.tokens: list[int] = []
        self.keys = array("Q")
        self.prev = array("q")
        self.head: dict[int, int] = {}
        self.min_match, self.max_match = min_match, max_match

    def append(self, new_tokens: Iterable[int]) -> None:
        toks, head, lo, hi = self.tokens, self.head, self.min_match, self.max_match
        width, get = hi - lo + 1, head.get
        for t in new_tokens:
            toks.append(t)
            row_keys, row_prev = [0] * width, [NO_NGRAM] * width
            h, slot = 0, (len(toks) - 1) * width - lo  # slot of level n: slot + n
            for n, tok in enumerate(toks[-1:-hi - 1:-1], 1):  # the last token first
                h = (h * HASH_BASE + tok + 1) & MASK64
                if n >= lo:
                    row_keys[n - lo] = h
                    row_prev[n - lo] = get(h, -1)
                    head[h] = slot + n
            self.keys.extend(row_keys)
            self.prev.extend(row_prev)

    def truncate(self, length: int) -> None:
        """Forget tokens[length:], restoring every chain head they replaced."""
        keys, prev, head = self.keys, self.prev, self.head
        for s in range(len(keys) - 1, length * self.width - 1, -1):
            link = prev[s]
            if link == NO_NGRAM:
                continue
            if link < 0:
                del head[keys[s]]
            else:
                head[keys[s]] = link
        del self.tokens[length:], keys[length * self.width:], prev[length * self.width:]

    @property
    def width(self) -> int:
        return self.max_match - self.min_match + 1

    def suffix_key(self, n: int) -> int | None:
        """Key of the last n tokens (None when the sequence is shorter than n)."""
        if n > len(self.tokens):
            return None
        return self.keys[(len(self.tokens) - 1) * self.width + n - self.min_match]

    def continuations(self, n: int, depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` continuations (``depth`` tokens at most) after earlier occurrences
        of the last n tokens, most recent first."""
        toks, width = self.tokens, self.width
        last = len(toks) - 1
        pattern = toks[last - n + 1:]
        out: list[list[int]] = []
        slot = self.prev[last * width + n - self.min_match]
        while slot >= 0 and len(out) < limit:
            q = slot // width
            if q >= n - 1 and toks[q - n + 1:q + 1] == pattern:
                out.append(toks[q + 1:q + 1 + depth])
            slot = self.prev[slot]
        return out


class _RecentCache:
    """Finished requests' sequences, oldest first, at most ``capacity`` of them and at
    most ``max_tokens`` tokens in all (the newest one always stays), under one chained
    index. Slot s of the sequence with uid u has global id ``u << SLOT_BITS | s``;
    ``entries[u] = (sequence, links)`` where ``links[s]`` is the global id of the previous
    occurrence of slot s's key (in the same or an older sequence). Invariant: ids below
    ``floor`` (evicted) are never followed, and ``head`` holds no key whose latest
    occurrence was evicted."""

    def __init__(self, capacity: int, max_tokens: int):
        self.capacity, self.max_tokens = capacity, max_tokens
        self.tokens = 0  # cached tokens in all
        self.entries: dict[int, tuple[_Sequence, array]] = {}
        self.order: deque[int] = deque()  # uids, oldest first
        self.head: dict[int, int] = {}
        self.next_uid = 0

    def __len__(self) -> int:
        return len(self.order)

    @property
    def floor(self) -> int:
        return (self.order[0] if self.order else self.next_uid) << SLOT_BITS

    def add(self, seq: _Sequence) -> None:
        """Take over a finished request's sequence (its own chains are dropped)."""
        uid, head = self.next_uid, self.head
        get, links = head.get, []
        for gid, key, link in zip(itertools.count(uid << SLOT_BITS), seq.keys, seq.prev):
            if link == NO_NGRAM:
                links.append(NO_NGRAM)
            else:
                links.append(get(key, -1))
                head[key] = gid
        seq.prev, seq.head = array("q"), {}
        self.entries[uid] = (seq, array("q", links))
        self.order.append(uid)
        self.next_uid = uid + 1
        self.tokens += len(seq.tokens)
        while len(self.order) > self.capacity or (len(self.order) > 1 and self.tokens > self.max_tokens):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        uid = self.order.popleft()
        seq, _ = self.entries.pop(uid)
        self.tokens -= len(seq.tokens)
        head, evicted = self.head, (uid + 1) << SLOT_BITS
        for key in seq.keys:
            if head.get(key, evicted) < evicted:  # its latest occurrence is gone, so are all
                del head[key]

    def continuations(self, key: int, pattern: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` continuations after cached occurrences of ``pattern`` (key = its
        64-bit key), most recent first."""
        n, floor, entries, out = len(pattern), self.floor, self.entries, []
        gid = self.head.get(key, -1)
        while gid >= floor and len(out) < limit:
            seq, links = entries[gid >> SLOT_BITS]
            local = gid & SLOT_MASK
            q = local // seq.width
            toks = seq.tokens
            if q >= n - 1 and toks[q - n + 1:q + 1] == pattern:
                out.append(toks[q + 1:q + 1 + depth])
            gid = links[local]
        return out
