"""The CUDA kernel returns exactly what the torch reference returns (needs a GPU).

Reference: ``specplug.common.sampling.verify`` on CPU copies of the same inputs (its
float32 cumsum accumulates in float64 there, as the kernel does). Random ragged trees,
both layouts ([B, N, V] and flattened), both schedules ("rows" and "path"),
float32 / bfloat16 (greedy also float16, and logits with ties).

Greedy is compared bit for bit on arbitrary logits. The stochastic rules are compared
bit for bit on "dyadic" probabilities (tests/cuda/cases.py): every sum the two
implementations form is then exact in any order, so any difference is a bug, not
rounding. The one exception is the SpecInfer tree rule after two rejections at one
node, whose normaliser is a float32 sum of already-rounded quotients: torch does not
fix that sum's order, so a draw within float32 rounding of a CDF boundary may differ
(measured here as a rate; see test_draft_rule_trees_agree).
"""

from __future__ import annotations

import pytest
import torch

from specplug.common import sampling as S
from specplug.common.cuda import dispatch, load_extension, try_verify
from tests.cuda.cases import dyadic_probs, flatten, plant, random_trees, sample_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False"),
]

SCHEDULES = ("rows", "path")
LAYOUTS = ("padded", "flat")


@pytest.fixture(scope="module", autouse=True)
def built_extension():
    build = load_extension()
    if build.module is None:  # on a GPU machine a failed build is a failure, not a skip
        pytest.fail(f"the CUDA extension did not build: {build.error}")
    return build.module


@pytest.fixture(params=SCHEDULES)
def schedule(request, monkeypatch):
    monkeypatch.setenv(dispatch.MODE_ENV, request.param)
    return request.param


def as_layout(x: torch.Tensor, num_nodes: torch.Tensor, layout: str) -> torch.Tensor:
    return flatten(x, num_nodes) if layout == "flat" else x


def run_both(trees, target, draft=None, *, method, uniforms=None, layout="padded"):
    """(kernel result on CUDA, reference result on CPU), both as CPU tensors."""
    cand, par, num = trees
    tgt = as_layout(target, num, layout)
    drf = None if draft is None else as_layout(draft, num, layout)
    ref = S.verify(cand, par, tgt, drf, method=method, num_nodes=num, uniforms=uniforms)
    cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
    got = try_verify(cuda(cand), cuda(par), cuda(tgt), cuda(drf), method=method, num_nodes=cuda(num),
                     uniforms=cuda(uniforms))
    assert got is not None, "try_verify declined a supported call"
    return S.VerifyResult(*(t.cpu() for t in got)), ref


def assert_same(got: S.VerifyResult, ref: S.VerifyResult, what: str) -> None:
    for name, g, r in zip(S.VerifyResult._fields, got, ref):
        assert g.shape == r.shape, f"{what}: {name} shape {tuple(g.shape)} != reference {tuple(r.shape)}"
        bad = (g != r).reshape(g.shape[0], -1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"{what}: {name} differs for requests {bad[:8]}: kernel {g[bad[:2]].tolist()} " \
                        f"reference {r[bad[:2]].tolist()}"


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 32003])
def test_greedy_matches_reference(schedule, layout, dtype, vocab):
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        trees = random_trees(gen, 12, 24, vocab)
        logits = (torch.randn(12, 24, vocab, generator=gen) * 3).to(dtype)
        trees = plant(gen, trees, logits.float().argmax(-1), rate=0.7)
        got, ref = run_both(trees, logits, method="greedy", layout=layout)
        assert_same(got, ref, f"greedy {dtype} V={vocab} {layout} {schedule} seed {seed}")


def test_greedy_ties_take_the_first_index(schedule):
    gen = torch.Generator().manual_seed(7)
    trees = random_trees(gen, 16, 16, 64)
    logits = torch.randint(-2, 3, (16, 16, 64), generator=gen).float()  # many equal maxima
    trees = plant(gen, trees, logits.argmax(-1), rate=0.8, duplicate_rate=0.3)
    got, ref = run_both(trees, logits, method="greedy")
    assert_same(got, ref, f"greedy ties {schedule}")


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 32003])
def test_target_only_matches_reference(schedule, layout, dtype, vocab):
    for seed in range(4):
        gen = torch.Generator().manual_seed(100 + seed)
        trees = random_trees(gen, 12, 24, vocab)
        p = dyadic_probs(torch.randn(12, 24, vocab, generator=gen) * 6, dtype)
        trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
        u = torch.rand(12, 25, generator=gen)
        got, ref = run_both(trees, p, method="rejection", uniforms=u, layout=layout)
        assert_same(got, ref, f"target-only {dtype} V={vocab} {layout} {schedule} seed {seed}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_rule_chains_match_reference(layout, dtype):
    """Leviathan on chains: at most one rejection per node, so every sum is exact."""
    vocab = 5003
    for seed in range(4):
        gen = torch.Generator().manual_seed(200 + seed)
        trees = random_trees(gen, 16, 8, vocab, chain=True)
        logits = torch.randn(16, 8, vocab, generator=gen) * 6
        p = dyadic_probs(logits, dtype)
        q = dyadic_probs(logits + torch.randn(16, 8, vocab, generator=gen), dtype)
        trees = plant(gen, trees, sample_rows(gen, q), rate=1.0, duplicate_rate=0.0)
        u = torch.rand(16, 9, generator=gen)
        got, ref = run_both(trees, p, q, method="rejection", uniforms=u, layout=layout)
        assert_same(got, ref, f"draft chains {dtype} {layout} seed {seed}")


def test_draft_rule_trees_agree():
    """SpecInfer trees: identical except where a float32 normaliser's summation order
    can move a draw across a boundary. Sample: 1024 requests (4 x 256), N = 16, V = 4096.
    Expected disagreement from that rounding is ~1e-5 per request, so allowing 3
    disagreements fails a correct kernel with probability < 1e-6. Negative control: the
    same inputs with uniforms (u + 0.5) mod 1 (a kernel reading the wrong draw) disagree on > 10%."""
    vocab, batch, nodes = 4096, 256, 16
    differ = control = 0
    for seed in range(4):
        gen = torch.Generator().manual_seed(300 + seed)
        trees = random_trees(gen, batch, nodes, vocab)
        logits = torch.randn(batch, nodes, vocab, generator=gen) * 6
        p = dyadic_probs(logits, torch.float32)
        q = dyadic_probs(logits + torch.randn(batch, nodes, vocab, generator=gen), torch.float32)
        trees = plant(gen, trees, sample_rows(gen, q), rate=1.0, duplicate_rate=0.0)
        u = torch.rand(batch, nodes + 1, generator=gen)
        got, ref = run_both(trees, p, q, method="rejection", uniforms=u)
        differ += int((got.bonus_token != ref.bonus_token).logical_or(got.num_accepted != ref.num_accepted).sum())
        wrong, _ = run_both(trees, p, q, method="rejection", uniforms=(u + 0.5) % 1.0)
        control += int((wrong.bonus_token != ref.bonus_token).logical_or(wrong.num_accepted != ref.num_accepted).sum())
    assert differ <= 3, f"{differ} of {4 * batch} requests differ from the reference"
    assert control > 0.1 * 4 * batch, f"negative control: only {control} differ with the wrong uniforms"


# --------------------------------------------------------------------------- plumbing


def test_sampling_verify_uses_the_kernel_on_cuda(caplog):
    gen = torch.Generator().manual_seed(11)
    trees = random_trees(gen, 8, 12, 777)
    p = dyadic_probs(torch.randn(8, 12, 777, generator=gen) * 6, torch.float32)
    trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
    u = torch.rand(8, 13, generator=gen)
    dispatch._announce.cache_clear()
    with caplog.at_level("INFO", logger="specplug.common.cuda.dispatch"):
        on_gpu = S.verify(*(t.cuda() for t in trees[:2]), p.cuda(), method="rejection",
                          num_nodes=trees.num_nodes.cuda(), uniforms=u.cuda())
    assert any("CUDA kernel path" in r.getMessage() for r in caplog.records)
    ref = S.verify(*trees[:2], p, method="rejection", num_nodes=trees.num_nodes, uniforms=u)
    assert_same(S.VerifyResult(*(t.cpu() for t in on_gpu)), ref, "sampling.verify on CUDA")


def test_largest_vocab_and_beyond():
    vocab = dispatch.MAX_VOCAB
    gen = torch.Generator().manual_seed(12)
    trees = random_trees(gen, 2, 4, vocab)
    p = dyadic_probs(torch.randn(2, 4, vocab, generator=gen) * 6, torch.bfloat16)
    trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
    u = torch.rand(2, 5, generator=gen)
    got, ref = run_both(trees, p, method="rejection", uniforms=u)
    assert_same(got, ref, "V = 262144")
    too_big = torch.zeros(1, 1, vocab + 1, device="cuda")
    one = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    assert try_verify(one, one - 1, too_big, method="greedy") is None


def test_results_are_reproducible_and_fully_written():
    """Same inputs twice give the same result; every request's output is written."""
    gen = torch.Generator().manual_seed(13)
    trees = random_trees(gen, 64, 32, 4099)
    logits = torch.randn(64, 32, 4099, generator=gen)
    cuda = [t.cuda() for t in trees]
    first = try_verify(cuda[0], cuda[1], logits.cuda(), method="greedy", num_nodes=cuda[2])
    second = try_verify(cuda[0], cuda[1], logits.cuda(), method="greedy", num_nodes=cuda[2])
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert bool((first.num_accepted >= 0).all()) and bool((first.num_accepted < cuda[2]).all())
    assert bool((first.bonus_token >= 0).all()) and bool((first.bonus_token < 4099).all())
