"""Which registered keys count: the key ring that the proxy reads from a keys file or a room's ``keys/`` folder.

Why: a room's ``keys/`` (``llmlab.serve.share``) is writable by every learner of the group, so what sits there is
the learners' word, not the instructor's.  A file counts only for the one user it names, and only if that user
made it; anything else a learner leaves there registers nothing and is never opened in a way that can block::

    keys/alice      a regular file (not a symlink, FIFO or device; one link) owned by the user named ``alice``,
                    at most 1 KiB, holding one ``sha256:<hex>`` line: alice's key
    keys/bob        a file of the proxy's own user (the instructor): trusted as it is.  ``llmlab revoke`` writes
                    one: a first line ``# revoked ...`` (bob's files count no more, under any name of his uid)
                    and ``revoked sha256:<hex>`` lines (those digests are refused wherever they appear)
    keys/.x, keys/x2 ...  temp files, a copy under another name, a name taken before its user came: ignored

A keys *file* (``--keys FILE``) must belong to the proxy's user.  Reading is bounded: at most ``MAX_ENTRIES``
entries of a folder, ``MAX_LEARNER_BYTES`` of a learner's file, ``MAX_TRUSTED_BYTES`` and ``MAX_TRUSTED_DIGESTS``
of the owner's, one warning line per change of what is ignored.  Files are opened ``O_NOFOLLOW | O_NONBLOCK`` (a
FIFO cannot block the reader, a symlink is not followed) and checked with ``fstat`` before they are read.  A
re-check costs one ``stat`` of the folder and one ``lstat`` per counted file; the folder is listed again only when
it changed.

``load(path, signature)`` is what the proxy's ``KeyRing.refresh`` calls; ``entries(folder)`` is what
``llmlab.serve.share`` (``learners``, ``revoke``, ``learner_key``) reads with.  Standard library only.
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger("llmlab.serve.proxy")  # the proxy's log: these lines belong with its own

MAX_ENTRIES = 10_000            # entries of keys/ looked at (a room has tens of learners)
MAX_LEARNER_BYTES = 1024        # one "sha256:<64 hex>  user@host time" line is about 120 bytes
MAX_TRUSTED_BYTES = 2**20       # the owner's own files (a keys file, revocation markers)
MAX_TRUSTED_DIGESTS = 10_000
REVOKED = "# revoked"
DIGEST_LINE = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})\b")
REVOKED_LINE = re.compile(r"^revoked\s+sha256:([0-9a-fA-F]{64})\b")
RACY_NS = 2 * 10**9          # a change this recent may hide in the clock's granularity: look again next time
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
NOT_THEIRS, NOT_REGULAR, HARD_LINK = "not made by the user it names", "not a regular file", "a hard link"
_last_warning: dict[str, str] = {}  # path -> the last warning logged for it: one line per change, not per read


@dataclass(frozen=True)
class Entry:
    """One entry of a keys folder, as read: whose it is and what it registers."""

    name: str
    uid: int
    trusted: bool                     # a file of the reader's own user (the instructor)
    revoked: bool                     # a "# revoked" marker of the trusted user
    digests: tuple[bytes, ...] = ()   # what it registers
    denied: tuple[bytes, ...] = ()    # "revoked sha256:" lines (trusted files only)
    problem: str = ""                 # why it registers nothing ("" when it counts)
    signature: tuple = ()             # (name, ino, mtime_ns, ctime_ns, size): a change means read again


@dataclass(frozen=True)
class Ring:
    """The digests that count, and what to compare next time to see whether anything changed."""

    digests: tuple[bytes, ...]
    signature: tuple


def user_uid(name: str, cache: dict[str, int | None] | None = None) -> int | None:
    """The uid of the user called ``name``, or None."""
    if cache is not None and name in cache:
        return cache[name]
    try:
        uid = pwd.getpwnam(name).pw_uid
    except (KeyError, UnicodeEncodeError, ValueError):
        uid = None
    if cache is not None:
        cache[name] = uid
    return uid


def _parse(text: str, trusted: bool) -> tuple[list[bytes], list[bytes], int, bool]:
    """(digests, denied, lines that are neither, revoked marker) of a file's text."""
    digests, denied, bad = [], [], 0
    lines = text.splitlines()
    revoked = trusted and bool(lines) and lines[0].startswith(REVOKED)
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if trusted and (m := REVOKED_LINE.match(line)):
            denied.append(bytes.fromhex(m[1]))
        elif m := DIGEST_LINE.match(line):
            digests.append(bytes.fromhex(m[1]))
        else:
            bad += 1
    return digests, denied, bad, revoked


def read_entry(dir_fd: int, name: str, *, trusted_uid: int, uids: dict | None = None) -> Entry | None:
    """Read ``name`` in the open folder ``dir_fd`` by the rules of the module docstring; None if it is not there.

    Never follows a symlink, never blocks on a FIFO, never reads more than the bound of its kind."""
    try:
        fd = os.open(name, _OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink; EACCES: not readable by us; ENXIO: a socket
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return None
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"not readable ({e.strerror})"
        return Entry(name, st.st_uid, st.st_uid == trusted_uid, False, problem=kind)
    try:
        st = os.fstat(fd)
        sig = (name, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        trusted = st.st_uid == trusted_uid
        base = Entry(name, st.st_uid, trusted, False, signature=sig)
        if not stat.S_ISREG(st.st_mode):
            return replace(base, problem=NOT_REGULAR)
        if st.st_nlink != 1:
            return replace(base, problem=HARD_LINK)
        if not trusted and user_uid(name, uids) != st.st_uid:
            return replace(base, problem=NOT_THEIRS)
        limit = MAX_TRUSTED_BYTES if trusted else MAX_LEARNER_BYTES
        if st.st_size > limit:
            return replace(base, problem=f"larger than {limit} bytes")
        data = _read_upto(fd, limit)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew since fstat
        return replace(base, problem=f"larger than {limit} bytes")
    digests, denied, bad, revoked = _parse(data.decode("utf-8", errors="replace"), trusted)
    if trusted:
        return replace(base, revoked=revoked, digests=tuple(digests[:MAX_TRUSTED_DIGESTS]), denied=tuple(denied),
                     problem=f"{bad} line(s) that are not 'sha256:<64 hex digits>'" if bad else "")
    if len(digests) != 1 or bad:
        return replace(base, problem=f"{len(digests)} digests and {bad} other line(s), not one 'sha256:<hex>' line")
    return replace(base, digests=tuple(digests))


def digests_in(dir_fd: int, name: str) -> list[bytes]:
    """The digest lines in the first ``MAX_LEARNER_BYTES`` of ``name``, whoever made it and whatever it is called
    (what ``llmlab revoke`` lists as refused); nothing for what is not a regular file."""
    try:
        fd = os.open(name, _OPEN | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        data = _read_upto(fd, MAX_LEARNER_BYTES)[:MAX_LEARNER_BYTES]
    finally:
        os.close(fd)
    return _parse(data.decode("utf-8", errors="replace"), trusted=False)[0]


def _read_upto(fd: int, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of ``fd``: one more than allowed says that it is too large."""
    chunks, left = [], limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 65536))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def open_folder(path: Path | str) -> int:
    """An fd of the folder ``path`` (not followed if it is a symlink itself); OSError as the system says."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))


def entries(folder: Path | str, trusted_uid: int | None = None) -> tuple[list[Entry], bool]:
    """Every entry of a keys folder (not the dot files), read by the rules above, and whether the listing stopped
    at ``MAX_ENTRIES``.  ``trusted_uid``: whose files are taken as they are (default: ours)."""
    trusted_uid = os.geteuid() if trusted_uid is None else trusted_uid
    dir_fd = open_folder(folder)
    out, uids, seen, cut = [], {}, 0, False
    try:
        with os.scandir(dir_fd) as it:
            for item in it:
                seen += 1
                if seen > MAX_ENTRIES:
                    cut = True
                    break
                if item.name.startswith("."):
                    continue
                e = read_entry(dir_fd, item.name, trusted_uid=trusted_uid, uids=uids)
                if e is not None:
                    out.append(e)
    finally:
        os.close(dir_fd)
    return sorted(out, key=lambda e: e.name), cut


def accepted(found: list[Entry]) -> list[Entry]:
    """The entries that count, revocations applied: a revoked user's files count under no name, and a revoked
    digest counts in no file."""
    revoked_uids = {user_uid(e.name) for e in found if e.trusted and e.revoked} - {None}
    denied = {d for e in found if e.trusted for d in e.denied}
    out = []
    for e in found:
        if e.problem and not e.digests or (not e.trusted and e.uid in revoked_uids):
            continue
        kept = tuple(d for d in e.digests if d not in denied)
        if kept:
            out.append(replace(e, digests=kept))
    return out


def _folder_signature(st: os.stat_result) -> tuple:
    return ("dir", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _warn_once(path: Path, message: str) -> None:
    if _last_warning.get(str(path)) != message:
        _last_warning[str(path)] = message
        if message:
            log.warning("%s", message)


def _recent(st: os.stat_result) -> bool:
    """Changed in the last ``RACY_NS``: a second change within the file system's clock tick (a few ms, a second on
    some NFS servers) would leave the same times, so such a signature is not trusted yet."""
    return time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS


def _unchanged(path: Path, signature: tuple) -> bool:
    """The folder lists the same entries and every counted file is the same as when ``signature`` was taken."""
    folder = os.stat(path)
    if not signature or signature[0] != _folder_signature(folder) or _recent(folder):
        return False
    for name, *rest in signature[1]:
        try:
            st = os.stat(path / name, follow_symlinks=False)
        except OSError:
            return False
        if (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size) != tuple(rest) or _recent(st):
            return False
    return True


def load(path: Path | str | None, signature: tuple | None = None) -> Ring | None:
    """The digests registered at ``path`` (a keys folder or file), or None when nothing changed since
    ``signature`` (None: read in any case) or the folder cannot be read just now (the caller keeps what it has;
    the reason is logged once).  Never raises for what is or is not at ``path``."""
    if path is None:
        return Ring((), ())
    path = Path(path)
    try:
        if not path.exists():
            return None if signature == ("missing",) else Ring((), ("missing",))
        if not path.is_dir():
            return _load_file(path, signature)
        if signature is not None and _unchanged(path, signature):
            return None
        folder = _folder_signature(os.stat(path))
        found, cut = entries(path)
    except OSError as e:
        _warn_once(path, f"cannot read the registered keys in {path} ({e.strerror}); keeping the ones read before")
        return None
    counted = accepted(found)
    ignored = [e for e in found if e.problem]
    if cut or ignored:
        some = ", ".join(f"{e.name!r} (uid {e.uid}: {e.problem})" for e in ignored[:5])
        _warn_once(path, (f"{path}: only the first {MAX_ENTRIES} entries are read; " if cut else f"{path}: ")
                   + (f"{len(ignored)} entr(ies) ignored in whole or in part: {some}" if ignored else ""))
    else:
        _warn_once(path, "")
    # re-checked each time: the regular files of the owner and of the users they name (one each: a room's few)
    watched = tuple(e.signature for e in found
                    if e.signature and (e.trusted or e.problem not in (NOT_THEIRS, NOT_REGULAR, HARD_LINK)))
    return Ring(tuple(d for e in counted for d in e.digests), (folder, watched))


def _load_file(path: Path, signature: tuple | None) -> Ring | None:
    """A keys file named on the proxy's command line: the owner's list, many digests, if the owner's."""
    fd = os.open(path, _OPEN)  # the owner named it: a symlink to it is theirs to make
    try:
        st = os.fstat(fd)
        sig = ("file", st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
        if signature == sig and not _recent(st):
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > MAX_TRUSTED_BYTES:
            _warn_once(path, f"{path} registers nothing: a keys file must be a regular file of the proxy's own user "
                             f"of at most {MAX_TRUSTED_BYTES} bytes (for a room, use a folder: one file per learner)")
            return Ring((), sig)
        data = _read_upto(fd, MAX_TRUSTED_BYTES)[:MAX_TRUSTED_BYTES]
    finally:
        os.close(fd)
    digests, denied, bad, _ = _parse(data.decode("utf-8", errors="replace"), trusted=True)
    _warn_once(path, f"{path}: {bad} line(s) are not 'sha256:<64 hex digits>'; ignored" if bad else "")
    return Ring(tuple(d for d in digests[:MAX_TRUSTED_DIGESTS] if d not in set(denied)), sig)
