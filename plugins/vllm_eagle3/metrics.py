"""Speculation metrics from vLLM's own counters, plus tau (mean tokens per verify step).

vLLM counts drafts, draft tokens, accepted tokens and accepted tokens per position for
every proposer (specplug's included), in its log and on Prometheus as
vllm:spec_decode_*; `LLM.get_metrics()` returns them when the engine was started with
disable_log_stats=False. Counters are cumulative: subtract a snapshot taken before a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_PREFIX = "vllm:spec_decode_"


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default_factory=tuple)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per verify step: 1 + accepted / drafts (1.0 with no drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def position_acceptance(self) -> tuple[float, ...]:
        """Fraction of drafts whose token at position i was accepted."""
        return tuple(a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position)

    def __sub__(self, earlier: "SpecDecodeStats") -> "SpecDecodeStats":
        return SpecDecodeStats(
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            tuple(_add_padded(self.accepted_per_position, [-a for a in earlier.accepted_per_position])),
        )


def spec_decode_stats(metrics) -> SpecDecodeStats:
    """SpecDecodeStats from `LLM.get_metrics()` (summed over engines / labels)."""
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_position: list[int] = []
    for metric in metrics:
        name = metric.name.removeprefix(_PREFIX)
        if not metric.name.startswith(_PREFIX):
            continue
        if name in counts:
            counts[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            per_position = _add_padded(per_position, [int(v) for v in metric.values])
    return SpecDecodeStats(accepted_per_position=tuple(per_position), **counts)


def _add_padded(xs, ys) -> list[int]:
    """Element-wise xs + ys, the shorter one padded with zeros."""
    width = max(len(xs), len(ys))
    return [(xs[i] if i < len(xs) else 0) + (ys[i] if i < len(ys) else 0) for i in range(width)]


def stats_from_outputs(outputs) -> SpecDecodeStats:
    """SpecDecodeStats summed over `LLM.generate` outputs of an engine started with
    per_request_spec_decode_metrics="summary" (vLLM's per-request acceptance histogram:
    histogram[j] = verify steps that accepted j draft tokens). Unlike the Prometheus
    counters these stay right when several engines share a process."""
    drafts = draft_tokens = accepted = 0
    per_position: list[int] = []
    for output in outputs:
        for completion in output.outputs:
            metrics = completion.spec_decode_metrics
            if metrics is None:
                continue
            histogram = list(metrics.histogram)
            drafts += sum(histogram)
            draft_tokens += metrics.num_draft_tokens
            accepted += sum(j * n for j, n in enumerate(histogram))
            at_least = [sum(histogram[i + 1:]) for i in range(len(histogram) - 1)]  # accepted past position i
            per_position = _add_padded(per_position, at_least)
    return SpecDecodeStats(drafts, draft_tokens, accepted, tuple(per_position))
