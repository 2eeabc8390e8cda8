"""Model-free retrieval drafting: draft trees from continuations of the context's suffix.

Prompt lookup, SuffixDecoding (Oliaro et al. 2024) and REST (He et al. 2024) in one
engine-free drafter. The longest suffix of a request's tokens that occurred before is
looked up in three sources:

* the request's own tokens (prompt + output so far),
* a bounded cache of finished requests' sequences (oldest evicted first),
* an optional static datastore built offline from a corpus (:func:`build_datastore`).

The continuations after its occurrences are merged into a trie whose best nodes form
the draft tree. Modules: ``config`` (settings), ``index`` (n-gram keys, the live
indexes), ``datastore`` (the static index and its file), ``trees`` (continuations ->
scored tree), ``drafter`` (the drafters), ``cli`` (`specplug datastore`).
"""

from .config import RetrievalConfig
from .datastore import Datastore, build_datastore, load_datastore, save_datastore
from .drafter import ReferenceDrafter, RetrievalDrafter
from .index import ngram_keys
from .trees import best_path, continuation_tree

__all__ = [
    "RetrievalConfig",
    "RetrievalDrafter",
    "ReferenceDrafter",
    "Datastore",
    "build_datastore",
    "load_datastore",
    "save_datastore",
    "continuation_tree",
    "best_path",
    "ngram_keys",
]
