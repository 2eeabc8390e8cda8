"""Payoff control in SGLang (on by default for every specplug algorithm): each decode step
verifies the drafted trees or the roots alone, whichever has delivered more tokens per
second at its batch size. Greedy output equals SGLang without speculation whatever it
chooses; SPECPLUG_EAGLE3's head, which skips the steps without drafts, drafts again after
them. (The suite's other engine tests pin the trees: conftest sets SPECPLUG_PAYOFF=0.)"""

import pytest

from tests.sglang.conftest import GREEDY, PROMPTS, assert_greedy_matches, greedy_run, sglang_engine
from tests.sglang.test_eagle3_engine import eagle3_head  # noqa: F401 (a fixture)


@pytest.fixture(scope="module", params=["RETRIEVAL", "MEDUSA", "SPECPLUG_EAGLE3"])
def payoff_engine(request, sgl_model, medusa_heads, eagle3_head, baseline):  # noqa: F811
    head = {"MEDUSA": medusa_heads, "SPECPLUG_EAGLE3": eagle3_head}.get(request.param)
    heads = {} if head is None else {"speculative_draft_model_path": str(head)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECPLUG_PAYOFF", "1")  # the user's default
        with sglang_engine(sgl_model, speculative_algorithm=request.param, **heads) as engine:
            yield engine


def test_greedy_output_equals_no_speculation_at_batch_4_and_1(payoff_engine, baseline):
    run = greedy_run(payoff_engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert sum(m["spec_num_proposed_drafts"] for m in run["meta"]) > 0  # it timed drafting steps
    for prompt, base in zip(PROMPTS[:2], baseline["greedy_bs1"]):
        assert greedy_run(payoff_engine, [prompt], GREEDY)["ids"][0] == base
