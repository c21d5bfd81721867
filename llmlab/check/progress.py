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
