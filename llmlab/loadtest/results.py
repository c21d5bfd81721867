"""A run's results: the records as a table, saved as they finish, loaded again to resume.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, driver.
"""

from __future__ import annotations

import csv
import json
import threading
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from llmlab.loadtest.records import Record, _missing, summarize

# --- results ------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """The records of a run (one per job, in the order of the jobs) and what they add up to."""

    records: list[Record]
    concurrency: int | None = None

    def summary(self) -> dict:
        return summarize(self.records, self.concurrency)

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "ok"]

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status != "ok"]

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
        return (f"LoadResult({s['requests']} requests: {s['ok']} ok, {s['errors']} failed; "
                f"{s['output_tokens_per_s']:.0f} output tokens/s at concurrency {self.concurrency})")


def save_records(records: Iterable[Record], path: str | Path) -> Path:
    """JSONL (one record per line) or, for a .csv name, CSV with ``itl`` as a JSON list."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in records]
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(Record)])
            writer.writeheader()
            for row in rows:
                writer.writerow({**row, "itl": json.dumps(row["itl"])})
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
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
    """Appends one JSON line per finished record, flushed at once, under a lock: a crash loses at most
    the line being written, and no two threads interleave their lines."""

    def __init__(self, path: Path | None):
        self.path, self.lock = path, threading.Lock()
        self.csv = path is not None and path.suffix == ".csv"
        self.f = None
        if path is not None and not self.csv:
            path.parent.mkdir(parents=True, exist_ok=True)
            torn = False
            if path.exists() and path.stat().st_size:
                with open(path, "rb") as f:
                    f.seek(-1, 2)
                    torn = f.read(1) != b"\n"
            self.f = open(path, "a")
            if torn:  # a run died mid-line: end that line, so the next record starts on its own
                self.f.write("\n")

    def write(self, record: Record) -> None:
        if self.f is not None:
            line = json.dumps(asdict(record)) + "\n"
            with self.lock:
                self.f.write(line)
                self.f.flush()

    def close(self, records: list[Record]) -> None:
        if self.f is not None:
            self.f.close()
        elif self.csv:
            save_records(records, self.path)  # CSV cannot be appended safely: written whole at the end
