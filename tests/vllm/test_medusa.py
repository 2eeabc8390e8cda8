"""Medusa heads with specplug trees in vLLM (method "medusa"): the core's MedusaDrafter on
the heads vLLM loaded (medusa_settings.LoadedMedusaHeads), verified by specplug's sampler
as a chain (stage "chain") or as the whole Medusa tree in one target pass (stage "tree",
the same TreeVerifier as EAGLE trees).

Greedy output equals vLLM without speculation in both stages; in stage "tree" every
request's per-step acceptance equals the engine-free reference loop's with the same heads
and tree (which fails if the drafter reads the hidden state of the wrong tree row after a
second branch is accepted); at T 0.8 the tokens keep the target's distribution
(chi-square against vLLM without speculation, negative control included)."""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.vllm_eagle3.bench_runner import stats_from_outputs  # noqa: E402
from tests.support.tiny_eagle3 import AGREE_TOKEN  # noqa: E402
from tests.support.tiny_medusa import fit_prompts, vllm_medusa_heads_dir  # noqa: E402
from tests.vllm.conftest import PROMPTS, drafter_of  # noqa: E402

pytestmark = pytest.mark.vllm

CHAIN = {"version": 1, "method": "medusa", "tree": {"topk": 1}}
TREE = {"version": 1, "method": "medusa", "stage": "tree", "tree": {"depth": 3, "topk": 2, "budget": 7}}
NODES = 7  # TREE's non-root nodes: vLLM's num_speculative_tokens in stage "tree"
# token-id prompts on which the tiny Llama falls into loops the fitted heads learned
LOOP_PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11], list(range(40, 71)), [100]]


def sampling(max_tokens=32, **kwargs):
    from vllm import SamplingParams
    return SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, **kwargs})


def run(llm, prompts, params):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], outputs


def token_prompts(ids):
    return [{"prompt_token_ids": p} for p in ids]


@pytest.fixture(scope="module")
def tree_llm(engine, target):
    return engine(target, vllm_medusa_heads_dir(target, specplug=TREE), NODES, method="medusa")


@pytest.mark.parametrize("section, k", [(CHAIN, 3), (TREE, NODES)], ids=["chain", "tree"])
def test_greedy_matches_no_speculation(engine, target, specplug_log, section, k):
    llm = engine(target, vllm_medusa_heads_dir(target, specplug=section), k, method="medusa")
    prompts = PROMPTS[:8] + token_prompts(LOOP_PROMPTS)
    spec, outputs = run(llm, prompts, sampling())
    assert spec == run(engine(target), prompts, sampling())[0]
    stats = stats_from_outputs(outputs)
    assert stats.num_steps > 0 and stats.num_accepted > 0
    assert type(drafter_of(llm).drafting.heads).__name__ == "LoadedMedusaHeads"
    assert any("specplug Medusa proposer active" in m for m in specplug_log.messages)


def test_tree_acceptance_equals_the_reference_loop(target, tree_llm):
    """Same heads, same tree, greedy: per request, vLLM's steps by accepted count equal the
    reference loop's (specplug.common.reference on the Hugging Face target)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specplug.common import reference
    from specplug.common.drafters import MedusaDrafter
    from specplug.common.formats import load_head_module
    from specplug.common.tree import TreeConfig

    head = vllm_medusa_heads_dir(target, specplug=TREE)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter = MedusaDrafter(load_head_module(head), head_accuracies=drafter_of(tree_llm).drafting.head_accuracies)
    # and prompts the heads were fitted on, whose continuations they draft right at every depth
    prompts = LOOP_PROMPTS + fit_prompts(model.config.vocab_size)[:6].tolist()
    spec, outputs = run(tree_llm, token_prompts(prompts), sampling(max_tokens=40))
    deep = 0
    for prompt, tokens, output in zip(prompts, spec, outputs):
        ref = reference.generate(model, drafter, prompt, 40, tree=TreeConfig.from_dict(TREE["tree"]), eos_token_id=[])
        assert tokens == ref.tokens
        histogram = list(output.outputs[0].spec_decode_metrics.histogram)
        assert Counter({j: n for j, n in enumerate(histogram) if n}) == Counter(ref.num_accepted)
        deep += sum(a >= 2 for a in ref.num_accepted)
    assert deep > 20  # accepted paths through nodes 1, 3, 5: read from moved rows


def test_no_section_runs_vllms_own_medusa(engine, target):
    llm = engine(target, vllm_medusa_heads_dir(target, specplug=None), 3, method="medusa")
    assert drafter_of(llm).specplug is None
    spec, outputs = run(llm, PROMPTS[:4], sampling())
    assert spec == run(engine(target), PROMPTS[:4], sampling())[0]


# The constant target draws i.i.d. tokens from a fixed p; heads fitted on it draft its
# greedy token first and another as the second child (topk 2), so siblings are tested
# against residuals. Same sample, bins and threshold as test_stage_tree's T > 0 test.
def test_sampled_tokens_keep_the_target_distribution(engine, constant_target):
    from tests.vllm.test_stage_chain import NUM_REQUESTS, NUM_TOKENS, _bins, _same_distribution

    llm = engine(constant_target, vllm_medusa_heads_dir(constant_target, specplug=TREE), NODES, method="medusa")
    params = [sampling(max_tokens=NUM_TOKENS, temperature=0.8, seed=s) for s in range(NUM_REQUESTS)]
    prompts = [PROMPTS[s % 8] for s in range(NUM_REQUESTS)]
    spec, outputs = run(llm, prompts, params)
    plain = run(engine(constant_target), prompts, params)[0]
    assert stats_from_outputs(outputs).num_accepted > 100
    assert _same_distribution(_bins(spec), _bins(plain))
    always_accepted = [[AGREE_TOKEN] * NUM_TOKENS for _ in range(NUM_REQUESTS)]  # negative control
    assert not _same_distribution(_bins(always_accepted), _bins(plain))


def test_mixed_rules_and_structured_output_stay_exact(engine, target, tree_llm):
    """Penalties, top-k beside logprobs, and a grammar (drafted as a chain) in one batch."""
    from vllm.sampling_params import StructuredOutputsParams

    choice = StructuredOutputsParams(choice=["red fox", "lazy dog", "the cat"])
    params = [sampling(repetition_penalty=1.3), sampling(top_k=20, temperature=0.0), sampling(logprobs=2),
              sampling(max_tokens=8, ignore_eos=False, structured_outputs=choice)]
    spec = run(tree_llm, PROMPTS[:4], params)[0]
    assert spec == run(engine(target), PROMPTS[:4], params)[0]


def test_tree_size_and_num_speculative_tokens_disagree_at_start(target):
    from vllm import LLM

    head = vllm_medusa_heads_dir(target, specplug=TREE)
    with pytest.raises(Exception, match=f'set "num_speculative_tokens": {NODES}'):
        LLM(model=str(target), dtype="float32", max_model_len=512, enforce_eager=True,
            distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20,
            speculative_config={"method": "medusa", "model": str(head), "num_speculative_tokens": 3})


def test_settings_refuse_what_medusa_in_vllm_does_not_offer():
    from specplug.vllm_eagle3.medusa_settings import medusa_settings

    assert medusa_settings(TREE).stage == "tree"
    for extra in ({"adaptive": True}, {"gate": True}, {"draft_temperature": 0.7}, {"retrieval": True}):
        with pytest.raises(ValueError, match="Medusa heads in vLLM does not support"):
            medusa_settings({**CHAIN, **extra})


def test_bench_runs_medusa_three_ways(target, monkeypatch):
    import json
    from pathlib import Path

    from specplug.vllm_eagle3.bench_runner import VllmRunner, vllm_medusa_head

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the runner sets it if absent; later engines must not inherit it
    fitted = vllm_medusa_heads_dir(target, specplug=TREE).parent / "fasterdecoding"
    heads = vllm_medusa_head(str(fitted), str(target))  # FasterDecoding -> vLLM's format
    runner = VllmRunner(str(target), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=1, medusa_head=heads)
    assert runner.methods()[-3:] == ["medusa", "specplug-medusa", "specplug-medusa-tree"]
    for method, stage, tokens in (("medusa", None, 3), ("specplug-medusa", "chain", 3),
                                  ("specplug-medusa-tree", "tree", NODES)):
        config = runner.speculative_config(method)
        assert config["method"] == "medusa" and config["num_speculative_tokens"] == tokens
        section = json.loads((Path(config["model"]) / "config.json").read_text()).get("specplug")
        assert (section or {}).get("stage") == stage
