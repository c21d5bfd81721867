"""A run's results: the records as a table, saved as they finish, loaded again to resume.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, repeats, driver.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import threading
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from llmlab.loadtest.records import Record, _missing, summarize

# --- results ------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """The records of a run (one per job, in the order of the jobs) and what they add up to.  An open-loop run
    (``run_rate``/``run_open``/``run_sessions``) has no concurrency; it may have a ``rate``, and where ``stop`` ended
    it early, ``stopped`` says why and ``planned`` how many requests it would have sent."""

    records: list[Record]
    concurrency: int | None = None
    rate: float | None = None
    planned: int | None = None
    stopped: str | None = None

    def summary(self, slo: dict | None = None) -> dict:
        """:func:`summarize` of the records; ``slo`` (seconds, e.g. ``{"ttft": 0.5, "tpot": 0.05}``) adds goodput."""
        s = summarize(self.records, self.concurrency, slo)
        if self.rate is not None:
            s["rate"] = self.rate
        if self.stopped:
            s.update(planned=self.planned, stopped=self.stopped)
        return s

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "ok"]

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status != "ok"]

    def raise_on_failure(self) -> LoadResult:
        """``self`` if every request succeeded, else a RuntimeError naming how many failed and the first error: for
        experiments whose figures would mislead over failed requests (a rate that flatters the layout that failed)."""
        if self.failed:
            raise RuntimeError(f"{len(self.failed)} of {len(self.records)} requests failed, the first: "
                               f"{self.failed[0].error}")
        return self

    def to_frame(self):
        """One row per record (a pandas DataFrame); ``itl`` stays a list."""
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.records], columns=[f.name for f in fields(Record)])

    def save(self, path: str | Path) -> Path:
        """Write every record to ``path``: JSONL, or CSV if the name ends in .csv."""
        return save_records(self.records, path)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        s = self.summary()
        load = f"concurrency {self.concurrency}" if self.concurrency is not None else (
            f"{self.rate:g} requests/s offered" if self.rate is not None else "an open loop")
        stopped = f"; stopped early: {self.stopped}" if self.stopped else ""
        return (f"LoadResult({s['requests']} requests: {s['ok']} ok, {s['errors']} failed; "
                f"{s['output_tokens_per_s']:.0f} output tokens/s at {load}{stopped})")


def save_records(records: Iterable[Record], path: str | Path) -> Path:
    """JSONL (one record per line) or, for a .csv name, CSV with ``itl`` as a JSON list.

    Written to a temporary file beside ``path`` that replaces it only once complete: a full disk (or any
    error) leaves an earlier ``path`` as it was, and the OSError says so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = list(records)
    rows = [asdict(r) for r in records]
    if path.suffix == ".csv":
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=[x.name for x in fields(Record)])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "itl": json.dumps(row["itl"])})
        data = text.getvalue()
    else:
        data = "".join(json.dumps(row) + "\n" for row in rows)
    try:
        return replace_file(path, data.encode())
    except OSError as e:
        kept = f"{path} is unchanged" if path.exists() else f"no file was created at {path}"
        raise OSError(e.errno, f"{e.strerror}: could not save {len(records)} records; {kept} (the records are still "
                               "in memory: free some space, or save them elsewhere)", str(path)) from e


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for a moment, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def replace_file(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file in the same folder, then ``os.replace``.  On any
    error (ENOSPC part-way) the temporary file goes and ``path`` keeps its earlier content.  The new file gets the
    old one's mode, or the usual one for a new file.  Where ``path`` is not a regular file (``/dev/null``, a
    FIFO), it is written in place: replacing a device is never what was meant."""
    path = Path(path)
    target = path.resolve() if path.is_symlink() else path  # a link keeps pointing where it pointed
    if target.exists() and not target.is_file():
        with open(target, "wb") as f:
            f.write(data)
        return path
    mode = (target.stat().st_mode & 0o7777) if target.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())  # the data is on the disk before the name points at it
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(path: str | Path) -> LoadResult:
    """Read saved records (JSONL or CSV).  Where an id appears more than once (a resumed run appends),
    the last record wins.  A torn line -- the process died while writing it -- is skipped with a warning."""
    path = Path(path)
    rows: list[dict] = []
    if path.suffix == ".csv":
        import pandas as pd

        frame = pd.read_csv(path, dtype={"id": str, "error": str, "text": str, "session": str})
        rows = [{k: (None if _missing(v) else v) for k, v in row.items()} for row in frame.to_dict("records")]
        for row in rows:
            row["id"] = int(row["id"]) if str(row["id"]).lstrip("-").isdigit() else row["id"]
            for key in ("prompt_tokens", "output_tokens", "max_tokens", "concurrency"):
                if row.get(key) is not None:
                    row[key] = int(row[key])
    else:
        torn = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    torn.append(n)
        if torn:
            warnings.warn(f"{path}: line(s) {', '.join(map(str, torn))} are incomplete (a run stopped while writing "
                          "them) and were skipped; resuming sends those requests again.", stacklevel=2)
    latest: dict[str, Record] = {}
    for row in rows:
        rec = Record.from_dict(row)
        latest.pop(str(rec.id), None)
        latest[str(rec.id)] = rec
    levels = {r.concurrency for r in latest.values()}
    return LoadResult(list(latest.values()), levels.pop() if len(levels) == 1 else None)


class _Appender:
    """Appends one JSON line per finished record, written at once, under a lock: a crash loses at most the line
    being written, and no two threads interleave their lines.

    A full disk (or any write error) does not end the run: the file is cut back to its last whole line, nothing
    more is written to it, and a warning says how many records it keeps; every record is in the LoadResult."""

    def __init__(self, path: Path | None):
        self.path, self.lock = path, threading.Lock()
        self.csv = path is not None and path.suffix == ".csv"
        self.fd: int | None = None
        self.saved = self.tried = 0  # records of this run written whole / handed to write()
        self.error: OSError | None = None
        if path is not None and not self.csv:
            path.parent.mkdir(parents=True, exist_ok=True)
            torn = False
            if path.exists() and path.stat().st_size:
                with open(path, "rb") as f:
                    f.seek(-1, 2)
                    torn = f.read(1) != b"\n"
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            self.good = os.fstat(self.fd).st_size  # the file's length after its last whole line
            if torn:  # a run died mid-line: end that line, so the next record starts on its own
                self._append(b"\n")

    def _append(self, data: bytes) -> bool:
        """Write ``data`` whole, or cut the file back to where it was and stop saving; True if written."""
        if self.fd is None:
            return False
        try:
            view = memoryview(data)
            while view:  # a nearly full disk takes part of a write, then refuses the rest
                view = view[os.write(self.fd, view):]
            self.good += len(data)
            return True
        except OSError as e:
            self.error = e
            try:
                os.ftruncate(self.fd, self.good)  # no torn line: what stays is whole records
            except OSError:
                pass  # a device (/dev/full) or a file system that refuses: load() skips a torn line anyway
            os.close(self.fd)
            self.fd = None
            warnings.warn(f"{self.path}: {e.strerror} after {self.saved} record(s) of this run were saved; the file "
                          "keeps those as whole lines and this run saves no more to it. The run goes on: every "
                          "record is in the LoadResult it returns.", stacklevel=4)
            return False

    def write(self, record: Record) -> None:
        if self.path is None or self.csv:
            return
        line = (json.dumps(asdict(record)) + "\n").encode()
        with self.lock:
            self.tried += 1
            if self._append(line):
                self.saved += 1

    def close(self, records: list[Record]) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.error is not None:
            warnings.warn(f"{self.path} keeps {self.saved} of the {self.tried} records of this run "
                          f"({self.error.strerror}); the others are only in the LoadResult this run returns: "
                          "result.save('another/place.jsonl') keeps them all.", stacklevel=4)
        elif self.csv:  # CSV cannot be appended safely: written whole at the end
            try:
                save_records(records, self.path)
            except OSError as e:
                warnings.warn(f"{self.path}: could not write the {len(records)} records ({e.strerror}); they are in "
                              "the LoadResult this run returns: result.save('another/place.csv') keeps them.",
                              stacklevel=4)
