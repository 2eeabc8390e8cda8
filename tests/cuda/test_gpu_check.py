"""bench/gpu_check.sh's own checks, as far as a CPU runs them; the GPU parts are marked ``gpu``.

- cuda-graph (bench/gpu_graph_check.py): its pure tensor part of greedy chain verification
  equals ``verify_step`` on new inputs (eagerly on the CPU; captured and replayed on a GPU),
  and a failed capture is reported by its first error and the specplug line it came from;
- tree-timing (bench/gpu_tree_attention.py): under Triton's interpreter its kernel output
  equals dense SDPA with the equivalent mask (skipped without Triton);
- train (bench/gpu_train_check.py): 2 steps in float32 on the CPU (slow);
- the results file (bench/gpu_check_report.py) and the script's shell syntax.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check_report, gpu_graph_check as G
from specplug.common.chains import verify_chains

ROOT = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()


def test_pure_chain_part_equals_verify_step():
    """On new inputs, accepting 0..K drafts: every output of greedy_chain_tensors equals verify_step's."""
    g = torch.Generator().manual_seed(0)
    num_nodes = torch.full((G.BATCH,), G.K + 1)
    seen = set()
    for _ in range(4):
        inputs = G.chain_inputs(g, "cpu")
        got = G.greedy_chain_tensors(inputs["logits"], inputs["candidates"], num_nodes)
        assert G.same(got, G.eager(inputs))
        seen |= set(got.num_accepted.tolist())
    assert {0, G.K} <= seen  # the planted drafts reach both ends
    # negative control: one draft changed where it was accepted must change the result
    wrong = dict(inputs, candidates=inputs["candidates"].clone())
    b = int(got.num_accepted.argmax())
    wrong["candidates"][b, 1] = (wrong["candidates"][b, 1] + 1) % G.VOCAB
    assert not G.same(G.greedy_chain_tensors(wrong["logits"], wrong["candidates"], num_nodes), got)


def test_chunked_argmax_is_first_argmax_with_ties():
    x = torch.randint(0, 3, (16, 5000)).float()  # many equal maxima, a partial last chunk
    assert torch.equal(G.chunked_argmax(x), x.argmax(-1))


def test_a_failed_capture_is_reported_by_its_first_error_and_specplug_line():
    """A capture error raised on top of the real one (as a failed capture's end does) still names the real one."""
    try:
        try:
            verify_chains(torch.zeros(1, 1, dtype=torch.long), torch.ones(1), torch.zeros(2, 3), "nope")
        except ValueError:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as exc:
        report = G.capture_error(exc)
    assert report["error"].startswith("ValueError: verify_chains supports")
    assert report["at"].startswith("specplug/common/chains.py:") and "raise ValueError" in report["at"]
    assert report["raised_last"].startswith("RuntimeError: operation failed")


def run_bench(script: str, *args: str, timeout: float) -> None:
    """bench/`script` with `args` in a process of its own (the checkout on its path); it must exit 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, f"bench/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU: torch.cuda.is_available() is False")
def test_captured_chain_part_replays_equal_eager(tmp_path):
    assert G.main(["--out", str(tmp_path / "graph"), "--replays", "3"]) == 0
    report = json.loads((tmp_path / "graph.json").read_text())
    assert report["pure_part"]["captured"] is True
    assert all(r["equal_to_eager"] for r in report["pure_part"]["replays"])
    assert isinstance(report["host_syncs"], list) and "captured" in report["whole_step"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (the vLLM environment has it)")
def test_tree_timing_dry_run_matches_dense_attention(tmp_path):
    """--device cpu (Triton's interpreter, a process of its own): the kernel equals SDPA with the dense mask."""
    run_bench("gpu_tree_attention.py", "--device", "cpu", "--shapes", "2x20x8", "--out", str(tmp_path / "tree"),
              timeout=300)
    rows = json.loads((tmp_path / "tree.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["max_abs_diff"] < 1e-5


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="specplug train needs transformers")
def test_train_check_runs_on_the_cpu(tmp_path):
    run_bench("gpu_train_check.py", "--device", "cpu", "--steps", "2", "--out", str(tmp_path / "train"), timeout=600)
    report = json.loads((tmp_path / "train.json").read_text())
    assert report["ok"] and report["steps_done"] == 2 and report["steps_per_s"] > 0


def test_results_file_holds_every_step(tmp_path):
    (tmp_path / "env.txt").write_text("GPU: none\n")
    (tmp_path / "graph.md").write_text("- result: PASS\n")
    (tmp_path / "graph.json").write_text(json.dumps({"ok": True}))
    (tmp_path / "sglang.log").write_text("skipped: SGLang not installed\n")
    base = ["record", "--out", str(tmp_path)]
    gpu_check_report.main(base + ["--name", "cuda-graph", "--title", "capture", "--status", "ok", "--seconds", "8",
                                  "--timeout", "30", "--md", str(tmp_path / "graph.md"),
                                  "--json", str(tmp_path / "graph.json")])
    gpu_check_report.main(base + ["--name", "sglang-mask", "--title", "masks", "--status", "skipped",
                                  "--note", "skipped: SGLang not installed", "--log", str(tmp_path / "sglang.log")])
    md = (tmp_path / "results.md").read_text()
    assert "| cuda-graph | ok | 8 | 30 |" in md and "- result: PASS" in md and "GPU: none" in md
    assert "| sglang-mask | skipped |" in md and "SGLang not installed" in md
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"] == {"cuda-graph": "ok", "sglang-mask": "skipped"}
    assert results["steps"][0]["result"] == {"ok": True}


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)
