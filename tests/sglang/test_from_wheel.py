"""What a user gets from `pip install`: the wheel installed in this environment, run from
a folder outside the checkout. `python -m sglang.launch_server --speculative-algorithm
RETRIEVAL` on the test bed answers a chat completion and a /generate request with
speculation.

The server process gets only the CPU stand-ins for sgl_kernel and torchvision on its
PYTHONPATH (tests/support/sglang_path and the checkout root they import from: this CPU
has no sgl-kernel build); neither holds a `specplug` package, so specplug comes from
the installed wheel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.support.installed import CHECKOUT, assert_installed, folder_outside_checkout, imported_paths
from tests.support.servers import free_port, stop_server, wait_healthy

pytestmark = [
    pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(900),
    pytest.mark.skipif(os.environ.get("SPECPLUG_INSTALL", "wheel") != "wheel",
                       reason="proves the installed wheel; this run uses an editable install"),
]

STAND_INS = [str(CHECKOUT), str(CHECKOUT / "tests" / "support" / "sglang_path")]
STARTUP_LIMIT_S = 420


def _user_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SGLANG_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(STAND_INS)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A folder outside the checkout, where `import specplug` must still find the wheel."""
    return folder_outside_checkout(tmp_path_factory)


@pytest.fixture(scope="module")
def server(outside):
    from specplug.common import testbed

    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(testbed.target_dir()),
           "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1",
           "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
           "--disable-cuda-graph", "--mem-fraction-static", "0.5", "--max-total-tokens", "8192",
           "--random-seed", "0", "--log-level", "warning", "--sleep-on-idle",
           "--speculative-algorithm", "RETRIEVAL"]
    proc = subprocess.Popen(cmd, cwd=outside, env=_user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, STARTUP_LIMIT_S)
        yield url
    finally:
        stop_server(proc)


def test_specplug_comes_from_the_installed_wheel(outside):
    (package,) = imported_paths("import specplug; print(specplug.__file__)", outside, _user_env())
    assert_installed(package)


def test_retrieval_answers_a_chat_completion_with_speculation(server):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "List three colours of the sea."}],
            "temperature": 0.0, "max_tokens": 32}
    reply = requests.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0
    generated = requests.post(f"{server}/generate", json={
        "text": "one two three one two three one two three", "sampling_params": {"temperature": 0.0,
                                                                                 "max_new_tokens": 24}},
        timeout=300).json()
    assert generated["meta_info"]["spec_verify_ct"] > 0
