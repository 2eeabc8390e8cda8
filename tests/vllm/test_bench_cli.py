"""`specplug bench` end to end on real vLLM (CPU) with the tiny Llama.

Runs in a subprocess: the ngram method imports numba, which breaks later in-process
vLLM engines (see DESIGN.md), so it must not share a process with other engine tests.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: scripts/test.sh vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_none_vs_ngram_is_lossless_and_reports_acceptance(tiny_llama_path, tmp_path):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
               VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "specplug.cli", "bench", "--engine", "vllm",
           "--model", str(tiny_llama_path), "--methods", "none,ngram:2", "--batch-sizes", "1,2",
           "--max-new-tokens", "24", "--num-prompts", "2", "--out", str(tmp_path), "--json"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = {(r["method"], r["batch_size"]): r for r in report["results"]}
    assert set(rows) == {("none", 1), ("none", 2), ("ngram:2", 1), ("ngram:2", 2)}
    for batch in (1, 2):
        ngram = rows[("ngram:2", batch)]
        assert ngram["identical_to_none"] == 1.0          # greedy: token-identical
        assert ngram["num_drafts"] > 0 and ngram["tau"] >= 1.0
        assert len(ngram["acceptance_by_pos"]) == 2         # ":2": vLLM's ngram with K = 2
        assert rows[("none", batch)]["speedup"] == 1.0
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_draft_model_rows_are_lossless(tiny_llama_path, tmp_path):
    """--draft-model adds vLLM's built-in draft_model chain and specplug's head + draft
    model tree (the "draft_model" token drafter) beside none, all greedy-identical."""
    from specplug.common.draft_model import cut_draft_model
    from tests.vllm.conftest import SPECPLUG_CHAIN
    from tests.support.tiny_eagle3 import tiny_head_dir

    draft = cut_draft_model(tiny_llama_path, "0", tmp_path / "draft")
    head = tiny_head_dir(tiny_llama_path, specplug=SPECPLUG_CHAIN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "specplug.cli", "bench", "--engine", "vllm", "--model", str(tiny_llama_path),
           "--head", str(head), "--draft-model", str(draft), "--self-spec-layers", "0,2",
           "--methods", "none,draft_model,specplug-draft-model,specplug-self-spec",
           "--batch-sizes", "1", "--max-new-tokens", "16", "--num-prompts", "2", "--out", str(tmp_path / "out")]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    for method in ("draft_model", "specplug-draft-model", "specplug-self-spec"):
        assert rows[method]["identical_to_none"] == 1.0 and rows[method]["num_drafts"] > 0


def test_bench_interleaved_rounds_are_lossless_and_cover_every_prompt(tiny_llama_path, tmp_path):
    """--interleave 1: each method in its own worker process, taking turns prompt by prompt
    (ngram beside other engines is fine there); every row covers all prompts, in rounds."""
    from tests.vllm.conftest import SPECPLUG_CHAIN
    from tests.support.tiny_eagle3 import tiny_head_dir

    head = tiny_head_dir(tiny_llama_path, specplug=SPECPLUG_CHAIN)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "specplug.cli", "bench", "--engine", "vllm", "--model", str(tiny_llama_path),
           "--head", str(head), "--methods", "ngram,ngram:2,none,specplug,specplug:2", "--interleave", "1",
           "--batch-sizes", "1", "--max-new-tokens", "16", "--num-prompts", "3", "--out", str(tmp_path), "--json"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["interleave"] == 1
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["ngram", "ngram:2", "none", "specplug", "specplug:2"]
    for row in rows.values():
        assert row["num_prompts"] == 3 and len(row["rounds"]) == 3
        assert row["output_tokens"] == 3 * 16 == sum(tokens for tokens, _ in row["rounds"])
    assert rows["specplug"]["identical_to_none"] == 1.0 and rows["specplug"]["num_drafts"] > 0
    assert rows["ngram"]["identical_to_none"] == 1.0
    assert len(rows["ngram"]["acceptance_by_pos"]) == 4  # no suffix: the runner's K = 4
    for method in ("ngram:2", "specplug:2"):  # two chain lengths of one method, side by side
        assert rows[method]["identical_to_none"] == 1.0 and len(rows[method]["acceptance_by_pos"]) == 2
    for method in rows:                                   # engine noise in a log per method
        assert (tmp_path / "logs" / f"vllm-{method}.log").stat().st_size > 0


def test_chain_length_suffix_sets_k_and_refuses_what_is_not_a_chain():
    from specplug.vllm_eagle3.bench_runner import chain_length

    assert chain_length("specplug") == ("specplug", None)
    assert chain_length("ngram:8") == ("ngram", 8)
    for bad, says in (("ngram:0", "int >= 1"), ("ngram:x", "int >= 1"), ("specplug-tree:8", "no chain length"),
                      ("none:4", "no chain length")):
        with pytest.raises(SystemExit, match=says):
            chain_length(bad)


def test_suffix_without_arctic_inference_is_refused_with_the_build_command(tiny_llama_path, tmp_path):
    """vLLM's `suffix` needs Arctic Inference, which PyPI ships as source only: without it the
    bench stops before any engine starts, naming scripts/arctic_suffix.sh."""
    from specplug.vllm_eagle3.bench_runner import has_arctic_inference

    if has_arctic_inference():
        pytest.skip("Arctic Inference is importable here")
    cmd = [sys.executable, "-m", "specplug.cli", "bench", "--engine", "vllm", "--model", str(tiny_llama_path),
           "--methods", "none,suffix", "--batch-sizes", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "scripts/arctic_suffix.sh" in done.stderr
    assert not (tmp_path / "bench.json").exists()
