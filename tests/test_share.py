"""One server for a room (llmlab.serve.share): learners of a UNIX group, each with a key of their own.

Real users and a real server: the test (root, as in CI) makes a group with one learner, and an outsider;
the embedded vLLM server's socket gets a second llmlab.serve.proxy that also accepts the keys registered in a share
directory; and the same through SLURM with ``llmlab launch --share``.  As the learner, ``llmlab.connect()``
makes and registers a key and generates text; the instructor revokes the learner without restarting
anything; the outsider cannot even read where the server is.  Skipped (with the reason) only where the test
cannot create users, i.e. not as root.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
from test_slurm import CPU_JOB, job_processes, needs_slurm, slurm_env, wait_for  # noqa: F401

from llmlab.ops import jobs
from llmlab.serve import share
from llmlab.serve.info import ServerInfo
from llmlab.serve.proc import free_port, health
from llmlab.serve.proxy import proxy_command

GROUP, LEARNER, OUTSIDER = "llmlab-ws", "llmlab-learner", "llmlab-outsider"
ROOT = Path(__file__).resolve().parent.parent
HOMES: dict[str, Path] = {}  # one home per user for the module: a learner keeps their key between runs
SYSTEM_PYTHON = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="creates UNIX users and a group: needs root (CI is root)"),
    pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"learners run {SYSTEM_PYTHON}: not installed"),
]


def ensure_user(name: str, group: str | None = None) -> None:
    subprocess.run(["groupadd", "-f", GROUP], check=True)
    if subprocess.run(["id", name], capture_output=True).returncode:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    if group:
        subprocess.run(["usermod", "-a", "-G", group, name], check=True)


def as_user(name: str, code: str, conn: Path) -> subprocess.CompletedProcess:
    """Run Python as another user, with a home of their own and the shared connection file (as the OOD app sets).

    The venv's interpreter may live under root's 0700 home (pyenv): the learner runs the system Python of the
    same minor version on the venv's packages instead.
    """
    if name not in HOMES:
        HOMES[name] = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        os.chown(HOMES[name], int(subprocess.check_output(["id", "-u", name])), -1)
    home = HOMES[name]
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LLMLAB_HOME": str(home / ".llmlab"),
           "LLMLAB_CONNECTION_FILE": str(conn), "PYTHONPATH": f"{ROOT}:{sysconfig.get_paths()['purelib']}"}
    return subprocess.run(["runuser", "-u", name, "--", SYSTEM_PYTHON, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)


LEARN = """
import llmlab
client, model = llmlab.connect()
r = client.completions.create(model=model, prompt="In the beginning", max_tokens=4, extra_body={"ignore_eos": True})
print("tokens", r.usage.completion_tokens)
"""


@pytest.fixture(scope="module")
def room(embedded):
    """A share directory, and a second proxy on the embedded server's socket that reads its keys."""
    ensure_user(LEARNER, GROUP)
    ensure_user(OUTSIDER)
    parent = Path(tempfile.mkdtemp(prefix="llmlab-share-"))  # not under pytest's 0700 folder: learners must enter
    os.chmod(parent, 0o755)
    root = share.prepare_dir(parent / "ws", GROUP)
    port = free_port()
    log = open(root.parent / "proxy.log", "w")
    proc = subprocess.Popen(proxy_command(f"127.0.0.1:{port}", Path(embedded["uds"]), Path(embedded["api_key_file"]),
                                          keys=root / "keys"), stdout=log, stderr=subprocess.STDOUT)
    owner_key = Path(embedded["api_key_file"]).read_text().strip()
    deadline = time.monotonic() + 30
    while not health("127.0.0.1", port, api_key=owner_key):
        assert proc.poll() is None and time.monotonic() < deadline, (root.parent / "proxy.log").read_text()
        time.sleep(0.3)
    conn = share.publish(root, embedded.updated(port=port, group=GROUP, job_id="4242", status=None))
    yield root, conn
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(parent, ignore_errors=True)


def test_share_directory_is_closed_to_everyone_but_the_group(room):
    root, conn = room
    assert stat.S_IMODE(root.stat().st_mode) == 0o2750 and stat.S_IMODE((root / "keys").stat().st_mode) == 0o3770
    assert stat.S_IMODE(conn.stat().st_mode) == 0o640
    assert root.stat().st_gid == (root / "keys").stat().st_gid
    info = ServerInfo.read(conn)
    assert "key" not in set(info) and info.kind == "shared" and info.get("share_dir") == str(root)


def test_learner_connects_with_a_key_of_their_own(room):
    root, conn = room
    out = as_user(LEARNER, LEARN, conn)
    assert out.returncode == 0 and "tokens 4" in out.stdout, out.stderr
    registered = (root / "keys" / LEARNER).read_text()
    assert registered.startswith("sha256:") and len(registered.split()[0]) == len("sha256:") + 64
    assert share.learners(root) == {LEARNER: "registered"}
    assert "1 learner(s) registered" in jobs._shared(ServerInfo.read(conn))
    again = as_user(LEARNER, LEARN, conn)  # the same key next time: nothing re-registered
    assert again.returncode == 0 and (root / "keys" / LEARNER).read_text() == registered


def test_outsider_gets_one_sentence(room):
    _, conn = room
    out = as_user(OUTSIDER, LEARN, conn)
    assert out.returncode != 0
    assert "You cannot read the connection file" in out.stderr and "ask its owner to add you to the group" in out.stderr


def test_revoked_learner_is_shut_out_without_a_restart(room):
    root, conn = room
    assert as_user(LEARNER, LEARN, conn).returncode == 0
    share.revoke(root, LEARNER)
    time.sleep(1.5)  # the proxy re-reads keys/ at most every second
    out = as_user(LEARNER, LEARN, conn)
    assert out.returncode != 0 and "was revoked by its owner" in out.stderr, out.stderr
    put_back = as_user(LEARNER, f"open({str(root / 'keys' / LEARNER)!r}, 'w').write('sha256:' + '0' * 64)", conn)
    assert put_back.returncode != 0 and "PermissionError" in put_back.stderr  # the sticky keys/ holds
    assert share.learners(root) == {LEARNER: "revoked"}
    assert "1 revoked" in jobs._shared(ServerInfo.read(conn))


@needs_slurm
def test_launch_share_serves_the_group_through_slurm(slurm_env, monkeypatch):  # noqa: F811
    """``llmlab launch --share GROUP``: the job publishes server.json for the group, a learner uses it with a key
    of their own, ``llmlab status`` counts them, ``llmlab revoke`` shuts them out, and the stop removes it."""
    ensure_user(LEARNER, GROUP)
    for key in ("SLURM_CONF", "PATH", "LLMLAB_PYTHON"):
        monkeypatch.setenv(key, slurm_env[key])
    parent = Path(tempfile.mkdtemp(prefix="llmlab-share-"))
    os.chmod(parent, 0o755)
    record = jobs.launch(jobs.prepare(CPU_JOB, nodes=1, share=GROUP, share_dir=str(parent / "ws")))
    job_id, conn = record["job_id"], parent / "ws" / "server.json"
    try:
        ready = jobs.wait(job_id, timeout=900, poll=1)
        assert ready.state == "READY" and ready.detail.endswith(f"shared with group {GROUP}: 0 learner(s) registered")
        out = as_user(LEARNER, LEARN, conn)
        assert out.returncode == 0 and "tokens 4" in out.stdout and "the shared server of SLURM job" in out.stdout, \
            out.stderr
        assert jobs.status(job_id).detail.endswith("1 learner(s) registered")
        revoked = subprocess.run([sys.executable, "-m", "llmlab", "revoke", job_id, LEARNER], capture_output=True,
                                 text=True)
        assert revoked.returncode == 0 and f"{LEARNER} can no longer use job {job_id}" in revoked.stdout
        time.sleep(1.5)
        out = as_user(LEARNER, LEARN, conn)
        assert out.returncode != 0 and "was revoked by its owner" in out.stderr
    finally:
        stopped = jobs.stop(job_id)
    assert stopped.state == "STOPPED" and not conn.exists()
    wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
    shutil.rmtree(parent, ignore_errors=True)
