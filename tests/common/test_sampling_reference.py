"""verify() against a literal, sequential, one-request-at-a-time reading of the rules.

The reference walks the tree node by node in plain Python (float64), testing each
node's children in id order with the uniform of that child, exactly as the module
docstring of specplug.common.sampling states the contract. Same uniforms in, same
decisions out (a float32-vs-float64 near-tie could flip a decision with chance ~1e-7
per draw; none occurs at these seeds).
"""

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplug.common import sampling as S
from specplug.common import tree as T


def inverse_cdf(dist, u):
    total = sum(dist)
    acc = 0.0
    for v, x in enumerate(dist):
        acc += x
        if acc > u * total:
            return v
    return len(dist) - 1


def reference_one(tokens, parents, p, q, u):
    """(accepted node ids, bonus token) for one request; q None = target-only rule."""
    path, cur = [0], 0
    p_res = list(p[0])
    while True:
        kids = [j for j in range(len(parents)) if parents[j] == cur]
        moved = False
        for j in kids:
            x = tokens[j]
            if q is None:
                if u[j] < p_res[x] / max(sum(p_res), p_res[x], 1e-300) and p_res[x] > 0:
                    moved = True
                else:
                    p_res[x] = 0.0
            else:
                if u[j] * q[cur][x] < p_res[x]:
                    moved = True
                else:
                    res = [max(0.0, a - b) for a, b in zip(p_res, q[cur])]
                    s = sum(res)
                    p_res = [r / s for r in res] if s > 0 else p_res
            if moved:
                path.append(j)
                cur = j
                total = sum(p[j])
                p_res = [a / total for a in p[j]] if q is not None else list(p[j])
                break
        if not moved:
            return path, inverse_cdf(p_res, u[0])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_verify_matches_sequential_reference(seed, with_q):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    trees = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 9)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        trees.append(T.DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(n)]), torch.tensor(parents)))
    batch = T.stack_trees(trees)
    g = torch.Generator().manual_seed(seed)
    shape = (*batch.candidates.shape, vocab)
    # sparse-ish targets so zero-probability drafts and exhausted residuals occur
    p = torch.softmax(3 * torch.randn(shape, generator=g), -1)
    p = torch.where(p < 0.05, 0.0, p)
    p = p / p.sum(-1, keepdim=True)
    q = torch.softmax(torch.randn(shape, generator=g), -1) if with_q else None
    u = torch.rand(shape[0], shape[1] + 1, generator=g)
    res = S.verify(batch.candidates, batch.parents, p, q, method="rejection", num_nodes=batch.num_nodes, uniforms=u)
    for b, t in enumerate(trees):
        n = t.num_nodes
        qb = None if q is None else q[b, :n].double().tolist()
        path, bonus = reference_one(t.tokens.tolist(), t.parents.tolist(), p[b, :n].double().tolist(), qb,
                                    u[b].double().tolist())
        got = [x for x in res.accepted_nodes[b].tolist() if x >= 0]
        assert got == path, (b, got, path)
        assert res.bonus_token[b] == bonus
        assert res.num_accepted[b] == len(path) - 1


def test_half_precision_probs_give_the_float32_answer():
    """Dyadic probabilities are exact in bf16 / fp16, so every decision must agree."""
    cands = torch.tensor([[0, 1, 2, 3], [0, 2, 1, 0]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    p = torch.tensor([0.5, 0.25, 0.125, 0.125]).expand(2, 4, 4).contiguous()
    u = torch.rand(2, 5, generator=torch.Generator().manual_seed(0))
    want = S.verify(cands, parents, p, method="rejection", uniforms=u)
    for dtype in (torch.bfloat16, torch.float16):
        got = S.verify(cands, parents, p.to(dtype), method="rejection", uniforms=u)
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        assert torch.equal(S.verify(cands, parents, p.to(dtype)).accepted_nodes,
                           S.verify(cands, parents, p).accepted_nodes)
