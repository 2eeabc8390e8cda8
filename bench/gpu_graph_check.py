"""CUDA-graph capture and replay of specplug's greedy chain verification.

Fixed shapes: batch 8, K = 4 drafts per request, vocab 32000; flat float32 logits
[B * (K + 1), V] (an engine's chain layout), every request greedy, and SPECPLUG_CUDA=0 (where
the CUDA verify kernel is built, verify_step hands chains to it), so that
``specplug.common.verify_step`` runs ``chains.verify_chains(method="greedy")``. Drafts are
planted so that requests accept 0..K of them. The check, in order:

1. host syncs: one eager ``verify_step`` under ``torch.cuda.set_sync_debug_mode("warn")``;
   every synchronising call, with the specplug source line that made it;
2. pure tensor part (:func:`greedy_chain_tensors`): the same computation with the host reads
   replaced by the fixed shapes, captured in a ``torch.cuda.CUDAGraph``, replayed on new
   inputs copied into the captured ones; each replay must equal an eager ``verify_step``
   on those inputs exactly (accepted nodes, accepted counts, bonus tokens);
3. whole step: ``verify_step`` itself captured; where capture fails, the error and the
   specplug line it was raised at (run last, so a failed capture cannot disturb step 2).

Writes OUT.json and OUT.md. ``--device cpu`` runs what needs no GPU: the pure tensor part
eagerly against ``verify_step`` (the capture steps are recorded as skipped).

    python bench/gpu_graph_check.py --out out/gpu_check/graph
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from specplug.common.chains import accept_prefix
from specplug.common.sampling import flat_node_rows
from specplug.common.target_probs import ARGMAX_CHUNK
from specplug.common.verify_result import VerifyResult
from specplug.common.verify_step import RequestSampling, verify_step

BATCH, K, VOCAB = 8, 4, 32000
PURE_PART = ("greedy_chain_tensors: first_argmax's chunked argmax (V > 4 * ARGMAX_CHUNK) without its NaN "
             "fallback, flat_node_rows, accept_prefix(max_drafts=K); left out: verify_step's rule choice "
             "(chain_rows(...).tolist()), verify_chains' row-count check and the NaN checks")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default) or cpu: no capture")
    ap.add_argument("--replays", type=int, default=5, help="new inputs replayed and compared (default: 5)")
    ap.add_argument("--seed", type=int, default=0, help="default: 0")
    ap.add_argument("--out", default="out/gpu_graph_check", help="output path without suffix")
    return ap.parse_args(argv)


def chain_inputs(g: torch.Generator, device: str) -> dict:
    """One step's inputs: logits Float [B * (K + 1), V], candidates / parents Long [B, K + 1]
    (node 0 the root), request b's drafts equal to the target's argmax for its first
    accept[b] places (accept[b] uniform over 0..K) and differing after."""
    logits = torch.randn(BATCH * (K + 1), VOCAB, generator=g) * 3
    follow = logits.argmax(-1).view(BATCH, K + 1)  # the target's token after each node
    accept = torch.randint(0, K + 1, (BATCH,), generator=g)
    candidates = torch.randint(0, VOCAB, (BATCH, K + 1), generator=g)
    for b in range(BATCH):
        for j in range(K):
            candidates[b, j + 1] = follow[b, j] if j < accept[b] else (follow[b, j] + 1) % VOCAB
    parents = torch.arange(-1, K).expand(BATCH, K + 1).contiguous()
    return dict(logits=logits.to(device), candidates=candidates.to(device), parents=parents.to(device))


def eager(inputs: dict) -> VerifyResult:
    return verify_step(inputs["logits"], inputs["candidates"], inputs["parents"], None,
                       [RequestSampling(temperature=0.0)] * BATCH)


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """target_probs.first_argmax on a non-CPU tensor of V > 4 * ARGMAX_CHUNK columns, without its NaN
    fallback (a host read): the first chunk holding the row's max, then the argmax inside it."""
    rows, vocab = x.shape
    whole = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    chunk_max = x[:, :whole].reshape(rows, -1, ARGMAX_CHUNK).amax(-1)  # [R, C]
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, x[:, whole:].amax(-1, keepdim=True)], 1)
    chunk = (chunk_max == chunk_max.amax(-1, keepdim=True)).int().argmax(-1)  # [R]
    columns = (chunk[:, None] * ARGMAX_CHUNK + torch.arange(ARGMAX_CHUNK, device=x.device)).clamp(max=vocab - 1)
    return chunk * ARGMAX_CHUNK + x.gather(1, columns).argmax(-1)


def greedy_chain_tensors(logits: torch.Tensor, candidates: torch.Tensor, num_nodes: torch.Tensor) -> VerifyResult:
    """verify_chains(candidates[:, 1:], num_nodes - 1, logits, "greedy") for chains of K drafts
    each, with no host read (see PURE_PART)."""
    tokens = chunked_argmax(logits)[flat_node_rows(num_nodes, K + 1)]  # [B, K + 1]
    return accept_prefix(candidates[:, 1:], num_nodes - 1, tokens, max_drafts=K)


def same(a: VerifyResult, b: VerifyResult) -> bool:
    return all(x.shape == y.shape and bool((x.cpu() == y.cpu()).all()) for x, y in zip(a, b))


def specplug_line(exc: BaseException) -> str | None:
    """'path:line: source' of the innermost specplug frame of exc's traceback."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/plugins/" in f.filename
              or "/specplug/" in f.filename]
    if not frames:
        return None
    f = frames[-1]
    return f"{short(f.filename)}:{f.lineno}: {(f.line or '').strip()}"


def short(path: str) -> str:
    """A module's path inside the package (the checkout's plugins/ or an installed specplug/)."""
    for marker in ("/plugins/", "/specplug/"):
        if marker in path:
            return "specplug/" + path.rsplit(marker, 1)[1]
    return path


def host_syncs(inputs: dict) -> list[str]:
    """The synchronising calls of one eager verify_step, as 'path:line: source' (first seen first)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eager(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    lines = []
    for w in caught:
        if "synchroniz" not in str(w.message).lower():
            continue
        line = f"{short(w.filename)}:{w.lineno}: {linecache.getline(w.filename, w.lineno).strip()}"
        if line not in lines:
            lines.append(line)
    return lines


def capture(fn):
    """(graph, outputs) of fn captured after a warm-up on a side stream; raises what capture raised."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def capture_error(exc: BaseException) -> dict:
    """The error of a failed capture: the first one raised (a failed capture's end raises a
    second one on top) and the specplug line each was raised at."""
    chain = [exc]
    while chain[-1].__context__ is not None and len(chain) < 5:
        chain.append(chain[-1].__context__)
    first = chain[-1]
    return dict(error=f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}",
                at=specplug_line(first), raised_last=f"{type(exc).__name__}: {str(exc).strip()[:200]}",
                raised_last_at=specplug_line(exc))


def median_us(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def pure_part(g: torch.Generator, args, report: dict) -> None:
    """Step 2: capture greedy_chain_tensors, replay on new inputs, compare with eager verify_step."""
    static = chain_inputs(g, args.device)
    num_nodes = torch.full((BATCH,), K + 1, dtype=torch.long, device=args.device)
    run = lambda: greedy_chain_tensors(static["logits"], static["candidates"], num_nodes)  # noqa: E731
    part = dict(what=PURE_PART, replays=[])
    report["pure_part"] = part
    if args.device == "cpu":
        part["captured"] = "skipped: needs CUDA (compared eagerly instead)"
        for _ in range(args.replays):
            new = chain_inputs(g, "cpu")
            got = greedy_chain_tensors(new["logits"], new["candidates"], num_nodes)
            part["replays"].append(dict(equal_to_eager=same(got, eager(new)), accepted=got.num_accepted.tolist()))
        return
    graph, outputs = capture(run)
    part["captured"] = True
    for _ in range(args.replays):
        new = chain_inputs(g, args.device)
        for key in ("logits", "candidates"):
            static[key].copy_(new[key])
        graph.replay()
        torch.cuda.synchronize()
        expected = eager(new)
        part["replays"].append(dict(equal_to_eager=same(outputs, expected), accepted=outputs.num_accepted.tolist()))
    part["replay_us"] = median_us(graph.replay)
    part["eager_verify_step_us"] = median_us(lambda: eager(static))


def whole_step(args, report: dict, g: torch.Generator) -> None:
    """Step 3: capture verify_step itself."""
    static = chain_inputs(g, args.device)
    whole = dict(call="verify_step(logits, candidates, parents, None, [RequestSampling(temperature=0.0)] * 8)")
    report["whole_step"] = whole
    try:
        graph, outputs = capture(lambda: eager(static))
    except Exception as exc:  # noqa: BLE001 - what broke capture is the result
        whole.update(captured=False, **capture_error(exc))
        return
    whole["captured"] = True
    new = chain_inputs(g, args.device)
    for key in ("logits", "candidates", "parents"):
        static[key].copy_(new[key])
    graph.replay()
    torch.cuda.synchronize()
    whole["replay_equal_to_eager"] = same(outputs, eager(new))


def markdown(report: dict) -> str:
    lines = [f"device: {report['device_name']}; torch {report['torch']}; batch {BATCH}, K {K}, vocab {VOCAB}, "
             "flat float32 logits, greedy chains", ""]
    syncs = report.get("host_syncs")
    if isinstance(syncs, list):
        lines.append(f"- host syncs in one eager verify_step ({len(syncs)}):")
        lines += [f"  - `{s}`" for s in syncs] or ["  - none"]
    else:
        lines.append(f"- host syncs: {syncs}")
    part = report.get("pure_part", {})
    equal = [r["equal_to_eager"] for r in part.get("replays", [])]
    lines.append(f"- pure tensor part ({part.get('what', '')}): captured: {part.get('captured')}; "
                 f"{sum(equal)}/{len(equal)} {'replays' if part.get('captured') is True else 'eager runs'} "
                 "equal to eager verify_step"
                 + (f"; replay {part['replay_us']:.0f} µs vs eager verify_step {part['eager_verify_step_us']:.0f} µs "
                    "(host wall time)" if "replay_us" in part else ""))
    whole = report.get("whole_step", {})
    if whole.get("captured") is False:
        lines.append(f"- whole verify_step: capture FAILED: {whole['error']} at `{whole['at']}`")
    else:
        lines.append(f"- whole verify_step: captured: {whole.get('captured')}"
                     + (f"; replay equal to eager: {whole['replay_equal_to_eager']}" if "replay_equal_to_eager"
                        in whole else ""))
    lines.append(f"- result: {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["SPECPLUG_CUDA"] = "0"  # the chain path itself: where the kernel is built, verify_step prefers it
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_graph_check: no CUDA device (torch.cuda.is_available() is False); --device cpu runs the rest",
              file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    report = dict(device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  torch=torch.__version__, batch=BATCH, k=K, vocab=VOCAB)
    if args.device == "cuda":
        report["host_syncs"] = host_syncs(chain_inputs(g, "cuda"))
    else:
        report["host_syncs"] = "skipped: needs CUDA"
    pure_part(g, args, report)
    if args.device == "cuda":
        whole_step(args, report, g)
    else:
        report["whole_step"] = dict(captured="skipped: needs CUDA")
    replays = report["pure_part"]["replays"]
    report["ok"] = bool(replays) and all(r["equal_to_eager"] for r in replays)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
