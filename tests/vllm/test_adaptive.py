"""Adaptive speculation in vLLM: per step the proposer drafts 0..num_speculative_tokens
tokens as specplug.common.policy.cost chooses; output stays exactly the target's (greedy)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.common.drafting.eagle import EagleDrafting
from specplug.common.policy.cost import AcceptanceTracker, AdaptiveConfig, Curve, StepCosts
from specplug.common.policy.adaptive_chains import ChainAdaptiveController
from specplug.vllm_eagle3.dense_head import DenseEagle3Head
from specplug.vllm_eagle3.settings import adapter_settings
from tests.vllm.conftest import NUM_SPEC_TOKENS, PROMPTS, SPECPLUG_CHAIN, SPECPLUG_TREE, drafter_of
from tests.support.tiny_eagle3 import tiny_head_dir

pytestmark = pytest.mark.vllm

# verify cost flat in tokens, free drafts (with a fixed acceptance of 0.9 at every depth):
# every extra draft adds expected tokens for free -> the deepest chain
FULL_DEPTH = StepCosts(verify=Curve([(1, 1.0), (10_000, 1.0)]), draft=Curve([(1, 0.0), (10_000, 0.0)]))
# verify cost linear in tokens, drafting dear: speculation never pays -> no drafts
NO_SPECULATION = StepCosts(verify=Curve([(1, 1.0), (2, 2.0)]), draft=Curve([(1, 10.0), (2, 20.0)]))


@pytest.fixture(scope="session")
def adaptive_head(target):
    return tiny_head_dir(target, specplug={**SPECPLUG_TREE, "adaptive": True})


def greedy(max_tokens=24):
    from vllm import SamplingParams
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def token_ids(llm, prompts):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(), use_tqdm=False)]


def controller(llm) -> ChainAdaptiveController:
    adaptive = drafter_of(llm).policy.adaptive
    assert adaptive is not None, "the head's specplug section says adaptive: true"
    return adaptive


def fixed_acceptance(adaptive, alpha):
    """A tracker whose prior (alpha at every depth) outweighs any measurement."""
    return AcceptanceTracker(AdaptiveConfig(options=adaptive.options, prior_alpha=alpha, prior_weight=1e12))


def depths_chosen(llm, prompts, costs=None, alpha=None):
    """(output token ids, {depth: steps}) of one greedy run, with `costs` (and a fixed
    acceptance `alpha`) injected."""
    adaptive = controller(llm)
    tracker = adaptive.tracker
    adaptive.costs_override = costs
    if alpha is not None:
        adaptive.tracker = fixed_acceptance(adaptive, alpha)
    before = dict(adaptive.depth_counts)
    try:
        out = token_ids(llm, prompts)
    finally:
        adaptive.costs_override, adaptive.tracker = None, tracker
    counts = {d: n - before.get(d, 0) for d, n in adaptive.depth_counts.items() if n - before.get(d, 0)}
    return out, counts


def test_adaptive_flag_from_section_and_env():
    assert not adapter_settings(SPECPLUG_TREE, environ={}).adaptive
    assert adapter_settings({**SPECPLUG_TREE, "adaptive": True}, environ={}).adaptive
    assert adapter_settings(SPECPLUG_TREE, environ={"SPECPLUG_ADAPTIVE": "1"}).adaptive
    assert not adapter_settings({**SPECPLUG_TREE, "adaptive": True}, environ={"SPECPLUG_ADAPTIVE": "0"}).adaptive
    with pytest.raises(ValueError, match="SPECPLUG_ADAPTIVE"):
        adapter_settings(SPECPLUG_TREE, environ={"SPECPLUG_ADAPTIVE": "maybe"})


def test_adaptive_is_off_by_default(engine, target, specplug_head):
    assert drafter_of(engine(target, specplug_head)).policy.adaptive is None


@pytest.mark.parametrize("batch", [1, 4])
def test_adaptive_greedy_matches_no_speculation(engine, target, adaptive_head, batch):
    """Measured costs, whatever they choose: output identical to the target alone."""
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[2]]
    llm = engine(target, adaptive_head)
    spec, counts = depths_chosen(llm, prompts)
    assert sum(counts.values()) > 0
    assert spec == token_ids(engine(target), prompts)


def test_forced_no_speculation_drafts_nothing_and_stays_exact(engine, target, adaptive_head):
    prompts = PROMPTS[:4]
    spec, counts = depths_chosen(engine(target, adaptive_head), prompts, NO_SPECULATION)
    assert set(counts) == {0}
    assert spec == token_ids(engine(target), prompts)


def test_forced_largest_option_drafts_full_depth(engine, target, adaptive_head):
    prompts = PROMPTS[:4]
    llm = engine(target, adaptive_head)
    drafter = drafter_of(llm)
    widths, propose = [], drafter.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        widths.append(out.shape[1])
        return out

    drafter.propose = recording
    try:
        spec, counts = depths_chosen(llm, prompts, FULL_DEPTH, alpha=0.9)
    finally:
        del drafter.propose
    assert set(counts) == {NUM_SPEC_TOKENS}
    assert set(widths) == {NUM_SPEC_TOKENS}
    assert spec == token_ids(engine(target), prompts)


def test_bench_adaptive_head_copy_says_adaptive(specplug_head):
    """`specplug bench --adaptive` runs the specplug method on such a copy."""
    import json
    from pathlib import Path

    from specplug.vllm_eagle3.bench_runner import adaptive_head

    copy = Path(adaptive_head(str(specplug_head)))
    section = json.loads((copy / "config.json").read_text())["specplug"]
    assert section == {**SPECPLUG_TREE, "adaptive": True, "stage": "chain"}  # adaptive chooses chain depths
    assert adapter_settings(section, environ={}).adaptive


def _roots_by_position(llm, prompt, monkeypatch):
    """{root position: (root token, draft log-probs of the first draft)} of every drafting
    step of a greedy batch-1 run (read where the proposer hands roots to the core's trees)."""
    seen, trees = {}, EagleDrafting.trees

    def recording(self, roots, *args, **kwargs):
        for root in roots:
            seen[root.position] = (root.token, root.logprobs.clone())
        return trees(self, roots, *args, **kwargs)

    monkeypatch.setattr(EagleDrafting, "trees", recording)
    try:
        out = token_ids(llm, [prompt])
    finally:
        monkeypatch.setattr(EagleDrafting, "trees", trees)
    return out, seen


def _forced_pattern(engine, target, monkeypatch, pattern):
    """An adaptive chain engine whose controller chooses depths from `pattern` (cycled)."""
    llm = engine(target, tiny_head_dir(target, specplug={**SPECPLUG_CHAIN, "adaptive": True}))
    depths = iter(pattern * 100)
    monkeypatch.setattr(controller(llm), "choose_depth", lambda batch: next(depths))
    return llm


PATTERN = [0, 0, 3, 0, 3, 0, 0, 0, 0, 0, 0, 3]


def test_deferred_catch_up_keeps_the_head_in_sync(engine, target, chain_head, monkeypatch):
    """Steps without drafts defer the head's catch-up (the prompt too); a later drafting
    step must see exactly the head state of a run that caught up every step: same root
    token and first-draft log-probs at every shared position."""
    llm = _forced_pattern(engine, target, monkeypatch, PATTERN)
    ours, ours_roots = _roots_by_position(llm, PROMPTS[2], monkeypatch)
    reference, reference_roots = _roots_by_position(engine(target, chain_head), PROMPTS[2], monkeypatch)
    assert ours == reference
    shared = sorted(set(ours_roots) & set(reference_roots))
    assert len(shared) >= 3
    for position in shared:
        assert ours_roots[position][0] == reference_roots[position][0]
        torch.testing.assert_close(ours_roots[position][1], reference_roots[position][1], rtol=1e-4, atol=1e-4)


def test_backlog_over_the_cap_drops_its_oldest_rows(engine, target, chain_head, monkeypatch):
    """With a cap of 4 deferred rows an idle head keeps only each request's newest 4 rows:
    its cache skips the rest (no head forward over them), and output stays exactly the
    target's greedy output."""
    llm = _forced_pattern(engine, target, monkeypatch, PATTERN)
    reference = token_ids(engine(target, chain_head), PROMPTS[2:3])
    proposer = drafter_of(llm)
    if proposer.session.drafting is None:
        proposer.session.drafting = EagleDrafting(DenseEagle3Head(proposer.model))
    drafting = proposer.session.drafting
    monkeypatch.setattr(drafting, "max_pending_rows", 4)
    rows, positions, catch_up, step = [], [], drafting.catch_up, drafting.runner.step

    def recording(requests):
        roots = catch_up(requests)
        positions.extend(drafting.caches[r.req_id].positions.clone() for r in requests)
        return roots

    def counting(tokens, *args, logit_rows=None, **kwargs):  # catch-up steps ask for root rows only
        if logit_rows is not None:
            rows.append(tokens.shape[0])
        return step(tokens, *args, logit_rows=logit_rows, **kwargs)

    monkeypatch.setattr(drafting, "catch_up", recording)
    monkeypatch.setattr(drafting.runner, "step", counting)
    assert token_ids(llm, PROMPTS[2:3]) == reference
    assert rows and max(rows) <= 4 + NUM_SPEC_TOKENS + 1  # a backlog of 4 plus one step's rows
    assert (positions[-1].diff() > 1).any()  # the head's context skips dropped rows
