"""Microbenchmark of specplug.common.sampling.verify on this CPU: microseconds per call.

Grid: batch 1/8/64 x tree 8/32/64 nodes x vocab 32k/128k, for greedy (on logits),
rejection target-only (deterministic drafting), rejection target-only without value
checks (validate=False) and rejection with draft probs (SpecInfer). Trees are Medusa
optimal-sparse shapes for the node budget. Combinations whose probability tensors
exceed --mem-cap-gib are skipped and marked so. Prints a markdown table and writes
JSON (+ PNG when matplotlib is installed).

    python bench/bench_core.py                      # full grid, out/bench_core.{json,png}
    python bench/bench_core.py --batch 1 8 --vocab 32000 --repeats 3
    python bench/bench_core.py --threads 1 --clock cpu     # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from specplug.common.sampling import verify
from specplug.common.static_trees import optimal_sparse

logger = logging.getLogger("bench_core")

METHODS = {
    "greedy": dict(method="greedy"),
    "rejection": dict(method="rejection"),
    "rejection_novalidate": dict(method="rejection", validate=False),
    "rejection_draft_probs": dict(method="rejection", draft=True),
}
# Per-head top-k accuracies shaped like Medusa's measurements: falling with depth and rank.
ACCURACIES = [[0.6 * 0.85**h / (r + 1) ** 1.2 for r in range(8)] for h in range(8)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes (default: 1 8 64)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 64],
                    help="tree nodes incl. root (default: 8 32 64)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000], help="vocab sizes (default: 32000 128000)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS), help="default: all")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per cell, median reported (default: 5)")
    ap.add_argument("--mem-cap-gib", type=float, default=1.0,
                    help="skip cells whose [B,N,V] fp32 tensors exceed this (default: 1.0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: 0 = torch's default)")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall or cpu (process) time (default: wall)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    ap.add_argument("--out", default="out/bench_core",
                    help="output path prefix for .json/.png (default: out/bench_core)")
    return ap.parse_args(argv)


def make_inputs(bsz: int, nodes: int, vocab: int, gen: torch.Generator):
    tree, _ = optimal_sparse(ACCURACIES, nodes - 1)
    candidates = torch.randint(0, vocab, (bsz, nodes), generator=gen)
    parents = tree.parents.expand(bsz, nodes).contiguous()
    return candidates, parents


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = "wall"  # set from --clock


def timed(fn, repeats: int) -> float:
    """Median microseconds of ``repeats`` calls after one warm-up call, on CLOCK
    ("cpu" = this process's CPU time: steadier on a shared machine with --threads 1)."""
    clock = CLOCKS[CLOCK]
    fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e6


def bench_cell(bsz, nodes, vocab, methods, repeats, cap_bytes, gen) -> dict:
    cell = {"batch": bsz, "nodes": nodes, "vocab": vocab}
    size = bsz * nodes * vocab * 4
    if size > cap_bytes:
        return cell | {m: None for m in methods} | {"skipped": f"{size / 2**30:.1f} GiB > cap"}
    candidates, parents = make_inputs(bsz, nodes, vocab, gen)
    x = torch.randn(bsz, nodes, vocab, generator=gen)  # logits, then probabilities in place
    if "greedy" in methods:
        cell["greedy"] = timed(lambda: verify(candidates, parents, x, method="greedy"), repeats)
    x.exp_()
    x.div_(x.sum(-1, keepdim=True))
    uniforms = torch.rand(bsz, nodes + 1, generator=gen)
    for name in ("rejection", "rejection_novalidate"):
        if name in methods:
            kw = {k: v for k, v in METHODS[name].items()}
            cell[name] = timed(lambda: verify(candidates, parents, x, uniforms=uniforms, **kw), repeats)
    if "rejection_draft_probs" in methods:
        if 2 * size > cap_bytes:
            cell["rejection_draft_probs"] = None
        else:
            q = torch.softmax(torch.randn(bsz, nodes, vocab, generator=gen), -1)
            cell["rejection_draft_probs"] = timed(
                lambda: verify(candidates, parents, x, q, method="rejection", uniforms=uniforms), repeats
            )
            del q
    return cell


def fmt(v) -> str:
    return "skip" if v is None else f"{v:,.0f}"


def markdown(rows, methods, meta) -> str:
    lines = [
        f"Machine: {meta['machine']}; torch {meta['torch']}, {meta['threads']} thread(s); "
        f"seed {meta['seed']}; median of {meta['repeats']} calls; {meta['clock']}-clock microseconds per "
        f"verify call (1-min load average {meta['load_average']:.1f}) "
        f"(skip = tensors over the {meta['mem_cap_gib']} GiB cap).",
        "",
        "| batch | nodes | vocab | " + " | ".join(methods) + " |",
        "|---:|---:|---:|" + "---:|" * len(methods),
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['nodes']} | {r['vocab']} | "
                     + " | ".join(fmt(r.get(m)) for m in methods) + " |")
    return "\n".join(lines)


def plot(rows, methods, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    vocabs = sorted({r["vocab"] for r in rows})
    fig, axes = plt.subplots(1, len(vocabs), figsize=(6 * len(vocabs), 4), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, vocab in zip(axes[0], vocabs):
        for color, m in enumerate(methods):  # colour = method, line style = batch
            for k, bsz in enumerate(sorted({r["batch"] for r in rows})):
                pts = [(r["nodes"], r[m]) for r in rows if r["vocab"] == vocab and r["batch"] == bsz and r.get(m)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{color}", linestyle=styles[k % 4], label=f"{m} B={bsz}")
        ax.set(title=f"vocab {vocab}", xlabel="tree nodes", ylabel="us per verify", yscale="log")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv=None) -> None:
    global CLOCK
    args = parse_args(argv)
    CLOCK = args.clock
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    cap = int(args.mem_cap_gib * 2**30)
    rows = []
    for vocab in args.vocab:
        for bsz in args.batch:
            for nodes in args.nodes:
                rows.append(bench_cell(bsz, nodes, vocab, args.methods, args.repeats, cap, gen))
                logger.info("%s", rows[-1])
    meta = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "load_average": os.getloadavg()[0],
        "seed": args.seed,
        "repeats": args.repeats,
        "mem_cap_gib": args.mem_cap_gib,
        "tree": "optimal_sparse(Medusa-like accuracies, nodes - 1)",
    }
    table = markdown(rows, args.methods, meta)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if plot(rows, args.methods, out.with_suffix(".png")):
        logger.info("wrote %s.json and %s.png", out, out)


if __name__ == "__main__":
    main()
