"""specplug.common.verify_step in a real SGLang 0.5.23 CPU engine (MEDUSA): a seeded sampled
request (T > 0, `sampling_seed`) gives the same text alone and inside a batch of 8 mixed
requests (greedy, other seeds, unseeded), each run twice. Its seed fixes its first token
(SGLang's sampler, seeded per request for the prefill: tree_worker._seeded_first_tokens)
and every later one (verify_step's (seed, position) draws), whatever its companions.

The engine draws sampled drafts from the heads' q (SPECPLUG_DRAFT_TEMPERATURE), so the
mixed batch holds all three lossless rules: greedy, coupled (seeded requests, q unused)
and rejection with q (unseeded ones). Control: another seed gives other text. No
companion uses min-p: SGLang's seeded sampler refuses it, so a seeded request prefilled
beside one gets an unseeded first token (its later tokens stay seeded). Its own module:
one engine per module (see test_medusa_sampled)."""

import pytest

from tests.sglang.conftest import generate_ids, sglang_engine

TOKENS = 32
# A prompt where the tiny model's next token is far from certain (max p 0.31 at T 1.5):
# four unseeded first tokens all agree with chance 1.6 %.
PROMPT = [205, 300, 168, 109, 107]
OTHER_PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(40, 60)), [100], [200, 201, 5], [33, 34], [71, 72, 73, 74]]
SEEDED = {"temperature": 1.5, "top_k": 50, "sampling_seed": 4321, "max_new_tokens": TOKENS, "ignore_eos": True}
COMPANIONS = [{"temperature": 0.0}, {"temperature": 0.8, "sampling_seed": 1}, {"temperature": 1.0},
              {"temperature": 0.7, "top_k": 20, "sampling_seed": 2}, {"temperature": 0.0, "repetition_penalty": 1.2},
              {"temperature": 0.6}, {"temperature": 1.2, "top_p": 0.9}]


@pytest.fixture(scope="module")
def medusa(sgl_model, medusa_heads):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECPLUG_DRAFT_TEMPERATURE", "0.9")
        with sglang_engine(sgl_model, speculative_algorithm="MEDUSA",
                           speculative_draft_model_path=str(medusa_heads)) as engine:
            yield engine


def _seeded_output(engine, place: int | None) -> dict:
    """The seeded request's output: alone (place None) or at `place` among the companions."""
    if place is None:
        return generate_ids(engine, [PROMPT], [SEEDED])[0]
    prompts, params = list(OTHER_PROMPTS), [dict(c, max_new_tokens=TOKENS, ignore_eos=True) for c in COMPANIONS]
    prompts.insert(place, PROMPT)
    params.insert(place, SEEDED)
    return generate_ids(engine, prompts, params)[place]


def test_seeded_request_is_the_same_alone_and_in_a_mixed_batch(medusa):
    outs = [_seeded_output(medusa, place) for place in (None, 7, None, 3)]
    texts = [o["output_ids"] for o in outs]
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert len(texts[0]) == TOKENS and all(t == texts[0] for t in texts), texts
    other = generate_ids(medusa, [PROMPT], [dict(SEEDED, sampling_seed=99)])[0]["output_ids"]
    assert other != texts[0]
