"""The CUDA kernel returns exactly what the torch reference returns.

Every scenario runs on two backends: ``cuda`` (the built extension on a GPU; marked
``gpu``, skipped without one) and ``emulator`` (the same kernel source compiled for the
CPU with tests/cuda/emu, where CUDA threads are coroutines with real block and warp
barriers; marked ``slow``, needs g++). The emulator checks the kernel's logic in CI;
only the GPU checks the real hardware, memory model and speed.

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

import os
import shutil

import pytest
import torch

from specplug.common import sampling as S
from specplug.common.cuda import dispatch, load_extension, try_verify
from specplug.common.verify_result import VerifyResult
from tests.cuda.cases import dyadic_probs, flatten, plant, random_trees, sample_rows
from tests.cuda.emulate import build_emulator, run_emulated

SCHEDULES = ("rows", "path")
LAYOUTS = ("padded", "flat")
# Problem sizes per backend: (batch, max nodes, seeds); the emulator runs ~1 ms per barrier.
SIZES = {"cuda": (12, 24, 4), "emulator": (5, 10, 1)}


class Backend:
    """Runs the kernel on ``cuda`` or the CPU ``emulator``; results as CPU tensors."""

    def __init__(self, name: str, binary=None):
        self.name, self.binary = name, binary
        self.batch, self.nodes, self.seeds = SIZES[name]

    def __call__(self, cand, par, tgt, drf, *, method, num, uniforms, mode):
        if self.name == "emulator":
            return VerifyResult(*run_emulated(self.binary, cand, par, tgt, drf, method=method, num_nodes=num,
                                              uniforms=uniforms, mode=mode))
        cuda = lambda t: None if t is None else t.cuda()  # noqa: E731
        os.environ[dispatch.MODE_ENV] = mode
        try:
            got = try_verify(cuda(cand), cuda(par), cuda(tgt), cuda(drf), method=method, num_nodes=cuda(num),
                             uniforms=cuda(uniforms))
        finally:
            os.environ.pop(dispatch.MODE_ENV, None)
        assert got is not None, "try_verify declined a supported call"
        return VerifyResult(*(t.cpu() for t in got))


NO_GPU = not torch.cuda.is_available()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")]),
        pytest.param("emulator", marks=[pytest.mark.slow, pytest.mark.skipif(
            shutil.which("g++") is None, reason="the CPU emulator needs g++")]),
    ],
)
def backend(request, tmp_path_factory):
    if request.param == "emulator":
        return Backend("emulator", build_emulator(tmp_path_factory.mktemp("emulator")))
    build = load_extension()
    if build.module is None:  # on a GPU machine a failed build is a failure, not a skip
        pytest.fail(f"the CUDA extension did not build: {build.error}")
    return Backend("cuda")


@pytest.fixture(params=SCHEDULES)
def schedule(request):
    return request.param


def as_layout(x: torch.Tensor, num_nodes: torch.Tensor, layout: str) -> torch.Tensor:
    return flatten(x, num_nodes) if layout == "flat" else x


def run_both(backend, trees, target, draft=None, *, method, uniforms=None, layout="padded", mode="path",
             validate=True):
    """(kernel result, reference result on CPU)."""
    cand, par, num = trees
    tgt = as_layout(target, num, layout)
    drf = None if draft is None else as_layout(draft, num, layout)
    ref = S.verify(cand, par, tgt, drf, method=method, num_nodes=num, uniforms=uniforms, validate=validate)
    return backend(cand, par, tgt, drf, method=method, num=num, uniforms=uniforms, mode=mode), ref


def assert_same(got: VerifyResult, ref: VerifyResult, what: str) -> None:
    for name, g, r in zip(VerifyResult._fields, got, ref):
        assert g.shape == r.shape, f"{what}: {name} shape {tuple(g.shape)} != reference {tuple(r.shape)}"
        bad = (g != r).reshape(g.shape[0], -1).any(-1).nonzero().flatten().tolist()
        assert not bad, f"{what}: {name} differs for requests {bad[:8]}: kernel {g[bad[:2]].tolist()} " \
                        f"reference {r[bad[:2]].tolist()}"


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 32003])
def test_greedy_matches_reference(backend, schedule, layout, dtype, vocab):
    for seed in range(backend.seeds):
        gen = torch.Generator().manual_seed(seed)
        trees = random_trees(gen, backend.batch, backend.nodes, vocab)
        logits = (torch.randn(backend.batch, backend.nodes, vocab, generator=gen) * 3).to(dtype)
        trees = plant(gen, trees, logits.float().argmax(-1), rate=0.7)
        got, ref = run_both(backend, trees, logits, method="greedy", layout=layout, mode=schedule)
        assert_same(got, ref, f"greedy {dtype} V={vocab} {layout} {schedule} seed {seed}")


def test_greedy_ties_take_the_first_index(backend, schedule):
    gen = torch.Generator().manual_seed(7)
    trees = random_trees(gen, backend.batch, 16, 64)
    logits = torch.randint(-2, 3, (backend.batch, 16, 64), generator=gen).float()  # many equal maxima
    trees = plant(gen, trees, logits.argmax(-1), rate=0.8, duplicate_rate=0.3)
    got, ref = run_both(backend, trees, logits, method="greedy", mode=schedule)
    assert_same(got, ref, f"greedy ties {schedule}")


# --------------------------------------------------------------------------- rejection


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 32003])
def test_target_only_matches_reference(backend, schedule, layout, dtype, vocab):
    batch, nodes = backend.batch, backend.nodes
    for seed in range(backend.seeds):
        gen = torch.Generator().manual_seed(100 + seed)
        trees = random_trees(gen, batch, nodes, vocab)
        p = dyadic_probs(torch.randn(batch, nodes, vocab, generator=gen) * 6, dtype)
        trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
        u = torch.rand(batch, nodes + 1, generator=gen)
        got, ref = run_both(backend, trees, p, method="rejection", uniforms=u, layout=layout, mode=schedule)
        assert_same(got, ref, f"target-only {dtype} V={vocab} {layout} {schedule} seed {seed}")


def coupled_tokens(p: torch.Tensor, parents: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Long [B, N]: the "coupled" token after each node, the inverse-CDF draw of its row of
    p [B, N, V] with the uniform of its depth (u [B, N + 1])."""
    from specplug.common.randomness import sample_inverse_cdf
    from specplug.common.tree import tree_depths

    draws = u.gather(1, tree_depths(parents))  # [B, N]
    return sample_inverse_cdf(p.float().flatten(0, 1), draws.flatten()).view(parents.shape)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chain", [True, False], ids=["chains", "trees"])
def test_coupled_matches_reference(backend, layout, dtype, chain):
    """"coupled" (deterministic drafts of sampled requests; vLLM's rule for seeded ones):
    each node's token is the inverse-CDF draw of p after its parent with the uniform of the
    parent's depth. Bit for bit on dyadic probabilities, with most drafts planted on those
    draws so that paths are accepted; negative control: uniforms (u + 0.5) mod 1 (a kernel
    reading the wrong draw) disagree with the reference."""
    vocab, nodes, batch = 5003, backend.nodes, 2 * backend.batch
    control = 0
    for seed in range(backend.seeds):
        gen = torch.Generator().manual_seed(400 + seed)
        trees = random_trees(gen, batch, nodes, vocab, chain=chain)
        p = dyadic_probs(torch.randn(batch, nodes, vocab, generator=gen) * 6, dtype)
        u = torch.rand(batch, nodes + 1, generator=gen)
        trees = plant(gen, trees, coupled_tokens(p, trees.parents, u), rate=0.8)
        got, ref = run_both(backend, trees, p, method="coupled", uniforms=u, layout=layout)
        assert_same(got, ref, f"coupled {dtype} {layout} {'chains' if chain else 'trees'} seed {seed}")
        assert int(ref.num_accepted.sum()) > 0
        wrong, _ = run_both(backend, trees, p, method="coupled", uniforms=(u + 0.5) % 1.0, layout=layout)
        control += int((wrong.bonus_token != ref.bonus_token).logical_or(wrong.num_accepted != ref.num_accepted).sum())
    assert control > 0.3 * backend.seeds * batch, f"negative control: only {control} differ with the wrong uniforms"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_rule_chains_match_reference(backend, layout, dtype):
    """Leviathan on chains: at most one rejection per node, so every sum is exact."""
    vocab, batch = 5003, 2 * backend.batch
    for seed in range(backend.seeds):
        gen = torch.Generator().manual_seed(200 + seed)
        trees = random_trees(gen, batch, 8, vocab, chain=True)
        logits = torch.randn(batch, 8, vocab, generator=gen) * 6
        p = dyadic_probs(logits, dtype)
        q = dyadic_probs(logits + torch.randn(batch, 8, vocab, generator=gen), dtype)
        trees = plant(gen, trees, sample_rows(gen, q), rate=1.0, duplicate_rate=0.0)
        u = torch.rand(batch, 9, generator=gen)
        got, ref = run_both(backend, trees, p, q, method="rejection", uniforms=u, layout=layout)
        assert_same(got, ref, f"draft chains {dtype} {layout} seed {seed}")


def test_draft_rule_trees_agree(backend):
    """SpecInfer trees: identical except where a float32 normaliser's summation order
    can move a draw across a boundary. Sample: 1024 requests on the GPU (4 x 256; 64 on
    the emulator), N = 16, V = 4096. The expected disagreement from that rounding is
    about 1e-5 per request (estimated: a ~1e-7 relative shift of a CDF boundary), so
    allowing 3 disagreements fails a correct kernel with probability < 1e-6. Negative
    control: the same inputs with uniforms (u + 0.5) mod 1 (a kernel reading the wrong
    draw) disagree on > 10% of requests."""
    vocab, nodes = 4096, 16
    batch, rounds = (256, 4) if backend.name == "cuda" else (32, 2)
    differ = control = 0
    for seed in range(rounds):
        gen = torch.Generator().manual_seed(300 + seed)
        trees = random_trees(gen, batch, nodes, vocab)
        logits = torch.randn(batch, nodes, vocab, generator=gen) * 6
        p = dyadic_probs(logits, torch.float32)
        q = dyadic_probs(logits + torch.randn(batch, nodes, vocab, generator=gen), torch.float32)
        trees = plant(gen, trees, sample_rows(gen, q), rate=1.0, duplicate_rate=0.0)
        u = torch.rand(batch, nodes + 1, generator=gen)
        got, ref = run_both(backend, trees, p, q, method="rejection", uniforms=u)
        differ += int((got.bonus_token != ref.bonus_token).logical_or(got.num_accepted != ref.num_accepted).sum())
        wrong, _ = run_both(backend, trees, p, q, method="rejection", uniforms=(u + 0.5) % 1.0)
        control += int((wrong.bonus_token != ref.bonus_token).logical_or(wrong.num_accepted != ref.num_accepted).sum())
    assert differ <= 3, f"{differ} of {rounds * batch} requests differ from the reference"
    assert control > 0.1 * rounds * batch, f"negative control: only {control} differ with the wrong uniforms"


@pytest.mark.parametrize("offset", [1, 3])
def test_misaligned_rows_and_odd_vocab(backend, schedule, offset):
    """Rows that start off a 16-byte boundary (flattened layout, odd vocab) and a tiny vocab."""
    gen = torch.Generator().manual_seed(400 + offset)
    for vocab in (offset + 4, 50257):
        trees = random_trees(gen, backend.batch, 9, vocab)
        logits = torch.randn(backend.batch, 9, vocab, generator=gen) * 6
        p = dyadic_probs(logits, torch.bfloat16)
        trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
        u = torch.rand(backend.batch, 10, generator=gen)
        got, ref = run_both(backend, trees, logits.bfloat16(), method="greedy", layout="flat", mode=schedule)
        assert_same(got, ref, f"greedy V={vocab}")
        got, ref = run_both(backend, trees, p, method="rejection", uniforms=u, layout="flat", mode=schedule)
        assert_same(got, ref, f"target-only V={vocab}")


def test_largest_vocab(backend, schedule):
    vocab = dispatch.MAX_VOCAB
    gen = torch.Generator().manual_seed(12)
    trees = random_trees(gen, 2, 4, vocab)
    p = dyadic_probs(torch.randn(2, 4, vocab, generator=gen) * 6, torch.bfloat16)
    trees = plant(gen, trees, sample_rows(gen, p), rate=0.6)
    u = torch.rand(2, 5, generator=gen)
    got, ref = run_both(backend, trees, p, method="rejection", uniforms=u, mode=schedule)
    assert_same(got, ref, "V = 262144")


# --------------------------------------------------------------------------- hand-made cases
# Deterministic inputs whose answers are known, aimed at what random inputs rarely hit.
# V = 37 makes every row but the first start off a 16-byte boundary.
EDGE_V = 37


def rows(*dists):
    """Probability rows [len(dists), EDGE_V] from {token: probability} dicts."""
    out = torch.zeros(len(dists), EDGE_V)
    for i, d in enumerate(dists):
        for tok, pr in d.items():
            out[i, tok] = pr
    return out


def batch_of(*requests):
    """requests: (tokens, parents, rows [n, V]) -> Trees and target [B, N, V] (padding one-hot at 0)."""
    n = max(len(t) for t, _, _ in requests)
    cand = torch.zeros(len(requests), n, dtype=torch.long)
    par = torch.full((len(requests), n), -1, dtype=torch.long)
    target = torch.zeros(len(requests), n, EDGE_V)
    target[:, :, 0] = 1.0
    for b, (toks, parents, r) in enumerate(requests):
        cand[b, : len(toks)], par[b, : len(toks)], target[b, : len(toks)] = torch.tensor(toks), torch.tensor(
            parents), r
    num = torch.tensor([len(t) for t, _, _ in requests])
    from tests.cuda.cases import Trees
    return Trees(cand, par, num), target


def expect(got, ref, nodes, bonus, what):
    assert_same(got, ref, what)
    for b, (path, tok) in enumerate(zip(nodes, bonus)):
        assert got.accepted_nodes[b, : len(path)].tolist() == path, f"{what}: request {b} path"
        assert int(got.num_accepted[b]) == len(path) - 1 and int(got.bonus_token[b]) == tok, f"{what}: request {b}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_argmax_at_row_edges(backend, schedule, layout):
    """The argmax sits in a row's unaligned head or tail; a single-node tree gives just the bonus."""
    last = EDGE_V - 1
    logits = lambda *tops: rows(*({t: 1.0} for t in tops)) - 1.0  # noqa: E731
    trees, target = batch_of(([5, last, 0], [-1, 0, 1], logits(last, 0, last - 1)), ([9], [-1], logits(last)))
    got, ref = run_both(backend, trees, target, method="greedy", layout=layout, mode=schedule)
    expect(got, ref, [[0, 1, 2], [0]], [last - 1, last], "greedy edges")


def test_target_only_rejections_shrink_the_residual(backend, schedule):
    """Root p = {3: .5, 5: .5}. Children 3 then 5, u = .75 each: 3 is rejected (.75 >= .5),
    then 5 has ratio .5 / (1 - .5) = 1 and is accepted; its one-hot row gives bonus 11.
    With a repeated 3 in between, the repeat has ratio 0 and is rejected."""
    root = {3: 0.5, 5: 0.5}
    trees, target = batch_of(
        ([0, 3, 5], [-1, 0, 0], rows(root, {1: 1.0}, {11: 1.0})),
        ([0, 3, 3, 5], [-1, 0, 0, 0], rows(root, {1: 1.0}, {1: 1.0}, {11: 1.0})),
    )
    u = torch.full((2, 5), 0.75)
    got, ref = run_both(backend, trees, target, method="rejection", uniforms=u, mode=schedule)
    expect(got, ref, [[0, 2], [0, 3]], [11, 11], "target-only residual")


def test_draw_exactly_on_a_cdf_boundary(backend, schedule):
    """p = {2: .25, 7: .25, 9: .5} at a leaf root: u = .25 is exactly cdf[2..6], so the draw
    is the first v with cdf[v] > .25, token 7; u = 0 gives token 2; u = .5 gives 9."""
    trees, target = batch_of(*[([0], [-1], rows({2: 0.25, 7: 0.25, 9: 0.5}))] * 3)
    u = torch.tensor([[0.25, 0.0], [0.0, 0.0], [0.5, 0.0]])
    got, ref = run_both(backend, trees, target, method="rejection", uniforms=u, mode=schedule)
    expect(got, ref, [[0], [0], [0]], [7, 2, 9], "cdf boundary")


def test_draft_rule_normalises_p_first(backend):
    """Unnormalised p = {3: .2, 5: .3} (sum .5; validation off), q = one-hot at 3. With
    u = .3 the child 3 is accepted because .3 * 1 < .2 / .5; without the normalisation it
    would be rejected. Second request: u = .5 rejects it; the residual max(p/.5 - q, 0)
    is one-hot at 5, the recovered token."""
    p = rows({3: 0.2, 5: 0.3}, {13: 1.0})
    q = rows({3: 1.0}, {13: 1.0})
    trees, target = batch_of(([0, 3], [-1, 0], p), ([0, 3], [-1, 0], p))
    _, draft = batch_of(([0, 3], [-1, 0], q), ([0, 3], [-1, 0], q))
    u = torch.tensor([[0.6, 0.3, 0.0], [0.6, 0.5, 0.0]])
    got, ref = run_both(backend, trees, target, draft, method="rejection", uniforms=u, validate=False)
    expect(got, ref, [[0, 1], [0]], [13, 5], "draft normalisation")


# --------------------------------------------------------------------------- GPU plumbing

needs_gpu = pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")


@pytest.mark.gpu
@needs_gpu
def test_sampling_verify_uses_the_kernel_on_cuda(caplog):
    assert load_extension().module is not None, load_extension().error
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
    assert_same(VerifyResult(*(t.cpu() for t in on_gpu)), ref, "sampling.verify on CUDA")


@pytest.mark.gpu
@needs_gpu
def test_beyond_the_limits_falls_back_on_cuda():
    too_big = torch.zeros(1, 1, dispatch.MAX_VOCAB + 1, device="cuda")
    one = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    assert try_verify(one, one - 1, too_big, method="greedy") is None


@pytest.mark.gpu
@needs_gpu
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
