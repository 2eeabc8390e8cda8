"""The tau curve: acceptance length of head snapshots against training tokens seen.

    python bench/tau_curve.py --snapshots HEAD.snapshots --target MODEL_DIR \
        [--budgets 8,16] [--prompts 8] [--tokens 64] [--md OUT.md] [--png OUT.png]

Each snapshot folder (written by bench/train_sittings.sh: a head plus its training.json)
is drafted in the reference loop (specplug.common.reference.generate: the target in
transformers, greedy, MT-bench first turns spread over the 8 categories) with EAGLE-2
dynamic trees of each budget (depth 4, top-k 4); tau = tokens per target pass. Writes a
markdown table and a PNG (tau against training tokens, one line per budget); results
are cached per snapshot in SNAPSHOT/tau.json, so a rerun only evaluates new snapshots.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger("tau_curve")


def tokens_seen(record: dict) -> int:
    """Sample tokens trained on so far: training.json's total (a run started with --init
    adds its head's), else all epochs of its throughput record."""
    total = record.get("total") or {}
    if "tokens" in total:
        return total["tokens"]
    return sum(e["tokens"] for e in record.get("throughput", {}).get("epochs", []))


def evaluate_snapshot(folder: Path, target, tokenizer, budgets: list[int], prompts: int, tokens: int) -> dict:
    """{"steps", "tokens_seen", "tau": {budget: tau}}, cached in folder/tau.json."""
    from specplug.common.training.evaluate import EvalConfig, evaluate, load_drafter

    cache = folder / "tau.json"
    settings = {"budgets": budgets, "prompts": prompts, "tokens": tokens}
    if cache.is_file() and json.loads(cache.read_text()).get("settings") == settings:
        return json.loads(cache.read_text())
    record = json.loads((folder / "training.json").read_text())
    drafter = load_drafter(folder, target)
    taus = {}
    for budget in budgets:
        report = evaluate(target, tokenizer, drafter, EvalConfig("mtbench", prompts, tokens, budget=budget))
        taus[str(budget)] = report["tau"]
        logger.info("%s budget %d: tau %.3f", folder.name, budget, report["tau"])
    result = {"settings": settings, "steps": record["steps"], "tokens_seen": tokens_seen(record),
              "minutes": record.get("minutes"), "tau": taus}
    cache.write_text(json.dumps(result, indent=2) + "\n")
    return result


def markdown(rows: list[dict], budgets: list[int]) -> str:
    head = "| step | training tokens | minutes | " + " | ".join(f"tau, {b} nodes" for b in budgets) + " |"
    lines = [head, "|" + "---|" * (3 + len(budgets))]
    for r in rows:
        taus = " | ".join(f"{r['tau'][str(b)]:.2f}" for b in budgets)
        lines.append(f"| {r['steps']} | {r['tokens_seen']:,} | {r['minutes']} | {taus} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], budgets: list[int], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for b in budgets:
        ax.plot([r["tokens_seen"] / 1e6 for r in rows], [r["tau"][str(b)] for r in rows], marker="o",
                label=f"{b}-node tree")
    ax.set_xlabel("training tokens seen (millions)")
    ax.set_ylabel("tau (tokens per target pass)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--snapshots", required=True, help="folder of step-NNNNNN head snapshots")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--budgets", default="8,16", help="tree node budgets (root excluded)")
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench prompts")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--md", default=None, help="write the table here")
    parser.add_argument("--png", default=None, help="write the plot here")
    parser.add_argument("--title", default="EAGLE-3 head, reference loop, MT-bench greedy")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    budgets = [int(b) for b in args.budgets.split(",") if b]
    folders = sorted(p for p in Path(args.snapshots).iterdir() if (p / "training.json").is_file())
    if not folders:
        raise SystemExit(f"--snapshots {args.snapshots}: no snapshot folder with a training.json")
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    rows = [evaluate_snapshot(f, target, tokenizer, budgets, args.prompts, args.tokens) for f in folders]
    table = markdown(rows, budgets)
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    if args.png:
        plot(rows, budgets, Path(args.png), args.title)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
