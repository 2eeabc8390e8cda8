"""Adaptive MEDUSA speculation in a real SGLang 0.5.23 CPU engine: per step the worker
verifies a tree of some budget or none, as specplug.common.policy.adaptive chooses; greedy
output stays the target's whatever it chooses.

What the controller chose is read back from SGLang's per-request histogram of accepted
drafts per step: a step without drafts can only accept 0."""

import json

import pytest

from tests.sglang.conftest import GREEDY, PROMPTS, assert_greedy_matches, greedy_run, sglang_engine

# Pinned cost curves (SPECPLUG_ADAPTIVE_COSTS): a verify pass is flat up to 4 tokens and
# 100x dearer from 5 on, drafting is free. At batch 1 a tree of up to 3 draft nodes
# costs what plain decoding does (so the controller speculates); at batch 4 every tree
# needs >= 8 tokens (so it must not).
KNEE_AT_4 = {"verify": [[1, 0.01], [4, 0.01], [5, 1.0]], "draft": [[1, 0.0]]}


def accepted_any_draft(meta: dict) -> bool:
    """True when some verify step of this request accepted at least one draft token."""
    return any(count for count in meta["spec_correct_drafts_histogram"][1:])


@pytest.fixture(scope="module")
def adaptive(sgl_model, medusa_heads):
    """Adaptive MEDUSA switched on through SGLang's own --speculative-adaptive argument."""
    with sglang_engine(sgl_model, speculative_algorithm="MEDUSA", speculative_draft_model_path=str(medusa_heads),
                       speculative_adaptive=True) as engine:
        yield engine


def test_adaptive_from_section_argument_and_env(medusa_heads, tmp_path):
    from types import SimpleNamespace

    from specplug.sglang_medusa.settings import medusa_settings

    cfg = SimpleNamespace(speculative_draft_model_path=str(medusa_heads), speculative_num_steps=None,
                          speculative_eagle_topk=None, speculative_num_draft_tokens=None,
                          speculative_accept_threshold_single=1.0, speculative_accept_threshold_acc=1.0)
    assert not medusa_settings(cfg, environ={}).adaptive
    assert medusa_settings(cfg, adaptive_arg=True, environ={}).adaptive
    assert medusa_settings(cfg, environ={"SPECPLUG_ADAPTIVE": "1"}).adaptive
    # one precedence for every field (specplug.common.head_section): the argument over the environment
    assert medusa_settings(cfg, adaptive_arg=True, environ={"SPECPLUG_ADAPTIVE": "0"}).adaptive
    assert not medusa_settings(cfg, environ={"SPECPLUG_ADAPTIVE": "0"}).adaptive
    with pytest.raises(ValueError, match="MEDUSA in SGLang does not support 'gate'.*SPECPLUG_GATE"):
        medusa_settings(cfg, environ={"SPECPLUG_GATE": "1"})
    heads = tmp_path / "heads"
    heads.mkdir()
    for f in medusa_heads.iterdir():
        (heads / f.name).symlink_to(f)
    config = json.loads((medusa_heads / "config.json").read_text())
    config["specplug"]["adaptive"] = True
    (heads / "config.json").unlink()
    (heads / "config.json").write_text(json.dumps(config))
    assert medusa_settings(SimpleNamespace(**{**vars(cfg), "speculative_draft_model_path": str(heads)}),
                                     environ={}).adaptive


def test_adaptive_greedy_matches_no_speculation_batch4(adaptive, baseline):
    run = greedy_run(adaptive, PROMPTS, GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0


def test_adaptive_greedy_matches_no_speculation_batch1(adaptive, baseline):
    for prompt, base in zip(PROMPTS[:2], baseline["greedy_bs1"]):
        assert greedy_run(adaptive, [prompt], GREEDY)["ids"][0] == base


def test_choice_follows_the_batch_under_pinned_costs(sgl_model, medusa_heads, baseline, monkeypatch):
    """Same engine, same heads, cost curves pinned with a knee at 4 tokens: batch 1 verifies
    small trees (drafts get accepted), batch 4 verifies none (no draft is ever accepted);
    both outputs equal SGLang's without speculation."""
    monkeypatch.setenv("SPECPLUG_ADAPTIVE_COSTS", json.dumps(KNEE_AT_4))
    monkeypatch.setenv("SPECPLUG_ADAPTIVE", "1")
    with sglang_engine(sgl_model, speculative_algorithm="MEDUSA",
                       speculative_draft_model_path=str(medusa_heads)) as engine:
        single = [greedy_run(engine, [p], GREEDY) for p in PROMPTS[:2]]
        batch4 = greedy_run(engine, PROMPTS, GREEDY)
    assert [r["ids"][0] for r in single] == baseline["greedy_bs1"]
    assert any(accepted_any_draft(r["meta"][0]) for r in single)
    assert assert_greedy_matches(batch4["ids"], baseline["greedy"]["ids"], baseline["greedy"]["gaps"]) == 0
    assert not any(accepted_any_draft(m) for m in batch4["meta"])
    assert all(m["spec_verify_ct"] == GREEDY["max_new_tokens"] - 1 for m in batch4["meta"])
