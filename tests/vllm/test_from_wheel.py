"""What a user gets from `pip install`: the wheel installed in this environment, run from
a folder outside the checkout. `specplug serve` with the committed EAGLE-3 head (found as
package data) answers chat completions whose greedy text equals the same server without
speculation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment: bash scripts/test.sh vllm")

import requests  # noqa: E402

from tests.support.installed import assert_installed, folder_outside_checkout, imported_paths  # noqa: E402
from tests.support.servers import free_port, healthy_servers  # noqa: E402

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("SPECPLUG_INSTALL", "wheel") != "wheel",
                       reason="proves the installed wheel; this run uses an editable install"),
]

STARTUP_LIMIT_S = 400
QUESTIONS = ["Write a haiku about a river at night.", "Explain what a hash map is in two sentences."]


def _user_env() -> dict:
    """The environment a user's shell would have: nothing pointing into this checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE")}


def _serve(target: Path, cwd: Path, extra: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("specplug")), "serve", str(target), "--port", str(port),
           "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024", "--seed", "0",
           "--served-model-name", "smollm2", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), *extra]
    proc = subprocess.Popen(cmd, cwd=cwd, env=_user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A folder outside the checkout, where `import specplug` must still find the wheel."""
    return folder_outside_checkout(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(outside):
    """(url with the committed head, url without speculation), started side by side."""
    from specplug.common import testbed

    target = testbed.target_dir()
    head = testbed.head_dir("smollm2-eagle3")
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    launches = [lambda: _serve(target, outside, ["--speculative-config", spec]), lambda: _serve(target, outside, [])]
    with healthy_servers(launches, STARTUP_LIMIT_S) as urls:
        yield tuple(urls)


def test_specplug_and_the_committed_head_come_from_the_installed_wheel(outside):
    code = ("import specplug, specplug.testbed_heads as h; "
            "print(specplug.__file__); print(h.ROOT / 'smollm2-eagle3' / 'model.safetensors')")
    package, head = imported_paths(code, outside, _user_env())
    assert_installed(package)
    assert_installed(head)
    assert head.is_file()


def _chat(url: str, question: str) -> str:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}],
            "temperature": 0.0, "max_tokens": 48}
    reply = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_greedy_chat_with_the_committed_head_equals_the_server_without_speculation(servers):
    spec_url, plain_url = servers
    for question in QUESTIONS:
        assert _chat(spec_url, question) == _chat(plain_url, question)
    metrics = requests.get(f"{spec_url}/metrics", timeout=30).text
    drafted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0, "the server with the head never drafted"
