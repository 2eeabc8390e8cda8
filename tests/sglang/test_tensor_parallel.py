"""--tp-size > 1 is refused for every specplug SGLang algorithm before any model loads
(settings.check_one_rank): specplug's drafters read the target's embedding and LM head
whole, which tensor parallelism splits into vocabulary shards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specplug.sglang_medusa.settings import (
    check_one_rank, eagle3_settings_from_server_args, settings_from_server_args, token_settings_from_server_args,
)
from tests.sglang.conftest import ENGINE_ARGS

REFUSAL = ("{algorithm}: specplug's SGLang algorithms run on one tensor-parallel rank, got --tp-size 3 (each rank "
           "would hold a vocabulary shard of the target's embedding and LM head, which specplug's drafters read "
           "whole): run with --tp-size 1")
ARGS = dict(speculative_draft_model_path=None, speculative_num_steps=None, speculative_eagle_topk=None,
            speculative_num_draft_tokens=None, speculative_accept_threshold_single=1.0,
            speculative_accept_threshold_acc=1.0)


@pytest.mark.parametrize("algorithm, settings", [
    ("MEDUSA", lambda cfg: settings_from_server_args(cfg)),
    ("SPECPLUG_EAGLE3", lambda cfg: eagle3_settings_from_server_args(cfg, {})),
    ("RETRIEVAL", lambda cfg: token_settings_from_server_args("retrieval", cfg, {})),
    ("DRAFT_MODEL", lambda cfg: token_settings_from_server_args("draft_model", cfg, {})),
    ("SELF_SPEC", lambda cfg: token_settings_from_server_args("self_spec", cfg, {})),
])
def test_every_algorithm_refuses_tp_above_1_first(algorithm, settings):
    with pytest.raises(ValueError) as error:
        settings(SimpleNamespace(**ARGS, tp_size=3))  # refused before the (missing) heads are looked at
    assert str(error.value).startswith(REFUSAL.format(algorithm=algorithm))


def test_one_rank_passes():
    for cfg in (SimpleNamespace(tp_size=1), SimpleNamespace(tp_size=None), SimpleNamespace()):
        check_one_rank(cfg, "MEDUSA")


@pytest.mark.timeout(300)
def test_engine_refuses_tp_3_before_model_load(sgl_model, medusa_heads):
    import sglang

    for algorithm, head in (("MEDUSA", medusa_heads), ("RETRIEVAL", None)):
        kwargs = {**ENGINE_ARGS, "speculative_algorithm": algorithm, "tp_size": 3,
                  **({"speculative_draft_model_path": str(head)} if head else {})}
        with pytest.raises(ValueError, match="got --tp-size 3 .*run with --tp-size 1"):
            sglang.Engine(model_path=str(sgl_model), **kwargs)
