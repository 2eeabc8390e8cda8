"""specplug.common.parallel: which head dimensions tensor parallelism cannot shard, and
the start-up message that names them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
        "divisible by 3. Fix: set tensor_parallel_size to 1 (the only size up to 8 that divides them), or train "
        "or convert a head whose sharded dimensions divide by 3 (e.g. draft_vocab_size 8256)")
    wide = {"draft_vocab_size": 8192, "num_attention_heads": 8, "num_key_value_heads": 2}
    assert "to one of 1, 2, 4, 8 (the sizes up to 8 that divide them)" in parallel.shard_error(wide, 3, "h", "tp")


def test_transformers_style_configs_are_read_by_attribute():
    from types import SimpleNamespace

    assert parallel.shard_problems(SimpleNamespace(**EAGLE3), 3) == ["draft_vocab_size 8192 is not divisible by 3"]
