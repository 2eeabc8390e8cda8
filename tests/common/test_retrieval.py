"""RetrievalDrafter: exact drafts on hand-made sequences, state equivalences (chunked
prefill, rollback, free -> cache), the static datastore and its validation, and a
property test that every drafted path occurs in the indexed text."""

import json
import random
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specplug.common import tree as tree_lib
from specplug.common.retrieval import (
    ReferenceDrafter, RetrievalConfig, RetrievalDrafter, best_path, build_datastore, continuation_tree,
    load_datastore, save_datastore,
)

LOOSE = RetrievalConfig(min_prob=0.0, prior=0.0)  # every branch, raw frequencies: exact trees


def drafted(drafter, rid="r", **kw):
    """(tokens, parents, probs) of one request's tree, root included."""
    batch, probs = drafter.draft_scored([rid], **kw)
    n = int(batch.num_nodes[0])
    tree_lib.check_parents(batch.parents, batch.num_nodes)
    return batch.candidates[0, :n].tolist(), batch.parents[0, :n].tolist(), probs[0, :n].tolist()


def paths(tokens, parents):
    """Token path (root excluded) of every node."""
    out = [[]]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + [tokens[i]])
    return out


def state(drafter, rid):
    seq = drafter.live[rid]
    return seq.tokens, seq.keys.tolist(), seq.prev.tolist(), dict(seq.head)


# -- exact drafts -----------------------------------------------------------------------------
def test_repeated_phrase_is_drafted_as_a_chain():
    d = RetrievalDrafter(LOOSE)
    d.prefill("r", [10, 11, 12, 13, 14, 20, 21, 10, 11, 12])
    tokens, parents, probs = drafted(d)
    assert tokens == [12, 13, 14, 20, 21, 10, 11, 12]  # root, then everything after the earlier "10 11 12"
    assert parents == [-1, 0, 1, 2, 3, 4, 5, 6]
    assert probs == [1.0] * 8


def test_longest_match_is_preferred():
    # "1" alone is followed by 7 three times, but the suffix "9 8 1" occurred once, followed by 3
    d = RetrievalDrafter(LOOSE)
    d.prefill("r", [5, 1, 7, 5, 1, 7, 5, 1, 7, 9, 8, 1, 3, 4, 0, 9, 8, 1])
    tokens, parents, _ = drafted(d, max_depth=2)
    assert tokens == [1, 3, 4]
    assert parents == [-1, 0, 1]


def test_most_frequent_continuation_ranks_first():
    # after "1 2" (the longest suffix seen before): 3 three times, then 4 once (the most recent)
    d = RetrievalDrafter(LOOSE)
    d.prefill("r", [5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2])
    tokens, parents, probs = drafted(d, max_depth=1)
    assert tokens == [2, 3, 4] and parents == [-1, 0, 0]
    assert probs == pytest.approx([1.0, 0.75, 0.25])
    batch = d.draft(["r"], max_depth=1)
    assert batch.scores[0].tolist() == pytest.approx([0.0, np.log(0.75), np.log(0.25)])


def test_min_prob_and_min_count_prune_weak_branches():
    seq = [5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2]
    for cfg in (RetrievalConfig(min_prob=0.3), RetrievalConfig(min_prob=0.0, min_count=2)):
        d = RetrievalDrafter(cfg)
        d.prefill("r", seq)
        assert drafted(d, max_depth=1)[0] == [2, 3]


def test_min_prob_override_keeps_a_weak_continuation_for_slots_verified_anyway():
    d = RetrievalDrafter()  # prior 4: a lone occurrence after a 1-token match scores 0.2, then 0.04
    d.prefill("r", [1, 7, 8, 9, 1])
    assert drafted(d)[0] == [1, 7]
    tokens, _, probs = drafted(d, min_prob=0.0, max_depth=3)
    assert tokens == [1, 7, 8, 9] and probs == pytest.approx([1.0, 0.2, 0.04, 0.008])
    assert d.config.min_prob == 0.1  # the override is for that call only


def test_min_expected_drafts_only_trees_expected_to_pay():
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, min_expected=0.5))
    d.prefill("weak", [1, 7, 8, 9, 1])  # a lone 1-token match: expected 0.2 + 0.04 + ... < 0.5
    d.prefill("strong", [3, 4, 5, 6, 2, 2, 3, 4, 5, 6, 2, 2, 3, 4, 5])  # 3-token matches, twice
    batch, probs = d.draft_scored(["weak", "strong"])
    assert batch.num_nodes[0] == 1 and batch.num_nodes[1] > 3
    assert probs[1].sum() - 1 >= 0.5
    with pytest.raises(ValueError, match="min_expected"):
        RetrievalConfig(min_expected=-1)


def test_no_match_gives_the_root_alone():
    d = RetrievalDrafter()
    d.prefill("a", [1, 2, 3, 4, 5])
    d.prefill("b", [6, 7, 6, 7])
    batch, probs = d.draft_scored(["a", "b"])
    assert batch.num_nodes.tolist() == [1, 3]
    assert batch.candidates[0, 0] == 5 and batch.parents[0].tolist() == [-1, -1, -1]
    assert probs[0].tolist() == [1.0, 0.0, 0.0]
    assert batch.scores[0, 1:].isneginf().all()
    assert batch.unbind()[0].num_nodes == 1


def test_budget_and_depth_are_respected_and_trees_are_valid():
    rng = random.Random(0)
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, max_match=2))
    d.prefill("r", [rng.randrange(4) for _ in range(300)])
    for budget, depth in [(1, 1), (3, 8), (8, 2), (20, 5)]:
        batch = d.draft(["r"], budget=budget, max_depth=depth)
        tree = batch.unbind()[0]
        assert tree.num_nodes - 1 == budget  # 4 symbols over 300 tokens: plenty of branches
        assert tree.max_depth <= depth


def test_nodes_are_ordered_best_first():
    rng = random.Random(1)
    d = RetrievalDrafter(LOOSE)
    d.prefill("r", [rng.randrange(3) for _ in range(200)])
    tokens, parents, probs = drafted(d, budget=12, max_depth=4)
    for i in range(1, len(tokens)):
        assert probs[i] <= probs[parents[i]]
        siblings = [j for j in range(1, i) if parents[j] == parents[i]]
        assert all(probs[j] >= probs[i] for j in siblings)
    # nodes 1..d follow the most frequent child at every step
    node, depth = 0, 0
    while any(parents[j] == node for j in range(1, len(tokens))):
        node, depth = node + 1, depth + 1
        assert parents[node] == node - 1


def test_best_chain_maximises_expected_accepted_length():
    # after "5": "1 1" once and "2" twice. Greedy by frequency takes 2 (0.67);
    # the chain "1 1" is worth 0.33 + 0.33 < 0.67, so 2 wins at k = 2 ...
    conts = [[2], [1, 1], [2]]
    assert best_path(conts, 2, LOOSE) == ([2], [pytest.approx(2 / 3)])
    # ... but "3 4 5" (3 x 0.5) beats "6" (0.5) at k = 3
    assert best_path([[6], [3, 4, 5]], 3, LOOSE)[0] == [3, 4, 5]
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, prior=0.0, max_match=1))
    d.prefill("r", [9, 3, 4, 5, 1, 9, 6, 2, 9, 6, 8, 9])  # after 9: 6 8, 6 2, 3 4 5 1
    chain, probs = d.best_chain(["r"], k=2)
    assert chain.candidates[0].tolist() == [9, 6, 8] and chain.parents[0].tolist() == [-1, 0, 1]
    assert probs[0].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3])
    # k = 4: "6 2 9 6" (2/3 + 3 x 1/3) beats "3 4 5 1" (4 x 1/3) and "6 8 9" (the sequence ends)
    chain, probs = d.best_chain(["r"], k=4)
    assert chain.candidates[0].tolist() == [9, 6, 2, 9, 6]
    tree = d.draft(["r"], budget=3, max_depth=4)  # nodes by count, then depth: 6, 3, 8
    assert tree.candidates[0].tolist() == [9, 6, 8, 3] and tree.parents[0].tolist() == [-1, 0, 1, 0]


def test_continuation_tree_of_nothing_is_empty():
    assert continuation_tree([], 8) == ([], [], [])
    assert continuation_tree([[1, 2]], 0) == ([], [], [])


def test_prior_shrinks_what_few_occurrences_support():
    cfg = RetrievalConfig(min_prob=0.0, prior=1.0)
    # one occurrence: each step halves the score
    assert continuation_tree([[7, 8, 9]], 8, cfg) == ([7, 8, 9], [0, 1, 2], [0.5, 0.25, 0.125])
    # after 9 occurrences of "1", 9 / 10; after the lone "2 3", 1 / 11 then 1 / 22
    tokens, parents, scores = continuation_tree([[1]] * 9 + [[2, 3]], 8, cfg)
    assert tokens == [1, 2, 3] and parents == [0, 0, 2]
    assert scores == pytest.approx([9 / 11, 1 / 11, 1 / 22])
    # ranked by score: "8 1" (3/7 * 3/4) before "9" (2/7) before the lone "4" (1/7)
    tokens, parents, scores = continuation_tree([[4, 5, 6]] + [[8, 1]] * 3 + [[9]] * 2, 3, cfg)
    assert tokens == [8, 1, 9] and parents == [0, 1, 0]
    assert scores == pytest.approx([3 / 7, 9 / 28, 2 / 7])
    assert continuation_tree([[7, 8, 9]], 8, RetrievalConfig(prior=1.0, min_prob=0.2))[0] == [7, 8]
    # a longer match is trusted more: prior / n, here 4 / 8
    assert continuation_tree([[7, 8]], 8, RetrievalConfig(min_prob=0.0), match_length=8)[2] == \
        pytest.approx([2 / 3, 4 / 9])
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0))
    d.prefill("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7, 8])  # an 8-token match
    assert drafted(d, max_depth=2)[2] == pytest.approx([1, 2 / 3, 4 / 9])


def test_a_batch_equals_its_requests_drafted_alone_and_drafting_keeps_state():
    rng = random.Random(4)
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, max_match=3))
    for rid in "abc":
        d.prefill(rid, [rng.randrange(5) for _ in range(rng.randrange(1, 60))])
    before = {rid: state(d, rid) for rid in "abc"}
    batch, probs = d.draft_scored(list("abc"))
    assert {rid: state(d, rid) for rid in "abc"} == before
    for b, rid in enumerate("abc"):
        alone, alone_probs = d.draft_scored([rid])
        n = int(alone.num_nodes[0])
        assert int(batch.num_nodes[b]) == n
        assert batch.candidates[b, :n].tolist() == alone.candidates[0].tolist()
        assert batch.parents[b, :n].tolist() == alone.parents[0].tolist()
        assert probs[b, :n].tolist() == alone_probs[0].tolist()
        assert (batch.parents[b, n:] == -1).all() and (probs[b, n:] == 0).all()


# -- state ------------------------------------------------------------------------------------
def test_chunked_prefill_equals_one_shot_prefill():
    rng = random.Random(2)
    tokens = [rng.randrange(6) for _ in range(120)]
    one, chunked = RetrievalDrafter(LOOSE), RetrievalDrafter(LOOSE)
    one.prefill("r", tokens)
    for start in range(0, 120, 37):
        chunked.prefill("r", tokens[start:start + 37])
    assert state(one, "r") == state(chunked, "r")
    assert one.draft(["r"]).candidates.tolist() == chunked.draft(["r"]).candidates.tolist()


def test_rollback_then_extend_equals_never_adding():
    rng = random.Random(3)
    tokens = [rng.randrange(5) for _ in range(80)]
    clean, rolled = RetrievalDrafter(LOOSE), RetrievalDrafter(LOOSE)
    clean.prefill("r", tokens[:50])
    rolled.prefill("r", tokens[:50])
    rolled.extend("r", [rng.randrange(5) for _ in range(9)])
    rolled.rollback("r", 47)
    rolled.extend("r", tokens[47:50])
    assert state(clean, "r") == state(rolled, "r")
    clean.extend("r", tokens[50:])
    rolled.extend("r", torch.tensor(tokens[50:]))
    assert state(clean, "r") == state(rolled, "r")
    rolled.rollback("r", 0)
    assert state(rolled, "r") == ([], [], [], {})


def test_sync_follows_an_engines_committed_tokens():
    """sync(prompt, output) appends what is new, forgets what the engine discarded, and
    ends in the state of adding the same tokens directly."""
    rng = random.Random(5)
    prompt, output = [rng.randrange(5) for _ in range(30)], [rng.randrange(5) for _ in range(20)]
    direct, synced = RetrievalDrafter(LOOSE), RetrievalDrafter(LOOSE)
    direct.prefill("r", prompt + output)
    synced.sync("r", prompt[:10], [])  # a first chunk
    synced.sync("r", prompt, output[:5])
    synced.sync("r", prompt, output[:5] + [4, 4, 4])  # drafts the engine later discards
    synced.sync("r", prompt, output[:5])
    synced.sync("r", prompt, output)
    assert state(direct, "r") == state(synced, "r")
    synced.sync("r", prompt[:12])  # a recomputed request shorter than before
    assert synced.tokens("r") == prompt[:12]


def test_bad_calls_are_refused():
    d = RetrievalDrafter()
    with pytest.raises(ValueError, match="call prefill"):
        d.extend("nope", [1])
    with pytest.raises(ValueError, match="no committed tokens"):
        d.draft(["nope"])
    assert d.draft(["nope"], root_tokens=[7]).candidates.tolist() == [[7]]
    d.prefill("r", [1, 2])
    with pytest.raises(ValueError, match="rollback length"):
        d.rollback("r", 3)
    with pytest.raises(ValueError, match="last committed token is 2"):
        d.draft(["r"], root_tokens=[5])
    with pytest.raises(ValueError, match=">= 0"):
        d.extend("r", [-1])
    with pytest.raises(ValueError, match="max_match"):
        RetrievalConfig(min_match=4, max_match=2)
    with pytest.raises(ValueError, match="budget"):
        RetrievalConfig(budget=0)
    d.free("never-seen")  # engines may free requests that never ran


def test_a_later_request_drafts_from_an_earlier_output():
    d = RetrievalDrafter(LOOSE)
    d.prefill("first", [1, 2, 3, 4, 5, 6, 7])
    d.extend("first", [8, 9])
    d.free("first")
    assert "first" not in d.live and len(d.cache) == 1
    d.prefill("second", [40, 41, 5, 6])
    assert drafted(d, "second")[0] == [6, 7, 8, 9]
    # own occurrences come first, then the cache's
    d.prefill("third", [5, 6, 0, 5, 6])
    tokens, parents, probs = drafted(d, "third", max_depth=1)
    assert tokens == [6, 0, 7] and probs == [1.0, 0.5, 0.5]


def test_clear_cache_keeps_requests_live_then_out_of_the_cache():
    """An engine frees a finished request at its next step, which may come after a caller
    cleared the cache between two runs: that request never joins the new cache (else a
    benchmark's second run of the same prompt would draft from the first one's output)."""
    d = RetrievalDrafter(LOOSE)
    d.prefill("first", [1, 2, 3, 4, 5, 6, 7])
    d.clear_cache()
    assert drafted(d, "first")[0][:1] == [7]  # still drafts from its own tokens while live
    d.free("first")
    assert "first" not in d.live and len(d.cache) == 0
    d.prefill("first", [1, 2, 3])  # an id reused later is cached as usual
    d.free("first")
    assert len(d.cache) == 1


def test_cache_is_bounded_and_evicts_the_oldest():
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, cache_requests=2))
    for i, rid in enumerate(["a", "b", "c"]):
        d.prefill(rid, [100 + i, 50, 60 + i])
        d.free(rid)
    assert len(d.cache) == 2
    assert [seq.tokens[0] for seq, _ in d.cache.entries.values()] == [101, 102]
    d.prefill("q", [7, 50])
    assert drafted(d, "q")[0] == [50, 62, 61]  # "a" (-> 60) is gone; "c" is the most recent
    # the evicted sequence left no chain heads behind
    assert all(gid >= d.cache.floor for gid in d.cache.head.values())
    d.prefill("r", [100])
    assert drafted(d, "r")[0] == [100]


def test_cache_is_bounded_by_tokens_too():
    """cache_tokens caps the cached tokens in all (oldest requests evicted first), so
    long requests cannot grow a server's memory 256 requests deep; the newest stays."""
    d = RetrievalDrafter(RetrievalConfig(min_prob=0.0, cache_requests=100, cache_tokens=7))
    for i, rid in enumerate(["a", "b", "c"]):
        d.prefill(rid, [100 + i, 50, 60 + i])
        d.free(rid)
    assert [seq.tokens[0] for seq, _ in d.cache.entries.values()] == [101, 102] and d.cache.tokens == 6
    assert all(gid >= d.cache.floor for gid in d.cache.head.values())
    d.prefill("long", list(range(200, 220)))
    d.free("long")
    assert [seq.tokens[0] for seq, _ in d.cache.entries.values()] == [200] and d.cache.tokens == 20
    with pytest.raises(ValueError, match="cache_tokens"):
        RetrievalConfig(cache_tokens=-1)


# -- datastore ------------------------------------------------------------------------------
CORPUS = [[1, 2, 3, 4, 5], [7, 2, 3, 9], [2, 3, 4, 8, 8, 8]]


def test_datastore_round_trip_and_drafts(tmp_path):
    built = build_datastore(CORPUS, tmp_path / "ds.npz", max_match=4, vocab_size=16, source="unit")
    store = load_datastore(tmp_path / "ds.npz", vocab_size=16)
    for name in ("tokens", "keys", "ends"):
        assert np.array_equal(getattr(built, name), getattr(store, name))
    assert store.summary() == built.summary() | {"source": "unit"}
    assert store.summary()["tokens"] == 15 and store.num_sequences == 3
    d = RetrievalDrafter(LOOSE, datastore=store)
    d.prefill("r", [0, 2, 3])
    tokens, parents, probs = drafted(d, max_depth=2)
    # "2 3" occurs 3 times: 4 5 / 9 (then the end of its sequence) / 4 8
    assert tokens == [3, 4, 5, 8, 9] and parents == [-1, 0, 1, 1, 0]
    assert probs == pytest.approx([1, 2 / 3, 1 / 3, 1 / 3, 1 / 3])
    d.prefill("s", [6, 8, 8])  # 8 8 -> 8, never across the end of a sequence
    assert drafted(d, "s")[0] == [8, 8]


def test_datastore_is_refused_when_corrupted_or_mismatched(tmp_path):
    path = tmp_path / "ds.npz"
    store = build_datastore(CORPUS, path)
    with pytest.raises(ValueError, match=r"ds.npz: field 'vocab_size' expected at most 8 .* rebuild"):
        load_datastore(path, vocab_size=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_datastore(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="junk.npz: not a readable .npz"):
        load_datastore(tmp_path / "junk.npz")
    (tmp_path / "cut.npz").write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="cut.npz"):
        load_datastore(tmp_path / "cut.npz")
    fields = dict(np.load(path))
    cases = {
        "tokens": (fields["tokens"][::-1].copy(), "tokens and index disagree"),
        "keys": (fields["keys"].astype(np.int64), "field 'keys' expected uint32 with 1 dims, given int64"),
        "version": (np.int64(99), "field 'version' expected 1, given 99"),
    }
    for name, (value, message) in cases.items():
        np.savez(tmp_path / f"bad_{name}.npz", **(fields | {name: value}))
        with pytest.raises(ValueError, match=message):
            load_datastore(tmp_path / f"bad_{name}.npz")
    np.savez(tmp_path / "no_ends.npz", **{k: v for k, v in fields.items() if k != "ends"})
    with pytest.raises(ValueError, match="field 'ends' is missing"):
        load_datastore(tmp_path / "no_ends.npz")
    save_datastore(store, tmp_path / "again.npz")
    with zipfile.ZipFile(tmp_path / "again.npz") as z:
        assert all(name.endswith(".npy") for name in z.namelist())  # plain arrays, no pickles


# -- property ---------------------------------------------------------------------------------
def occurs_in(needle, haystacks):
    n = len(needle)
    return any(h[i:i + n] == needle for h in haystacks for i in range(len(h) - n + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    own=st.lists(st.integers(0, 4), min_size=1, max_size=60),
    finished=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), max_size=3),
    corpus=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=20), max_size=3),
    min_match=st.integers(1, 3),
    extra=st.integers(0, 3),
    budget=st.integers(1, 10),
)
def test_every_drafted_path_occurs_in_the_indexed_text(own, finished, corpus, min_match, extra, budget):
    cfg = RetrievalConfig(min_match=min_match, max_match=min_match + extra, budget=budget, max_depth=4,
                          min_prob=0.0, max_occurrences=8)
    store = build_datastore(corpus, min_match=1, max_match=3) if corpus else None
    d = RetrievalDrafter(cfg, datastore=store)
    for i, seq in enumerate(finished):
        d.prefill(i, seq)
        d.free(i)
    d.prefill("r", own)
    batch, probs = d.draft_scored(["r"])
    n = int(batch.num_nodes[0])
    tokens, parents = batch.candidates[0, :n].tolist(), batch.parents[0, :n].tolist()
    tree_lib.check_parents(batch.parents, batch.num_nodes)
    assert tokens[0] == own[-1] and n - 1 <= budget
    # the matched pattern (at least the last min_match tokens) followed by the path, in one sequence
    for i, path in enumerate(paths(tokens, parents)[1:], start=1):
        assert len(path) <= 4
        assert 0 < probs[0, i] <= probs[0, parents[i]]
        assert occurs_in(own[-min_match:] + path, [own] + finished + corpus)


# -- reference loop and command line ---------------------------------------------------------
def test_reference_loop_is_lossless_and_accepts_drafts(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    from specplug.common.reference import generate

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    prompt = torch.tensor([5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7])
    with torch.no_grad():
        plain = target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    result = generate(target, ReferenceDrafter(), prompt, 24, tree=tree_lib.TreeConfig(depth=4, budget=6))
    assert result.tokens == plain[:len(result.tokens)] and len(result.tokens) >= min(24, len(plain))
    assert sum(result.num_accepted) > 0


def test_cli_builds_a_datastore(tiny_llama_path, tmp_path, capsys):
    from specplug.cli import main

    data = tmp_path / "corpus.jsonl"
    records = [{"text": "the quick red fox"},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]},
               {"conversations": [{"from": "human", "value": "a b"}, {"from": "gpt", "value": "the dog"}]}]
    data.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "ds.npz"
    assert main(["datastore", "build", "--target", str(tiny_llama_path), "--data", str(data),
                 "--out", str(out), "--max-match", "4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["sequences"] == 3 and summary["max_match"] == 4 and summary["vocab_size"] == 512
    assert load_datastore(out, vocab_size=512).num_sequences == 3
    assert main(["datastore", "info", str(out)]) == 0
    with pytest.raises(SystemExit):
        main(["datastore", "build", "--help"])
    help_text = capsys.readouterr().out
    for option in ("--target", "--data", "--out", "--max-samples", "--max-length", "--min-match", "--max-match"):
        assert option in help_text
    assert "(default: 2000)" in help_text


def test_skip_head_needs_every_request_confident():
    from specplug.common.retrieval import RetrievalConfig
    probs = torch.tensor([[1.0, 0.9, 0.6, 0.0], [1.0, 0.5, 0.2, 0.1]])  # expects 1.5 and 0.8
    assert not RetrievalConfig().skip_head(probs)  # head_skip None: the head always drafts
    assert RetrievalConfig(head_skip=0.8).skip_head(probs)
    assert not RetrievalConfig(head_skip=1.0).skip_head(probs)
    assert RetrievalConfig(head_skip=1.0).skip_head(probs[:1])
    with pytest.raises(ValueError, match="head_skip"):
        RetrievalConfig(head_skip=0.0)


def test_lengthen_scores_deeper_nodes_as_longer_matches():
    """A lone occurrence after a 2-token match, prior 4: off, every depth uses prior / 2
    (1/3, 1/9, 1/27); with lengthen, depth d uses prior / (2 + d - 1) (1/3, 1/7, 1/14),
    for a chain and inside a branching tree alike."""
    from specplug.common.retrieval import RetrievalConfig, continuation_tree

    plain, grown = RetrievalConfig(min_prob=0.0), RetrievalConfig(min_prob=0.0, lengthen=True)
    assert continuation_tree([[5, 6, 7]], 3, plain, match_length=2)[2] == pytest.approx([1 / 3, 1 / 9, 1 / 27])
    assert continuation_tree([[5, 6, 7]], 3, grown, match_length=2)[2] == pytest.approx([1 / 3, 1 / 7, 1 / 14])
    tokens, parents, scores = continuation_tree([[5, 6, 7], [5, 6, 7], [8]], 8, grown, match_length=2)
    assert tokens[:3] == [5, 6, 7] and scores[:3] == pytest.approx([2 / 5, 2 / 5 * 2 / (2 + 4 / 3),
                                                                    2 / 5 * 2 / (2 + 4 / 3) * 2 / (2 + 1)])
