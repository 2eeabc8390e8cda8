"""Test support (not product code): start-up helpers for servers the suites launch on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest
import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, limit_s: float) -> None:
    """Poll `url`/health until 200; fail with the server's last output if it exits first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode} during start-up:\n{proc.stdout.read()[-4000:]}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    pytest.fail("server did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it has not exited after 30 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@contextlib.contextmanager
def healthy_servers(launches, limit_s: float):
    """Runs every launch() (-> (url, process)) first, so the start-ups overlap; yields the
    urls once all are healthy; stops every server started, whatever happened."""
    started = []
    try:
        for launch in launches:
            started.append(launch())
        for url, proc in started:
            wait_healthy(url, proc, limit_s)
        yield [url for url, _ in started]
    finally:
        for _, proc in started:
            stop_server(proc)
