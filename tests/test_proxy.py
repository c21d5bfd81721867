"""llmlab.proxy: the key check, the path rules, and the proxy in front of the real embedded server.

The attacker's view (a second UNIX user) is tests/test_security.py; here the owner's side: registered keys and
their revocation, streaming that is not buffered, and a client that goes away aborting the generation in vLLM.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from llmlab import proxy
from llmlab.connection import write_private
from llmlab.server import free_port, health


@pytest.mark.parametrize("raw, path, refused", [
    ("/v1/completions", "/v1/completions", False),
    ("/v1/models/llmlab-tiny", "/v1/models/llmlab-tiny", False),
    ("/v1/../invocations", "/v1/../invocations", True),
    ("/v1/%2e%2e/invocations", "/v1/../invocations", True),
    ("/v1/%2E%2E%2Finvocations", "/v1/../invocations", True),
    ("/v1/%252e%252e/invocations", "/v1/%2e%2e/invocations", True),
    ("/v1/./models", "/v1/./models", True),
    ("/v1//models", "/v1//models", True),
    ("/v1\\..\\pause", "/v1\\..\\pause", True),
    ("/v1/models%00", "/v1/models\x00", True),
])
def test_paths_that_are_not_normal_are_refused(raw, path, refused):
    assert (proxy.check_path(raw.encode(), path) is not None) == refused


def test_allow_list():
    assert all(proxy.allowed(p) for p in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                          "/metrics"))
    assert not any(proxy.allowed(p) for p in ("/invocations", "/tokenize", "/pause", "/abort_requests", "/docs",
                                              "/openapi.json", "/v1", "/v1/", "/v2/x", "/health/x", "/metricsx"))


def test_keyring_owner_registered_and_revoked(tmp_path):
    owner = write_private(tmp_path / "owner.key", "owner-key-0123456789abcdef\n")
    keys = tmp_path / "keys.d"
    keys.mkdir()
    ring = proxy.KeyRing(owner, keys, recheck=0)
    assert ring.accepts("Bearer owner-key-0123456789abcdef") and ring.accepts("bearer owner-key-0123456789abcdef")
    assert not ring.accepts(None) and not ring.accepts("owner-key-0123456789abcdef")  # no scheme
    assert not ring.accepts("Basic owner-key-0123456789abcdef") and not ring.accepts("Bearer ")
    learner = "learner-1-key-xyz-0123456789"
    assert not ring.accepts(f"Bearer {learner}")
    (keys / "alice").write_text("# alice's key\n" + proxy.key_digest_line(learner, "alice") + "\nnot a digest\n")
    assert ring.accepts(f"Bearer {learner}") and ring.registered == 1
    assert learner not in (keys / "alice").read_text()  # only the hash is registered
    (keys / "alice").unlink()  # revoked, without restarting anything
    assert not ring.accepts(f"Bearer {learner}") and ring.accepts("Bearer owner-key-0123456789abcdef")


def test_keyring_refuses_an_unreadable_or_short_key(tmp_path):
    with pytest.raises(proxy.ProxyError, match="Cannot read the key file"):
        proxy.KeyRing(tmp_path / "missing.key")
    with pytest.raises(proxy.ProxyError, match="shorter than 16"):
        proxy.KeyRing(write_private(tmp_path / "short.key", "abc\n"))


def test_bad_listen_address_is_one_sentence(tmp_path):
    key = write_private(tmp_path / "k", "k" * 32)
    out = subprocess.run([sys.executable, "-m", "llmlab.proxy", "--listen", "nohostport", "--upstream",
                          f"unix:{tmp_path}/s", "--key-file", str(key)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give HOST:PORT" in out.stderr and "Traceback" not in out.stderr


def _get(url: str, key: str | None, timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError:  # nothing listens (yet)
        return 0, b""


def metric(port: int, key: str, name: str, label: str = "") -> float:
    """A counter or gauge of vLLM's /metrics (through the proxy), summed over the lines that carry ``label``."""
    status, body = _get(f"http://127.0.0.1:{port}/metrics", key)
    assert status == 200
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} ([\d.e+]+)$"
    return sum(float(m[2]) for m in re.finditer(pattern, body.decode(), re.M) if label in m[1])


def test_embedded_server_is_behind_the_proxy_on_a_private_socket(embedded, api_key):
    uds = Path(embedded["uds"])
    assert uds.is_socket() and oct(uds.parent.stat().st_mode & 0o777) == "0o700"
    base = f"http://127.0.0.1:{embedded['port']}"
    assert _get(base + "/health", None)[0] == 401 and health("127.0.0.1", embedded["port"], api_key=api_key)
    assert _get(base + "/invocations", api_key)[0] == 404  # not on the allow-list, even with the key
    assert b"vllm:num_requests_running" in _get(base + "/metrics", api_key)[1]


def test_registered_key_works_and_revocation_needs_no_restart(embedded, tmp_path):
    """A second proxy on the same socket with a keys directory: what a workshop's shared server does."""
    owner = write_private(tmp_path / "owner.key", "owner-" + os.urandom(16).hex())
    keys = tmp_path / "keys.d"
    keys.mkdir()
    learner = "learner-" + os.urandom(16).hex()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmlab.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"unix:{embedded['uds']}", "--key-file", str(owner), "--keys", str(keys)])
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        deadline = time.monotonic() + 60
        while _get(url, owner.read_text())[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.3)
        assert _get(url, learner)[0] == 401
        write_private(keys / "learner", proxy.key_digest_line(learner, "learner") + "\n")
        time.sleep(1.2)  # the key ring re-reads its files at most once a second
        assert _get(url, learner)[0] == 200
        (keys / "learner").unlink()
        time.sleep(1.2)
        assert _get(url, learner)[0] == 401 and _get(url, owner.read_text())[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_stream_is_not_buffered_and_a_client_that_leaves_aborts_the_generation(embedded, api_key):
    """The first tokens arrive while vLLM still runs the request; closing the connection then ends the request
    in vLLM (it would otherwise generate all 400 tokens for nobody)."""
    port = embedded["port"]
    tokens, finished = (metric(port, api_key, "vllm:generation_tokens_total"),
                        metric(port, api_key, "vllm:request_success_total"))
    body = ('{"model": "llmlab-tiny", "prompt": "Once", "max_tokens": 400, "stream": true, "ignore_eos": true}')
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(65536)
        assert received.startswith(b"HTTP/1.1 200")
        # the first tokens are here while vLLM still generates the request: streamed, not buffered
        assert metric(port, api_key, "vllm:num_requests_running") == 1
    deadline = time.monotonic() + 30
    while metric(port, api_key, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still runs the request 30 s after the client left"
        time.sleep(0.2)
    # aborted: fewer than the 400 tokens asked for, and not counted as finished (vLLM 0.32 counts no aborts)
    assert metric(port, api_key, "vllm:generation_tokens_total") - tokens < 400
    assert metric(port, api_key, "vllm:request_success_total") == finished
