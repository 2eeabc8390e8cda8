"""`specplug.soak.wait_healthy`: a server launched early (vLLM's first speculative server
starts beside the baseline) is asked for /health even when its start-up deadline passed
while the baseline ran; one that never answers is stopped and reported; `defaults` makes
the log folder."""

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from specplug import soak


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def _server(url: str, tmp_path) -> dict:
    log = tmp_path / "server.log"
    log.write_text("the server's log\n")
    proc = SimpleNamespace(poll=lambda: None, returncode=None, pid=-1)
    return {"name": "tree", "url": url, "proc": proc, "log": log, "deadline": time.monotonic() - 1}


def test_a_healthy_server_past_its_deadline_is_ready(tmp_path):
    httpd = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        server = _server(f"http://127.0.0.1:{httpd.server_port}", tmp_path)
        assert soak.wait_healthy(server) is server
    finally:
        httpd.shutdown()


def test_a_silent_server_past_its_deadline_is_stopped_and_reported(tmp_path, monkeypatch):
    stopped = []
    monkeypatch.setattr(soak, "stop_server", stopped.append)
    server = _server(f"http://127.0.0.1:{free_port()}", tmp_path)
    with pytest.raises(RuntimeError, match="(?s)server tree did not become healthy.*the server's log"):
        soak.wait_healthy(server)
    assert stopped == [server]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_log_dir_that_does_not_exist_yet_is_made(tmp_path):
    args = SimpleNamespace(engine="vllm", model=str(tmp_path), head=str(tmp_path), configs="chain", skip="",
                           log_dir=str(tmp_path / "new" / "logs"))
    soak.defaults(args)
    assert (tmp_path / "new" / "logs").is_dir()
