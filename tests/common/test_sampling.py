"""verify(): greedy properties, layouts, randomness contract, logits processing, bad input.

The statistical proof that the rejection samplers are lossless is in
test_sampling_lossless.py.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplug.common import sampling as S
from specplug.common import tree as T
from specplug.common.randomness import draw_uniforms, sample_inverse_cdf
from specplug.common.target_probs import SamplingConfig, first_argmax, process_logits, sampling_tensors


def rand_tree_batch(rng: random.Random, bsz: int, max_nodes: int, vocab: int):
    trees = []
    for _ in range(bsz):
        n = rng.randint(1, max_nodes)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        trees.append(T.DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(n)]), torch.tensor(parents)))
    return trees, T.stack_trees(trees)


def path_to(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def greedy_reference(tokens, parents, argmax):
    """Deepest root path agreeing with argmax at every step; ties to lowest node id."""
    best = [0]
    for i in range(1, len(parents)):
        path = path_to(parents, i)
        if all(tokens[c] == argmax[parents[c]] for c in path[1:]) and len(path) > len(best):
            best = path
    return best, argmax[best[-1]]


# --------------------------------------------------------------------------- greedy


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.integers(2, 6))
def test_greedy_accepts_longest_agreeing_path(seed, bsz, vocab):
    rng = random.Random(seed)
    trees, batch = rand_tree_batch(rng, bsz, 10, vocab)
    n = batch.candidates.shape[1]
    logits = torch.randn(bsz, n, vocab, generator=torch.Generator().manual_seed(seed))
    res = S.verify(batch.candidates, batch.parents, logits, method="greedy", num_nodes=batch.num_nodes)
    argmax = logits.argmax(-1)
    for b, t in enumerate(trees):
        path, bonus = greedy_reference(t.tokens.tolist(), t.parents.tolist(), argmax[b].tolist())
        row = res.accepted_nodes[b].tolist()
        assert row[: len(path)] == path and all(x == -1 for x in row[len(path):])
        assert res.num_accepted[b] == len(path) - 1 and res.bonus_token[b] == bonus
    assert res.accepted_nodes.shape[1] == max(t.max_depth for t in trees) + 1


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_rejection_with_one_hot_target_is_greedy(seed):
    """temperature-0 rows (one-hot p from process_logits) verified by 'rejection' act greedily."""
    rng = random.Random(seed)
    trees, batch = rand_tree_batch(rng, 4, 8, 4)
    # distinct sibling tokens: the sampling rules test duplicates once, greedy takes the longest
    keep = [t for t in trees if not any(
        (t.parents == p).sum() > len(set(t.tokens[t.parents == p].tolist())) for p in range(t.num_nodes))]
    if not keep:
        return
    batch = T.stack_trees(keep)
    logits = torch.randn(*batch.candidates.shape, 4, generator=torch.Generator().manual_seed(seed))
    p = process_logits(logits, temperature=0.0)
    kw = dict(num_nodes=batch.num_nodes)
    greedy = S.verify(batch.candidates, batch.parents, logits, method="greedy", **kw)
    for draft in (None, torch.softmax(torch.randn_like(logits), -1)):
        rej = S.verify(batch.candidates, batch.parents, p, draft, method="rejection", **kw)
        assert torch.equal(rej.accepted_nodes, greedy.accepted_nodes)
        assert torch.equal(rej.bonus_token, greedy.bonus_token)


def test_greedy_chain_example():
    cands = torch.tensor([[9, 1, 2, 3]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    logits = torch.full((1, 4, 5), -1.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 4] = logits[0, 3, 0] = 1.0
    res = S.verify(cands, parents, logits)
    assert res.accepted_nodes.tolist() == [[0, 1, 2, -1]]
    assert res.num_accepted.tolist() == [2] and res.bonus_token.tolist() == [4]
    assert res.output_tokens(cands).tolist() == [[1, 2, 4, -1]]
    assert res.node_rows(torch.tensor([5])).tolist() == [[5, 6, 7, -1]]  # request 0's root at flat row 5
    assert res.node_rows(torch.tensor([5]), 5).tolist() == [[5, 6, 7, -1, -1]]


def test_greedy_ties_go_to_the_first_maximal_index():
    logits = torch.tensor([[[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [0.0, 2.0, 2.0]]])
    parents = torch.tensor([[-1, 0, 0]])
    tie_loser = S.verify(torch.tensor([[0, 1, 2]]), parents, logits)  # argmax at root is 0, not 1
    assert tie_loser.num_accepted.tolist() == [0] and tie_loser.bonus_token.tolist() == [0]
    tie_winner = S.verify(torch.tensor([[0, 2, 0]]), parents, logits)
    assert tie_winner.accepted_nodes.tolist() == [[0, 2]] and tie_winner.bonus_token.tolist() == [1]


# --------------------------------------------------------------------------- layouts and randomness


def rand_probs_batch(seed, bsz=6, max_nodes=9, vocab=7):
    rng = random.Random(seed)
    trees, batch = rand_tree_batch(rng, bsz, max_nodes, vocab)
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(*batch.candidates.shape, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(*batch.candidates.shape, vocab, generator=g), -1)
    return batch, p, q


@pytest.mark.parametrize("method, use_q",
                         [("greedy", False), ("rejection", False), ("rejection", True), ("typical", False)])
def test_flattened_layout_equals_padded(method, use_q):
    batch, p, q = rand_probs_batch(1)
    real = torch.arange(p.shape[1]) < batch.num_nodes.unsqueeze(1)
    u = torch.rand(p.shape[0], p.shape[1] + 1, generator=torch.Generator().manual_seed(2))
    kw = dict(method=method, num_nodes=batch.num_nodes, uniforms=u)
    padded = S.verify(batch.candidates, batch.parents, p, q if use_q else None, **kw)
    flat = S.verify(batch.candidates, batch.parents, p[real], q[real] if use_q else None, **kw)
    for a, b in zip(padded, flat):
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_q", [False, True])
def test_seeded_generators_reproduce_each_request_independently(use_q):
    batch, p, q = rand_probs_batch(3)
    q = q if use_q else None

    def run(order):
        gens = [torch.Generator().manual_seed(100 + b) for b in order]
        idx = torch.tensor(order)
        return S.verify(batch.candidates[idx], batch.parents[idx], p[idx], None if q is None else q[idx],
                        method="rejection", num_nodes=batch.num_nodes[idx], generators=gens)

    a, b = run([0, 1, 2, 3, 4, 5]), run([5, 4, 3, 2, 1, 0])
    assert torch.equal(a.bonus_token, b.bonus_token.flip(0))
    assert torch.equal(a.num_accepted, b.num_accepted.flip(0))
    explicit = draw_uniforms(6, p.shape[1], [torch.Generator().manual_seed(100 + i) for i in range(6)])
    c = S.verify(batch.candidates, batch.parents, p, q, method="rejection", num_nodes=batch.num_nodes,
                 uniforms=explicit)
    assert torch.equal(a.bonus_token, c.bonus_token)


def test_uniforms_define_the_decisions():
    """Node j's uniform decides node j; uniforms[:, 0] picks the final token by inverse CDF."""
    cands, parents = torch.tensor([[0, 2]]), torch.tensor([[-1, 0]])
    p = torch.tensor([[[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    accept = S.verify(cands, parents, p, method="rejection", uniforms=torch.tensor([[0.0, 0.19, 0.0]]))
    reject = S.verify(cands, parents, p, method="rejection", uniforms=torch.tensor([[0.0, 0.21, 0.0]]))
    assert accept.num_accepted.tolist() == [1] and reject.num_accepted.tolist() == [0]
    # residual after rejecting token 2: [0.5, 0.3, 0, 0] / 0.8; u = 0.7 -> 0.56 -> token 1
    residual = S.verify(cands, parents, p, method="rejection", uniforms=torch.tensor([[0.7, 0.5, 0.0]]))
    assert residual.bonus_token.tolist() == [1]
    assert sample_inverse_cdf(torch.tensor([[0.0, 1.0, 0.0, 3.0]]), torch.tensor([0.25])).tolist() == [3]
    assert sample_inverse_cdf(torch.tensor([[0.0, 1.0, 0.0, 3.0]]), torch.tensor([0.2499])).tolist() == [1]


def test_cuda_dispatch_hook_is_called_and_may_decline(monkeypatch):
    import specplug.common.cuda as cuda

    calls = []

    def fake(candidates, parents, target_probs, draft_probs, *, method, num_nodes, uniforms):
        calls.append((method, num_nodes.tolist(), None if uniforms is None else uniforms.shape))
        return None

    monkeypatch.setattr(cuda, "try_verify", fake, raising=False)
    batch, p, _ = rand_probs_batch(4, bsz=2)
    u = torch.rand(2, p.shape[1] + 1)
    assert S._try_cuda(batch.candidates, batch.parents, p, None, "rejection", batch.num_nodes, u) is None
    assert calls == [("rejection", batch.num_nodes.tolist(), u.shape)]
    monkeypatch.delattr(cuda, "try_verify")
    assert S._try_cuda(batch.candidates, batch.parents, p, None, "greedy", batch.num_nodes, None) is None


# --------------------------------------------------------------------------- typical (lossy)


def test_typical_acceptance_threshold():
    # p after root: entropy-based threshold min(0.09, 0.3 * exp(-H))
    p_root = torch.tensor([0.6, 0.3, 0.05, 0.05])
    h = float(-(p_root * p_root.log()).sum())
    thr = min(S.TYPICAL_EPSILON, S.TYPICAL_DELTA * torch.exp(torch.tensor(-h)).item())
    assert 0.05 < thr < 0.3
    cands, parents = torch.tensor([[0, 2, 1]]), torch.tensor([[-1, 0, 0]])
    probs = torch.stack([p_root, torch.full((4,), 0.25), torch.full((4,), 0.25)]).unsqueeze(0)
    res = S.verify(cands, parents, probs, method="typical")
    assert res.accepted_nodes.tolist() == [[0, 2]]  # token 2 (p=0.05) fails, token 1 (p=0.3) passes
    strict = S.verify(cands, parents, probs, method="typical", typical_epsilon=0.5, typical_delta=10.0)
    assert strict.num_accepted.tolist() == [0]


# --------------------------------------------------------------------------- process_logits


def test_process_logits_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(process_logits(logits), torch.softmax(logits, -1))
    assert torch.allclose(process_logits(logits, temperature=2.0), torch.softmax(logits / 2, -1))
    assert process_logits(logits, temperature=0.0).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    top2 = process_logits(logits, top_k=2)
    assert torch.allclose(top2, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4)
    full = torch.softmax(logits, -1)[0]  # [0.644, 0.237, 0.087, 0.032]
    assert (process_logits(logits, top_p=0.6)[0] > 0).tolist() == [True, False, False, False]
    assert (process_logits(logits, top_p=float(full[0] + 0.01))[0] > 0).tolist() == [True, True, False, False]
    assert (process_logits(logits, top_p=1.0) > 0).all()


def test_process_logits_follows_each_engines_filter_order():
    """p = [0.5, 0.3, 0.2], top-k 2, top-p 0.6: vLLM renormalises after top-k (mass
    before token 1 is 0.625 >= 0.6: dropped), SGLang counts the full mass (0.5 <= 0.6:
    kept). p = [0.4, 0.35, 0.25], min-p 0.7, top-p 0.5: vLLM filters min-p first and
    renormalises (mass before token 1: 0.53 >= 0.5, dropped), SGLang takes top-p on the
    full mass (0.4: kept), then min-p (0.35 >= 0.28: kept)."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    vllm = process_logits(logits, top_k=2, top_p=0.6)
    sglang = process_logits(logits, top_k=2, top_p=0.6, order="sglang")
    assert (vllm[0] > 0).tolist() == [True, False, False]
    torch.testing.assert_close(sglang, torch.tensor([[0.625, 0.375, 0.0]]))
    logits = torch.tensor([[0.4, 0.35, 0.25]]).log()
    assert (process_logits(logits, top_p=0.5, min_p=0.7)[0] > 0).tolist() == [True, False, False]
    assert (process_logits(logits, top_p=0.5, min_p=0.7, order="sglang")[0] > 0).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="order must be one of"):
        process_logits(logits, order="tgi")


def test_process_logits_per_request_settings_mix_greedy_and_sampled():
    logits = torch.randn(3, 5, 11)
    cfgs = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.7, top_k=3), SamplingConfig(top_p=0.5)]
    t, k, p = sampling_tensors(cfgs)
    probs = process_logits(logits, t, k, p)
    for b, c in enumerate(cfgs):
        assert torch.allclose(probs[b], process_logits(logits[b : b + 1], c.temperature, c.top_k, c.top_p)[0])
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5))
    assert ((probs[1] > 0).sum(-1) == 3).all()
    assert cfgs[0].method == "greedy" and cfgs[1].method == "rejection"
    assert SamplingConfig(seed=5).generator().initial_seed() == 5


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_sampling_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)


def test_process_logits_rejects_wrongly_shaped_settings():
    with pytest.raises(ValueError, match="repeat_interleave"):
        process_logits(torch.zeros(4, 3), temperature=torch.ones(3))


# --------------------------------------------------------------------------- bad input


def good():
    return dict(
        candidates=torch.tensor([[0, 1, 2]]),
        parents=torch.tensor([[-1, 0, 0]]),
        target_probs=torch.full((1, 3, 4), 0.25),
    )


@pytest.mark.parametrize(
    "change, err, match",
    [
        (dict(candidates=torch.tensor([[0, 1]])), ValueError, "candidates and parents"),
        (dict(candidates=torch.tensor([[0.0, 1.0, 2.0]])), TypeError, "candidates"),
        (dict(parents=torch.tensor([[-1, 0, 2]])), ValueError, "not a tree"),
        (dict(parents=torch.tensor([[0, 0, 0]])), ValueError, "root"),
        (dict(target_probs=torch.full((1, 2, 4), 0.25)), ValueError, "target_probs must be"),
        (dict(target_probs=torch.full((1, 3, 4), 0.3)), ValueError, "sums to 1.2"),
        (dict(target_probs=torch.tensor([[[0.25] * 4, [0.25] * 4, [float("nan"), 0.5, 0.25, 0.25]]])),
         ValueError, "NaN"),
        (dict(draft_probs=torch.full((1, 3, 5), 0.2)), ValueError, "vocab"),
        (dict(draft_probs=torch.full((1, 3, 4), 0.5)), ValueError, "draft_probs row"),
        (dict(method="beam"), ValueError, "method"),
        (dict(candidates=torch.tensor([[0, 1, 4]])), ValueError, r"candidates\[0, 2\] = 4 is outside"),
        (dict(num_nodes=torch.tensor([4])), ValueError, "num_nodes"),
        (dict(num_nodes=torch.tensor([0])), ValueError, "num_nodes"),
        (dict(uniforms=torch.zeros(1, 3)), ValueError, "uniforms must be"),
        (dict(uniforms=torch.ones(1, 4)), ValueError, r"\[0, 1\)"),
        (dict(generators=[None, None]), ValueError, "generators"),
        (dict(target_probs=torch.full((5, 4), 0.25)), ValueError, "flattened"),
    ],
)
def test_bad_input_raises_naming_the_argument(change, err, match):
    kw = dict(good(), method="rejection")
    kw.update(change)
    with pytest.raises(err, match=match):
        S.verify(**kw)


def test_greedy_rejects_nan_logits_but_not_unnormalised_ones():
    kw = good()
    kw["target_probs"] = torch.randn(1, 3, 4) * 5
    S.verify(**kw)
    kw["target_probs"][0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        S.verify(**kw)


def test_padding_rows_are_not_validated():
    kw = good()
    kw["target_probs"][0, 2] = float("nan")
    res = S.verify(**kw, method="rejection", num_nodes=torch.tensor([2]))
    assert res.accepted_nodes.shape == (1, 2)


def test_validate_false_skips_only_the_value_checks():
    kw = dict(good(), method="rejection", uniforms=torch.rand(1, 4, generator=torch.Generator().manual_seed(0)))
    assert all(torch.equal(a, b) for a, b in zip(S.verify(**kw), S.verify(**kw, validate=False)))
    kw["target_probs"] = torch.full((1, 3, 4), 0.3)  # sums to 1.2: only the value check objects
    S.verify(**kw, validate=False)
    with pytest.raises(ValueError, match="not a tree"):
        S.verify(**dict(kw, parents=torch.tensor([[-1, 2, 0]])), validate=False)


def test_output_tokens_when_no_request_has_drafts():
    """A batch of root-only trees (D = 0) emits just the bonus token per request."""
    cands = torch.tensor([[7], [8]])
    parents = torch.full((2, 1), -1)
    p = torch.zeros(2, 1, 5)
    p[0, 0, 3] = p[1, 0, 1] = 1.0
    res = S.verify(cands, parents, p, method="greedy")
    assert res.output_tokens(cands).tolist() == [[3], [1]]


@pytest.mark.parametrize("vocab", [7, 4096, 4097, 49152, 50001])
def test_first_argmax_is_torch_argmax(vocab):
    """Random rows, ties within and across chunks, a max in the ragged last chunk, NaN."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1, [3, vocab - 1]] = 50.0  # tie: the first index wins
    x[2, vocab - 1] = 50.0  # the last column (past the whole chunks when ragged)
    x[3, [vocab // 2, vocab // 2 + 1, 0]] = 50.0
    x[4] = 0.0  # every column ties
    x[5, vocab // 3] = float("nan")
    x[6, [vocab - 2, vocab - 1]] = float("inf")
    x[7] = float("-inf")
    x[8, [vocab // 4, vocab // 5]] = float("nan")  # two NaNs: the first wins
    x = torch.cat([x, x.half().float()])  # rounding: many ties
    # numpy's argmax on a CPU (float32/64/16), the chunked path for bf16; strided rows too
    for y in (x, x.bfloat16(), x.half(), x.double(), x[:, ::2]):
        assert torch.equal(first_argmax(y), y.argmax(-1)), y.dtype
    assert first_argmax(x[:0]).shape == (0,)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(4097, 12000), st.integers(0, 2**31 - 1))
def test_first_argmax_on_coarse_values(rows, vocab, seed):
    """Values from a handful of levels: ties everywhere, the first index still wins."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (rows, vocab), generator=g).float()
    assert torch.equal(first_argmax(x), x.argmax(-1))
