"""`python -m sglang.launch_server --speculative-algorithm MEDUSA` serves /generate and the
OpenAI-compatible endpoint, reports speculation in meta_info, and shuts down cleanly."""

import os
import signal
import subprocess
import sys

import psutil
import pytest
import requests

from tests.sglang.conftest import GREEDY, PROMPTS
from tests.support.servers import free_port, wait_healthy

STARTUP_LIMIT_S = 420  # generous: engine start is 20-60 s on 2 busy cores


@pytest.fixture(scope="module")
def server(sgl_model, medusa_heads):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(sgl_model), "--port", str(port),
           "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
           "--disable-cuda-graph", "--mem-fraction-static", "0.5", "--max-total-tokens", "16384",
           "--random-seed", "0", "--log-level", "warning", "--sleep-on-idle",
           "--speculative-algorithm", "MEDUSA", "--speculative-draft-model-path", str(medusa_heads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, STARTUP_LIMIT_S)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def test_generate_endpoint_runs_medusa(server, baseline):
    url, _ = server
    reply = requests.post(f"{url}/generate", json={"input_ids": PROMPTS[0], "sampling_params": GREEDY},
                          timeout=120).json()
    assert reply["output_ids"] == baseline["greedy"]["ids"][0]
    assert reply["meta_info"]["spec_verify_ct"] > 0


def test_openai_completions_endpoint(server, sgl_model):
    url, _ = server
    reply = requests.post(f"{url}/v1/completions", json={
        "model": str(sgl_model), "prompt": "the cat", "max_tokens": 12, "temperature": 0}, timeout=120).json()
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] == 12
    assert isinstance(reply["choices"][0]["text"], str)


def test_structured_output_is_refused_with_400_and_the_server_keeps_serving(server, sgl_model):
    """MEDUSA does not apply grammars yet: such a request gets a 400 naming why (it used to
    stop the scheduler, and the server with it); the next request is served."""
    url, _ = server
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    reply = requests.post(f"{url}/v1/chat/completions", json={
        "model": str(sgl_model), "messages": [{"role": "user", "content": "a name?"}], "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}, timeout=120)
    assert reply.status_code == 400 and "MEDUSA" in reply.text
    test_openai_completions_endpoint(server, sgl_model)
    assert requests.get(f"{url}/health", timeout=5).status_code == 200


def test_shutdown_is_clean(server):
    """SIGTERM stops the server and every process it started (runs last in this module)."""
    _, proc = server
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"processes left after shutdown: {[p.pid for p in alive]}"
