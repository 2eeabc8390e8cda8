"""Times the stage-tree Triton kernel against dense attention with an equivalent mask.

For each shape (batch, context, tree nodes): one random tree per request (node i's parent
uniform over 0..i-1) after a committed prefix of `context` tokens, in a paged KV cache with
shuffled block tables (tests/support/tree_attention_cases.py). Columns:

- kernel µs: ``tree_attention_triton.tree_attention`` over the paged cache;
- sdpa µs: ``F.scaled_dot_product_attention`` over the same keys and values already gathered
  into contiguous [B, heads, S, D] (KV heads repeated to the query heads), with the dense bool
  mask [B, 1, n, S] (each row: the prefix, its ancestors and itself);
- gather + sdpa µs: the same plus the gather out of the paged cache (and the repeat);
- max |kernel - sdpa|: both outputs compared in float32.

Times are medians of --reps calls after one warm-up call (which compiles the kernel), CUDA
events around each call. Prints a markdown table and writes OUT.md and OUT.json.

    python bench/gpu_tree_attention.py                       # the default shapes, bf16, on CUDA
    python bench/gpu_tree_attention.py --device cpu          # tiny shapes under Triton's interpreter

``--device cpu`` sets TRITON_INTERPRET=1 before Triton loads and runs float32 on CPU tensors:
a dry run of this script, whose timings say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.support (test support)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (batch, context, nodes) and model shape per device
DEFAULTS = {
    "cuda": dict(shapes=["1x1024x64", "8x1024x32", "32x2048x16", "8x4096x64"], heads=32, kv_heads=8, dim=128,
                 dtype="bf16", reps=20),
    "cpu": dict(shapes=["2x20x8", "3x40x12"], heads=4, kv_heads=2, dim=32, dtype="fp32", reps=1),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default) or cpu: tiny shapes under Triton's interpreter, a dry run")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="BATCHxCONTEXTxNODES each (default cuda: 1x1024x64 8x1024x32 32x2048x16 8x4096x64; "
                         "cpu: 2x20x8 3x40x12)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default cuda 32, cpu 4)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default cuda 8, cpu 2)")
    ap.add_argument("--dim", type=int, default=None, help="head dim (default cuda 128, cpu 32)")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="default cuda bf16, cpu fp32")
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block size (default: 16)")
    ap.add_argument("--tile", type=int, default=32, help="the kernel's key tile (default: 32)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per column, median (default cuda 20, cpu 1)")
    ap.add_argument("--seed", type=int, default=0, help="default: 0")
    ap.add_argument("--out", default="out/gpu_tree_attention", help="output path without suffix")
    args = ap.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def shape_of(text: str) -> tuple[int, int, int]:
    try:
        batch, context, nodes = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes takes BATCHxCONTEXTxNODES, e.g. 8x1024x32; got {text!r}") from None
    return batch, context, nodes


def timed_us(fn, reps: int, device: str) -> float:
    """Median microseconds of fn() over reps calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e6)
    return statistics.median(times)


def gathered(case: dict, context: int, nodes: int):
    """(q [B, H, n, D], k / v [B, H, S, D] contiguous, mask Bool [B, 1, n, S]) of one pass."""
    from tests.support.tree_attention_cases import visible

    key_cache, value_cache = case["key_cache"], case["value_cache"]
    block_size = key_cache.shape[1]
    batch = len(case["parents"])
    positions = torch.arange(context + nodes, device=key_cache.device)
    blocks = case["block_table"][:, positions // block_size].long()  # [B, S]
    slots = (positions % block_size)[None].expand(batch, -1)
    groups = case["query"].shape[1] // key_cache.shape[2]
    k = key_cache[blocks, slots].transpose(1, 2).repeat_interleave(groups, 1)  # [B, H, S, D]
    v = value_cache[blocks, slots].transpose(1, 2).repeat_interleave(groups, 1)
    q = case["query"].view(batch, nodes, *case["query"].shape[1:]).transpose(1, 2)  # [B, H, n, D]
    mask = torch.stack([visible(p, context, nodes) for p in case["parents"]])[:, None].to(key_cache.device)
    return q, k, v, mask


def sdpa(q, k, v, mask, scale):
    """Dense attention: q [B, H, n, D] over k / v [B, H, S, D] where mask [B, 1, n, S]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def bench_shape(batch: int, context: int, nodes: int, args, dtype, seed: int) -> dict:
    from specplug.common.cuda.tree_attention_triton import tree_attention
    from tests.support.tree_attention_cases import KERNEL_ARGUMENTS, paged_inputs, random_parents

    g = torch.Generator().manual_seed(seed)
    spec = dict(requests=[(context, random_parents(nodes, g), nodes) for _ in range(batch)],
                block_size=args.block_size, tile=args.tile, heads=args.heads)
    case = paged_inputs(spec, seed, kv_heads=args.kv_heads, dim=args.dim, dtype=dtype, device=args.device)
    out = torch.empty_like(case["query"])
    kernel_args = [case[k] for k in KERNEL_ARGUMENTS]
    q, k, v, mask = gathered(case, context, nodes)
    scale = case["scale"]
    row = dict(batch=batch, context=context, nodes=nodes, tokens=batch * nodes)
    row["kernel_us"] = timed_us(lambda: tree_attention(*kernel_args, out=out, tile=args.tile), args.reps, args.device)
    row["sdpa_us"] = timed_us(lambda: sdpa(q, k, v, mask, scale), args.reps, args.device)
    row["gather_sdpa_us"] = timed_us(lambda: sdpa(*gathered(case, context, nodes), scale), args.reps, args.device)
    dense = sdpa(q, k, v, mask, scale).transpose(1, 2).reshape(out.shape)
    row["max_abs_diff"] = float((out.float() - dense.float()).abs().max())
    row["sdpa_over_kernel"] = row["sdpa_us"] / row["kernel_us"]
    return row


def markdown(rows, meta) -> str:
    lines = [f"device: {meta['device_name']}; torch {meta['torch']}; triton {meta['triton']}; dtype {meta['dtype']}; "
             f"heads {meta['heads']}/{meta['kv_heads']} (q/kv), head_dim {meta['dim']}; block {meta['block_size']}; "
             f"tile {meta['tile']}; random trees, seed {meta['seed']}; median of {meta['reps']} calls"
             + ("; Triton interpreter on CPU: a dry run, timings meaningless" if meta["interpreted"] else ""), "",
             "| B | context | nodes | kernel µs | sdpa µs | gather + sdpa µs | sdpa / kernel | max abs diff |",
             "|" + " --- |" * 8]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['nodes']} | {r['kernel_us']:.1f} | {r['sdpa_us']:.1f} | "
                     f"{r['gather_sdpa_us']:.1f} | {r['sdpa_over_kernel']:.2f}x | {r['max_abs_diff']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # read when Triton is imported, below
    elif not torch.cuda.is_available():
        print("gpu_tree_attention: no CUDA device (torch.cuda.is_available() is False); --device cpu is a dry run",
              file=sys.stderr)
        return 2
    import triton

    shapes = [shape_of(s) for s in args.shapes]
    dtype = DTYPES[args.dtype]
    meta = dict(device_name=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, triton=triton.__version__, dtype=args.dtype, heads=args.heads,
                kv_heads=args.kv_heads, dim=args.dim, block_size=args.block_size, tile=args.tile, seed=args.seed,
                reps=args.reps, interpreted=args.device == "cpu", host=platform.node())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (batch, context, nodes) in enumerate(shapes):
        rows.append(bench_shape(batch, context, nodes, args, dtype, args.seed + i))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        out.with_suffix(".md").write_text(markdown(rows, meta) + "\n")  # after every shape: a cut run keeps it
        out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
