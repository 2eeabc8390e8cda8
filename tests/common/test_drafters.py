"""Eagle3Drafter (with EAGLE-3 and EAGLE-1 heads) / MedusaDrafter on the tiny Llama: tree
drafting equals path-by-path chains, commit equals a fresh prefill, drafting leaves no
state, batches equal singles."""

import pytest
import torch

from specplug.common.drafters import Eagle3Drafter, EagleDrafter, MedusaDrafter, prior_accuracies
from specplug.common.heads import Eagle1Config, Eagle1Head, Eagle3Config, Eagle3Head, MedusaConfig, MedusaHeads
from specplug.common.heads.eagle3 import d2t_to_t2d
from specplug.common.static_trees import optimal_sparse
from specplug.common.tree import TreeConfig

pytestmark = pytest.mark.usefixtures("one_thread")

DRAFT_VOCAB = 200




# -- helpers shared with test_reference.py ---------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_llama_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def random_eagle3_head(target, seed=0, draft_vocab=DRAFT_VOCAB, scale=0.5) -> Eagle3Head:
    """A random EAGLE-3 head for `target` with a reduced draft vocab (random sorted subset)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=draft_vocab)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (scale if p.dim() > 1 else 0.1) + (p.dim() == 1))
        ids = torch.randperm(cfg.vocab_size, generator=gen)[:draft_vocab].sort().values
        head.d2t.copy_(ids - torch.arange(draft_vocab))
        head.t2d.copy_(d2t_to_t2d(head.d2t, cfg.vocab_size))
    head.set_target_embedding(target.get_input_embeddings())
    return head.eval()


def random_eagle1_head(target, seed=0) -> Eagle1Head:
    """A random EAGLE-1 head for `target`, scoring with the target's lm_head and embedding;
    weights ~ N(0, 1/fan_in) keep its output near the target's feature scale."""
    gen = torch.Generator().manual_seed(seed)
    head = Eagle1Head(Eagle1Config.for_target(target.config))
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
                    + (p.dim() == 1))
    head.set_target(target)
    return head.eval()


def random_medusa_heads(target, num_heads=3, num_layers=1, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = MedusaConfig(num_heads, num_layers, target.config.hidden_size, target.config.vocab_size)
    return MedusaHeads(cfg).eval()


def target_hidden(target, ids, layer_ids):
    """The target's hidden_states entries `layer_ids` over ids [n], concatenated -> [n, Hc]."""
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i][0] for i in layer_ids], -1)


def prefill(drafter, target, rid, ids, first):
    layers = drafter.target_hidden_layers(target.config.num_hidden_layers)
    drafter.prefill([rid], [ids], [target_hidden(target, ids, layers)], torch.tensor([first]))


PROMPT = torch.tensor([1, 40, 41, 42, 43, 44, 45, 46, 47])


# -- EAGLE-3 ----------------------------------------------------------------------------------
def chain_scores(drafter, rid, tokens):
    """Cumulative draft log-probs of tokens[1:] drafted one at a time from the committed state
    of `rid` (no tree machinery): the reference for a node's score."""
    head, root = drafter.head, drafter.roots[rid]
    k, v = root.key.transpose(0, 1)[None], root.value.transpose(0, 1)[None]  # [1, kvh, S, D]
    hidden, logprobs = root.hidden[None, None], root.logprobs
    draft_ids = {int(t): i for i, t in enumerate(drafter.token_map)}
    score, scores = 0.0, []
    for tok in tokens[1:].tolist():
        score += float(logprobs[draft_ids[tok]].detach())
        scores.append(score)
        s = k.shape[2]  # the draft position of this input: committed length + depth - 1
        out = head(torch.tensor([[tok]]), hidden, torch.tensor([[s]]), torch.ones(1, 1, s + 1, dtype=torch.bool),
                   (k, v))
        k, v = torch.cat([k, out.kv[0]], 2), torch.cat([v, out.kv[1]], 2)
        hidden = out.hidden
        logprobs = head.compute_logits(out.normed)[0, 0].float().log_softmax(-1)
    return scores


def test_eagle3_tree_scores_equal_path_by_path_chains(target):
    drafter = Eagle3Drafter(random_eagle3_head(target))
    prefill(drafter, target, "a", PROMPT, 7)
    batch = drafter.draft(["a"], TreeConfig(depth=3, topk=3, budget=8))
    (tree,) = batch.unbind()
    assert tree.num_nodes == 9 and int(tree.tokens[0]) == 7
    assert drafter.head.t2d[tree.tokens[1:]].all(), "draft tokens must be target ids inside the draft vocab"
    anc = tree.attention_mask()
    for node in range(1, tree.num_nodes):
        path = anc[node].nonzero().flatten()
        want = chain_scores(drafter, "a", tree.tokens[path])[-1]
        assert abs(float(tree.scores[node]) - want) < 1e-4, f"node {node}"


def test_eagle3_chain_is_greedy_rollout(target):
    drafter = Eagle3Drafter(random_eagle3_head(target))
    prefill(drafter, target, 0, PROMPT, 7)
    (chain,) = drafter.draft_chain([0], 4).unbind()
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    # greedy rollout: every step's argmax; chain_scores follows the chain, so each token
    # must be the argmax of the distribution it was drafted from
    for d in range(1, 5):
        alt = chain.tokens[: d + 1].clone()
        base = chain_scores(drafter, 0, alt)[-1]
        for other in drafter.token_map[:20].tolist():
            alt[d] = other
            assert chain_scores(drafter, 0, alt)[-1] <= base + 1e-5


@pytest.mark.parametrize("make_head", ["random_eagle3_head", "random_eagle1_head"])
def test_eagle_draft_leaves_state_untouched_and_commit_equals_prefill(target, make_head):
    head = globals()[make_head](target)
    drafter, fresh = Eagle3Drafter(head), Eagle3Drafter(head)
    prefill(drafter, target, 0, PROMPT, 7)
    first = drafter.draft([0], TreeConfig(3, 2, 5))
    again = drafter.draft([0], TreeConfig(3, 2, 5))
    assert torch.equal(first.candidates, again.candidates) and torch.equal(first.scores, again.scores)
    # commit 2 accepted tokens + bonus 9 after root 7; compare with prefill of the whole text
    layers = drafter.target_hidden_layers(target.config.num_hidden_layers)
    full = torch.cat([PROMPT, torch.tensor([7, 11, 12])])
    h = target_hidden(target, full, layers)
    drafter.commit([0], [torch.tensor([11, 12])], [h[len(PROMPT):]], torch.tensor([9]))
    fresh.prefill([0], [full], [h], torch.tensor([9]))
    a, b = drafter.roots[0], fresh.roots[0]
    assert a.key.shape[0] == b.key.shape[0] == len(full) and a.token == b.token == 9
    assert a.position == b.position == len(full) - 1
    for x, y in ((a.key, b.key), (a.value, b.value), (a.hidden, b.hidden), (a.logprobs, b.logprobs)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_eagle3_batch_equals_singles(target):
    head = random_eagle3_head(target)
    prompts = [PROMPT, PROMPT[:4], torch.tensor([1, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100])]
    firsts = [7, 8, 9]
    layers = head.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
    batched = Eagle3Drafter(head)
    batched.prefill(["x", "y", "z"], prompts, [target_hidden(target, p, layers) for p in prompts],
                    torch.tensor(firsts))
    trees = batched.draft(["x", "y", "z"], TreeConfig(3, 3, 6))
    for b, (p, f) in enumerate(zip(prompts, firsts)):
        single = Eagle3Drafter(head)
        prefill(single, target, 0, p, f)
        one = single.draft([0], TreeConfig(3, 3, 6))
        assert torch.equal(trees.candidates[b], one.candidates[0])
        assert torch.equal(trees.parents[b], one.parents[0])
        torch.testing.assert_close(trees.scores[b], one.scores[0], rtol=1e-4, atol=1e-4)


def test_eagle3_drafter_errors(target):
    drafter = Eagle3Drafter(random_eagle3_head(target))
    with pytest.raises(ValueError, match="prefill"):
        drafter.draft(["nope"])
    prefill(drafter, target, 0, PROMPT, 7)
    with pytest.raises(ValueError, match="hidden has 1 rows"):
        drafter.commit([0], [torch.tensor([3, 4])], [torch.zeros(1, drafter.head.config.fc_input_size)],
                       torch.tensor([5]))
    with pytest.raises(ValueError, match="one entry per request"):
        drafter.commit([0, 1], [torch.tensor([3])], [torch.zeros(2, 3)], torch.tensor([5]))
    drafter.release([0])
    assert 0 not in drafter.roots and drafter.drafting.length(0) == 0


# -- EAGLE-1 (the same drafter) ---------------------------------------------------------------
def test_eagle1_tree_scores_equal_path_by_path_chains(target):
    """Deeper nodes read their parent's head output as the feature, like one-at-a-time drafting."""
    drafter = EagleDrafter(random_eagle1_head(target))
    assert drafter.target_hidden_layers(4) == (4,) and drafter.token_map.shape == (target.config.vocab_size,)
    prefill(drafter, target, "a", PROMPT, 7)
    (tree,) = drafter.draft(["a"], TreeConfig(depth=3, topk=3, budget=8)).unbind()
    assert tree.num_nodes == 9 and int(tree.tokens[0]) == 7
    anc = tree.attention_mask()
    for node in range(1, tree.num_nodes):
        want = chain_scores(drafter, "a", tree.tokens[anc[node].nonzero().flatten()])[-1]
        assert abs(float(tree.scores[node]) - want) < 1e-4, f"node {node}"


# -- Medusa -----------------------------------------------------------------------------------
def test_medusa_tree_holds_each_heads_topk(target):
    heads = random_medusa_heads(target, num_heads=3)
    drafter = MedusaDrafter(heads)
    prefill(drafter, target, 0, PROMPT, 7)
    batch = drafter.draft([0], TreeConfig(depth=3, topk=3, budget=10))
    (tree,) = batch.unbind()
    template = drafter.template(TreeConfig(depth=3, topk=3, budget=10))
    assert tree.num_nodes == 11 and torch.equal(tree.parents, template.parents)
    hidden = target_hidden(target, PROMPT, (target.config.num_hidden_layers,))[-1]
    topk = heads(hidden[None, None])[:, 0, 0].topk(3, -1).indices  # [K, 3]
    assert int(tree.tokens[0]) == 7
    for node in range(1, tree.num_nodes):
        assert int(tree.tokens[node]) == int(topk[tree.depth[node] - 1, template.tokens[node]])
    # the final-norm output is what the heads read (hidden_states[L] == model.norm output)
    with torch.no_grad():
        last = target.model(PROMPT[None]).last_hidden_state[0, -1]
    torch.testing.assert_close(hidden, last)


def test_medusa_drafts_from_handed_hidden_states_equal_draft_after_prefill(target):
    """The stateless path engines use (vLLM hands the hidden state each step) drafts the
    same trees as prefill + draft, for a batch."""
    heads = random_medusa_heads(target, num_heads=3)
    drafter = MedusaDrafter(heads)
    config = TreeConfig(depth=3, topk=2, budget=6)
    prompts = [PROMPT, PROMPT[:5]]
    for rid, prompt in enumerate(prompts):
        prefill(drafter, target, rid, prompt, 7 + rid)
    hidden = torch.stack([target_hidden(target, p, (target.config.num_hidden_layers,))[-1] for p in prompts])
    stateful = drafter.draft([0, 1], config)
    stateless = drafter.fill(drafter.logits_from(hidden), torch.tensor([7, 8]), config)
    for a, b in zip(stateful, stateless):
        assert (a is None and b is None) or torch.equal(a, b)


def test_medusa_chain_choices_and_accuracies(target):
    heads = random_medusa_heads(target, num_heads=3)
    drafter = MedusaDrafter(heads)
    prefill(drafter, target, 0, PROMPT, 7)
    (chain,) = drafter.draft_chain([0], 3).unbind()
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    hidden = target_hidden(target, PROMPT, (target.config.num_hidden_layers,))[-1]
    assert chain.tokens[1:].tolist() == heads(hidden[None, None])[:, 0, 0].argmax(-1).tolist()
    choices = [[0], [1], [0, 0]]
    assert MedusaDrafter(heads, choices=choices).template(TreeConfig()).num_nodes == 4
    acc = prior_accuracies(3, 2)
    acc[1] = torch.tensor([1.0, 0.0], dtype=acc.dtype)  # head 1's top-1 always right: go deep, not wide
    prior = MedusaDrafter(heads).template(TreeConfig(3, 2, 2))
    measured = MedusaDrafter(heads, head_accuracies=acc).template(TreeConfig(3, 2, 2))
    assert prior.parents.tolist() == [-1, 0, 0] and measured.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="prefill"):
        drafter.draft([1])


def test_medusa_path_scores_are_the_accuracies_multiplied_along_each_path(target):
    """Each node's score is log of the product of accuracy[head, rank] over its path
    (what merging with retrieval's trees ranks); every request's tree carries them."""
    heads = random_medusa_heads(target, num_heads=3)
    acc = torch.tensor([[0.5, 0.2], [0.4, 0.1], [0.3, 0.05]], dtype=torch.float64)
    drafter = MedusaDrafter(heads, choices=[[0], [1], [0, 0], [0, 1], [0, 0, 0]], head_accuracies=acc)
    want = [1.0, 0.5, 0.2, 0.5 * 0.4, 0.5 * 0.1, 0.5 * 0.4 * 0.3]
    assert drafter.template(TreeConfig()).scores.exp().tolist() == pytest.approx(want, rel=1e-6)
    prefill(drafter, target, 0, PROMPT, 7)
    prefill(drafter, target, 1, PROMPT[:5], 8)
    tree = drafter.draft([0, 1], TreeConfig())
    assert tree.scores.exp().flatten().tolist() == pytest.approx(want * 2, rel=1e-6)
    prior = MedusaDrafter(heads).template(TreeConfig(3, 2, 2))  # no measured accuracies: the prior's
    assert prior.scores.exp().tolist() == pytest.approx([1.0, 0.6, 0.3], rel=1e-6)


def test_prior_accuracies_shape():
    acc = prior_accuracies(4, 3)
    assert acc.shape == (4, 3) and float(acc[0, 0]) == pytest.approx(0.6)
    assert (acc[1:] < acc[:-1]).all() and (acc[:, 1:] < acc[:, :-1]).all()
    tree, expected = optimal_sparse(acc, 10)
    assert tree.num_nodes == 11 and expected > 1
