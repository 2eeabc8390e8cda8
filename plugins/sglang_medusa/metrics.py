"""SGLang's per-request speculation fields -> specplug.common.metrics.AcceptanceStats.

SGLang reports, in every request's `meta_info`: `spec_verify_ct` (verify steps),
`spec_accept_length` (completion tokens / verify steps), and
`spec_correct_drafts_histogram` (h[i] = steps that accepted exactly i draft tokens).
Per-position acceptance follows from the histogram's tail sums.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from specplug.common.metrics import AcceptanceStats


def acceptance_from_meta_info(meta_infos: Iterable[Mapping],
                              draft_tokens_per_step: int | None = None) -> AcceptanceStats:
    """Merge the histograms of many requests' meta_info into one AcceptanceStats
    (tau, per-position acceptance). draft_tokens_per_step: tree nodes minus the root, if known."""
    stats = AcceptanceStats()
    for meta in meta_infos:
        histogram = meta.get("spec_correct_drafts_histogram")
        if not histogram:
            continue
        counts = torch.as_tensor(histogram, dtype=torch.long)
        num_accepted = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # [steps]
        proposed = None if draft_tokens_per_step is None else draft_tokens_per_step * num_accepted.numel()
        stats.update(num_accepted, proposed)
    return stats
