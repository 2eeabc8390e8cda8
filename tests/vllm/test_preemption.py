"""Preemption while drafts are in flight: a KV cache of a few blocks makes vLLM's scheduler
preempt running requests and recompute them later; specplug's draft state (the head's
draft cache, the tree verifier, the retrieval drafter) must follow, so greedy output stays
identical to vLLM without speculation on the same small cache.

Setting: the tiny target (2 KiB of KV per token), blocks of vLLM-CPU's 128 tokens, a cache
of KV_BLOCKS blocks, 8 prompts x 200 greedy tokens: each request outgrows its first block,
so at most a few run at once and the rest are preempted as the running ones grow.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN, SPECPLUG_TREE, kv_bytes  # noqa: E402
from tests.vllm.test_stage_chain import params, token_ids  # noqa: E402
from tests.vllm.test_stage_tree import BUDGET, SPECPLUG_TREE_SECTION  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = pytest.mark.vllm

KV_BLOCKS = 6
SMALL = dict(max_model_len=256, max_num_seqs=8)
RETRIEVAL = {"budget": 4, "max_depth": 4, "min_prob": 0.0}
SECTIONS = {
    "chain": (SPECPLUG_TREE, 3),
    "tree": (SPECPLUG_TREE_SECTION, BUDGET),
    "hybrid-chain": ({**SPECPLUG_CHAIN, "retrieval": RETRIEVAL}, 3),
}


def small_kv(target_dir) -> int:
    """KV_BLOCKS blocks of 128 tokens of the target."""
    return kv_bytes(target_dir, KV_BLOCKS * 128)


def preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


@pytest.mark.parametrize("stage", list(SECTIONS))
def test_preempted_requests_match_no_speculation(engine, target, stage):
    section, spec_tokens = SECTIONS[stage]
    small = dict(SMALL, kv_cache_memory_bytes=small_kv(target))
    spec = engine(target, tiny_head_dir(target, specplug=section), num_spec_tokens=spec_tokens, **small)
    sampling = params(max_tokens=200, temperature=0.0, ignore_eos=True)
    before = preemptions(spec)  # read before another engine starts: vLLM's metrics registry is global
    out = token_ids(spec.generate(PROMPTS[:8], sampling, use_tqdm=False))
    assert preemptions(spec) > before, "no request was preempted: the cache is not small enough"
    plain = engine(target, **small)
    assert out == token_ids(plain.generate(PROMPTS[:8], sampling, use_tqdm=False))


def test_seeded_output_survives_preemption(engine, target):
    """A seeded T > 0 request gives the same tokens on the small cache (preempted and
    recomputed) as on a cache where it never waits: its draws are fixed by (seed, position)."""
    section, spec_tokens = SECTIONS["tree"]
    head = tiny_head_dir(target, specplug=section)
    sampling = [params(max_tokens=200, temperature=0.9, seed=s, ignore_eos=True) for s in range(8)]
    # max_num_seqs 7: an engine of its own, started here, so the global metrics are its own
    fresh = dict(SMALL, max_num_seqs=7)
    small = engine(target, head, num_spec_tokens=spec_tokens, **fresh, kv_cache_memory_bytes=small_kv(target))
    before = preemptions(small)
    preempted = token_ids(small.generate(PROMPTS[:8], sampling, use_tqdm=False))
    assert preemptions(small) > before
    roomy = engine(target, head, num_spec_tokens=spec_tokens, **fresh)
    assert preempted == token_ids(roomy.generate(PROMPTS[:8], sampling, use_tqdm=False))
