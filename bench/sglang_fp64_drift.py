"""SGLang's greedy outputs and log-probabilities against an fp64 reference, per method.

    SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=.:tests/support/sglang_path $S/bin/python bench/sglang_fp64_drift.py \
        [--methods none,medusa,retrieval,eagle3] [--prompts humaneval:31,sharegpt:681,...] \
        [--max-new-tokens 128] [--json OUT.json]

Each method runs in its own in-process SGLang engine (the `specplug bench` runner: same
heads, same CPU settings), one prompt at a time, greedy, with the top-2 log-probabilities
of every emitted token. Hugging Face transformers then scores the no-speculation output in
fp64 (teacher-forced, the reference) and in fp32. Per prompt it prints:

- the baseline's smallest top-2 log-probability gap, and at how many tokens it is under
  0.05 nats: the near-ties where a drift of that size would change a token;
- how far SGLang's log-probability of each emitted token lies from the fp64 one (max),
  beside how far transformers' own fp32 lies from fp64 (any token);
- per speculative method: "identical" with the same distance for the log-probabilities
  its verify pass reported, or where it first diverges, the baseline's top-2 gap there
  and which of the two tokens fp64 prefers.

A divergence at a gap far above the distances measured is a bug in a verify path, not an
fp32 near-tie. `--prompts` names prompts as SET:INDEX of specplug's prompt sets
(sharegpt, mtbench, humaneval: `specplug.common.training.data.prompts`); the default
holds four HumanEval problems about primes and four ShareGPT prompts (two recipes, a
business article, a text game).
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPTS = ("humaneval:31,humaneval:39,humaneval:75,humaneval:96,"
                   "sharegpt:151,sharegpt:681,sharegpt:807,sharegpt:1014")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,medusa,retrieval,eagle3",
                        help="`specplug bench --engine sglang` methods; `none` is added first if missing")
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help="SET:INDEX,... (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--json", help="also write every output and log-probability here")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    args.methods = ["none"] + [m for m in methods if m != "none"]
    return args


def prompt_ids(spec: str, tokenizer) -> list[list[int]]:
    """Token ids of the chat-formatted prompts SET:INDEX,..."""
    from specplug.common.training import data

    chosen, sets = [], {}
    for item in spec.split(","):
        name, _, index = item.partition(":")
        if not index.isdigit():
            raise SystemExit(f"--prompts: {item!r} is not SET:INDEX (e.g. humaneval:31)")
        prompts = sets.setdefault(name, data.prompts(name, tokenizer))
        if int(index) >= len(prompts):
            raise SystemExit(f"--prompts: {name} has {len(prompts)} prompts, {item!r} is past its end")
        chosen.append(tokenizer(prompts[int(index)].text, add_special_tokens=False)["input_ids"])
    return chosen


def generate(runner, method: str, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Per prompt: emitted ids, their log-probabilities and the top-2 (logprob, id) pairs."""
    engine = runner._engine_for(method)
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    results = []
    for ids in prompts:
        out = engine.generate(input_ids=[ids], sampling_params=[params], return_logprob=True, top_logprobs_num=2)[0]
        meta = out["meta_info"]
        results.append({"ids": out["output_ids"], "logprobs": [lp for lp, *_ in meta["output_token_logprobs"]],
                        "top2": [[(lp, t) for lp, t, *_ in tops] for tops in meta["output_top_logprobs"]]})
    return results


def reference_logprobs(model, prompt: list[int], output: list[int]):
    """Teacher-forced log-probabilities [len(output), V] (fp64) of `model` after each prefix."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(output)]
    return torch.log_softmax(logits.double(), -1)


def distance(run: dict, ref) -> float:
    """The largest |log-prob - fp64 log-prob| over the tokens a run emitted (ref [n, V])."""
    import torch

    chosen = torch.tensor(run["ids"])
    return float((torch.tensor(run["logprobs"], dtype=torch.float64) - ref[torch.arange(len(chosen)), chosen])
                 .abs().max())


def compare(base: dict, spec: dict, ref) -> str:
    """One method's verdict against the baseline on one prompt (ref: fp64 logprobs [n, V])."""
    if spec["ids"] == base["ids"]:
        return f"identical, log-probs within {distance(spec, ref):.1e} of fp64"
    j = next((k for k, (a, b) in enumerate(zip(spec["ids"], base["ids"])) if a != b), None)
    if j is None:
        return f"a prefix of the baseline ({len(spec['ids'])} of {len(base['ids'])} tokens)"
    (top1, _), (top2, _) = base["top2"][j][:2]
    a, b = base["ids"][j], spec["ids"][j]
    prefers = "the baseline's" if ref[j, a] > ref[j, b] else "the speculative"
    return (f"diverges at token {j} (baseline gap {top1 - top2:.4f} nats); fp64 prefers {prefers} token "
            f"by {abs(float(ref[j, a] - ref[j, b])):.4f}")


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specplug.common import testbed
    from specplug.sglang_medusa.bench_runner import SglangRunner, default_head

    args = parse_args(argv)
    model_dir = str(testbed.target_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(args.prompts, tokenizer)
    runner = SglangRunner(model_dir, default_head(), max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0,
                          max_batch=1, eagle3_head=default_head("smollm2-eagle3"))
    outputs = {}
    try:
        for method in args.methods:
            print(f"generating: {method}", file=sys.stderr, flush=True)
            outputs[method] = generate(runner, method, prompts, args.max_new_tokens)
    finally:
        runner.close()
    print("scoring with transformers (fp64 and fp32)", file=sys.stderr, flush=True)
    fp64, fp32 = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
                  for dt in (torch.float64, torch.float32))
    print("| prompt | smallest top-2 gap (tokens under 0.05) | no speculation: max nats from fp64 | "
          "transformers fp32: max nats from fp64 | " + " | ".join(args.methods[1:]) + " |")
    print("|---" * (4 + len(args.methods) - 1) + "|")
    for i, (name, prompt, base) in enumerate(zip(args.prompts.split(","), prompts, outputs["none"])):
        ref = reference_logprobs(fp64, prompt, base["ids"])
        hf32 = (reference_logprobs(fp32, prompt, base["ids"]) - ref).abs().max()
        verdicts = [compare(base, outputs[m][i], ref) for m in args.methods[1:]]
        gaps = [top[0][0] - top[1][0] for top in base["top2"]]
        close = f"{min(gaps):.4f} ({sum(g < 0.05 for g in gaps)})"
        print(f"| {name} | {close} | {distance(base, ref):.1e} | {hf32:.1e} | {' | '.join(verdicts)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"prompts": args.prompts.split(","), "outputs": outputs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
