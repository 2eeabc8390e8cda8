"""Sampled drafting (specplug.common.dynamic_trees.sampled, drafters.SampledDrafts) is lossless.

Trees are built by the production builder `dynamic_trees.sampled` from the toy model of
test_sampling_lossless (draft Q, target P depending on the previous token and the
output index), over B = 100,000 independent requests per check, and verified with
`sampling.verify(method="rejection", draft_probs=TreeBatch.draft_probs)`. The first
emitted token and the first two jointly must follow P (chi-square, fails at
p < ALPHA = 1e-5; 8 checks on correct code, so a false failure has chance < 1e-4).
Covered: Leviathan chains (width 1), SpecInfer sampled chains sharing a root (width 2
and 3), and a draft vocabulary smaller than the target's (EAGLE-3's token map: q is
scattered into target columns). Negative control: the same trees verified with a q
at another temperature than the one drawn from (a draft-temperature bug) must fail.
"""

import pytest
import torch

from specplug.common import sampling as S
from specplug.common import tree as tree_lib
from specplug.common.dynamic_trees import sampled
from tests.common.test_sampling_lossless import ALPHA, SAMPLES, ToyModel, chi_square_pvalue  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def toy_trees(model: ToyModel, roots, offset, depth, width, token_map=None, verify_power=1.0):
    """Sampled trees rooted at roots [B] at output index ``offset``; returns the TreeBatch
    and the target p [B, N, V]. ``verify_power`` != 1 hands verify a wrong q."""
    def q_of(prev, index):  # [.., V'] over the draft vocabulary
        q = model.Q[index, prev]
        if token_map is not None:
            q = q[..., token_map]
            q = q / q.sum(-1, keepdim=True)
        return q

    expand = lambda f: q_of(f.tokens, offset + f.depth)  # noqa: E731  [B, F, V']
    batch = sampled(expand, roots, q_of(roots, offset), depth=depth, width=width,
                    token_map=token_map, vocab_size=model.vocab)
    depths = tree_lib.tree_depths(batch.parents[0])
    p = model.P[offset + depths, batch.candidates]  # [B, N, V]
    q = batch.draft_probs
    if verify_power != 1.0:
        q = q.pow(verify_power)
        q = torch.where(q.sum(-1, keepdim=True) > 0, q / q.sum(-1, keepdim=True).clamp(min=1e-30), q)
    return batch, p, q


def first_two(model, depth, width, token_map=None, verify_power=1.0, seed=0):
    torch.manual_seed(seed)
    roots = torch.zeros(SAMPLES, dtype=torch.long)
    batch, p, q = toy_trees(model, roots, 0, depth, width, token_map, verify_power)
    res = S.verify(batch.candidates, batch.parents, p, q, method="rejection")
    out = res.output_tokens(batch.candidates)[:, :2].clone()
    short = res.num_accepted == 0
    if bool(short.any()):
        b2, p2, q2 = toy_trees(model, out[short, 0], 1, depth, width, token_map, verify_power)
        verified = S.verify(b2.candidates, b2.parents, p2, q2, method="rejection")
        out[short, 1] = verified.output_tokens(b2.candidates)[:, 0]
    return out


def pvalues(model, out):
    p1 = model.P[0, 0]
    joint = p1.unsqueeze(1) * model.P[1]
    return chi_square_pvalue(out[:, 0], p1), chi_square_pvalue(out[:, 0] * model.vocab + out[:, 1], joint)


CASES = [(3, 1, None), (2, 2, None), (2, 3, "map"), (1, 3, "map")]


@pytest.mark.parametrize("depth, width, vocab_map", CASES, ids=[f"d{d}-w{w}-{m or 'full'}" for d, w, m in CASES])
def test_sampled_trees_with_q_are_lossless(depth, width, vocab_map):
    model = ToyModel(16, 1.0, vocab_map is not None, seed=depth * 10 + width)
    token_map = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 14, 15]) if vocab_map else None
    p_first, p_joint = pvalues(model, first_two(model, depth, width, token_map, seed=width))
    assert p_first >= ALPHA and p_joint >= ALPHA, (p_first, p_joint)


def test_negative_control_wrong_q_fails():
    model = ToyModel(16, 1.0, False, seed=4)
    assert min(pvalues(model, first_two(model, 2, 2, seed=1))) >= ALPHA
    p_first, p_joint = pvalues(model, first_two(model, 2, 2, verify_power=2.0, seed=1))
    assert p_first < ALPHA and p_joint < ALPHA


def test_sampled_tree_layout():
    """width chains of depth sharing the root; q rows of leaves are zero; tokens in the map."""
    q_root = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    expand = lambda f: torch.tensor([0.0, 0.0, 0.0, 1.0]).expand(*f.tokens.shape, 4)  # noqa: E731
    token_map = torch.tensor([10, 11, 12, 13])
    batch = sampled(expand, torch.tensor([7]), q_root, depth=3, width=2, token_map=token_map,
                    vocab_size=16)
    assert batch.parents[0].tolist() == [-1, 0, 0, 1, 2, 3, 4]
    assert batch.candidates[0, 0] == 7 and set(batch.candidates[0, 1:3].tolist()) <= {11, 12}
    assert batch.candidates[0, 3:].tolist() == [13, 13, 13, 13]
    assert batch.draft_probs.shape == (1, 7, 16)
    assert torch.equal(batch.draft_probs[0, 0, 10:14], q_root[0])
    assert float(batch.draft_probs[0, 5:].abs().sum()) == 0.0  # leaves draw nothing


def test_seeded_generators_reproduce_and_differ():
    q_root = torch.softmax(torch.randn(2, 50), -1)
    expand = lambda f: torch.softmax(torch.randn(*f.tokens.shape, 50, generator=torch.Generator().manual_seed(0)), -1)  # noqa: E731
    gens = lambda s: [torch.Generator().manual_seed(s), torch.Generator().manual_seed(s + 1)]  # noqa: E731
    a = sampled(expand, torch.tensor([1, 2]), q_root, depth=3, width=2, generators=gens(3))
    b = sampled(expand, torch.tensor([1, 2]), q_root, depth=3, width=2, generators=gens(3))
    assert torch.equal(a.candidates, b.candidates)


def test_sampled_drafts_settings_are_checked():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        from specplug.common.drafters import SampledDrafts
        SampledDrafts(0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        sampled(lambda f: None, torch.tensor([0]), torch.ones(1, 2) / 2, depth=1, width=1,
                token_map=torch.tensor([3, 4]))


def test_medusa_sampled_drafts_draw_each_depth_from_its_head():
    """MedusaDrafter.draft_sampled: `width` chains of min(depth, heads) nodes; every node at
    depth d carries head d-1's q at the draft temperature whatever its parent (a Medusa
    head sees no drafted token), so dynamic_trees.sampled's proof (above) covers it."""
    from specplug.common.drafters import MedusaDrafter, SampledDrafts
    from specplug.common.heads.medusa import MedusaConfig, MedusaHeads
    from specplug.common.tree import TreeConfig

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(medusa_num_heads=3, medusa_num_layers=1, hidden_size=16, vocab_size=50))
    drafter = MedusaDrafter(heads)
    hidden = torch.randn(2, 1, 16)
    drafter.prefill(["a", "b"], [None, None], hidden, torch.tensor([7, 8]))
    trees = drafter.draft_sampled(["a", "b"], TreeConfig(depth=5, topk=2, budget=10), SampledDrafts(0.5))
    assert trees.candidates.shape == (2, 1 + 2 * 3) and trees.candidates[:, 0].tolist() == [7, 8]
    q = (heads(hidden)[:, :, 0].float() / 0.5).softmax(-1)  # [K, B, V]
    depths = tree_lib.tree_depths(trees.parents)  # [B, N]
    for b in range(2):
        for j in range(trees.candidates.shape[1]):
            d = int(depths[b, j])
            expected = q[d, b] if d < 3 else torch.zeros(50)  # q of node j's children; leaves draw none
            torch.testing.assert_close(trees.draft_probs[b, j], expected)
