"""Path choice: which part of a drafted tree an engine verifies when it verifies chains.

Engines that verify one chain per request (vLLM stage "chain") take it from a drafted
tree here, so both engines and every drafter choose paths the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from specplug.common import merge
from specplug.common.tree import TreeBatch, path_reduce, tree_depths

logger = logging.getLogger(__name__)


def full_budget(depth: int, topk: int, draft_vocab: int) -> int:
    """Nodes dynamic_trees.dynamic drafts in all (root excluded): keeping all of them keeps every leaf."""
    k = min(topk, draft_vocab)
    return k + (depth - 1) * k * k


def best_chains(trees: TreeBatch, depth: int) -> torch.Tensor:
    """Long [B, depth]: the chain vLLM verifies in stage "chain". It is the root path with the largest
    expected accepted length under the draft's own probabilities (sum over its nodes of
    exp(cumulative log-prob)), at any depth; a path shorter than `depth` is padded by
    repeating its last token (vLLM schedules exactly `depth` drafts; verification stays
    exact whatever they are). Measured on the test bed this beats both the best-scoring
    deepest node (beam search) and requiring a full-depth path."""
    return best_chains_expected(trees, depth)[0]


def best_chains_expected(trees: TreeBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(best_chains, Float [B]: each chain's expected accepted length, the sum of its
    nodes' exp(cumulative log-prob); padding adds nothing)."""
    return best_chain_paths(trees, depth)[:2]


def best_chain_paths(trees: TreeBatch, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(best_chains Long [B, depth], expected Float [B], lengths Long [B]): as
    best_chains_expected, and how many of each chain's tokens are its path (the rest
    repeat its last token; at most `depth`)."""
    depths = tree_depths(trees.parents)  # [B, N]
    reach = torch.where(depths > 0, trees.scores.exp(), torch.zeros_like(trees.scores))
    expected = path_reduce(reach, trees.parents, torch.add)  # [B, N]
    node = expected.argmax(dim=1)  # [B]
    best = expected.gather(1, node[:, None]).squeeze(1)  # [B]
    length = depths.gather(1, node[:, None]).squeeze(1)  # [B] path length, >= 1
    chain = torch.empty(trees.candidates.shape[0], depth, dtype=torch.long)
    for d in range(depth - 1, -1, -1):
        on_path = d < length  # [B] walk up only once position d is on the path
        chain[:, d] = trees.candidates.gather(1, node[:, None]).squeeze(1)
        node = torch.where(on_path, trees.parents.gather(1, node[:, None]).squeeze(1), node)
    return chain, best, length.clamp(max=depth)


def best_merged_chains(sources: Sequence[TreeBatch], depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """best_chain_paths(merge_trees(sources, every node), depth), on the merged trie in
    Python (merge.trie / merge.ranked): the same chains, expected lengths (float64 sums
    here, so an exact float32 tie may break the other way) and path lengths, without
    building the merged tree. At batch 1 the tensor route costs ~0.7 ms of small ops."""
    merge.check_sources(sources)
    chains, expected, lengths = [], [], []
    for trees in zip(*(merge.requests(s) for s in sources)):
        nodes = merge.trie(trees)
        reach, best, best_path = {(): 0.0}, 0.0, ()
        for path in merge.ranked(nodes):  # merge_trees' node order: the first maximum wins, as argmax
            reach[path] = reach[path[:-1]] + math.exp(nodes[path])
            if reach[path] > best:
                best, best_path = reach[path], path
        path = list(best_path[:depth]) or [trees[0][0][0]]  # no draft node: the root repeated
        chains.append(path + [path[-1]] * (depth - len(path)))
        expected.append(best)
        lengths.append(min(len(best_path), depth))
    return torch.tensor(chains, dtype=torch.long), torch.tensor(expected), torch.tensor(lengths, dtype=torch.long)


def pad_chains(chains: TreeBatch, depth: int) -> torch.Tensor:
    """Long [B, depth]: each chain's draft tokens (candidates[b, 1:num_nodes[b]]) padded
    by repeating its last token (the root's when it has none)."""
    last = (chains.num_nodes - 1).clamp(min=0)  # [B] index of each chain's last node
    column = torch.minimum(torch.arange(1, depth + 1)[None], last[:, None])  # [B, depth]
    return chains.candidates.gather(1, column)


def lengthen_chains(drafter, request_ids, chains: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Long [B, depth]: `chains` with each short chain's padding (past its path of
    lengths[b] tokens) replaced by the token drafter's continuation of the request's
    committed tokens followed by that path (`drafter.continuation(rid, path, k)`, a
    drafter without it: chains unchanged); where the continuation runs out, its last
    token repeats. Lossless whatever it returns (the drafts are deterministic, verified
    by the target-only rule); vLLM verifies every slot anyway, so a weak continuation
    still beats repeating the last token. A drafter that raises costs the chains
    nothing, never the step."""
    depth = chains.shape[1]
    continuation = getattr(drafter, "continuation", None)
    lengths = lengths.tolist()  # [B] ints: read once, not one tensor index per row and use
    short = [b for b, rid in enumerate(request_ids) if lengths[b] < depth and rid in drafter.live]
    if continuation is None or not short:
        return chains
    out = chains.clone()
    try:
        for b in short:
            n = lengths[b]
            more = continuation(request_ids[b], out[b, :n].tolist(), depth - n)
            if more:
                out[b, n:n + len(more)] = torch.tensor(more)
                out[b, n + len(more):] = more[-1]
    except Exception:
        logger.exception("token drafter %s failed to lengthen chains; they keep their padding", type(drafter).__name__)
        return chains
    return out
