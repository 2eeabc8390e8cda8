"""`specplug bench --engine sglang`: the runner's methods and the engine arguments they map to
(the engines themselves are exercised by the other SGLang tests)."""

import pytest

from specplug.sglang_medusa.bench_runner import TYPICAL, SglangRunner, engine_args


def test_methods_and_their_speculative_arguments(sgl_model, medusa_heads):
    runner = SglangRunner(str(sgl_model), str(medusa_heads), max_new_tokens=8, temperature=0.0, seed=0, max_batch=4)
    assert runner.methods() == ["none", "ngram", "retrieval", "medusa", "medusa-hybrid", "medusa-typical",
                                "medusa-adaptive", "medusa-sampled"]
    assert runner.speculative_args("none") == {}
    assert runner.speculative_args("ngram")["speculative_algorithm"] == "NGRAM"
    assert runner.speculative_args("retrieval") == {"speculative_algorithm": "RETRIEVAL"}
    medusa = runner.speculative_args("medusa")
    assert medusa == {"speculative_algorithm": "MEDUSA", "speculative_draft_model_path": str(medusa_heads)}
    assert runner.speculative_args("medusa-typical") == {**medusa, **TYPICAL}
    assert runner.speculative_args("medusa-adaptive") == {**medusa, "speculative_adaptive": True}
    assert runner.speculative_args("medusa-sampled") == medusa
    assert runner.speculative_args("medusa-hybrid") == medusa
    assert runner.environment("medusa-hybrid") == {"SPECPLUG_RETRIEVAL": "1"} and runner.environment("medusa") == {}
    with pytest.raises(SystemExit, match="'medusa-sampled' draws drafts at the run's temperature"):
        runner.environment("medusa-sampled")
    adaptive = SglangRunner(str(sgl_model), str(medusa_heads), max_new_tokens=8, temperature=0.0, seed=0,
                            max_batch=4, adaptive=True)
    assert adaptive.speculative_args("medusa") == {**medusa, "speculative_adaptive": True}
    assert adaptive.speculative_args("medusa-typical")["speculative_adaptive"] is True
    with pytest.raises(SystemExit, match="unknown SGLang method"):
        runner.speculative_args("eagle2")
    no_head = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=4)
    assert no_head.methods() == ["none", "ngram", "retrieval"]
    with pytest.raises(SystemExit, match="needs --head"):
        no_head.speculative_args("medusa")
    with pytest.raises(SystemExit, match="needs an EAGLE-3 head"):
        no_head.speculative_args("eagle3")
    with pytest.raises(SystemExit, match="needs --draft-model"):
        no_head.speculative_args("draft-model")


def test_eagle3_method_takes_an_eagle3_head_given_as_head(sgl_model, medusa_heads):
    from argparse import Namespace

    from specplug.sglang_medusa.bench_runner import is_eagle3_head, make_runner
    from tests.support.tiny_eagle3 import tiny_head_dir

    head = tiny_head_dir(sgl_model)
    assert is_eagle3_head(str(head)) and not is_eagle3_head(str(medusa_heads))
    args = Namespace(model=str(sgl_model), head=str(head), max_new_tokens=8, temperature=0.0, seed=0,
                     batch_sizes="1", adaptive=False, draft_model=None)
    runner = make_runner(args)
    assert runner.methods() == ["none", "ngram", "retrieval", "eagle3", "eagle3-head", "eagle3-sampled"]
    assert runner.speculative_args("eagle3") == {"speculative_algorithm": "SPECPLUG_EAGLE3",
                                                 "speculative_draft_model_path": str(head)}


def test_draft_model_method_sets_the_drafter_only_while_its_engine_starts(sgl_model, monkeypatch):
    from specplug.sglang_medusa.bench_runner import DRAFT_MODEL_TREE, _environment

    runner = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=4,
                          draft_model="/models/draft")
    assert runner.methods() == ["none", "ngram", "retrieval", "draft-model"]
    assert runner.speculative_args("draft-model") == {"speculative_algorithm": "DRAFT_MODEL", **DRAFT_MODEL_TREE}
    monkeypatch.setenv("SPECPLUG_DRAFTER", "mine")
    monkeypatch.setenv("SPECPLUG_RETRIEVAL", "1")
    with _environment(runner.environment("draft-model")):
        import os
        assert os.environ["SPECPLUG_DRAFTER"] == '{"model": "/models/draft"}'
        assert os.environ["SPECPLUG_RETRIEVAL"] == "1"  # the user's, not the method's: left as set
    assert os.environ["SPECPLUG_DRAFTER"] == "mine" and os.environ["SPECPLUG_RETRIEVAL"] == "1"
    with _environment(runner.environment("none")):
        assert "SPECPLUG_DRAFTER" not in os.environ
    with _environment({"SPECPLUG_RETRIEVAL": "0"}):  # eagle3-head's
        assert os.environ["SPECPLUG_RETRIEVAL"] == "0"
    assert os.environ["SPECPLUG_RETRIEVAL"] == "1"


def test_eagle3_head_alone_and_sampled_methods(sgl_model):
    from tests.support.tiny_eagle3 import tiny_head_dir

    head = str(tiny_head_dir(sgl_model))
    sampled = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.7, seed=0, max_batch=4,
                           eagle3_head=head)
    assert sampled.methods()[-3:] == ["eagle3", "eagle3-head", "eagle3-sampled"]
    assert sampled.speculative_args("eagle3-sampled") == sampled.speculative_args("eagle3")
    assert sampled.environment("eagle3-head") == {"SPECPLUG_RETRIEVAL": "0"}
    assert sampled.environment("eagle3-sampled") == {"SPECPLUG_RETRIEVAL": "0", "SPECPLUG_DRAFT_TEMPERATURE": "0.7"}
    greedy = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=4,
                          eagle3_head=head)
    with pytest.raises(SystemExit, match="--temperature > 0"):
        greedy.environment("eagle3-sampled")


def test_tensor_parallel_size_reaches_the_engine_and_binds_ranks_to_cores(sgl_model, monkeypatch):
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    runner = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=4, tp_size=2)
    assert engine_args(str(sgl_model), seed=0, max_batch=4, tp_size=2)["tp_size"] == 2
    assert runner._threads_bind() == {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "1|0")  # the user's binding wins
    assert runner._threads_bind() == {}


def test_cpu_engine_arguments(sgl_model):
    args = engine_args(str(sgl_model), seed=3, max_batch=4)
    assert args["device"] == "cpu" and args["attention_backend"] == "torch_native"
    assert args["random_seed"] == 3 and args["max_running_requests"] == 4


def test_self_spec_method_names_the_layers(sgl_model):
    from specplug.sglang_medusa.bench_runner import DRAFT_MODEL_TREE

    runner = SglangRunner(str(sgl_model), None, max_new_tokens=8, temperature=0.0, seed=0, max_batch=4,
                          self_spec_layers="0-1")
    assert runner.methods() == ["none", "ngram", "retrieval", "self-spec"]
    assert runner.speculative_args("self-spec") == {"speculative_algorithm": "SELF_SPEC", **DRAFT_MODEL_TREE}
    assert runner.environment("self-spec") == {"SPECPLUG_DRAFTER": '{"layers": "0-1"}'}


def test_bench_interleaved_runs_each_method_in_its_own_worker(sgl_model, medusa_heads, tmp_path):
    """--interleave 1 with SGLang: each method's engine (which starts its scheduler as a
    child process) in its own worker process, the methods taking turns prompt by prompt;
    every row covers all prompts, output equal to no speculation, engine noise in a log."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "specplug.cli", "bench", "--engine", "sglang", "--model", str(sgl_model),
           "--head", str(medusa_heads), "--methods", "none,medusa-hybrid", "--interleave", "1",
           "--batch-sizes", "1", "--max-new-tokens", "8", "--num-prompts", "2", "--out", str(tmp_path), "--json"]
    subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True, text=True,
                   timeout=600)
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    assert list(rows) == ["none", "medusa-hybrid"]
    for method, row in rows.items():
        assert row["num_prompts"] == 2 and len(row["rounds"]) == 2 and row["output_tokens"] == 2 * 8
        assert (tmp_path / "logs" / f"sglang-{method}.log").stat().st_size > 0
    assert rows["medusa-hybrid"]["identical_to_none"] == 1.0
