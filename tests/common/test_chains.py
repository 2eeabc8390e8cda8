"""chains.verify_chains is sampling.verify for chains: the same result on random batches
(greedy with many argmax ties, coupled), and the same distribution proof (chi-square of
the first two tokens against the target, with a negative control that must fail)."""

import pytest
import torch

from specplug.common import sampling as S
from specplug.common.chains import accept_prefix, verify_chains
from specplug.common.randomness import sample_inverse_cdf
from specplug.common.tree import chain_batch
from specplug.common.verify_result import VerifyResult
from tests.common.test_sampling_lossless import ALPHA, ToyModel, lossless_pvalues


def _random_chains(gen, batch: int, k: int, target_rows):
    """num_drafts Long [B] in 0..k and target_rows(R): flat rows [R, V] for them."""
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    rows = target_rows(int((num_drafts + 1).sum()))
    return num_drafts, rows


def _drafts_following(tokens_after: torch.Tensor, num_drafts: torch.Tensor, vocab: int, gen):
    """Chain drafts [sum(num_drafts)] equal to the token after their parent's row 80% of the time."""
    drafts, start = [], 0
    for n in num_drafts.tolist():
        own = tokens_after[start:start + n]  # the token after the root and each draft but the last
        noise = torch.randint(0, vocab, (n,), generator=gen)
        keep = torch.rand(n, generator=gen) < 0.8
        drafts.append(torch.where(keep, own, noise))
        start += n + 1
    return torch.cat(drafts)


def _both(num_drafts, flat_drafts, rows, method, uniforms=None):
    batch = chain_batch(num_drafts.tolist(), flat_drafts)
    expected = S.verify(batch.candidates, batch.parents, rows, method=method, num_nodes=batch.num_nodes,
                        uniforms=uniforms)
    got = verify_chains(batch.candidates[:, 1:], num_drafts, rows, method, uniforms)
    return expected, got


def _assert_equal(expected: VerifyResult, got: VerifyResult):
    assert int(got.num_accepted.max()) >= 2  # the batch exercises long accepted prefixes
    for name in VerifyResult._fields:
        assert torch.equal(getattr(expected, name), getattr(got, name)), name


@pytest.mark.parametrize("seed", range(6))
def test_greedy_equals_verify_with_ties(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 5, 4
    num_drafts, logits = _random_chains(gen, 64, k,
                                        lambda r: torch.randint(0, 3, (r, vocab), generator=gen).float())
    flat = _drafts_following(logits.argmax(-1), num_drafts, vocab, gen)
    _assert_equal(*_both(num_drafts, flat, logits, "greedy"))


@pytest.mark.parametrize("seed", range(6))
def test_coupled_equals_verify(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 7, 5
    num_drafts, probs = _random_chains(gen, 64, k,
                                       lambda r: torch.softmax(torch.randn(r, vocab, generator=gen), -1))
    uniforms = torch.rand(64, k + 2, generator=gen)
    request = torch.arange(64).repeat_interleave(num_drafts + 1)
    depth = torch.arange(probs.shape[0]) - ((num_drafts + 1).cumsum(0) - num_drafts - 1)[request]
    draws = sample_inverse_cdf(probs, uniforms[request, depth])
    flat = _drafts_following(draws, num_drafts, vocab, gen)
    _assert_equal(*_both(num_drafts, flat, probs, "coupled", uniforms))


def test_accept_prefix_with_max_drafts_given_reads_nothing_back():
    """max_drafts (for CUDA graphs) gives what reading num_drafts.max() gives; the width is the one given."""
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, 3, (32, 4), generator=gen)
    num_drafts = torch.randint(0, 5, (32,), generator=gen)
    tokens = torch.randint(0, 3, (32, 5), generator=gen)
    read, given = accept_prefix(drafts, num_drafts, tokens), accept_prefix(drafts, num_drafts, tokens, max_drafts=4)
    assert int(num_drafts.max()) == 4 and int(read.num_accepted.max()) >= 2
    for name in S.VerifyResult._fields:
        assert torch.equal(getattr(read, name), getattr(given, name)), name
    wider = accept_prefix(drafts, num_drafts.clamp(max=2), tokens, max_drafts=4)
    assert wider.accepted_nodes.shape == (32, 5) and int(wider.num_accepted.max()) <= 2


def test_all_without_drafts_emit_the_root_token():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    res = verify_chains(torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long), logits)
    assert res.num_accepted.tolist() == [0, 0] and res.bonus_token.tolist() == [1, 0]
    assert res.accepted_nodes.tolist() == [[0], [0]]


def test_bad_input_is_refused():
    drafts, num = torch.tensor([[1]]), torch.tensor([1])
    with pytest.raises(ValueError, match="NaN"):
        verify_chains(drafts, num, torch.tensor([[0.0, float("nan")], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="sum to 1"):
        verify_chains(drafts, num, torch.full((2, 2), 0.7), "coupled", torch.rand(1, 3))
    with pytest.raises(ValueError, match="rows"):
        verify_chains(drafts, num, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="supports"):
        verify_chains(drafts, num, torch.zeros(2, 2), "rejection")


def _chains_in_place_of_verify(shared_draw: bool = False):
    """S.verify for the lossless harness's chain shapes, answered by verify_chains
    (p [B, N, V] flattened; optionally every depth given the draw of depth 0: wrong)."""
    def verify(cand, parents, p, q=None, *, method, uniforms):
        batch, n = cand.shape
        if shared_draw:
            uniforms = uniforms[:, :1].expand_as(uniforms)
        return verify_chains(cand[:, 1:], torch.full((batch,), n - 1), p.reshape(batch * n, -1), method, uniforms)
    return verify


@pytest.mark.parametrize("shape, temperature, filtered", [("chain1", 1.0, False), ("chain3", 0.5, True),
                                                          ("chain5", 1.5, False)])
def test_coupled_chains_follow_the_target(monkeypatch, shape, temperature, filtered):
    model = ToyModel(16, temperature, filtered, seed=11)
    monkeypatch.setattr(S, "verify", _chains_in_place_of_verify())
    p_first, p_joint = lossless_pvalues(model, shape, False, seed=13, method="coupled")
    assert p_first >= ALPHA and p_joint >= ALPHA, (p_first, p_joint)


def test_negative_control_one_draw_for_every_depth_fails(monkeypatch):
    model = ToyModel(16, 1.0, False, seed=3)
    monkeypatch.setattr(S, "verify", _chains_in_place_of_verify(shared_draw=True))
    p_first, p_joint = lossless_pvalues(model, "chain3", False, seed=5, method="coupled")
    assert p_first >= ALPHA  # the first token alone still follows the target
    assert p_joint < ALPHA  # the first two are correlated through the shared draw
