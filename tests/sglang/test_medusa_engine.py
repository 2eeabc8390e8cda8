"""MEDUSA in a real SGLang 0.5.23 CPU engine: greedy equality, acceptance, and lossless T > 0.

Compared against SGLang without speculation (`baseline`, conftest.py) and against the
engine-free reference loop (specplug.common.reference) with the same heads and tree."""

import pytest
import torch

from tests.sglang.conftest import (
    GREEDY, PENALISED, PROMPTS, RULES, SAMPLE_PROMPT, SAMPLED, SAMPLES, assert_greedy_matches, generate_ids, greedy_run,
    sglang_engine,
)

# T = 0.8 test: chi-square homogeneity of the token at generated positions 1 and 2 (the
# first two tokens produced by verify steps; position 0 comes from prefill), SAMPLES
# requests per engine. Each position is tested at ALPHA, so a correct implementation
# fails with probability <= 2 * ALPHA = 0.2 %.
ALPHA = 1e-3
POSITIONS = (1, 2)


@pytest.fixture(scope="module")
def medusa(sgl_model, medusa_heads):
    with sglang_engine(sgl_model, speculative_algorithm="MEDUSA",
                       speculative_draft_model_path=str(medusa_heads)) as engine:
        yield engine


def test_plain_engine_matches_hf_greedy(sgl_model, baseline):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sgl_model, dtype=torch.float32).eval()
    for prompt, ids in zip(PROMPTS, baseline["greedy"]["ids"]):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY["max_new_tokens"], do_sample=False,
                             min_new_tokens=GREEDY["max_new_tokens"], pad_token_id=0)
        assert out[0, len(prompt):].tolist() == ids


def test_greedy_batch4_mixed_lengths_matches_no_speculation(medusa, baseline):
    run = greedy_run(medusa, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert all(m["spec_verify_ct"] > 0 for m in run["meta"])
    assert max(m["spec_accept_length"] for m in run["meta"]) > 1.5  # the heads do get accepted


def test_greedy_batch1_matches_no_speculation(medusa, baseline):
    for prompt, base in zip(PROMPTS[:2], baseline["greedy_bs1"]):
        assert greedy_run(medusa, [prompt], GREEDY)["ids"][0] == base


def test_penalised_requests_match_no_speculation(medusa, baseline):
    """Presence / frequency / repetition penalties beside a plain greedy request, applied
    per tree node along its own path (specplug.common.request_rules, engine "sglang"):
    every output equals SGLang without speculation."""
    spec = [o["output_ids"] for o in generate_ids(medusa, PROMPTS[:4], PENALISED)]
    assert spec == baseline["penalised"]


def test_acceptance_equals_engine_free_reference_loop(medusa, sgl_model, medusa_heads):
    """Same heads, same tree, greedy: SGLang's MEDUSA and specplug's reference loop emit the
    same tokens, and SGLang's accept length equals the reference's tau (tokens per verify
    step, the prefill token counted as SGLang counts it)."""
    from transformers import AutoModelForCausalLM

    from specplug.common import reference
    from specplug.common.drafters import MedusaDrafter
    from specplug.common.formats import load_head_module
    from specplug.common.head_section import read_section
    from specplug.common.tree import TreeConfig
    from specplug.common.metrics import AcceptanceStats

    target = AutoModelForCausalLM.from_pretrained(sgl_model, dtype=torch.float32).eval()
    section = read_section(str(medusa_heads))
    drafter = MedusaDrafter(load_head_module(medusa_heads), head_accuracies=section["head_accuracies"])
    tree = TreeConfig.from_dict(section["tree"])
    for prompt, out in zip(PROMPTS, generate_ids(medusa, PROMPTS, GREEDY)):
        ref = reference.generate(target, drafter, prompt, GREEDY["max_new_tokens"], tree=tree)
        assert out["output_ids"] == ref.tokens
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] == ref.steps
        assert meta["spec_accept_length"] == pytest.approx(len(ref.tokens) / ref.steps, abs=1e-6)
        stats = AcceptanceStats.from_histograms([meta["spec_correct_drafts_histogram"]])
        assert stats.num_steps == ref.steps and stats.acceptance_per_pos == pytest.approx(ref.acceptance_per_position)


def _token_counts(outputs, position):
    counts = {}
    for ids in outputs:
        counts[ids[position]] = counts.get(ids[position], 0) + 1
    return counts


def homogeneity_pvalue(a: list[list[int]], b: list[list[int]], position: int) -> float:
    """Chi-square test that two samples of token sequences share the distribution of the
    token at `position`; categories with expected count < 5 are pooled."""
    from scipy.stats import chi2_contingency

    ca, cb = _token_counts(a, position), _token_counts(b, position)
    tokens = sorted(set(ca) | set(cb), key=lambda t: -(ca.get(t, 0) + cb.get(t, 0)))
    rows, other = [], [0, 0]
    for t in tokens:
        pair = [ca.get(t, 0), cb.get(t, 0)]
        if sum(pair) >= 10:
            rows.append(pair)
        else:
            other = [other[0] + pair[0], other[1] + pair[1]]
    if sum(other):
        rows.append(other)
    if len(rows) < 2:
        return 1.0
    return float(chi2_contingency(rows).pvalue)


def test_sampling_at_t08_matches_no_speculation(medusa, baseline):
    """Lossless: the speculative engine's tokens follow the target's distribution."""
    outs = [o["output_ids"] for o in generate_ids(medusa, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)]
    for position in POSITIONS:
        assert homogeneity_pvalue(outs, baseline["sampled"], position) > ALPHA, position


def test_logit_bias_min_new_tokens_and_penalties_match_no_speculation(medusa, baseline):
    """Per-node rules: penalised requests draft and accept like any other (no longer their
    root alone), and every output equals SGLang without speculation."""
    outs = generate_ids(medusa, PROMPTS[:4], RULES)
    assert [o["output_ids"] for o in outs] == baseline["rules"]
    assert max(o["meta_info"]["spec_accept_length"] for o in outs[:3]) > 1.0  # penalised rows accepted drafts


# Runs last among the tests of the module-scoped `medusa` engine: shutting down its own
# engine kills every SGLang scheduler of this process (SGLang's kill_process_tree),
# the module's engine included.
def test_typical_acceptance_is_lossy_negative_control(sgl_model, medusa_heads, baseline):
    """Negative control for test_sampling_at_t08_matches_no_speculation: typical
    acceptance (LOSSY by design, with thresholds loose enough to accept nearly every head
    guess) must be detected."""
    with sglang_engine(sgl_model, speculative_algorithm="MEDUSA", speculative_draft_model_path=str(medusa_heads),
                       speculative_accept_threshold_single=0.01, speculative_accept_threshold_acc=0.01) as engine:
        outs = [o["output_ids"] for o in generate_ids(engine, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)]
    assert min(homogeneity_pvalue(outs, baseline["sampled"], p) for p in POSITIONS) < ALPHA
