"""A specplug head whose dimensions vLLM cannot shard over tensor_parallel_size is refused
while vLLM builds its configuration (settings.check_head_shards, patch
"SpeculativeConfig.__post_init__ shards"), with the numbers and the fix, never vLLM's
AssertionError from inside the head's layers."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

from specplug.vllm_eagle3.demo import find_head  # noqa: E402
from specplug.vllm_eagle3.settings import check_head_shards  # noqa: E402

pytestmark = pytest.mark.vllm

HEAD = find_head()
SHAPE = {"vocab_size": 49152, "draft_vocab_size": 8192, "num_attention_heads": 9, "num_key_value_heads": 3,
         "intermediate_size": 1536}
REFUSAL = ("the specplug head H cannot be sharded over tensor_parallel_size 3: draft_vocab_size 8192 is not "
           "divisible by 3. Fix: set tensor_parallel_size to 1")


def _speculative_config(tp_size: int, section: dict | None = None, method: str = "eagle3", pp_size: int = 1,
                        **shape):
    config = {**SHAPE, **shape, **({"specplug": section} if section is not None else {})}
    draft = SimpleNamespace(model="H", hf_config=SimpleNamespace(**config))
    parallel = SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size)
    return SimpleNamespace(method=method, draft_model_config=draft, target_parallel_config=parallel)


@pytest.mark.parametrize("method, kind", [("eagle3", "eagle3"), ("eagle", "eagle1"), ("medusa", "medusa")])
def test_a_specplug_head_that_cannot_be_sharded_is_refused(method, kind):
    with pytest.raises(ValueError) as error:
        check_head_shards(_speculative_config(3, {"method": kind}, method))
    assert str(error.value).startswith(REFUSAL)
    assert "draft_vocab_size 8256" in str(error.value)


def test_pipeline_parallelism_is_refused_for_specplug_heads_only():
    with pytest.raises(ValueError, match="the specplug head H runs at pipeline_parallel_size 1 only, got 2: .*Fix: "
                                         "set pipeline_parallel_size 1 and shard with tensor_parallel_size"):
        check_head_shards(_speculative_config(1, {"method": "eagle3"}, pp_size=2))
    check_head_shards(_speculative_config(1, None, pp_size=2))  # vLLM's own EAGLE-3 path: vLLM's behaviour


def test_heads_that_shard_and_heads_without_a_section_pass():
    check_head_shards(_speculative_config(1, {"method": "eagle3"}))
    check_head_shards(_speculative_config(3, {"method": "eagle3"}, draft_vocab_size=8256))
    check_head_shards(_speculative_config(3, None))  # vLLM's own EAGLE-3 path: vLLM's behaviour
    check_head_shards(SimpleNamespace(method="ngram", draft_model_config=None, target_parallel_config=None))


@pytest.mark.timeout(300)
def test_vllm_refuses_the_committed_head_at_tp_3_before_any_worker_starts(monkeypatch):
    """LLM(...) at tensor_parallel_size 3 with the multiprocess executor: the refusal comes
    from building the engine's configuration in this process, before vLLM spawns a worker."""
    if HEAD is None:
        pytest.skip("no specplug EAGLE-3 head committed under heads/")
    from vllm import LLM

    from specplug.common.testbed import target_dir

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
    draft_vocab = json.loads((HEAD / "config.json").read_text())["draft_vocab_size"]
    with pytest.raises(ValueError) as error:
        LLM(model=str(target_dir()), tensor_parallel_size=3, distributed_executor_backend="mp", enforce_eager=True,
            speculative_config={"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 3})
    message = str(error.value)
    assert f"the specplug head {HEAD} cannot be sharded over tensor_parallel_size 3" in message
    assert f"draft_vocab_size {draft_vocab} is not divisible by 3" in message
    assert "Fix: set tensor_parallel_size to 1" in message
    assert "specplug convert HEAD NEW_HEAD --to eagle3 --tensor-parallel-size 3" in message


def test_one_rank_decides_alone():
    """Outside an engine, or in an engine of one TP rank, the proposer's controllers take their
    own decisions (ranks.tp_ranks is ALONE); tests/common/test_parallel.py runs the group case."""
    from specplug.common.parallel import ALONE
    from specplug.vllm_eagle3.ranks import tp_ranks

    assert tp_ranks() is ALONE


def _tp3_runs(target, head: str, tmp_path) -> list[dict]:
    """tests.support.tp_generate runs on the test bed at TP 3 besides the committed head as committed
    (stage chain, hybrid with retrieval): the same head in stage tree beside a one-layer draft model cut
    from the target, and the committed Medusa heads' tree; payoff control off (as the suite sets it), so
    every step drafts. (self_spec on sharded layers runs at TP 2: _tp2_runs.)"""
    from specplug.common import formats, testbed
    from specplug.common.draft_model import cut_draft_model
    from specplug.common.head_section import read_section
    from specplug.vllm_eagle3.medusa_settings import tree_nodes

    draft = cut_draft_model(target, "0", tmp_path / "draft")
    medusa = tmp_path / "medusa"  # vLLM's format: one LM head per head
    formats.convert(str(testbed.head_dir("smollm2-medusa", target=target)), medusa, "vllm-medusa")
    tree = {"SPECPLUG_STAGE": "tree", "SPECPLUG_PAYOFF": "0"}

    def spec(method, model, k):
        return {"method": method, "model": str(model), "num_speculative_tokens": k}

    budget = read_section(head)["tree"]["budget"]  # stage tree: every node of the served head's tree
    return [
        {"name": "tree + draft_model", "speculative_config": spec("eagle3", head, budget), "env": {
            **tree, "SPECPLUG_DRAFTER": json.dumps({"name": "draft_model", "model": str(draft), "max_depth": 3})}},
        {"name": "medusa tree", "speculative_config": spec("medusa", medusa, tree_nodes(str(medusa))), "env": tree},
    ]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # two engines at TP 3 (four with SPECPLUG_TEST_TP3_ALL=1: 8-10 min on 2 cores)
def test_the_committed_heads_at_tp_3_keep_greedy_output_and_drafts(tmp_path):
    """The test bed at tensor_parallel_size 3 (multiprocess executor, ranks bound to cores 0|1|0) with the
    rank check on. The committed EAGLE-3 head, its draft vocabulary padded 8192 -> 8256 by `specplug
    convert --tensor-parallel-size 3`, as committed (stage chain, hybrid with retrieval; its int4 weights
    run as loaded under TP); with SPECPLUG_TEST_TP3_ALL=1 also the same head in stage tree with the
    draft_model drafter and the committed Medusa heads' tree (_tp3_runs). Each greedy output equals the
    same engine without speculation, and the drafts are accepted (the padding keeps what the EAGLE-3 head
    drafts)."""
    from specplug.common.formats import convert
    from specplug.common.testbed import target_dir
    from tests.support.tp_generate import ALL_TP3, run_checked

    if HEAD is None:
        pytest.skip("no specplug EAGLE-3 head committed under heads/")
    head = str(tmp_path / "head-tp3")
    convert(HEAD, head, "eagle3", tensor_parallel_size=3)
    runs = _tp3_runs(target_dir(), head, tmp_path) if ALL_TP3 else []
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = run_checked("tests.support.tp_generate", ["--target", str(target_dir()), "--tp", "3", "base", head,
                                                    *map(json.dumps, runs)], env, timeout=1440)
    base = out.pop("base")["ids"]
    assert sum(map(len, base)) >= 32  # a prompt may stop
    for name, result in out.items():
        assert result["ids"] == base and result["accepted"] > 0, name


def _tp2_runs(target, tmp_path) -> list[dict]:
    """tests.support.tp_generate runs covering every specplug method on the tiny target (4 query / 2 KV
    heads, vocabulary 512: all divide by 2), with heads that need no training: random EAGLE-3 heads, the
    EAGLE-1 echo head (drafts the target's own prediction, so drafts are accepted), fitted Medusa heads.
    Payoff control (which the suite turns off) is on in the last run only."""
    from specplug.common.draft_model import cut_draft_model
    from tests.support.tiny_eagle1 import eagle1_head_dir
    from tests.support.tiny_eagle3 import tiny_head_dir
    from tests.support.tiny_medusa import vllm_medusa_heads_dir

    draft = cut_draft_model(target, "0", tmp_path / "draft")
    chain = {"version": 1, "method": "eagle3", "tree": {"topk": 1}}
    tree = {"stage": "tree", "tree": {"depth": 3, "topk": 2, "budget": 6}}
    every_step = {"SPECPLUG_PAYOFF": "0"}  # as the suite's conftest sets it; spelled out for the runs that need it

    def spec(method, head, k):
        return {"method": method, "model": str(head), "num_speculative_tokens": k}

    self_spec = {"name": "self_spec", "layers": "0,2", "max_depth": 3, "topk": 2}
    draft_model = {"name": "draft_model", "model": str(draft), "max_depth": 3, "topk": 2}
    return [
        {"name": "eagle3 chain + self_spec", "env": every_step, "speculative_config": spec(
            "eagle3", tiny_head_dir(target, specplug={**chain, "drafter": self_spec}), 3)},
        {"name": "eagle1 tree + draft_model", "env": every_step, "speculative_config": spec(
            "eagle", eagle1_head_dir(target, echo=True, specplug={
                "version": 1, "method": "eagle1", **tree, "drafter": draft_model}), 6)},
        {"name": "medusa tree", "env": every_step, "speculative_config": spec(
            "medusa", vllm_medusa_heads_dir(target, specplug={"version": 1, "method": "medusa", **tree,
                                                             "tree": {"depth": 3, "topk": 2, "budget": 7}}), 7)},
        {"name": "eagle3 adaptive + retrieval", "speculative_config": spec(
            "eagle3", tiny_head_dir(target, specplug={**chain, "tree": {"topk": 4}, "adaptive": True,
                                                      "retrieval": True}), 4)},
        {"name": "eagle1 chain sampled", "sampling": {"temperature": 0.8, "seed": 7, "ignore_eos": True},
         "env": {"SPECPLUG_PAYOFF": "1"},
         "speculative_config": spec("eagle", eagle1_head_dir(
             target, echo=True, specplug={"version": 1, "method": "eagle1", "tree": {"topk": 2}}), 3)},
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_method_at_tp_2_keeps_greedy_output_and_ranks_in_step(tmp_path):
    """tensor_parallel_size 2 (multiprocess executor, ranks bound to cores 0|1) with the rank check on,
    one engine per run of _tp2_runs: stage chain with the self_spec drafter (the target's own sharded
    layers), stage tree with an EAGLE-1 head and the draft_model drafter, Medusa's tree, adaptive speculation
    with retrieval: each greedy output equals TP 2 without speculation, each drafted; the echo head's drafts
    are accepted. Seeded sampled requests (T 0.8) with payoff control on run with ranks in step (a rank that
    sampled another token would draft from other tokens and fail the check)."""
    from tests.support.tiny_eagle3 import tiny_target_dir
    from tests.support.tp_generate import run_checked

    target = tiny_target_dir()
    runs = _tp2_runs(target, tmp_path)
    out = run_checked("tests.support.tp_generate", ["--target", str(target), "--tp", "2", "--max-tokens", "24",
                                                    "base", *map(json.dumps, runs)],
                      {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    base = out.pop("base")["ids"]
    sampled = out.pop("eagle1 chain sampled")
    for name, result in out.items():
        assert result["ids"] == base and result["drafts"] > 0, name
    assert out["eagle1 tree + draft_model"]["accepted"] > 0
    assert sampled["drafts"] > 0 and sampled["ids"] != base and all(len(ids) == 24 for ids in sampled["ids"])
