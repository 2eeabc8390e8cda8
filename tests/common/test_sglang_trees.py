"""SGLang's verify layouts of draft trees (specplug.common.sglang_trees): retrieve links,
tree-only and prefix-included masks."""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplug.common import sglang_trees as S
from specplug.common import tree as T
from tests.common.test_tree import parents_lists, random_parents


@settings(max_examples=60, deadline=None)
@given(parents_lists())
def test_sglang_layout_walks_children_in_id_order(parents):
    n = len(parents)
    index, next_token, next_sibling = S.sglang_layout(torch.tensor(parents))
    assert index.tolist() == list(range(n))
    for i in range(n):
        kids = [j for j in range(n) if parents[j] == i]
        walked, c = [], int(next_token[i])
        while c >= 0:
            walked.append(c)
            c = int(next_sibling[c])
        assert walked == kids


def test_batched_layout_and_flat_masks_match_single_trees():
    rng = random.Random(0)
    trees = [T.DraftTree(torch.randint(0, 50, (n,)), torch.tensor(random_parents(rng, n))) for n in (1, 4, 9)]
    batch = T.stack_trees(trees)
    idx, nxt, sib = S.sglang_layout(batch.parents, batch.num_nodes)
    for b, t in enumerate(trees):
        n = t.num_nodes
        assert idx[b, :n].tolist() == [b * 9 + i for i in range(n)] and (idx[b, n:] == -1).all()
        assert torch.equal(nxt[b, :n], S.sglang_layout(t.parents)[1])
        assert torch.equal(sib[b, :n], S.sglang_layout(t.parents)[2])
    flat = S.flat_tree_masks(trees)
    assert flat.numel() == 1 + 16 + 81
    assert torch.equal(flat[17:], trees[2].attention_mask().flatten())


def _per_request(tree_masks, seq_lens):
    """The reference: per request [n, s + n] = [all-True prefix | tree mask], concatenated."""
    n = tree_masks.shape[1]
    return torch.cat([torch.cat([torch.ones(n, s, dtype=torch.bool), m], 1).flatten()
                      for m, s in zip(tree_masks, seq_lens)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(parents_lists(max_nodes=7), st.integers(0, 20)), min_size=1, max_size=4),
       st.integers(0, 3))
def test_prefix_included_masks_match_per_request_blocks(requests, extra):
    trees = [T.DraftTree(torch.zeros(len(p), dtype=torch.long), torch.tensor(p)) for p, _ in requests]
    seq_lens = torch.tensor([s for _, s in requests])
    batch = T.pad_batch(T.stack_trees(trees), max(t.num_nodes for t in trees) + extra)  # padded nodes too
    masks = T.ancestor_mask(batch.parents)  # [B, n, n]
    n = masks.shape[1]
    flat = S.prefix_included_masks(masks, seq_lens)
    assert torch.equal(flat, _per_request(masks, seq_lens.tolist()))
    indptr = S.mask_indptr(seq_lens, n)
    assert indptr.tolist() == [0] + torch.cumsum(n * (seq_lens + n), 0).tolist()
    for b, (t, s) in enumerate(zip(trees, seq_lens.tolist())):
        block = flat[indptr[b]:indptr[b + 1]].view(n, s + n)
        assert torch.equal(block[:t.num_nodes, s:s + t.num_nodes], t.attention_mask())
        pad = block[t.num_nodes:]  # padding nodes: the prefix and themselves only
        assert pad[:, :s].all() and torch.equal(pad[:, s:], torch.eye(n, dtype=torch.bool)[t.num_nodes:])


def test_accepted_outputs_in_sglang_bookkeeping():
    """Two requests, trees of 3 nodes (root; request 0 a chain 0-1-2, request 1 two
    children of the root): request 0 accepts both drafts, request 1 its second child only.
    accept_index holds flat node rows, predict the token emitted after each accepted node
    (the next accepted node's token, then the bonus), accept_tokens what each request emits."""
    from specplug.common.verify_result import VerifyResult

    trees = T.TreeBatch(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[-1, 0, 1], [-1, 0, 0]]),
                        torch.tensor([3, 3]))
    verdict = VerifyResult(torch.tensor([[0, 1, 2], [0, 2, -1]]), torch.tensor([2, 1]), torch.tensor([70, 71]))
    accept_index, predict, accept_tokens = S.accepted_outputs(trees, verdict, "cpu")
    assert accept_index.tolist() == [[0, 1, 2], [3, 5, -1]]
    assert accept_tokens.tolist() == [[6, 7, 70], [10, 71, 0]]
    assert predict.tolist() == [6, 7, 70, 10, 0, 71]


def test_root_only_batch_is_a_plain_decode_step():
    batch = S.root_only_batch(torch.tensor([4, 9]))
    assert batch.candidates.tolist() == [[4], [9]] and batch.parents.tolist() == [[-1], [-1]]
    assert S.ROOT_ONLY["mask"].tolist() == [[True]] and S.ROOT_ONLY["next_token"].tolist() == [-1]


def test_full_width_and_prefill_outputs():
    from specplug.common.sglang_trees import full_width, prefill_outputs

    tokens = torch.tensor([[5, 6], [7, 0]], dtype=torch.int32)
    assert full_width(tokens, 2) is tokens and full_width(tokens, 4).tolist() == [[5, 6, 0, 0], [7, 0, 0, 0]]
    accept_tokens, accept_lens = prefill_outputs(torch.tensor([3, 4]), 2, 3, "cpu")
    assert accept_tokens.tolist() == [3, 0, 0, 4, 0, 0] and accept_lens.tolist() == [1, 1]
    assert prefill_outputs(None, 0, 3, "cpu")[0].numel() == 0


def test_verify_q_is_on_the_logits_width():
    from types import SimpleNamespace

    from specplug.common.sglang_trees import verify_q

    tree = SimpleNamespace(draft_probs=torch.full((1, 2, 3), 0.25), candidates=None, num_nodes=None)
    assert verify_q(None, ["a"], tree, 4, "cpu").shape == (1, 2, 4)  # padded with 0
    assert verify_q(None, ["a"], SimpleNamespace(draft_probs=None), 4, "cpu") is None
    session = SimpleNamespace(draft_q=lambda ids, candidates, num_nodes: {0: torch.ones(2, 6)})
    assert verify_q(session, ["a"], tree, 4, "cpu")[0].shape == (2, 4)  # cut to the vocabulary
    assert verify_q(SimpleNamespace(draft_q=lambda *a: {}), ["a"], tree, 4, "cpu") is None
