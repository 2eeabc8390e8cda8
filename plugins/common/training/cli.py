"""The command line of `specplug train`: its options (defaults from `TrainConfig`), the
`TrainConfig` they make, and the command that runs `train.train` and reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal

from specplug.common.training.config import METHODS, TrainConfig
from specplug.common.training.output import CHECKPOINT
from specplug.common.training.train import train

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    parser.add_argument("method", choices=METHODS, help="head type to train")
    parser.add_argument("--target", required=True, help="Hugging Face causal-LM folder (frozen)")
    parser.add_argument("--out", required=True, help="output folder for the head and its checkpoint")
    parser.add_argument("--data", default=d["data"], help="'sharegpt' or a ShareGPT-style .json/.jsonl file")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps of the whole run = the LR schedule's length (default: 1000, "
                             "or --epochs)")
    parser.add_argument("--epochs", type=float, default=None,
                        help="passes over the training samples, converted to --steps (excludes --steps)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="wall-clock budget of THIS sitting: checkpoint and stop, then rerun with --resume "
                             "(the LR schedule follows --steps / --epochs only)")
    parser.add_argument("--max-samples", type=int, default=None, help="use at most this many conversations")
    for name, kind in (("max_length", int), ("batch_size", int), ("lr", float), ("warmup_steps", int),
                       ("seed", int), ("checkpoint_every", int), ("reuse", int), ("heldout_samples", int),
                       ("ttt_steps", int), ("step_decay", float), ("eval_prompts", int), ("eval_tokens", int),
                       ("draft_vocab_size", int), ("num_layers", int), ("topk", int)):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=d[name], help=_HELP.get(name, name))
    parser.add_argument("--heads", type=int, default=d["num_heads"], help="Medusa heads")
    parser.add_argument("--aux-layers", default=None, help="EAGLE-3 aux layer ids, e.g. 2,15,27 (default 2,L//2,L-3)")
    parser.add_argument("--format", default=None,
                        help="output format: eagle3 (default) or speculators; medusa (default) or vllm-medusa")
    parser.add_argument("--save-dtype", default=d["save_dtype"], choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=d["device"], help="torch device (cpu, cuda)")
    parser.add_argument("--regenerate", action="store_true",
                        help="self-distillation: the target first writes its own replies to the training "
                             "prompts (cached under $SPECPLUG_CACHE/regenerated) and the head trains on those")
    parser.add_argument("--regen-temperature", type=float, default=d["regen_temperature"],
                        help="--regenerate sampling temperature (0 = greedy)")
    parser.add_argument("--regen-batch-size", type=int, default=None,
                        help="--regenerate: prompts generated at once (default --batch-size)")
    parser.add_argument("--states-cache", default=None, metavar="PATH",
                        help="folder of the cached target states (default $SPECPLUG_CACHE/states/KEY, "
                             "KEY hashing target, samples and aux layers)")
    parser.add_argument("--no-states-cache", action="store_true",
                        help="no cached target states: a live target forward on every batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (torch.set_num_threads; default: torch's)")
    parser.add_argument("--log-file", default=None, metavar="PATH",
                        help="append progress lines (step, loss, accuracy, tokens/s, ETA) and the log to PATH, "
                             "for runs in the background")
    parser.add_argument("--log-every", type=int, default=d["log_every"],
                        help="--log-file: a progress line every N steps (and at least once a minute)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint (same data order, same LR schedule)")
    parser.add_argument("--init", default=None, metavar="HEAD",
                        help="start from a trained head folder of the same method (e.g. the committed test-bed "
                             "head) instead of from scratch: a new LR schedule over this run's data; its "
                             "draft vocabulary and shape come from HEAD; training.json adds HEAD's steps and "
                             "minutes to this run's in `total`")
    parser.add_argument("--revocab", action="store_true",
                        help="EAGLE-3 with --init: rebuild the draft vocabulary from this run's data (its "
                             "--draft-vocab-size most frequent reply tokens); tokens HEAD already drafts keep "
                             "their trained lm_head rows, new ones start from the target's. For a head whose "
                             "vocabulary misses tokens the target often writes (the log prints both coverages)")
    parser.add_argument("--overwrite", action="store_true", help="replace a head or checkpoint in OUT")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


_HELP = {
    "max_length": "tokens per training sample", "batch_size": "samples per step", "lr": "peak learning rate",
    "ttt_steps": "EAGLE-3 training-time-test steps unrolled", "step_decay": "loss weight decay per step/head",
    "draft_vocab_size": "EAGLE-3 draft vocabulary size",
    "num_layers": "EAGLE-3: decoder layers of the head; Medusa: residual blocks per head (with --init: more "
                  "than HEAD has appends identity layers / blocks)",
    "topk": "Medusa: ranks whose accuracy is recorded",
    "reuse": "optimizer steps per target pass",
    "heldout_samples": "conversations kept out of training (Medusa rank accuracies)",
    "eval_prompts": "final greedy tau check: MT-bench prompts in the reference loop (0 = skip)",
    "eval_tokens": "final tau check: new tokens per prompt", "checkpoint_every": "steps between checkpoints",
}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
    return TrainConfig(
        method=args.method, target=args.target, out=args.out, data=args.data, steps=args.steps,
        minutes=args.minutes, max_samples=args.max_samples, max_length=args.max_length,
        batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
        checkpoint_every=args.checkpoint_every, reuse=args.reuse, heldout_samples=args.heldout_samples,
        ttt_steps=args.ttt_steps, step_decay=args.step_decay, eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        draft_vocab_size=args.draft_vocab_size, aux_layer_ids=aux, num_heads=args.heads,
        num_layers=args.num_layers, topk=args.topk, format=args.format, save_dtype=args.save_dtype,
        resume=args.resume, overwrite=args.overwrite, init=args.init, revocab=args.revocab, device=args.device,
        regenerate=args.regenerate,
        regen_temperature=args.regen_temperature, regen_batch_size=args.regen_batch_size, epochs=args.epochs,
        states_cache=not args.no_states_cache, states_cache_dir=args.states_cache, threads=args.threads,
        log_file=args.log_file, log_every=args.log_every)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="specplug train: %(message)s")
    try:
        result = train(config_from_args(args))
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    elif result.stopped:
        print(f"stopped ({result.stopped}) at step {result.steps} of {result.schedule_steps}: checkpoint in "
              f"{result.out}/{CHECKPOINT}; rerun the same command with --resume to continue")
    else:
        print(f"wrote {result.out} after {result.steps} steps ({result.seconds / 60:.1f} min): "
              f"loss {result.first_loss:.3f} -> {result.last_loss:.3f}, "
              f"top-1 accuracy by position {result.accuracy}")
        if result.eval:
            print(f"reference loop on {result.eval['eval']['prompts']} MT-bench prompts (greedy): "
                  f"tau {result.eval['tau']}, acceptance by position {result.eval['acceptance_per_position']}")
    return 128 + int(getattr(signal, result.stopped)) if result.stopped in ("SIGINT", "SIGTERM") else 0
