"""A run of `specplug train`: EAGLE-3 and Medusa heads for a Hugging Face causal LM.

The head trains on the frozen target's states: written once before the loop into a
memory-mapped cache (`states`, the default) or recomputed by a live forward on
every batch (`--no-states-cache`, `target.target_pass`). The method-specific parts (head
construction, loss, saving) live in `eagle3` and `medusa`, the loop (LR
schedule, checkpoints, stopping, progress, throughput) in `loop`, the settings in
`config` (`TrainConfig`, the ONE place for defaults), the up-front checks that fail
before any long work in `checks`, the data (chat conversations -> token ids + a mask of
assistant tokens) in `samples` and `regenerate`, the target in `target`, the output
folder's layout in `output` and the command line in `cli`. This module runs one sitting:
checks, data, the head (new, --init or --resume), the loop, the output and the final eval.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specplug.common.training.checks import check_init, check_memory, check_output, check_target
from specplug.common.training.config import TrainConfig
from specplug.common.training.output import CHECKPOINT
from specplug.common.training.regenerate import regenerate
from specplug.common.training.samples import Sample, build_samples, load_conversations
from specplug.common.training.target import load_target

logger = logging.getLogger(__name__)


def method_module(method: str):
    """The module implementing one method's head, loss and output."""
    if method == "eagle3":
        from specplug.common.training import eagle3 as module
    else:
        from specplug.common.training import medusa as module
    return module


class OutputContext(NamedTuple):
    """What a method's save_output may need beyond the head: the target, held-out samples."""

    target: Any
    heldout: list  # list[Sample], never trained on
    pad_id: int


@dataclass
class TrainResult:
    out: str
    steps: int
    seconds: float
    first_loss: float
    last_loss: float
    accuracy: list[float]  # per step position (EAGLE-3) or head (Medusa), top-1, last window
    files: list[str]
    eval: dict | None = None  # evaluate.evaluate's report (greedy, MT-bench), when run
    schedule_steps: int = 0  # steps of the whole run (steps < schedule_steps: stopped early)
    stopped: str | None = None  # None = finished; "minutes" / "SIGINT" / "SIGTERM": --resume continues


def train(cfg: TrainConfig) -> TrainResult:
    """Train a head as `cfg` says; returns what was written and the loss curve's ends.

    A sitting stopped early (--minutes, SIGINT, SIGTERM) writes its checkpoint and
    training.json; after --minutes also the head so far; the final eval runs only at the
    schedule's end."""
    from specplug.common.training import loop as train_loop

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = check_output(cfg)
    target_config = check_target(cfg.target)
    check_memory(cfg, target_config)
    method = method_module(cfg.method)
    method.preflight(cfg, target_config)
    lineage = check_init(cfg, target_config)
    convs = load_conversations(cfg.data)
    with train_loop.log_to_file(cfg.log_file):
        target, tokenizer = load_target(cfg.target, cfg.device)
        rewrite = (lambda chosen: regenerate(target, tokenizer, chosen, cfg)) if cfg.regenerate else None
        samples, heldout = build_samples(tokenizer, convs, cfg, rewrite)
        logger.info("%d training samples, %d tokens, %d assistant tokens", len(samples),
                    sum(len(s.input_ids) for s in samples), sum(sum(s.loss_mask) for s in samples))
        run, state = _start(cfg, method, target, tokenizer, samples, out)
        if lineage is not None:
            state["init"] = lineage
        stopped = train_loop.run_loop(run, state)
        return _finish(run, state, tokenizer, heldout, stopped)


def _start(cfg: TrainConfig, method, target, tokenizer, samples: list[Sample], out: Path):
    """(train_loop.Run, state) of this sitting: a new head, or the checkpoint's head,
    optimizer and RNG states (--resume); the cached target states opened (written if new)."""
    from specplug.common.training import loop as train_loop

    if cfg.overwrite and (out / CHECKPOINT).is_dir():
        import shutil
        shutil.rmtree(out / CHECKPOINT)
    torch.manual_seed(cfg.seed)
    if cfg.resume:
        head, state = method.load_checkpoint(out / CHECKPOINT, target, cfg)
    elif cfg.init:
        head = method.init_head(Path(cfg.init), target, cfg, samples)
        state = {"step": 0, "losses": [], "seconds": 0.0}
    else:
        head, state = method.build_head(target, samples, cfg), {"step": 0, "losses": [], "seconds": 0.0}
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr,
                                  weight_decay=cfg.weight_decay)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    schedule = cfg.schedule_steps(len(samples))
    train_loop.note_schedule(state, schedule, cfg)
    states = _states_cache(cfg, method, head, target, samples, pad_id, state)
    if cfg.resume:
        optimizer.load_state_dict(torch.load(out / CHECKPOINT / "optimizer.pt", weights_only=True))
        train_loop.restore_rng(out / CHECKPOINT)
    return train_loop.Run(cfg, method, head, target, samples, optimizer, out, pad_id, schedule, states), state


def _states_cache(cfg: TrainConfig, method, head, target, samples: list[Sample], pad_id: int, state: dict):
    """The reader of the cached target states (written now when missing); None with
    --no-states-cache. state["states_cache"] records the sitting that wrote them."""
    if not cfg.states_cache:
        return None
    from specplug.common.training import states as train_cache

    reader, info = train_cache.open_states(cfg, target, samples, method.aux_ids(head, target), pad_id)
    if info["written"] or "states_cache" not in state:
        state["states_cache"] = info
    return reader


def _finish(run, state: dict, tokenizer, heldout: list[Sample], stopped: str | None) -> TrainResult:
    """Write the head (not after a signal), run the final eval (only when finished) and
    training.json; the result."""
    from specplug.common.training import loop as train_loop

    files: list[str] = []
    if stopped in (None, "minutes"):
        context = OutputContext(run.target, heldout, run.pad_id)
        files = run.method.save_output(run.head, run.out, run.cfg, state, context)
    state["eval"] = final_eval(run.out, run.target, tokenizer, run.cfg) if stopped is None else None
    train_loop.write_training_record(run, state, stopped)
    losses = state["losses"]
    return TrainResult(str(run.out), state["step"], state["seconds"], losses[0] if losses else float("nan"),
                       losses[-1] if losses else float("nan"), state.get("accuracy", []), files, state["eval"],
                       run.schedule, stopped)


def final_eval(out: Path, target, tokenizer, cfg: TrainConfig) -> dict | None:
    """Greedy tau of the written head on cfg.eval_prompts MT-bench prompts (None if 0)."""
    if cfg.eval_prompts < 1:
        return None
    from specplug.common.training.evaluate import EvalConfig, evaluate, load_drafter

    eval_cfg = EvalConfig("mtbench", cfg.eval_prompts, cfg.eval_tokens)
    report = evaluate(target, tokenizer, load_drafter(out, target), eval_cfg)
    logger.info("reference loop, %d MT-bench prompts x %d tokens, greedy: tau %.2f, acceptance by position %s",
                cfg.eval_prompts, cfg.eval_tokens, report["tau"], report["acceptance_per_position"])
    return report
