"""Process and HTTP helpers every server path shares: free ports, liveness, ``/health``, stopping a group.

Why a module of its own: the embedded server, the offline engine, the launcher's helpers, rehearsals and the
proxy all start, watch and stop processes; these few functions are the one way they do it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def last_lines(path: Path, n: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n)).rstrip()
    except OSError:
        return "(no log)"


def health(host: str, port: int, timeout: float = 2.0, api_key: str | None = None) -> bool:
    """``/health`` answers 200 once the engine is loaded.  Through llmlab's proxy it needs the key, like every
    request; while the engine loads, the proxy answers 503."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        request = urllib.request.Request(f"http://{host}:{port}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def pid_alive(pid: int | None) -> bool:
    """True for a running process; False for none, or a zombie (exited, not yet reaped by its parent)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def terminate(pid: int, grace: float = 20.0) -> None:
    """SIGTERM the engine's process group (the API server and its engine core), SIGKILL after ``grace``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
