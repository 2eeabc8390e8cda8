"""SGLang's tensor-parallel group as specplug.common.parallel's RankGroup: the group the
SGLang adapter's decisions are taken once in and broadcast over (the rank rule)."""

from __future__ import annotations

from specplug.common.parallel import ALONE, RankGroup, engine_group
from specplug.sglang_medusa.batch_view import tp_group


def tp_ranks() -> RankGroup:
    """The tensor-parallel group's CPU (gloo) side, for the small host data broadcast; ALONE
    with one rank or outside an engine."""
    group = tp_group()
    return ALONE if group is None else engine_group(group.cpu_group)
