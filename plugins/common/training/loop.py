"""The loop of `specplug train`: optimizer steps, LR schedule, checkpoints, stopping, progress.

Invariants (what makes `--resume` exact):
  * optimizer step s trains on target pass b = s // reuse, whose samples are
    `batch_indices(b, batch_size, len(samples), seed)` (each epoch reshuffled by
    (seed, epoch)): the data order is a function of s;
  * the LR at step s is `lr_at(s, cfg, schedule)`: a function of s and the schedule's
    length in steps, never of the wall clock;
  * a checkpoint holds the head's fp32 tensors, the optimizer, torch's RNG states and
    state.json (step, losses, accuracy window, tokens/s by epoch), so a resumed run
    continues bit for bit (tested, with and without cached target states).
`--minutes` bounds one sitting (checked after each step, so a sitting makes at least
one); SIGINT / SIGTERM stop after the step under way. Either way a checkpoint is written
and the log says how to continue. Throughput: tokens of samples trained on per second
(target states + forward/backward/step; checkpoints and logging excluded), per epoch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specplug.common.training.config import TrainConfig
from specplug.common.training.output import CHECKPOINT
from specplug.common.training.samples import Batch, batch_indices, collate
from specplug.common.training.target import TargetOutput, target_pass

logger = logging.getLogger(__name__)

WINDOW = 20  # steps over which the bar's loss and accuracy are averaged
LOG_GAP_S = 60.0  # with --log-file, a progress line at least this often
PROGRESS_LOGGER = "specplug.progress"  # progress lines: to --log-file only


def lr_at(step: int, cfg: TrainConfig, schedule: int) -> float:
    """Linear warm-up over cfg.warmup_steps, then cosine decay to 10% of cfg.lr at step
    `schedule` (the run's length in optimizer steps); a pure function of the step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, schedule - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclasses.dataclass
class Run:
    """What one sitting of the loop works on (the evolving `state` dict travels beside it)."""

    cfg: TrainConfig
    method: Any  # training.eagle3 or training.medusa
    head: torch.nn.Module
    target: Any
    samples: list  # list[Sample]
    optimizer: torch.optim.Optimizer
    out: Path
    pad_id: int
    schedule: int  # optimizer steps of the whole run
    states: Any = None  # states.StatesReader; None = a live target pass per batch
    started: float = dataclasses.field(default_factory=time.perf_counter)  # this sitting


def run_loop(run: Run, state: dict) -> str | None:
    """Train from state["step"] to run.schedule; None when there, else why this sitting
    stopped early ("minutes", "SIGINT", "SIGTERM"). Writes a checkpoint either way."""
    stopper = Stopper(run.cfg.minutes)
    progress = Progress(run, state)
    run.head.train()
    with stopper.signals():
        while state["step"] < run.schedule and stopper.reason is None:
            _train_on_batch(run, state, stopper, progress)
    progress.close(state, stopper.reason)
    save_checkpoint(run, state)
    state["seconds"] += time.perf_counter() - run.started
    return stopper.reason


def _train_on_batch(run: Run, state: dict, stopper: Stopper, progress: Progress) -> None:
    """Up to cfg.reuse optimizer steps on one target pass (fewer when resuming mid-pass or
    at the schedule's end, or when the sitting must stop)."""
    cfg = run.cfg
    start = time.perf_counter()
    index = state["step"] // cfg.reuse
    batch, tgt = target_states(run, index)
    tokens = int(batch.attention_mask.sum())
    epoch = index * cfg.batch_size // len(run.samples)
    for _ in range(min(cfg.reuse - state["step"] % cfg.reuse, run.schedule - state["step"])):
        _update(run, tgt, batch, state)
        count_tokens(state, epoch, tokens, time.perf_counter() - start)
        progress.step(state, tokens)
        if state["step"] % cfg.checkpoint_every == 0:
            save_checkpoint(run, state)
        stopper.check()
        if stopper.reason is not None:
            return
        start = time.perf_counter()


def target_states(run: Run, index: int) -> tuple[Batch, TargetOutput]:
    """The index-th batch (on the device) and the target's states for it: read from the
    cache when there is one, else a live forward of the target."""
    ids = batch_indices(index, run.cfg.batch_size, len(run.samples), run.cfg.seed)
    batch = Batch(*(t.to(run.cfg.device) for t in collate([run.samples[i] for i in ids], run.pad_id)))
    if run.states is not None:
        return batch, run.states.target_output(ids, batch.input_ids.shape[1])
    return batch, target_pass(run.target, batch, run.method.aux_ids(run.head, run.target))


def _update(run: Run, tgt: TargetOutput, batch: Batch, state: dict) -> None:
    """One optimizer step; appends the loss and updates the accuracy window in `state`."""
    loss, accuracy = run.method.loss(run.head, tgt, batch, run.cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(state["step"], run.cfg, run.schedule)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in run.head.parameters() if p.requires_grad], run.cfg.grad_clip)
    run.optimizer.step()
    state["step"] += 1
    state["losses"].append(loss.item())
    window = (state.get("accuracy_window", []) + [[float(a) for a in accuracy]])[-WINDOW:]
    state["accuracy_window"] = window  # [steps <= WINDOW][positions]
    state["accuracy"] = [round(sum(column) / len(window), 4) for column in zip(*window)]


def count_tokens(state: dict, epoch: int, tokens: int, seconds: float) -> None:
    """Add one step's tokens and seconds to state["epochs"][epoch] (epochs listed in order)."""
    epochs = state.setdefault("epochs", [])
    while len(epochs) <= epoch:
        epochs.append({"epoch": len(epochs), "steps": 0, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0})
    entry = epochs[epoch]
    entry["steps"] += 1
    entry["tokens"] += tokens
    entry["seconds"] += seconds
    entry["tokens_per_s"] = round(entry["tokens"] / max(entry["seconds"], 1e-9), 1)


# ---------------------------------------------------------------------------------------
# Stopping and progress
# ---------------------------------------------------------------------------------------
class Stopper:
    """Why this sitting should stop: --minutes spent (checked after each step) or SIGINT /
    SIGTERM received (the step under way finishes first); None while it should go on."""

    def __init__(self, minutes: float | None):
        self.deadline = time.monotonic() + 60 * minutes if minutes else None
        self.reason: str | None = None

    def check(self) -> None:
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = "minutes"

    @contextlib.contextmanager
    def signals(self):
        """SIGINT / SIGTERM set `reason` (main thread only); a second one acts as usual."""
        previous: dict[int, Any] = {}

        def handler(signum, frame):
            self.reason = self.reason or signal.Signals(signum).name
            signal.signal(signum, previous[signum])

        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.signal(sig, handler)
                previous[sig] = old if old is not None else signal.SIG_DFL
        except ValueError:  # not the main thread: signals keep their handlers
            pass
        try:
            yield self
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


class Progress:
    """The tqdm bar (off when --log-file is given and stderr is no terminal) and, with
    --log-file, a line every cfg.log_every steps or LOG_GAP_S seconds: step, epoch, loss,
    accuracy by position, lr, tokens/s since the last line, ETA of the whole schedule."""

    def __init__(self, run: Run, state: dict):
        from tqdm.auto import tqdm

        self.run, self.cfg = run, run.cfg
        quiet = bool(run.cfg.log_file) and not sys.stderr.isatty()
        self.bar = tqdm(total=run.schedule, initial=state["step"], desc=f"train {run.cfg.method}", unit="step",
                        dynamic_ncols=True, disable=quiet)
        self.first, self.start = state["step"], time.perf_counter()
        self.mark = (self.start, 0)  # time of the last line, tokens since it
        self.log = logging.getLogger(PROGRESS_LOGGER)
        if run.cfg.log_file:
            self.log.info("sitting starts at step %d of %d%s", state["step"], run.schedule,
                          f" (--minutes {run.cfg.minutes})" if run.cfg.minutes else "")

    def step(self, state: dict, tokens: int) -> None:
        now = time.perf_counter()
        self.mark = (self.mark[0], self.mark[1] + tokens)
        self.bar.update(1)
        self.bar.set_postfix_str(self._postfix(state, now), refresh=False)
        if self.cfg.log_file and (state["step"] % self.cfg.log_every == 0 or now - self.mark[0] >= LOG_GAP_S):
            self.log.info("%s", self.line(state, now))
            self.mark = (now, 0)

    def line(self, state: dict, now: float) -> str:
        """One progress line (the --log-file format)."""
        run, step = self.run, state["step"]
        epoch = ((step - 1) // self.cfg.reuse + 1) * self.cfg.batch_size / len(run.samples)  # samples seen / n
        rate = self.mark[1] / max(now - self.mark[0], 1e-9)
        return (f"step {step}/{run.schedule} epoch {epoch:.2f} loss {_recent_loss(state):.4f} "
                f"acc@pos {_acc(state)} lr {lr_at(step - 1, self.cfg, run.schedule):.2e} "
                f"tok/s {rate:.0f} eta {self._eta(step, now) / 60:.1f} min")

    def _eta(self, step: int, now: float) -> float:
        done = step - self.first
        return (self.run.schedule - step) * (now - self.start) / done if done else float("nan")

    def _postfix(self, state: dict, now: float) -> str:
        text = f"loss {_recent_loss(state):.3f} acc@pos {_acc(state)}"
        if self.cfg.minutes:
            left = 60 * self.cfg.minutes - (now - self.start)
            text += f" sitting left {max(0.0, left) / 60:.1f} min"
        return text

    def close(self, state: dict, stopped: str | None) -> None:
        self.bar.close()
        if stopped is None:
            logger.info("done: step %d of %d", state["step"], self.run.schedule)
            return
        why = f"--minutes {self.cfg.minutes} spent" if stopped == "minutes" else f"{stopped} received"
        logger.info("%s: stopped at step %d of %d; checkpoint in %s; rerun the same command with --resume "
                    "to continue", why, state["step"], self.run.schedule, self.run.out / CHECKPOINT)


def _recent_loss(state: dict) -> float:
    recent = state["losses"][-WINDOW:]
    return sum(recent) / len(recent)


def _acc(state: dict) -> str:
    return "/".join(f"{a:.2f}" for a in state.get("accuracy", []))


@contextlib.contextmanager
def log_to_file(path: str | None):
    """With a path: the run's INFO log and the progress lines are appended to it (progress
    lines go there only); nothing changes without one."""
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    handler.setLevel(logging.INFO)
    package, progress = logging.getLogger("specplug"), logging.getLogger(PROGRESS_LOGGER)
    saved = (package.level, progress.level, progress.propagate)
    if package.getEffectiveLevel() > logging.INFO:
        package.setLevel(logging.INFO)
    progress.setLevel(logging.INFO)
    progress.propagate = False
    package.addHandler(handler)
    progress.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        progress.removeHandler(handler)
        package.level, progress.level, progress.propagate = saved
        handler.close()


# ---------------------------------------------------------------------------------------
# Checkpoints and the record
# ---------------------------------------------------------------------------------------
def save_checkpoint(run: Run, state: dict) -> None:
    """Write OUT/checkpoint atomically (a crash mid-write leaves the previous one)."""
    import shutil

    from safetensors.torch import save_file

    final, tmp = run.out / CHECKPOINT, run.out / f".{CHECKPOINT}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    saved = dict(state, seconds=state["seconds"] + time.perf_counter() - run.started, config=config_dict(run.cfg))
    save_file({k: v.detach().contiguous() for k, v in run.method.checkpoint_tensors(run.head).items()},
              str(tmp / "head.safetensors"))
    torch.save(run.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    (tmp / "head_config.json").write_text(json.dumps(run.method.head_config(run.head), indent=2) + "\n")
    (tmp / "state.json").write_text(json.dumps(saved) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    logger.debug("checkpoint at step %d", state["step"])


def _rng_state() -> dict[str, Any]:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(ckpt: Path) -> None:
    """Set torch's RNG states to the checkpoint's (a checkpoint without rng.pt: unchanged)."""
    if not (ckpt / "rng.pt").is_file():
        return
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def note_schedule(state: dict, schedule: int, cfg: TrainConfig) -> None:
    """Log the schedule; warn when a resumed run's differs from the checkpoint's."""
    before = state.get("schedule_steps")
    if before is not None and before != schedule:
        logger.warning("LR schedule changes from %d to %d steps at step %d: the steps before and after "
                       "follow different schedules (pass the first sitting's --steps / --epochs to keep it)",
                       before, schedule, state["step"])
    state["schedule_steps"] = schedule
    logger.info("schedule: %d optimizer steps (warm-up %d, cosine to 10%% of lr %g)%s", schedule,
                cfg.warmup_steps, cfg.lr, f"; this sitting stops after {cfg.minutes} min" if cfg.minutes else "")


def config_dict(cfg: TrainConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["aux_layer_ids"] = list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None
    return d


def write_training_record(run: Run, state: dict, stopped: str | None) -> None:
    """OUT/training.json: settings, steps, time, loss ends, accuracies, tokens/s by epoch
    and the states cache's write time (for the record)."""
    losses, epochs = state["losses"], state.get("epochs", [])
    record = {"config": config_dict(run.cfg), "steps": state["step"], "schedule_steps": run.schedule,
              "finished": stopped is None, "stopped": stopped, "minutes": round(state["seconds"] / 60, 2),
              "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
              "accuracy_top1_by_position": state.get("accuracy", []),
              "head_accuracies": state.get("head_accuracies"), "eval": state.get("eval"),
              "init": state.get("init"), "total": _total(state),
              "throughput": {"tokens_per_s_by_epoch": [e["tokens_per_s"] for e in epochs], "epochs": epochs,
                             "states_cache": state.get("states_cache")}}
    (run.out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def _total(state: dict) -> dict:
    """Steps, minutes and sample tokens behind the written head: this run's plus its
    --init head's."""
    init = state.get("init") or {"steps": 0, "minutes": 0.0, "tokens": 0}
    tokens = sum(e["tokens"] for e in state.get("epochs", []))
    return {"steps": init["steps"] + state["step"], "minutes": round(init["minutes"] + state["seconds"] / 60, 2),
            "tokens": init["tokens"] + tokens}
