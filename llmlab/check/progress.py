"""Where a learner stands: every check's verdict, kept in ``~/.llmlab/progress.jsonl``, and a table of it.

Why: a self-paced learner comes back days later and should see at once which exercises they have passed, and a
workshop instructor asks "who is stuck on 06?".  Each call of ``llmlab.check.<name>`` appends one line (the
check, right or not yet, when, and the notebook when JupyterLab says which); ``llmlab progress`` and
:func:`table` count, per lesson, the exercises passed out of those its exercise notebook has.  Nothing is sent
anywhere, and the answers themselves are not kept.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import secrets
import stat
import time
from pathlib import Path

from llmlab.serve.keyring import names_its_owner, owner_name, read_upto

COURSE = Path(__file__).resolve().parent.parent.parent  # the repository: solutions/, exercises/


def progress_file() -> Path:
    """``$LLMLAB_PROGRESS_FILE``, else ``progress.jsonl`` in llmlab's home.  Why the setting: an OnDemand session of the
    tiny model has a home of its own (its server's files), and a learner's progress must outlive the session."""
    from llmlab.serve.info import llmlab_home

    return Path(os.environ.get("LLMLAB_PROGRESS_FILE") or llmlab_home() / "progress.jsonl")


def record(check: str, ok: bool) -> None:
    """Append one verdict.  A home that cannot be written costs the record, never the check's own answer."""
    line = {"check": check, "ok": ok, "time": time.time()}
    if session := os.environ.get("JPY_SESSION_NAME"):  # the notebook's path, as JupyterLab tells its kernels
        line["notebook"] = Path(session).stem
    try:
        with open(progress_file(), "a") as f:
            f.write(json.dumps(line) + "\n")
    except OSError:
        pass
    if (folder := room_folder()) is not None:
        try:
            hand_in(folder)
        except (OSError, ValueError):  # `llmlab progress --hand-in DIR` says why; a check's answer comes first
            pass


def room_folder() -> Path | None:
    """The room's progress folder when this learner is in one, else None: ``$LLMLAB_PROGRESS_DIR``, or a
    ``progress`` folder beside the workshop's connection file (``<share-dir>/progress``, docs/workshop.md).  Why
    by itself: a hand-in that each learner must remember to type is one most forget (issue 47); each check hands
    the table in -- the table only, no key, no answer."""
    named = os.environ.get("LLMLAB_PROGRESS_DIR")
    if named:
        return Path(named)
    connection = os.environ.get("LLMLAB_CONNECTION_FILE")
    beside = Path(connection).parent / "progress" if connection else None
    return beside if beside is not None and beside.is_dir() else None


def recorded(check):
    """Wrap a check so that each call records its verdict: right (it returned) or not yet (it raised)."""
    from llmlab.check.verdict import NotYet

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            result = check(*args, **kwargs)
        except NotYet:
            record(check.__name__, False)
            raise
        record(check.__name__, True)
        return result

    return wrapper


def exercises(folder: Path | None = None) -> dict[str, list[str]]:
    """The checks each lesson's exercise notebook calls, by notebook name (``06_threaded_requests``)."""
    folder = folder or next((COURSE / d for d in ("exercises", "solutions") if (COURSE / d).is_dir()), COURSE)
    found = {}
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text()).get("cells", [])
        source = "\n".join("".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code")
        found[path.stem] = list(dict.fromkeys(re.findall(r"llmlab\.check\.(\w+)\(", source)))
    return found


def attempts(path: Path | None = None) -> list[dict]:
    """Every recorded verdict, oldest first; a line that is not JSON (a crash mid-write) is skipped."""
    path = path or progress_file()
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def table(path: Path | None = None, folder: Path | None = None) -> list[dict]:
    """One row per lesson: exercises passed / total, and when the learner last tried one of them."""
    tried, lessons = attempts(path), exercises(folder)
    rows = []
    for notebook, checks in lessons.items():
        # a verdict from a lesson's notebook counts there; one from elsewhere (nbval, a copy) wherever its check is
        mine = [a for a in tried if a.get("check") in checks
                and (a.get("notebook") == notebook or a.get("notebook") not in lessons)]
        passed = {a["check"] for a in mine if a.get("ok")}
        last = max((a["time"] for a in mine), default=None)
        rows.append({"lesson": notebook, "passed": len(passed), "total": len(checks),
                     "last attempt": time.strftime("%Y-%m-%d %H:%M", time.localtime(last)) if last else "-",
                     "not yet": [c for c in checks if c not in passed]})  # in the notebook's order
    return rows


def show(path: Path | None = None) -> str:
    """The table as text, for ``llmlab progress`` and a notebook cell."""
    rows = table(path)
    lines = [f"{'lesson':<28} {'passed':>8}  {'last attempt':<16}  next"]
    for r in rows:
        nxt = r["not yet"][0] if r["not yet"] else "all done"
        lines.append(f"{r['lesson']:<28} {r['passed']:>3} / {r['total']:<2}  {r['last attempt']:<16}  {nxt}")
    done, total = sum(r["passed"] for r in rows), sum(r["total"] for r in rows)
    lines.append(f"{'all lessons':<28} {done:>3} / {total:<2}  (kept in {progress_file()})")
    return "\n".join(lines)


# --- a workshop room (opt-in) ----------------------------------------------------------------------------------
#
# The room's folder is shared by every learner of the workshop's group, and each of them may be the attacker: a
# fellow learner (docs/security.md, "The progress folder").  So a hand-in never writes through a name another
# learner could have planted, and the instructor's view of the room trusts no file in the folder.

USER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # a UNIX name that is also a safe file name
LESSON_NAME = re.compile(r"[0-9]{2}_[A-Za-z0-9_]{1,60}")     # an exercise notebook's stem (``06_threaded_requests``)
MAX_HANDIN_BYTES = 64 * 1024  # a hand-in is about 2 KB; anything over 64 KiB is not one
MAX_LEARNERS = 10_000         # hand-ins one --room reads; past that it says how many it left out
MAX_LESSONS = 200
MAX_NOTES = 20                # skipped files named one a line, then one line counting the rest
OPEN_UNTRUSTED = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def learner_name() -> str:
    """This learner's UNIX name, from the process's real uid: never ``$USER`` or ``$LOGNAME``, which anyone can set
    (``USER=bob llmlab progress --hand-in DIR`` must not write ``bob.json``)."""
    import pwd

    try:
        name = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        raise ValueError(f"your uid {os.getuid()} has no user name on this machine (`getent passwd {os.getuid()}` "
                         "says nothing): ask the cluster's admins.") from None
    if not USER_NAME.fullmatch(name):
        raise ValueError(f"{printable(name)!r} is not a user name llmlab can use as a file name.")
    return name


def printable(text: str, limit: int = 200) -> str:
    """``text`` made safe for a terminal and cut at ``limit`` characters: every character that is not printable
    becomes ``?`` -- ESC and the other control characters (which could move the cursor, rewrite lines or retitle
    the instructor's terminal) and Unicode's format characters such as right-to-left overrides."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def check_room_folder(folder: Path, st: os.stat_result) -> None:
    """Refuse a folder that others may write to but that is not sticky: there any learner can rename, replace or
    delete another's file, and plant names before them.  In a sticky folder (``chmod 3770``) each learner can add
    files but replace or delete only their own."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise PermissionError(f"{folder} is writable by other users but not sticky, so another learner could replace "
                              f"or pre-plant your file: ask your instructor to run `chmod 3770 {folder}`.")


def hand_in(folder: Path) -> Path:
    """Put this learner's table -- and nothing else: no key, no answer, no notebook -- into the room's folder as
    ``<user>.json``, readable by its group (0640), so that the instructor sees who is stuck where.  Opt-in: only
    this call writes there, and each call replaces the learner's earlier file.  The folder is one the instructor
    made for the room, group-writable and sticky (``install -d -m 3770 -g GROUP DIR``); one that is not sticky is
    refused.  ``<user>`` is the name of the process's real uid.

    The folder is opened once and everything happens in it through that descriptor: the table goes to a new file
    of a random name (``O_EXCL | O_NOFOLLOW``: no name another learner planted, a symlink to a file of yours say, is
    written through or chmod-ed), which is then renamed onto ``<user>.json`` (a rename replaces the entry itself,
    whatever it was)."""
    folder, user = Path(folder), learner_name()
    dir_fd = _open_room_folder(folder)
    try:
        check_room_folder(folder, os.fstat(dir_fd))
        _refuse_taken(folder, dir_fd, f"{user}.json")
        rows = [{k: r[k] for k in ("lesson", "passed", "total", "last attempt")} for r in table()]
        text = json.dumps({"user": user, "handed in": time.strftime("%Y-%m-%d %H:%M"), "lessons": rows})
        _replace_in(dir_fd, f".{user}.", f"{user}.json", text)
    finally:
        os.close(dir_fd)
    return folder / f"{user}.json"


def _open_room_folder(folder: Path) -> int:
    """A descriptor of the room's folder, or one sentence saying to ask for the right folder."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        dir_fd = None
    if dir_fd is None or not os.access(".", os.W_OK | os.X_OK, dir_fd=dir_fd):
        if dir_fd is not None:
            os.close(dir_fd)
        raise PermissionError(f"{folder} is not a folder you can write to: ask your instructor for the room's "
                              "progress folder (they create it for the workshop's group, group-writable and sticky).")
    return dir_fd


def _refuse_taken(folder: Path, dir_fd: int, name: str) -> None:
    """Someone else's entry, or a folder, under this learner's name: the sticky folder keeps it there (the rename
    would fail with a bare "Operation not permitted"), so say whose it is and who can remove it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        raise PermissionError(f"{folder / name} is there already and belongs to {printable(owner_name(st.st_uid))}, "
                              "not to you: ask your instructor to remove it, then hand in again.")
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(f"{folder / name} is a folder of yours: remove it, then hand in again.")


def _replace_in(dir_fd: int, prefix: str, name: str, text: str) -> None:
    """Write ``text`` to a new file of a random name (``O_EXCL``: never a name that exists; ``O_NOFOLLOW``: never
    through a link), make it 0640 with ``fchmod`` (the open file, not a name), then rename it onto ``name``."""
    for _ in range(10):
        tmp = f"{prefix}{secrets.token_hex(8)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=dir_fd)
            break
        except FileExistsError:  # only if someone guessed 64 random bits
            continue
    else:
        raise FileExistsError("ten random names for a temp file were all taken: someone fills the folder.")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o640)  # whatever the umask: the group (the instructor) reads it, nobody else
            f.write(text)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


class NotAHandIn(ValueError):
    """A file of the room's folder that is not what :func:`hand_in` writes; the message says why, in a few words."""


def read_room(folder: Path) -> tuple[list[dict], list[str]]:
    """The room: one row per learner who handed in, and notes on what was skipped and why.

    No file is trusted.  Only ``<name>.json`` owned by the UNIX user ``name`` counts, so a learner cannot hand in
    for another nor twice, and the name shown is the owner's, never what the file says.  Every other ``*.json``
    costs one ``lstat``.  A file that counts is opened without following a link and without blocking (a FIFO, a
    link to /dev/zero), read only if it is a regular file, at most ``MAX_HANDIN_BYTES`` of it, and used only if it
    has the shape :func:`hand_in` writes.  At most ``MAX_LEARNERS`` files are read."""
    folder, rows, notes = Path(folder), [], Notes()
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        return [], [f"cannot read {printable(folder)} ({e.strerror})"]
    try:
        try:
            check_room_folder(folder, os.fstat(dir_fd))
        except PermissionError:
            notes.warn(f"warning: {folder} is writable by other users but not sticky, so a learner can replace "
                       f"another's file: `chmod 3770 {folder}`.")
        names: dict[int, str] = {}
        theirs = _hand_in_names(dir_fd, names, notes)
        for name in theirs[:MAX_LEARNERS]:
            try:
                rows.append(_room_row(dir_fd, name, names))
            except NotAHandIn as e:
                notes.skip(name, e)
    finally:
        os.close(dir_fd)
    if len(theirs) > MAX_LEARNERS:
        notes.warn(f"only the first {MAX_LEARNERS} of {len(theirs)} hand-ins were read")
    return rows, notes.lines()


class Notes:
    """What the room's view skipped, a line each up to ``MAX_NOTES``, then one line counting the rest: a learner
    who plants 100,000 files costs the instructor one line, not 100,000."""

    def __init__(self):
        self.shown: list[str] = []
        self.more = 0

    def warn(self, line: str) -> None:
        self.shown.append(printable(line, 300))

    def skip(self, name: str, why: Exception) -> None:
        if len(self.shown) < MAX_NOTES:
            self.shown.append(f"skipped {printable(name, 80)}: {why}")
        else:
            self.more += 1

    def lines(self) -> list[str]:
        return self.shown + ([f"... and {self.more} more files skipped"] if self.more else [])


def _hand_in_names(dir_fd: int, names: dict[int, str], notes: Notes) -> list[str]:
    """The ``*.json`` entries of the open folder named after their owner, sorted; a note for every other one.
    Names starting with a dot (a hand-in's temp file) are not looked at."""
    theirs = []
    with os.scandir(dir_fd) as found:
        for entry in found:
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            try:
                _named_after_owner(entry.name, entry.stat(follow_symlinks=False), names)
            except FileNotFoundError:
                continue  # renamed or removed since the listing: a hand-in in progress
            except (NotAHandIn, OSError) as e:
                notes.skip(entry.name, e)
                continue
            theirs.append(entry.name)
    return sorted(theirs)


def _named_after_owner(name: str, st: os.stat_result, names: dict[int, str]) -> str:
    """The owner's name if ``name`` is a regular file called ``<owner>.json``, else :class:`NotAHandIn`."""
    if not stat.S_ISREG(st.st_mode):
        raise NotAHandIn("a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file")
    owner = owner_name(st.st_uid, names)
    if not names_its_owner(name, st, suffix=".json"):
        raise NotAHandIn(f"it belongs to {printable(owner, 64)}, and only {printable(owner, 64)}.json can be theirs")
    return owner


def _room_row(dir_fd: int, name: str, names: dict[int, str]) -> dict:
    """One learner's row from the file ``name`` of the open folder, checked again on the file as opened (it may
    have been replaced since the listing), or :class:`NotAHandIn` saying why not."""
    try:
        fd = os.open(name, OPEN_UNTRUSTED, dir_fd=dir_fd)
    except OSError as e:  # ELOOP: a symlink by now; EACCES: not readable by the instructor
        raise NotAHandIn("a symbolic link" if e.errno == errno.ELOOP else f"not readable ({e.strerror})") from None
    try:
        owner = _named_after_owner(name, os.fstat(fd), names)
        data = read_upto(fd, MAX_HANDIN_BYTES)
    finally:
        os.close(fd)
    if len(data) > MAX_HANDIN_BYTES:
        raise NotAHandIn(f"larger than {MAX_HANDIN_BYTES // 1024} KiB")
    lessons, handed = _parse_hand_in(data)
    return {"user": owner, "passed": sum(r["passed"] for r in lessons), "total": sum(r["total"] for r in lessons),
            "handed in": handed, **{r["lesson"]: f"{r['passed']}/{r['total']}" for r in lessons}}


def _parse_hand_in(data: bytes) -> tuple[list[dict], str]:
    """The lessons (name, passed, total) and the time of a file :func:`hand_in` wrote, checked field by field: a
    file of another shape is skipped with a note, never a traceback."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError included
        raise NotAHandIn("not JSON (cut short? that learner hands in again)") from None
    lessons = doc.get("lessons") if isinstance(doc, dict) else None
    if not isinstance(lessons, list) or len(lessons) > MAX_LESSONS:
        raise NotAHandIn(f"not a hand-in: no list of at most {MAX_LESSONS} lessons")
    out = []
    for i, r in enumerate(lessons, 1):
        if not isinstance(r, dict) or not isinstance(r.get("lesson"), str) or not LESSON_NAME.fullmatch(r["lesson"]):
            raise NotAHandIn(f"not a hand-in: lesson {i} has no lesson name")
        passed, total = r.get("passed"), r.get("total")
        if not all(type(n) is int for n in (passed, total)) or not 0 <= passed <= total <= 1000:
            raise NotAHandIn(f"not a hand-in: lesson {i} has no counts (0 <= passed <= total)")
        out.append({"lesson": r["lesson"], "passed": passed, "total": total})
    handed = doc.get("handed in")
    return out, printable(handed, 16) if isinstance(handed, str) else "-"


def room(folder: Path) -> list[dict]:
    """One row per learner who handed in: exercises passed in all, per lesson, and when they handed in."""
    return read_room(folder)[0]


def show_room(folder: Path, path: list[str]) -> str:
    """The room as text, a learner a line, then what was skipped and why (``llmlab progress --room DIR``): ``path``,
    the workshop path's lessons in order (``llmlab.ops.course.path_lessons``), a column each -- a room is taught the
    path, so the view leads with its exercises, not the whole course's (58 over 19 lessons, issue 47).  Every
    string a learner's file brings is :func:`printable` by now: no escape sequence reaches the instructor's
    terminal."""
    rows, notes = read_room(folder)
    if not rows:
        return "\n".join([f"nobody has handed in yet: learners run `llmlab progress --hand-in {folder}`.", *notes])
    lines = [f"{'user':<16} {'the path':>9} {'all':>9}  {'handed in':<16}  " + " ".join(k[:2].rjust(5) for k in path)]
    for r in rows:
        done, total = _sums([r.get(k, "0/0") for k in path])
        lines.append(f"{printable(r['user'], 64):<16} {done:>4} / {total:<3} {r['passed']:>4} / {r['total']:<3} "
                     f"{r['handed in']:<16}  " + " ".join(str(r.get(k, "-")).rjust(5) for k in path))
    lines.append(f"(the path: the lessons of the workshop's path, {', '.join(k[:2] for k in path)}, each "
                 "column a lesson's exercises passed / all of them; all: the course's every lesson)")
    return "\n".join(lines + notes)


def _sums(cells: list[str]) -> tuple[int, int]:
    pairs = [tuple(int(n) for n in c.split("/")) for c in cells]
    return sum(p for p, _ in pairs), sum(t for _, t in pairs)
