"""Tree structure and builders: masks, positions, paths, padding, optimal_sparse, dynamic."""

import itertools
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specplug.common import tree as T
from specplug.common.dynamic_trees import Frontier, _first_frontier, _rerank, _topk_children, dynamic
from specplug.common.static_trees import chain, fill_static, from_choices, optimal_sparse


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [-1] + [rng.randrange(i) for i in range(1, n)]


@st.composite
def parents_lists(draw, max_nodes=12):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def ancestors(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out  # self first, root last


# --------------------------------------------------------------------------- structure


@settings(max_examples=60, deadline=None)
@given(parents_lists())
def test_mask_depth_positions_paths_match_parents(parents):
    n = len(parents)
    tree = T.DraftTree(torch.arange(n), torch.tensor(parents))
    mask = tree.attention_mask()
    for i in range(n):
        anc = set(ancestors(parents, i))
        assert mask[i].nonzero().flatten().tolist() == sorted(anc)
        assert tree.depth[i] == len(anc) - 1
    assert tree.positions(7).tolist() == [7 + d for d in tree.depth.tolist()]
    paths = tree.retrieve_paths()
    leaves = [i for i in range(n) if i not in parents]
    assert paths.shape == (len(leaves), tree.max_depth + 1)
    for row, leaf in zip(paths.tolist(), leaves):
        nodes = [x for x in row if x >= 0]
        assert nodes == ancestors(parents, leaf)[::-1]
        assert all(x == -1 for x in row[len(nodes):])


def test_batched_helpers_match_single_trees_and_pad():
    rng = random.Random(0)
    trees = [T.DraftTree(torch.randint(0, 50, (n,)), torch.tensor(random_parents(rng, n))) for n in (1, 4, 9)]
    batch = T.stack_trees(trees)
    assert batch.candidates.shape == (3, 9) and batch.num_nodes.tolist() == [1, 4, 9]
    assert (batch.parents[0, 1:] == -1).all() and (batch.parents[1, 4:] == -1).all()
    masks = T.ancestor_mask(batch.parents)
    depths = T.tree_depths(batch.parents)
    for b, t in enumerate(trees):
        n = t.num_nodes
        assert torch.equal(masks[b, :n, :n], t.attention_mask())
        assert torch.equal(depths[b, :n], t.depth)
    table = T.children_table(batch.parents)  # [B, N, C]
    for b, t in enumerate(trees):
        for node in range(9):
            kids = [k for k in table[b, node].tolist() if k >= 0]
            assert kids == (t.children(node) if node < t.num_nodes else [])
            assert T.sibling_rank(batch.parents)[b, kids].tolist() == list(range(len(kids)))
    for t, u in zip(trees, batch.unbind()):
        assert torch.equal(t.tokens, u.tokens) and torch.equal(t.parents, u.parents)


def test_pad_batch_adds_nodes_verification_never_accepts():
    rng = random.Random(1)
    trees = [T.DraftTree(torch.randint(1, 50, (n,)), torch.tensor(random_parents(rng, n))) for n in (2, 5)]
    batch = T.stack_trees(trees)._replace(draft_probs=torch.rand(2, 5, 3))
    padded = T.pad_batch(batch, 8)
    assert padded.candidates.shape == (2, 8) and torch.equal(padded.num_nodes, batch.num_nodes)
    assert torch.equal(padded.parents[:, :5], batch.parents) and (padded.parents[:, 5:] == -1).all()
    assert (padded.candidates[:, 5:] == 0).all() and (padded.draft_probs[:, 5:] == 0).all()
    mask = T.ancestor_mask(padded.parents)
    assert torch.equal(mask[:, 5:, :], torch.eye(8, dtype=torch.bool)[5:].expand(2, 3, 8))  # padding: self only
    assert T.pad_batch(batch, 5).candidates is batch.candidates  # already that wide
    with pytest.raises(ValueError, match="width 4 is below"):
        T.pad_batch(batch, 4)
    stacked = T.stack_batches([batch, T.stack_trees(trees[:1])])
    assert stacked.candidates.shape == (3, 5) and stacked.draft_probs is None


def test_chain():
    c = chain(3, [9, 1, 2, 3])
    assert c.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(c.attention_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert c.retrieve_paths().tolist() == [[0, 1, 2, 3]]
    assert chain(0).num_nodes == 1


@pytest.mark.parametrize(
    "parents, match",
    [([0, 0], "must be -1"), ([-1, 1], "not a tree"), ([-1, 0, 3, 1], "not a tree"), ([-1, -1], "not a tree")],
)
def test_bad_parents_raise(parents, match):
    with pytest.raises(ValueError, match=match):
        T.DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents))


def test_bad_tree_inputs_raise():
    with pytest.raises(ValueError, match="shape"):
        T.DraftTree(torch.zeros(3, dtype=torch.long), torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="integer"):
        T.DraftTree(torch.zeros(2), torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="stack_trees needs"):
        T.stack_trees([])
    with pytest.raises(ValueError, match="budget"):
        T.TreeConfig(budget=0)
    with pytest.raises(ValueError, match="unknown keys"):
        T.TreeConfig.from_dict({"depth": 2, "width": 3})


def test_tree_config_roundtrip():
    cfg = T.TreeConfig(depth=3, topk=2, budget=5)
    assert T.TreeConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.num_nodes == 6


# --------------------------------------------------------------------------- Medusa static trees


def test_from_choices_orders_like_medusa_and_fills_tokens():
    choices = [[1], [0, 0], [0], [0, 1], [1, 0], [0, 0, 0]]
    t = from_choices(choices)
    # sorted by (depth, path): [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    assert t.tokens.tolist() == [0, 0, 1, 0, 1, 0, 0]  # template: ranks
    head_tokens = torch.tensor([[10, 11], [20, 21], [30, 31]])  # [heads, topk]
    filled = from_choices(choices, head_tokens, root_token=5)
    assert filled.tokens.tolist() == [5, 10, 11, 20, 21, 20, 30]
    batch = fill_static(t, torch.tensor([5, 6]), torch.stack([head_tokens, head_tokens + 100]))
    assert batch[1].tolist() == [6, 110, 111, 120, 121, 120, 130]


@pytest.mark.parametrize(
    "choices, match", [([[0, 1]], "closed under parents"), ([[0], [0]], "twice"), ([[]], "non-empty"), ([[-1]], ">= 0")]
)
def test_from_choices_rejects_bad_paths(choices, match):
    with pytest.raises(ValueError, match=match):
        from_choices(choices)


def test_fill_static_needs_enough_heads():
    with pytest.raises(ValueError, match="heads"):
        fill_static(from_choices([[0], [0, 0]]), torch.tensor([1]), torch.zeros(1, 1, 2, dtype=torch.long))


def brute_force_best(acc, budget):
    heads, topk = len(acc), len(acc[0])
    nodes = [p for d in range(1, heads + 1) for p in itertools.product(range(topk), repeat=d)]
    value = {p: math.prod(acc[h][r] for h, r in enumerate(p)) for p in nodes}
    best = 0.0
    for subset in itertools.combinations(nodes, budget):
        s = set(subset)
        if all(len(p) == 1 or p[:-1] in s for p in subset):
            best = max(best, sum(value[p] for p in subset))
    return 1.0 + best


@pytest.mark.parametrize("seed", range(6))
def test_optimal_sparse_matches_brute_force(seed):
    rng = random.Random(seed)
    heads, topk = rng.choice([(2, 2), (2, 3), (3, 2)])
    acc = [[rng.random() for _ in range(topk)] for _ in range(heads)]  # deliberately not sorted by rank
    for budget in range(1, 6):
        tree, tau = optimal_sparse(acc, budget)
        assert tree.num_nodes == budget + 1
        assert tau == pytest.approx(brute_force_best(acc, budget), abs=1e-12)


def test_optimal_sparse_63_node_tree_round_trips_through_choices():
    acc = [[0.6 * 0.8**h / (r + 1) for r in range(10)] for h in range(5)]  # Medusa-like: 5 heads, top-10
    tree, tau = optimal_sparse(acc, 63)
    assert tree.num_nodes == 64 and 1.0 < tau < 6.0
    again = from_choices(tree.choices())
    assert torch.equal(again.parents, tree.parents) and torch.equal(again.tokens, tree.tokens)
    siblings_rank_first = all(
        tree.tokens[kids].tolist() == sorted(tree.tokens[kids].tolist())
        for kids in (tree.parents == p for p in range(tree.num_nodes))
    )
    assert siblings_rank_first


def test_optimal_sparse_prefers_chain_when_first_head_is_sure_and_validates():
    tree, tau = optimal_sparse([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05]], 3)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tau == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    with pytest.raises(ValueError, match="budget"):
        optimal_sparse([[0.5]], 0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        optimal_sparse([[1.5]], 1)
    assert optimal_sparse([[0.5, 0.2]], 10)[0].num_nodes == 3  # clamped to every possible node


# --------------------------------------------------------------------------- EAGLE-2 dynamic trees

VOCAB = 23


def path_logprobs(path: tuple) -> torch.Tensor:
    """A deterministic toy drafter: log-probs depend on the token path from the root."""
    g = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.log_softmax(3 * torch.randn(VOCAB, generator=g), -1)


def token_path(tokens, parents, node):
    return tuple(tokens[i] for i in ancestors(parents, node)[::-1])


class CheckingDrafter:
    """expand() callback that checks the Frontier it is handed, then answers per path."""

    def __init__(self):
        self.calls = 0

    def __call__(self, f: Frontier) -> torch.Tensor:
        self.calls += 1
        bsz, width = f.tokens.shape
        assert f.depth == self.calls and (f.positions == f.depth).all()
        assert f.expanded_mask.shape == (bsz, width, 1 + f.depth * width)
        out = torch.empty(bsz, width, VOCAB)
        for b in range(bsz):
            toks, pars = f.tree_tokens[b].tolist(), f.tree_parents[b].tolist()
            for s in range(width):
                node = int(f.node_ids[b, s])
                assert toks[node] == f.tokens[b, s]
                assert T.tree_depths(f.tree_parents[b])[node] == f.depth
                out[b, s] = path_logprobs(token_path(toks, pars, node))
        return out


def reference_dynamic(root, depth, topk, budget):
    """Plain-Python EAGLE-2 for one request (no batching, no tensors in the loop)."""
    nodes = [((root,), 0.0, -1)]  # (token path, score, parent index)
    lp = path_logprobs((root,))
    frontier = []
    for tok in lp.topk(topk).indices.tolist():
        nodes.append(((root, tok), float(lp[tok]), 0))
        frontier.append(len(nodes) - 1)
    for _ in range(1, depth):
        cands = []
        for f in frontier:
            lp = path_logprobs(nodes[f][0])
            for tok in lp.topk(topk).indices.tolist():
                nodes.append((nodes[f][0] + (tok,), nodes[f][1] + float(lp[tok]), f))
                cands.append(len(nodes) - 1)
        frontier = sorted(sorted(cands, key=lambda i: -nodes[i][1])[:topk])
    kept = sorted(sorted(range(1, len(nodes)), key=lambda i: -nodes[i][1])[:budget])
    return {nodes[i][0]: nodes[i][1] for i in kept}


@pytest.mark.parametrize("depth, topk, budget", [(1, 3, 2), (3, 3, 7), (4, 2, 30), (4, 4, 12)])
def test_dynamic_matches_reference_and_is_closed(depth, topk, budget):
    roots = torch.tensor([3, 7, 11])
    root_lp = torch.stack([path_logprobs((int(r),)) for r in roots])
    drafter = CheckingDrafter()
    batch = dynamic(drafter, roots, root_lp, depth=depth, topk=topk, budget=budget)
    assert drafter.calls == depth - 1
    for b, tree in enumerate(batch.unbind()):
        toks, pars = tree.tokens.tolist(), tree.parents.tolist()
        got = {token_path(toks, pars, i): float(tree.scores[i]) for i in range(1, tree.num_nodes)}
        want = reference_dynamic(int(roots[b]), depth, topk, budget)
        assert got.keys() == want.keys()
        for path in got:
            assert got[path] == pytest.approx(want[path], abs=1e-5)
        assert tree.max_depth <= depth  # closed under parents is checked by DraftTree itself


def test_dynamic_expanded_mask_marks_ancestors_in_call_order():
    seen = []

    def expand(f):
        seen.append(f)
        generator = torch.Generator().manual_seed(len(seen))
        return torch.log_softmax(torch.randn(f.tokens.shape + (VOCAB,), generator=generator), -1)

    dynamic(expand, torch.tensor([1, 2]), torch.log_softmax(torch.randn(2, VOCAB), -1), depth=4, topk=3, budget=10)
    run = [torch.zeros(2, 1, dtype=torch.long)]
    for f in seen:
        run.append(f.node_ids)
        order = torch.cat(run, 1)  # nodes the drafter ran, call order
        for b in range(2):
            pars = f.tree_parents[b].tolist()
            for s in range(f.tokens.shape[1]):
                anc = set(ancestors(pars, int(f.node_ids[b, s])))
                assert f.expanded_mask[b, s].tolist() == [int(x) in anc for x in order[b]]
                if f.depth > 1:
                    prev = seen[f.depth - 2].node_ids[b, f.parent_slot[b, s]]
                    assert pars[int(f.node_ids[b, s])] == prev


def test_dynamic_token_map_and_unnormalised_scores_stay_closed():
    token_map = torch.arange(VOCAB) * 10 + 1000  # draft vocab index -> target id

    def expand(f):
        return torch.full(f.tokens.shape + (VOCAB,), 5.0)  # positive "log-probs": children outscore parents

    batch = dynamic(expand, torch.tensor([0]), torch.zeros(1, VOCAB), depth=3, topk=2, budget=4, token_map=token_map)
    tree = batch.unbind()[0]  # DraftTree validates parents < child
    assert tree.num_nodes == 5 and (tree.tokens[1:] >= 1000).all()


def test_dynamic_bad_input_raises():
    with pytest.raises(ValueError, match="budget"):
        dynamic(lambda f: None, torch.tensor([0]), torch.zeros(1, 5), budget=0)
    with pytest.raises(ValueError, match="root_logprobs"):
        dynamic(lambda f: None, torch.tensor([0]), torch.zeros(5))
    with pytest.raises(ValueError, match="expand must return"):
        dynamic(lambda f: torch.zeros(1, 1, 5), torch.tensor([0]), torch.zeros(1, 5), depth=2, topk=2)


def test_dynamic_stops_expanding_below_stop_below():
    """A frontier whose best node has cumulative draft probability under stop_below is
    not expanded: fewer expand calls, a shallower tree; 0 keeps every level."""
    calls = []

    def expand(front):
        calls.append(front.depth)
        return torch.full((*front.tokens.shape, 8), 0.125).log()  # uniform: each level x 1/8

    root = torch.tensor([1])
    confident = torch.tensor([[0.9] + [0.1 / 7] * 7]).log()
    for stop, want_calls in ((0.0, 3), (0.1, 2), (0.2, 1), (0.95, 0)):  # levels: 0.9, 0.1125, 0.014
        calls.clear()
        trees = dynamic(expand, root, confident, depth=4, topk=2, budget=30, stop_below=stop)
        assert len(calls) == want_calls, stop
        assert int(T.tree_depths(trees.parents[0]).max()) == want_calls + 1
    with pytest.raises(ValueError, match="stop_below"):
        T.TreeConfig(stop_below=1.0)


def test_chain_batch_is_an_engines_flat_chain_layout():
    batch = T.chain_batch([2, 0, 1], torch.tensor([5, 6, 7]))
    assert batch.candidates.tolist() == [[0, 5, 6], [0, 0, 0], [0, 7, 0]]
    assert batch.parents.tolist() == [[-1, 0, 1], [-1, -1, -1], [-1, 0, -1]]
    assert batch.num_nodes.tolist() == [3, 1, 2]
    assert T.is_chain(batch.parents[0]) and not T.is_chain(torch.tensor([-1, 0, 0]))
    same = T.chain_batch([2, 2], torch.tensor([5, 6, 7, 8], dtype=torch.int32))  # one length: a reshape
    assert same.candidates.tolist() == [[0, 5, 6], [0, 7, 8]] and same.candidates.dtype == torch.long
    assert same.parents.tolist() == [[-1, 0, 1]] * 2 and same.num_nodes.tolist() == [3, 3]
    none = T.chain_batch([0, 0], torch.zeros(0, dtype=torch.long))
    assert none.candidates.tolist() == [[0], [0]] and none.parents.tolist() == [[-1], [-1]]
    padded = T.pad_parents([torch.tensor([-1, 0, 0]), torch.tensor([-1])], 4)
    assert padded.tolist() == [[-1, 0, 0, -1], [-1, -1, -1, -1]]


@pytest.mark.parametrize("budget", [1, 2, 3, 10])
@pytest.mark.parametrize("shift", [0.0, 5.0])  # 5.0: unnormalised positive scores, all tied at the root's rank
def test_dynamic_without_expansion_equals_the_general_rerank(budget, shift):
    """A tree that stops at depth 1 (depth 1, or stop_below above every child) takes a
    shortcut; it must equal what the general path (first frontier, then _rerank) keeps."""
    gen = torch.Generator().manual_seed(int(budget + shift))
    roots = torch.tensor([4, 9, 2])
    logprobs = torch.log_softmax(torch.randn(3, VOCAB, generator=gen), -1) + shift
    token_map = torch.arange(VOCAB) * 3 + 100
    tokens, scores = _topk_children(logprobs.unsqueeze(1), 3, token_map)
    front, tree_scores = _first_frontier(roots, tokens, scores)
    want = _rerank(front.tree_tokens, front.tree_parents, tree_scores, budget)

    def never(front):
        raise AssertionError("no expansion expected")

    stops = [{"depth": 1, "stop_below": 0.0}] + ([{"depth": 4, "stop_below": 0.99}] if shift == 0.0 else [])
    for kwargs in stops:  # (positive scores never fall below a stop_below)
        got = dynamic(never, roots, logprobs, topk=3, budget=budget, token_map=token_map, **kwargs)
        for name in ("candidates", "parents", "num_nodes", "scores"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, kwargs)
