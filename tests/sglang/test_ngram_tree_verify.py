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
