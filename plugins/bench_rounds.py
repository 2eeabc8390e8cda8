"""Interleaved bench runs (`specplug bench --interleave N`): methods take turns, N prompts
at a time, so a host whose speed drifts during the run slows every method alike.

Each method runs in its own worker process that holds its engine from the first round
to the last (vLLM cannot host two engines in one process, and an engine start costs
minutes). Round r gives each method the same N prompts, in an order rotated by r, so
over the run every method sits at every place of the order equally often. The rounds of
one (method, batch size) add up to one `RunResult`: the same prompts, in the same order,
as a run without interleaving, with the engine's caches reset only before the first
round (the retrieval drafter's cache of recent requests builds across rounds exactly as
it builds within one run).

Invariant: a method's result covers exactly the prompts `sweep` would give it, and its
`seconds` count only its own generation (never an engine start or another method).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import traceback
from dataclasses import replace
from typing import Callable, Sequence

from specplug.bench_types import ENGINES, RunResult

GIB = 1 << 30
WORKER_GIB = {"vllm": 2.0, "sglang": 4.0}  # resident memory of one worker with its engine (test bed, CPU) ...
KV_SPACE_ENV, KV_SPACE_DEFAULT = "VLLM_CPU_KVCACHE_SPACE", "2"  # ... plus, for vLLM, its KV cache (GiB)

# (prompts, batch size, fresh) -> RunResult; fresh = reset the engine's caches first
RunFn = Callable[[Sequence[str], int, bool], RunResult]


def rounds(prompts: Sequence[str], round_size: int, batch_size: int) -> list[list[str]]:
    """`prompts` cut into rounds of `round_size` (rounded up to whole batches)."""
    size = -(-max(round_size, batch_size) // batch_size) * batch_size
    return [list(prompts[i:i + size]) for i in range(0, len(prompts), size)]


def rotated(methods: Sequence[str], r: int) -> list[str]:
    """The order of round r: `methods` rotated left by r."""
    k = r % len(methods)
    return list(methods[k:]) + list(methods[:k])


def combine(parts: Sequence[RunResult]) -> RunResult:
    """One result from the rounds of one (method, batch size): counters add up, outputs
    concatenate in prompt order, per-round (tokens, seconds) are kept in `rounds`."""
    first = parts[0]
    width = max(len(p.accepted_per_pos) for p in parts)
    per_pos = [sum(p.accepted_per_pos[i] for p in parts if i < len(p.accepted_per_pos)) for i in range(width)]
    timed = [p for p in parts if p.draft_seconds is not None and p.verify_seconds is not None]
    return replace(
        first, num_prompts=sum(p.num_prompts for p in parts), output_tokens=sum(p.output_tokens for p in parts),
        seconds=sum(p.seconds for p in parts), num_drafts=sum(p.num_drafts for p in parts),
        num_draft_tokens=sum(p.num_draft_tokens for p in parts), num_accepted=sum(p.num_accepted for p in parts),
        accepted_per_pos=per_pos,
        draft_seconds=sum(p.draft_seconds for p in timed) if len(timed) == len(parts) else None,
        verify_seconds=sum(p.verify_seconds for p in timed) if len(timed) == len(parts) else None,
        outputs=[o for p in parts for o in p.outputs],
        rounds=[[p.output_tokens, p.seconds] for p in parts])


def sweep_interleaved(run_fns: dict[str, RunFn], prompts: Sequence[str], batch_sizes: Sequence[int],
                      num_prompts: int, round_size: int, progress=None) -> list[RunResult]:
    """Every method of `run_fns` at every batch size, the methods taking turns by round."""
    methods, results = list(run_fns), []
    for batch in batch_sizes:
        chunk = list(prompts[:max(num_prompts, batch)])
        parts: dict[str, list[RunResult]] = {m: [] for m in methods}
        for r, part in enumerate(rounds(chunk, round_size, batch)):
            for method in rotated(methods, r):
                parts[method].append(run_fns[method](part, batch, r == 0))
                if progress is not None:
                    progress(method, batch, r)
        results += [combine(parts[m]) for m in methods]
    return results


class MethodWorker:
    """One method's runner (and engine) in a spawned process; `run` is a RunFn."""

    def __init__(self, engine: str, args: argparse.Namespace, method: str, log: str | None = None):
        self.method, self.log = method, log
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        # SGLang's engine starts its scheduler as a child process, and vLLM's multiprocess
        # executor (tensor parallelism) its workers, which a daemonic process may not have;
        # a non-daemonic worker still ends with this one (its recv() raises).
        children = engine == "sglang" or getattr(args, "tensor_parallel_size", 1) > 1
        self._process = context.Process(target=_serve, args=(child, engine, args, method, log),
                                        name=f"specplug-bench-{method}", daemon=not children)
        self._process.start()
        child.close()

    def run(self, prompts: Sequence[str], batch_size: int, fresh: bool) -> RunResult:
        self._conn.send((list(prompts), batch_size, fresh))
        ok, value = self._conn.recv()
        if not ok:
            where = f" (engine log: {self.log})" if self.log else ""
            raise RuntimeError(f"specplug bench: method {self.method!r} failed in its worker{where}:\n{value}")
        return value

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=120)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()


def _serve(conn, engine: str, args: argparse.Namespace, method: str, log: str | None) -> None:
    """Worker loop: run each (prompts, batch, fresh) job on this method's engine, the
    engine's output (stdout and stderr, its subprocesses' too) appended to `log`."""
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    runner = importlib.import_module(ENGINES[engine][1]).make_runner(args)
    try:
        while (job := conn.recv()) is not None:
            prompts, batch, fresh = job
            try:
                conn.send((True, runner.run(method, prompts, batch, fresh=fresh)))
            except Exception:  # reported to the parent, which stops the bench with it
                conn.send((False, traceback.format_exc()))
    finally:
        runner.close()


def check_memory(engine: str, methods: Sequence[str]) -> None:
    """Refuse, before any engine starts, an interleaved run whose workers would not fit."""
    import psutil

    per_worker = WORKER_GIB[engine] + (float(os.environ.get(KV_SPACE_ENV, KV_SPACE_DEFAULT)) if engine == "vllm" else 0)
    need = len(methods) * per_worker * GIB
    free = psutil.virtual_memory().available
    if need > free:
        smaller = f", set {KV_SPACE_ENV}=1 (GiB of KV cache per engine)" if engine == "vllm" else ""
        raise SystemExit(
            f"specplug bench: --interleave keeps one {engine} engine per method alive ({len(methods)} methods, "
            f"about {need / GIB:.0f} GiB) but {free / GIB:.0f} GiB are available: pass fewer --methods{smaller}, "
            f"or --interleave 0 to run the methods one after another")
