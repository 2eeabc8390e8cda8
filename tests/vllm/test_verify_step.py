"""specplug.common.verify_step in vLLM: a seeded sampled request (T > 0, SamplingParams
`seed`) gives the same text alone and inside a batch of 8 mixed requests (greedy, other
seeds, unseeded), each run twice, in stage "chain" chains, stage "tree" trees and chains whose
unseeded requests' drafts are drawn from the head's q (so the batch mixes all three
rules: greedy, coupled, block verification with q). Another seed gives other text
(control)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.support.tiny_eagle3 import tiny_head_dir
from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN
from tests.vllm.test_stage_chain import params, run
from tests.vllm.test_stage_tree import BUDGET, tree_head  # noqa: F401 (fixture)

pytestmark = pytest.mark.vllm

TOKENS = 32
SEEDED = dict(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=4321)
COMPANIONS = [dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=1.0),
              dict(temperature=0.7, top_k=20, seed=2), dict(temperature=0.0, repetition_penalty=1.2),
              dict(temperature=0.6), dict(temperature=1.2, min_p=0.05)]


@pytest.fixture(scope="session", params=["chain", "tree", "chain-drafts-from-q"])
def spec_engine(request, engine, target, specplug_head, tree_head):  # noqa: F811
    if request.param == "chain":
        return engine(target, specplug_head)
    if request.param == "tree":
        return engine(target, tree_head, num_spec_tokens=BUDGET)
    return engine(target, tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "draft_temperature": 1.0}))


def _seeded_text(llm, place: int | None):
    """The seeded request's tokens: alone (place None) or at `place` among the companions."""
    if place is None:
        return run(llm, [PROMPTS[2]], [params(**SEEDED)])
    sampling = [params(max_tokens=TOKENS, **c) for c in COMPANIONS]
    prompts = [p for p in PROMPTS[:8] if p != PROMPTS[2]][:len(COMPANIONS)]
    sampling.insert(place, params(**SEEDED))
    prompts.insert(place, PROMPTS[2])
    ids, stats = run(llm, prompts, sampling)
    return [ids[place]], stats


@pytest.fixture
def rules_seen(monkeypatch):
    """The rules verify_step chose for the requests of every step (engines run in-process)."""
    from specplug.common.verify_step import chain_rows, choose_rule
    from specplug.vllm_eagle3 import sampler

    seen, real = set(), sampler.verify_step

    def recording(logits, candidates, parents, num_nodes, params, **kw):
        drawn = kw.get("draft_probs") or {}
        chain = chain_rows(parents, num_nodes).tolist()
        seen.update(choose_rule(p, b in drawn, chain=chain[b]) for b, p in enumerate(params))
        return real(logits, candidates, parents, num_nodes, params, **kw)

    monkeypatch.setattr(sampler, "verify_step", recording)
    return seen


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(request, spec_engine, rules_seen):
    texts = []
    for place in (None, 7, None, 3):  # alone, in the batch, alone again, in the batch at another row
        ids, stats = _seeded_text(spec_engine, place)
        assert stats.num_steps > 0
        texts.append(ids[0])
    assert len(texts[0]) == TOKENS and all(t == texts[0] for t in texts), texts
    other = run(spec_engine, [PROMPTS[2]], [params(**{**SEEDED, "seed": 99})])[0][0]
    assert other != texts[0]
    drafts_from_q = request.node.callspec.params["spec_engine"] == "chain-drafts-from-q"
    assert rules_seen == {"greedy", "coupled"} | ({"block"} if drafts_from_q else set())
