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

A keys *file* (``--keys FILE``) must belong to the proxy's user.  What a learner leaves in ``keys/`` changes who
else is admitted in no way: only *key files* are opened and counted -- a name that is its owner's login name
(``getpwuid`` of the file's uid, as ``llmlab.serve.share.user`` writes it) or a file of the instructor's, not a dot
file -- and everything else is junk, told apart with one ``lstat`` and never opened.  No number of junk entries
keeps a key file from being read: the folder is always listed to its end, and the owner of more than ``MAX_JUNK``
junk entries is named in the log (``llmlab revoke`` removes them).  Reading is bounded: at most ``MAX_ENTRIES`` key
files (only the instructor can make more than one per user), ``MAX_LEARNER_BYTES`` of a learner's file,
``MAX_TRUSTED_BYTES`` and ``MAX_TRUSTED_DIGESTS`` of the owner's, one warning line per change of what is ignored.
Files are opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block the reader, a symlink is not followed) and checked
with ``fstat`` before they are read.  A :class:`Reader` that reads a folder again and again (the proxy's) remembers
the user names it looked up and the key files it read: a file whose (name, inode, mtime, ctime, size) did not
change is not opened again.  A re-check costs one ``stat`` of the folder and one ``lstat`` per counted file; when
the folder changed, one ``lstat`` per entry, and an ``open`` only for key files that changed.

``load(path, signature, reader)`` is what the proxy's ``KeyRing`` calls (in a thread: llmlab/serve/proxy/keys.py);
``entries(folder)`` and ``names_of(folder, uid)`` are what ``llmlab.serve.share`` (``learners``, ``revoke``,
``learner_key``) reads with.  Standard library only.
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

MAX_ENTRIES = 10_000            # key files read (a room has tens of learners; junk does not count)
MAX_JUNK = 1_000                # junk entries of one user before the log names them
MAX_LEARNER_BYTES = 1024        # one "sha256:<64 hex>  user@host time" line is about 120 bytes
MAX_TRUSTED_BYTES = 2**20       # the owner's own files (a keys file, revocation markers)
MAX_TRUSTED_DIGESTS = 10_000
REVOKED = "# revoked"
DIGEST_LINE = re.compile(r"^(?:sha256:)?([0-9a-fA-F]{64})\b")
REVOKED_LINE = re.compile(r"^revoked\s+sha256:([0-9a-fA-F]{64})\b")
RACY_NS = 2 * 10**9          # a change this recent may hide in the clock's granularity: look again next time
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
NOT_THEIRS, NOT_REGULAR, HARD_LINK = "not made by the user it names", "not a regular file", "a hard link"
USER_CACHE_S = 60.0             # how long a Reader trusts the user names it looked up (a learner added mid-class)
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
    denied: tuple[bytes, ...] = ()  # revoked by the owner ("revoked sha256:" lines): refused with a sentence of its own


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


def names_its_owner(name: str, st: os.stat_result, *, suffix: str = "", uids: dict | None = None) -> bool:
    """True when ``name`` is ``<login><suffix>`` and ``<login>`` is the file's owner: the one rule for a file in a
    folder every learner of a room may write to (a key file in ``keys/``, ``<user>.json`` in the progress folder).

    Why by name -> uid: a learner can create any name there, but not a file owned by someone else, so a file counts
    only for the user it names, and nobody can put words in another's name (a login the system does not know never
    matches)."""
    if not name.endswith(suffix):
        return False
    login = name[:len(name) - len(suffix)]
    return bool(login) and user_uid(login, uids) == st.st_uid


def owner_name(uid: int, cache: dict[int, str] | None = None) -> str:
    """The UNIX name of ``uid`` (``uid N`` where it has none), looked up once per uid when given a cache."""
    if cache is not None and uid in cache:
        return cache[uid]
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid {uid}"
    if cache is not None:
        cache[uid] = name
    return name


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
        if not trusted and not names_its_owner(name, st, uids=uids):
            return replace(base, problem=NOT_THEIRS)
        limit = MAX_TRUSTED_BYTES if trusted else MAX_LEARNER_BYTES
        if st.st_size > limit:
            return replace(base, problem=f"larger than {limit} bytes")
        data = read_upto(fd, limit)
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
        data = read_upto(fd, MAX_LEARNER_BYTES)[:MAX_LEARNER_BYTES]
    finally:
        os.close(fd)
    return _parse(data.decode("utf-8", errors="replace"), trusted=False)[0]


def read_upto(fd: int, limit: int) -> bytes:
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


@dataclass(frozen=True)
class Scan:
    """One listing of a keys folder: the key files as read, and whose the rest is."""

    entries: list[Entry]              # key files (see the module docstring), sorted by name
    junk: dict[int, int]              # uid -> entries of theirs that are not key files (never opened)
    examples: dict[int, tuple[str, ...]]  # uid -> a few of those names, for the log
    cut: bool                         # more than MAX_ENTRIES key files: the rest were not read


class Reader:
    """Reads one keys folder again and again (the proxy's key ring, every time ``keys/`` changes).

    Why: a learner can fill ``keys/`` with thousands of names and change one of them every few hundred ms.  A
    re-read must not cost an ``open`` and a ``getpwnam`` per name (a miss took 70 us on local files, far more
    through LDAP or SSSD): junk is told apart with one ``lstat`` and a lookup of its owner's *uid*, cached (a room
    has tens of uids, whatever the number of names), and a key file that did not change is not opened again.
    Not thread-safe: one scan at a time (the proxy runs one at a time, in a worker thread)."""

    def __init__(self, trusted_uid: int | None = None):
        self.trusted_uid = os.geteuid() if trusted_uid is None else trusted_uid
        self._names: dict[int, str | None] = {}   # uid -> login name (getpwuid)
        self._uids: dict[str, int | None] = {}    # name -> uid (getpwnam), for read_entry
        self._read: dict[str, Entry] = {}         # name -> the key file as last read
        self._users_since = time.monotonic()

    def login(self, uid: int) -> str | None:
        """The login name of ``uid``, or None; looked up once per ``USER_CACHE_S``."""
        if uid not in self._names:
            try:
                self._names[uid] = pwd.getpwuid(uid).pw_name
            except KeyError:
                self._names[uid] = None
        return self._names[uid]

    def scan(self, folder: Path | str) -> Scan:
        """Every key file of ``folder``, read (or remembered, if unchanged), and a count of everything else."""
        if time.monotonic() - self._users_since > USER_CACHE_S:
            self._names, self._uids, self._users_since = {}, {}, time.monotonic()
        dir_fd = open_folder(folder)
        out, read, junk, examples, cut = [], {}, {}, {}, False
        try:
            with os.scandir(dir_fd) as it:
                for item in it:
                    try:
                        st = item.stat(follow_symlinks=False)
                    except OSError:  # gone since it was listed
                        continue
                    if not self._is_key_file(item.name, st):
                        if st.st_uid != self.trusted_uid:
                            junk[st.st_uid] = junk.get(st.st_uid, 0) + 1
                            if len(examples.setdefault(st.st_uid, ())) < 3:
                                examples[st.st_uid] += (item.name,)
                        continue
                    if len(out) >= MAX_ENTRIES:
                        cut = True
                        continue
                    e = self._entry(dir_fd, item.name, st)
                    if e is not None:
                        out.append(e)
                        read[e.name] = e
        finally:
            os.close(dir_fd)
        self._read = read
        return Scan(sorted(out, key=lambda e: e.name), junk, examples, cut)

    def _is_key_file(self, name: str, st: os.stat_result) -> bool:
        """Named after its owner, or the instructor's; a dot file never (temp files, and nothing to count)."""
        return not name.startswith(".") and (st.st_uid == self.trusted_uid or self.login(st.st_uid) == name)

    def _entry(self, dir_fd: int, name: str, st: os.stat_result) -> Entry | None:
        """The key file ``name``: as read before if its signature is the same (and not too recent to tell)."""
        trusted = st.st_uid == self.trusted_uid
        if stat.S_ISLNK(st.st_mode):
            return Entry(name, st.st_uid, trusted, False, problem="a symbolic link")
        if not stat.S_ISREG(st.st_mode):  # a FIFO, a device, a folder: never opened
            return Entry(name, st.st_uid, trusted, False, problem=NOT_REGULAR)
        before = self._read.get(name)
        if (before is not None and before.uid == st.st_uid and not _recent(st)
                and before.signature == (name, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)):
            return before
        return read_entry(dir_fd, name, trusted_uid=self.trusted_uid, uids=self._uids)


def entries(folder: Path | str, trusted_uid: int | None = None) -> tuple[list[Entry], bool]:
    """Every key file of a keys folder, read by the rules above, and whether more than ``MAX_ENTRIES`` were found.
    ``trusted_uid``: whose files are taken as they are (default: ours)."""
    found = Reader(trusted_uid).scan(folder)
    return found.entries, found.cut


def names_of(folder: Path | str, uid: int) -> list[str]:
    """Every entry of ``folder`` that ``uid`` owns, dot files and junk included, never followed or opened: what
    ``llmlab revoke`` removes."""
    dir_fd = open_folder(folder)
    try:
        with os.scandir(dir_fd) as it:
            return sorted(item.name for item in it if _owner(item) == uid)
    finally:
        os.close(dir_fd)


def _owner(item: os.DirEntry) -> int | None:
    try:
        return item.stat(follow_symlinks=False).st_uid
    except OSError:
        return None


def accepted(found: list[Entry]) -> list[Entry]:
    """The entries that count, revocations applied: a revoked user's files count under no name, and a revoked
    digest counts in no file."""
    uids: dict[str, int | None] = {}
    revoked_uids = {user_uid(e.name, uids) for e in found if e.trusted and e.revoked} - {None}
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


def load(path: Path | str | None, signature: tuple | None = None, reader: Reader | None = None) -> Ring | None:
    """The digests registered at ``path`` (a keys folder or file), or None when nothing changed since
    ``signature`` (None: read in any case) or the folder cannot be read just now (the caller keeps what it has;
    the reason is logged once).  ``reader``: the :class:`Reader` of earlier calls, whose caches spare the work of
    reading again what did not change.  Never raises for what is or is not at ``path``."""
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
        found = (reader or Reader()).scan(path)
    except OSError as e:
        _warn_once(path, f"cannot read the registered keys in {path} ({e.strerror}); keeping the ones read before")
        return None
    _warn_once(path, _what_is_ignored(path, found))
    # re-checked each time: the regular files of the owner and of the users they name (one each: a room's few)
    watched = tuple(e.signature for e in found.entries
                    if e.signature and (e.trusted or e.problem not in (NOT_THEIRS, NOT_REGULAR, HARD_LINK)))
    return Ring(tuple(d for e in accepted(found.entries) for d in e.digests), (folder, watched),
                tuple(d for e in found.entries if e.trusted for d in e.denied))


def _what_is_ignored(path: Path, found: Scan) -> str:
    """One warning for the log ("" for none): key files that register nothing, and the users with more than
    ``MAX_JUNK`` junk entries, by name.  Worded to stay the same while the counts change (one line per change)."""
    parts = []
    if found.cut:
        parts.append(f"more than {MAX_ENTRIES} key files; only the first {MAX_ENTRIES} are read")
    ignored = [e for e in found.entries if e.problem]
    if ignored:
        some = ", ".join(f"{e.name!r} (uid {e.uid}: {e.problem})" for e in ignored[:5])
        parts.append(f"{len(ignored)} key file(s) ignored in whole or in part: {some}")
    flooders = sorted(uid for uid, n in found.junk.items() if n > MAX_JUNK)
    if flooders:
        who = ", ".join(f"{owner_name(uid)} (uid {uid}, e.g. {', '.join(map(repr, found.examples[uid]))})"
                        for uid in flooders)
        parts.append(f"more than {MAX_JUNK} entries that are not key files, made by {who}: they register nothing "
                     f"and slow every re-read of the folder; `llmlab revoke JOB USER` removes them all")
    return f"{path}: " + "; ".join(parts) if parts else ""


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
        data = read_upto(fd, MAX_TRUSTED_BYTES)[:MAX_TRUSTED_BYTES]
    finally:
        os.close(fd)
    digests, denied, bad, _ = _parse(data.decode("utf-8", errors="replace"), trusted=True)
    _warn_once(path, f"{path}: {bad} line(s) are not 'sha256:<64 hex digits>'; ignored" if bad else "")
    return Ring(tuple(d for d in digests[:MAX_TRUSTED_DIGESTS] if d not in set(denied)), sig, tuple(denied))
