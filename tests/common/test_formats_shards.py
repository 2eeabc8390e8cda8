"""An EAGLE-3 head's draft vocabulary padded for a tensor-parallel size (formats.shards,
`specplug convert --tensor-parallel-size N`): the committed test-bed head (8192 draft
tokens, refused at TP 3) becomes one vLLM can shard at TP 3, drafting as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specplug.common import testbed
from specplug.common.formats import CheckpointError, load_head
from specplug.common.formats.shards import pad_draft_vocab
from specplug.common.parallel import shard_problems
from tests.common.test_formats import write_eagle3, write_medusa


@pytest.fixture(scope="module")
def committed():
    try:
        return load_head(testbed.head_dir("smollm2-eagle3"))
    except ValueError:
        pytest.skip("no committed EAGLE-3 head")


def _targets(head) -> torch.Tensor:
    """[draft_vocab] target id of each draft id."""
    d2t = head.state_dict["d2t"]
    return torch.arange(d2t.numel()) + d2t


def test_the_committed_head_pads_to_a_vocabulary_three_ranks_shard(committed):
    assert shard_problems(committed.config, 3) == ["draft_vocab_size 8192 is not divisible by 3"]
    padded, notes = pad_draft_vocab(committed, 3)
    assert padded.config["draft_vocab_size"] == 8256 and shard_problems(padded.config, 3) == []
    assert notes and notes[0].startswith("draft_vocab_size 8192 -> 8256 for tensor_parallel_size 3")
    weight, old = padded.state_dict["lm_head.weight"], committed.state_dict["lm_head.weight"]
    assert weight.shape == (8256, 576) and torch.equal(weight[:8192], old) and not weight[8192:].any()
    targets = _targets(padded)
    assert torch.equal(targets[:8192], _targets(committed))                  # every old draft id as before
    assert targets.unique().numel() == 8256                                   # no target token mapped twice
    assert not committed.state_dict["t2d"][targets[8192:]].any()              # new ids: tokens outside the old vocab
    assert padded.state_dict["t2d"].sum() == 8256 and padded.state_dict["t2d"][targets].all()


def test_padding_keeps_the_heads_top_tokens(committed):
    """Draft logits over the target vocabulary: the old ids score as before, the new ones 0,
    so the top-4 target tokens are unchanged wherever the head's 4th best scores above 0."""
    padded, _ = pad_draft_vocab(committed, 3)
    hidden = torch.randn(64, 576, generator=torch.Generator().manual_seed(0))

    def top4(head):
        logits = hidden @ head.state_dict["lm_head.weight"].float().T    # [64, V_draft]
        return _targets(head)[logits.topk(4).indices], logits.topk(4).values[:, -1]

    (old, fourth), (new, _) = top4(committed), top4(padded)
    assert (fourth > 0).float().mean() > 0.9
    assert torch.equal(old[fourth > 0], new[fourth > 0])


def test_a_head_that_already_shards_or_tp_1_is_unchanged(tmp_path, committed):
    head = load_head(write_eagle3(tmp_path / "e"))
    assert pad_draft_vocab(head, 2) == (head, [])    # 32 draft tokens pad to 64, which 2 ranks split
    assert pad_draft_vocab(committed, 1) == (committed, [])
    medusa = load_head(write_medusa(tmp_path / "m"))
    assert pad_draft_vocab(medusa, 1) == (medusa, [])


def test_what_padding_cannot_fix_is_refused(tmp_path):
    head = load_head(write_eagle3(tmp_path / "e"))    # 2 attention heads
    with pytest.raises(CheckpointError, match="num_attention_heads 2 is not divisible by 3.*train a head"):
        pad_draft_vocab(head, 3)
    with pytest.raises(CheckpointError, match="an EAGLE-3 head.*a medusa head"):
        pad_draft_vocab(load_head(write_medusa(tmp_path / "m")), 3)


def test_convert_pads_and_says_so(tmp_path, committed):
    out = subprocess.run([sys.executable, "-m", "specplug.cli", "convert", committed.path, tmp_path / "tp3",
                          "--to", "eagle3", "--tensor-parallel-size", "3", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["notes"][0].startswith("draft_vocab_size 8192 -> 8256")
    config = json.loads((tmp_path / "tp3" / "config.json").read_text())
    assert config["draft_vocab_size"] == 8256 and config["specplug"] == committed.config["specplug"]
    assert load_head(tmp_path / "tp3").state_dict["lm_head.weight"].shape == (8256, 576)
