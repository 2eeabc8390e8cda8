"""Sampled draft-model trees in a real SGLang 0.5.23 CPU engine: with "temperature" the
"draft_model" token drafter samples its trees from q and returns q per node, and the
verify step checks them with q (sampling.verify's draft-probability rule: accept with
min(1, p/q), resample from norm(max(0, p - q))), its production caller. At T = 0.8 the
first tokens of SAMPLES requests follow SGLang's own distribution without speculation
(chi-square homogeneity, as the MEDUSA and RETRIEVAL tests; the core's negative control
verifies with q at the wrong temperature and fails). Its own module: an engine's
shutdown stops every SGLang scheduler in the process."""

import json

from tests.sglang.conftest import SAMPLE_PROMPT, SAMPLED, SAMPLES, generate_ids, sglang_engine
from tests.sglang.test_medusa_engine import ALPHA, POSITIONS, homogeneity_pvalue


def test_sampled_draft_model_trees_verified_with_q_keep_the_distribution(sgl_model, baseline, tmp_path, monkeypatch):
    from specplug.common.draft_model import cut_draft_model

    draft = cut_draft_model(sgl_model, "0", tmp_path / "draft")
    monkeypatch.setenv("SPECPLUG_DRAFTER", json.dumps({"model": str(draft), "topk": 2, "temperature": 0.8, "seed": 0}))
    with sglang_engine(sgl_model, speculative_algorithm="DRAFT_MODEL", speculative_num_draft_tokens=5,
                       speculative_num_steps=2) as engine:
        outs = generate_ids(engine, [SAMPLE_PROMPT] * SAMPLES, SAMPLED)
    assert sum(o["meta_info"]["spec_num_correct_drafts"] for o in outs) > 0
    ids = [o["output_ids"] for o in outs]
    for position in POSITIONS:
        assert homogeneity_pvalue(ids, baseline["sampled"], position) > ALPHA, position
