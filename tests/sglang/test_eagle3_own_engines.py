"""SPECPLUG_EAGLE3 engines a test starts and shuts down itself, one at a time (see
test_eagle3_engine.py for the rest). They live in their own module because shutting an
SGLang engine down kills every scheduler of the process (SGLang's kill_process_tree): a
module-scoped engine alive at that moment would die, and its watchdog takes the test
process with it.

EAGLE-1 heads (the target's final hidden state, its lm_head) run through the same
worker: greedy output equals no speculation and the reference loop, step for step. So
does an EAGLE-3 head with int8 or int4 weights ("head_weights"), against the reference
loop running the same quantized head, and a two-layer EAGLE-3 head."""

import pytest


from tests.sglang.conftest import (
    GREEDY, PROMPTS, SAMPLE_PROMPT, SAMPLED, SAMPLES, assert_greedy_matches, generate_ids, greedy_run, sglang_engine,
)
from tests.sglang.test_eagle3_engine import (  # noqa: F401
    ALGORITHM, TREE, assert_equals_reference, eagle3_head, reference_run,
)
from tests.sglang.test_medusa_engine import ALPHA, POSITIONS, homogeneity_pvalue
from tests.support.tiny_eagle1 import eagle1_head_dir
from tests.support.tiny_eagle3 import (
    AGREE_TOKEN, TWO_DRAFT_TOKENS, constant_target_dir, tiny_head_dir, two_token_head_dir,
)

EAGLE1_TREE = {"depth": 4, "topk": 2, "budget": 8}


def test_sampled_drafts_at_t08_match_no_speculation(sgl_model, eagle3_head, baseline, monkeypatch):
    """Drafts drawn from q at T 0.8 (SPECPLUG_DRAFT_TEMPERATURE), verified with q: the
    tokens still follow the target's distribution."""
    monkeypatch.setenv("SPECPLUG_DRAFT_TEMPERATURE", "0.8")
    with sglang_engine(sgl_model, speculative_algorithm=ALGORITHM,
                       speculative_draft_model_path=str(eagle3_head)) as engine:
        outs = generate_ids(engine, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    for position in POSITIONS:
        assert homogeneity_pvalue([o["output_ids"] for o in outs], baseline["sampled"], position) > ALPHA, position


@pytest.mark.parametrize("fmt, setting", [("int8", {"head_int8": True}), ("int4", {"head_weights": "int4"})])
def test_quantized_head_weights_match_no_speculation_and_the_quantized_reference_loop(sgl_model, baseline, fmt,
                                                                                        setting):
    """"head_weights" (int8 through the older "head_int8"): greedy output equals SGLang
    without speculation, and the reference loop with the same quantized linears
    (quantization.head_linears.swap_linears) step for step, so the worker drafted with them."""
    head = tiny_head_dir(sgl_model, specplug={"version": 1, "method": "eagle3", "tree": TREE, **setting})
    with sglang_engine(sgl_model, speculative_algorithm=ALGORITHM, speculative_draft_model_path=str(head)) as engine:
        run = greedy_run(engine, PROMPTS, GREEDY)
        outs = generate_ids(engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert assert_equals_reference(outs, reference_run(sgl_model, head, PROMPTS, TREE, weights=fmt)) > 0


def test_two_layer_head_matches_no_speculation_and_the_reference_loop(sgl_model, baseline):
    """A two-layer EAGLE-3 head (layers.1.*, vLLM's multi-layer names): greedy output equals
    SGLang without speculation, and the reference loop step for step."""
    head = tiny_head_dir(sgl_model, specplug={"version": 1, "method": "eagle3", "tree": TREE}, num_hidden_layers=2)
    with sglang_engine(sgl_model, speculative_algorithm=ALGORITHM, speculative_draft_model_path=str(head)) as engine:
        run = greedy_run(engine, PROMPTS, GREEDY)
        outs = generate_ids(engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert assert_equals_reference(outs, reference_run(sgl_model, head, PROMPTS, TREE)) > 0


def test_branching_trees_on_the_constant_target_equal_the_reference_loop():
    """Every draft is one of the target's two likeliest tokens, so each step accepts a
    path through a branching tree (accepted nodes off the chain order); SGLang accepts
    exactly what the reference loop accepts."""
    target = constant_target_dir()
    tree = {"depth": 4, "topk": 2, "budget": 12}
    head = two_token_head_dir(target, specplug={"version": 1, "method": "eagle3", "tree": tree})
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    with sglang_engine(target, speculative_algorithm=ALGORITHM, speculative_draft_model_path=str(head)) as engine:
        outs = generate_ids(engine, prompts, GREEDY)
    assert all(set(out["output_ids"]) == {TWO_DRAFT_TOKENS[0]} for out in outs)  # the constant target's greedy output
    accepted = assert_equals_reference(outs, reference_run(target, head, prompts, tree))
    assert accepted >= sum(out["meta_info"]["spec_verify_ct"] for out in outs)  # about a draft per step, or more


def test_eagle1_head_matches_no_speculation_and_the_reference_loop(sgl_model, baseline):
    """An EAGLE-1 head (echo: its drafts repeat what the target predicted last) on the
    random target: greedy output equals SGLang without speculation, and equals the
    reference loop with as many verify steps, so SGLang's final hidden states and the
    target lm_head the head scores with are the reference's."""
    head = eagle1_head_dir(sgl_model, echo=True, specplug={"version": 1, "method": "eagle1", "tree": EAGLE1_TREE})
    with sglang_engine(sgl_model, speculative_algorithm=ALGORITHM, speculative_draft_model_path=str(head)) as engine:
        run = greedy_run(engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    outs = [{"output_ids": ids, "meta_info": meta} for ids, meta in zip(run["ids"], run["meta"])]
    assert assert_equals_reference(outs, reference_run(sgl_model, head, PROMPTS, EAGLE1_TREE)) > 0


def test_eagle1_head_on_the_constant_target_accepts_every_draft():
    """On the constant target the echo head's q is the target's p at every depth, so
    each step accepts a deep path (as deep as the 8-node tree keeps its likeliest
    branch), exactly as in the reference loop."""
    target = constant_target_dir()
    head = eagle1_head_dir(target, echo=True, specplug={"version": 1, "method": "eagle1", "tree": EAGLE1_TREE})
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    with sglang_engine(target, speculative_algorithm=ALGORITHM, speculative_draft_model_path=str(head)) as engine:
        outs = generate_ids(engine, prompts, GREEDY)
    assert all(set(out["output_ids"]) == {AGREE_TOKEN} for out in outs)
    accepted = assert_equals_reference(outs, reference_run(target, head, prompts, EAGLE1_TREE))
    assert accepted >= 2 * sum(out["meta_info"]["spec_verify_ct"] for out in outs)  # two drafts a step, or more
