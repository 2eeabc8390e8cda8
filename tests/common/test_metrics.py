"""Acceptance metrics: per-position counts, tau, merging, vLLM counters."""

import pytest
import torch

from specplug.common.metrics import AcceptanceStats, tau
from specplug.common.sampling import verify


def test_per_position_counts_and_tau():
    stats = AcceptanceStats().update(torch.tensor([0, 2, 3, 1]), num_draft_tokens=4 * 3)
    assert stats.num_steps == 4 and stats.num_accepted == 6
    assert stats.accepted_per_pos == [3, 2, 1]  # steps accepting position 0, 1, 2
    assert stats.tau == pytest.approx(2.5) == tau(torch.tensor([0, 2, 3, 1]))
    assert stats.acceptance_per_pos == [0.75, 0.5, 0.25]
    assert stats.conditional_acceptance == pytest.approx([0.75, 2 / 3, 0.5])
    assert stats.draft_acceptance_rate == pytest.approx(0.5)


def test_accumulates_and_merges():
    a = AcceptanceStats().update(torch.tensor([1])).update(torch.tensor([0, 4]))
    b = AcceptanceStats().update(torch.tensor([2, 2]))
    both = a + b
    assert both.num_steps == 5 and both.num_accepted == 9
    assert both.accepted_per_pos == [4, 3, 1, 1]
    assert both.as_dict()["tau"] == pytest.approx(1 + 9 / 5)
    assert AcceptanceStats().tau == 0.0 and AcceptanceStats().draft_acceptance_rate is None


def test_update_takes_a_verify_result():
    res = verify(torch.tensor([[0, 1, 1]]), torch.tensor([[-1, 0, 1]]), torch.tensor([[[0.0, 1.0]] * 3]))
    stats = AcceptanceStats().update(res)
    assert stats.accepted_per_pos == [1, 1] and stats.tau == 3.0


def test_bad_input():
    with pytest.raises(ValueError, match=">= 0"):
        AcceptanceStats().update(torch.tensor([-1]))
    with pytest.raises(ValueError, match="zero steps"):
        tau(torch.tensor([], dtype=torch.long))


def test_from_histograms_merges_requests():
    """h[i] = steps that accepted exactly i drafts (SGLang's spec_correct_drafts_histogram)."""
    stats = AcceptanceStats.from_histograms([[1, 0, 1, 1], None, [], [0, 1]], draft_tokens_per_step=3)
    assert stats.num_steps == 4 and stats.num_accepted == 0 + 2 + 3 + 1
    assert stats.accepted_per_pos == [3, 2, 1] and stats.num_draft_tokens == 12


def test_a_snapshot_subtracted_leaves_the_steps_since():
    before = AcceptanceStats(2, 3, 6, [2, 1])
    after = AcceptanceStats(6, 11, 18, [4, 3, 4])
    run = after - before
    assert run == AcceptanceStats(4, 8, 12, [2, 2, 4])
    assert run.tau == 3.0 and run.acceptance_per_pos == [0.5, 0.5, 1.0]
