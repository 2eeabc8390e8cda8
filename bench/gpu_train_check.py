"""A few `specplug train eagle3` steps on a tiny target built here, offline.

The target is a random-init LlamaForCausalLM with a BPE tokenizer trained on a synthetic
corpus (tests/support/tiny_llama.py: nothing is downloaded; built once under
$SPECPLUG_CACHE/tiny): on cuda hidden 512, 4 layers, 8 query / 4 KV heads, intermediate 1024;
on cpu the test suite's tiny Llama (hidden 128).
The data is ShareGPT-style JSONL whose replies count in a cycle, as in
tests/common/test_train.py. The command run is

    python -m specplug.cli train eagle3 --device DEVICE --steps 5 --json ...

with $SPECPLUG_CACHE (its cached target states) in a temporary folder. On a GPU
`specplug train` loads the target in bfloat16 (train.load_target) and trains the head's
float32 parameters; on the CPU everything is float32. Records the loss of the first and
the last step, steps/s and tokens/s (from training.json: the steps' own time, states cache
and checkpoints excluded) and the wall time. Passes when the command succeeds and both
losses are finite. Writes OUT.json and OUT.md.

    python bench/gpu_train_check.py --out out/gpu_check/train                 # cuda
    python bench/gpu_train_check.py --device cpu --out /tmp/train_check       # float32 on the CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.support (test support)

TARGETS = {  # build_tiny_llama settings per device
    "cuda": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024),
    "cpu": dict(),
}
RUN = {"cuda": dict(batch_size=8, max_length=96), "cpu": dict(batch_size=4, max_length=48)}
COUNT = "one two three four five six seven eight nine ten".split()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="default: cuda")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (default: 5)")
    ap.add_argument("--timeout", type=float, default=240, help="seconds for the train command (default: 240)")
    ap.add_argument("--out", default="out/gpu_train_check", help="output path without suffix")
    return ap.parse_args(argv)


def counting_data(path: Path, rows: int = 64) -> Path:
    """Conversations whose replies count in a cycle: a head can learn the next token."""
    def cycle(start: int, n: int) -> str:
        return " ".join(COUNT[(start + i) % len(COUNT)] for i in range(n))

    lines = [json.dumps({"conversations": [{"from": "human", "value": "count from " + COUNT[i % 10]},
                                           {"from": "gpt", "value": cycle(i, 24)}]}) for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_command(device: str, target: Path, data: Path, out: Path, steps: int) -> list[str]:
    run = RUN[device]
    return [sys.executable, "-m", "specplug.cli", "train", "eagle3", "--target", str(target), "--out", str(out),
            "--data", str(data), "--device", device, "--steps", str(steps), "--batch-size", str(run["batch_size"]),
            "--max-length", str(run["max_length"]), "--lr", "3e-3", "--warmup-steps", "1",
            "--checkpoint-every", "1000", "--heldout-samples", "4", "--eval-prompts", "0",
            "--draft-vocab-size", "256", "--aux-layers", "1,2,3", "--overwrite", "--json"]


def check(args, work: Path) -> dict:
    from tests.support.tiny_llama import tiny_llama_dir

    start = time.perf_counter()
    target = tiny_llama_dir(**TARGETS[args.device])  # built once, under $SPECPLUG_CACHE/tiny
    env = dict(os.environ, SPECPLUG_CACHE=str(work / "cache"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    report = dict(device=args.device, target=dict(TARGETS[args.device] or {"hidden_size": 128, "num_layers": 4}),
                  target_dtype="bfloat16" if args.device != "cpu" else "float32", steps=args.steps,
                  build_s=round(time.perf_counter() - start, 1), **RUN[args.device])
    command = train_command(args.device, target, counting_data(work / "count.jsonl"), work / "head", args.steps)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    report["train_wall_s"] = round(time.perf_counter() - start, 1)
    report["command"] = " ".join(["specplug"] + command[3:])
    if proc.returncode != 0:
        report.update(ok=False, error=f"exit code {proc.returncode}", stderr_tail=proc.stderr[-3000:])
        return report
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    record = json.loads((work / "head" / "training.json").read_text())
    epochs = record["throughput"]["epochs"]  # per epoch: steps, tokens, seconds of the steps themselves
    seconds = sum(e["seconds"] for e in epochs)
    tokens = sum(e["tokens"] for e in epochs)
    report.update(first_loss=result["first_loss"], last_loss=result["last_loss"], steps_done=result["steps"],
                  steps_per_s=result["steps"] / seconds if seconds else None,
                  tokens_per_s=tokens / seconds if seconds else None, accuracy=result["accuracy"],
                  files=result["files"])
    report["ok"] = bool(seconds) and result["steps"] == args.steps and all(
        math.isfinite(result[k]) for k in ("first_loss", "last_loss"))
    return report


def markdown(report: dict) -> str:
    target = ", ".join(f"{k} {v}" for k, v in report["target"].items())
    lines = [f"device {report['device']}; target: random tiny Llama ({target}) in {report['target_dtype']}, "
             f"head parameters float32; batch {report['batch_size']}, max length {report['max_length']}", ""]
    if "first_loss" in report:
        lines.append(f"- {report['steps_done']} steps: loss {report['first_loss']:.3f} (step 1) -> "
                     f"{report['last_loss']:.3f} (step {report['steps_done']}); {report['steps_per_s']:.2f} steps/s, "
                     f"{report['tokens_per_s']:.0f} tokens/s (steps only); command wall time "
                     f"{report['train_wall_s']} s (imports, target load, states cache included)")
    else:
        lines.append(f"- FAILED: {report.get('error')}\n\n```\n{report.get('stderr_tail', '')[-1500:]}\n```")
    lines.append(f"- result: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import tokenizers  # noqa: F401 - the tiny target's tokenizer is trained with it
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"gpu_train_check: skipped: {exc.name} not installed (specplug train needs transformers)",
              file=sys.stderr)
        return 3
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_train_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="specplug-train-check-") as work:
        report = check(args, Path(work))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
