"""`specplug bench`: speed-up and acceptance of speculation against the same engine
without it, every method measured side by side in one run.

The engine-specific part is a runner (`specplug.vllm_eagle3.bench_runner`,
`specplug.sglang_medusa.bench_runner`) that turns (method, prompts, batch size) into a
`RunResult`; everything else — prompt sets, the loop over batch sizes, the markdown
table, the JSON with every number and the PNG plot — lives here, once.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from specplug.bench_types import ENGINES, RunResult

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES = (1, 4, 16, 64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=["auto", *ENGINES, "both"], default="auto",
                        help="engine to drive; auto = the one installed in this Python")
    parser.add_argument("--model", default=None,
                        help="target model folder (default: the test bed's SmolLM2-135M-Instruct)")
    parser.add_argument("--head", default=None,
                        help="draft head folder (default: the committed test-bed head for the engine's method)")
    parser.add_argument("--draft-model", default=None,
                        help="a draft model folder (a small causal LM with the target's tokenizer, e.g. from "
                             "`specplug draft-model cut`): adds the methods draft-model (SGLang: specplug's "
                             "DRAFT_MODEL), draft_model (vLLM's built-in) and specplug-draft-model (vLLM: the head's "
                             "tree merged with the draft model's)")
    parser.add_argument("--medusa-head", default=None, metavar="DIR",
                        help="vLLM: Medusa heads in any format specplug reads ('testbed' = the committed "
                             "heads/smollm2-medusa), converted to vLLM's for the run: adds the methods medusa "
                             "(vLLM's own top-1 chain), specplug-medusa (stage chain) and specplug-medusa-tree "
                             "(the Medusa tree verified in one pass). SGLang takes Medusa heads as --head")
    parser.add_argument("--self-spec-layers", default=None, metavar="LAYERS",
                        help="the target's own layers to self-speculate with, e.g. 0-7 (specplug's \"self_spec\" "
                             "drafter, on the weights the engine loaded): adds the methods self-spec (SGLang: "
                             "SELF_SPEC) and specplug-self-spec (vLLM: the head's tree merged with the self_spec "
                             "drafter's)")
    parser.add_argument("--prompts", default="mtbench",
                        help="prompt set: mtbench, humaneval or sharegpt; 'mtbench:coding' picks a category")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="prompts per batch-size run (at least the batch size is used)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                        help="comma-separated batch sizes")
    parser.add_argument("--methods", default=None,
                        help="comma-separated methods (default: all the engine offers: none, built-ins, specplug)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (per request: seed + index)")
    parser.add_argument("--unseeded", action="store_true",
                        help="vLLM: requests carry no seed (--seed seeds the engine only); specplug's sampled "
                             "drafts (specplug-sampled) serve unseeded requests only")
    parser.add_argument("--interleave", type=int, default=0, metavar="N",
                        help="methods take turns N prompts at a time, each in its own process holding its "
                             "engine, so a host whose speed drifts slows every method alike (ratios you can "
                             "trust on a shared or throttling machine; needs memory for one engine per "
                             "method); 0 = one method after another")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the target over N ranks (vLLM: the multiprocess executor, the head sharded too; "
                             "a head whose draft vocabulary does not shard: specplug convert HEAD NEW --to eagle3 "
                             "--tensor-parallel-size N. SGLang: --tp-size N, specplug's heads replicated). On a CPU "
                             "each rank is bound to a core round robin unless VLLM_CPU_OMP_THREADS_BIND / "
                             "SGLANG_CPU_OMP_THREADS_BIND is set")
    parser.add_argument("--adaptive", action="store_true",
                        help="turn on adaptive (batch-aware) speculation for specplug methods")
    parser.add_argument("--out", default="bench-results", help="folder for the JSON and PNG")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of the markdown table")


def run(args: argparse.Namespace) -> int:
    engines = _engines(args.engine)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": _meta(args, batch_sizes), "results": []}
    for engine in engines:
        runner = importlib.import_module(ENGINES[engine][1]).make_runner(args)
        try:
            report["meta"][f"{engine}_version"] = runner.version
            prompts = load_prompts(args, runner)
            methods = args.methods.split(",") if args.methods else runner.methods()
            for method in methods:
                getattr(runner, "check_method", lambda _: None)(method)
            if args.interleave > 0:
                results = interleaved(engine, args, methods, prompts, batch_sizes)
            else:
                results = sweep(runner, methods, prompts, batch_sizes, args.num_prompts)
            same = identical_to_none(results)
            report["results"] += [{"engine": engine, **summarise(r), "identical_to_none": same[i]}
                                  for i, r in enumerate(results)]
        finally:
            runner.close()
    add_speedups(report["results"])
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "bench.png")
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}", file=sys.stderr)
    return 0


def _engines(choice: str) -> list[str]:
    installed = [e for e, (mod, _) in ENGINES.items() if importlib.util.find_spec(mod) is not None]
    wanted = list(ENGINES) if choice == "both" else installed[:1] if choice == "auto" else [choice]
    missing = [e for e in wanted if e not in installed]
    if not wanted or missing:
        name = ", ".join(missing) or "vllm or sglang"
        raise SystemExit(
            f"specplug bench: {name} is not installed in this Python ({sys.executable}). "
            f"Install it with pip install 'specplug[vllm]' / 'specplug[sglang]', or run the bench "
            f"from the engine's environment: source scripts/envs.sh; $(ensure_env vllm)/bin/specplug bench")
    return wanted


def load_prompts(args: argparse.Namespace, runner) -> list[str]:
    """Chat-formatted prompt texts of the chosen set (and category), enough for the largest batch."""
    from specplug.common.training import data

    name, _, category = args.prompts.partition(":")
    need = max(args.num_prompts, *(int(b) for b in args.batch_sizes.split(",") if b))
    chosen = data.prompts(name, runner.tokenizer, category=category or None)
    if not chosen:
        raise SystemExit(f"specplug bench: prompt set {args.prompts!r} is empty")
    texts = [p.text for p in chosen]
    return [texts[i % len(texts)] for i in range(need)]


def sweep(runner, methods: Sequence[str], prompts: Sequence[str], batch_sizes: Sequence[int],
          num_prompts: int) -> list[RunResult]:
    """Every method at every batch size, in one process so the ratios share conditions.

    Methods are outermost (one engine start each); the runner's `run_last` methods
    (e.g. vLLM's ngram, whose numba import breaks later in-process engines) go last.
    """
    from tqdm import tqdm

    last = set(getattr(runner, "run_last", ()))
    late = [m for m in methods if m.partition(":")[0] in last]  # "ngram:8" runs late as "ngram" does
    if len(late) > 1:
        raise SystemExit(f"specplug bench: {', '.join(late)} cannot share one process (each breaks the next "
                         "in-process engine); compare them with --interleave N, which runs every method in its "
                         "own process")
    ordered = [m for m in methods if m not in late] + late
    results = []
    with tqdm(total=len(ordered) * len(batch_sizes), desc=f"bench {runner.engine}", unit="run") as bar:
        for method in ordered:
            for batch in batch_sizes:
                bar.set_postfix_str(f"{method} bs{batch}")
                chunk = list(prompts[:max(num_prompts, batch)])
                results.append(runner.run(method, chunk, batch))
                bar.update()
    return results


def interleaved(engine: str, args: argparse.Namespace, methods: Sequence[str], prompts: Sequence[str],
                batch_sizes: Sequence[int]) -> list[RunResult]:
    """`sweep` with the methods taking turns `args.interleave` prompts at a time (bench_rounds)."""
    from tqdm import tqdm

    from specplug import bench_rounds

    bench_rounds.check_memory(engine, methods)
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"engine logs: {logs}/{engine}-METHOD.log", file=sys.stderr)
    workers = {m: bench_rounds.MethodWorker(engine, args, m, str(logs / f"{engine}-{m}.log")) for m in methods}
    total = sum(len(methods) * len(bench_rounds.rounds(prompts[:max(args.num_prompts, b)], args.interleave, b))
                for b in batch_sizes)
    try:
        with tqdm(total=total, desc=f"bench {engine} (interleaved)", unit="turn") as bar:
            def progress(method, batch, r):
                bar.set_postfix_str(f"{method} bs{batch} round {r + 1}")
                bar.update()
            return bench_rounds.sweep_interleaved({m: w.run for m, w in workers.items()}, prompts,
                                                  batch_sizes, args.num_prompts, args.interleave, progress)
    finally:
        for w in workers.values():
            w.close()


def summarise(r: RunResult) -> dict:
    row = {k: v for k, v in asdict(r).items() if k != "outputs"}
    row.update(tok_per_s=r.tok_per_s, tau=r.tau, acceptance_by_pos=r.acceptance_by_pos)
    return row


def identical_to_none(results: Sequence[RunResult]) -> list[float | None]:
    """Per result, the fraction of its outputs token-identical to `none` at the same batch.

    At temperature 0 speculation must give 1.0 (lossless); at T > 0 it is informative only.
    """
    base = {r.batch_size: r.outputs for r in results if r.method == "none"}
    fractions = []
    for r in results:
        ref = base.get(r.batch_size)
        if not ref or not r.outputs:
            fractions.append(None)
            continue
        fractions.append(sum(a == b for a, b in zip(r.outputs, ref)) / len(ref))
    return fractions


def add_speedups(rows: list[dict]) -> None:
    """speedup = tok/s over the same engine's `none` run at the same batch size; for
    interleaved runs also round_speedups, the same ratio round by round."""
    base = {(r["engine"], r["batch_size"]): r for r in rows if r["method"] == "none"}
    for r in rows:
        ref = base.get((r["engine"], r["batch_size"]))
        r["speedup"] = r["tok_per_s"] / ref["tok_per_s"] if ref and ref["tok_per_s"] else None
        r["round_speedups"] = round_speedups(r, ref) if ref is not None and r is not ref else None


def round_speedups(row: dict, none: dict) -> list[float] | None:
    """Per interleaved round, the row's tok/s over `none`'s in the same round: the same
    prompts, run back to back, so their spread shows how far the host's noise moves one
    ratio. None without rounds (or with a round that timed nothing)."""
    mine, base = row.get("rounds") or [], none.get("rounds") or []
    pairs = list(zip(mine, base))
    if not pairs or len(mine) != len(base) or any(s <= 0 or bs <= 0 or bt <= 0 for (_, s), (bt, bs) in pairs):
        return None
    return [(t / s) / (bt / bs) for (t, s), (bt, bs) in pairs]


def _meta(args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    import torch

    return {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
            "device": "cuda" if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "model": args.model or "test bed SmolLM2-135M-Instruct", "head": args.head,
            "prompts": args.prompts, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "batch_sizes": batch_sizes,
            "temperature": args.temperature, "seed": args.seed, "unseeded": getattr(args, "unseeded", False),
            "adaptive": args.adaptive, "interleave": getattr(args, "interleave", 0),
            "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECPLUG_")}}


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"machine: {m['machine']} ({m['device']}); model: {m['model']}; prompts: {m['prompts']} "
             f"x{m['num_prompts']}, {m['max_new_tokens']} new tokens; T={m['temperature']}; "
             f"{'unseeded requests' if m.get('unseeded') else 'seed ' + str(m['seed'])}"
             + (f"; tensor_parallel_size {m['tensor_parallel_size']}" if m.get("tensor_parallel_size", 1) > 1 else "")
             + "".join(f"; {k}={v}" for k, v in m.get("environment", {}).items()),
             "", "| engine | batch | method | tok/s | speed-up | tau | accepted by position | draft / verify time "
             "| same as none |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        pos = " ".join(f"{a:.2f}" for a in r["acceptance_by_pos"][:8]) or "-"
        share = "-"
        if r["draft_seconds"] is not None and r["verify_seconds"] is not None and r["seconds"]:
            share = f"{r['draft_seconds'] / r['seconds']:.0%} / {r['verify_seconds'] / r['seconds']:.0%}"
        spread = r.get("round_speedups")
        speedup = _fmt(r["speedup"], ".2f") + "x" + (f" ({min(spread):.2f}-{max(spread):.2f})" if spread else "")
        lines.append(f"| {r['engine']} | {r['batch_size']} | {r['method']} | {r['tok_per_s']:.1f} | "
                     f"{speedup} | {_fmt(r['tau'], '.2f')} | {pos} | {share} | "
                     f"{_fmt(r.get('identical_to_none'), '.0%')} |")
    if any(r.get("round_speedups") for r in report["results"]):
        lines += ["", "speed-up (a-b): the lowest and highest of the per-round ratios (each round runs the method "
                      "and none on the same prompts, back to back); a speed-up inside the range that holds 1.00 "
                      "is not told apart from no change by this run."]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Speed-up vs batch size per method, and acceptance by draft position at the smallest batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    keys = sorted({(r["engine"], r["method"]) for r in rows})
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {key: cycle[i % len(cycle)] for i, key in enumerate(keys)}  # same colour in both panels
    for key in keys:
        pts = sorted((r["batch_size"], r["speedup"], r.get("round_speedups")) for r in rows
                     if (r["engine"], r["method"]) == key and r["speedup"] is not None)
        if pts:
            left.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color[key],
                      label=f"{key[0]} {key[1]}")
        spread = [(b, s, min(rs), max(rs)) for b, s, rs in pts if rs]
        if spread:  # interleaved rounds: the lowest and highest per-round ratio
            left.errorbar([p[0] for p in spread], [p[1] for p in spread], fmt="none", ecolor=color[key], capsize=3,
                          yerr=[[s - lo for _, s, lo, _ in spread], [hi - s for _, s, _, hi in spread]])
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    batches = sorted({r["batch_size"] for r in rows}) or [1]
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    left.minorticks_off()
    left.set(xlabel="batch size", ylabel="speed-up vs no speculation", title="Speed-up by batch size")
    left.legend(fontsize=8)
    smallest = min((r["batch_size"] for r in rows), default=1)
    for r in rows:
        if r["batch_size"] == smallest and r["acceptance_by_pos"]:
            acc = r["acceptance_by_pos"]
            right.plot(range(1, len(acc) + 1), acc, marker="o", color=color[(r["engine"], r["method"])],
                       label=f"{r['engine']} {r['method']}")
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set(xlabel="draft position", ylabel="fraction of steps accepted", ylim=(0, 1.05),
              title=f"Acceptance by position (batch {smallest})")
    if right.lines:
        right.legend(fontsize=8)
    fig.suptitle(f"{report['meta']['model']} — {report['meta']['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
