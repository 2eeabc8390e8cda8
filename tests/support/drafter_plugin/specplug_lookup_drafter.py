"""A third-party token drafter, as a plugin author writes one (test support, not product
code): prompt lookup (Saxena 2023) in ONE class, registered through the entry-point group
"specplug" (specplug_lookup_drafter-0.1.dist-info/entry_points.txt). The suites put this
folder on sys.path, so vLLM runs it beside the head (`SPECPLUG_DRAFTER=lookup`) and
SGLang alone (`--speculative-algorithm LOOKUP`) without a line of engine code."""

from __future__ import annotations

from specplug.common.hooks import hookimpl
from specplug.common.token_drafters import TokenDrafterBase, pack_trees


class LookupDrafter(TokenDrafterBase):
    """Drafts, as a chain, what followed the most recent earlier occurrence of the last
    `ngram` tokens; node i scores `score` ** (i + 1)."""

    def __init__(self, budget: int = 8, max_depth: int = 8, ngram: int = 2, score: float = 0.5):
        super().__init__(budget, max_depth)
        self.ngram, self.score = ngram, score

    def draft(self, request_ids, root_tokens=None, *, budget=None, max_depth=None, min_prob=None):
        k = min(budget or self.budget, max_depth or self.max_depth)
        roots, chains = [], []
        for b, rid in enumerate(request_ids):
            tokens = self.live.get(rid, [])
            roots.append(int(root_tokens[b]) if root_tokens is not None else tokens[-1])
            found = self._continuation(tokens, k)
            chains.append((found, list(range(len(found))), [self.score ** (i + 1) for i in range(len(found))]))
        return pack_trees(roots, chains)[0]

    def _continuation(self, tokens: list[int], k: int) -> list[int]:
        key = tokens[-self.ngram:]
        for start in range(len(tokens) - self.ngram - 1, -1, -1):
            if tokens[start:start + self.ngram] == key:
                return tokens[start + self.ngram:start + self.ngram + k]
        return []


@hookimpl
def specplug_drafters():
    return {"lookup": LookupDrafter}
