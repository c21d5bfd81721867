"""The key-checking proxy under attack by a learner of its room (issue 37; docs/security.md): the figures behind the
tests in tests/cluster/test_security.py, printed.

Three attacks, each against a proxy of this script's own in front of a stand-in for vLLM (tests/proxy_helpers.py: no
engine, nothing else on the machine is touched):

- ``keys``: a room's ``keys/`` holds ``--junk`` names that are no user's key file, and one file is made and removed
  every 0.3 s; a sequential keyed client (one keep-alive connection) measures each GET /v1/models, first with a
  quiet folder, then with the churn.  The junk must belong to another user (the proxy's own files are the
  instructor's, which count), so this attack needs root: its files are chowned to ``nobody``.
- ``memory``: a learner with a valid key holds ``--connections`` connections, each with a 32 MiB body one byte short
  (never finished), then sends one 32 MiB body of ten million empty JSON objects to a ``--route prefix`` proxy
  (two stand-in replicas).  VmRSS of the proxy (/proc/PID/status) before, at its peak and a second after the
  attacker left; the owner's own requests meanwhile (their slowest answer).
- ``mixed``: security-review-3's three attacks on the proxy at once, at a limit of 256 open files, each in a process
  of its own: 60 keyless POSTs part-way through their bodies (F3), a learner's 31 bodies of 4 MiB one byte short
  (F4), and the learner's 100 connections of pipelined requests never read (F5); VmRSS, and the owner's GETs and
  8 MiB POSTs (answered, failed, how long) throughout.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/proxy_under_attack.py            # all three
    PYTHONPATH=. .venv/bin/python benchmarks/proxy_under_attack.py --attack memory  # any user

Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import pwd
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from proxy_helpers import keyed_latencies, proxy_process, stand_in_vllm  # noqa: E402

from llmlab.serve.info import write_private  # noqa: E402
from llmlab.serve.proxy.keys import key_digest_line  # noqa: E402

MiB = 2**20


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) / 1024


def summary(took: list[float]) -> str:
    took = sorted(took)
    p = lambda q: took[min(len(took) - 1, int(len(took) * q))] * 1000  # noqa: E731
    return (f"{len(took)} requests, p50 {p(0.5):.1f} ms, p99 {p(0.99):.1f} ms, max {took[-1] * 1000:.1f} ms, "
            f"mean {statistics.mean(took) * 1000:.1f} ms")


def churn(keys: Path, uid: int, stop: threading.Event) -> None:
    """Another user's file, made and removed every 0.3 s: a change of the folder each time."""
    n = 0
    while not stop.is_set():
        path = keys / f"churn{n:06d}"
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o640))
        os.chown(path, uid, -1)
        time.sleep(0.15)
        path.unlink()
        time.sleep(0.15)
        n += 1


def attack_keys(folder: Path, junk: int, seconds: float) -> None:
    if os.geteuid() != 0:
        print("keys: skipped (run as root: the junk must be another user's, here nobody's)")
        return
    uid = pwd.getpwnam("nobody").pw_uid
    keys = folder / "keys"
    keys.mkdir()
    for i in range(junk):
        path = keys / f"junk{i:06d}"
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o640))
        os.chown(path, uid, -1)
    with stand_in_vllm(folder) as uds, proxy_process(folder, uds, "--keys", str(keys)) as (_, port, key):
        time.sleep(2)
        print(f"keys: {junk} junk names, quiet folder:      {summary(keyed_latencies(port, key, seconds))}")
        stop = threading.Event()
        worker = threading.Thread(target=churn, args=(keys, uid, stop), daemon=True)
        worker.start()
        try:
            print(f"keys: {junk} junk names, a file churned:  {summary(keyed_latencies(port, key, seconds))}")
        finally:
            stop.set()
            worker.join()


def hold_bodies(port: int, key: str, n: int, said: list[str], done: threading.Event) -> None:
    """The learner's side: ``n`` bodies of 32 MiB one byte short, held open, then one 32 MiB prefix-routed body."""
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Type: application/json"
            "\r\nContent-Length: %d\r\n\r\n")
    held, refused, chunk = [], 0, b"x" * MiB
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            s.sendall((head % (key, 32 * MiB)).encode())
            for _ in range(31):
                s.sendall(chunk)
            s.sendall(chunk[:-1])
        except OSError:
            refused += 1
        held.append(s)
    body = b'{"messages":[' + b"{}," * ((32 * MiB - 20) // 3) + b"{}]}"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            s.sendall((head % (key, len(body))).encode() + body)
            said.append("prefix body: " + s.recv(200).split(b"\r\n")[0].decode())
        except OSError as e:
            said.append(f"prefix body: {e}")
    said.append(f"held {len(held)} connections, {refused} refused while sending")
    done.set()
    time.sleep(1)
    for s in held:
        s.close()


def attack_memory(folder: Path, connections: int) -> None:
    learner = "learner-" + os.urandom(16).hex()
    keys = write_private(folder / "keys.txt", key_digest_line(learner) + "\n")
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    with stand_in_vllm(folder / "a") as a, stand_in_vllm(folder / "b") as b, proxy_process(
            folder, a, "--upstream", f"unix:{b}", "--route", "prefix", "--keys", str(keys)) as (proc, port, key):
        time.sleep(1)
        before = peak = rss_mib(proc.pid)
        said, done = [], threading.Event()
        attacker = threading.Thread(target=hold_bodies, args=(port, learner, connections, said, done), daemon=True)
        attacker.start()
        owner: list[float] = []
        while not done.is_set():
            peak = max(peak, rss_mib(proc.pid))
            owner += keyed_latencies(port, key, 0.2)
        attacker.join()
        peak = max(peak, rss_mib(proc.pid))
        time.sleep(1)
        after = rss_mib(proc.pid)
    print(f"memory: {connections} x (32 MiB - 1 byte) held + one 32 MiB prefix-routed body: VmRSS {before:.0f} MiB "
          f"before, {peak:.0f} MiB at the peak (+{peak - before:.0f}), {after:.0f} MiB a second after")
    print(f"memory: the attacker: {'; '.join(said)}")
    print(f"memory: the owner meanwhile: {summary(owner)}")


def owner_requests(port: int, key: str, seconds: float) -> tuple[list[float], list[str]]:
    """The owner's sequential GETs for ``seconds``, a new connection after any failure: (seconds each successful
    one took, what each failed one got)."""
    import http.client

    took, failed, conn = [], [], None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        try:
            conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
            response = conn.getresponse()
            response.read()
            if response.status == 200:
                took.append(time.monotonic() - t)
                continue
            failed.append(str(response.status))
        except OSError as e:
            failed.append(type(e).__name__)
        conn = None
        time.sleep(0.05)
    return took, failed


def keyless_bodies(port: int, n: int, seconds: float) -> None:
    """F3's attack: ``n`` keyless POSTs part-way through a body of a million bytes, one byte more every 2 s."""
    held = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(s)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nx")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(2)
        for s in held:
            with contextlib.suppress(OSError):
                s.send(b"x")


def share_bodies(port: int, key: str, n: int, seconds: float) -> None:
    """F4's attack: a learner's ``n`` bodies of 4 MiB one byte short, held open (124 MiB of the 128 for n=31)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {4 * MiB}\r\n\r\n").encode()
    held = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            held.append(s)
            s.sendall(head + b"x" * (4 * MiB - 1))
    time.sleep(seconds)


def pipelined_flood(port: int, key: str, n: int, seconds: float) -> None:
    """F5's attack: ``n`` connections, each sending batches of a thousand keyed requests for a route that does not
    exist and never reading the answers; a connection the proxy closes is opened again."""
    batch = f"GET /nowhere HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode() * 1000
    end = time.monotonic() + seconds

    def one() -> None:
        while time.monotonic() < end:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", port))
                s.settimeout(1)
                while time.monotonic() < end:
                    with contextlib.suppress(socket.timeout):
                        s.sendall(batch)
            time.sleep(0.1)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def owner_post(port: int, key: str, size: int) -> tuple[str, float]:
    """The owner's POST of ``size`` body bytes: (its status, or the error, and the seconds it took)."""
    t = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                       f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode() + b"x" * size)
            status = s.recv(100).split(b" ")[1].decode()
    except (OSError, IndexError) as e:
        status = type(e).__name__
    return status, time.monotonic() - t


def attack_mixed(folder: Path, seconds: float) -> None:
    """The three attacks of security-review-3 at once against a proxy with a limit of 256 open files, each in a
    process of its own: F3 (60 keyless POSTs part-way through their bodies), F4 (a learner's 31 bodies of 4 MiB
    one byte short) and F5 (the learner's 100 connections of pipelined requests never read).  Meanwhile the owner
    sends GET /v1/models one after another, and an 8 MiB POST (larger than each of the learner's bodies) every
    half second; their statuses and times, and the proxy's VmRSS, are printed."""
    import multiprocessing

    learner = "learner-" + os.urandom(16).hex()
    keys = write_private(folder / "keys.txt", key_digest_line(learner) + "\n")
    with stand_in_vllm(folder) as uds, proxy_process(folder, uds, "--keys", str(keys), ulimit="-n 256") as (
            proc, port, key):
        time.sleep(1)
        before = peak = rss_mib(proc.pid)
        attackers = [multiprocessing.Process(target=f, args=args, daemon=True) for f, args in (
            (keyless_bodies, (port, 60, seconds + 5)), (share_bodies, (port, learner, 31, seconds + 5)),
            (pipelined_flood, (port, learner, 100, seconds + 5)))]
        for a in attackers:
            a.start()
        time.sleep(3)  # the attacks in place
        took, failed, posts = [], [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            peak = max(peak, rss_mib(proc.pid))
            ok, bad = owner_requests(port, key, 0.5)
            took += ok
            failed += bad
            posts.append(owner_post(port, key, 8 * MiB))
        for a in attackers:
            a.terminate()
            a.join()
        time.sleep(1)
        after = rss_mib(proc.pid)
    print(f"mixed: 60 keyless bodies part-way + a learner's 31 x (4 MiB - 1) bodies held + the learner's 100 "
          f"connections of pipelined requests never read, open files 256, {seconds:g} s: VmRSS {before:.0f} MiB "
          f"before, {peak:.0f} at the peak (+{peak - before:.0f}), {after:.0f} a second after")
    print(f"mixed: the owner's GETs meanwhile: {summary(took) if took else 'no answer'}; {len(failed)} failed "
          f"{sorted(set(failed)) if failed else ''}")
    statuses = collections.Counter(status for status, _ in posts)
    print(f"mixed: the owner's 8 MiB POSTs meanwhile: {len(posts)}, {dict(statuses)}, "
          f"{summary([t for status, t in posts if status == '200']) if statuses['200'] else 'none answered'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", choices=("keys", "memory", "mixed", "all"), default="all")
    p.add_argument("--junk", type=int, default=10_000, help="junk names in keys/")
    p.add_argument("--seconds", type=float, default=8.0, help="how long the keyed client measures, each phase")
    p.add_argument("--connections", type=int, default=12, help="connections holding a 32 MiB body")
    a = p.parse_args()
    for attack, run in (("keys", lambda f: attack_keys(f, a.junk, a.seconds)),
                        ("memory", lambda f: attack_memory(f, a.connections)),
                        ("mixed", lambda f: attack_mixed(f, a.seconds))):
        if a.attack in (attack, "all"):
            folder = Path(tempfile.mkdtemp(prefix=f"llmlab-attack-{attack}-"))
            os.chmod(folder, 0o755)
            try:
                run(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
