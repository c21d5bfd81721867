"""pytest plugin for the course's own suite (loaded with ``-p llmlab.ops.testing`` from pyproject).

- Gives the whole test session a private ``LLMLAB_HOME``, so tests never touch a learner's running server
  and nbval's notebook kernels (which inherit the environment) all find the one embedded server.
- ``embedded`` fixture: the real embedded vLLM server, started once per session, stopped at the end.
- Notebook cells tagged ``cluster-only`` are skipped with a visible reason: they need a GPU cluster.
- ``LLMLAB_TEST_SERVER=cluster`` (``make test-cluster``): before the first test, the launcher's CPU job serves a
  second small model (``llmlab-wide``, every shape unlike the tiny model's) under the SLURM test bed, and
  ``LLMLAB_CONNECTION_FILE`` points every notebook kernel at it -- a cluster's server, found a cluster's way
  (``tests/cluster_mode.py``).  The job is cancelled at the end.  Only the notebooks that read that server (the
  manifest's ``room`` rows, ``llmlab/course.toml``) are executed there: the others would run the same cells again.
- **Each notebook is executed once per CI run, and kept.**  nbval executes every cell; this plugin keeps what each
  cell printed and drew, and how long it took, and writes the executed copy of every notebook to
  ``build/executed/`` (``build/executed-cluster/`` in cluster mode; ``LLMLAB_EXECUTED_DIR`` elsewhere).  ``make
  book`` renders those copies instead of running the lessons a second time.  Every API key of every engine the
  session started is searched for in every copy: a copy that holds one fails the session, and ``make book``
  checks again, so no key reaches the book.  Which keys: every key llmlab made (``llmlab.serve.info.new_key_file``
  notes each one's digest in ``keys.sha256`` beside the copies, through ``LLMLAB_KEY_DIGESTS``, which the
  notebooks' kernels inherit: a router's key in its own run folder, an engine that stopped long before the end),
  and every key file a thread sees under ``LLMLAB_HOME`` while it exists (a SLURM job's, made by its launcher).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path

import pytest

CLUSTER_ONLY = "cluster-only"
WIDGET = "application/vnd.jupyter.widget-view+json"
_HOME: str | None = None
_CLUSTER_JOB: str | None = None
_CELLS: dict[str, dict[int, dict]] = {}  # notebook path -> code cell number -> what it printed, its time, outcome
_KEYS: set[str] = set()  # every key file's content seen under LLMLAB_HOME during the session
_WATCH = threading.Event()  # set: the key watcher stops


def _cluster_mode(config):
    """The tests/cluster_mode.py module of the checkout under test (test infrastructure, not part of llmlab)."""
    import importlib.util

    path = config.rootpath / "tests" / "cluster_mode.py"
    spec = importlib.util.spec_from_file_location("llmlab_cluster_mode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    global _HOME
    digests = executed_dir(config) / "keys.sha256"  # kept across runs: a copy of an earlier run is checked too
    digests.parent.mkdir(parents=True, exist_ok=True)
    digests.touch(mode=0o600)
    os.environ["LLMLAB_KEY_DIGESTS"] = str(digests)
    if "LLMLAB_TEST_HOME" in os.environ:
        os.environ["LLMLAB_HOME"] = os.environ["LLMLAB_TEST_HOME"]
    else:
        _HOME = tempfile.mkdtemp(prefix="llmlab-test-home-")
        os.environ["LLMLAB_HOME"] = _HOME
    for var in ("LLMLAB_BASE_URL", "LLMLAB_API_KEY", "LLMLAB_API_KEY_FILE", "LLMLAB_CONNECTION_FILE"):
        os.environ.pop(var, None)


def _cluster() -> bool:
    return os.environ.get("LLMLAB_TEST_SERVER") == "cluster"


def pytest_sessionstart(session):
    """Watch for keys; cluster mode: serve ``llmlab-wide`` through the SLURM launcher before any notebook kernel
    starts (kernels inherit ``LLMLAB_CONNECTION_FILE``)."""
    global _CLUSTER_JOB
    if session.config.option.collectonly:
        return
    threading.Thread(target=_watch_keys, args=(Path(os.environ["LLMLAB_HOME"]),), daemon=True).start()
    if not _cluster():
        return
    job_id, conn = _cluster_mode(session.config).up(Path(os.environ["LLMLAB_HOME"]))
    _CLUSTER_JOB = job_id
    os.environ["LLMLAB_CONNECTION_FILE"] = str(conn)


def pytest_sessionfinish(session, exitstatus):
    """Write the executed copies; a copy that holds a key fails the session."""
    _WATCH.set()
    _read_keys(Path(os.environ.get("LLMLAB_HOME", "/nonexistent")))
    from llmlab.serve.info import note_key

    for key in _KEYS:  # a job's key, made by its launcher: noted with the rest, for `make book`
        note_key(key)
    if not _CELLS:
        return
    leaked = write_executed(executed_dir(session.config), session.config.rootpath)
    if leaked:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nan engine's API key appears in the outputs of {', '.join(leaked)}: fix the cell that prints it "
              "(the copies are marked and the book refuses them).")


def pytest_unconfigure(config):
    """Stop the session's embedded server (started by a fixture or by a notebook's connect())."""
    if _CLUSTER_JOB is not None:
        _cluster_mode(config).down(_CLUSTER_JOB)
    if _HOME is not None:
        from llmlab.serve import embedded

        embedded.stop_embedded()


def pytest_collection_modifyitems(config, items):
    if _cluster():  # only the notebooks that read the cluster's server
        from llmlab.ops import course

        room = {config.rootpath / p for p in course.load().room_notebooks()}
        kept = [i for i in items if not _is_cell(i) or Path(i.parent.path) in room]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is not None and CLUSTER_ONLY in cell.get("metadata", {}).get("tags", []):
            item.add_marker(pytest.mark.skip(reason="cluster-only cell: needs a GPU cluster's vLLM server"))


# --- the executed copies ----------------------------------------------------------------------------------------

def _is_cell(item) -> bool:
    return hasattr(item, "cell_num") and hasattr(item, "test_outputs")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep what an nbval cell printed (``item.test_outputs``: nbval's own record), its time and its outcome."""
    outcome = yield
    report = outcome.get_result()
    if not _is_cell(item) or (report.when != "call" and not report.skipped):
        return
    _CELLS.setdefault(str(item.parent.path), {})[item.cell_num] = {
        "outputs": [dict(o) for o in (item.test_outputs or [])], "seconds": round(report.duration, 3),
        "outcome": report.outcome}


def executed_dir(config) -> Path:
    if "LLMLAB_EXECUTED_DIR" in os.environ:
        return Path(os.environ["LLMLAB_EXECUTED_DIR"])
    return config.rootpath / "build" / ("executed-cluster" if _cluster() else "executed")


def write_executed(dest: Path, root: Path) -> list[str]:
    """One executed copy per notebook run (``dest/<folder>/<name>.ipynb``) with outputs, execution counts and, in
    the notebook's metadata, each cell's seconds and outcome; returns the copies that hold a key."""
    from llmlab.ops import book
    from llmlab.serve.info import noted_keys

    digests = noted_keys(Path(os.environ.get("LLMLAB_KEY_DIGESTS", dest / book.KEY_DIGESTS)))
    leaked = []
    for path, cells in sorted(_CELLS.items()):
        src = Path(path)
        nb = json.loads(src.read_text())
        count, timing = 0, []
        for i, cell in enumerate(c for c in nb["cells"] if c["cell_type"] == "code"):
            ran = cells.get(i)
            if ran is None or ran["outcome"] == "skipped":
                timing.append({"cell": i, "outcome": ran["outcome"] if ran else "not run", "seconds": 0})
                continue
            count += 1
            cell["execution_count"] = count
            cell["outputs"] = [_output(o, count) for o in ran["outputs"]]
            timing.append({"cell": i, "outcome": ran["outcome"], "seconds": ran["seconds"]})
        found = any(key in json.dumps(nb) for key in _KEYS) or book.holds_key(book.page_text(nb), digests)
        nb["metadata"]["llmlab"] = {
            "executed": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "server": "cluster" if _cluster() else "embedded",
            "cells": timing, "failed": [t["cell"] for t in timing if t["outcome"] == "failed"],
            "seconds": round(sum(t["seconds"] for t in timing), 1), "keys_searched": sum(map(len, digests.values())),
            "key_found": found}
        rel = src.relative_to(root) if src.is_relative_to(root) else Path(src.parent.name) / src.name
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        if found:
            leaked.append(str(rel))
    return leaked


def _output(out: dict, count: int) -> dict:
    """nbval's record of an output as nbformat writes one."""
    kind = out["output_type"]
    if kind == "stream":
        return {"output_type": kind, "name": out["name"], "text": out["text"]}
    if kind == "error":
        return {"output_type": kind, "ename": out["ename"], "evalue": out["evalue"], "traceback": out["traceback"]}
    data = {k: v for k, v in out.get("data", {}).items() if k != WIDGET}  # no widget state is kept: its text stays
    shown = {"output_type": kind, "data": data, "metadata": out.get("metadata", {})}
    return {**shown, "execution_count": count} if kind == "execute_result" else shown


def _read_keys(home: Path) -> None:
    for path in [*home.glob("**/*.key"), *home.glob("**/key")]:
        try:
            if path.is_file() and path.stat().st_size < 4096:
                _KEYS.update(line.strip() for line in path.read_text().splitlines() if len(line.strip()) >= 16)
        except OSError:  # removed while we read it: an engine stopped
            pass


def _watch_keys(home: Path, every: float = 0.2) -> None:
    """Engines live for tens of seconds at least, so a read every 0.2 s sees every key a notebook's engine used."""
    while not _WATCH.wait(every):
        _read_keys(home)


@pytest.fixture(scope="session")
def embedded():
    """The running embedded server's ``ServerInfo`` (``embedded.port``, ``.model``, ``.api_key_file``, ``.pid``,
    ``.log``; ``embedded.extra["uds"]``: the engine's socket behind the proxy)."""
    from llmlab.serve import embedded

    return embedded.ensure_embedded(progress=False)


@pytest.fixture(scope="session")
def api_key(embedded) -> str:
    return embedded.key()
