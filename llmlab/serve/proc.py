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

from llmlab.serve.info import root_url


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
        request = urllib.request.Request(root_url(host, port) + "/health", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat`` after the command's name: [state, ppid, pgrp, ...]; None where /proc cannot say."""
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return None


def _signal(pid: int, sig: int, group: bool) -> bool | None:
    """Send ``sig`` (0: only ask) to a process or its group: True if it exists, False if not, None if not ours."""
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return None
    return True


def pid_alive(pid: int | None) -> bool:
    """True for a running process; False for none, or a zombie (exited, not yet reaped by its parent)."""
    if not pid:
        return False
    exists = _signal(pid, 0, group=False)
    if exists is not True:
        return exists is None
    stat = _stat(pid)
    return stat is None or stat[0] != "Z"


def group_alive(pgid: int) -> bool:
    """True while a process of the group ``pgid`` runs; zombies (exited, not yet reaped) do not count."""
    exists = _signal(pgid, 0, group=True)
    if exists is not True:
        return exists is None
    if not Path("/proc/self/stat").exists():
        return True  # no /proc (macOS): the group exists, which is all we can tell
    for entry in Path("/proc").iterdir():
        stat = _stat(entry.name) if entry.name.isdigit() else None
        if stat and stat[2] == str(pgid) and stat[0] != "Z":
            return True
    return False


def terminate(pid: int, grace: float = 20.0, settle: float = 20.0) -> bool:
    """End the process group ``pid`` leads (an API server, its engine core, its workers, a proxy beside it).

    SIGTERM the group, wait up to ``grace`` s for its leader, SIGKILL the group, then wait up to ``settle`` s until
    no process of it runs.  Returns True once none does (False: some survived, or belong to someone else)."""
    _signal(pid, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace
    while pid_alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.2)
    deadline = time.monotonic() + settle
    while True:
        _signal(pid, signal.SIGKILL, group=True)
        if not group_alive(pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def raise_fd_limit() -> int | None:
    """Raise the soft limit on open files to the hard one; return the limit now in force (None: unlimited).

    Why: every stream costs two descriptors (the client's connection and vLLM's socket), and SLURM jobs often
    inherit a soft limit of 1024 from the submitting shell, against the thousands of streams a workshop has in
    flight (vLLM raises its own limit the same way)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # macOS: an unlimited hard limit cannot be the soft one
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft
