"""specplug.common.request_rules: each tree node's row is processed as plain decoding
would process the logits after committed + path(root -> node).

Exact checks against a per-sequence reference for every rule, on a chain and a tree,
with a negative control (rows processed without their path differ). Then a statistical
proof that verification with processed rows keeps the distribution of plain decoding
under penalties + min-p (vLLM's and SGLang's order): 100,000 requests, chi-square on the first two tokens jointly,
threshold p < 1e-5 (a correct sampler fails < 0.01 % of fresh seeds; seeds are fixed),
and the same test fails for rows processed without their path (negative control).
"""

from __future__ import annotations

import pytest
import torch

from specplug.common import sampling as S
from specplug.common.request_rules import RequestRules, apply_rules
from specplug.common.target_probs import process_logits
from tests.common.test_sampling_lossless import chi_square_pvalue

V = 12
CHAIN = torch.tensor([[-1, 0, 1, 2]])
TREE = torch.tensor([[-1, 0, 0, 1, 1, 3]])


def _reference_row(logits, rules: RequestRules, history: list[int], depth: int):
    """Plain decoding's processing of one row after `history` (output + path)."""
    x = logits.clone()
    if rules.allowed is not None:
        x[~rules.allowed[0]] = float("-inf")
    for word in rules.bad_words.get(0, []):
        if len(word) == 1 or history[-(len(word) - 1):] == word[:-1]:
            x[word[-1]] = float("-inf")
    for token, bias in rules.logit_bias.get(0, {}).items():
        x[token] += bias
    if 0 in rules.min_tokens and depth < rules.min_tokens[0][0]:
        x[sorted(rules.min_tokens[0][1])] = float("-inf")
    if rules.has_penalties:
        counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=V).float()
        seen = rules.prompt_mask[0] | (counts > 0)
        rep = torch.where(seen, rules.repetition[0], 1.0)
        x = x * torch.where(x > 0, 1.0 / rep, rep)
        x = x - rules.frequency[0] * counts - rules.presence[0] * (counts > 0)
    return x


def _sglang_reference_row(logits, rules: RequestRules, history: list[int], depth: int):
    """SGLang's penaltylib after `history`, transcribed: cumulated rows built token by token
    (scatter_add / scatter), added as one additive row, repetition scaling, logit bias."""
    x, additive = logits.clone(), torch.zeros(V)
    if 0 in rules.min_tokens and depth < rules.min_tokens[0][0]:
        additive[sorted(rules.min_tokens[0][1])] = float("-inf")
    if rules.has_penalties:
        frequency, presence, scaling = torch.zeros(V), torch.zeros(V), torch.ones(V)
        for token in history:
            frequency[token] += rules.frequency[0]
            presence[token] = rules.presence[0]
            scaling[token] = rules.repetition[0]
        x = x + (additive - frequency - presence)
        x = torch.where(x < 0, x * scaling, x / scaling)
    else:
        x = x + additive
    for token, bias in rules.logit_bias.get(0, {}).items():
        x[token] += bias
    return x


def _path(parents: list[int], candidates: list[int], node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(candidates[node])
        node = parents[node]
    return path[::-1]


RULE_SETS = {
    "penalties": dict(presence=torch.tensor([0.7]), frequency=torch.tensor([0.4]), repetition=torch.tensor([1.5]),
                      prompt_mask=torch.arange(V)[None] % 5 == 0),
    "bad_words": dict(bad_words={0: [[3], [4, 5], [2, 2, 7]]}),
    "allowed": dict(allowed=torch.arange(V)[None] < 9),
    "logit_bias": dict(logit_bias={0: {1: 3.0, 6: -2.0}}),
    "min_tokens": dict(min_tokens={0: (2, {0, 11})}),
}


SGLANG_RULES = ("penalties", "logit_bias", "min_tokens")  # what SGLang's sampler offers


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("rule", SGLANG_RULES)
def test_sglang_rows_equal_sglangs_plain_decoding_after_their_path(rule, shape):
    g = torch.Generator().manual_seed(3)
    parents = CHAIN if shape == "chain" else TREE
    n = parents.shape[1]
    candidates = torch.randint(0, V, (1, n), generator=g)
    candidates[0, 1:3] = torch.tensor([5, 5])  # a token seen before, twice on the path
    logits = torch.randn(n, V, generator=g) * 3
    fields = {k: v for k, v in RULE_SETS[rule].items() if k != "prompt_mask"}  # SGLang: output tokens only
    rules = RequestRules(output_tokens=[[2, 5, 2]], engine="sglang", **fields)
    out = apply_rules(logits, rules, candidates, parents, torch.tensor([n]))
    for i in range(n):
        path = _path(parents[0].tolist(), candidates[0].tolist(), i)
        expected = _sglang_reference_row(logits[i], rules, rules.output_tokens[0] + path, len(path))
        torch.testing.assert_close(out[i], expected, rtol=1e-6, atol=1e-6)
    if rule == "penalties":  # negative control: vLLM's order and scope give other rows
        vllm = apply_rules(logits, RequestRules(output_tokens=[[2, 5, 2]], **fields), candidates, parents,
                           torch.tensor([n]))
        assert not torch.allclose(vllm, out)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of"):
        RequestRules(engine="tgi")


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("rule", sorted(RULE_SETS))
def test_rows_equal_plain_decoding_after_their_path(rule, shape):
    g = torch.Generator().manual_seed(1)
    parents = CHAIN if shape == "chain" else TREE
    n = parents.shape[1]
    candidates = torch.randint(0, V, (1, n), generator=g)
    candidates[0, 1:3] = torch.tensor([4, 2])  # paths that complete bad words
    logits = torch.randn(n, V, generator=g)
    rules = RequestRules(output_tokens=[[2, 5, 2]], **RULE_SETS[rule])
    out = apply_rules(logits, rules, candidates, parents, torch.tensor([n]))
    for i in range(n):
        path = _path(parents[0].tolist(), candidates[0].tolist(), i)
        expected = _reference_row(logits[i], rules, rules.output_tokens[0] + path, len(path))
        torch.testing.assert_close(out[i], expected, rtol=0, atol=1e-6)


def test_rows_processed_without_their_path_differ():
    """Negative control: the path matters (the reference with committed tokens only differs)."""
    g = torch.Generator().manual_seed(2)
    candidates = torch.tensor([[0, 3, 3, 3]])
    logits = torch.randn(4, V, generator=g).abs() + 0.1
    rules = RequestRules(output_tokens=[[1]], **RULE_SETS["penalties"])
    out = apply_rules(logits, rules, candidates, CHAIN, torch.tensor([4]))
    without_path = _reference_row(logits[3], rules, [1], 0)
    assert not torch.allclose(out[3], without_path)


def test_no_rules_is_the_identity():
    logits = torch.randn(4, V)
    assert apply_rules(logits, RequestRules(output_tokens=[[]]), torch.zeros(1, 4, dtype=torch.long), CHAIN,
                       torch.tensor([4])) is logits


# --- distribution: penalties + min-p, tree verification, 100,000 requests -------------------
SAMPLES, ALPHA, MIN_P, ROOT = 100_000, 1e-5, 0.05, 0
PENALTIES = dict(presence=torch.tensor([0.6]), frequency=torch.tensor([0.5]), repetition=torch.tensor([1.3]),
                 prompt_mask=torch.zeros(1, 8, dtype=torch.bool))
BINARY = torch.tensor([-1, 0, 0, 1, 1, 2, 2])


def _toy_logits(vocab=8):
    """Target logits after prev token: Float [V, V]."""
    return 1.5 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3))


def _rules(history, engine):
    penalties = PENALTIES if engine == "vllm" else {k: v for k, v in PENALTIES.items() if k != "prompt_mask"}
    return RequestRules(output_tokens=[history], engine=engine, **penalties)


def _plain_probs(logits_row, history, engine="vllm"):
    rules = _rules(history, engine)
    x = apply_rules(logits_row[None], rules, torch.tensor([[0]]), torch.tensor([[-1]]), torch.tensor([1]))
    return process_logits(x, 1.0, 0, 1.0, MIN_P)[0]


def _speculative_two_tokens(L, with_path: bool, gen, engine):
    """First two tokens of SAMPLES requests: a binary tree of the target's top-2 tokens,
    rows processed by apply_rules (or, wrongly, each without its path)."""
    cand = torch.zeros(7, dtype=torch.long)
    for j in range(1, 7):
        cand[j] = L[cand[BINARY[j]]].argsort(descending=True)[(j - 1) % 2]
    if with_path:
        rows = apply_rules(L[cand], _rules([], engine), cand[None], BINARY[None], torch.tensor([7]))
        p = process_logits(rows, 1.0, 0, 1.0, MIN_P)  # [7, V]
    else:
        p = torch.stack([_plain_probs(L[c], [], engine) for c in cand.tolist()])
    res = S.verify(cand.expand(SAMPLES, 7), BINARY.expand(SAMPLES, 7), p.expand(SAMPLES, 7, 8), method="rejection",
                   uniforms=torch.rand(SAMPLES, 8, generator=gen))
    out = res.output_tokens(cand.expand(SAMPLES, 7))[:, :2].clone()
    short = res.num_accepted == 0
    for x1 in out[short, 0].unique().tolist():  # second step: plain decoding after x1
        rows_x1 = short & (out[:, 0] == x1)
        second = _plain_probs(L[x1], [x1], engine)
        out[rows_x1, 1] = torch.multinomial(second, int(rows_x1.sum()), replacement=True, generator=gen)
    return out


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("with_path", [True, False])
def test_penalties_and_min_p_keep_plain_decodings_distribution(with_path, engine):
    L = _toy_logits()
    p1 = _plain_probs(L[ROOT], [], engine)
    joint = torch.stack([p1[x] * _plain_probs(L[x], [x], engine) for x in range(8)])  # [V, V]
    out = _speculative_two_tokens(L, with_path, torch.Generator().manual_seed(4), engine)
    pvalue = chi_square_pvalue(out[:, 0] * 8 + out[:, 1], joint)
    if with_path:
        assert pvalue > ALPHA
    else:  # negative control
        assert pvalue < ALPHA


def test_structured_output_key_names_the_field_a_request_sets():
    from specplug.common.request_rules import structured_output_key

    assert structured_output_key({"temperature": 0.5, "regex": None}) is None
    assert structured_output_key([{"max_new_tokens": 4}, {"json_schema": "{}"}]) == "json_schema"
    assert structured_output_key(None) is None and structured_output_key({"ebnf": "root ::= x"}) == "ebnf"
