"""llmlab.serve.proxy: the key check, the path rules, and the proxy in front of the real embedded server.

The attacker's view (a second UNIX user) is tests/cluster/test_security.py; here the owner's side: registered keys and
their revocation, streaming that is not buffered, and a client that goes away aborting the generation in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import io
import json
import logging
import os
import re
import socket
import socketserver
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from proxy_helpers import get as _get
from proxy_helpers import proxy_process, stand_in_vllm
from slurm_helpers import wait_for

from llmlab.serve.info import write_private
from llmlab.serve.proc import free_port, health
from llmlab.serve.proxy import answers, command, policy
from llmlab.serve.proxy import keys as proxy_keys
from llmlab.serve.proxy import limits as proxy_limits


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
    assert (policy.check_path(raw.encode(), path) is not None) == refused


def test_allow_list():
    assert all(policy.allowed(p) for p in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                          "/metrics"))
    assert not any(policy.allowed(p) for p in ("/invocations", "/tokenize", "/pause", "/abort_requests", "/docs",
                                              "/openapi.json", "/v1", "/v1/", "/v2/x", "/health/x", "/metricsx"))


def test_keyring_owner_registered_and_revoked(tmp_path):
    owner = write_private(tmp_path / "owner.key", "owner-key-0123456789abcdef\n")
    keys = tmp_path / "keys.d"
    keys.mkdir()
    ring = proxy_keys.KeyRing(owner, keys, recheck=0)
    assert ring.accepts("Bearer owner-key-0123456789abcdef") and ring.accepts("bearer owner-key-0123456789abcdef")
    assert not ring.accepts(None) and not ring.accepts("owner-key-0123456789abcdef")  # no scheme
    assert not ring.accepts("Basic owner-key-0123456789abcdef") and not ring.accepts("Bearer ")
    learner = "learner-1-key-xyz-0123456789"
    assert not ring.accepts(f"Bearer {learner}")
    (keys / "alice").write_text("# alice's key\n" + proxy_keys.key_digest_line(learner, "alice") + "\nnot a digest\n")
    assert ring.accepts(f"Bearer {learner}") and ring.registered == 1
    assert learner not in (keys / "alice").read_text()  # only the hash is registered
    (keys / "alice").unlink()  # revoked, without restarting anything
    assert not ring.accepts(f"Bearer {learner}") and ring.accepts("Bearer owner-key-0123456789abcdef")
    assert not ring.revoked(f"Bearer {learner}")  # gone, not revoked: the proxy says "wrong key"
    # llmlab revoke's way: a file of the owner's under the learner's name, listing the digests it refuses
    (keys / "alice").write_text("# revoked by the instructor\nrevoked " + proxy_keys.key_digest_line(learner, "alice")
                                .split()[0] + "\n")
    assert not ring.accepts(f"Bearer {learner}")
    assert ring.revoked(f"Bearer {learner}") and not ring.revoked("Bearer someone-else-0123456789")
    assert not ring.revoked(None) and not ring.revoked(learner)  # no scheme: not even looked up


def test_keyring_reads_the_keys_folder_off_the_event_loop(tmp_path, monkeypatch):
    """security-review-2, finding 3: a re-read of keys/ that takes a second (10,000 junk names, a slow user
    database) held the proxy's event loop for as long, each time the folder changed.  Under a running loop the
    key ring reads in a worker thread: the loop is never held, and the new key still counts once read.  The
    stand-in read takes 3 s, so a loop held by it stands 3 s and the bound (1.5 s) leaves room for a loaded 2-core
    machine's scheduling."""
    from llmlab.serve import keyring

    owner = write_private(tmp_path / "owner.key", "owner-key-0123456789abcdef\n")
    keys = tmp_path / "keys.d"
    keys.mkdir()
    ring = proxy_keys.KeyRing(owner, keys, recheck=0.1)
    load = keyring.load
    monkeypatch.setattr(keyring, "load", lambda *a, **k: time.sleep(3.0) or load(*a, **k))
    learner = "learner-1-key-xyz-0123456789"
    (keys / "instructor").write_text(proxy_keys.key_digest_line(learner) + "\n")

    async def probe() -> tuple[float, bool]:
        held, accepted, end = 0.0, False, time.monotonic() + 7.0
        while time.monotonic() < end:
            t = time.monotonic()
            accepted = ring.accepts(f"Bearer {learner}") or accepted
            await asyncio.sleep(0.01)
            held = max(held, time.monotonic() - t - 0.01)
        return held, accepted

    held, accepted = asyncio.run(probe())
    assert held < 1.5 and accepted, f"the loop was held {held:.3f} s; the key counted: {accepted}"


def test_keyring_refuses_an_unreadable_or_short_key(tmp_path):
    with pytest.raises(answers.ProxyError, match="Cannot read the key file"):
        proxy_keys.KeyRing(tmp_path / "missing.key")
    with pytest.raises(answers.ProxyError, match="shorter than 16"):
        proxy_keys.KeyRing(write_private(tmp_path / "short.key", "abc\n"))


def test_bad_listen_address_is_one_sentence(tmp_path):
    key = write_private(tmp_path / "k", "k" * 32)
    out = subprocess.run([sys.executable, "-m", "llmlab.serve.proxy", "--listen", "nohostport", "--upstream",
                          f"unix:{tmp_path}/s", "--key-file", str(key)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give HOST:PORT" in out.stderr and "Traceback" not in out.stderr


def metric(port: int, key: str, name: str, label: str = "") -> float:
    """A counter or gauge of vLLM's /metrics (through the proxy), summed over the lines that carry ``label``."""
    status, body = _get(f"http://127.0.0.1:{port}/metrics", key)
    assert status == 200
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} ([\d.e+]+)$"
    return sum(float(m[2]) for m in re.finditer(pattern, body.decode(), re.M) if label in m[1])


def test_embedded_server_is_behind_the_proxy_on_a_private_socket(embedded, api_key):
    uds = Path(embedded.extra["uds"])
    assert uds.is_socket() and oct(uds.parent.stat().st_mode & 0o777) == "0o700"
    base = f"http://127.0.0.1:{embedded.port}"
    assert _get(base + "/health", None)[0] == 401 and health("127.0.0.1", embedded.port, api_key=api_key)
    assert _get(base + "/invocations", api_key)[0] == 404  # not on the allow-list, even with the key
    assert b"vllm:num_requests_running" in _get(base + "/metrics", api_key)[1]


def test_embedded_proxy_keeps_off_the_core_vllm_reserves_for_its_frontend(embedded):
    """vLLM-CPU binds its compute threads away from its highest CPU and runs its API server there; the proxy
    runs on the others (llmlab.serve.proxy.proxy_cpus)."""
    ours = sorted(os.sched_getaffinity(0))
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    proxies = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"llmlab.serve.proxy" in cmdline and f"127.0.0.1:{embedded.port}".encode() in cmdline:
            proxies.append(pid)
    assert len(proxies) == 1
    assert sorted(os.sched_getaffinity(proxies[0])) == (ours[:-1] if len(ours) > 1 else ours)
    log = Path(embedded.log).read_text(errors="replace")
    if len(ours) > 1 and "reserved_cpus=" in log:  # vLLM's own account of which CPU it keeps for its frontend
        assert f"reserved_cpus=[{ours[-1]}]" in log


def test_proxy_listens_with_a_backlog_for_a_burst_of_connections(embedded):
    """asyncio's default backlog (100) makes a burst of new connections (a workshop's threaded cells, a c=256 load
    test) wait on SYN retries of a second or more; ``ss`` shows a listening socket's backlog as its Send-Q."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{embedded.port}"], capture_output=True, text=True, check=True)
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(out.stdout.split()[2]) == min(proxy_limits.BACKLOG, somaxconn)


def test_registered_key_works_and_revocation_needs_no_restart(embedded, tmp_path):
    """A second proxy on the same socket with a keys directory: what a workshop's shared server does."""
    owner = write_private(tmp_path / "owner.key", "owner-" + os.urandom(16).hex())
    keys = tmp_path / "keys.d"
    keys.mkdir()
    learner = "learner-" + os.urandom(16).hex()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmlab.serve.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"unix:{embedded.extra['uds']}", "--key-file", str(owner), "--keys", str(keys)])
    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        deadline = time.monotonic() + 60
        while _get(url, owner.read_text())[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.3)
        assert _get(url, learner)[0] == 401
        write_private(keys / "learner", proxy_keys.key_digest_line(learner, "learner") + "\n")
        # the key ring re-reads its files in the background about once a second, later on a starved machine
        wait_for(lambda: _get(url, learner)[0] == 200, 30, "the proxy to accept the registered key", poll=0.2)
        (keys / "learner").unlink()
        wait_for(lambda: _get(url, learner)[0] == 401, 30, "the proxy to refuse the removed key", poll=0.2)
        assert _get(url, owner.read_text())[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_stream_is_not_buffered_and_a_client_that_leaves_aborts_the_generation(embedded, api_key):
    """The first tokens reach the client while vLLM still generates: a client that reads three of them and leaves
    ends the request in vLLM, which generated far fewer tokens than asked.  A proxy that buffered the answer would
    send the first token only after the last one: every token would have been generated.

    64 choices of 500 tokens (the context's worth) keep the engine busy for 9 s on a quiet machine: with eight
    (3.4 s), a loaded CI machine generated all 4,000 tokens before the disconnect reached vLLM (its API server and
    the proxy starved of CPU while the engine ran on), though on a quiet one the abort lands 0.14 s after the client
    leaves.  The request's end is read from counters, never from the running gauge at one moment (CI once read 0
    there: the request had ended before a slow scrape)."""
    port = embedded.port
    asked = 64 * 500
    tokens, finished = (metric(port, api_key, "vllm:generation_tokens_total"),
                        metric(port, api_key, "vllm:request_success_total"))
    body = ('{"model": "llmlab-tiny", "prompt": "Once", "max_tokens": 500, "n": 64, "stream": true, '
            '"ignore_eos": true}')
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(65536)
        assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    deadline = time.monotonic() + 60
    while metric(port, api_key, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vLLM still runs the request 60 s after the client left"
        time.sleep(0.2)
    # aborted: fewer tokens than asked for, and no choice counted as finished (vLLM 0.32 counts no aborts)
    assert metric(port, api_key, "vllm:generation_tokens_total") - tokens < asked
    assert metric(port, api_key, "vllm:request_success_total") == finished


# -- HTTP at the byte level: what the proxy's own parser must get right (the real server behind it) -------------

def _exchange(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes, read until the proxy closes the connection (each case ends with a closing request)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        received = b""
        while chunk := s.recv(65536):
            received += chunk
    return received


def _statuses(answer: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.[01] (\d{3}) ", answer)]  # bodies hold no such text


def _get_line(path: str, key: str | None, close: bool = False, version: str = "1.1") -> bytes:
    return (f"GET {path} HTTP/{version}\r\nHost: x\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "")
            + ("Connection: close\r\n" if close else "") + "\r\n").encode()


def test_keep_alive_answers_several_requests_on_one_connection(embedded, api_key):
    answer = _exchange(embedded.port, _get_line("/v1/models", api_key) + _get_line("/health", api_key)
                       + _get_line("/v1/models", api_key, close=True))
    assert _statuses(answer) == [200, 200, 200] and answer.count(b'"llmlab-tiny"') >= 2


def test_a_pipelined_request_without_the_key_is_judged_on_its_own(embedded, api_key):
    """Request smuggling: a second request behind an authorised one, in the same packet, is still checked; its 401
    is the connection's last answer (security-review-3 F5b), and nothing behind it is answered."""
    answer = _exchange(embedded.port, _get_line("/v1/models", api_key) + _get_line("/invocations", api_key)
                       + _get_line("/tokenize", None) + _get_line("/v1/models", api_key, close=True))
    assert _statuses(answer) == [200, 404, 401]


def test_ambiguous_body_length_is_refused(embedded, api_key):
    body = b'{"model": "llmlab-tiny", "prompt": "Once", "max_tokens": 2}'
    data = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\nContent-Length: "
            f"{len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    data += b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    assert _statuses(_exchange(embedded.port, data)) == [400]


def test_a_chunked_request_body_is_forwarded(embedded, api_key):
    body = b'{"model": "llmlab-tiny", "prompt": "Once upon", "max_tokens": 3}'
    data = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\nContent-Type: "
            "application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    data += b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    answer = _exchange(embedded.port, data)
    assert _statuses(answer) == [200] and b'"completion_tokens":3' in answer.replace(b" ", b"")


def test_expect_100_continue_is_honoured(embedded, api_key):
    body = b'{"model": "llmlab-tiny", "prompt": "Once", "max_tokens": 2}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", embedded.port), timeout=30) as s:
        s.sendall(head.encode())
        assert s.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")  # before the body is sent
        s.sendall(body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert _statuses(answer) == [200]


@pytest.mark.parametrize("data, status", [
    (b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n", 405),
    (b"PUT /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n\r\n", 405),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"this is not HTTP\r\n\r\n", 400),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nUpgrade: websocket\r\n"
     b"Connection: Upgrade\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Length: 99999999999\r\n\r\n",
     413),
], ids=["head", "put", "huge-head", "not-http", "websocket-upgrade", "huge-body"])
def test_requests_the_proxy_does_not_forward_are_answered_and_closed(embedded, api_key, data, status):
    answer = _exchange(embedded.port, data.replace(b"{key}", api_key.encode()))
    assert _statuses(answer) == [status] and b'"error"' in answer


def test_http_1_0_gets_its_answer_and_the_connection_closes(embedded, api_key):
    answer = _exchange(embedded.port, _get_line("/v1/models", api_key, version="1.0"))
    assert _statuses(answer) == [200] and answer.rstrip().endswith(b"}") and b"chunked" not in answer.lower()


def test_upstream_that_does_not_answer_is_503_with_the_reason(tmp_path):
    key = "owner-" + os.urandom(16).hex()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmlab.serve.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"unix:{tmp_path}/no-vllm.sock", "--key-file", str(write_private(tmp_path / "k", key))])
    try:
        deadline = time.monotonic() + 60
        while (got := _get(f"http://127.0.0.1:{port}/v1/models", key))[0] == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.3)
        assert got[0] == 503 and b"llmlab status" in got[1]
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0  # SIGTERM is a clean stop


# -- issue 26: a proxy of the test's own in front of a stand-in for vLLM (no engine needed) ---------------------


def test_a_large_body_sent_in_one_write_is_not_taken_for_a_large_head(tmp_path):
    """P3: the head-size limit counts the head only, however much body arrives in the same read."""
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds) as (_, port, key):
        body = json.dumps({"model": "llmlab-tiny", "prompt": "hello " * 20000, "max_tokens": 1}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        answer = _exchange(port, head + body)
    assert len(body) > 100_000 and _statuses(answer) == [200]
    assert f'"body_bytes": {len(body)}'.encode() in answer  # all of it reached vLLM's place


def test_a_head_larger_than_the_limit_is_still_refused_when_it_comes_in_pieces(tmp_path):
    """The client goes on sending after the proxy refused: its sends must not break (the proxy lingers, reading
    and dropping), and it reads the 431 that says why (CI's stop 48 saw a broken pipe instead)."""
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds) as (_, port, key):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(f"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer {key}\r\n".encode())
            for i in range(24):
                s.sendall(b"X-Filler: " + b"a" * 4000 + b"\r\n")
                if i == 16:  # past the 64 KiB limit: the proxy answers and closes meanwhile
                    time.sleep(0.5)
            s.sendall(b"\r\n")
            answer = b"".join(iter(lambda: s.recv(65536), b""))
    assert _statuses(answer) == [431]


def test_a_flood_of_bad_entries_in_the_keys_folder_writes_a_bounded_proxy_log(tmp_path):
    """S4c: learners who fill a room's keys/ with files (thousands, long names, lines that are not digests) must
    not fill proxy.log, which lands in the instructor's home quota: each re-read of keys/ is logged, and each log
    line is cut to a width (LogBudget)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    for i in range(2000):
        (keys / f"learner-{i:04d}-{'x' * 60}").write_text("not a digest\n")
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, _key):
        for n in range(4):
            (keys / "flood").write_text("still not a digest\n" * (50_000 + n))
            time.sleep(1.1)  # the key ring looks at its files at most once a second, when a request comes
            assert _get(f"http://127.0.0.1:{port}/v1/models", "any-key-at-all")[0] == 401
    log = (tmp_path / "proxy.log").read_text()
    assert len(log) < 64 * 2**10 and len(log.splitlines()) <= 60, f"{len(log):,} characters: {log[-300:]}"


def test_the_proxy_log_has_a_budget_of_lines_and_of_line_width():
    """LogBudget: a burst of lines, then one per interval, each cut at a width; what was held back is counted."""
    out = io.StringIO()
    budget = proxy_limits.LogBudget(burst=5, every=3600, width=100)
    handler = logging.StreamHandler(out)
    handler.addFilter(budget)
    logger = logging.getLogger("llmlab.test.log-budget")
    logger.addHandler(handler)
    logger.propagate = False
    for i in range(10_000):
        logger.warning("line %d %s", i, "x" * 500)
    lines = out.getvalue().splitlines()
    assert len(lines) == 6 and all(len(line) < 160 for line in lines) and "suppressed" in lines[-1]
    budget.every = 1e-6  # time enough has passed: the next line goes out, saying how many were held back
    logger.warning("after the flood")
    assert out.getvalue().splitlines()[-1] == "(9995 log lines suppressed) after the flood"


def test_proxy_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path):
    """P2: a job that inherits a soft limit of 1024 open files would refuse connections long before the hard
    limit; the proxy raises the soft limit at start (here: soft 64)."""
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds, ulimit="-S -n 64") as (proc, _, _):
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
    soft, hard = re.search(r"Max open files\s+(\S+)\s+(\S+)", limits).groups()
    assert soft == hard != "64", limits


def test_proxy_reports_the_port_it_bound_in_a_private_ready_file(tmp_path):
    """Bind, then publish: with port 0 the system picks a free port, and the proxy writes it (0600) once it
    listens; a caller reads the port from there instead of choosing one that someone else may hold."""
    key = write_private(tmp_path / "owner.key", "owner-" + os.urandom(16).hex() + "\n")
    ready = tmp_path / "run" / "proxy.ready"
    with stand_in_vllm(tmp_path) as uds:
        proc = subprocess.Popen([sys.executable, "-m", "llmlab.serve.proxy", "--listen", "127.0.0.1:0", "--upstream",
                                 f"unix:{uds}", "--key-file", str(key), "--ready-file", str(ready)])
        try:
            bound = command.wait_bound(ready, lambda: proc.poll() is None, tmp_path / "none.log", timeout=60)
            assert os.stat(ready).st_mode & 0o777 == 0o600 and bound["pid"] == proc.pid
            assert bound["host"] == "127.0.0.1" and bound["port"] > 0
            assert _get(f"http://127.0.0.1:{bound['port']}/v1/models", key.read_text().strip())[0] == 200
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def test_proxy_on_a_port_someone_holds_exits_with_a_sentence_and_writes_no_ready_file(tmp_path):
    key = write_private(tmp_path / "owner.key", "owner-" + os.urandom(16).hex() + "\n")
    ready = tmp_path / "proxy.ready"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "llmlab.serve.proxy", "--listen", f"127.0.0.1:{port}",
                              "--upstream", f"unix:{tmp_path}/vllm.sock", "--key-file", str(key), "--ready-file",
                              str(ready)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr and not ready.exists()
    assert f"127.0.0.1:{port}" in out.stderr and "in use" in out.stderr


def test_a_learner_revoked_mid_notebook_is_told_so_by_the_proxy(tmp_path):
    """A room's learner whose key the instructor revokes while a notebook runs gets the proxy's 401 on the next
    request: it says the access was revoked and whom to ask, not "wrong key" (a key that was never registered
    still gets that)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    learner = "learner-key-" + os.urandom(12).hex()
    (keys / "alice").write_text(proxy_keys.key_digest_line(learner, "alice") + "\n")
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, _key):
        url = f"http://127.0.0.1:{port}/v1/models"
        assert _get(url, learner)[0] == 200
        (keys / "alice").write_text("# revoked by the instructor\nrevoked " +
                                    proxy_keys.key_digest_line(learner, "alice").split()[0] + "\n")
        answer = wait_for(lambda: (a := _get(url, learner))[0] == 401 and a, 30,  # the key ring notices in about 1 s
                          "the proxy to refuse the revoked key", poll=0.2)
        assert answer[0] == 401 and b"revoked by its owner" in answer[1] and b"ask your instructor" in answer[1]
        wrong = _get(url, "never-registered-0123456789")
        assert wrong[0] == 401 and b"missing or wrong API key" in wrong[1]


def test_a_keys_folder_that_keeps_changing_logs_only_changes_of_who_is_in(tmp_path, caplog):
    """A room's keys/ changes every time anyone writes there; the proxy logs the count of registered keys when it
    changes, not at every re-read (it logged every second while a learner churned a junk file)."""
    owner = write_private(tmp_path / "owner.key", "owner-key-0123456789abcdef\n")
    keys = tmp_path / "keys.d"
    keys.mkdir()
    ring = proxy_keys.KeyRing(owner, keys, recheck=0)
    caplog.set_level(logging.INFO, logger=proxy_keys.log.name)
    (keys / "alice").write_text(proxy_keys.key_digest_line("learner-1-key-xyz-0123456789", "alice") + "\n")
    assert ring.accepts("Bearer learner-1-key-xyz-0123456789") and ring.registered == 1
    for n in range(5):  # junk made and removed: the folder changes, who is in does not
        (keys / f"junk{n}").write_text("x")
        ring.refresh(force=True)
        (keys / f"junk{n}").unlink()
        ring.refresh(force=True)
    said = [r.getMessage() for r in caplog.records if "registered key(s)" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("1 registered key(s)"), said


# -- issue 53: the doors security-review-3 found -----------------------------------------------------------------


class _Squatter:
    """Whoever binds a model job's port after the job ended (F1): answers every request 200 "EVE" with a made-up
    proof, and keeps every byte it was sent."""

    def __init__(self, port: int):
        import socketserver
        import threading

        got = self.got = bytearray()

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(5)
                while True:
                    try:
                        data = self.request.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    got.extend(data)
                    if b"\r\n\r\n" in data:
                        self.request.sendall(b"HTTP/1.1 200 OK\r\nx-llmlab-proof: " + b"0" * 64
                                             + b"\r\ncontent-length: 3\r\n\r\nEVE")

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _post(port: int, key: str, body: dict) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_router_sends_a_model_jobs_key_and_prompts_only_to_that_jobs_own_proxy(tmp_path):
    """F1 of security-review-3: `llmlab launch A B`'s front routes to each model job's proxy at the host:port it read
    once.  After job A ends, anyone may bind that port; the router used to send it A's key with every request, and
    the learners' prompts, and relay its answers as model A's.  Now the router asks each connection to prove it
    holds A's key (HMAC of a fresh nonce, on the same connection) before it sends a byte of the request: the
    squatter gets neither key nor prompt, and the learner a 503 that says why."""
    member, router_dir = tmp_path / "member", tmp_path / "router"
    member.mkdir()
    router_dir.mkdir()
    secret = "alice private prompt: my exam answer is 42"
    with stand_in_vllm(member) as uds:
        with proxy_process(member, uds) as (_, member_port, member_key):
            upstream = f"A=http://127.0.0.1:{member_port}"
            with proxy_process(router_dir, upstream, "--upstream-key-file", f"A={member / 'owner.key'}") as (
                    _, port, key):
                status, body = _post(port, key, {"model": "A", "prompt": "hello"})
                assert status == 200 and json.loads(body)["path"] == "/v1/completions", body  # the real job answers
                # ... then job A ends (its proxy exits), and someone binds its port
        squatter = _Squatter(member_port)
        try:
            with proxy_process(router_dir, upstream, "--upstream-key-file", f"A={member / 'owner.key'}") as (
                    _, port, key):
                status, body = _post(port, key, {"model": "A", "prompt": secret})
                listed, _ = _get(f"http://127.0.0.1:{port}/v1/models", key)
        finally:
            squatter.close()
    assert status == 503 and b"no longer proves it is that job" in body, body
    assert b"EVE" not in body and listed != 200
    assert squatter.got, "the router never dialled the port (the test would prove nothing)"
    assert member_key.encode() not in squatter.got and secret.encode() not in squatter.got
    assert b"authorization" not in squatter.got.lower()


def test_a_proxy_answers_an_identity_challenge_without_a_key_and_nothing_else(tmp_path):
    """The member's side of F1's fix: ``GET /llmlab/identity`` with a nonce is answered keyless with the owner key's
    HMAC of it (no other use of the key gives these bytes: identity_proof is labelled), on a connection that stays
    open for the keyed request that follows; a bad nonce is 400; every other route still wants the key."""
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds) as (_, port, key):
        nonce = os.urandom(32).hex().encode()
        got = _exchange(port, proxy_keys.identity_request(nonce)
                        + _get_line("/v1/models", key, close=True))
        assert _statuses(got) == [200, 200]
        assert b"x-llmlab-proof: " + proxy_keys.identity_proof(key, nonce) in got
        assert _statuses(_exchange(port, proxy_keys.identity_request(b"x" * 64))) == [400]
        assert _get(f"http://127.0.0.1:{port}/v1/models", None)[0] == 401


def test_bodies_vllm_has_taken_stop_counting_toward_the_proxys_budget(tmp_path):
    """F4 of security-review-3: a learner sends four requests of exactly 32 MiB whose answers take minutes (a long
    non-streamed generation).  Their bodies are in vLLM's hands at once, yet they stayed counted in MAX_BODIES until
    vLLM answered, and every other POST, the owner's too, got 503.  Now a body stops counting once vLLM's socket has
    taken it: the owner is answered while the four wait."""
    import threading

    keys = tmp_path / "keys"
    learner = "learner-" + os.urandom(16).hex()
    keys.write_text(proxy_keys.key_digest_line(learner) + "\n")
    size = policy.MAX_BODY
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {learner}\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    held = []

    def send_whole_and_wait():
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        held.append(s)
        s.sendall(head + b"x" * size)  # whole; the answer is not read

    with stand_in_vllm(tmp_path, slow_over=2**20, slow_s=10) as uds, \
            proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, key):
        senders = [threading.Thread(target=send_whole_and_wait) for _ in range(policy.MAX_BODIES // size)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(60)
        time.sleep(2)  # the stand-in has read them all and "generates"
        body = json.dumps({"model": "m", "prompt": "the owner's turn"}).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        for s in held:
            s.close()
    assert _statuses(answer) == [200], answer[:300]


def test_on_a_shared_server_each_learner_has_a_prefix_cache_of_their_own(embedded, tmp_path):
    """F6 of security-review-3: every llmlab server reports ``cached_tokens`` per request, so one learner could test
    whether another had sent a prompt (the shared prefix cache as an oracle).  On a server with registered keys the
    proxy now puts each learner's own salt (an HMAC under the owner's key) before the ``cache_salt`` they send: a
    learner's repeat still hits their own cache, their own salts still part their requests (lesson 13), and another
    learner's identical prompt, whatever salt either sends, finds nothing."""
    import httpx

    owner = write_private(tmp_path / "owner.key", "owner-" + os.urandom(16).hex())
    keys = tmp_path / "keys.d"
    keys.mkdir()
    alice, bob = ("learner-" + os.urandom(16).hex() for _ in range(2))
    for name, key in (("alice", alice), ("bob", bob)):
        write_private(keys / name, proxy_keys.key_digest_line(key, name) + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmlab.serve.proxy", "--listen", f"127.0.0.1:{port}", "--upstream",
                             f"unix:{embedded.extra['uds']}", "--key-file", str(owner), "--keys", str(keys)])
    prompt = "Alice's private question, long enough to fill several cache blocks: " + os.urandom(24).hex() * 6

    def cached(key: str, **extra) -> int:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"model": embedded.model, "prompt": prompt, "max_tokens": 1, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    try:
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/v1/models", bob)[0] == 200, 30, "the registered keys")
        assert cached(alice) == 0
        assert cached(alice) > 0  # her own repeat: her cache
        assert cached(bob) == 0  # the same prompt from another learner: nothing cached for him
        assert cached(alice, cache_salt="room") == 0 < cached(alice, cache_salt="room")  # her salts part her requests
        assert cached(bob, cache_salt="room") == 0  # the same salt from him: still not her cache
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _learner_keys(tmp_path: Path) -> tuple[Path, str]:
    """A keys file with one learner's digest, and that learner's key."""
    learner = "learner-" + os.urandom(16).hex()
    keys = tmp_path / "keys"
    keys.write_text(proxy_keys.key_digest_line(learner) + "\n")
    return keys, learner


def _post_raw(port: int, key: str, size: int, close: bool = True) -> bytes:
    """A POST of ``size`` body bytes, sent whole; its answer read to the end (the proxy or the client closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                   f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode() + b"x" * size)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def test_a_learners_bodies_hold_only_their_keys_share_of_the_budget(tmp_path):
    """F4 of security-review-3, the rest: a learner held 31 bodies of 4 MiB one byte short, never finished (124 MiB
    of the proxy's 128), and the owner's 8 MiB prompt, the largest body still arriving once the budget was passed,
    was the one refused (503).  Now a learner's key holds at most KEY_BODIES (their largest arriving body is
    refused beyond it, with a sentence naming the share), and the owner's POST passes while the learner holds all
    of theirs."""
    keys, learner = _learner_keys(tmp_path)
    size = 4 * 2**20
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {learner}\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    held = []
    with stand_in_vllm(tmp_path) as uds, proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, key):
        for _ in range(31):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            held.append(s)
            with contextlib.suppress(OSError):  # refused part way: the proxy answered and shut its side
                s.sendall(head + b"x" * (size - 1))
        time.sleep(1)
        owner = _post_raw(port, key, 8 * 2**20)
        refused = b""
        for s in held:
            s.settimeout(0.2)
            with contextlib.suppress(OSError):
                refused += s.recv(65536)
            s.close()
    assert _statuses(owner) == [200], owner[:300]
    assert b"your key's requests have 32 MiB of bodies on their way" in refused, refused[:300]


def test_a_learners_key_has_a_limit_on_requests_in_progress(tmp_path):
    """F5 of security-review-3, the rest: one learner's requests in progress had no bound but their connections'
    (16 waiting on each, for as many connections as the files allow).  Now a learner's key has at most
    KEY_REQUESTS being sent, waiting or being answered, all connections together: the next one is a 429 that names
    the limit (answered in turn: a client that pipelines without reading stays held back by TCP, where closing made
    it reconnect at once); the owner and another learner are served meanwhile, and the learner again once theirs
    are answered."""
    keys, learner = _learner_keys(tmp_path)
    other = "learner-" + os.urandom(16).hex()
    with open(keys, "a") as f:
        f.write(proxy_keys.key_digest_line(other) + "\n")
    slow = json.dumps({"prompt": "x" * 2000}).encode()  # over slow_over: each answered 15 s later
    one = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {learner}\r\n"
           f"Content-Length: {len(slow)}\r\n\r\n").encode() + slow
    connections = policy.KEY_REQUESTS // 16 + 2
    held = []
    with stand_in_vllm(tmp_path, slow_over=1000, slow_s=15) as uds, \
            proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, key):
        for _ in range(connections):  # 16 pipelined on each: more than KEY_REQUESTS in all
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(one * 16)
            held.append(s)
        url = f"http://127.0.0.1:{port}/v1/models"
        status, said = wait_for(lambda: (a := _get(url, learner))[0] == 429 and a, 20, "the learner's limit", poll=0.5)
        assert f"your key has {policy.KEY_REQUESTS} requests in progress".encode() in said, said
        assert _get(url, key)[0] == 200 and _get(url, other)[0] == 200
        for s in held:
            s.close()
        wait_for(lambda: _get(url, learner)[0] == 200, 20, "the learner's requests to end with their connections")


def test_revoking_a_learner_closes_their_open_connections_at_once(tmp_path):
    """F5b of security-review-3: a revoked learner kept the connections opened before the revocation, answering 401
    after 401 (fixed first by closing at the next request); still, an idle one stayed up to IDLE_TIMEOUT (30 s), and
    an answer being generated went on to its end.  Now the proxy closes every connection that showed the revoked
    key as soon as it reads the keys again (about a second): the idle one, and the one waiting for a slow answer
    (whose upstream request is closed, so vLLM aborts it)."""
    keys, learner = _learner_keys(tmp_path)
    slow = json.dumps({"prompt": "x" * 2000}).encode()
    with stand_in_vllm(tmp_path, slow_over=1000, slow_s=15) as uds, \
            proxy_process(tmp_path, uds, "--keys", str(keys)) as (_, port, _key):
        idle = socket.create_connection(("127.0.0.1", port), timeout=10)
        idle.sendall(_get_line("/v1/models", learner))
        first = b""
        while b'"body_bytes"' not in first:
            first += idle.recv(65536)
        waiting = socket.create_connection(("127.0.0.1", port), timeout=10)
        waiting.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {learner}\r\n"
                         f"Content-Length: {len(slow)}\r\n\r\n").encode() + slow)
        time.sleep(1)
        keys.write_text("")  # the instructor revokes the learner
        for s in (idle, waiting):  # each ends (b"") within its 10 s timeout, with nothing more said
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            s.close()
            assert got == b"", got[:200]


def test_a_vllm_whose_socket_queue_is_full_makes_requests_wait_not_fail(tmp_path):
    """vLLM's Unix socket holds a backlog of connections not yet accepted; when it is full, a connect fails at once
    with EAGAIN under uvloop (a TCP client's SYN would be retried).  A room of 100 on two busy cores lost 3,855
    requests so, told the server "does not answer" (benchmarks/results/cpu-room-10-replay-2026-11-29).  The proxy
    tries again (router.UDS_RETRY), so those requests wait until vLLM accepts, and are answered."""
    accepting = threading.Event()
    accepting.set()
    with stand_in_vllm(tmp_path, backlog=1, accepting=accepting) as uds, proxy_process(tmp_path, uds) as (_, port, key):
        accepting.clear()  # busy: the socket's queue of one fills, the rest of the connects get EAGAIN
        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(_get, f"http://127.0.0.1:{port}/v1/models", key, 30) for _ in range(8)]
            time.sleep(1.5)
            accepting.set()
            statuses = [a.result()[0] for a in answers]
    assert statuses == [200] * 8, f"{statuses}: {(tmp_path / 'proxy.log').read_text()[-2000:]}"


@contextlib.contextmanager
def _streaming_stand_in(folder: Path, total: int):
    """vLLM's place on a Unix socket answering every request with a chunked stream of ``total`` bytes, written as
    fast as the proxy takes them; yields a dict that says how the stream ended (``"sent"`` or ``"broken"``, and the
    bytes written by then)."""
    ended: dict = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            piece, sent = b"data: " + b"x" * 1000 + b"\n\n", 0
            try:
                while sent < total:
                    self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                    sent += len(piece)
                self.wfile.write(b"0\r\n\r\n")
                ended.update(how="sent", bytes=sent)
            except OSError:
                ended.update(how="broken", bytes=sent)

        def log_message(self, *args):
            pass

    server = socketserver.ThreadingUnixStreamServer(str(folder / "vllm.sock"), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield ended
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_stops_reading_a_streamed_answer_is_dropped_after_the_send_timeout(tmp_path, monkeypatch):
    """A client that sends a streamed request and never reads the answer: the proxy stops reading vLLM once the
    client's socket is full (its memory stays bounded), and after SEND_TIMEOUT of nothing read it drops the client and
    closes vLLM's connection, so vLLM aborts the generation.  Before the fix the timeout held only between requests:
    mid-answer the connection, vLLM's and the key's request slot stayed for as long as the client lived (lesson 19)."""
    monkeypatch.setenv("LLMLAB_PROXY_SEND_TIMEOUT", "2")
    with _streaming_stand_in(tmp_path, 64 * 2**20) as ended, \
            proxy_process(tmp_path, tmp_path / "vllm.sock") as (proc, port, key):
        reader = socket.create_connection(("127.0.0.1", port))
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"stream": true}'
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %b\r\ncontent-length: %d\r\n\r\n"
        reader.sendall(head % (key.encode(), len(body)) + body)
        t0 = time.monotonic()
        wait_for(lambda: ended, 30, "the stand-in's stream to end (sent whole, or cut by the proxy)", poll=0.1)
        took = time.monotonic() - t0
        log = (tmp_path / "proxy.log").read_text()
        reader.setblocking(False)
        with contextlib.suppress(OSError):  # what the kernel held for it, then the end: a reset (the proxy aborted)
            while reader.recv(2**20):
                pass
        reader.close()
    assert ended["how"] == "broken" and ended["bytes"] < 8 * 2**20, ended  # held back, then cut: not 64 MiB
    assert 2 <= took < 20, took
    assert "left its answers unread for 2 s: connection dropped mid-answer" in log, log
