"""Tree verification on torch_native as a product feature: SGLang's OWN NGRAM speculation
(multi-branch trees from its n-gram corpus) verified through specplug's hook must
produce the no-speculation greedy output on the GQA tiny Llama, over long outputs.
Without the hook, SGLang 0.5.23's torch_native backend cannot run TARGET_VERIFY at all."""

from tests.sglang.conftest import LONG_GREEDY, PROMPTS, assert_greedy_matches, greedy_run, sglang_engine


def test_ngram_long_greedy_matches_no_speculation(sgl_model, baseline):
    with sglang_engine(sgl_model, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8) as engine:
        run = greedy_run(engine, PROMPTS, LONG_GREEDY)
    assert assert_greedy_matches(run["ids"], baseline["long"]["ids"], baseline["long"]["gaps"]) == 0
    # the trees were real: drafts were accepted, several per step on the looping outputs
    assert max(m["spec_accept_length"] for m in run["meta"]) > 2.0
    assert all(len(ids) == LONG_GREEDY["max_new_tokens"] for ids in run["ids"])


def test_ngram_on_the_test_bed_matches_or_diverges_only_at_near_ties():
    """SmolLM2-135M (GQA 9/3) on eight chat and code prompts x 128 greedy tokens, NGRAM
    through the hook: every output equals SGLang without speculation, or its first
    divergence is at a near-tie of the baseline (top-2 logprob gap < 1e-3 nats). The verify
    pass (SDPA over prefix + tree) and the decode pass use different kernels, so fp32
    near-ties may flip; anything else is a bug."""
    from transformers import AutoTokenizer

    from specplug.common.training.data import prompts
    from specplug.common.testbed import target_dir

    model = target_dir()
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [tokenizer(p.text)["input_ids"] for p in prompts("mtbench", tokenizer, limit=4)]
    ids += [tokenizer(p.text)["input_ids"] for p in prompts("humaneval", tokenizer, limit=4)]
    params = {"temperature": 0.0, "max_new_tokens": 128}
    with sglang_engine(model) as engine:
        base = greedy_run(engine, ids, params)
    with sglang_engine(model, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8) as engine:
        run = greedy_run(engine, ids, params)
    diverged = assert_greedy_matches(run["ids"], base["ids"], base["gaps"])
    assert diverged <= 1, f"{diverged} of 8 outputs diverged (each at a near-tie)"
