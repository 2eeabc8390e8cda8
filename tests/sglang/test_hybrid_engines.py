"""Hybrid drafting in a real SGLang 0.5.23 CPU engine: a head's trees merged with the
retrieval drafter's under one node budget (SPECPLUG_RETRIEVAL=1, what a head section's
"retrieval": true asks for), for MEDUSA and SPECPLUG_EAGLE3.

Greedy output equals SGLang without speculation (`baseline`, conftest.py); one request at
a time on a flushed engine, it equals the engine-free reference loop drafting the same
merge (specplug.common.merge.MergedDrafter) token for token and step for step, where
the head alone would take a different number of steps."""

import pytest
import torch

from tests.sglang.conftest import GREEDY, PROMPTS, assert_greedy_matches, generate_ids, greedy_run, sglang_engine
from tests.sglang.test_eagle3_engine import TREE as EAGLE3_TREE, eagle3_head  # noqa: F401


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", params=["MEDUSA", "SPECPLUG_EAGLE3"])
def hybrid(request, sgl_model, medusa_heads, eagle3_head, baseline, monkeypatch_module):  # noqa: F811
    monkeypatch_module.setenv("SPECPLUG_RETRIEVAL", "1")
    head = medusa_heads if request.param == "MEDUSA" else eagle3_head
    with sglang_engine(sgl_model, speculative_algorithm=request.param,
                       speculative_draft_model_path=str(head)) as engine:
        yield request.param, head, engine


def test_greedy_batch4_matches_no_speculation(hybrid, baseline):
    _, _, engine = hybrid
    engine.flush_cache()
    run = greedy_run(engine, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert all(m["spec_verify_ct"] > 0 for m in run["meta"])


def merged_drafter(algorithm, target, head_dir):
    """(the reference loop's MergedDrafter of the head and retrieval, the tree) as the
    SGLang worker of `algorithm` drafts them: retrieval's paths as deep as the heads' tree."""
    from specplug.common.drafters import Eagle3Drafter, MedusaDrafter
    from specplug.common.formats import load_head_module
    from specplug.common.merge import MergedDrafter
    from specplug.common.retrieval import ReferenceDrafter
    from specplug.common.tree import TreeConfig
    from specplug.common.head_section import read_section

    head = load_head_module(head_dir)
    if algorithm == "MEDUSA":
        section = read_section(str(head_dir))
        drafter, tree = MedusaDrafter(head, head_accuracies=section["head_accuracies"]), TreeConfig(**section["tree"])
        depth = drafter.template(tree).max_depth
    else:
        head.set_target_embedding(target.get_input_embeddings())
        drafter, tree = Eagle3Drafter(head), TreeConfig(**EAGLE3_TREE)
        depth = tree.depth
    return MergedDrafter([drafter, ReferenceDrafter(depth=depth)]), tree


def test_trees_equal_the_reference_loops_merge(hybrid, sgl_model):
    from transformers import AutoModelForCausalLM

    from specplug.common import reference

    algorithm, head_dir, engine = hybrid
    target = AutoModelForCausalLM.from_pretrained(sgl_model, dtype=torch.float32).eval()
    accepted, steps_alone, steps = 0, 0, 0
    for prompt in PROMPTS:
        engine.flush_cache()  # retrieval's cache of finished requests: empty, as in a fresh reference loop
        out = generate_ids(engine, [prompt], GREEDY)[0]
        drafter, tree = merged_drafter(algorithm, target, head_dir)
        ref = reference.generate(target, drafter, prompt, GREEDY["max_new_tokens"], tree=tree)
        assert out["output_ids"] == ref.tokens
        assert out["meta_info"]["spec_verify_ct"] == ref.steps
        accepted, steps = accepted + len(ref.tokens) - ref.steps, steps + ref.steps
        head_alone = merged_drafter(algorithm, target, head_dir)[0].drafters[0]
        steps_alone += reference.generate(target, head_alone, prompt, GREEDY["max_new_tokens"], tree=tree).steps
    assert accepted > 0, "some drafts should be accepted, or this test proves little"
    assert steps != steps_alone, "retrieval's drafts changed nothing, so this test cannot tell a merge happened"
