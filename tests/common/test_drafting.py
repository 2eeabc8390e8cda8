"""The engine drafting state (drafting.eagle.EagleDrafting) through the runner seam
(drafting.runner.TorchHeadRunner), on the tiny Llama: a batched step equals one step per
request, a catch-up after an engine roll-back equals never having seen the rolled-back
rows, deferred rows equal catching up every step, the backlog cap drops the oldest rows,
forget frees finished requests, held roots serve only while in step with the engine
(deferred rows caught up when drafting resumes), and a DraftCache's buffers hold exactly what copying
would; masked_attention equals SDPA over repeated keys."""

import pytest
import torch
import torch.nn.functional as F

from specplug.common.drafting.eagle import Committed, DraftCache, EagleDrafting, HeldRoots
from specplug.common.drafting.runner import Segment, TorchHeadRunner, masked_attention
from specplug.common.tree import TreeConfig
from tests.common.test_drafters import random_eagle3_head, target, target_hidden  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = torch.tensor([1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])


@pytest.fixture(scope="module")
def runner(target):
    return TorchHeadRunner(random_eagle3_head(target))


@pytest.fixture(scope="module")
def states(target, runner):
    """[len(TEXT), 3 H]: the target's aux states over TEXT, as an engine captures them."""
    layers = runner.head.config.resolved_aux_layer_ids(target.config.num_hidden_layers)
    return target_hidden(target, TEXT, layers)


@pytest.fixture(scope="module")
def hidden(runner, states):
    """[len(TEXT), H]: the head's combined target states over TEXT."""
    return runner.combine(states)


def rows(req_id, states, start, stop):
    """Committed rows start..stop-1 of TEXT: token after position i is TEXT[i + 1]."""
    return Committed(req_id, TEXT[start + 1:stop + 1], torch.arange(start, stop), states[start:stop])


def assert_same_root(a, b):
    assert a.token == b.token and a.position == b.position
    for x, y in ((a.key, b.key), (a.value, b.value), (a.hidden, b.hidden), (a.logprobs, b.logprobs)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_batched_step_equals_one_step_per_request(runner, hidden):
    past = runner.step(TEXT[1:5], hidden[:4], torch.arange(4),
                       [Segment(slice(0, 4), runner.empty_kv(), runner.empty_kv(), torch.ones(4, 4).tril().bool())])
    seg_a = Segment(slice(0, 3), past.key, past.value, torch.ones(3, 7).tril(diagonal=4).bool())
    seg_b = Segment(slice(3, 5), runner.empty_kv(), runner.empty_kv(), torch.ones(2, 2).tril().bool())
    tokens, states = torch.cat([TEXT[5:8], TEXT[1:3]]), torch.cat([hidden[4:7], hidden[:2]])
    positions = torch.cat([torch.arange(4, 7), torch.arange(2)])
    both = runner.step(tokens, states, positions, [seg_a, seg_b._replace(rows=slice(3, 5))])
    one_a = runner.step(tokens[:3], states[:3], positions[:3], [seg_a])
    one_b = runner.step(tokens[3:], states[3:], positions[3:], [seg_b._replace(rows=slice(0, 2))])
    for field in ("logprobs", "hidden", "key", "value"):
        torch.testing.assert_close(getattr(both, field), torch.cat([getattr(one_a, field), getattr(one_b, field)]),
                                   rtol=1e-3, atol=1e-3)  # batched matmuls round differently


def test_a_step_split_into_padded_groups_equals_one_forward(runner, hidden, monkeypatch):
    """TorchHeadRunner bounds each padded forward (PADDED_ROWS): a long request runs apart
    from short ones; results, log-prob rows in the order asked included, are the same."""
    from specplug.common.drafting import runner as runner_module

    past = runner.step(TEXT[1:5], hidden[:4], torch.arange(4),
                       [Segment(slice(0, 4), runner.empty_kv(), runner.empty_kv(), torch.ones(4, 4).tril().bool())])
    segments = [Segment(slice(0, 3), past.key, past.value, torch.ones(3, 7).tril(diagonal=4).bool()),
                Segment(slice(3, 5), runner.empty_kv(), runner.empty_kv(), torch.ones(2, 2).tril().bool()),
                Segment(slice(5, 8), runner.empty_kv(), runner.empty_kv(), torch.ones(3, 3).tril().bool())]
    tokens, states = torch.cat([TEXT[5:8], TEXT[1:3], TEXT[1:4]]), torch.cat([hidden[4:7], hidden[:2], hidden[:3]])
    positions = torch.cat([torch.arange(4, 7), torch.arange(2), torch.arange(3)])
    logit_rows = torch.tensor([7, 0, 4])
    whole = runner.step(tokens, states, positions, segments, logit_rows=logit_rows)
    monkeypatch.setattr(runner_module, "PADDED_ROWS", 6)  # groups: [0], [1, 2]
    assert [len(g) for g in runner_module._groups(segments)] == [1, 2]
    split = runner.step(tokens, states, positions, segments, logit_rows=logit_rows)
    for field in ("logprobs", "hidden", "key", "value"):
        torch.testing.assert_close(getattr(split, field), getattr(whole, field), rtol=1e-3, atol=1e-3)


def test_catch_up_after_rollback_equals_a_fresh_request(runner, states):
    drafting, fresh = EagleDrafting(runner), EagleDrafting(runner)
    drafting.catch_up([rows("a", states, 0, 8)])
    (rolled,) = drafting.catch_up([rows("a", states, 5, 10)])  # the engine discarded positions 5..7
    (want,) = fresh.catch_up([rows("a", states, 0, 10)])
    assert_same_root(rolled, want)
    assert drafting.caches["a"].positions.tolist() == list(range(10))


def test_deferred_rows_equal_catching_up_every_step(runner, states):
    """Rows that wait are combined with the rest at the next catch-up, from copies (the
    engine may overwrite the buffer they came from), and give the same root and trees."""
    deferred, eager = EagleDrafting(runner), EagleDrafting(runner)
    for start, stop in ((0, 4), (4, 6), (6, 9)):
        eager.catch_up([rows("a", states, start, stop)])
    deferred.catch_up([rows("a", states, 0, 4)])
    buffer = states.clone()  # the engine's capture buffer, reused after each step
    deferred.defer([rows("a", buffer, 4, 7)])
    buffer.zero_()
    deferred.defer([rows("a", states, 6, 8)])  # a step that rolled back position 6 of the last one
    deferred.catch_up([rows("a", states, 8, 9)])
    (want,) = eager.catch_up([rows("a", states, 9, 10)])
    (root,) = deferred.catch_up([rows("a", states, 9, 10)])
    assert_same_root(root, want)
    a, b = deferred.trees([root], TreeConfig(3, 2, 5)), eager.trees([want], TreeConfig(3, 2, 5))
    assert torch.equal(a.candidates, b.candidates) and torch.equal(a.parents, b.parents)


def test_backlog_cap_keeps_the_newest_rows(runner, states):
    drafting = EagleDrafting(runner, max_pending_rows=3)
    drafting.catch_up([rows("a", states, 0, 2)])
    drafting.defer([rows("a", states, 2, 5)])
    drafting.defer([rows("a", states, 5, 8)])
    assert drafting.pending["a"].rows == 3
    drafting.catch_up([rows("a", states, 8, 9)])
    assert drafting.caches["a"].positions.tolist() == [0, 1, 5, 6, 7, 8]  # 2..4 dropped: a gap


def test_forget_frees_what_the_engine_dropped(runner, states):
    drafting = EagleDrafting(runner)
    drafting.catch_up([rows("a", states, 0, 3), rows("b", states, 0, 4)])
    drafting.defer([rows("b", states, 4, 5)])
    drafting.forget({"a"})
    assert set(drafting.caches) == {"a"} and not drafting.pending and drafting.length("b") == 0


def test_held_roots_serve_only_while_in_step_with_the_engine(runner, states):
    """A held Root is drafted from only at the engine's root token and seq_len - 1 (a
    negative control for each); free and clear drop the head state with it; past
    max_live, requests missing from the decode batch are freed."""
    held = HeldRoots(EagleDrafting(runner), max_live=2)
    held.catch_up([rows("a", states, 0, 5), rows("b", states, 0, 3)])
    token_a, token_b = int(TEXT[5]), int(TEXT[3])
    found = held.in_step(["a", "b", "c"], [token_a, token_b, 1], [5, 3, 1])  # root at seq_len - 1
    assert [r is not None for r in found] == [True, True, False] and found[0].position == 4
    assert held.in_step(["a"], [token_a + 1], [5]) == [None]  # another root token: a retraction
    assert held.in_step(["a"], [token_a], [6]) == [None]  # a step the head did not see
    held.catch_up([rows("c", states, 0, 2)])
    held.forget_stale(["a", "c"])  # three held, bound two: "b" was never reported finished
    assert set(held.roots) == {"a", "c"} and held.drafting.length("b") == 0
    held.free(["a"])
    assert set(held.roots) == {"c"} and held.drafting.length("a") == 0
    held.clear()
    assert not held.roots and not held.drafting.caches


def test_held_roots_defer_steps_without_drafts_and_catch_up_when_drafting_resumes(runner, states):
    """Rows deferred over steps without drafts are caught up at the next in_step, in one
    head step: the Root equals catching up every step; before it the held Root is out of
    step (a negative control: without the catch-up in_step finds nothing to draft from)."""
    every, deferred = HeldRoots(EagleDrafting(runner), max_live=4), HeldRoots(EagleDrafting(runner), max_live=4)
    for held in (every, deferred):
        held.catch_up([rows("a", states, 0, 4), rows("b", states, 0, 3)])
    for start in range(4, 7):  # three plain steps, one row each (b stays out of the batch)
        every.committed([rows("a", states, start, start + 1)], drafted=True)
        deferred.committed([rows("a", states, start, start + 1)], drafted=False)
    assert deferred.roots["a"].position == 3 and deferred.drafting.pending  # nothing ran yet
    token = int(TEXT[7])
    found = deferred.in_step(["a", "b"], [token, int(TEXT[3])], [7, 3])
    assert_same_root(found[0], every.in_step(["a"], [token], [7])[0])
    assert found[1] is not None and not deferred.drafting.pending
    assert deferred.drafting.length("a") == every.drafting.length("a") == 7
    without = HeldRoots(EagleDrafting(runner), max_live=4)
    without.catch_up([rows("a", states, 0, 4)])
    without.drafting.defer([rows("a", states, 4, 7)])
    without.drafting.pending.clear()  # the deferred rows lost: the held Root stays out of step
    assert without.in_step(["a"], [token], [7]) == [None]


def test_draft_cache_buffers_equal_copies():
    """Appends and roll-backs in any order leave key/value/positions equal to the
    concatenate-and-slice reference; buffers grow by doubling, so 300 appends of 1-3
    rows reallocate at most ~6 times and a roll-back reallocates nothing."""
    gen = torch.Generator().manual_seed(0)
    cache = DraftCache(torch.zeros(0, 3, 4), torch.zeros(0, 3, 4), torch.zeros(0, dtype=torch.long))
    ref_key, ref_value, ref_pos = torch.zeros(0, 3, 4), torch.zeros(0, 3, 4), torch.zeros(0, dtype=torch.long)
    capacities, position = set(), 0
    for _ in range(300):
        if position > 4 and torch.rand(1, generator=gen) < 0.3:  # the engine rejected the last few rows
            position -= int(torch.randint(1, 4, (1,), generator=gen))
            cache.truncate(position)
            n = int((ref_pos < position).sum())
            ref_key, ref_value, ref_pos = ref_key[:n], ref_value[:n], ref_pos[:n]
        n = int(torch.randint(1, 4, (1,), generator=gen))
        key, value = torch.randn(n, 3, 4, generator=gen), torch.randn(n, 3, 4, generator=gen)
        positions = torch.arange(position, position + n)
        cache.append(key, value, positions)
        ref_key, ref_value = torch.cat([ref_key, key]), torch.cat([ref_value, value])
        ref_pos, position = torch.cat([ref_pos, positions]), position + n
        assert cache.length == ref_key.shape[0]
        assert torch.equal(cache.key, ref_key) and torch.equal(cache.value, ref_value)
        assert torch.equal(cache.positions, ref_pos)
        capacities.add(cache.capacity)
    assert all(c & (c - 1) == 0 for c in capacities) and len(capacities) <= 7


@pytest.mark.parametrize("heads,kv_heads,rows,past", [(9, 3, 1, 0), (9, 3, 5, 40), (4, 4, 3, 7), (8, 2, 16, 130)])
def test_masked_attention_equals_sdpa_over_repeated_kv(heads, kv_heads, rows, past):
    """Grouped-query attention under an arbitrary mask (each row sees itself) matches
    SDPA over keys/values repeated to every query head."""
    g = torch.Generator().manual_seed(rows * 1000 + past)
    dim = 16
    q = torch.randn(rows, heads * dim, generator=g)
    keys, values = torch.randn(2, past + rows, kv_heads, dim, generator=g)
    mask = torch.rand(rows, past + rows, generator=g) < 0.6
    mask[:, past:] = torch.eye(rows, dtype=torch.bool)  # a tree: itself and (below) some ancestors
    mask[:, past:] |= torch.rand(rows, rows, generator=g).tril(-1) < 0.5
    groups = heads // kv_heads
    expected = F.scaled_dot_product_attention(
        q.view(rows, heads, dim).transpose(0, 1), keys.transpose(0, 1).repeat_interleave(groups, dim=0),
        values.transpose(0, 1).repeat_interleave(groups, dim=0), attn_mask=mask[None], scale=0.3,
    ).transpose(0, 1).reshape(rows, heads * dim)
    got = masked_attention(q, keys, values, mask, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prefill_and_accepted_rows_pair_each_state_with_the_token_after_it():
    """An engine's prefill chunks and verify steps as Committed rows (drafting.eagle)."""
    from specplug.common.drafting.eagle import accepted_rows, prefill_rows
    from specplug.common.verify_result import VerifyResult

    states = torch.arange(7.0)[:, None]  # [sum n, 1]: row i's state is i
    chunks = prefill_rows(["a", "b"], [[5, 6, 7, 8], [9, 10]], [(0, 3), (0, 2)], [99, 11], states[:5])
    assert [c.shifted.tolist() for c in chunks] == [[6, 7, 8], [10, 11]]  # b's last: its sampled token
    assert chunks[1].positions.tolist() == [0, 1] and chunks[1].hidden[:, 0].tolist() == [3, 4]
    candidates = torch.tensor([[1, 2, 3], [4, 5, 6]])  # [B, n]: node 1 under the root, node 2 under node 1
    verdict = VerifyResult(torch.tensor([[0, 1, 2], [0, -1, -1]]), torch.tensor([2, 0]), torch.tensor([7, 8]))
    path = accepted_rows(["a", "b"], candidates, verdict, [10, 4], torch.arange(6.0)[:, None])
    assert [p.shifted.tolist() for p in path] == [[2, 3, 7], [8]]
    assert [p.positions.tolist() for p in path] == [[10, 11, 12], [4]]
    assert [p.hidden[:, 0].tolist() for p in path] == [[0, 1, 2], [3]]  # rows b * n + accepted node
