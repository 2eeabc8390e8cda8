"""What the parts of `specplug bench` share: each engine's runner module (ENGINES), what
one run measured (RunResult) and what a runner offers (Runner). specplug.bench (the
command), specplug.bench_rounds (interleaved rounds) and the engines' bench runners
import them from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

ENGINES = {"vllm": ("vllm", "specplug.vllm_eagle3.bench_runner"),
           "sglang": ("sglang", "specplug.sglang_medusa.bench_runner")}


@dataclass
class RunResult:
    """What one (method, batch size) run measured. Counters are deltas over the run."""

    method: str
    batch_size: int
    num_prompts: int
    output_tokens: int
    seconds: float
    num_drafts: int = 0               # verify steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    rounds: list[list[float]] = field(default_factory=list)  # --interleave: [tokens, seconds] per round

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float | None:
        """Mean tokens per verify step (accepted drafts + the bonus token)."""
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_by_pos(self) -> list[float]:
        """Fraction of drafts whose position-i token was accepted."""
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []


class Runner(Protocol):
    engine: str
    version: str

    def methods(self) -> list[str]: ...

    def run(self, method: str, prompts: Sequence[str], batch_size: int, fresh: bool = True) -> RunResult:
        """Generate `prompts` in batches; `fresh` resets the engine's caches first."""

    def close(self) -> None: ...
