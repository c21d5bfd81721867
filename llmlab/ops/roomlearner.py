"""One learner of a rehearsed room: run the workshop path's notebooks in kernels of one's own, then hand in.

``llmlab room`` starts this module as the learner's own UNIX user (``setpriv``), so every kernel, key and file is
theirs, exactly as in JupyterLab::

    python -m llmlab.ops.roomlearner SPEC.json

The spec (written by ``llmlab.ops.room``) names the notebooks, the files to write, and the one event this learner
meets, if any: a kernel restart after a given cell of a given notebook (the driver restarts it and runs that
notebook again from its first cell, as a learner does after "Restart Kernel").  Each notebook gets a fresh kernel
(JupyterLab gives each open notebook its own), started with a hidden first cell that records the requests
(``llmlab.ops.roomtrace``).  A failing cell does not stop the learner (they read the error and go on), but a refusal
of their key does: a revoked learner cannot go on, and says so.  Last, ``llmlab progress --hand-in``.

What it writes: ``events`` (a JSON line per notebook and cell, read live by the instructor's side), ``results``
(the summary) and ``trace`` (the requests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REFUSED = ("AuthenticationFailed", "AuthenticationError", "PermissionDenied")


class Restart(Exception):
    """The spec's kernel restart is due: leave this kernel, run the notebook again in a new one."""


def event(path: Path, **fields) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"t": time.time(), **fields}) + "\n")


def hidden_cell(trace: str, notebook: str):
    import nbformat

    code = (f"import llmlab.ops.roomtrace as _room_trace\n_room_trace.install({trace!r}, {notebook!r})\n"
            "del _room_trace")
    return nbformat.v4.new_code_cell(code, metadata={"tags": ["room-trace"]})


ANSI = re.compile(r"\x1b\[[0-9;]*m")
ARROW = re.compile(r"^\s*-+>\s*\d*\s?")  # IPython's mark of the line that raised, padded to the line number's width


def error_of(cell) -> tuple[str, str, str] | None:
    """(exception name, last line of the error, the cell's line that raised it) of an executed cell, or None.
    The line matters where the message is empty: a bare ``assert`` says only ``AssertionError``."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            value = (out.get("evalue") or "").strip().splitlines()
            frames = [ANSI.sub("", f) for f in out.get("traceback", [])]
            arrows = [line for f in frames for line in f.splitlines() if ARROW.match(line)]  # ----> 3, ---> 21
            raised = ARROW.sub("", arrows[0]) if arrows else ""
            return (out.get("ename", "Error"), f"{out.get('ename', 'Error')}: {value[-1] if value else ''}".strip(),
                    raised.strip())
    return None


def is_refusal(name: str, line: str) -> bool:
    """The server (or connect()) refused this learner's key: the learner cannot go on."""
    return name in REFUSED or ("401" in line and "Unauthorized" in line)


def run_notebook(path: Path, spec: dict, restart_after: int | None) -> dict:
    """Execute one notebook in a fresh kernel; returns its failures, refusal and timing."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    name = path.stem
    nb.cells.insert(0, hidden_cell(spec["trace"], name))
    os.environ["JPY_SESSION_NAME"] = str(path)  # llmlab.check.progress names the notebook of each verdict
    client = NotebookClient(nb, timeout=spec.get("cell_timeout", 600), kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": spec["workdir"]}})
    out = {"notebook": name, "start": time.time(), "failed": [], "refused": None, "cells": 0}
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            shown = index - 1  # the notebook's own cell number (the hidden one is not the learner's)
            try:
                client.execute_cell(cell, index)
                err = error_of(cell)
            except Exception as e:  # noqa: BLE001 -- a cell past its time-out, a kernel that died: the learner's problem
                lines = str(e).strip().splitlines()
                err = (type(e).__name__, f"{type(e).__name__}: {lines[-1] if lines else ''}", "")
            if index == 0:  # the hidden cell: the learner never sees it (an error in it is the room's, raise it)
                if err:
                    raise RuntimeError(f"the room's hidden first cell failed in {name}: {err[1]}")
                continue
            out["cells"] += 1
            refused = bool(err) and is_refusal(err[0], err[1])
            event(Path(spec["events"]), kind="cell", notebook=name, cell=shown, error=err[1] if err else None,
                  refused=refused)
            if refused:
                out["refused"] = {"cell": shown, "sentence": err[1]}
                break
            if err:
                out["failed"].append({"cell": shown, "error": err[1], "raised_at": err[2]})
            if restart_after is not None and shown >= restart_after:
                raise Restart(shown, out["failed"])
    out["end"] = time.time()
    return out


def hand_in(spec: dict) -> dict:
    res = subprocess.run([sys.executable, "-m", "llmlab", "progress", "--hand-in", spec["hand_in"]],
                         capture_output=True, text=True, timeout=120)
    return {"rc": res.returncode, "output": (res.stdout + res.stderr).strip()}


def main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    events = Path(spec["events"])
    restart = spec.get("restart") or {}
    results = {"name": spec["name"], "notebooks": [], "restarted": None, "refused": None, "start": time.time()}
    for nb_path in map(Path, spec["notebooks"]):
        event(events, kind="notebook", notebook=nb_path.stem)
        due = restart.get("after_cell") if restart.get("notebook") == nb_path.stem else None
        try:
            done = run_notebook(nb_path, spec, due)
        except Restart as r:
            results["restarted"] = {"notebook": nb_path.stem, "after_cell": r.args[0], "at": time.time(),
                                    "failed_before": r.args[1]}
            event(events, kind="restart", notebook=nb_path.stem, cell=r.args[0])
            done = run_notebook(nb_path, spec, None)  # a new kernel, from the notebook's first cell
            results["restarted"]["completed"] = done["refused"] is None
        results["notebooks"].append(done)
        if done["refused"]:
            results["refused"] = {"notebook": done["notebook"], **done["refused"]}
            break
    results["end"] = time.time()
    results["hand_in"] = hand_in(spec)
    event(events, kind="done")
    Path(spec["results"]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
