"""bench/expectations.py: several `specplug bench` runs merged into one table and figure
(docs/benchmarks.md, "What to expect")."""

from __future__ import annotations

import json

from bench import expectations


def _run(path, engine, temperature, rows):
    path.mkdir()
    results = [{"engine": engine, "method": m, "batch_size": b, "tok_per_s": t, "speedup": s, "tau": tau,
                "identical_to_none": same} for m, b, t, s, tau, same in rows]
    (path / "bench.json").write_text(json.dumps({"meta": {"temperature": temperature}, "results": results}))
    return str(path)


def test_runs_merge_into_one_row_per_engine_temperature_and_method(tmp_path):
    first = _run(tmp_path / "a", "sglang", 0.0, [
        ("none", 1, 17.0, 1.0, None, 1.0), ("none", 4, 47.0, 1.0, None, 1.0),
        ("medusa", 1, 16.0, 0.94, 1.2, 1.0), ("medusa", 4, 50.0, 1.06, 1.1, 1.0)])
    second = _run(tmp_path / "b", "sglang", 0.0, [
        ("none", 1, 15.0, 1.0, None, 1.0), ("ngram", 1, 14.0, 0.93, 1.1, 1.0)])
    sampled = _run(tmp_path / "c", "sglang", 0.7, [
        ("none", 1, 14.0, 1.0, None, 1.0), ("ngram", 1, 14.0, 1.0, 1.2, 0.0)])
    table = expectations.markdown(expectations.load([first, second, sampled])).splitlines()
    assert table[0] == "| engine | T | method | bs 1 | bs 4 | tau (bs 1) | same as none |"
    assert table[2:] == [
        "| sglang | 0 | none | 17 tok/s | 47 tok/s | - | 100% |",        # the second run's none is not a row
        "| sglang | 0 | medusa | 0.94x | 1.06x | 1.20 | 100% |",
        "| sglang | 0 | ngram | 0.93x | - | 1.10 | 100% |",                # its ratio to its own run's none
        "| sglang | 0.7 | none | 14 tok/s | - | - | sampled |",
        "| sglang | 0.7 | ngram | 1.00x | - | 1.20 | sampled |"]


def test_the_figure_has_one_panel_per_engine_and_temperature(tmp_path):
    run = _run(tmp_path / "a", "vllm", 0.0, [("none", 1, 23.0, 1.0, None, 1.0), ("specplug", 1, 31.0, 1.36, 1.4, 1.0)])
    expectations.plot(expectations.load([run]), tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0
