"""Microbenchmark of specplug.common.retrieval.RetrievalDrafter: microseconds per draft step.

A step is what a serving engine does per decode step: ``extend`` every request by the
tokens the verifier committed (accepted drafts + bonus, about 2 here) and ``draft`` a
tree for the whole batch. Contexts are synthetic token streams (300-1000 tokens by
default) in which about half the tokens are copied spans, from earlier in the same
stream or from a pool of phrases shared by all requests, and the rest Zipf-distributed
over a 32k vocabulary, so lookups hit and miss as in chat/code output. The "verifier"
accepts the longest tree path that agrees with the stream (not timed). Scenarios: the
request's own tokens only; plus a cache of finished requests; plus a static datastore.
Prints a markdown table and writes JSON (+ PNG when matplotlib is installed).

    python bench/bench_retrieval.py                           # out/bench_retrieval.{json,png}
    python bench/bench_retrieval.py --batch 1 8 64 --steps 100
    python bench/bench_retrieval.py --clock cpu               # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import time
from pathlib import Path

from specplug.common.retrieval import RetrievalConfig, RetrievalDrafter, build_datastore

logger = logging.getLogger("bench_retrieval")
VOCAB = 32000
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch sizes (default: 1 64)")
    ap.add_argument("--context", type=int, nargs=2, default=[300, 1000],
                    help="context length range (default: 300 1000)")
    ap.add_argument("--steps", type=int, default=50, help="timed draft steps per cell (default: 50)")
    ap.add_argument("--cache-requests", type=int, default=256, help="finished requests in the cache (default: 256)")
    ap.add_argument("--datastore-tokens", type=int, default=1_000_000, help="static datastore size (default: 1000000)")
    ap.add_argument("--budget", type=int, default=RetrievalConfig.budget,
                    help=f"draft nodes (default: {RetrievalConfig.budget})")
    ap.add_argument("--clock", choices=list(CLOCKS), default="wall",
                    help="wall or cpu (process) time; cpu is steadier on a shared machine (default: wall)")
    ap.add_argument("--seed", type=int, default=0, help="RNG seed (default: 0)")
    ap.add_argument("--out", default="out/bench_retrieval",
                    help="output path prefix for .json/.png (default: out/bench_retrieval)")
    return ap.parse_args(argv)


def zipf_token(rng: random.Random) -> int:
    return min(int(rng.paretovariate(1.1)), VOCAB - 1)


def stream(rng: random.Random, length: int, pool: list[list[int]]) -> list[int]:
    """Synthetic output: copied spans (own history or the shared pool) and Zipf tokens."""
    out: list[int] = []
    while len(out) < length:
        r = rng.random()
        if r < 0.25 and len(out) > 40:
            start = rng.randrange(len(out) - 30)
            out += out[start:start + rng.randint(3, 30)]
        elif r < 0.5:
            phrase = rng.choice(pool)
            start = rng.randrange(len(phrase))
            out += phrase[start:start + rng.randint(3, 30)]
        else:
            out += [zipf_token(rng) for _ in range(rng.randint(1, 6))]
    return out[:length]


def accepted_length(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Draft tokens a greedy verifier accepts: the longest tree path equal to truth's prefix."""
    node, depth = 0, 0
    while depth < len(truth):
        nxt = next((i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def make_drafter(scenario: str, args, rng: random.Random, pool) -> RetrievalDrafter:
    cfg = RetrievalConfig(budget=args.budget, cache_requests=args.cache_requests if scenario != "own" else 0)
    store = None
    if scenario == "own+cache+datastore":
        sequences, total = [], 0
        while total < args.datastore_tokens:
            sequences.append(stream(rng, 1000, pool))
            total += 1000
        store = build_datastore(sequences)
    drafter = RetrievalDrafter(cfg, datastore=store)
    if scenario != "own":
        for i in range(args.cache_requests):
            drafter.prefill(("done", i), stream(rng, rng.randint(*args.context), pool))
            drafter.free(("done", i))
    return drafter


def prefill_batch(drafter: RetrievalDrafter, ids, args, rng: random.Random, pool, clock):
    """Prefill every request with a synthetic context; -> (streams, cursors, seconds, tokens)."""
    truths, cursor, seconds = [], [], 0.0
    for rid in ids:
        ctx = rng.randint(*args.context)
        truths.append(stream(rng, ctx + args.steps * (args.budget + 1) + 1, pool))
        cursor.append(ctx)
        start = clock()
        drafter.prefill(rid, truths[-1][:ctx])
        seconds += clock() - start
    return truths, cursor, seconds, sum(cursor)


def verify(batch, truths, cursor) -> tuple[list[list[int]], int, int]:
    """The committed tokens of each request (accepted + bonus; advances cursor), draft nodes, accepted."""
    commits, nodes, accepted = [], 0, 0
    for b in range(len(truths)):
        n = int(batch.num_nodes[b])
        a = accepted_length(batch.candidates[b, :n].tolist(), batch.parents[b, :n].tolist(), truths[b][cursor[b]:])
        commits.append(truths[b][cursor[b]:cursor[b] + a + 1])
        cursor[b] += a + 1
        nodes, accepted = nodes + n - 1, accepted + a
    return commits, nodes, accepted


def run_cell(drafter: RetrievalDrafter, bsz: int, args, rng: random.Random, pool) -> dict:
    """Time ``args.steps`` draft steps (draft + extend) of ``bsz`` requests, then free them."""
    clock = CLOCKS[args.clock]
    ids = [("live", bsz, b) for b in range(bsz)]
    truths, cursor, prefill_s, prefilled = prefill_batch(drafter, ids, args, rng, pool, clock)
    draft_s, extend_s, nodes, accepted = [], [], 0, 0
    for _ in range(args.steps):
        start = clock()
        batch, _ = drafter.draft_scored(ids)
        draft_s.append(clock() - start)
        commits, step_nodes, step_accepted = verify(batch, truths, cursor)
        nodes, accepted = nodes + step_nodes, accepted + step_accepted
        start = clock()
        for rid, tokens in zip(ids, commits):
            drafter.extend(rid, tokens)
        extend_s.append(clock() - start)
    start = clock()
    for rid in ids:
        drafter.free(rid)
    free_s = clock() - start
    draft_us, extend_us = 1e6 * statistics.median(draft_s), 1e6 * statistics.median(extend_s)
    return {"batch": bsz, "step_us": draft_us + extend_us, "per_request_us": (draft_us + extend_us) / bsz,
            "draft_us": draft_us, "extend_us": extend_us, "nodes": nodes / (bsz * args.steps),
            "tau": 1 + accepted / (bsz * args.steps), "prefill_us_per_token": 1e6 * prefill_s / prefilled,
            "free_us_per_request": 1e6 * free_s / bsz}


def table(rows: list[dict], args) -> str:
    head = (f"machine: {platform.machine()} {os.cpu_count()} cores, {platform.python_implementation()} "
            f"{platform.python_version()}; synthetic contexts {args.context[0]}-{args.context[1]} tokens, vocab "
            f"{VOCAB}; budget {args.budget}; cache {args.cache_requests} requests; datastore "
            f"{args.datastore_tokens} tokens; {args.steps} steps; seed {args.seed}; {args.clock} clock, medians\n\n")
    lines = ["| scenario | batch | µs / step | µs / request / step | draft µs | extend µs | nodes | τ "
             "| prefill µs / token | free µs / request |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['batch']} | {r['step_us']:.0f} | {r['per_request_us']:.1f} | "
                     f"{r['draft_us']:.0f} | {r['extend_us']:.0f} | {r['nodes']:.2f} | {r['tau']:.2f} | "
                     f"{r['prefill_us_per_token']:.2f} | {r['free_us_per_request']:.0f} |")
    return head + "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        sub = [r for r in rows if r["scenario"] == scenario]
        ax.plot([r["batch"] for r in sub], [r["per_request_us"] for r in sub], marker="o", label=scenario)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("µs per request per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for scenario in ("own", "own+cache", "own+cache+datastore"):
        rng = random.Random(args.seed)
        pool = [[zipf_token(rng) for _ in range(rng.randint(10, 60))] for _ in range(2000)]
        drafter = make_drafter(scenario, args, rng, pool)
        for bsz in args.batch:
            rows.append({"scenario": scenario, **run_cell(drafter, bsz, args, rng, pool)})
    text = table(rows, args)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
