"""specplug bench --interleave: rounds, their order, and how rounds add up to one result."""

import pytest

from specplug.bench_types import RunResult
from specplug.bench_rounds import combine, rotated, rounds, sweep_interleaved


def test_rounds_are_whole_batches_covering_every_prompt_once():
    prompts = [f"p{i}" for i in range(10)]
    assert rounds(prompts, 4, 1) == [prompts[0:4], prompts[4:8], prompts[8:10]]
    assert rounds(prompts, 3, 2) == [prompts[0:4], prompts[4:8], prompts[8:10]]   # 3 -> 2 whole batches
    assert rounds(prompts, 1, 16) == [prompts]                                  # a round is >= one batch


def test_every_method_takes_every_place_in_the_order_equally_often():
    methods = ["none", "a", "b"]
    orders = [rotated(methods, r) for r in range(6)]
    for method in methods:
        places = [order.index(method) for order in orders]
        assert sorted(places) == [0, 0, 1, 1, 2, 2]


def test_rounds_add_up_to_the_run_without_interleaving():
    parts = [RunResult("x", 1, 2, output_tokens=8, seconds=2.0, num_drafts=4, num_draft_tokens=16,
                       num_accepted=3, accepted_per_pos=[2, 1], outputs=[[1], [2]]),
             RunResult("x", 1, 1, output_tokens=4, seconds=1.0, num_drafts=2, num_draft_tokens=8,
                       num_accepted=2, accepted_per_pos=[1, 0, 1], outputs=[[3]])]
    whole = combine(parts)
    assert (whole.num_prompts, whole.output_tokens, whole.seconds) == (3, 12, 3.0)
    assert (whole.num_drafts, whole.num_draft_tokens, whole.num_accepted) == (6, 24, 5)
    assert whole.accepted_per_pos == [3, 1, 1]
    assert whole.outputs == [[1], [2], [3]]
    assert whole.rounds == [[8, 2.0], [4, 1.0]]
    assert whole.tau == pytest.approx(1 + 5 / 6)
    assert whole.draft_seconds is None          # a time nobody measured stays unknown


def test_sweep_interleaved_turns_fresh_caches_and_prompt_order():
    calls = []

    def fake(method):
        def run(prompts, batch, fresh):
            calls.append((method, batch, tuple(prompts), fresh))
            return RunResult(method, batch, len(prompts), len(prompts), 1.0, outputs=[[int(p)] for p in prompts])
        return run

    prompts = [str(i) for i in range(8)]
    results = sweep_interleaved({"none": fake("none"), "x": fake("x")}, prompts, [1, 4],
                                num_prompts=4, round_size=2)
    assert [c[:2] for c in calls[:4]] == [("none", 1), ("x", 1), ("x", 1), ("none", 1)]
    assert [c[3] for c in calls if c[1] == 1] == [True, True, False, False]   # caches reset once per run
    assert [(r.method, r.batch_size, r.num_prompts) for r in results] == [
        ("none", 1, 4), ("x", 1, 4), ("none", 4, 4), ("x", 4, 4)]
    assert results[1].outputs == [[0], [1], [2], [3]]                           # prompt order kept
    assert len(results[0].rounds) == 2 and len(results[2].rounds) == 1


def test_an_interleaved_run_that_would_not_fit_is_refused_naming_the_fixes(monkeypatch):
    import psutil

    from specplug.bench_rounds import check_memory

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 8 << 30})())
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    with pytest.raises(SystemExit, match=r"--methods.*VLLM_CPU_KVCACHE_SPACE=1.*--interleave 0"):
        check_memory("vllm", ["none", "ngram", "specplug"])             # 3 x (2 + 2) GiB > 8
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    check_memory("vllm", ["none", "ngram", "specplug"])                 # 3 x 2.5 GiB fits
