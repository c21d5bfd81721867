"""Where a learner stands: every check's verdict, kept in ``~/.llmlab/progress.jsonl``, and a table of it.

Why: a self-paced learner comes back days later and should see at once which exercises they have passed, and a
workshop instructor asks "who is stuck on 06?".  Each call of ``llmlab.check.<name>`` appends one line (the
check, right or not yet, when, and the notebook when JupyterLab says which); ``llmlab progress`` and
:func:`table` count, per lesson, the exercises passed out of those its exercise notebook has.  Nothing is sent
anywhere, and the answers themselves are not kept.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path

COURSE = Path(__file__).resolve().parent.parent.parent  # the repository: solutions/, exercises/


def progress_file() -> Path:
    from llmlab.serve.info import llmlab_home

    return llmlab_home() / "progress.jsonl"


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

def hand_in(folder: Path, user: str | None = None) -> Path:
    """Put this learner's table -- and nothing else: no key, no answer, no notebook -- into the room's folder as
    ``<user>.json``, readable by its group (0640), so that the instructor sees who is stuck where.  Opt-in: only
    this call writes there, and each call replaces the learner's earlier file.  The folder is one the instructor
    made for the room (group-writable, e.g. ``install -d -m 2770 -g GROUP DIR``)."""
    import getpass

    folder, user = Path(folder), user or getpass.getuser()
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise PermissionError(f"{folder} is not a folder you can write to: ask your instructor for the room's "
                              "progress folder (they create it group-writable for the workshop's group).")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", user) or user.startswith("."):
        raise ValueError(f"{user!r} is not a user name llmlab can use as a file name.")
    rows = [{k: r[k] for k in ("lesson", "passed", "total", "last attempt")} for r in table()]
    tmp = folder / f".{user}.json.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w") as f:
        json.dump({"user": user, "handed in": time.strftime("%Y-%m-%d %H:%M"), "lessons": rows}, f)
    os.chmod(tmp, 0o640)  # whatever the umask: the group (the instructor) reads it, nobody else
    return tmp.replace(folder / f"{user}.json")


def room(folder: Path) -> list[dict]:
    """One row per learner who handed in: exercises passed in all, per lesson, and when they handed in."""
    rows = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # unreadable or half-written: that learner hands in again
        lessons = data.get("lessons", [])
        rows.append({"user": data.get("user", path.stem), "passed": sum(r["passed"] for r in lessons),
                     "total": sum(r["total"] for r in lessons), "handed in": data.get("handed in", "-"),
                     **{r["lesson"]: f"{r['passed']}/{r['total']}" for r in lessons}})
    return rows


def show_room(folder: Path) -> str:
    """The room as text, a learner a line (``llmlab progress --room DIR``)."""
    rows = room(folder)
    if not rows:
        return f"nobody has handed in yet: learners run `llmlab progress --hand-in {folder}`."
    lessons = [k for k in rows[0] if k[:2].isdigit()]
    lines = [f"{'user':<16} {'passed':>9}  {'handed in':<16}  " + " ".join(k[:2].rjust(5) for k in lessons)]
    lines += [f"{r['user']:<16} {r['passed']:>4} / {r['total']:<3} {r['handed in']:<16}  " +
              " ".join(str(r.get(k, "-")).rjust(5) for k in lessons) for r in rows]
    return "\n".join(lines)
