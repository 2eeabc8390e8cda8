"""One table and one figure from several `specplug bench` runs: what a user can expect from
each method at each batch size and temperature (docs/benchmarks.md, "What to expect").

    python bench/expectations.py RUN_DIR... --png docs/img/expectations.png

Each RUN_DIR holds a bench.json (one engine, one temperature; several runs of one engine at
one temperature, e.g. SGLang's methods split over two runs for memory, are merged, each
keeping its ratio to its own run's `none`). Prints the markdown table: one row per (engine,
temperature, method), the speed-up over no speculation at each batch size, the tokens per
step at the smallest batch and the share of outputs identical to `none`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SAMPLED = "sampled"  # a row's identity column at T > 0: seeded outputs are compared in the run, not asserted


def load(dirs: list[str]) -> list[dict]:
    """Every result row of the runs, with its run's temperature; `none` from the first run
    of each (engine, temperature) only."""
    rows, seen = [], set()
    for d in dirs:
        report = json.loads((Path(d) / "bench.json").read_text())
        temperature = report["meta"]["temperature"]
        engines = {r["engine"] for r in report["results"]}
        rows += [{**r, "temperature": temperature} for r in report["results"]
                 if r["method"] != "none" or (r["engine"], temperature) not in seen]
        seen |= {(engine, temperature) for engine in engines}
    return rows


def groups(rows: list[dict]) -> dict[tuple, dict[int, dict]]:
    """(engine, temperature, method) -> {batch size: row}, in first-seen order."""
    out: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        out.setdefault((r["engine"], r["temperature"], r["method"]), {})[r["batch_size"]] = r
    return out


def markdown(rows: list[dict]) -> str:
    batches = sorted({r["batch_size"] for r in rows})
    head = ("| engine | T | method | " + " | ".join(f"bs {b}" for b in batches)
            + " | tau (bs 1) | same as none |")
    lines = [head, "|" + "---|" * (len(batches) + 5)]
    for (engine, temperature, method), by_batch in groups(rows).items():
        cells = [("-" if b not in by_batch else f"{by_batch[b]['tok_per_s']:.0f} tok/s" if method == "none"
                  else f"{by_batch[b]['speedup']:.2f}x" if by_batch[b]["speedup"] else "-") for b in batches]
        first = by_batch[min(by_batch)]
        tau = f"{first['tau']:.2f}" if first.get("tau") else "-"
        same = [r["identical_to_none"] for r in by_batch.values() if r.get("identical_to_none") is not None]
        identity = (f"{min(same):.0%}" if same else "-") if temperature == 0 else SAMPLED
        lines.append(f"| {engine} | {temperature:g} | {method} | " + " | ".join(cells) + f" | {tau} | {identity} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """One panel per (engine, temperature): speed-up against batch size, one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["engine"], r["temperature"]) for r in rows})
    engines = sorted({e for e, _ in panels})
    temperatures = sorted({t for _, t in panels})
    fig, axes = plt.subplots(len(engines), len(temperatures), figsize=(5.5 * len(temperatures), 4 * len(engines)),
                             squeeze=False, sharey=True)
    batches = sorted({r["batch_size"] for r in rows})
    for (engine, temperature, method), by_batch in groups(rows).items():
        ax = axes[engines.index(engine)][temperatures.index(temperature)]
        pts = sorted((b, r["speedup"]) for b, r in by_batch.items() if r["speedup"])
        ax.plot(*zip(*pts), marker="o", label=method, ls="--" if method == "none" else "-")
    for i, engine in enumerate(engines):
        for j, temperature in enumerate(temperatures):
            ax = axes[i][j]
            ax.axhline(1.0, color="grey", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.minorticks_off()
            ax.set(title=f"{engine}, T = {temperature:g}", xlabel="batch size", ylabel="speed-up vs none")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders holding a bench.json each")
    parser.add_argument("--png", default=None, help="write the figure here")
    args = parser.parse_args()
    rows = load(args.runs)
    print(markdown(rows))
    if args.png:
        plot(rows, Path(args.png))


if __name__ == "__main__":
    main()
