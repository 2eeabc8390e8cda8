"""Statistical proof that the rejection samplers are lossless.

Set-up: a toy "language model" whose next-token distribution depends on the previous
token and the output index, ``P[index, prev]`` (target, after temperature / top-k /
top-p through process_logits) and ``Q[index, prev]`` (drafter, unfiltered). Each test
runs ONE batched verify over B = 100,000 independent requests that share a tree shape
and root token, and compares the empirical distribution of

* the first emitted token with P[0, root], and
* the first two emitted tokens jointly with P[0, root][x1] * P[1, x1][x2]; when a row
  accepts no draft token its second token comes from a second verify step rooted at
  x1 (exactly what an engine does next).

Rules covered: coupled (deterministic drafting, the target's inverse-CDF sample per
depth matched against the children; tests/common/test_sampling_coupled.py adds its
reproducibility), target-only (deterministic drafting: children are the drafter's top
ranks; chains 1..5 and trees, one with a duplicated sibling token) and draft-probs
(children drawn i.i.d. from Q: Leviathan on chains, SpecInfer on trees). Vocab 8-32,
temperature 0.5 / 1 / 1.5, with and without top-k + top-p.

Thresholds and false-failure chance. Chi-square goodness of fit (cells with expected
count < 5 merged into one) fails when p < ALPHA = 1e-5; the suite runs < 50 such tests
on correct samplers (16 configurations x 2, plus controls), so a correct
implementation fails somewhere with chance < 0.1 % per fresh seed (seeds are fixed, so the outcome is reproducible).
Tokens with zero target probability must never appear (exact check).
TV shrinks like 1/sqrt(n): TV(n) <= 3 * Bn with Bn = 1/2 sum_x sqrt(p(x)(1 - p(x)) / n)
>= E[TV]; TV moves by at most 1/n per sample, so by McDiarmid a correct sampler
breaks this with chance <= exp(-8 n Bn^2), printed and asserted < 1e-3 per check.
Negative controls: the same checks must FAIL for two deliberately wrong samplers
(no zeroing of rejected tokens in the residual; accept with p/q but no residual).
"""

import math
import zlib

import pytest
import torch
from scipy import stats

from specplug.common import sampling as S
from specplug.common.static_trees import from_choices
from specplug.common.target_probs import process_logits
from specplug.common.tree import tree_depths

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLES = 100_000
ALPHA = 1e-5
MAX_INDEX = 8  # output indices the toy model covers (depth 5 + second step)

# shape name -> (parents, sibling rank used by deterministic drafting)
SHAPES = {f"chain{k}": (list(range(-1, k)), [0] * (k + 1)) for k in range(1, 6)}
_medusa = from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
SHAPES["medusa7"] = (_medusa.parents.tolist(), _medusa.tokens.tolist())
SHAPES["binary"] = ([-1, 0, 0, 1, 1, 2, 2], [0, 0, 1, 0, 1, 0, 1])
SHAPES["dup_sibling"] = ([-1, 0, 0, 0, 1, 3], [0, 0, 1, 0, 0, 1])  # node 3 repeats node 1's token
TEMPERATURES = (0.5, 1.0, 1.5)
# rule -> verify method: target-only and draft-probs rejection, and the coupled rule
# (deterministic drafts, the target's own inverse-CDF sample matched against them)
RULES = {"target_only": "rejection", "draft_probs": "rejection", "coupled": "coupled"}
VOCABS = (8, 16, 32)


class ToyModel:
    """Target P and drafter Q: Float [MAX_INDEX, V, V], row [index, prev] = next-token dist."""

    def __init__(self, vocab: int, temperature: float, filtered: bool, seed: int):
        g = torch.Generator().manual_seed(seed)
        logits = 1.0 * torch.randn(MAX_INDEX, vocab, vocab, generator=g)
        top_k, top_p = (vocab // 2, 0.9) if filtered else (0, 1.0)
        self.P = process_logits(logits.view(-1, vocab), temperature, top_k, top_p).view(logits.shape)
        draft_logits = 0.7 * logits + 1.5 * torch.randn(logits.shape, generator=g)
        self.Q = torch.softmax(draft_logits, -1)
        self.draft_order = draft_logits.argsort(-1, descending=True)  # deterministic drafter's ranking
        self.vocab = vocab


def draft_step(model: ToyModel, roots, offset, shape, iid, gen):
    """Build B trees of ``shape`` rooted at ``roots`` [B]; returns candidates, parents, p, q."""
    parents_list, ranks = SHAPES[shape]
    parents = torch.tensor(parents_list)
    depth = tree_depths(parents).tolist()
    bsz, n = roots.shape[0], len(parents_list)
    cand = torch.empty(bsz, n, dtype=torch.long)
    cand[:, 0] = roots
    for j in range(1, n):
        prev, index = cand[:, parents_list[j]], offset + depth[parents_list[j]]
        if iid:  # draw the child from Q[index, prev] by inverse CDF
            cdf = model.Q[index, prev].cumsum(-1)
            u = torch.rand(bsz, 1, generator=gen) * cdf[:, -1:]
            cand[:, j] = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=model.vocab - 1)
        else:
            cand[:, j] = model.draft_order[index, prev, ranks[j]]
    index = [offset + d for d in depth]
    p = torch.stack([model.P[index[j], cand[:, j]] for j in range(n)], 1)  # [B, N, V]
    q = torch.stack([model.Q[index[j], cand[:, j]] for j in range(n)], 1) if iid else None
    return cand, parents.expand(bsz, n), p, q


def first_two_tokens(model, shape, iid, seed, root=0, method="rejection"):
    """Long [B, 2]: the first two emitted tokens of B independent requests."""
    gen = torch.Generator().manual_seed(seed)
    roots = torch.full((SAMPLES,), root, dtype=torch.long)
    cand, parents, p, q = draft_step(model, roots, 0, shape, iid, gen)
    res = S.verify(cand, parents, p, q, method=method, uniforms=torch.rand(SAMPLES, cand.shape[1] + 1, generator=gen))
    out = res.output_tokens(cand)[:, :2].clone()
    short = res.num_accepted == 0  # emitted one token: the next verify step supplies the second
    if not bool(short.any()):
        return out
    cand2, parents2, p2, q2 = draft_step(model, out[short, 0], 1, shape, iid, gen)
    u2 = torch.rand(cand2.shape[0], cand2.shape[1] + 1, generator=gen)
    res2 = S.verify(cand2, parents2, p2, q2, method=method, uniforms=u2)
    out[short, 1] = res2.output_tokens(cand2)[:, 0]
    return out


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of integer samples to ``probs``; 0.0 if a zero-probability cell occurs."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double().flatten() * samples.numel()
    if bool((counts[expected == 0] > 0).any()):
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    if int(keep.sum()) < 2:
        return 1.0  # one possible outcome, and no sample fell outside it
    exp = exp[keep] * obs.sum() / exp[keep].sum()  # float rounding only
    return float(stats.chisquare(obs[keep].numpy(), exp.numpy()).pvalue)


def lossless_pvalues(model, shape, iid, seed, root=0, method="rejection"):
    out = first_two_tokens(model, shape, iid, seed, root, method)
    p1 = model.P[0, root]  # [V]
    joint = p1.unsqueeze(1) * model.P[1]  # [V, V]: x1, x2
    return (
        chi_square_pvalue(out[:, 0], p1),
        chi_square_pvalue(out[:, 0] * model.vocab + out[:, 1], joint),
    )


def configs():
    """Each rule runs every shape once; (temperature, filter) pairs and vocabs cycle so
    that each rule sees all six (temperature, filter) pairs and all three vocabs."""
    pairs = [(t, f) for t in TEMPERATURES for f in (False, True)]
    out = []
    for rule in RULES:
        for s, shape in enumerate(SHAPES):
            temp, filtered = pairs[(s + list(RULES).index(rule)) % len(pairs)]
            vocab = VOCABS[s % len(VOCABS)]
            tag = f"{rule}-{shape}-T{temp}-V{vocab}-{'topk_topp' if filtered else 'nofilter'}"
            out.append(pytest.param(rule, shape, temp, vocab, filtered, id=tag))
    return out




@pytest.mark.parametrize("rule, shape, temperature, vocab, filtered", configs())
def test_first_and_first_two_tokens_follow_the_target(rule, shape, temperature, vocab, filtered):
    seed = zlib.crc32(f"{rule}-{shape}-{temperature}-{vocab}".encode()) % 10_000  # fixed across runs
    model = ToyModel(vocab, temperature, filtered, seed)
    p_first, p_joint = lossless_pvalues(model, shape, rule == "draft_probs", seed, method=RULES[rule])
    assert p_first >= ALPHA, f"first token: chi-square p = {p_first:.3g} < {ALPHA}"
    assert p_joint >= ALPHA, f"first two tokens: chi-square p = {p_joint:.3g} < {ALPHA}"


def test_the_configs_cover_the_grid():
    params = [p.values for p in configs()]
    for rule in RULES:
        mine = [p for p in params if p[0] == rule]
        assert {(p[2], p[4]) for p in mine} == {(t, f) for t in TEMPERATURES for f in (False, True)}
        assert {p[3] for p in mine} == set(VOCABS) and {p[1] for p in mine} == set(SHAPES)


# --------------------------------------------------------------------------- TV ~ 1/sqrt(n)


def tv_checks(first: torch.Tensor, p1: torch.Tensor):
    """[(n, TV(n), 3 * Bn, McDiarmid false-failure bound)] for n = 1e3, 1e4, 1e5."""
    rows = []
    for n in (1_000, 10_000, 100_000):
        emp = torch.bincount(first[:n], minlength=p1.numel()).double() / n
        tv = 0.5 * float((emp - p1.double()).abs().sum())
        bn = 0.5 * float((p1.double() * (1 - p1.double()) / n).sqrt().sum())
        rows.append((n, tv, 3 * bn, math.exp(-8 * n * bn * bn)))
    return rows


@pytest.mark.parametrize("rule, shape",
                         [("target_only", "medusa7"), ("draft_probs", "chain3"), ("draft_probs", "binary")])
def test_total_variation_shrinks_like_one_over_sqrt_n(rule, shape):
    model = ToyModel(16, 1.0, False, seed=7)
    first = first_two_tokens(model, shape, rule == "draft_probs", seed=11)[:, 0]
    for n, tv, bound, chance in tv_checks(first, model.P[0, 0]):
        assert chance < 1e-3, f"bound too weak to test at n={n}: false-failure chance {chance:.2g}"
        assert tv <= bound, f"TV({n}) = {tv:.4f} > 3 * Bn = {bound:.4f}"


# --------------------------------------------------------------------------- negative controls


def _no_zeroing(p, tree, final):
    return p.rows(final)  # bug: rejected children keep their mass in the final distribution


def _no_residual(p_res, q):
    return p_res  # bug: accept with p/q, on rejection resample from p (no max(0, p - q))


@pytest.mark.parametrize(
    "rule, shape, patch",
    [
        ("target_only", "chain1", ("_target_only_final", _no_zeroing)),
        ("target_only", "medusa7", ("_target_only_final", _no_zeroing)),
        ("draft_probs", "chain1", ("_specinfer_residual", _no_residual)),
        ("draft_probs", "binary", ("_specinfer_residual", _no_residual)),
    ],
)
def test_negative_control_wrong_samplers_fail(monkeypatch, rule, shape, patch):
    model = ToyModel(16, 1.0, False, seed=3)
    iid = rule == "draft_probs"
    assert min(lossless_pvalues(model, shape, iid, seed=5)) >= ALPHA  # the correct sampler passes
    monkeypatch.setattr(S, *patch)
    p_first, p_joint = lossless_pvalues(model, shape, iid, seed=5)
    assert p_first < ALPHA and p_joint < ALPHA
    first = first_two_tokens(model, shape, iid, seed=5)[:, 0]
    n, tv, bound, _ = tv_checks(first, model.P[0, 0])[-1]
    assert tv > bound, f"wrong sampler: TV({n}) = {tv:.4f} should exceed {bound:.4f}"
