"""The static corpus index (REST): :class:`Datastore`, building it, its .npz file and its validation."""

from __future__ import annotations

import logging
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import RetrievalConfig, _check_int
from .index import HASH_BASE, HASH_MIX, _key32, _np_key32, ngram_keys

logger = logging.getLogger(__name__)

SEPARATOR = -1  # between sequences in a datastore's token array
FORMAT = "specplug-retrieval-datastore"
VERSION = 1


@dataclass(frozen=True, eq=False)
class Datastore:
    """A static corpus index, built offline (:func:`build_datastore`), read-only.

    tokens: Int32 [T] the corpus, sequences separated (and surrounded) by SEPARATOR.
    keys:   UInt32 [M] sorted; keys[i] = datastore key (:func:`_key32`) of an n-gram,
            min_match <= n <= max_match, ending at ends[i] and followed by a token.
    ends:   Int32 [M] end positions, ascending within equal keys.
    """

    tokens: np.ndarray
    keys: np.ndarray
    ends: np.ndarray
    min_match: int
    max_match: int
    vocab_size: int = -1  # -1: unknown
    source: str = ""
    num_sequences: int = 0

    def ranges(self, keys64: Sequence[int]) -> tuple[list[int], list[int]]:
        """Index ranges [lo, hi) of the entries whose key matches each 64-bit n-gram key."""
        query = np.fromiter((_key32(k) for k in keys64), dtype=np.uint32, count=len(keys64))
        lo = self.keys.searchsorted(query, "left")
        hi = self.keys.searchsorted(query, "right")
        return lo.tolist(), hi.tolist()

    def continuations(self, lo: int, hi: int, pattern: list[int], depth: int, limit: int) -> list[list[int]]:
        """Continuations after the entries lo..hi that really end with ``pattern`` (first
        ``limit``), cut at the end of their sequence."""
        n, out = len(pattern), []
        ends = self.ends[lo:min(hi, lo + 4 * limit)].astype(np.int64)
        ends = ends[ends >= n - 1]
        # [k, n + depth] windows: the pattern then the continuation (clipped to the final SEPARATOR)
        windows = self.tokens[np.minimum(ends[:, None] + np.arange(1 - n, depth + 1), self.tokens.size - 1)]
        for row in windows.tolist():
            if row[:n] != pattern:
                continue
            cont = row[n:]
            out.append(cont[:cont.index(SEPARATOR)] if SEPARATOR in cont else cont)
            if len(out) == limit:
                break
        return out

    def summary(self) -> dict:
        return {"sequences": self.num_sequences, "tokens": int((self.tokens >= 0).sum()),
                "entries": int(self.keys.shape[0]), "min_match": self.min_match, "max_match": self.max_match,
                "vocab_size": self.vocab_size, "source": self.source}


def _corpus(sequences: Iterable[Sequence[int]]) -> tuple[np.ndarray, int]:
    """Sequences -> Int64 [T] with SEPARATOR before, between and after them; and their count."""
    parts, count = [np.array([SEPARATOR], dtype=np.int64)], 0
    for seq in sequences:
        arr = np.asarray(seq, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= 2**31 - 1):
            raise ValueError(f"sequence {count} has token ids outside [0, 2**31 - 1): pass token ids")
        parts += [arr, np.array([SEPARATOR], dtype=np.int64)]
        count += 1
    return np.concatenate(parts), count


def _index_corpus(corpus: np.ndarray, min_match: int, max_match: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys UInt32 [M] sorted, ends Int32 [M]) of every n-gram followed by a token."""
    size = corpus.shape[0]
    followed = np.zeros(size, dtype=bool)
    followed[:-1] = corpus[1:] >= 0
    h = np.zeros(size, dtype=np.uint64)
    valid = np.ones(size, dtype=bool)
    keys, ends = [], []
    for n in range(1, max_match + 1):
        tok = np.full(size, SEPARATOR, dtype=np.int64)  # tok[p] = corpus[p - n + 1]
        tok[n - 1:] = corpus[:size - n + 1]
        valid &= tok >= 0
        h = h * np.uint64(HASH_BASE) + (tok + 1).astype(np.uint64)
        if n >= min_match:
            at = np.flatnonzero(valid & followed)
            keys.append(_np_key32(h[at]))
            ends.append(at.astype(np.int32))
    keys_all, ends_all = np.concatenate(keys), np.concatenate(ends)
    order = np.lexsort((ends_all, keys_all))
    return keys_all[order], ends_all[order]


def build_datastore(sequences: Iterable[Sequence[int]], path: str | Path | None = None, *,
                    min_match: int = RetrievalConfig.min_match, max_match: int = RetrievalConfig.max_match,
                    vocab_size: int = -1, source: str = "") -> Datastore:
    """Index token sequences into a :class:`Datastore`; write it to ``path`` (.npz) if given.

    Size: 4 bytes per corpus token + 8 bytes per (token, n-gram length) entry, i.e.
    about 68 bytes per token for n = 1..8.
    """
    _check_int("build_datastore", "min_match", min_match, 1)
    _check_int("build_datastore", "max_match", max_match, min_match)
    corpus, count = _corpus(sequences)
    if corpus.shape[0] >= 2**31:
        raise ValueError(f"corpus has {corpus.shape[0]} tokens; a datastore holds < 2**31: pass fewer sequences")
    keys, ends = _index_corpus(corpus, min_match, max_match)
    store = Datastore(corpus.astype(np.int32), keys, ends, min_match, max_match, int(vocab_size), source, count)
    if path is not None:
        save_datastore(store, path)
    logger.info("datastore: %d sequences, %d tokens, %d entries (n = %d..%d)",
                count, corpus.shape[0] - count - 1, keys.shape[0], min_match, max_match)
    return store


def save_datastore(store: Datastore, path: str | Path) -> Path:
    """Write ``store`` as an uncompressed .npz (no pickled objects)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, format=np.array(FORMAT), version=np.int64(VERSION), hash_base=np.uint64(HASH_BASE),
                 hash_mix=np.uint64(HASH_MIX), min_match=np.int64(store.min_match),
                 max_match=np.int64(store.max_match), vocab_size=np.int64(store.vocab_size),
                 num_sequences=np.int64(store.num_sequences), source=np.array(store.source),
                 tokens=store.tokens, keys=store.keys, ends=store.ends)
    return path


# field -> (dtype, ndim); scalars are 0-d arrays
_FIELDS = {
    "format": (np.str_, 0), "version": (np.int64, 0), "hash_base": (np.uint64, 0), "hash_mix": (np.uint64, 0),
    "min_match": (np.int64, 0), "max_match": (np.int64, 0), "vocab_size": (np.int64, 0),
    "num_sequences": (np.int64, 0), "source": (np.str_, 0),
    "tokens": (np.int32, 1), "keys": (np.uint32, 1), "ends": (np.int32, 1),
}
_REBUILD = "rebuild it with `specplug datastore build`"


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(f"datastore {path} does not exist: {_REBUILD} --out {path}")
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError(f"holds one {type(npz).__name__}, not an archive of named fields")
        with npz:
            return {name: npz[name] for name in npz.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"datastore {path}: not a readable .npz file ({type(exc).__name__}: {exc}); "
                         f"{_REBUILD}") from exc


def _check_fields(path: Path, data: dict[str, np.ndarray]) -> None:
    for name, (dtype, ndim) in _FIELDS.items():
        if name not in data:
            raise ValueError(f"datastore {path}: field {name!r} is missing (expected {np.dtype(dtype).name} "
                             f"with {ndim} dims); {_REBUILD}")
        arr = data[name]
        if not np.issubdtype(arr.dtype, dtype) or arr.ndim != ndim:
            raise ValueError(f"datastore {path}: field {name!r} expected {np.dtype(dtype).name} with {ndim} dims, "
                             f"given {arr.dtype} with shape {arr.shape}; {_REBUILD}")
    expected = {"format": FORMAT, "version": VERSION, "hash_base": HASH_BASE, "hash_mix": HASH_MIX}
    for name, value in expected.items():
        if data[name].item() != value:
            raise ValueError(f"datastore {path}: field {name!r} expected {value!r}, given {data[name].item()!r}; "
                             f"{_REBUILD} from this specplug version")


def _check_index(path: Path, data: dict[str, np.ndarray]) -> None:
    tokens, keys, ends = data["tokens"], data["keys"], data["ends"]
    lo, hi = int(data["min_match"]), int(data["max_match"])
    if not 1 <= lo <= hi:
        raise ValueError(f"datastore {path}: fields 'min_match'/'max_match' expected 1 <= min <= max, given "
                         f"{lo}/{hi}; {_REBUILD}")
    if keys.shape != ends.shape:
        raise ValueError(f"datastore {path}: field 'ends' expected shape {keys.shape} (as 'keys'), given "
                         f"{ends.shape}; {_REBUILD}")
    unsorted = keys.size and bool((keys[1:] < keys[:-1]).any())
    if unsorted or (keys.size and (int(ends.min()) < 0 or int(ends.max()) >= tokens.size - 1)):
        raise ValueError(f"datastore {path}: field 'keys' expected sorted with 'ends' in [0, {tokens.size - 1}), "
                         f"given an unsorted or out-of-range index; {_REBUILD}")
    for i in np.linspace(0, keys.size - 1, num=min(keys.size, 64)).astype(np.int64).tolist():
        end = int(ends[i])
        window = tokens[max(0, end - hi + 1):end + 1].tolist()[::-1]
        stop = window.index(SEPARATOR) if SEPARATOR in window else len(window)
        found = {_key32(k) for k in ngram_keys(window[:stop][::-1], stop - 1, hi)[lo - 1:]} if stop else set()
        if int(keys[i]) not in found:
            raise ValueError(f"datastore {path}: field 'keys' entry {i} expected the key of an n-gram ending at "
                             f"token {end}, given {int(keys[i])} (tokens and index disagree: corrupted); {_REBUILD}")


def load_datastore(path: str | Path, *, vocab_size: int | None = None) -> Datastore:
    """Read and validate a datastore written by :func:`build_datastore`.

    Raises FileNotFoundError when ``path`` is missing and ValueError (naming the file,
    the field, what was expected and given, and the fix) when it is not a datastore of
    this version, is corrupted (index and tokens disagree on a sample of entries), or
    was built for a larger vocabulary than ``vocab_size`` (the target's; a target
    may pad its embedding beyond the tokenizer, so a smaller stored size is accepted).
    """
    path = Path(path)
    data = _read_npz(path)
    _check_fields(path, data)
    _check_index(path, data)
    stored = int(data["vocab_size"])
    top = int(data["tokens"].max()) if data["tokens"].size else -1
    if vocab_size is not None and (stored > vocab_size or top >= vocab_size):
        raise ValueError(f"datastore {path}: field 'vocab_size' expected at most {vocab_size} (the target's), "
                         f"given {stored} (largest token id {top}): it was built with another tokenizer; "
                         f"rebuild it with `specplug datastore build --target` pointing at this target")
    store = Datastore(data["tokens"], data["keys"], data["ends"], int(data["min_match"]), int(data["max_match"]),
                      stored, str(data["source"]), int(data["num_sequences"]))
    logger.info("retrieval datastore %s: %s", path, store.summary())
    return store
