"""Continuations -> scored draft tree: node ranking, :func:`continuation_tree`, :func:`best_path`.

A node's score estimates the probability that its whole path is accepted: the product
along the path of the conditional frequencies count(child) / (count(parent) + prior / n),
n = the match length; prior 0 gives the share of occurrences followed by the path
(SuffixDecoding's frequency), the default shrinks what few occurrences of a short
pattern support, as measured (see :class:`~.config.RetrievalConfig`).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from .config import RetrievalConfig


class _Node(NamedTuple):
    token: int
    parent: int  # rank id of the parent (index + 1 among the ranked nodes); 0 = the root
    count: int  # continuations that start with this node's path
    score: float  # estimated acceptance probability of the path


def _prior(config: RetrievalConfig, match_length: int):
    """d -> the pseudo-count a node at depth d + 1 is scored with: config.prior / match
    length, or with config.lengthen config.prior / (match length + d) (the path's own d
    tokens, if accepted, lengthen the match)."""
    if config.lengthen:
        return lambda d: config.prior / (match_length + d)
    return lambda d: config.prior / match_length


def _ranked_nodes(continuations: Sequence[Sequence[int]], budget: int, depth: int,
                  config: RetrievalConfig, prior) -> list[_Node]:
    """The ``budget`` best continuation prefixes (at most ``depth`` tokens), best first by
    (score desc, depth, first seen), each with count >= min_count and score >= min_prob.

    score(child) = score(parent) * count(child) / (count(parent) + prior(d)), d the
    parent's depth, root: count = all continuations, score 1 (``prior``: _prior). Scores fall
    along every path, so a parent is always taken before its children. Best-first
    search over the trie: a prefix is split by its next token only once it is taken,
    so the work is bounded by ``budget`` splits.
    """
    heap: list = []
    nodes: list[_Node] = []
    pushed = 0

    def push_children(items: list, d: int, parent: int, count: int, score: float) -> None:
        nonlocal pushed
        if len(items) == 1:  # one distinct continuation: its next token alone
            by_token = {items[0][0][d]: items} if len(items[0][0]) > d else {}
        else:
            by_token = {}
            for item in items:
                if len(item[0]) > d:
                    by_token.setdefault(item[0][d], []).append(item)
        for token, group in by_token.items():
            child_count = group[0][1] if len(group) == 1 else sum(w for _, w in group)
            child_score = score * child_count / (count + prior(d))
            if child_count >= config.min_count and child_score >= config.min_prob:
                heapq.heappush(heap, (-child_score, d + 1, pushed, token, parent, child_count, group))
                pushed += 1

    push_children(list(Counter(map(tuple, continuations)).items()), 0, 0, len(continuations), 1.0)
    while heap and len(nodes) < budget:
        neg_score, d, _, token, parent, count, group = heapq.heappop(heap)
        nodes.append(_Node(token, parent, count, -neg_score))
        if d < depth:
            push_children(group, d, len(nodes), count, -neg_score)
    return nodes


def _chain(continuation: Sequence[int], total: int, budget: int, config: RetrievalConfig,
           prior) -> tuple[list[int], list[int], list[float]]:
    """:func:`continuation_tree` when all ``total`` continuations are the same: a chain."""
    if total < config.min_count:
        return [], [], []
    scores, score = [], 1.0
    for d in range(min(len(continuation), budget)):
        score *= total / (total + prior(d))
        if score < config.min_prob:
            break
        scores.append(score)
    return list(continuation[:len(scores)]), list(range(len(scores))), scores


def continuation_tree(continuations: Sequence[Sequence[int]], budget: int,
                      config: RetrievalConfig = RetrievalConfig(), match_length: int = 1
                      ) -> tuple[list[int], list[int], list[float]]:
    """Merge continuations into a draft tree: -> (tokens, parents, scores) of the draft nodes.

    Node ids are 1.. (0 = the root, not listed); ``parents[i - 1]`` is node i's parent.
    A node is a distinct continuation prefix; its score estimates the probability that
    its whole path is accepted: the product along the path of the conditional
    frequencies count(child) / (count(parent) + config.prior / match_length) (prior 0:
    the share of continuations that start with the path; ``match_length``: tokens of
    the pattern the continuations followed). Kept: the ``budget`` best nodes (see
    :func:`_ranked_nodes`), closed under parents. Order: depth-first, children by
    rank, so nodes 1..d are the path that always takes the best child, siblings are
    tested most likely first, and parents precede children.
    """
    if not continuations or budget <= 0:
        return [], [], []
    prior, first = _prior(config, match_length), continuations[0]
    if all(c == first for c in continuations):
        return _chain(first, len(continuations), budget, config, prior)
    ranked = _ranked_nodes(continuations, budget, max(map(len, continuations)), config, prior)
    children: list[list[int]] = [[] for _ in range(len(ranked) + 1)]  # by rank id, 0 = root
    for i, node in enumerate(ranked, start=1):
        children[node.parent].append(i)
    tokens, parents, scores = [], [], []
    stack = [(child, 0) for child in reversed(children[0])]
    while stack:
        rank_id, parent = stack.pop()
        node = ranked[rank_id - 1]
        tokens.append(node.token)
        parents.append(parent)
        scores.append(node.score)
        stack.extend((child, len(tokens)) for child in reversed(children[rank_id]))
    return tokens, parents, scores


def best_path(continuations: Sequence[Sequence[int]], k: int, config: RetrievalConfig = RetrievalConfig(),
              match_length: int = 1) -> tuple[list[int], list[float]]:
    """The chain of at most k tokens with the largest expected accepted length (the sum of
    its nodes' scores, nodes under the thresholds excluded): -> (tokens, scores). Ties go
    to the better-ranked path."""
    if not continuations or k <= 0:
        return [], []
    ranked = _ranked_nodes(continuations, len(continuations) * k, k, config, _prior(config, match_length))
    value = [0.0]  # by rank id, 0 = root
    for node in ranked:
        value.append(value[node.parent] + node.score)
    best = max(range(len(value)), key=lambda i: (value[i], -i))
    tokens, scores = [], []
    while best:
        node = ranked[best - 1]
        tokens.append(node.token)
        scores.append(node.score)
        best = node.parent
    return tokens[::-1], scores[::-1]
