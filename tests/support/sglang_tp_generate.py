"""Test support: token ids from SGLang CPU engines at one --tp-size, one engine after the
other, in a process of their own (SGLang spawns one scheduler per rank; an engine's
shutdown ends every scheduler of its process, so engines never overlap).

python -m tests.support.sglang_tp_generate --model MODEL --tp 2 [--text] '{"name": "base"}' '{"name": ..., ...}' ...
prints one line MARKER + JSON {NAME: {"ids": [[ids], ...], "accepted": n}, ...}. A run is
{"name": NAME, "engine_args": {sglang.Engine arguments}, "env": {VAR: VALUE}, "sampling": {...}}: env is set
while that engine starts (its schedulers inherit it); sampling: SGLang sampling fields over greedy, a "seed"
s gives prompt i the sampling_seed s + i. "accepted": draft tokens accepted, all requests (tokens beyond
the first, less SGLang's verify steps).
--text: tests.support.tp_generate's text prompts through the model's tokenizer (a trained model's
drafts need text), else PROMPTS (token ids any vocabulary holds).
Run with tests/support/sglang_path on PYTHONPATH (the CPU stand-ins), as the SGLang suite does.
"""

from __future__ import annotations

import argparse
import json
import os

from specplug.common.parallel import threads_bind
from tests.support.tp_generate import PROMPTS as TEXT_PROMPTS
from tests.support.tp_generate import environment

MARKER = "sglang_tp_generate: "  # the result line's prefix
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11], list(range(40, 71)), [100]]


def sampling_params(fields: dict, max_tokens: int, num_prompts: int) -> list[dict]:
    """One SGLang sampling dict per prompt: greedy unless `fields` say otherwise; seed s -> s + i."""
    seed = fields.get("seed")
    base = {"temperature": 0.0, "max_new_tokens": max_tokens, **{k: v for k, v in fields.items() if k != "seed"}}
    return [{**base, **({} if seed is None else {"sampling_seed": seed + i})} for i in range(num_prompts)]


def generate(model: str, run: dict, tp: int, max_tokens: int, prompts=PROMPTS) -> dict:
    import sglang

    from specplug.sglang_medusa.bench_runner import CPU_ENGINE_ARGS

    args = dict(CPU_ENGINE_ARGS, max_total_tokens=16384, log_level="error", random_seed=0, tp_size=tp,
                **run.get("engine_args", {}))
    with environment(run.get("env", {})):
        engine = sglang.Engine(model_path=model, **args)
        try:
            out = engine.generate(input_ids=prompts,
                                  sampling_params=sampling_params(run.get("sampling", {}), max_tokens, len(prompts)))
        finally:
            engine.shutdown()
    ids = [o["output_ids"] for o in out]
    steps = [o["meta_info"].get("spec_verify_ct", 0) for o in out]
    return {"ids": ids, "accepted": sum(len(i) - 1 - s for i, s in zip(ids, steps) if s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target model folder (default: none)")
    parser.add_argument("--tp", type=int, default=2, help="--tp-size (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per prompt (default: 24)")
    parser.add_argument("--text", action="store_true", help="text prompts through the model's tokenizer")
    parser.add_argument("runs", nargs="+", help="JSON runs, in this order")
    args = parser.parse_args()
    prompts = PROMPTS
    if args.text:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = [tokenizer(text)["input_ids"] for text in TEXT_PROMPTS]
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("SGLANG_PLUGINS", "specplug_medusa")
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(args.tp))
    out = {}
    for text in args.runs:
        run = json.loads(text)
        out[run["name"]] = generate(args.model, run, args.tp, args.max_tokens, prompts)
    print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
