"""Stage "chain": specplug drafts a dynamic tree, vLLM verifies its best path as a chain.

Greedy output must be token-identical to vLLM without speculation; sampled output must
be reproducible per seed and keep the target's distribution.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.vllm_eagle3.bench_runner import stats_from_outputs
from tests.vllm.conftest import NUM_SPEC_TOKENS, PROMPTS, SPECPLUG_CHAIN as SPECPLUG_CHAIN_SECTION, drafter_of
from tests.support.tiny_eagle3 import AGREE_TOKEN, CONSTANT_TARGET_LOGITS, tiny_head_dir

pytestmark = pytest.mark.vllm


def params(**kw):
    from vllm import SamplingParams
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(llm, prompts, sampling):
    """(token ids per prompt, AcceptanceStats of this run)."""
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    return token_ids(outputs), stats_from_outputs(outputs)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_matches_no_speculation(engine, target, specplug_head, batch):
    prompts = PROMPTS[:batch] if batch > 1 else [PROMPTS[2]]
    sampling = params(max_tokens=24, temperature=0.0)
    spec, stats = run(engine(target, specplug_head), prompts, sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(prompts, sampling, use_tqdm=False))


def _recorded_drafts(llm, prompts, sampling):
    """Run the engine recording every draft its proposer returns: (outputs, stats, drafts)."""
    drafter = drafter_of(llm)
    drafts, propose = [], drafter.propose

    def recording(*args, **kwargs):
        out = propose(*args, **kwargs)
        drafts.append(out.tolist())
        return out

    drafter.propose = recording
    try:
        return (*run(llm, prompts, sampling), drafts)
    finally:
        del drafter.propose


def test_topk1_tree_drafts_what_vllm_builtin_drafts(engine, target, chain_head, plain_head):
    """With topk=1 the tree is EAGLE's greedy chain: every step's drafts equal vLLM's own
    eagle3 drafts with the same weights (the random head's attention reads the whole
    cache, so this checks the dense head KV stays in sync through vLLM's rollbacks)."""
    sampling = params(max_tokens=24, temperature=0.0)
    ours, ours_stats, ours_drafts = _recorded_drafts(engine(target, chain_head), PROMPTS[:8], sampling)
    builtin, builtin_stats, builtin_drafts = _recorded_drafts(engine(target, plain_head), PROMPTS[:8], sampling)
    assert ours == builtin
    assert ours_stats == builtin_stats
    assert len(ours_drafts) > 10 and ours_drafts == builtin_drafts


def test_two_layer_head_drafts_what_vllm_builtin_drafts_and_stays_exact(engine, target):
    """A two-layer EAGLE-3 head (vLLM's multi-layer names, layers.1.*): with topk=1 every
    step's drafts equal vLLM's own eagle3 drafts with the same weights, so both layers'
    dense KV (side by side in one cache) stay in sync; greedy output equals no speculation."""
    two = tiny_head_dir(target, specplug=SPECPLUG_CHAIN_SECTION, num_hidden_layers=2)
    plain = tiny_head_dir(target, num_hidden_layers=2)
    sampling = params(max_tokens=24, temperature=0.0)
    ours, _, ours_drafts = _recorded_drafts(engine(target, two), PROMPTS[:8], sampling)
    builtin, _, builtin_drafts = _recorded_drafts(engine(target, plain), PROMPTS[:8], sampling)
    assert ours == builtin == run(engine(target), PROMPTS[:8], sampling)[0]
    assert len(ours_drafts) > 10 and ours_drafts == builtin_drafts


def test_agreeing_draft_is_accepted_at_every_position(engine, constant_target, agreeing_head):
    out, stats = run(engine(constant_target, agreeing_head), PROMPTS[:4], params(max_tokens=17, temperature=0.0))
    assert all(ids == [AGREE_TOKEN] * 17 for ids in out)
    assert stats.num_steps > 0
    assert stats.accepted_per_pos == [stats.num_steps] * NUM_SPEC_TOKENS
    assert stats.tau == NUM_SPEC_TOKENS + 1


def test_seeded_sampling_is_reproducible_and_batch_independent(engine, target, specplug_head):
    check_seeded_sampling(engine(target, specplug_head))


def check_seeded_sampling(llm):
    """A seeded T=0.8 request reproduces, alone or with batch mates; another seed differs."""
    seeded = params(max_tokens=24, temperature=0.8, seed=1234)
    alone = token_ids(llm.generate([PROMPTS[2]], seeded, use_tqdm=False))[0]
    assert token_ids(llm.generate([PROMPTS[2]], seeded, use_tqdm=False))[0] == alone
    others = [params(max_tokens=24, temperature=0.8, seed=s) for s in (1, 2, 3)]
    batch = token_ids(llm.generate(PROMPTS[:3] + [PROMPTS[2]], others + [seeded], use_tqdm=False))
    assert batch[3] == alone
    assert token_ids(llm.generate([PROMPTS[2]], params(max_tokens=24, temperature=0.8, seed=99),
                                  use_tqdm=False))[0] != alone


# --- the target's distribution survives speculation ------------------------------------
# The constant target draws i.i.d. tokens from a fixed p over CONSTANT_TARGET_LOGITS (plus a
# negligible rest); the agreeing head always drafts AGREE_TOKEN, the most likely one, so
# vLLM accepts it with probability p(AGREE_TOKEN) and otherwise samples the residual.
# Sample: 48 requests x 24 tokens = 1152 tokens per engine. Test: chi-square
# homogeneity of the token counts (4 bins) between the speculating and the plain engine,
# p-value threshold 1e-3, so a correct sampler fails 0.1% of runs. Negative control: the
# same test on a "sampler" that always accepts the draft must fail.
NUM_REQUESTS, NUM_TOKENS, P_THRESHOLD = 48, 24, 1e-3


def _bins(sequences):
    tokens = [t for seq in sequences for t in seq]
    known = list(CONSTANT_TARGET_LOGITS)
    return [sum(t == k for t in tokens) for k in known] + [sum(t not in known for t in tokens)]


def _same_distribution(counts_a, counts_b) -> bool:
    from scipy.stats import chi2_contingency
    table = [[a, b] for a, b in zip(counts_a, counts_b) if a + b > 0]
    return chi2_contingency(table).pvalue > P_THRESHOLD


def test_sampled_tokens_keep_the_target_distribution(engine, constant_target, agreeing_head):
    sampling = [params(max_tokens=NUM_TOKENS, temperature=0.8, seed=s) for s in range(NUM_REQUESTS)]
    prompts = [PROMPTS[s % 8] for s in range(NUM_REQUESTS)]
    spec, stats = run(engine(constant_target, agreeing_head), prompts, sampling)
    plain = token_ids(engine(constant_target).generate(prompts, sampling, use_tqdm=False))
    assert 0.2 < stats.draft_acceptance_rate < 0.9  # drafts are tested, and sometimes rejected
    assert _same_distribution(_bins(spec), _bins(plain))
    always_accepted = [[AGREE_TOKEN] * NUM_TOKENS for _ in range(NUM_REQUESTS)]  # negative control
    assert not _same_distribution(_bins(always_accepted), _bins(plain))


def test_drafts_drawn_from_q_are_verified_with_q_and_keep_the_distribution(engine, constant_target):
    """"draft_temperature": unseeded sampled requests get chains drawn from the head's q
    (two tokens, near uniform at a hot draft temperature) and the sampler verifies them
    with q (Leviathan), which accepts sum min(p, q) of first drafts where the target-only
    rule accepts sum q p <= max p: the tokens
    keep the target's distribution (chi-square homogeneity against vLLM without
    speculation, unseeded on both sides), acceptance is above the target-only rule's
    bound for these drafts, and a greedy request beside them still gets argmax drafts."""
    from tests.support.tiny_eagle3 import TWO_DRAFT_TOKENS, two_token_head_dir

    # a hot draft temperature: q close to uniform over the two tokens
    head = two_token_head_dir(constant_target, specplug={**SPECPLUG_CHAIN_SECTION, "draft_temperature": 10.0})
    llm = engine(constant_target, head)
    drafter = drafter_of(llm)
    drawn, draw = [], drafter.session._drawn_chains

    def counting(roots, req_ids, depth):
        drawn.append(len(req_ids))
        return draw(roots, req_ids, depth)

    drafter.session._drawn_chains = counting
    try:
        sampling = params(max_tokens=NUM_TOKENS, temperature=0.8)
        prompts = [PROMPTS[s % 8] for s in range(NUM_REQUESTS)]
        spec, stats = run(llm, prompts, sampling)
        greedy = run(llm, PROMPTS[:1], params(max_tokens=8, temperature=0.0))[0]
    finally:
        del drafter.session._drawn_chains
    plain = token_ids(engine(constant_target).generate(prompts, sampling, use_tqdm=False))
    assert sum(drawn) > 0
    assert _same_distribution(_bins(spec), _bins(plain))
    p = _bins(plain)
    p_two = [p[list(CONSTANT_TARGET_LOGITS).index(t)] / sum(p) for t in TWO_DRAFT_TOKENS]
    first = stats.accepted_per_pos[0] / stats.num_steps  # q-rule: sum min(p, q); target-only: sum q p <= max p
    assert first > max(p_two) + 0.1
    assert greedy == [[AGREE_TOKEN] * 8]


def test_penalties_are_verified_by_specplug_and_stay_exact(engine, target, specplug_head):
    sampling = params(max_tokens=24, temperature=0.0, repetition_penalty=1.3)
    spec, stats = run(engine(target, specplug_head), PROMPTS[:4], sampling)
    assert stats.num_steps > 0
    assert spec == token_ids(engine(target).generate(PROMPTS[:4], sampling, use_tqdm=False))


def test_chunked_prefill_keeps_head_in_sync(engine, target, chain_head, plain_head):
    """A prompt longer than the token budget is prefilled in 64-token chunks; vLLM
    discards the drafts of partial prefills, and the head must still see every committed
    position with the right next token. After the prefill, every step's drafts equal
    vLLM's built-in eagle3 drafts for the same prompt prefilled in one piece. (vLLM's
    built-in itself feeds its head the LAST prompt token at each chunk boundary, so its
    chunked drafts drift; ours do not.)"""
    long_prompt = " ".join(PROMPTS[:8]) * 2  # ~300 tokens
    max_tokens = 24
    sampling = params(max_tokens=max_tokens, temperature=0.0)
    chunked = dict(max_num_batched_tokens=64, max_num_seqs=4)
    ours, stats, ours_drafts = _recorded_drafts(engine(target, chain_head, **chunked), [long_prompt], sampling)
    builtin, _, builtin_drafts = _recorded_drafts(engine(target, plain_head), [long_prompt], sampling)
    assert stats.num_steps > 0
    assert ours == builtin == token_ids(engine(target, **chunked).generate([long_prompt], sampling, use_tqdm=False))
    decode_steps = max_tokens - 1  # every draft is rejected by the random head: one token per step
    assert ours_drafts[-decode_steps:] == builtin_drafts[-decode_steps:]
