"""Helpers of the proxy tests (the owner's side, tests/engine) and of the attacker's side
(tests/cluster/test_security.py): a stand-in vLLM on a Unix socket and a proxy process in front of it."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmlab.serve.info import write_private
from llmlab.serve.proc import free_port
from llmlab.serve.proxy.limits import BACKLOG


def get(url: str, key: str | None, timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError:  # nothing listens (yet)
        return 0, b""


class _StandIn(http.server.BaseHTTPRequestHandler):
    """vLLM's place on a Unix socket: every request is answered 200 with the number of body bytes it carried."""
    protocol_version = "HTTP/1.1"

    def _answer(self):
        got = len(self.rfile.read(int(self.headers.get("content-length") or 0)))
        body = json.dumps({"path": self.path, "body_bytes": got}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):  # a Unix socket has no client address to log
        pass


@contextlib.contextmanager
def stand_in_vllm(folder: Path, slow_over: int | None = None, slow_s: float = 0.0, backlog: int = BACKLOG,
                  accepting: threading.Event | None = None):
    """A stand-in for vLLM listening on ``folder/vllm.sock`` (a thread of this process) while the block runs.
    ``slow_over``: a body of more bytes is read whole, then answered ``slow_s`` seconds later (a long generation).
    ``backlog``: connections its socket holds before accepting them; ``accepting``: while it is clear, nothing is
    accepted (a vLLM whose event loop is too busy to take connections)."""
    class Handler(_StandIn):
        def _answer(self):
            if slow_over is not None and int(self.headers.get("content-length") or 0) > slow_over:
                self.rfile.read(int(self.headers["content-length"]))
                self.headers.replace_header("content-length", "0")
                time.sleep(slow_s)
            super()._answer()

        do_GET = do_POST = _answer

    class Server(socketserver.ThreadingUnixStreamServer):
        request_queue_size = backlog  # connections from the proxy at once (vLLM's uvicorn: 2048)

        def get_request(self):
            if accepting is not None:
                accepting.wait()
            return super().get_request()

    server = Server(str(folder / "vllm.sock"), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield folder / "vllm.sock"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def proxy_process(tmp_path: Path, upstream: Path | str, *args: str, ulimit: str = ""):
    """``python -m llmlab.serve.proxy`` of the test's own: yields (process, port, owner key) once it answers; its
    output goes to ``tmp_path/proxy.log``.  ``upstream``: a socket path, or an ``--upstream`` value as it is
    (``MODEL=http://...``).  ``ulimit``: options for bash's ulimit, e.g. ``-n 64``."""
    key = "owner-" + os.urandom(16).hex()
    port = free_port()
    cmd = [sys.executable, "-m", "llmlab.serve.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
           f"unix:{upstream}" if isinstance(upstream, Path) else upstream,
           "--key-file", str(write_private(tmp_path / "owner.key", key + "\n")), *args]
    if ulimit:
        cmd = ["bash", "-c", f'ulimit {ulimit} && exec "$@"', "bash", *cmd]
    with open(tmp_path / "proxy.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while get(f"http://127.0.0.1:{port}/health", key)[0] == 0:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "proxy.log").read_text()
            time.sleep(0.2)
        yield proc, port, key
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def keyed_latencies(port: int, key: str, seconds: float) -> list[float]:
    """A sequential keyed client on one keep-alive connection: the seconds each GET /v1/models took (each answered
    200), for ``seconds``.  The test of a churned keys folder asserts on them; benchmarks/proxy_under_attack.py
    prints them."""
    import http.client

    conn, took = http.client.HTTPConnection("127.0.0.1", port, timeout=30), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        response.read()
        assert response.status == 200, f"the proxy answered {response.status}"
        took.append(time.monotonic() - t)
    conn.close()
    return took
