"""Sampled MEDUSA drafts in a real SGLang 0.5.23 CPU engine: with SPECPLUG_DRAFT_TEMPERATURE
each request's chains are drawn from the heads' q (MedusaDrafter.draft_sampled) and the
verify step checks them with q. At T = 0.8 the first tokens of SAMPLES requests follow
SGLang's own distribution without speculation (chi-square homogeneity; the negative
control is test_medusa_engine's typical acceptance). Its own module, so its engine starts
after test_medusa_engine's module engine is shut down: an engine's shutdown stops every
SGLang scheduler in the process, and an engine launched beside a dead one risks SGLang's
launch-phase SIGQUIT handler, which kills the whole process."""

from tests.sglang.conftest import SAMPLE_PROMPT, SAMPLED, SAMPLES, generate_ids, sglang_engine
from tests.sglang.test_medusa_engine import ALPHA, POSITIONS, homogeneity_pvalue


def test_sampled_drafts_from_the_heads_q_match_no_speculation(sgl_model, medusa_heads, baseline, monkeypatch):
    """Chains drawn from the heads' q at T 0.8, verified with q: the tokens still follow
    the target's distribution."""
    monkeypatch.setenv("SPECPLUG_DRAFT_TEMPERATURE", "0.8")
    with sglang_engine(sgl_model, speculative_algorithm="MEDUSA",
                       speculative_draft_model_path=str(medusa_heads)) as engine:
        outs = generate_ids(engine, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    for position in POSITIONS:
        assert homogeneity_pvalue([o["output_ids"] for o in outs], baseline["sampled"], position) > ALPHA, position
