"""SPECPLUG_EAGLE3 in a real SGLang 0.5.23 CPU engine: EAGLE-3 heads with dynamic trees,
drafted by the core (specplug.common.drafting) that the vLLM adapter and the reference
loop also run.

- greedy output equals SGLang without speculation (batch 4 and 1, with penalties and
  other per-node rules), and equals the engine-free reference loop token for token with
  the same verify-step count (so SGLang's aux states, the catch-up rows and the trees are
  the reference's);
- T = 0.8 with top-k trees (target-only rule): chi-square homogeneity against no
  speculation, with the negative control in test_medusa_engine (typical acceptance) for
  the same test.
test_eagle3_own_engines.py: trees sampled from q (verified with q) at T = 0.8, and
branching trees accepted deep on a constant target."""

import pytest
import torch

from tests.sglang.conftest import (
    GREEDY, PENALISED, PROMPTS, RULES, SAMPLE_PROMPT, SAMPLED, SAMPLES, assert_greedy_matches, generate_ids, greedy_run,
    sglang_engine,
)
from tests.sglang.test_medusa_engine import ALPHA, POSITIONS, homogeneity_pvalue
from tests.support.tiny_eagle3 import tiny_head_dir

ALGORITHM = "SPECPLUG_EAGLE3"
TREE = {"depth": 3, "topk": 2, "budget": 6}  # the head's specplug.tree: small, branching


@pytest.fixture(scope="module")
def eagle3_head(sgl_model):
    return tiny_head_dir(sgl_model, specplug={"version": 1, "method": "eagle3", "tree": TREE})


@pytest.fixture(scope="module")
def eagle3(sgl_model, eagle3_head, baseline):  # baseline first: its engine's shutdown kills every scheduler
    with sglang_engine(sgl_model, speculative_algorithm=ALGORITHM,
                       speculative_draft_model_path=str(eagle3_head)) as engine:
        yield engine


def test_greedy_batch4_mixed_lengths_matches_no_speculation(eagle3, baseline):
    run = greedy_run(eagle3, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert all(m["spec_verify_ct"] > 0 for m in run["meta"])


def test_greedy_batch1_matches_no_speculation(eagle3, baseline):
    for prompt, base in zip(PROMPTS[:2], baseline["greedy_bs1"]):
        assert greedy_run(eagle3, [prompt], GREEDY)["ids"][0] == base


def test_penalties_and_rules_match_no_speculation(eagle3, baseline):
    assert [o["output_ids"] for o in generate_ids(eagle3, PROMPTS[:4], PENALISED)] == baseline["penalised"]
    assert [o["output_ids"] for o in generate_ids(eagle3, PROMPTS[:4], RULES)] == baseline["rules"]


def reference_run(target_dir, head_dir, prompts, tree, weights="float") -> list:
    """specplug's engine-free reference loop, greedy, with the head and tree SGLang uses
    (its linears after fc with int8 or int4 weights, as "head_weights" runs them, if
    `weights` says so)."""
    from transformers import AutoModelForCausalLM

    from specplug.common import reference
    from specplug.common.drafters import Eagle3Drafter
    from specplug.common.formats import load_head_module
    from specplug.common.tree import TreeConfig

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = load_head_module(head_dir)
    if weights != "float":
        from specplug.common.quantization import head_linears

        assert head_linears.swap_linears(head, head_linears.EAGLE3_MODULES, weights) is None
    if head.KIND == "EAGLE-1":
        head.set_target(target)  # its lm_head too
    else:
        head.set_target_embedding(target.get_input_embeddings())
    drafter = Eagle3Drafter(head)
    return [reference.generate(target, drafter, p, GREEDY["max_new_tokens"], tree=TreeConfig(**tree)) for p in prompts]


def assert_equals_reference(outs, refs) -> int:
    """Same tokens in as many verify steps (so each step accepted what the reference
    accepted); returns the draft tokens accepted in all."""
    for out, ref in zip(outs, refs):
        assert out["output_ids"] == ref.tokens
        assert out["meta_info"]["spec_verify_ct"] == ref.steps
    return sum(len(ref.tokens) - ref.steps for ref in refs)


def test_drafts_equal_the_engine_free_reference_loop(eagle3, sgl_model, eagle3_head):
    """Same head, same tree, greedy: SGLang's aux states, catch-up rows and trees are the
    reference loop's."""
    accepted = assert_equals_reference(generate_ids(eagle3, PROMPTS, GREEDY),
                                       reference_run(sgl_model, eagle3_head, PROMPTS, TREE))
    assert accepted > 0, "the random head should have some drafts accepted, or this test proves little"


def test_sampling_at_t08_matches_no_speculation(eagle3, baseline):
    """Lossless: deterministic trees verified with the target-only rule at T = 0.8."""
    outs = [o["output_ids"] for o in generate_ids(eagle3, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)]
    for position in POSITIONS:
        assert homogeneity_pvalue(outs, baseline["sampled"], position) > ALPHA, position
