"""Times the fused CUDA verify kernel against the torch path and the bandwidth floor.

For each (method, batch, nodes, vocab): the kernel's device time per call (CUDA-graph
replays, inputs rotated so the logits come from HBM, not L2) under both schedules
("rows", "path") and the automatic choice; the end-to-end call time of
``sampling.verify`` with the kernel and with the torch path (SPECPLUG_CUDA=0); and the
floor = bytes of target (and draft) probabilities / HBM bandwidth measured in this run
by a device-to-device copy. Trees are Medusa optimal-sparse shapes with tokens planted
so that paths are accepted several levels deep. Prints a markdown table and writes
JSON (+ PNG when matplotlib is installed). Needs a CUDA GPU.

    python bench/gpu_bench.py                               # full grid, out/gpu_bench.*
    python bench/gpu_bench.py --batch 1 --nodes 8 --vocab 32000 --methods greedy
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.cuda.cases (test support)

from specplug.common import sampling as S  # noqa: E402
from specplug.common.cuda import dispatch, load_extension  # noqa: E402
from specplug.common.static_trees import optimal_sparse  # noqa: E402
from specplug.common.tree import stack_trees, tree_depths  # noqa: E402
from specplug.common.verify_result import VerifyResult  # noqa: E402
from tests.cuda.cases import Trees, plant  # noqa: E402

ACCURACIES = [[0.6 * 0.85**h / (r + 1) ** 1.2 for r in range(8)] for h in range(8)]  # Medusa-like
METHODS = ("greedy", "target_only", "draft")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes (default: 1 8 64)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 64], help="tree nodes incl. root (default: 8 64)")
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256], help="vocab sizes (default: 32000 128256)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS, help="default: all")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="logits / probs dtype (default: bf16)")
    ap.add_argument("--replays", type=int, default=50, help="graph replays per device timing (default: 50)")
    ap.add_argument("--calls", type=int, default=10, help="end-to-end calls per path, median (default: 10)")
    ap.add_argument("--seed", type=int, default=0, help="default: 0")
    ap.add_argument("--out", default="out/gpu_bench", help="output path without suffix (default: out/gpu_bench)")
    return ap.parse_args(argv)


def measure_bandwidth(gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def make_case(method: str, batch: int, nodes: int, vocab: int, dtype, gen: torch.Generator):
    """Inputs on the GPU: trees (optimal-sparse shape, planted tokens), target (and draft), uniforms."""
    tree, _ = optimal_sparse(ACCURACIES, nodes - 1)  # budget excludes the root
    stacked = stack_trees([tree] * batch)
    logits = torch.randn(batch, nodes, vocab, device="cuda", dtype=torch.float32) * 4
    if method == "greedy":
        target, draft, method_name = logits.to(dtype), None, "greedy"
        follow = target.float().argmax(-1)
    else:
        target = torch.softmax(logits, -1).to(dtype)
        method_name = "rejection"
        draft = None
        follow = logits.argmax(-1)
        if method == "draft":
            noisy = logits + torch.randn_like(logits)
            draft = torch.softmax(noisy, -1).to(dtype)
            follow = noisy.argmax(-1)
    tokens = torch.randint(0, vocab, stacked.candidates.shape, generator=gen)
    trees = Trees(tokens, stacked.parents, stacked.num_nodes)
    trees = plant(gen, trees, follow.cpu(), rate=0.8, duplicate_rate=0.0)
    uniforms = torch.rand(batch, nodes + 1, device="cuda")
    cand, par, num = (t.cuda() for t in trees)
    return dict(candidates=cand, parents=par, target_probs=target, draft_probs=draft, method=method_name,
                num_nodes=num, uniforms=None if method == "greedy" else uniforms,
                max_depth=int(tree_depths(par).max()))


def call_kernel(case):
    return dispatch.try_verify(case["candidates"], case["parents"], case["target_probs"], case["draft_probs"],
                               method=case["method"], num_nodes=case["num_nodes"], uniforms=case["uniforms"],
                               max_depth=case["max_depth"])


def device_us(cases, replays: int, mode: str | None) -> float:
    """Device time per kernel call: CUDA graphs (one per input copy) replayed round-robin."""
    if mode:
        os.environ[dispatch.MODE_ENV] = mode
    try:
        graphs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for case in cases:
                call_kernel(case)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        for case in cases:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                call_kernel(case)
            graphs.append(g)
        for g in graphs:
            g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(replays):
            graphs[i % len(graphs)].replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / replays
    finally:
        os.environ.pop(dispatch.MODE_ENV, None)


def call_us(case, calls: int, torch_path: bool) -> tuple[float, VerifyResult]:
    """End-to-end sampling.verify time (median of `calls`, synchronised), and its result."""
    if torch_path:
        os.environ[dispatch.DISABLE_ENV] = "0"
    try:
        args = dict(method=case["method"], num_nodes=case["num_nodes"], uniforms=case["uniforms"], validate=False)
        run = lambda: S.verify(case["candidates"], case["parents"], case["target_probs"],  # noqa: E731
                               case["draft_probs"], **args)
        result = run()
        times = []
        for _ in range(calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times), result
    finally:
        os.environ.pop(dispatch.DISABLE_ENV, None)


def bench_cell(method, batch, nodes, vocab, dtype, args, bandwidth, gen) -> dict:
    elem = torch.tensor([], dtype=dtype).element_size()
    read = batch * nodes * vocab * elem * (2 if method == "draft" else 1)
    copies = max(1, min(8, math.ceil(256 * 2**20 / read)))  # >= 256 MB in rotation: beyond L2
    cases = [make_case(method, batch, nodes, vocab, dtype, gen) for _ in range(copies)]
    row = dict(method=method, batch=batch, nodes=nodes, vocab=vocab, dtype=str(dtype).split(".")[-1],
               mbytes=read / 1e6, floor_us=read / bandwidth * 1e6, copies=copies)
    schedules = ["path"] if method == "draft" else ["rows", "path"]
    for mode in schedules:
        row[f"{mode}_us"] = device_us(cases, args.replays, mode)
    row["auto_mode"] = "path" if method == "draft" else (
        "path" if batch * nodes >= dispatch.SCHEDULE.path_min_rows else "rows")
    row["auto_us"] = row[f"{row['auto_mode']}_us"]
    row["auto_x_floor"] = row["auto_us"] / row["floor_us"]
    row["kernel_call_us"], got = call_us(cases[0], args.calls, torch_path=False)
    row["torch_call_us"], ref = call_us(cases[0], args.calls, torch_path=True)
    row["speedup_vs_torch"] = row["torch_call_us"] / row["kernel_call_us"]
    same = torch.ones(batch, dtype=torch.bool, device="cuda")
    for a, b in zip(got, ref):
        same &= (a == b).reshape(batch, -1).all(-1) if a.shape == b.shape else torch.zeros_like(same)
    row["agree_with_torch_cuda"] = float(same.float().mean())
    row["accepted_mean"] = float(got.num_accepted.float().mean())
    return row


def markdown(rows, meta) -> str:
    head = ("| method | B | N | V | MB read | floor µs | rows µs | path µs | auto | auto / floor | "
            "kernel call µs | torch call µs | speed-up | accepted | agree |")
    lines = [f"GPU: {meta['gpu']}; torch {meta['torch']}; CUDA {meta['cuda']}; dtype {meta['dtype']}; "
             f"copy bandwidth {meta['bandwidth_gbs']:.0f} GB/s (floor uses it); seed {meta['seed']}; "
             "Medusa optimal-sparse trees, tokens planted (rate 0.8)", "", head, "|" + " --- |" * 15]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['batch']} | {r['nodes']} | {r['vocab']} | {r['mbytes']:.1f} | {r['floor_us']:.1f} | "
            f"{r.get('rows_us', float('nan')):.1f} | {r['path_us']:.1f} | {r['auto_mode']} | "
            f"{r['auto_x_floor']:.2f}x | {r['kernel_call_us']:.0f} | {r['torch_call_us']:.0f} | "
            f"{r['speedup_vs_torch']:.1f}x | {r['accepted_mean']:.2f} | {r['agree_with_torch_cuda']:.3f} |")
    return "\n".join(lines)


def write_outputs(rows, meta, out: Path) -> None:
    out.with_suffix(".md").write_text(markdown(rows, meta) + "\n")
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


def plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['method'][:6]} B{r['batch']} N{r['nodes']} V{r['vocab'] // 1000}k" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["auto_x_floor"] for r in rows], 0.4, label="kernel / floor")
    ax.bar([x + 0.2 for x in xs], [r["speedup_vs_torch"] for r in rows], 0.4, label="torch call / kernel call")
    ax.set_yscale("log")
    ax.axhline(1.5, color="k", lw=0.5, ls="--")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    build = load_extension()
    if build.module is None:
        print(f"gpu_bench: the extension did not build: {build.error}", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    bandwidth = measure_bandwidth()
    dtype = DTYPES[args.dtype]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                dtype=args.dtype, bandwidth_gbs=bandwidth / 1e9, seed=args.seed, host=platform.node(),
                schedule=vars(dispatch.SCHEDULE))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods:
        for batch in args.batch:
            for nodes in args.nodes:
                for vocab in args.vocab:
                    rows.append(bench_cell(method, batch, nodes, vocab, dtype, args, bandwidth, gen))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                    write_outputs(rows, meta, out)  # after every cell: a cut run keeps its numbers
                    torch.cuda.empty_cache()
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
