"""verify_step: each request verified by its own rule, from logits.

Distribution (the harness of test_sampling_lossless: its toy model, draft_step and
chi-square): verify_step gets the toy model's LOGITS and each request's settings, and the
first emitted token and the first two jointly must follow the target P (after
temperature / top-k / top-p) for every rule: coupled with (seed, position) draws (each of
the B = 100,000 requests its own seed), coupled with draws from a generator, block
verification (chains drafted from q), rejection with q (trees, children drawn i.i.d. from
q), and a seeded request whose drafts were drawn from q (coupled, q unused); greedy
requests must emit the argmax path exactly. Sample size 100,000 per configuration;
chi-square (cells with expected count < 5 merged) fails at p < ALPHA = 1e-5; 20 such
checks on correct code fail somewhere with chance < 2e-4.
Negative controls: the same checks FAIL when the seeded draws ignore the depth (one draw
for both tokens of a step) and when rejection with q skips the residual.

Rule choice: in a mixed batch (greedy, seeded, unseeded, drafts from q, trees and
chains, flat and padded layouts) every request's result equals sampling.verify with its
rule on that request alone (block_verify.verify_block for an unseeded chain drafted from
q); a seeded request's result does not depend on its batch companions or on the
generator.
"""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from specplug.common import sampling as S
from specplug.common import verify_step as V
from specplug.common.block_verify import verify_block
from specplug.common.randomness import position_uniforms
from specplug.common.target_probs import process_logits
from specplug.common.tree import DraftTree, is_chain, stack_trees
from specplug.common.verify_result import VerifyResult
from specplug.common.verify_step import RequestSampling, choose_rule, step_uniforms, verify_step
from tests.common.test_sampling_lossless import ALPHA, MAX_INDEX, SAMPLES, ToyModel, chi_square_pvalue, draft_step

pytestmark = pytest.mark.usefixtures("one_thread")

POSITION = 7  # the first step's position (tokens held); the second step's is POSITION + 1


# --------------------------------------------------------------------------- the rule table


def test_rule_table():
    greedy, sampled, seeded = RequestSampling(temperature=0.0), RequestSampling(0.8), RequestSampling(0.8, seed=3)
    assert [choose_rule(greedy, q) for q in (False, True)] == ["greedy", "greedy"]
    assert [choose_rule(sampled, q) for q in (False, True)] == ["coupled", "rejection"]
    assert [choose_rule(sampled, q, chain=True) for q in (False, True)] == ["coupled", "block"]
    assert [choose_rule(seeded, q, chain=c) for q in (False, True) for c in (False, True)] == ["coupled"] * 4
    assert choose_rule(greedy, True, chain=True) == "greedy"
    assert choose_rule(sampled, True, typical=True, chain=True) == "typical"
    assert {choose_rule(p, q, typical=True) for p in (sampled, seeded) for q in (False, True)} == {"typical"}
    assert choose_rule(greedy, True, typical=True) == "greedy"
    assert seeded.method == "coupled" and greedy.method == "greedy"


@pytest.mark.parametrize("kw, match", [(dict(min_p=1.5), "min_p"), (dict(order="hf"), "order"),
                                       (dict(position=-1), "position"), (dict(seed=1.5), "seed"),
                                       (dict(temperature=-1.0), "temperature")])
def test_request_sampling_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        RequestSampling(**kw)


# --------------------------------------------------------------------------- distribution


class StepModel(ToyModel):
    """ToyModel plus the logits its P came from and the settings that made P from them."""

    def __init__(self, vocab: int, temperature: float, filtered: bool, seed: int):
        super().__init__(vocab, temperature, filtered, seed)
        self.logits = torch.randn(MAX_INDEX, vocab, vocab, generator=torch.Generator().manual_seed(seed))  # as ToyModel
        self.settings = dict(temperature=temperature, top_k=vocab // 2 if filtered else 0,
                             top_p=0.9 if filtered else 1.0)
        assert torch.allclose(process_logits(self.logits.view(-1, vocab), **self.settings).view(self.P.shape), self.P)
        self.as_logits = SimpleNamespace(P=self.logits, Q=self.Q, draft_order=self.draft_order, vocab=vocab)


def _step(model, roots, offset, shape, iid, gen, params, flat):
    """One verify_step over len(roots) requests rooted at `roots`; emitted tokens [B, D + 1]."""
    cand, parents, logits, q = draft_step(model.as_logits, roots, offset, shape, iid, gen)
    if flat:
        logits = logits.reshape(-1, model.vocab)
        q = None if q is None else q.reshape(-1, model.vocab)
    res = verify_step(logits, cand, parents, None, params, draft_probs=q, generator=gen)
    return res.output_tokens(cand), res.num_accepted


def step_first_two(model, shape, iid, seed, seeded, flat):
    """Long [SAMPLES, 2]: the first two emitted tokens of SAMPLES requests (request b seeded
    with 10 * seed + b when `seeded`); a request that accepted no draft gets its second
    token from a second step rooted at its first, one position further."""
    gen = torch.Generator().manual_seed(seed)
    params = [RequestSampling(**model.settings, seed=10 * seed + b if seeded else None, position=POSITION)
              for b in range(SAMPLES)]
    roots = torch.zeros(SAMPLES, dtype=torch.long)
    out, num_accepted = _step(model, roots, 0, shape, iid, gen, params, flat)
    out = out[:, :2].clone()
    short = (num_accepted == 0).nonzero().squeeze(1)
    if short.numel():
        later = [dataclasses.replace(params[b], position=POSITION + 1) for b in short.tolist()]
        out[short, 1] = _step(model, out[short, 0], 1, shape, iid, gen, later, flat)[0][:, 0]
    return out


def step_pvalues(model, shape, iid, seed, seeded, flat):
    out = step_first_two(model, shape, iid, seed, seeded, flat)
    p1 = model.P[0, 0]
    joint = p1.unsqueeze(1) * model.P[1]
    return chi_square_pvalue(out[:, 0], p1), chi_square_pvalue(out[:, 0] * model.vocab + out[:, 1], joint)


CASES = {  # name -> (shape, drafts drawn from q, seeded, flat layout, temperature, top-k + top-p)
    "coupled-seeded-chain3-flat": ("chain3", False, True, True, 0.8, False),
    "coupled-seeded-medusa7": ("medusa7", False, True, False, 1.0, True),
    "coupled-seeded-dup_sibling": ("dup_sibling", False, True, False, 1.5, False),
    "coupled-unseeded-chain2-flat": ("chain2", False, False, True, 1.0, True),
    "coupled-unseeded-binary": ("binary", False, False, False, 0.5, False),
    "block-q-chain3-flat": ("chain3", True, False, True, 1.0, False),
    "block-q-chain2": ("chain2", True, False, False, 0.8, True),
    "rejection-q-binary": ("binary", True, False, False, 0.8, True),
    "seeded-with-q-binary": ("binary", True, True, False, 1.0, False),
    "seeded-with-q-chain2-flat": ("chain2", True, True, True, 0.8, True),
}




@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_follows_the_target(case):
    shape, iid, seeded, flat, temperature, filtered = CASES[case]
    seed = sum(map(ord, case)) % 1000
    model = StepModel(16, temperature, filtered, seed)
    p_first, p_joint = step_pvalues(model, shape, iid, seed, seeded, flat)
    assert p_first >= ALPHA, f"first token: chi-square p = {p_first:.3g} < {ALPHA}"
    assert p_joint >= ALPHA, f"first two tokens: chi-square p = {p_joint:.3g} < {ALPHA}"


@pytest.mark.parametrize("shape, flat", [("chain3", True), ("medusa7", False)])
def test_greedy_requests_emit_the_argmax_path(shape, flat):
    model = StepModel(16, 1.0, False, seed=4)
    model.settings = dict(temperature=0.0)
    out = step_first_two(model, shape, False, seed=4, seeded=False, flat=flat)
    first = int(model.logits[0, 0].argmax())
    assert (out[:, 0] == first).all() and (out[:, 1] == int(model.logits[1, first].argmax())).all()


def _one_draw_per_step(seeds, positions, width):
    return _position_uniforms(seeds, positions, 1).expand(-1, width)  # wrong: every depth the same draw


_position_uniforms = position_uniforms


def test_negative_control_seeded_draws_that_ignore_the_depth_fail(monkeypatch):
    model = StepModel(16, 1.0, False, seed=3)
    assert min(step_pvalues(model, "chain3", False, 5, True, True)) >= ALPHA  # the correct step passes
    monkeypatch.setattr(V, "position_uniforms", _one_draw_per_step)
    p_first, p_joint = step_pvalues(model, "chain3", False, 5, True, True)
    assert p_first >= ALPHA  # the first token alone still follows the target
    assert p_joint < ALPHA  # the first two are correlated through the shared draw


def test_negative_control_rejection_without_residual_fails(monkeypatch):
    model = StepModel(16, 1.0, False, seed=3)
    assert min(step_pvalues(model, "binary", True, 5, False, False)) >= ALPHA
    monkeypatch.setattr(S, "_specinfer_residual", lambda p_res, q: p_res)
    assert max(step_pvalues(model, "binary", True, 5, False, False)) < ALPHA


# --------------------------------------------------------------------------- rule choice in a mixed batch


VOCAB = 12


def _mixed_batch(rng: random.Random, chains: bool):
    """(trees, logits Float [sum(num_nodes), V], params, q {row: Float [n, V]}) of 8
    requests: greedy, seeded, unseeded, drafts from q (seeded and not), min-p, top-k."""
    settings = [dict(temperature=0.0), dict(temperature=0.9, seed=11), dict(temperature=1.2),
                dict(temperature=0.7, top_k=5), dict(temperature=1.0, min_p=0.1, seed=2**63 + 5),
                dict(temperature=0.0), dict(temperature=0.8, top_p=0.8), dict(temperature=1.1, seed=7)]
    drawn = {3, 5, 6, 7}  # rows whose drafts were drawn from q: unseeded, greedy, unseeded, seeded
    trees = []
    for b in range(len(settings)):
        n = rng.randint(1, 6)
        parents = list(range(-1, n - 1)) if chains else [-1] + [rng.randrange(i) for i in range(1, n)]
        trees.append(DraftTree(torch.tensor([rng.randrange(VOCAB) for _ in range(n)]), torch.tensor(parents)))
    batch = stack_trees(trees)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = 2 * torch.randn(int(batch.num_nodes.sum()), VOCAB, generator=gen)
    q = {b: torch.softmax(torch.randn(int(batch.num_nodes[b]) - 1, VOCAB, generator=gen), -1) for b in drawn}
    params = [RequestSampling(**s, position=rng.randrange(100), order=rng.choice(["vllm", "sglang"]))
              for s in settings]
    return batch, logits, params, q


def _rows(flat: torch.Tensor, num_nodes: torch.Tensor, b: int) -> torch.Tensor:
    start = int(num_nodes[:b].sum())
    return flat[start:start + int(num_nodes[b])]


def _alone(batch, logits, params, q, uniforms, b):
    """Request b verified alone with the rule the table gives it: sampling.verify, or
    verify_block for "block"."""
    rows, sp = _rows(logits, batch.num_nodes, b), params[b]
    cand, parents, n = batch.candidates[b:b + 1], batch.parents[b:b + 1], batch.num_nodes[b:b + 1]
    rule = choose_rule(sp, b in q, chain=is_chain(parents[0, :int(n)]))
    if rule == "greedy":
        return S.verify(cand, parents, rows, method="greedy", num_nodes=n)
    p = process_logits(rows, sp.temperature, sp.top_k, sp.top_p, sp.min_p, order=sp.order)
    q_b = torch.cat([q[b], torch.zeros(1, VOCAB)]) if rule in ("block", "rejection") else None
    if rule == "block":
        return verify_block(cand[:, 1:int(n)], n - 1, p, q_b, uniforms[b:b + 1])
    return S.verify(cand, parents, p, q_b, method=rule, num_nodes=n, uniforms=uniforms[b:b + 1])


def _assert_row(result, alone, b):
    got = result.accepted_nodes[b]
    width = alone.accepted_nodes.shape[1]
    assert torch.equal(got[:width], alone.accepted_nodes[0]) and bool((got[width:] == -1).all()), b
    assert int(result.num_accepted[b]) == int(alone.num_accepted[0]), b
    assert int(result.bonus_token[b]) == int(alone.bonus_token[0]), b


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("chains", [False, True])
def test_every_request_gets_its_own_rule(seed, chains):
    batch, logits, params, q = _mixed_batch(random.Random(seed), chains)
    uniforms = step_uniforms(params, batch.candidates.shape[1] + 1, torch.Generator().manual_seed(seed))
    result = verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=q,
                         generator=torch.Generator().manual_seed(seed))
    for b in range(len(params)):
        _assert_row(result, _alone(batch, logits, params, q, uniforms, b), b)


def test_padded_layout_gives_the_flat_result():
    batch, logits, params, q = _mixed_batch(random.Random(5), chains=False)
    n = batch.candidates.shape[1]
    padded = torch.zeros(len(params), n, VOCAB)
    padded_q = {}
    for b in range(len(params)):
        padded[b, :int(batch.num_nodes[b])] = _rows(logits, batch.num_nodes, b)
        if b in q:
            padded_q[b] = torch.cat([q[b], torch.zeros(n - q[b].shape[0], VOCAB)])
    flat = verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=q,
                       generator=torch.Generator().manual_seed(1))
    pad = verify_step(padded, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=padded_q,
                      generator=torch.Generator().manual_seed(1))
    for name in VerifyResult._fields:
        assert torch.equal(getattr(flat, name), getattr(pad, name)), name


def test_chains_take_the_chain_fast_path(monkeypatch):
    calls = []
    real = V.verify_chains
    monkeypatch.setattr(V, "verify_chains", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    for chains in (True, False):
        batch, logits, params, _ = _mixed_batch(random.Random(3), chains)
        verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params)
        greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
        verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, greedy)
    assert calls == ["coupled", "greedy"]  # the trees went through sampling.verify


def test_chains_go_to_the_cuda_kernel_where_it_runs(monkeypatch):
    """Where the fused kernel takes the logits' device (dispatch.kernel_ready: CUDA, built),
    greedy and coupled chains go through sampling.verify, which offers them to the kernel
    (tests/cuda/test_parity.py proves its greedy and coupled walks against the torch
    reference), without value checks, as on the chain path; the result is the same."""
    batch, logits, params, _ = _mixed_batch(random.Random(3), chains=True)
    greedy = [dataclasses.replace(p, temperature=0.0) for p in params]
    expected = [verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, ps,
                            generator=torch.Generator().manual_seed(2)) for ps in (params, greedy)]
    verified, real_verify = [], V.verify
    monkeypatch.setattr(V, "kernel_ready", lambda tensor: True)
    monkeypatch.setattr(V, "verify_chains", lambda *a, **k: pytest.fail("the chain path ran beside the kernel"))
    monkeypatch.setattr(V, "verify", lambda *a, **k: verified.append((k["method"], k["validate"])) or
                        real_verify(*a, **k))
    got = [verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, ps,
                       generator=torch.Generator().manual_seed(2)) for ps in (params, greedy)]
    assert ("coupled", False) in verified and verified[-1] == ("greedy", False)
    for g, e in zip(got, expected):
        for name in VerifyResult._fields:
            assert torch.equal(getattr(g, name), getattr(e, name)), name


def test_unseeded_chains_drafted_from_q_take_block_verification(monkeypatch):
    """Chains (a lone root too) of unseeded sampled requests with q go to verify_block, in
    one call; trees with q stay with sampling.verify's rejection; seeded rows stay coupled."""
    block_rows, rejection_rows, real_block, real_verify = [], [], V.verify_block, V.verify
    monkeypatch.setattr(V, "verify_block", lambda *a, **k: block_rows.append(a[0].shape[0]) or real_block(*a, **k))
    monkeypatch.setattr(V, "verify", lambda *a, method, **k: (rejection_rows.append(a[0].shape[0])
                                                               if method == "rejection" else None)
                        or real_verify(*a, method=method, **k))
    trees = [DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1])),  # unseeded chain with q: block
             DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0])),  # unseeded tree with q: rejection
             DraftTree(torch.tensor([4]), torch.tensor([-1])),  # unseeded lone root with q: block
             DraftTree(torch.tensor([1, 5, 6, 7]), torch.tensor([-1, 0, 1, 2])),  # seeded chain with q: coupled
             DraftTree(torch.tensor([1, 5]), torch.tensor([-1, 0]))]  # unseeded chain, no q: coupled
    batch = stack_trees(trees)
    params = [RequestSampling(0.9), RequestSampling(0.9), RequestSampling(1.0), RequestSampling(0.9, seed=3),
              RequestSampling(0.9)]
    logits = torch.randn(int(batch.num_nodes.sum()), VOCAB, generator=torch.Generator().manual_seed(0))
    q = {b: torch.softmax(torch.randn(int(batch.num_nodes[b]) - 1, VOCAB), -1) for b in range(4)}
    verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=q)
    assert block_rows == [2] and rejection_rows == [1]


@pytest.mark.parametrize("chains", [False, True])
def test_seeded_requests_do_not_depend_on_their_companions(chains):
    """A seeded request's result alone equals its result in any batch, whatever the
    companions (greedy, unseeded, drafts from q: block and rejection, other seeds) and
    the generator's state."""
    rng = random.Random(0)
    batch, logits, params, q = _mixed_batch(rng, chains=chains)
    seeded = [b for b, p in enumerate(params) if p.seed is not None]
    full = verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=q,
                       generator=torch.Generator().manual_seed(1))
    for trial in range(6):
        keep = sorted(set(rng.sample(range(len(params)), rng.randint(0, len(params)))) | {seeded[trial % 3]})
        sub = stack_trees([DraftTree(batch.candidates[b, :int(batch.num_nodes[b])],
                                     batch.parents[b, :int(batch.num_nodes[b])]) for b in keep])
        sub_logits = torch.cat([_rows(logits, batch.num_nodes, b) for b in keep])
        sub_q = {i: q[b] for i, b in enumerate(keep) if b in q}
        got = verify_step(sub_logits, sub.candidates, sub.parents, sub.num_nodes, [params[b] for b in keep],
                          draft_probs=sub_q, generator=torch.Generator().manual_seed(100 + trial))
        for i, b in enumerate(keep):
            if b in seeded:
                width = got.accepted_nodes.shape[1]
                assert torch.equal(got.accepted_nodes[i], full.accepted_nodes[b, :width]), (trial, b)
                assert int(got.bonus_token[i]) == int(full.bonus_token[b]), (trial, b)


def test_seeded_draws_are_the_position_hash():
    params = [RequestSampling(0.8, seed=5, position=3), RequestSampling(0.8, position=3),
              RequestSampling(0.8, seed=-1, position=0)]
    u = step_uniforms(params, 4, torch.Generator().manual_seed(0))
    assert torch.equal(u[0], position_uniforms(torch.tensor([5]), torch.tensor([3]), 4)[0])
    assert torch.equal(u[2], position_uniforms(torch.tensor([-1]), torch.tensor([0]), 4)[0])
    assert not torch.equal(u[1], step_uniforms(params, 4, torch.Generator().manual_seed(1))[1])


def test_typical_is_an_explicit_option():
    batch, logits, params, q = _mixed_batch(random.Random(2), chains=False)
    u = step_uniforms(params, batch.candidates.shape[1] + 1, torch.Generator().manual_seed(4))
    result = verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=q,
                         generator=torch.Generator().manual_seed(4), typical=True)
    for b, sp in enumerate(params):
        if sp.temperature == 0:
            _assert_row(result, _alone(batch, logits, params, q, u, b), b)
            continue
        rows = process_logits(_rows(logits, batch.num_nodes, b), sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                              order=sp.order)
        alone = S.verify(batch.candidates[b:b + 1], batch.parents[b:b + 1], rows, method="typical",
                         num_nodes=batch.num_nodes[b:b + 1], uniforms=u[b:b + 1])
        _assert_row(result, alone, b)


def test_bad_input_is_refused():
    batch, logits, params, q = _mixed_batch(random.Random(1), chains=False)
    with pytest.raises(ValueError, match="one RequestSampling per request"):
        verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params[:-1])
    with pytest.raises(ValueError, match="outside the batch"):
        verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs={99: q[3]})
    too_long = {3: torch.softmax(torch.randn(9, VOCAB), -1)}
    with pytest.raises(ValueError, match=r"draft_probs\[3\]"):
        verify_step(logits, batch.candidates, batch.parents, batch.num_nodes, params, draft_probs=too_long)
