"""The second UNIX user of the cluster tier's attacks (docs/security.md): who it is, how it runs a command, and
what it gets back.  tests/cluster/test_security.py attacks the embedded server, a Ray head and a room's share
directory with it; tests/cluster/test_jobs.py attacks the SLURM job it launched (one job for both: a CPU job
takes the test bed's two nodes for a minute and a half)."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ATTACKER = "llmlab-attacker"
TOOLS = ("useradd", "setpriv", "curl", "ps")

needs_attacker = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason=f"the attacker's suite creates a second UNIX user: it needs root and {', '.join(TOOLS)} (CI has them)")


def system_user(name: str) -> pwd.struct_passwd:
    """A UNIX user without a home or a shell, created once: the second (and third) user of the attacks."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True, capture_output=True)
        return pwd.getpwnam(name)


def as_attacker(who: tuple[int, int], *cmd: str, stdin: bytes | None = None,
                timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``cmd`` as the other user, with a clean environment (nothing of ours leaks to it)."""
    uid, gid = who
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *cmd],
                          input=stdin, capture_output=True, timeout=timeout,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C"})


LEARNER_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"  # the venv's may be in a 0700 home


def llmlab_as(who: tuple[int, int], home: Path, *args: str, env: dict[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess:
    """``llmlab ARGS`` run as another UNIX user, as a learner runs it: this checkout and the venv's packages on the
    system's Python of the same version, ``LLMLAB_HOME=home`` (a folder of theirs), plus ``env``."""
    repo = Path(__file__).resolve().parent.parent
    extra = [f"{k}={v}" for k, v in (env or {}).items()]
    return as_attacker(who, "env", f"PYTHONPATH={repo}:{sysconfig.get_paths()['purelib']}", f"LLMLAB_HOME={home}",
                       *extra, LEARNER_PYTHON, "-m", "llmlab", *args, timeout=timeout)


def attacker_http(who, url: str, *, key: str | None = None, method: str = "GET", body: dict | None = None) -> int:
    """The status code the attacker gets (0: no HTTP answer at all).  ``--path-as-is``: curl sends ``..`` as is."""
    cmd = ["curl", "-s", "--path-as-is", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20", "-X", method]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    out = as_attacker(who, *cmd, url)
    return int(out.stdout.decode() or 0)


def owner_http(url: str, key: str, method: str = "GET", raw_path: str | None = None) -> int:
    """The owner's request; ``raw_path`` is sent byte for byte (urllib would keep it too, but say so)."""
    if raw_path is not None:
        host, port = url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(f"{method} {raw_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
            return int(s.recv(100).split()[1])
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


EMPTY_GRPC_MESSAGE = b"\0\0\0\0\0"  # a gRPC frame: not compressed, length 0 (an empty protobuf request)


def grpc_status(run, ip: str, port: int, method: str, token: str | None = None) -> str:
    """``grpc-status`` of one unary call over HTTP/2 (curl speaks it), or '' if nothing answered."""
    cmd = ["curl", "-s", "--http2-prior-knowledge", "--max-time", "15", "-X", "POST", "-D", "-", "-o", "/dev/null",
           "-H", "content-type: application/grpc", "-H", "te: trailers", "--data-binary", "@-"]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    out = run(*cmd, f"http://{ip}:{port}/{method}", stdin=EMPTY_GRPC_MESSAGE)
    m = re.search(rb"grpc-status: *(\d+)", out.stdout)
    return m[1].decode() if m else ""


def owner_run(*cmd, stdin=None):
    """Run ``cmd`` as the test's own user: the owner's side of :func:`grpc_status`."""
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=30)


GCS_METHOD = "ray.rpc.NodeInfoGcsService/GetAllNodeInfo"


def ray_folder_is_out_of_reach(who, folder: Path) -> None:
    sockets = folder / "session_latest" / "sockets"
    assert stat.S_IMODE(sockets.stat().st_mode) == 0o777  # Ray's own doing: why the folder around it matters
    found = sorted(sockets.iterdir())
    assert found, f"Ray's sockets should be in {sockets}"
    planted = sockets / "attacker-was-here"
    touched = as_attacker(who, "touch", str(planted))
    assert touched.returncode != 0 and not planted.exists(), "another user can write into Ray's sockets folder"
    for path in found:  # not even their names: they cannot be replaced
        assert as_attacker(who, "stat", str(path)).returncode != 0, path
    assert as_attacker(who, "ls", str(folder.parent)).returncode != 0
    st = folder.parent.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid() and folder.parent.name != "tmp"
