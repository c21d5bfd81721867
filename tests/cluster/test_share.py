"""One server for a room (llmlab.serve.share): learners of a UNIX group, each with a key of their own.

Real users and a real server: the test (root, as in CI) makes a group with one learner, and an outsider;
the embedded vLLM server's socket gets a second llmlab.serve.proxy that also accepts the keys registered in a share
directory.  (The same through SLURM, ``llmlab launch --share`` with ``llmlab revoke`` and ``llmlab status``
counting the keys, is tests/cluster/test_room.py's room: one shared job for both.)  As the learner, ``llmlab.connect()``
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
from slurm_helpers import (
    ROOT,
    wait_for,
)

from llmlab.ops import jobs
from llmlab.serve import keyring, share
from llmlab.serve.info import ServerInfo
from llmlab.serve.proc import free_port, health
from llmlab.serve.proxy.command import proxy_command
from llmlab.serve.proxy.keys import digest, key_digest_line

GROUP, LEARNER, OUTSIDER = "llmlab-ws", "llmlab-learner", "llmlab-outsider"
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
    proc = subprocess.Popen(proxy_command(f"127.0.0.1:{port}", Path(embedded.extra["uds"]), Path(embedded.api_key_file),
                                          keys=root / "keys"), stdout=log, stderr=subprocess.STDOUT)
    owner_key = Path(embedded.api_key_file).read_text().strip()
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
    assert "key" not in info.as_dict() and info.kind == "shared" and info.extra.get("share_dir") == str(root)


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
    # the proxy re-reads keys/ about once a second, later on a loaded machine
    out = wait_for(lambda: (o := as_user(LEARNER, LEARN, conn)).returncode != 0 and o, 30,
                   "the proxy to refuse the revoked learner", poll=0.5)
    assert out.returncode != 0 and "was revoked by its owner" in out.stderr, out.stderr
    put_back = as_user(LEARNER, f"open({str(root / 'keys' / LEARNER)!r}, 'w').write('sha256:' + '0' * 64)", conn)
    assert put_back.returncode != 0 and "PermissionError" in put_back.stderr  # the sticky keys/ holds
    assert share.learners(root) == {LEARNER: "revoked"}
    assert "1 revoked" in jobs._shared(ServerInfo.read(conn))


# --------------------------------------------------------------------------------------------------
# The key ring's rules (llmlab.serve.keyring), file by file: no server, files given their owners with chown
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def keys_dir():
    ensure_user(LEARNER, GROUP)
    ensure_user(OUTSIDER)
    parent = Path(tempfile.mkdtemp(prefix="llmlab-keys-"))
    root = share.prepare_dir(parent / "ws", GROUP)
    yield root / "keys"
    shutil.rmtree(parent, ignore_errors=True)


def put(path: Path, text: str, owner: str | None = None) -> Path:
    path.write_text(text)
    if owner:
        os.chown(path, int(subprocess.check_output(["id", "-u", owner])), -1)
    return path


def test_keyring_counts_one_digest_from_the_file_named_after_its_owner(keys_dir):
    line = {k: key_digest_line(k, "x") + "\n" for k in ("mine", "copy", "squat", "two", "owner-a", "owner-b")}
    put(keys_dir / LEARNER, line["mine"], LEARNER)
    put(keys_dir / "spare", line["copy"], LEARNER)                      # a copy under another name
    put(keys_dir / OUTSIDER, line["squat"], LEARNER)                    # a name taken from another user
    put(keys_dir / "nobody-such", line["two"] + line["two"], LEARNER)
    put(keys_dir / "instructor", line["owner-a"] + "# note\n" + line["owner-b"])  # the proxy's own user: trusted
    os.mkfifo(keys_dir / "fifo")
    (keys_dir / "link").symlink_to(keys_dir / "instructor")
    ring = keyring.load(keys_dir)
    assert set(ring.digests) == {digest("mine"), digest("owner-a"), digest("owner-b")}
    assert share.learners(keys_dir.parent) == {LEARNER: "registered", "instructor": "registered"}


def test_keyring_reads_again_only_what_changed(keys_dir, monkeypatch):
    monkeypatch.setattr(keyring, "RACY_NS", 0)  # no change is "too recent" here
    put(keys_dir / LEARNER, key_digest_line("one") + "\n", LEARNER)
    ring = keyring.load(keys_dir)
    assert keyring.load(keys_dir, ring.signature) is None  # one stat of the folder, one of the learner's file
    put(keys_dir / LEARNER, key_digest_line("two", "rewritten in place") + "\n", LEARNER)
    assert keyring.load(keys_dir, ring.signature).digests == (digest("two"),)


def test_keyring_learner_file_with_two_digests_or_oversized_registers_nothing(keys_dir):
    put(keys_dir / LEARNER, key_digest_line("a") + "\n" + key_digest_line("b") + "\n", LEARNER)
    assert keyring.load(keys_dir).digests == ()
    put(keys_dir / LEARNER, key_digest_line("a") + "  " + "x" * keyring.MAX_LEARNER_BYTES + "\n", LEARNER)
    assert keyring.load(keys_dir).digests == ()
    put(keys_dir / LEARNER, key_digest_line("a", "learner@node") + "\n", LEARNER)
    assert keyring.load(keys_dir).digests == (digest("a"),)


def test_keyring_sees_a_change_made_within_the_clock_tick(keys_dir):
    """The signature of a folder changed in the last two seconds is not trusted: a file added within the same tick
    of the file system's clock leaves the folder's times as they were."""
    ring = keyring.load(keys_dir)
    put(keys_dir / LEARNER, key_digest_line("fast") + "\n", LEARNER)
    again = keyring.load(keys_dir, ring.signature)
    assert again is not None and again.digests == (digest("fast"),)


def test_keyring_file_of_another_user_registers_nothing(keys_dir):
    keys_file = put(keys_dir.parent.parent / "keys.txt", key_digest_line("k") + "\n")
    assert keyring.load(keys_file).digests == (digest("k"),)
    os.chown(keys_file, int(subprocess.check_output(["id", "-u", LEARNER])), -1)
    assert keyring.load(keys_file).digests == ()


def test_revoke_refuses_the_learners_digests_in_every_file(keys_dir):
    put(keys_dir / LEARNER, key_digest_line("theirs") + "\n", LEARNER)
    put(keys_dir / "spare", key_digest_line("spare") + "\n", LEARNER)
    share.revoke(keys_dir.parent, LEARNER)
    marker = (keys_dir / LEARNER).read_text()
    assert marker.startswith(share.REVOKED) and f"revoked sha256:{digest('theirs').hex()}" in marker
    assert f"revoked sha256:{digest('spare').hex()}" in marker and not (keys_dir / "spare").exists()
    assert stat.S_IMODE((keys_dir / LEARNER).stat().st_mode) == 0o644 and (keys_dir / LEARNER).stat().st_uid == 0
    put(keys_dir / "instructor", key_digest_line("theirs") + "\n" + key_digest_line("other") + "\n")
    assert keyring.load(keys_dir).digests == (digest("other"),)  # refused even in the instructor's own file
    share.revoke(keys_dir.parent, LEARNER)  # again: what was refused stays refused
    assert f"revoked sha256:{digest('theirs').hex()}" in (keys_dir / LEARNER).read_text()
    assert not list(keys_dir.glob(".*"))  # no temp file left behind
