"""Where a decode step's time goes, per method, in vLLM on the test bed (bs 1 by default).

    LD_PRELOAD=$V/lib/libiomp5.so $V/bin/python bench/step_breakdown.py \
        [--methods none,eagle3,specplug,specplug-tree,specplug-hybrid] [--num-prompts 4] \
        [--max-new-tokens 96] [--prompts mtbench] [--batch-size 1] [--plain] [--md OUT.md]

Each method runs in its own in-process engine (the `specplug bench` runner: same heads,
same settings). After warm-up, timers wrap the engine step, the target model's forward,
the runner's `propose_draft_token_ids` less the proposer's `propose` ("vLLM draft prep":
vLLM's own preparation of the drafter's inputs), `propose` (all drafting: the head's
catch-up and tree forwards, tree building, path choice; of which the head's catch-up,
its trees, and the retrieval drafter's sync + lookup), and the sampler (specplug's
verification, or vLLM's). "rest" is the step minus those: vLLM's scheduler, input
preparation, KV bookkeeping, output processing. Times are means per engine step in ms;
tokens/step counts emitted tokens. With --plain, payoff control is pinned to depth 0, so
each specplug step drafts nothing: what a plain step costs through the speculative
engine, next to `none`. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from types import SimpleNamespace

PARTS = ("step", "target forward", "vLLM draft prep", "drafting", "of which head catch-up", "of which head trees",
         "of which retrieval", "sampler")


class Timers:
    """Accumulated seconds and call counts per part."""

    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1
        return timed


class TimedCallable:
    """A callable object (the runner's sampler) timed as one part; attributes pass through."""

    def __init__(self, inner, timers: Timers, part: str):
        self._inner, self._timed = inner, timers.wrap(part, inner.__call__)

    def __call__(self, *args, **kwargs):
        return self._timed(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def instrument(llm, timers: Timers) -> None:
    """Wrap the step, the target forward, drafting, retrieval and the sampler of `llm`."""
    engine = llm.llm_engine
    engine.step = timers.wrap("step", engine.step)
    runner = engine.model_executor.driver_worker.worker.model_runner
    runner.model.forward = timers.wrap("target forward", runner.model.forward)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        runner.propose_draft_token_ids = timers.wrap("vLLM draft prep", runner.propose_draft_token_ids)
        drafter.propose = timers.wrap("drafting", drafter.propose)
        token_drafter = getattr(drafter, "token_drafter", None)
        if token_drafter is not None:
            token_drafter.draft = timers.wrap("of which retrieval", token_drafter.draft)
            drafter._sync_token_drafter = timers.wrap("of which retrieval", drafter._sync_token_drafter)
        drafting = getattr(drafter, "drafting", None)  # the head's; built at the warm-up's first step
        if drafting is not None:
            drafting.catch_up = timers.wrap("of which head catch-up", drafting.catch_up)
            drafting.trees = timers.wrap("of which head trees", drafting.trees)
    if getattr(runner, "rejection_sampler", None) is not None and drafter is not None:
        runner.rejection_sampler = TimedCallable(runner.rejection_sampler, timers, "sampler")
    else:
        runner.sampler = TimedCallable(runner.sampler, timers, "sampler")


def pin_plain(llm) -> None:
    """Payoff control of `llm`'s specplug proposer chooses depth 0 (no drafts) every step."""
    from specplug.vllm_eagle3.bench_runner import engine_drafter

    clock = getattr(engine_drafter(llm), "payoff", None)
    if clock is None:
        raise SystemExit("step_breakdown --plain: the method runs no payoff control (a specplug method with "
                         "\"payoff\" on is needed)")
    clock.control._decide = lambda bucket, batch: 0


def measure(runner, method: str, prompts, batch_size: int, plain: bool = False) -> dict:
    """Per-step means (ms) of each part for one method, plus tokens per step and tok/s;
    `plain`: specplug methods draft nothing (pin_plain)."""
    llm = runner._engine(method)
    if plain and method != "none":
        pin_plain(llm)
    timers = Timers()
    instrument(llm, timers)
    result = runner.run(method, prompts, batch_size)
    steps = max(1, timers.calls["step"])
    ms = {part: 1e3 * timers.seconds[part] / steps for part in PARTS}
    ms["vLLM draft prep"] = max(0.0, ms["vLLM draft prep"] - ms["drafting"])  # around our propose
    ms["rest"] = ms["step"] - ms["target forward"] - ms["vLLM draft prep"] - ms["drafting"] - ms["sampler"]
    return {"method": method, "steps": steps, "ms": ms, "tok_per_s": result.output_tokens / result.seconds,
            "tokens_per_step": result.output_tokens / steps}


def markdown(rows: list[dict]) -> str:
    cols = list(PARTS) + ["rest"]
    lines = ["| method | tok/s | tokens/step | " + " | ".join(f"{c} (ms)" for c in cols) + " |",
             "|" + "---|" * (3 + len(cols))]
    for r in rows:
        cells = " | ".join(f"{r['ms'][c]:.1f}" for c in cols)
        lines.append(f"| {r['method']} | {r['tok_per_s']:.1f} | {r['tokens_per_step']:.2f} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--methods", default="none,eagle3,specplug,specplug-tree,specplug-hybrid")
    parser.add_argument("--prompts", default="mtbench", help="prompt set")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--plain", action="store_true",
                        help="pin payoff control to depth 0: specplug steps draft nothing (the cost of a plain step)")
    parser.add_argument("--head", default=None, help="EAGLE-3 head (default: the committed test-bed head)")
    parser.add_argument("--md", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from specplug.common.training import data
    from specplug.vllm_eagle3.bench_runner import make_runner

    runner = make_runner(SimpleNamespace(model=None, head=args.head, max_new_tokens=args.max_new_tokens,
                                         temperature=0.0, seed=0, batch_sizes=str(args.batch_size)))
    prompts = [p.text for p in data.prompts(args.prompts, runner.tokenizer, limit=args.num_prompts)]
    rows = []
    for method in args.methods.split(","):
        rows.append(measure(runner, method, prompts, args.batch_size, args.plain))
        print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    runner.close()
    table = markdown(rows)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
