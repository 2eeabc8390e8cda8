"""specplug bench's engine-free part: results, speed-ups, the table, the JSON and the plot."""

import argparse

import pytest

from specplug.bench import add_arguments, add_speedups, identical_to_none, markdown, plot, summarise, sweep
from specplug.bench_types import RunResult


def report_of(results):
    rows = [{"engine": "vllm", **summarise(r)} for r in results]
    add_speedups(rows)
    meta = {"machine": "test", "device": "cpu", "model": "tiny", "prompts": "mtbench",
            "num_prompts": 4, "max_new_tokens": 8, "temperature": 0.0, "seed": 0}
    return {"meta": meta, "results": rows}


def test_tau_and_acceptance_by_position():
    r = RunResult("specplug", 1, 4, output_tokens=40, seconds=2.0, num_drafts=10,
                  num_draft_tokens=40, num_accepted=25, accepted_per_pos=[9, 8, 5, 3])
    assert r.tok_per_s == 20.0
    assert r.tau == pytest.approx(3.5)
    assert r.acceptance_by_pos == [0.9, 0.8, 0.5, 0.3]
    assert RunResult("none", 1, 4, 40, 2.0).tau is None


def test_speedup_is_relative_to_none_at_the_same_batch():
    report = report_of([RunResult("none", 1, 4, 40, 4.0), RunResult("x", 1, 4, 40, 2.0),
                        RunResult("none", 4, 4, 40, 1.0), RunResult("x", 4, 4, 40, 2.0)])
    speedups = {(r["method"], r["batch_size"]): r["speedup"] for r in report["results"]}
    assert speedups == {("none", 1): 1.0, ("x", 1): 2.0, ("none", 4): 1.0, ("x", 4): 0.5}


def test_markdown_table_and_png(tmp_path):
    report = report_of([RunResult("none", 1, 4, 40, 4.0),
                        RunResult("specplug", 1, 4, 40, 2.0, num_drafts=10, num_accepted=20,
                                  accepted_per_pos=[9, 7, 4], draft_seconds=0.5, verify_seconds=1.2)])
    table = markdown(report)
    assert "| vllm | 1 | specplug | 20.0 | 2.00x | 3.00 | 0.90 0.70 0.40 | 25% / 60% | n/a |" in table
    assert "machine: test" in table
    plot(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_interleaved_rounds_give_each_speedup_its_per_round_range(tmp_path):
    """Round r's ratio pairs the method with none on round r's prompts; the table shows
    the range and says what it means; rows without rounds show none (negative control)."""
    none = RunResult("none", 4, 8, 80, 4.0, rounds=[[40, 2.0], [40, 2.0]])
    fast = RunResult("x", 4, 8, 80, 3.0, rounds=[[40, 1.0], [40, 2.0]])  # 2.0x, then 1.0x
    report = report_of([none, fast, RunResult("none", 1, 4, 40, 4.0), RunResult("x", 1, 4, 40, 2.0)])
    rows = {(r["method"], r["batch_size"]): r for r in report["results"]}
    assert rows[("x", 4)]["round_speedups"] == [2.0, 1.0] and rows[("none", 4)]["round_speedups"] is None
    assert rows[("x", 1)]["round_speedups"] is None
    table = markdown(report)
    assert "| vllm | 4 | x | 26.7 | 1.33x (1.00-2.00) |" in table and "| vllm | 1 | x | 20.0 | 2.00x |" in table
    assert "lowest and highest of the per-round ratios" in table
    plot(report, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_runs_run_last_methods_after_the_others():
    class FakeRunner:
        engine, run_last = "fake", ("ngram",)
        calls = []

        def run(self, method, prompts, batch):
            self.calls.append((method, batch))
            return RunResult(method, batch, len(prompts), 1, 1.0)

    runner = FakeRunner()
    sweep(runner, ["ngram", "none"], ["p"] * 4, [1, 2], num_prompts=2)
    assert runner.calls == [("none", 1), ("none", 2), ("ngram", 1), ("ngram", 2)]


def test_help_names_every_option_with_default():
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    text = parser.format_help()
    for option in ("--engine", "--batch-sizes", "--prompts", "--methods", "--adaptive", "--json"):
        assert option in text
    assert "1,4,16,64" in text


def test_identical_to_none_compares_outputs_at_the_same_batch():
    results = [RunResult("none", 1, 2, 4, 1.0, outputs=[[1, 2], [3, 4]]),
               RunResult("x", 1, 2, 4, 1.0, outputs=[[1, 2], [3, 5]]),
               RunResult("x", 2, 2, 4, 1.0, outputs=[[1, 2], [3, 4]])]
    assert identical_to_none(results) == [1.0, 0.5, None]
