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
The proxy in front of vLLM (``llmlab.serve.proxy``) accepts the owner's key and the registered hashes, re-reading
``keys/`` as it changes, by the rules of ``llmlab.serve.keyring``: every learner can write into ``keys/``, so a file
counts only as the one key of the user it is named after, and only if that user made it (a copy under another
name, or a name taken before its user came, registers nothing); FIFOs, symlinks and oversized files are skipped
without blocking.  The instructor revokes a learner with ``llmlab revoke JOB USER``: their files in ``keys/`` are
removed, and their name gets a file the instructor owns that registers nothing and lists the revoked digests,
which the proxy then refuses in any file; the sticky bit keeps the learner from putting theirs back.  A revocation
by mistake is undone with ``llmlab revoke JOB USER --undo``, which removes that file (:func:`admit`).  Every file
made in ``keys/`` goes through a random ``O_EXCL`` temp name (``tempfile.mkstemp``) and ``os.replace``: a name
planted there in advance is never written through.  The instructor's job cannot write into a learner's home, and
need not.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import hashlib
import os
import pwd
import re
import secrets
import socket
import stat
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from llmlab.serve import keyring
from llmlab.serve.info import AuthenticationFailed, ServerError, ServerInfo, llmlab_home, new_key_file, read_key

REVOKED = keyring.REVOKED
MAX_DENIED = 1000  # digests a revocation lists: its file stays far below keyring.MAX_TRUSTED_BYTES


def user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def key_line(key: str) -> str:
    """What a learner registers: the proxy's own digest line for the key (never the key), with who and when."""
    from llmlab.serve.proxy.keys import key_digest_line

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
    """Create (or repair) the share directory with the modes above; return it.

    The folder and its ``keys/`` are opened without following a symlink and must be the caller's own: a learner who
    planted the name (in a world-writable parent such as the default ``$LLMLAB_SHARE_ROOT/GROUP``) as a link to a
    folder of the instructor's would otherwise have that folder opened to the group.  A symlink among the parents
    is followed only if root or the caller made it."""
    g = check_group(group)
    path = Path(os.path.abspath(Path(share_dir).expanduser()))
    for part in (path, *path.parents):
        try:
            st = os.lstat(part)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode) and (part == path or st.st_uid not in (0, os.geteuid())):
            raise ServerError(f"The share directory {path} goes through {part}, a symbolic link made by "
                              f"{keyring.owner_name(st.st_uid)}: give a real folder of yours (--share-dir).")
    root = Path(os.path.realpath(path.parent)) / path.name
    fds: list[int] = []
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        fds.append(_own_folder(root, None, root))
        fds.append(_own_folder("keys", fds[0], root / "keys"))
        for fd, mode in zip(fds, (0o2750, 0o3770), strict=True):
            os.fchown(fd, -1, g.gr_gid)
            os.fchmod(fd, mode)
    except OSError as e:
        why = "a symbolic link or not a folder" if e.errno in (errno.ELOOP, errno.ENOTDIR) else e.strerror
        raise ServerError(f"Cannot prepare the share directory {root} ({why}): choose a folder you own on a "
                          "file system your learners can reach (--share-dir).") from None
    finally:
        for fd in fds:
            os.close(fd)
    return root


def _own_folder(name: str | Path, dir_fd: int | None, shown: Path) -> int:
    """An fd of the folder ``name`` (made 0700 if missing), opened without following a symlink; only the caller's."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    if (uid := os.fstat(fd).st_uid) != os.geteuid():
        os.close(fd)
        raise ServerError(f"{shown} belongs to {keyring.owner_name(uid)}, not to you: choose a folder of your own "
                          "(--share-dir).")
    return fd


def publish(share_dir: str | Path, info: ServerInfo) -> Path:
    """Write ``server.json`` (group-readable, no key), replacing whatever was there.  A job calls it only once READY
    (``launcher.publish_room`` says when): the file is what every learner's ``connect()`` and the OnDemand form
    read, and a job still queued or loading that wrote it cut the room off a server that still worked."""
    root = Path(share_dir)
    return ServerInfo.of(info).updated(kind="shared", share_dir=str(root)).write(root / "server.json", mode=0o640)


def holder(share_dir: str | Path) -> str | None:
    """The job id the room's ``server.json`` names, or None (no file, or one that cannot be read)."""
    with contextlib.suppress(ServerError, OSError):
        return ServerInfo.read(Path(share_dir) / "server.json").job_id
    return None


def unpublish(share_dir: str | Path, job_id: str) -> bool:
    """Remove the room's ``server.json`` if job ``job_id`` wrote it; True if it did.

    Why the check: after a hand-over (a new job READY, then the old one stopped) the file is the new job's, and
    the old job's clean-up must leave it, or the room loses a server that runs.  (A new job that became READY
    between the read and the removal, microseconds apart, would lose its file: a hand-over stops the old job only
    after the new one is READY, so the two do not meet.)"""
    if holder(share_dir) != str(job_id):
        return False
    (Path(share_dir) / "server.json").unlink(missing_ok=True)
    return True


def learners(share_dir: str | Path) -> dict[str, str]:
    """Learners -> "registered" (their own file counts) or "revoked" (a file of the share's owner that registers
    nothing).  What counts for nobody (copies, names taken from others, FIFOs, symlinks) is left out; it is read as
    the proxy reads it (``llmlab.serve.keyring``): bounded, never blocking."""
    try:
        found, _ = keyring.entries(Path(share_dir) / "keys")
    except OSError:
        return {}
    out = {e.name: "revoked" for e in found if e.trusted and e.revoked}
    out.update({e.name: "registered" for e in keyring.accepted(found) if e.name not in out})
    return dict(sorted(out.items()))


def revoke(share_dir: str | Path, name: str) -> None:
    """Shut one learner out within a second, without restarting the server.

    Every file of theirs in ``keys/`` is removed (copies under other names, names taken from other learners, dot
    files and any other junk they left there), and their name gets a file of the share's owner -- which the sticky
    ``keys/`` keeps them from replacing -- listing the digests they had there: the proxy refuses those in any file,
    and any file of theirs under any name."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        raise ServerError(f"There is no user {name!r} on this machine.") from None
    keys = Path(share_dir) / "keys"
    try:
        found, _ = keyring.entries(keys)
        theirs = keyring.names_of(keys, uid)
        denied = [d for e in found if e.trusted and e.name == name for d in e.denied]  # refused before: still
        fd = keyring.open_folder(keys)
        try:
            # theirs by name first (it is what counted), then the other names; dot files hold no registration
            for other in sorted(theirs, key=lambda n: (n != name, n.startswith("."), n)):
                if len(denied) >= MAX_DENIED or other.startswith("."):
                    break
                denied += keyring.digests_in(fd, other)
        finally:
            os.close(fd)
        lines = [f"{REVOKED} by {user()} at {datetime.now(UTC):%Y-%m-%dT%H:%MZ}"]
        lines += [f"revoked sha256:{d.hex()}" for d in list(dict.fromkeys(denied))[:MAX_DENIED]]
        _replace_in(keys, name, "\n".join(lines) + "\n", 0o644)
        for other in theirs:
            if other != name:
                _remove_if_theirs(keys / other, uid)
    except OSError as e:
        raise ServerError(f"Cannot revoke {name} in {keys} ({e.strerror}): run `llmlab revoke` as the user who "
                          "launched the shared server.") from None


def admit(share_dir: str | Path, name: str) -> None:
    """Give back a learner revoked by mistake (``llmlab revoke JOB USER --undo``): remove the revocation file of the
    share's owner at ``keys/NAME``; the learner's next ``connect()`` registers their key again.

    Why removing that one file is enough: the proxy refuses the revoked digests only while a file of its owner lists
    them.  The folders ``revoke`` moved aside stay aside: they only held names, never a key."""
    keys = Path(share_dir) / "keys"
    try:
        fd = keyring.open_folder(keys)
        try:
            entry = keyring.read_entry(fd, name, trusted_uid=os.geteuid())
            if entry is None or not (entry.trusted and entry.revoked):
                raise ServerError(f"{name} is not revoked in {keys}: there is nothing to undo (`llmlab status JOB` "
                                  "counts who is).")
            os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise ServerError(f"Cannot give {name} back in {keys} ({e.strerror}): run `llmlab revoke --undo` as the user "
                          "who launched the shared server.") from None


def _remove_if_theirs(path: Path, uid: int) -> None:
    """Remove a learner's file, or move a folder of theirs aside to a dot name (the share's owner may rename it in
    the sticky ``keys/``, though not empty it: a folder they made read-only keeps its files), never someone else's.
    Why the folder too: one made under another learner's name (security-review-3, F9) kept that name taken after
    ``revoke``, which had said it frees it."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if st.st_uid != uid:
            return
        if stat.S_ISDIR(st.st_mode):
            os.rename(path, path.with_name(f".{path.name}.revoked-aside.{secrets.token_hex(8)}"))
        else:
            os.unlink(path)


def _replace_in(folder: Path, name: str, text: str, mode: int) -> None:
    """Put ``text`` at ``folder/name`` through a temp file of a random name made with ``O_EXCL`` (nothing planted in
    the shared folder is written through or chmod-ed), then ``os.replace``, which swaps the entry whatever it was,
    a symlink included.  A folder in the way is moved aside first (its owner may remove it)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(folder / name).st_mode):
                os.rename(folder / name, folder / f".{name}.moved-aside.{secrets.token_hex(8)}")
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------------
# The learner's side (llmlab.connect)
# --------------------------------------------------------------------------------------------------

def learner_key(info: ServerInfo) -> tuple[str, bool]:
    """The learner's own key for a shared server, made and registered on first use: (key, newly registered).

    Raises one sentence when the learner is outside the group or was revoked.
    """
    root = Path(info.extra["share_dir"])
    group = info.extra.get("group", "the share's group")
    key_file = _learner_key_file(root, info)
    if key_file.exists():
        key = read_key(key_file)
    else:
        for old in key_file.parent.glob(key_file.name.rsplit("-", 1)[0] + "-*.key"):  # an earlier job's: dead now
            old.unlink(missing_ok=True)
        key = new_key_file(key_file)
    keys, me = root / "keys", user()
    not_in_group = ServerError(f"You cannot register a key with the shared server in {root}: you are not in its "
                               f"group {group!r} (`id -Gn` lists yours); ask your instructor to add you.")
    try:
        fd = keyring.open_folder(keys)
    except OSError:
        raise not_in_group from None
    try:
        instructor = os.fstat(fd).st_uid
        mine = keyring.read_entry(fd, me, trusted_uid=instructor)  # never through a symlink, never blocking
    finally:
        os.close(fd)
    if mine is not None and mine.uid != os.getuid():
        if mine.uid == instructor:
            raise AuthenticationFailed(f"Your access to the shared server in {root} was revoked by its owner: ask "
                                       "your instructor.")
        raise _taken(keys / me, mine.uid)
    if mine is not None and not mine.problem and mine.digests == (hashlib.sha256(key.strip().encode()).digest(),):
        return key, False
    try:
        _replace_in(keys, me, key_line(key), 0o640)
    except PermissionError:
        with contextlib.suppress(OSError):
            if (uid := os.lstat(keys / me).st_uid) != os.getuid():  # taken in the meantime
                raise _taken(keys / me, uid) from None
        raise not_in_group from None
    return key, True


def _learner_key_file(root: Path, info: ServerInfo) -> Path:
    """The learner's key for this share folder *and this server* (its job, else its start time): a new job means a
    new key, registered again.  Why: a key kept for the folder outlived its job, and a ``server.json`` left by a job
    killed past its clean-up handed it, with the learner's prompts, to whoever then bound the job's port; the next
    day's job would have accepted it from them (security-review-3, F7)."""
    server = re.sub(r"[^0-9A-Za-z]", "", str(info.job_id or info.started or "server"))[:40] or "server"
    return llmlab_home() / "keys" / f"shared-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}-{server}.key"


def _taken(path: Path, uid: int) -> ServerError:
    """Another learner made the file named after this one first: it registers nothing, and only the share's owner
    can remove it."""
    who = keyring.owner_name(uid)
    return ServerError(f"{path} was made by {who}, not by you: it registers nothing, and only your instructor can "
                       f"remove it. Ask them to (`llmlab revoke JOB {who}` removes every file {who} made there and "
                       "moves their folders aside).")


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
