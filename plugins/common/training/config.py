"""Settings of `specplug train`: `TrainConfig`, the ONE place for its defaults (the command
line reads its defaults from here), checked when built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

METHODS = ("eagle3", "medusa")


@dataclass(frozen=True)
class TrainConfig:
    """All training settings and their defaults (the CLI reads its defaults from here).

    steps / epochs: the length of the run and of its LR schedule, in optimizer steps
    (epochs are converted: ceil(epochs * samples / batch_size) target passes x reuse);
    1000 steps when neither is given. minutes: a budget per SITTING, not the schedule:
    the run checkpoints and stops, and `--resume` continues it (same data order, same LR).
    max_length: tokens per sample (longer conversations are cut).
    ttt_steps: EAGLE-3 training-time-test steps unrolled per batch (step j drafts the
    token j+1 places past the first draft). step_decay: loss weight of step / head j
    is step_decay**j. draft_vocab_size: EAGLE-3 draft vocabulary (most frequent
    assistant tokens of the training data). num_heads: Medusa; num_layers: EAGLE-3 decoder
    layers or Medusa residual blocks per head.
    save_dtype: dtype of the written head. checkpoint_every: steps between checkpoints.
    reuse: optimizer steps per target pass (>1 trades data diversity for speed where the
    frozen target's forward dominates, e.g. a busy CPU); steps count optimizer steps.
    heldout_samples: conversations kept out of training (Medusa's rank accuracies).
    eval_prompts / eval_tokens: the final greedy tau check in the reference loop on that
    many held-out MT-bench prompts (0 = skip).
    regenerate: before training, the frozen target writes its own reply to each used
    conversation's first prompt (self-distillation); regen_temperature 0 = greedy;
    regen_batch_size: prompts generated at once (default batch_size; generation holds no
    gradients, so it can be several times larger).
    Cached under $SPECPLUG_CACHE/regenerated (see `regenerate`).
    states_cache: train from the target's states written once (`states`) instead of
    a live target forward per batch; states_cache_dir: its folder (default
    $SPECPLUG_CACHE/states/KEY). threads: torch.set_num_threads (None = torch's default).
    log_file: progress lines (step, loss, accuracy, tokens/s, ETA) every log_every steps
    and at least once a minute, plus the run's log, for runs in the background.
    """

    method: str
    target: str
    out: str
    data: str = "sharegpt"
    steps: int | None = None
    epochs: float | None = None
    minutes: float | None = None
    max_samples: int | None = None
    max_length: int = 512
    batch_size: int = 2
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 100
    reuse: int = 1
    heldout_samples: int = 32
    eval_prompts: int = 4
    eval_tokens: int = 64
    ttt_steps: int = 3
    step_decay: float = 0.8
    draft_vocab_size: int = 8192
    aux_layer_ids: tuple[int, ...] | None = None
    num_heads: int = 4
    num_layers: int = 1
    topk: int = 10
    format: str | None = None
    save_dtype: str = "bfloat16"
    resume: bool = False
    overwrite: bool = False
    init: str | None = None
    revocab: bool = False
    device: str = "cpu"
    regenerate: bool = False
    regen_temperature: float = 0.0
    regen_batch_size: int | None = None
    states_cache: bool = True
    states_cache_dir: str | None = None
    threads: int | None = None
    log_file: str | None = None
    log_every: int = 10

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("max_length", "batch_size", "ttt_steps", "draft_vocab_size", "num_heads",
                     "checkpoint_every", "topk", "reuse", "regen_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_length < 8:
            raise ValueError(f"max_length must be >= 8 tokens, got {self.max_length}")
        if self.regen_temperature < 0:
            raise ValueError(f"regen_temperature must be >= 0 (0 = greedy), got {self.regen_temperature}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and (self.epochs <= 0 or self.steps is not None):
            raise ValueError(f"epochs must be > 0 and exclude --steps (both set the schedule's length), "
                             f"got epochs={self.epochs}, steps={self.steps}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.states_cache_dir and not self.states_cache:
            raise ValueError("--states-cache PATH and --no-states-cache exclude each other")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other: resume keeps the checkpoint, "
                             "overwrite deletes it")
        if self.init and self.resume:
            raise ValueError("--init and --resume exclude each other: --init starts a new run from a trained "
                             "head, --resume continues this run's checkpoint (which already holds --init's start)")
        if self.method == "eagle3" and self.num_layers < 1:
            raise ValueError("--num-layers must be >= 1 for an EAGLE-3 head (its decoder layers), "
                             f"got {self.num_layers}")
        if self.revocab and not (self.init and self.method == "eagle3"):
            raise ValueError("--revocab rebuilds an EAGLE-3 head's draft vocabulary from this run's data when it "
                             "starts from a trained head: pass it with `specplug train eagle3 --init HEAD` (a new "
                             "head takes its vocabulary from the data anyway)")

    @property
    def regen_batch(self) -> int:
        return self.regen_batch_size or self.batch_size

    def schedule_steps(self, num_samples: int) -> int:
        """Optimizer steps of the whole run (the LR schedule's length; where it ends)."""
        if self.steps is not None:
            return self.steps
        if self.epochs is not None:
            return math.ceil(self.epochs * num_samples / self.batch_size) * self.reuse
        return 1000
