"""RETRIEVAL (specplug's model-free retrieval drafter) in a real SGLang 0.5.23 CPU engine:
greedy output equal to SGLang without speculation (`baseline`, conftest.py), drafts that
are verified and accepted, and lossless sampling at T > 0. The verify step is the one
MEDUSA uses (tree_worker.TreeVerifyWorker), whose typical-acceptance negative control
lives in test_medusa_engine.py."""

import pytest

from tests.sglang.conftest import (
    GREEDY, LONG_GREEDY, PENALISED, PROMPTS, RULES, SAMPLE_PROMPT, SAMPLED, SAMPLES, assert_greedy_matches,
    generate_ids, greedy_run, sglang_engine,
)
from tests.sglang.test_medusa_engine import ALPHA, POSITIONS, homogeneity_pvalue


@pytest.fixture(scope="module")
def retrieval(sgl_model):
    with sglang_engine(sgl_model, speculative_algorithm="RETRIEVAL") as engine:
        engine.flush_cache()  # no recent requests: each test's drafts come from its own requests
        yield engine


def test_greedy_batch4_mixed_lengths_matches_no_speculation(retrieval, baseline):
    retrieval.flush_cache()
    run = greedy_run(retrieval, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert sum(m["spec_num_proposed_drafts"] for m in run["meta"]) > 0
    assert max(m["spec_accept_length"] for m in run["meta"]) > 1.5  # repeating outputs: drafts accepted


def test_greedy_batch1_matches_no_speculation(retrieval, baseline):
    for prompt, base in zip(PROMPTS[:2], baseline["greedy_bs1"]):
        assert greedy_run(retrieval, [prompt], GREEDY)["ids"][0] == base


def test_long_greedy_with_the_recent_cache_matches_no_speculation(retrieval, baseline):
    """96 tokens per request, after the tests above left their requests in the drafter's
    cache of recent requests: drafts now also come from those."""
    run = greedy_run(retrieval, PROMPTS, LONG_GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["long"]["ids"], baseline["long"]["gaps"]) == 0


def test_penalised_requests_match_no_speculation(retrieval, baseline):
    spec = [o["output_ids"] for o in generate_ids(retrieval, PROMPTS[:4], PENALISED)]
    assert spec == baseline["penalised"]


def test_sampling_at_t08_matches_no_speculation(retrieval, baseline):
    """Lossless at T > 0: SAMPLES requests of one prompt, so from the first finished
    ones on, the recent-request cache supplies drafts for the generated positions."""
    retrieval.flush_cache()
    outs = generate_ids(retrieval, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > 0.05 * SAMPLES
    ids = [o["output_ids"] for o in outs]
    for position in POSITIONS:
        assert homogeneity_pvalue(ids, baseline["sampled"], position) > ALPHA, position


def test_logit_bias_min_new_tokens_and_penalties_match_no_speculation(retrieval, baseline):
    """Per-node rules: penalised requests draft and accept like any other (no longer their
    root alone), and every output equals SGLang without speculation."""
    outs = generate_ids(retrieval, PROMPTS[:4], RULES)
    assert [o["output_ids"] for o in outs] == baseline["rules"]
    assert max(o["meta_info"]["spec_accept_length"] for o in outs[:3]) > 1.0  # penalised rows accepted drafts
