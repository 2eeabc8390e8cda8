"""Hybrid drafting in vLLM: retrieval candidates merged with the head's tree, both stages.

Greedy output equals vLLM without speculation; retrieval candidates reach the verified
trees (prompts that repeat themselves are drafted from their own tokens); finished
requests join the drafter's cache of recent requests; bad settings fail at start."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.vllm.conftest import NUM_SPEC_TOKENS, SPECPLUG_CHAIN, drafter_of  # noqa: E402
from tests.vllm.test_stage_chain import params, run, token_ids  # noqa: E402
from tests.vllm.test_stage_tree import BUDGET, SPECPLUG_TREE_SECTION  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = pytest.mark.vllm

RETRIEVAL = {"budget": 4, "max_depth": 4, "min_prob": 0.0}
# prompts that repeat a phrase: the model's continuations often repeat it too
REPEATING = ["one two three four one two three four one two three four one two",
             "the cat and the dog the cat and the dog the cat and the",
             "red fox red fox red fox red fox red",
             "a b c d e a b c d e a b c"]


@pytest.fixture(scope="session", params=["chain", "tree"])
def hybrid(request, engine, target):
    section = SPECPLUG_CHAIN if request.param == "chain" else SPECPLUG_TREE_SECTION
    head = tiny_head_dir(target, specplug={**section, "retrieval": RETRIEVAL})
    spec_tokens = 3 if request.param == "chain" else BUDGET
    return engine(target, head, num_spec_tokens=spec_tokens)


def test_greedy_matches_no_speculation(engine, target, hybrid):
    sampling = params(max_tokens=32, temperature=0.0)
    spec, stats = run(hybrid, REPEATING, sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))


def test_retrieval_candidates_reach_the_drafts(hybrid):
    """Retrieval offers candidates beside the head's in some steps (stage chain: the
    merged trie's best path, path_choice.best_merged_chains; stage tree: the merged tree)."""
    drafter = drafter_of(hybrid)
    assert drafter.session.token_drafter is not None
    found, token_trees = [], drafter.session._token_trees

    def recording(trees, req_ids, depth, budget):
        offered = token_trees(trees, req_ids, depth, budget)
        found.append(bool((offered.num_nodes > 1).any()))
        return offered

    drafter.session._token_trees = recording
    try:
        hybrid.generate(REPEATING, params(max_tokens=24, temperature=0.0), use_tqdm=False)
    finally:
        del drafter.session._token_trees
    assert any(found)
    assert len(drafter.session.token_drafter.cache) > 0  # finished requests joined the cache


def test_a_fresh_bench_run_starts_without_the_earlier_runs_requests(hybrid):
    """`specplug bench` runs the same prompts at each batch size; a fresh run first empties
    what drafting would reuse (VllmRunner._forget_earlier_runs: the prefix cache, and on
    every worker retrieval's cache of recent requests, which the earlier run's requests,
    freed at the next step, never join), so the same greedy run drafts and accepts the same
    again. Negative control: without it, the next run drafts from the earlier outputs and
    accepts more."""
    from specplug.vllm_eagle3.bench_runner import VllmRunner

    retrieval = drafter_of(hybrid).session.token_drafter
    sampling = params(max_tokens=24, temperature=0.0)

    def fresh_run():
        VllmRunner._forget_earlier_runs(hybrid)
        assert len(retrieval.cache) == 0
        return run(hybrid, REPEATING, sampling)[1]

    first, again = fresh_run(), fresh_run()
    assert (again.num_steps, again.num_draft_tokens, again.num_accepted) == (
        first.num_steps, first.num_draft_tokens, first.num_accepted)
    hybrid.reset_prefix_cache()
    remembered = run(hybrid, REPEATING, sampling)[1]  # the earlier run's requests join the cache
    assert len(retrieval.cache) >= len(REPEATING)
    assert remembered.num_accepted > first.num_accepted


def test_bad_retrieval_settings_fail_at_start():
    from specplug.vllm_eagle3.settings import adapter_settings

    with pytest.raises(ValueError, match="unknown field"):
        adapter_settings({"retrieval": {"bugdet": 4}})
    with pytest.raises(ValueError, match="SPECPLUG_RETRIEVAL"):
        adapter_settings({}, {"SPECPLUG_RETRIEVAL": "{not json"})
    assert adapter_settings({"retrieval": True}, {"SPECPLUG_RETRIEVAL": "0"}).drafter is None
    assert adapter_settings({}, {"SPECPLUG_RETRIEVAL": '{"budget": 2}'}).drafter.settings["budget"] == 2


def test_drafted_alone_skip_the_head_and_stay_lossless(engine, target):
    """head_skip: steps where retrieval's best chain expects >= 0.5 accepted tokens draft
    from retrieval alone (the head's catch-up deferred); greedy output is unchanged and
    the head is back in sync whenever it drafts again."""
    head = tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "retrieval": {**RETRIEVAL, "head_skip": 0.5}})
    llm = engine(target, head)
    sampling = params(max_tokens=48, temperature=0.0)
    spec = token_ids(llm.generate(REPEATING, sampling, use_tqdm=False))
    assert drafter_of(llm).session.drafted_alone > 0
    assert spec == token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))


def test_calibrated_hybrid_learns_and_stays_lossless(engine, target):
    """"calibrate": the head's and retrieval's nodes are ranked on acceptance measured in
    this engine; the verified chains are counted for both sources and greedy output is
    unchanged."""
    head = tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "retrieval": RETRIEVAL, "calibrate": True})
    llm = engine(target, head)
    sampling = params(max_tokens=32, temperature=0.0)
    spec, stats = run(llm, REPEATING, sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))
    verified = drafter_of(llm).session.scale.calibration.verified.sum(1)  # [head, tokens]
    assert (verified > 0).all()


def test_draft_temperature_setting():
    from specplug.vllm_eagle3.settings import adapter_settings

    assert adapter_settings({}).draft_temperature is None
    assert adapter_settings({"draft_temperature": 0.7}).draft_temperature == 0.7
    assert adapter_settings({"draft_temperature": 0.7}, {"SPECPLUG_DRAFT_TEMPERATURE": "0"}).draft_temperature is None
    with pytest.raises(ValueError, match="SPECPLUG_DRAFT_TEMPERATURE must be a temperature > 0"):
        adapter_settings({}, {"SPECPLUG_DRAFT_TEMPERATURE": "-1"})
    with pytest.raises(ValueError, match="stage 'tree' in vLLM does not support 'draft_temperature'"):
        adapter_settings({"stage": "tree", "draft_temperature": 0.7})


def test_calibrate_flag():
    from specplug.vllm_eagle3.settings import adapter_settings

    assert not adapter_settings({}).calibrate
    assert adapter_settings({"calibrate": True}).calibrate
    assert not adapter_settings({"calibrate": True}, {"SPECPLUG_CALIBRATE": "0"}).calibrate
    with pytest.raises(TypeError, match="calibrate"):
        adapter_settings({"calibrate": "yes"})
    with pytest.raises(ValueError, match="SPECPLUG_CALIBRATE"):
        adapter_settings({}, {"SPECPLUG_CALIBRATE": "maybe"})


@pytest.mark.parametrize("name, cls", [("lookup", "LookupDrafter"), ("draft_model", "DraftModelTokenDrafter"),
                                       ("self_spec", "SelfSpecTokenDrafter")])
def test_a_registered_drafter_runs_beside_the_head(engine, target, tmp_path_factory, name, cls):
    """Token drafters named in the head's section draft beside the head with no engine
    code of their own; greedy output equals vLLM without speculation. `lookup`:
    tests/support/drafter_plugin, one class and one entry point in the group "specplug";
    "draft_model": built in, here the target's first layer cut out by `specplug
    draft-model cut`; "self_spec": built in, the target's layers 0 and 2 as vLLM loaded
    them. SGLang runs all three alone (tests/sglang/test_plugin_drafter.py)."""
    from specplug.common.draft_model import cut_draft_model

    drafter = {"name": "lookup", "ngram": 1}
    if name == "draft_model":
        draft = cut_draft_model(target, "0", tmp_path_factory.mktemp("draft") / "draft")
        drafter = {"name": "draft_model", "model": str(draft), "max_depth": 3, "topk": 2}
    if name == "self_spec":
        drafter = {"name": "self_spec", "layers": "0,2", "max_depth": 3, "topk": 2}
    llm = engine(target, tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "drafter": drafter}))
    sampling = params(max_tokens=32, temperature=0.0)
    spec, stats = run(llm, REPEATING, sampling)
    assert type(drafter_of(llm).session.token_drafter).__name__ == cls
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))


@pytest.mark.parametrize("layers", ["0-3", "0,2"])
def test_self_spec_runs_the_targets_own_layers_as_vllm_loaded_them(engine, target, layers):
    """The self_spec draft model is vLLM's loaded target with layers skipped, no copy of
    its weights: its logits equal Hugging Face's on the same layers (all four: the target
    itself; 0 and 2: the layer-skip view), in one pass and through its cache in chunks."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from specplug.common.draft_model import layer_skip_view

    drafter = {"name": "self_spec", "layers": layers, "max_depth": 3, "topk": 2}
    llm = engine(target, tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "drafter": drafter}))
    model = drafter_of(llm).session.token_drafter.drafter.model
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    view = layer_skip_view(hf, layers)
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 8]])
    positions = torch.arange(8)[None]
    with torch.no_grad():
        want = view(ids, position_ids=positions).logits
        whole = model(ids, past_key_values=DynamicCache(config=model.cache_config), position_ids=positions).logits
        cache = DynamicCache(config=model.cache_config)
        parts = [model(ids[:, a:b], past_key_values=cache, position_ids=positions[:, a:b]).logits
                 for a, b in ((0, 5), (5, 6), (6, 8))]
    assert torch.allclose(whole, want, atol=1e-4), (whole - want).abs().max()
    assert torch.allclose(torch.cat(parts, 1), want, atol=1e-4)
    loaded = drafter_of(llm).state.runner.model.model  # vLLM's target: the draft model holds its modules
    assert model.embed is loaded.embed_tokens and model.layers[-1] is loaded.layers[int(layers[-1])]


def test_draft_gate_withholds_chains_per_request_and_stays_lossless(engine, target, monkeypatch):
    """"gate": each request's chain is handed vLLM only where the draft gate keeps it
    (per request: a batch mixes requests with and without drafts, vLLM verifying exactly
    what each got). Greedy output is unchanged with the gate's own choices (on this
    engine's timings) and with a forced pattern that withholds every other chain."""
    head = tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "retrieval": RETRIEVAL, "gate": True})
    llm = engine(target, head)
    gate = drafter_of(llm).session.gate
    sampling = params(max_tokens=32, temperature=0.0)
    baseline = token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))
    assert token_ids(llm.generate(REPEATING, sampling, use_tqdm=False)) == baseline
    assert gate.drafted + gate.withheld > 0
    flips = iter([True, False] * 1000)
    monkeypatch.setattr(gate, "choose", lambda expected, batch, drafts: torch.tensor(
        [next(flips) for _ in range(len(expected))]))
    spec, stats = run(llm, REPEATING, sampling)
    assert stats.num_steps > 0
    assert spec == baseline


def test_gate_flag():
    from specplug.vllm_eagle3.settings import adapter_settings

    assert not adapter_settings({}).gate
    assert adapter_settings({"gate": True}).gate
    assert not adapter_settings({"gate": True}, {"SPECPLUG_GATE": "0"}).gate
    with pytest.raises(ValueError, match="stage 'tree' in vLLM does not support 'gate'.*SPECPLUG_GATE"):
        adapter_settings({"stage": "tree", "gate": True})
    with pytest.raises(ValueError, match="stage 'tree' in vLLM does not support 'adaptive'.*SPECPLUG_ADAPTIVE"):
        adapter_settings({"stage": "tree", "adaptive": True})


def test_steps_without_drafts_leave_the_token_drafter_to_catch_up_when_drafting_resumes(engine, target,
                                                                                        monkeypatch):
    """With payoff control, a step that drafts nothing does not touch the token drafter;
    the next step that drafts fills in the tokens it skipped from vLLM's request state.
    Forced depths 0, 0, 0, 3, ...: at every drafting step the drafter holds exactly the
    tokens vLLM committed (its request state, then the token sampled this step), and greedy
    output is unchanged."""
    monkeypatch.delenv("SPECPLUG_PAYOFF", raising=False)
    head = tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "retrieval": RETRIEVAL, "payoff": True})
    llm = engine(target, head)
    proposer = drafter_of(llm)
    depths, chosen = iter([0, 0, 0, NUM_SPEC_TOKENS] * 1000), []
    monkeypatch.setattr(proposer.policy.payoff.control, "choose",
                        lambda batch: chosen.append(next(depths)) or chosen[-1])
    synced, held, sync = [], [], proposer.session.sync_committed

    def checked(requests, known):
        synced.append(len(requests))
        sync(requests, known)
        for req_id, *_ in requests:
            held.append(proposer.session.token_drafter.tokens(req_id)[:-1] == proposer.state.known_tokens(req_id))

    monkeypatch.setattr(proposer.session, "sync_committed", checked)
    sampling = params(max_tokens=32, temperature=0.0)
    spec, stats = run(llm, REPEATING, sampling)
    assert stats.num_steps > 0 and held and all(held)
    assert len(synced) == sum(d > 0 for d in chosen)  # synced at drafting steps only
    assert spec == token_ids(engine(target).generate(REPEATING, sampling, use_tqdm=False))
