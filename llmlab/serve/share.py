"""One server for a room of learners: a UNIX group shares it, and each learner holds a key of their own.

Why: in the workshop this course grew from, each of ~30 learners started a 4-GPU 70B server (about 120 GPUs
for one class).  One server answers them all (notebook 06 measures how many requests it serves at once); what
it must not do is hand one key to 30 people -- then nobody can be shut out without restarting the server,
and a key pasted into a chat opens it to the whole cluster.

The share directory (``llmlab launch MODEL --share GROUP --share-dir DIR``), on a file system the learners
see, owned by the instructor and the group, closed to everyone else::

    DIR/                mode 2750 (group may enter and read; setgid: files inherit the group)
      server.json       mode 0640: where the server listens (no key) -- what llmlab.connect() reads
      keys/             mode 3770 (sticky: a learner can add a file, but delete or replace only their own)
        alice           "sha256:<hex of alice's key>  alice@login1 2026-11-22T09:00Z", mode 0640

A learner's ``llmlab.connect()`` (with ``LLMLAB_CONNECTION_FILE=DIR/server.json``, which the OOD app sets)
makes a random key in a 0600 file in *their* home, writes only its hash as ``keys/<their name>``, and uses it.
The proxy in front of vLLM (``llmlab.serve.proxy``) accepts the owner's key and every registered hash, re-reading
``keys/`` as it changes.  The instructor revokes a learner with ``llmlab revoke JOB USER``: their file is
replaced by one the instructor owns that registers nothing, and the sticky bit keeps the learner from
putting theirs back.  The instructor's job cannot write into a learner's home, and need not.
"""

from __future__ import annotations

import grp
import hashlib
import os
import pwd
import socket
import time
from datetime import UTC, datetime
from pathlib import Path

from llmlab.serve.info import AuthenticationFailed, ServerError, ServerInfo, llmlab_home, read_key, write_private

REVOKED = "# revoked"


def user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def key_line(key: str) -> str:
    """What a learner registers: the proxy's own digest line for the key (never the key), with who and when."""
    from llmlab.serve.proxy import key_digest_line

    return key_digest_line(key, f"{user()}@{socket.gethostname()} {datetime.now(UTC):%Y-%m-%dT%H:%MZ}") + "\n"


# --------------------------------------------------------------------------------------------------
# The instructor's side (the launch, and the job)
# --------------------------------------------------------------------------------------------------

def check_group(group: str) -> grp.struct_group:
    """The group must exist and the instructor must be in it (else their proxy could not read the keys)."""
    try:
        g = grp.getgrnam(group)
    except KeyError:
        raise ServerError(f"There is no UNIX group {group!r} on this machine: `getent group` lists them; ask the "
                          "cluster's admins for a group with your learners in it.") from None
    if os.getuid() != 0 and g.gr_gid not in os.getgroups() and user() not in g.gr_mem:
        raise ServerError(f"You are not in the group {group!r}: your server could not read the keys your "
                          "learners register there. Use a group you belong to (`id -Gn`).")
    return g


def prepare_dir(share_dir: str | Path, group: str) -> Path:
    """Create (or repair) the share directory with the modes above; return it."""
    g = check_group(group)
    root = Path(share_dir).expanduser().resolve()
    keys = root / "keys"
    try:
        keys.mkdir(parents=True, exist_ok=True)
        for path, mode in ((root, 0o2750), (keys, 0o3770)):
            os.chown(path, -1, g.gr_gid)
            os.chmod(path, mode)
    except OSError as e:
        raise ServerError(f"Cannot prepare the share directory {root} ({e.strerror}): choose a folder you own on a "
                          "file system your learners can reach (--share-dir).") from None
    return root


def publish(share_dir: str | Path, info: ServerInfo) -> Path:
    """Write ``server.json`` (group-readable, no key) once the server is ready."""
    root = Path(share_dir)
    return ServerInfo.of(info).updated(kind="shared", share_dir=str(root)).write(root / "server.json", mode=0o640)


def learners(share_dir: str | Path) -> dict[str, str]:
    """Registered learners -> "registered" or "revoked" (a file of the share's owner that registers nothing)."""
    keys = Path(share_dir) / "keys"
    out = {}
    for path in sorted(keys.glob("[!.]*")) if keys.is_dir() else []:
        try:
            revoked = path.read_text().startswith(REVOKED)
        except OSError:
            continue
        out[path.name] = "revoked" if revoked else "registered"
    return out


def revoke(share_dir: str | Path, name: str) -> None:
    """Shut one learner out within a second, without restarting the server: their hash file is replaced by
    one that the share's owner holds (the sticky ``keys/`` keeps the learner from replacing it again)."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        raise ServerError(f"There is no user {name!r} on this machine.") from None
    path = Path(share_dir) / "keys" / name
    tmp = path.with_name(f".{name}.revoked")
    tmp.write_text(f"{REVOKED} by {user()} at {datetime.now(UTC):%Y-%m-%dT%H:%MZ}\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# The learner's side (llmlab.connect)
# --------------------------------------------------------------------------------------------------

def learner_key(info: ServerInfo) -> tuple[str, bool]:
    """The learner's own key for a shared server, made and registered on first use: (key, newly registered).

    Raises one sentence when the learner is outside the group or was revoked.
    """
    root = Path(info["share_dir"])
    group = info.get("group", "the share's group")
    key_file = llmlab_home() / "keys" / f"shared-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}.key"
    if key_file.exists():
        key = read_key(key_file)
    else:
        import secrets

        key = secrets.token_urlsafe(32)
        key_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(key_file, key + "\n")
    mine = root / "keys" / user()
    try:
        current = mine.read_text() if mine.exists() else ""
    except PermissionError:
        current = REVOKED
    if current.startswith(REVOKED) or (mine.exists() and mine.stat().st_uid != os.getuid()):
        raise AuthenticationFailed(f"Your access to the shared server in {root} was revoked by its owner: ask "
                                   "your instructor.")
    if current.split()[:1] == key_line(key).split()[:1]:
        return key, False
    try:
        tmp = mine.with_name(f".{user()}.{os.getpid()}")
        tmp.write_text(key_line(key))
        os.chmod(tmp, 0o640)
        os.replace(tmp, mine)
    except PermissionError:
        raise ServerError(f"You cannot register a key with the shared server in {root}: you are not in its group "
                          f"{group!r} (`id -Gn` lists yours); ask your instructor to add you.") from None
    return key, True


def wait_until_accepted(base_url: str, key: str, timeout: float = 5.0) -> None:
    """A fresh registration reaches the proxy within its re-read interval (about a second): until then it
    answers 401.  Wait for the first answer that is not 401 (any other problem is connect()'s to report)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    request = urllib.request.Request(base_url.rstrip("/") + "/models", headers={"Authorization": f"Bearer {key}"})
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(request, timeout=5).close()
            return
        except urllib.error.HTTPError as e:
            if e.code != 401:
                return
        except OSError:
            return
        time.sleep(0.3)


def is_shared_for_me(info: ServerInfo) -> bool:
    """A shared server whose owner's key this user cannot read: use a learner key instead."""
    return info.kind == "shared" and not os.access(info.api_key_file, os.R_OK)
