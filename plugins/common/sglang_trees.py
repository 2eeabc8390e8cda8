"""Draft trees in SGLang's verify layouts: retrieve links, tree-only and prefix-included
masks, and a verify step's result in the tensors SGLang's bookkeeping reads.

Engine-free (torch only): the SGLang adapter hands these to SGLang's TARGET_VERIFY pass.

* ``tree_layout`` / ``batch_layout``: a tree's (or each request's) mask, depths and
  retrieve links, as the adapter builds a verify batch from them; ``root_only_batch``
  and ``ROOT_ONLY``: a plain decode step's.
* ``accepted_outputs``: accept_index, predict and accept_tokens of a VerifyResult;
  ``full_width`` pads them to the reserved node count; ``prefill_outputs``: a prefill's.
* ``request_masks``: a verify batch's custom_mask, either layout, split per request.

* ``sglang_layout``: the retrieve links SGLang's tree acceptance walks.
* ``flat_tree_masks``: the tree-only export, ``n x n`` per request (SGLang's ngram
  worker's input to ``reconstruct_indices_from_tree_mask``; specplug's torch_native
  hook reads it too).
* ``prefix_included_masks``: what SGLang's GPU verify attention reads (its Triton
  extend kernel): per request ``n`` rows of ``seq_len + n`` columns (the committed
  prefix, then the ``n`` tree nodes), flattened row-major and concatenated in batch
  order; request b's block starts at ``mask_indptr(seq_lens, n)[b]``. Every request
  has the same ``n`` (SGLang's ``speculative_num_draft_tokens``): smaller trees are
  padded (``tree.pad_batch``) with nodes that see only the prefix and themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specplug.common.tree import DraftTree, TreeBatch, ancestor_mask, tree_depths

if TYPE_CHECKING:
    from specplug.common.verify_result import VerifyResult

__all__ = ["sglang_layout", "flat_tree_masks", "prefix_included_masks", "mask_indptr", "tree_layout",
           "batch_layout", "ROOT_ONLY", "root_only_batch", "accepted_outputs", "vocab_width"]


def sglang_layout(parents: torch.Tensor, num_nodes: torch.Tensor | None = None):
    """SGLang's verify layout: parents [B, N] (or [N]) -> three Long tensors of the same shape.

    ``retrieve_index[b, i] = b * N + i`` (row of node i in the flattened batch),
    ``retrieve_next_token[b, i]`` = first child of i, ``retrieve_next_sibling[b, i]``
    = next sibling of i, both in node-id order, -1 = none. Padding nodes are -1.
    """
    single = parents.dim() == 1
    p = parents.unsqueeze(0) if single else parents
    bsz, n = p.shape
    ids = torch.arange(n, device=p.device)
    real = torch.ones_like(p, dtype=torch.bool) if num_nodes is None else ids < num_nodes.unsqueeze(-1)
    p = torch.where(real, p, torch.full_like(p, -1))
    retrieve_index = torch.where(real, ids + n * torch.arange(bsz, device=p.device).unsqueeze(-1), -1)
    is_child = p.unsqueeze(-2) == ids.view(1, n, 1)  # [B, parent, node]
    is_child &= ids.view(1, 1, n) > 0
    big = torch.full_like(p, n).unsqueeze(-2).expand(bsz, n, n)
    first = torch.where(is_child, ids.view(1, 1, n).expand(bsz, n, n), big).min(-1).values
    next_token = torch.where(first < n, first, -1)
    same = (p.unsqueeze(-1) == p.unsqueeze(-2)) & (p.unsqueeze(-1) >= 0)  # [B, node, other]
    later = ids.view(1, 1, n) > ids.view(1, n, 1)
    nxt = torch.where(same & later, ids.view(1, 1, n).expand(bsz, n, n), big).min(-1).values
    next_sibling = torch.where(nxt < n, nxt, -1)
    out = (retrieve_index, next_token, next_sibling)
    return tuple(t[0] for t in out) if single else out


def flat_tree_masks(trees: Sequence[DraftTree]) -> torch.Tensor:
    """The "n x n mask per request" export: Bool [sum(N_b ** 2)], row-major per request.

    This is the flat tree mask SGLang's ngram worker hands to
    ``reconstruct_indices_from_tree_mask``.
    """
    return torch.cat([t.attention_mask().flatten() for t in trees]) if trees else torch.zeros(0, dtype=torch.bool)


def mask_indptr(seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Where each request's block starts in a prefix-included mask: seq_lens [B] ->
    Long [B + 1], ``indptr[b + 1] - indptr[b] = n * (seq_lens[b] + n)``."""
    sizes = n * (seq_lens.long() + n)  # [B]
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])


def prefix_included_masks(tree_masks: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Tree masks [B, n, n] (row i may attend column j: ``tree.ancestor_mask``) and the
    committed lengths seq_lens [B] -> SGLang's GPU verify mask Bool [sum(n * (s_b + n))].

    Invariant: entry ``mask_indptr(seq_lens, n)[b] + i * (s_b + n) + c`` is True for every
    prefix column ``c < s_b`` and equals ``tree_masks[b, i, c - s_b]`` for the tree columns.
    On the tensors' device; one host sync (the total size).
    """
    bsz, n, _ = tree_masks.shape
    seq_lens = seq_lens.to(tree_masks.device).long()
    indptr = mask_indptr(seq_lens, n)  # [B + 1]
    flat = torch.ones(int(indptr[-1]), dtype=torch.bool, device=tree_masks.device)  # the prefix: visible
    rows = torch.arange(n, device=tree_masks.device)
    width = (seq_lens + n)[:, None, None]  # [B, 1, 1]
    where = indptr[:-1, None, None] + rows[None, :, None] * width + seq_lens[:, None, None] + rows[None, None, :]
    flat[where.flatten()] = tree_masks.bool().flatten()  # [B, n, n] tree columns
    return flat


def tree_layout(tree: DraftTree, device="cpu") -> dict[str, torch.Tensor]:
    """One static tree's mask Bool [N, N], depths Long [N] and SGLang retrieve links [N],
    on `device` (a worker caches the layouts of its static trees there)."""
    _, next_token, next_sibling = sglang_layout(tree.parents)
    layout = {"mask": tree.attention_mask(), "depth": tree.depth, "next_token": next_token,
              "next_sibling": next_sibling}
    return {name: t.to(device) for name, t in layout.items()}


def batch_layout(trees: TreeBatch) -> dict[str, torch.Tensor]:
    """Per-request trees' masks Bool [B, N, N], depths and retrieve links Long [B, N];
    padding nodes attend only to themselves (depth 0) and are linked to nothing."""
    real = torch.arange(trees.parents.shape[1]) < trees.num_nodes.cpu()[:, None]
    parents = torch.where(real, trees.parents.cpu(), -1)
    _, next_token, next_sibling = sglang_layout(parents, trees.num_nodes.cpu())
    return {"mask": ancestor_mask(parents), "depth": tree_depths(parents), "next_token": next_token,
            "next_sibling": next_sibling}


ROOT_ONLY = tree_layout(DraftTree(torch.zeros(1, dtype=torch.long), torch.tensor([-1])))


def vocab_width(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """q [B, N, V'] on the logits' vocabulary width: SGLang pads the LM head's rows, and
    a drafter's q covers the tokenizer's vocabulary (padding columns get 0)."""
    if q.shape[-1] >= vocab:
        return q[..., :vocab]
    return torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))


def verify_q(session, request_ids, tree: TreeBatch, vocab: int, device):
    """q of a step's drafts drawn from q, for verify_step on the logits' vocabulary width
    (vocab_width) and device: {row: q Float [k, V]} from `session`'s step record (a
    drafting.session.DraftingSession; None when no row drew), or TreeBatch.draft_probs
    (every row, or None) without a session."""
    q = tree.draft_probs if session is None else session.draft_q(request_ids, tree.candidates, tree.num_nodes) or None
    if isinstance(q, dict):
        return {b: vocab_width(rows.to(device), vocab) for b, rows in q.items()}
    return None if q is None else vocab_width(q.to(device), vocab)


def root_only_batch(roots: torch.Tensor) -> TreeBatch:
    """Every request verifies its root alone (n = 1): an ordinary decode step."""
    bs = roots.shape[0]
    return TreeBatch(roots[:, None], torch.full((bs, 1), -1, dtype=torch.long), torch.ones(bs, dtype=torch.long))


def accepted_outputs(tree: TreeBatch, verdict: VerifyResult, device) -> tuple[torch.Tensor, ...]:
    """A verify step's result as SGLang's bookkeeping reads it, on `device`: (accept_index
    Int [B, n] flat node rows -1 padded, predict Int [B*n] the token emitted after each
    accepted node, accept_tokens Int [B, n] the emitted tokens)."""
    bs, n = tree.candidates.shape
    accept_index = verdict.node_rows(torch.arange(bs) * n, n).to(device=device, dtype=torch.int32)
    width = verdict.accepted_nodes.shape[1]
    on_path = accept_index[:, :width] >= 0  # [B, D+1]
    # token after path[j]: the token AT path[j + 1]; after the last accepted, the bonus
    emitted = verdict.output_tokens(tree.candidates.to(verdict.accepted_nodes.device))  # [B, D+1], -1 padded
    emitted = torch.where(on_path, emitted.to(device), 0)
    accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=device)
    accept_tokens[:, :width] = emitted.to(torch.int32)
    predict = torch.zeros(bs * n, dtype=torch.int32, device=device)
    kept = accept_index >= 0
    predict[accept_index[kept].long()] = accept_tokens[kept]
    return accept_index, predict, accept_tokens


def full_width(accept_tokens: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """accept_tokens [B, n] -> [B, num_nodes], zero padded: SGLang reads accepted tokens with
    the stride of the most nodes a step may verify."""
    bs, n = accept_tokens.shape
    if n == num_nodes:
        return accept_tokens
    padded = accept_tokens.new_zeros(bs, num_nodes)
    padded[:, :n] = accept_tokens
    return padded


def prefill_outputs(next_token_ids, bs: int, num_nodes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill step's result for `bs` requests as SGLang's bookkeeping reads it: (accept_tokens
    Int [B * num_nodes], each request's first token in its row's column 0; accept_lens Int [B], all 1)."""
    accept_tokens = torch.zeros(bs, num_nodes, dtype=torch.int32, device=device)
    if bs:
        accept_tokens[:, 0] = next_token_ids
    return accept_tokens.flatten(), torch.ones(bs, dtype=torch.int32, device=device)


def request_masks(custom_mask: torch.Tensor, seq_lens: list[int], n: int) -> list[torch.Tensor]:
    """Split a verify batch's flat custom_mask into per-request Bool [n, seq_len + n]
    (True = may attend), accepting the tree-only and the prefix-included layouts."""
    bs = len(seq_lens)
    flat = custom_mask.reshape(-1).bool()
    if flat.numel() == bs * n * n:  # tree-only: the prefix is always visible
        trees = flat.view(bs, n, n)
        return [torch.cat([trees.new_ones(n, s), trees[b]], dim=1) for b, s in enumerate(seq_lens)]
    sizes = [n * (s + n) for s in seq_lens]
    if flat.numel() < sum(sizes):
        raise ValueError(
            f"custom_mask has {flat.numel()} entries; expected {bs * n * n} (tree only) or "
            f"at least {sum(sizes)} (prefix + tree) for seq_lens {seq_lens} and {n} draft "
            "tokens per request: the speculative worker built an inconsistent verify batch")
    return [m.view(n, s + n) for m, s in zip(flat[: sum(sizes)].split(sizes), seq_lens)]
