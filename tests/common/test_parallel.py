"""specplug.common.parallel: which head dimensions tensor parallelism cannot shard, and
the start-up message that names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specplug.common import parallel

COMMITTED_EAGLE3 = Path(__file__).resolve().parents[2] / "heads" / "smollm2-eagle3" / "config.json"
# the committed head's shape, written out so the test runs without the checkout's heads/
EAGLE3 = {"vocab_size": 49152, "draft_vocab_size": 8192, "num_attention_heads": 9, "num_key_value_heads": 3,
          "intermediate_size": 1536, "hidden_size": 576}


def test_committed_head_config_is_the_one_tested_here():
    if not COMMITTED_EAGLE3.is_file():
        pytest.skip("heads/ not in this checkout")
    config = json.loads(COMMITTED_EAGLE3.read_text())
    assert {k: config[k] for k in EAGLE3} == EAGLE3


def test_the_committed_head_shards_at_tp_1_only():
    assert parallel.shard_problems(EAGLE3, 1) == []
    assert parallel.shard_problems(EAGLE3, 3) == ["draft_vocab_size 8192 is not divisible by 3"]
    assert parallel.shard_problems(EAGLE3, 2) == ["num_attention_heads 9 is not divisible by 2",
                                                  "num_key_value_heads 3 neither divides by 2 nor divides it"]
    assert parallel.fitting_tp_sizes(EAGLE3) == [1]


def test_vocabularies_are_padded_to_64_before_they_are_split():
    assert parallel.padded_vocab(8192) == 8192 and parallel.padded_vocab(8193) == 8256
    assert parallel.shard_problems({"draft_vocab_size": 8200}, 3) == []  # padded to 8256 = 3 * 2752
    assert parallel.shard_problems({"vocab_size": 100}, 3) == ["vocab_size 100 (padded to 128) is not divisible by 3"]
    assert parallel.fitting_vocab(8192, 3) == 8256 and parallel.fitting_vocab(8192, 2) == 8192


def test_kv_heads_are_split_or_replicated():
    assert parallel.shard_problems({"num_attention_heads": 12, "num_key_value_heads": 2}, 4) == []  # 2 per rank pair
    assert parallel.shard_problems({"num_attention_heads": 12, "num_key_value_heads": 4}, 2) == []  # split
    assert parallel.shard_problems({"num_attention_heads": 12, "num_key_value_heads": 4}, 6) == [
        "num_key_value_heads 4 neither divides by 6 nor divides it"]


def test_missing_or_non_numeric_fields_are_not_checked():
    assert parallel.shard_problems({"num_attention_heads": None, "vocab_size": True, "eagle_config": {}}, 3) == []
    with pytest.raises(ValueError, match="tensor parallel size must be >= 1, got 0"):
        parallel.shard_problems(EAGLE3, 0)


def test_the_message_names_the_head_the_numbers_and_the_fix():
    assert parallel.shard_error(EAGLE3, 1, "head H", "tensor_parallel_size") is None
    message = parallel.shard_error(EAGLE3, 3, "the specplug head H", "tensor_parallel_size")
    assert message == (
        "the specplug head H cannot be sharded over tensor_parallel_size 3: draft_vocab_size 8192 is not "
        "divisible by 3. Fix: set tensor_parallel_size to 1 (the only size up to 8 that divides them), or pad "
        "the head's draft vocabulary to draft_vocab_size 8256: specplug convert HEAD NEW_HEAD --to eagle3 "
        "--tensor-parallel-size 3, and serve NEW_HEAD")
    wide = {"draft_vocab_size": 8192, "num_attention_heads": 8, "num_key_value_heads": 2}
    assert parallel.shard_error(wide, 3, "h", "tp") == (
        "h cannot be sharded over tp 3: draft_vocab_size 8192 is not divisible by 3; num_attention_heads 8 is not "
        "divisible by 3; num_key_value_heads 2 neither divides by 3 nor divides it. Fix: set tp to one of 1, 2, 4, "
        "8 (the sizes up to 8 that divide them), or train a head whose sharded dimensions divide by 3 (e.g. "
        "draft_vocab_size 8256)")


def test_transformers_style_configs_are_read_by_attribute():
    from types import SimpleNamespace

    assert parallel.shard_problems(SimpleNamespace(**EAGLE3), 3) == ["draft_vocab_size 8192 is not divisible by 3"]


# -- the rank rule, on 3 CPU processes over gloo ------------------------------------------

RANKS = 3


def _ranks(rank: int, init_file: str, out_dir: str) -> None:
    """One spawned rank: joins the gloo group, runs every job of JOBS in order, writes what
    each returned (or its RuntimeError) to out_dir/<job>.<rank>."""
    import os

    import torch.distributed as dist

    os.environ["SPECPLUG_CHECK_RANKS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS)
    try:
        for name, job in JOBS.items():
            try:
                result = repr(job(rank))
            except RuntimeError as exc:
                result = f"RuntimeError: {exc}"
            Path(out_dir, f"{name}.{rank}").write_text(result)
    finally:
        dist.destroy_process_group()


def _decide(rank: int):
    import torch.distributed as dist

    mask = parallel.decide_once(torch.tensor([rank == 1, rank != 1, True]))
    seconds = parallel.decide_once(0.25 * (rank + 1))
    depth = parallel.decide_once({"depth": rank + 2, "keep": (rank,)})
    pair = dist.new_group([1, 2])  # every rank creates it; ranks 1 and 2 decide with it
    in_pair = parallel.engine_group(pair).decide_once(10 * rank) if rank in (1, 2) else None
    return mask.tolist(), seconds, depth, in_pair


def _same(rank: int):
    parallel.check_same_on_ranks(7, {"depth": 3, "tokens": torch.arange(4), "keep": [True, False]})
    return "ok"


def _differ(rank: int):  # negative control: rank 2 decided alone
    parallel.check_same_on_ranks(7, {"depth": 3 if rank != 2 else 2, "tokens": torch.arange(4)})
    return "ok"


def _policy(rank: int):
    """Each rank's own timings: rank 0's say drafting is free, the others' that it never
    pays. Alone, the ranks choose differently (the negative control); with the group, every
    rank runs rank 0's choice."""
    from specplug.common.policy.adaptive import AdaptiveController, chain_options
    from specplug.common.policy.cost import Curve, StepCosts
    from specplug.common.policy.draft_gate import DraftGate

    free = rank == 0
    costs = StepCosts(verify=Curve([(1, 0.01), (64, 0.01 if free else 0.64)]),
                      draft=Curve([(1, 0.0 if free else 0.05)]))
    chosen = []
    for ranks in (parallel.ALONE, parallel.engine_group(None)):
        controller = AdaptiveController(chain_options(3), ranks=ranks)
        controller.costs_override = costs
        gate = DraftGate(ranks=ranks)
        gate.step_timed(2, 0.01)
        gate.step_timed(8, 0.01 if free else 0.1)
        option = controller.choose(1)
        chosen.append((None if option is None else option.depth, gate.choose(torch.tensor([1.0, 0.5]), 2, 3).tolist()))
    return chosen


JOBS = {"decide": _decide, "same": _same, "differ": _differ, "policy": _policy}


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    """{job: [what rank 0, 1, 2 saw]}: one spawn of RANKS processes runs every job."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_ranks, args=(str(out / "init"), str(out)), nprocs=RANKS, join=True)
    return {job: [(out / f"{job}.{r}").read_text() for r in range(RANKS)] for job in JOBS}


@pytest.mark.timeout(180)
def test_decide_once_gives_every_rank_rank_0s_values(seen):
    rank0 = ([False, True, True], 0.25, {"depth": 2, "keep": (0,)})
    assert seen["decide"][0] == repr((*rank0, None))
    assert seen["decide"][1] == seen["decide"][2] == repr((*rank0, 10))  # the pair's rank 0 is global rank 1


@pytest.mark.timeout(180)
def test_the_rank_check_passes_equal_decisions_and_names_the_ranks_that_differ(seen):
    assert seen["same"] == ["'ok'"] * RANKS
    for message in seen["differ"]:  # every rank raises, none hangs
        assert message.startswith("RuntimeError: specplug rank check (SPECPLUG_CHECK_RANKS=1): the decisions "
                                  "of step 7 differ between the tensor-parallel ranks: ranks [2] differ from rank 0")


@pytest.mark.timeout(180)
def test_adaptive_depth_and_the_gate_keep_rank_0s_choice(seen):
    rank0 = (3, [True, True])
    assert seen["policy"][0] == repr([rank0, rank0])
    for other in seen["policy"][1:]:
        assert other == repr([(None, [False, False]), rank0])  # alone they would differ


def test_without_a_group_decisions_stay_local_and_the_check_is_a_no_op():
    values = torch.tensor([1.0, 2.0])
    assert parallel.decide_once(values) is values and parallel.decide_once(3) == 3
    assert parallel.ALONE.decide_once("x") == "x"
    parallel.check_same_on_ranks(1, {"a": 1}, environ={"SPECPLUG_CHECK_RANKS": "1"})
    assert parallel.checking_ranks({"SPECPLUG_CHECK_RANKS": "1"}) and not parallel.checking_ranks({})


def test_the_digest_sees_every_decision():
    base = {"depth": 3, "tokens": torch.arange(4), "keep": [True, False]}
    assert parallel.decisions_digest(base) == parallel.decisions_digest(dict(reversed(base.items())))
    for other in ({**base, "depth": 2}, {**base, "tokens": torch.arange(4).int()}, {**base, "keep": [True, True]},
                  {**base, "tokens": torch.arange(5)}):
        assert parallel.decisions_digest(other) != parallel.decisions_digest(base)


def test_tensor_parallel_ranks_are_bound_to_cores_round_robin():
    from specplug.common.parallel import threads_bind

    assert threads_bind(3, cores=2) == "0|1|0" and threads_bind(2, cores=8) == "0|1" and threads_bind(1, 4) == "0"
