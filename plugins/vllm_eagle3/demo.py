"""The demo: vLLM on the test-bed model with and without the specplug EAGLE-3 head, side by
side in one process, printing tokens/s, the speed-up, tau and per-position acceptance.

Run it with `bash scripts/demo.sh` (builds the environment and the test bed first) or
`python -m specplug.vllm_eagle3.demo` inside the vLLM environment. The head is the first
specplug EAGLE-3 head committed under heads/ (a config.json whose `specplug` section says
method "eagle3"), or --head DIR; without one the demo writes an UNTRAINED head and says
so, which shows the plumbing but not a speed-up (tau stays near 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_HEADS = Path(__file__).resolve().parents[2] / "heads"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", default=None,
                        help="EAGLE-3 head directory (default: the first specplug eagle3 head under heads/)")
    parser.add_argument("--prompts", default="mtbench", help="prompt set (sharegpt, mtbench, humaneval)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts to generate for")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--batch-size", type=int, default=1, help="requests per generate call")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def find_head(heads_dir: Path = REPO_HEADS) -> Path | None:
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


def _engine(target: Path, head: Path | None, depth: int):
    from vllm import LLM

    spec = {}
    if head is not None:
        spec = {"per_request_spec_decode_metrics": "summary",
                "speculative_config": {"method": "eagle3", "model": str(head), "num_speculative_tokens": depth}}
    return LLM(model=str(target), dtype="float32", seed=0, max_model_len=2048, enforce_eager=True,
               distributed_executor_backend="uni", disable_log_stats=False, **spec)


def _timed_generate(llm, prompts: list[str], sampling, batch_size: int):
    """(outputs, seconds, generated tokens) over batches of batch_size requests."""
    outputs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs += llm.generate(prompts[i:i + batch_size], sampling, use_tqdm=False)
    seconds = time.perf_counter() - start
    return outputs, seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def measure(args) -> dict:
    """Both engines on the same prompts; the result dict the demo prints."""
    import gc

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from specplug.common.data import prompts as prompt_set
    from specplug.common.testbed import target_dir
    from specplug.vllm_eagle3.metrics import stats_from_outputs

    target = target_dir()
    head = Path(args.head) if args.head else find_head()
    trained = head is not None
    head = head or untrained_head(target)
    depth = (json.loads((head / "config.json").read_text()).get("specplug") or {}).get("tree", {}).get("depth", 4)
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [p.text for p in prompt_set(args.prompts, tokenizer, limit=args.num_prompts)]
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    runs = {}
    for name, engine_head in (("no speculation", None), ("specplug eagle3", head)):
        llm = _engine(target, engine_head, depth)
        if engine_head is not None:
            active = _specplug_active(llm)
        _timed_generate(llm, texts[:1], SamplingParams(max_tokens=8), 1)  # warm-up
        outputs, seconds, tokens = _timed_generate(llm, texts, sampling, args.batch_size)
        runs[name] = {"outputs": [list(o.outputs[0].token_ids) for o in outputs],
                      "tok_per_s": tokens / seconds, "stats": stats_from_outputs(outputs)}
        del llm
        gc.collect()
    base, spec = runs["no speculation"], runs["specplug eagle3"]
    stats = spec["stats"]
    return {
        "model": str(target), "head": str(head), "head_trained": trained,
        "prompts": f"{args.prompts} x {len(texts)}", "max_tokens": args.max_tokens,
        "batch_size": args.batch_size, "temperature": args.temperature, "depth": depth,
        "tok_per_s_without": base["tok_per_s"], "tok_per_s_with": spec["tok_per_s"],
        "speedup": spec["tok_per_s"] / base["tok_per_s"], "tau": stats.tau,
        "acceptance_per_position": list(stats.position_acceptance),
        "identical_outputs": sum(a == b for a, b in zip(base["outputs"], spec["outputs"])),
        "num_outputs": len(texts), "specplug_active": active,
    }


def _specplug_active(llm) -> bool:
    """Whether the in-process engine's drafter runs specplug's path."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return getattr(runner.drafter, "specplug", None) is not None


def report(result: dict) -> str:
    lines = [
        f"model {result['model']}",
        f"head  {result['head']}" + ("" if result["head_trained"] else
                                    "  (UNTRAINED: no specplug EAGLE-3 head under heads/ yet; tau stays near 1)"),
        f"specplug proposer active: {'yes' if result['specplug_active'] else 'NO (vLLM built-in path)'}",
        f"prompts {result['prompts']}, {result['max_tokens']} new tokens, batch {result['batch_size']}, "
        f"temperature {result['temperature']}, tree depth {result['depth']}",
        "",
        "| engine | tok/s |",
        "|---|---|",
        f"| vLLM, no speculation | {result['tok_per_s_without']:.1f} |",
        f"| vLLM + specplug EAGLE-3 | {result['tok_per_s_with']:.1f} |",
        "",
        f"speed-up {result['speedup']:.2f}x, tau {result['tau']:.2f}, acceptance per position "
        + ", ".join(f"{a:.2f}" for a in result["acceptance_per_position"]),
    ]
    if result["temperature"] == 0:
        lines.append(f"greedy outputs identical to no speculation: {result['identical_outputs']}/{result['num_outputs']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specplug.vllm_eagle3.demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
