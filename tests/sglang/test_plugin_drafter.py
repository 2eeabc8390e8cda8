"""Token drafters beyond RETRIEVAL in a real SGLang 0.5.23 CPU engine, with no engine code
of their own (the worker and verify step RETRIEVAL uses):

* `lookup` (tests/support/drafter_plugin): a third-party drafter, one class and one entry
  point in the group "specplug", run as --speculative-algorithm LOOKUP;
* the built-in "draft_model" (a small causal LM: the tiny target's first layer, cut out by
  `specplug draft-model cut`), run as --speculative-algorithm DRAFT_MODEL;
* the built-in "self_spec" (self-speculation on the modules SGLang loaded, here with all
  the target's layers, so its greedy drafts are the target's own), run as
  --speculative-algorithm SELF_SPEC.

Greedy, penalised and rule-laden output equal SGLang without speculation (`baseline`,
conftest.py). Sampled draft-model trees verified with q: test_draft_model_sampled.py.
vLLM runs the same classes beside its head (tests/vllm/test_hybrid.py)."""

import json

import pytest

from tests.sglang.conftest import (
    GREEDY, PENALISED, PROMPTS, RULES, assert_greedy_matches, generate_ids, greedy_run, sglang_engine,
)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", params=["lookup", "draft_model", "self_spec"])
def drafter_engine(request, sgl_model, monkeypatch_module, tmp_path_factory):
    if request.param == "lookup":
        monkeypatch_module.setenv("SPECPLUG_DRAFTER", '{"ngram": 1}')
    elif request.param == "self_spec":
        layers = json.loads((sgl_model / "config.json").read_text())["num_hidden_layers"]
        monkeypatch_module.setenv("SPECPLUG_DRAFTER", f'{{"layers": {layers}, "topk": 1}}')
    else:
        from specplug.common.draft_model import cut_draft_model

        draft = cut_draft_model(sgl_model, "0", tmp_path_factory.mktemp("draft") / "draft")
        monkeypatch_module.setenv("SPECPLUG_DRAFTER", f'{{"model": "{draft}", "topk": 2}}')
    with sglang_engine(sgl_model, speculative_algorithm=request.param.upper(), speculative_num_draft_tokens=5,
                       speculative_num_steps=3) as engine:
        yield engine


def test_greedy_batch4_matches_no_speculation(drafter_engine, baseline):
    run = greedy_run(drafter_engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert sum(m["spec_num_proposed_drafts"] for m in run["meta"]) > 0


def test_penalised_requests_match_no_speculation(drafter_engine, baseline):
    spec = [o["output_ids"] for o in generate_ids(drafter_engine, PROMPTS[:4], PENALISED)]
    assert spec == baseline["penalised"]


def test_logit_bias_min_new_tokens_and_penalties_match_no_speculation(drafter_engine, baseline):
    outs = generate_ids(drafter_engine, PROMPTS[:4], RULES)
    assert [o["output_ids"] for o in outs] == baseline["rules"]


def test_self_spec_on_all_layers_drafts_what_the_target_says(request, drafter_engine, baseline):
    """self_spec with every layer IS the target, run on SGLang's modules outside its
    forward: greedy chains of topk 1 are accepted whole (a wrong layer walk, norm or cache
    would be rejected at once on a random model)."""
    if request.node.callspec.params["drafter_engine"] != "self_spec":
        pytest.skip("self_spec only")
    run = greedy_run(drafter_engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    tokens = sum(len(ids) for ids in run["ids"])
    steps = sum(m["spec_verify_ct"] for m in run["meta"])
    assert tokens / steps >= 3.5, (tokens, steps)  # depth 3 + bonus = 4 per step, less near-ties and the ends
