"""The coupled rule's two promises beyond losslessness (tested in test_sampling_lossless):
with position_uniforms a seeded request's output does not depend on what was drafted,
and position_uniforms is the stated hash, uniform on [0, 1).

Negative control: a coupled sampler that reuses one draw for every depth keeps the
first token's distribution but breaks the joint of the first two (chi-square fails)."""

import pytest
import torch
from scipy import stats

from specplug.common import sampling as S
from specplug.common.randomness import position_uniforms
from tests.common.test_sampling_lossless import ALPHA, ToyModel, lossless_pvalues

MASK = (1 << 64) - 1


def splitmix_reference(seed: int, t: int) -> float:
    """Pure-Python splitmix64 of (seed, t), exact modulo 2**64."""
    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)
    z = mix((mix(seed & MASK) + (t + 1) * 0x9E3779B97F4A7C15) & MASK)
    return (z >> 40) * 2.0 ** -24


def test_position_uniforms_are_the_stated_hash_and_uniform():
    seeds = torch.tensor([0, 1, 12345, 2**40 + 7])
    positions = torch.tensor([0, 5, 1000, 3])
    u = position_uniforms(seeds, positions, 4)
    for b in range(4):
        for d in range(4):
            assert u[b, d].item() == splitmix_reference(int(seeds[b]), int(positions[b]) + d)
    many = position_uniforms(torch.arange(1000), torch.zeros(1000, dtype=torch.long), 100).flatten()
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert stats.kstest(many.numpy(), "uniform").pvalue > ALPHA
    # shifting the position by one shifts the columns: the draw belongs to the position
    assert torch.equal(position_uniforms(seeds, positions + 1, 3), u[:, 1:])


def _decode(P: torch.Tensor, seed: int, steps: int, draft_tree, gen) -> list[int]:
    """Emitted tokens of one request under P[prev] -> next (Float [V, V]) with the coupled
    rule and position draws; draft_tree(prev, gen) -> (candidates, parents) per step."""
    out = [0]
    while len(out) < steps:
        cand, parents = draft_tree(out[-1], gen)
        p = P[cand].unsqueeze(0)  # [1, N, V]: the row after each node is P[its token]
        u = position_uniforms(torch.tensor([seed]), torch.tensor([len(out)]), cand.shape[0] + 1)
        res = S.verify(cand[None], parents[None], p, method="coupled", uniforms=u)
        emitted = res.output_tokens(cand[None])[0]
        out += [int(t) for t in emitted if t >= 0]
    return out[:steps]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_output_does_not_depend_on_the_drafts(seed):
    vocab = 6
    P = torch.softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)), -1)

    def no_drafts(prev, gen):
        return torch.tensor([prev]), torch.tensor([-1])

    def random_chain(prev, gen):
        k = int(torch.randint(1, 5, (1,), generator=gen))
        return torch.cat([torch.tensor([prev]), torch.randint(0, vocab, (k,), generator=gen)]), torch.arange(-1, k)

    def random_tree(prev, gen):
        parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
        return torch.cat([torch.tensor([prev]), torch.randint(0, vocab, (6,), generator=gen)]), parents

    def good_chain(prev, gen):  # the target's likeliest continuation: many acceptances
        toks = [prev]
        for _ in range(4):
            toks.append(int(P[toks[-1]].argmax()))
        return torch.tensor(toks), torch.arange(-1, 4)

    runs = [_decode(P, seed, 60, f, torch.Generator().manual_seed(9))
            for f in (no_drafts, random_chain, random_tree, good_chain)]
    assert all(r == runs[0] for r in runs[1:])
    other_seed = _decode(P, seed + 100, 60, no_drafts, torch.Generator())
    assert other_seed != runs[0]


def test_coupled_refuses_draft_probabilities():
    cand, parents = torch.tensor([[0, 1]]), torch.tensor([[-1, 0]])
    p = torch.full((1, 2, 4), 0.25)
    with pytest.raises(ValueError, match="deterministic drafting"):
        S.verify(cand, parents, p, p, method="coupled")


def _one_draw_for_all_depths(p, tree, uniforms):
    return _correct_coupled(p, tree, uniforms[:, :1].expand_as(uniforms))


_correct_coupled = S._verify_coupled


def test_negative_control_one_draw_for_every_depth_fails(monkeypatch):
    model = ToyModel(16, 1.0, False, seed=3)
    assert min(lossless_pvalues(model, "chain3", False, seed=5, method="coupled")) >= ALPHA
    monkeypatch.setattr(S, "_verify_coupled", _one_draw_for_all_depths)
    p_first, p_joint = lossless_pvalues(model, "chain3", False, seed=5, method="coupled")
    assert p_first >= ALPHA  # the first token alone still follows the target
    assert p_joint < ALPHA  # but the first two are correlated through the shared draw
