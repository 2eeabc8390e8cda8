"""specplug's SGLang algorithms at --tp-size 2 (tiny Llama) and 3 (the test bed, its committed
heads) (the scheduler on every rank drafts and verifies; the heads specplug loads are
replicated, the target's embedding and LM head are gathered whole once, rank-local
measurements are decided on rank 0): greedy output equals SGLang at the same --tp-size
without speculation, with the rank check on. Pipeline stages and
data-parallel attention are refused before any model loads (spec.py)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from specplug.sglang_medusa import spec

SERVER = dict(device="cpu", attention_backend="torch_native", prefill_attention_backend=None,
              decode_attention_backend=None, enable_dp_attention=False, pp_size=1)


@pytest.mark.parametrize("algorithm", ["MEDUSA", "SPECPLUG_EAGLE3", "RETRIEVAL", "DRAFT_MODEL", "SELF_SPEC"])
def test_pipeline_stages_and_dp_attention_are_refused_tensor_parallelism_is_not(algorithm):
    for layout in ({"pp_size": 2}, {"enable_dp_attention": True}):
        with pytest.raises(ValueError, match=f"^{algorithm} does not support data-parallel attention or pipeline "
                                             "parallelism .* shard with --tp-size"):
            spec._check_backend(SimpleNamespace(**{**SERVER, **layout}), algorithm)
    spec._check_backend(SimpleNamespace(**SERVER, tp_size=3), algorithm)


def _runs(model, tmp_path) -> list[dict]:
    """tests.support.sglang_tp_generate runs covering every specplug algorithm on the tiny Llama (4 query /
    2 KV heads, vocabulary 512: SGLang shards it over 2 ranks), with heads that need no training. Payoff
    control (which the suite turns off) is on in the last run only."""
    from specplug.common.draft_model import cut_draft_model
    from tests.support.tiny_eagle1 import eagle1_head_dir
    from tests.support.tiny_eagle3 import tiny_head_dir
    from tests.support.tiny_medusa import medusa_heads_dir

    every_step = {"SPECPLUG_PAYOFF": "0"}
    medusa = medusa_heads_dir(model, tmp_path / "medusa", fit_steps=60)
    draft = cut_draft_model(model, "0", tmp_path / "draft")
    eagle3 = tiny_head_dir(model, specplug={"version": 1, "method": "eagle3", "drafter": "retrieval",
                                            "tree": {"depth": 3, "topk": 2, "budget": 6}})
    eagle1 = eagle1_head_dir(model, echo=True, specplug={"version": 1, "method": "eagle1",
                                                         "tree": {"depth": 4, "topk": 2, "budget": 8}})

    def head(algorithm, path, **args):
        return {"speculative_algorithm": algorithm, "speculative_draft_model_path": str(path), **args}

    return [
        {"name": "base"},
        {"name": "RETRIEVAL", "env": every_step, "engine_args": {"speculative_algorithm": "RETRIEVAL"}},
        {"name": "MEDUSA adaptive", "engine_args": head("MEDUSA", medusa, speculative_adaptive=True)},
        {"name": "SPECPLUG_EAGLE3 + retrieval", "env": every_step,
         "engine_args": head("SPECPLUG_EAGLE3", eagle3, speculative_num_draft_tokens=7)},
        {"name": "SPECPLUG_EAGLE3 EAGLE-1", "env": every_step,
         "engine_args": head("SPECPLUG_EAGLE3", eagle1, speculative_num_draft_tokens=9)},
        {"name": "SELF_SPEC", "env": every_step, "engine_args": {"speculative_algorithm": "SELF_SPEC"}},
        {"name": "DRAFT_MODEL sampled", "env": {"SPECPLUG_DRAFTER": json.dumps({"model": str(draft), "topk": 2}),
                                                "SPECPLUG_PAYOFF": "1"},
         "sampling": {"temperature": 0.8, "seed": 7, "ignore_eos": True},
         "engine_args": {"speculative_algorithm": "DRAFT_MODEL", "speculative_num_draft_tokens": 5,
                         "speculative_num_steps": 3}},
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_algorithm_at_tp_2_keeps_greedy_output_and_ranks_in_step(sgl_model, tmp_path):
    """--tp-size 2 (ranks bound to cores 0|1), SPECPLUG_CHECK_RANKS=1, one engine per run of _runs:
    RETRIEVAL, MEDUSA with adaptive speculation (decided on rank 0), SPECPLUG_EAGLE3 with an EAGLE-3 head
    merged with retrieval (the gathered embedding) and with the EAGLE-1 echo head (the gathered LM head: it
    drafts the target's own prediction, so its drafts are accepted), SELF_SPEC (the target's sharded layers,
    reduced where SGLang leaves the reduction to its layer boundaries): each greedy output equals SGLang at
    --tp-size 2 without speculation. DRAFT_MODEL with payoff control on and seeded requests at T 0.8 runs
    with ranks in step (a rank that drew another token would draft from other tokens and fail the check)."""
    from tests.support.sglang_tp_generate import MARKER
    from tests.support.tp_generate import run_checked

    runs = _runs(sgl_model, tmp_path)
    out = run_checked("tests.support.sglang_tp_generate", ["--model", str(sgl_model), "--tp", "2", "--max-tokens",
                                                           "24", *map(json.dumps, runs)], dict(os.environ), MARKER)
    base = out.pop("base")["ids"]
    sampled = out.pop("DRAFT_MODEL sampled")
    for name, result in out.items():
        assert result["ids"] == base, name
    assert out["RETRIEVAL"]["accepted"] > 0 and out["SPECPLUG_EAGLE3 EAGLE-1"]["accepted"] > 0
    assert sampled["ids"] != base and all(len(ids) == 24 for ids in sampled["ids"])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three engines at TP 3 (five with SPECPLUG_TEST_TP3_ALL=1: 9-11 min on 2 cores)
def test_the_committed_heads_at_tp_3_keep_greedy_output_and_drafts(tmp_path):
    """The test bed (9 query / 3 KV heads, vocabulary 49152) at --tp-size 3, ranks bound to cores 0|1|0,
    SPECPLUG_CHECK_RANKS=1, four text prompts, a tree every step: MEDUSA and SPECPLUG_EAGLE3 with the
    committed heads as committed (replicated on every rank, so the EAGLE-3 head's 8192-token draft
    vocabulary needs no padding, unlike vLLM's; its section merges retrieval's drafts); with
    SPECPLUG_TEST_TP3_ALL=1 also DRAFT_MODEL with a one-layer draft cut from the test bed and SELF_SPEC.
    Each greedy output equals SGLang at --tp-size 3 without speculation, and each method's drafts are
    accepted."""
    from specplug.common import testbed
    from specplug.common.draft_model import cut_draft_model
    from tests.support.sglang_tp_generate import MARKER
    from tests.support.tp_generate import ALL_TP3, run_checked

    target = testbed.target_dir()
    every_step = {"SPECPLUG_PAYOFF": "0"}
    runs = [{"name": "base"}] + [
        {"name": algorithm, "env": every_step, "engine_args": {
            "speculative_algorithm": algorithm, "speculative_draft_model_path": str(testbed.head_dir(head))}}
        for algorithm, head in (("MEDUSA", "smollm2-medusa"), ("SPECPLUG_EAGLE3", "smollm2-eagle3"))]
    if ALL_TP3:
        draft = cut_draft_model(target, "0", tmp_path / "draft")
        runs += [{"name": "DRAFT_MODEL", "env": {**every_step, "SPECPLUG_DRAFTER": json.dumps({"model": str(draft)})},
                  "engine_args": {"speculative_algorithm": "DRAFT_MODEL"}},
                 {"name": "SELF_SPEC", "env": every_step, "engine_args": {"speculative_algorithm": "SELF_SPEC"}}]
    out = run_checked("tests.support.sglang_tp_generate", ["--model", str(target), "--tp", "3", "--text",
                                                           *map(json.dumps, runs)], dict(os.environ), MARKER,
                      timeout=1440)
    base = out.pop("base")["ids"]
    assert sum(map(len, base)) >= 32  # a prompt may stop early
    for name, result in out.items():
        assert result["ids"] == base and result["accepted"] > 0, name
