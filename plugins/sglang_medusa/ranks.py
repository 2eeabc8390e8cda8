"""SGLang's tensor-parallel group as specplug.common.parallel's RankGroup: the group the
SGLang adapter's decisions are taken once in and broadcast over (the rank rule)."""

from __future__ import annotations

from specplug.common.parallel import ALONE, RankGroup, engine_group


def tp_ranks() -> RankGroup:
    """The scheduler's tensor-parallel group (its CPU/gloo side: the values broadcast are
    small host data) when this worker is one of several TP ranks; ALONE with one rank, or
    outside an engine (SGLang's groups not initialised)."""
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return ALONE
    group = parallel_state.get_tp_group()
    return ALONE if group.world_size == 1 else engine_group(group.cpu_group)
