"""pytest plugin for the course's own suite (loaded with ``-p llmlab.ops.testing`` from pyproject).

- Gives the whole test session a private ``LLMLAB_HOME``, so tests never touch a learner's running server
  and nbval's notebook kernels (which inherit the environment) all find the one embedded server.
- ``embedded`` fixture: the real embedded vLLM server, started once per session, stopped at the end.
- Notebook cells tagged ``cluster-only`` are skipped with a visible reason: they need a GPU cluster.
- ``LLMLAB_TEST_SERVER=cluster`` (``make test-cluster``): before the first test, the launcher's CPU job serves a
  second small model (``llmlab-wide``, every shape unlike the tiny model's) under the SLURM test bed, and
  ``LLMLAB_CONNECTION_FILE`` points every notebook kernel at it -- a cluster's server, found a cluster's way
  (``tests/cluster_mode.py``).  The job is cancelled at the end.
"""

from __future__ import annotations

import os
import tempfile

import pytest

CLUSTER_ONLY = "cluster-only"
_HOME: str | None = None
_CLUSTER_JOB: str | None = None


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
    if "LLMLAB_TEST_HOME" in os.environ:
        os.environ["LLMLAB_HOME"] = os.environ["LLMLAB_TEST_HOME"]
    else:
        _HOME = tempfile.mkdtemp(prefix="llmlab-test-home-")
        os.environ["LLMLAB_HOME"] = _HOME
    for var in ("LLMLAB_BASE_URL", "LLMLAB_API_KEY", "LLMLAB_API_KEY_FILE", "LLMLAB_CONNECTION_FILE"):
        os.environ.pop(var, None)


def pytest_sessionstart(session):
    """Cluster mode: serve ``llmlab-wide`` through the SLURM launcher before any notebook kernel starts (kernels
    inherit ``LLMLAB_CONNECTION_FILE``)."""
    global _CLUSTER_JOB
    if os.environ.get("LLMLAB_TEST_SERVER") != "cluster" or session.config.option.collectonly:
        return
    from pathlib import Path

    job_id, conn = _cluster_mode(session.config).up(Path(os.environ["LLMLAB_HOME"]))
    _CLUSTER_JOB = job_id
    os.environ["LLMLAB_CONNECTION_FILE"] = str(conn)


def pytest_unconfigure(config):
    """Stop the session's embedded server (started by a fixture or by a notebook's connect())."""
    if _CLUSTER_JOB is not None:
        _cluster_mode(config).down(_CLUSTER_JOB)
    if _HOME is not None:
        from llmlab.serve import embedded

        embedded.stop_embedded()


def pytest_collection_modifyitems(config, items):
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is not None and CLUSTER_ONLY in cell.get("metadata", {}).get("tags", []):
            item.add_marker(pytest.mark.skip(reason="cluster-only cell: needs a GPU cluster's vLLM server"))


@pytest.fixture(scope="session")
def embedded():
    """The running embedded server's ``ServerInfo`` (host, port, model, api_key_file, pid, log; also readable as
    ``embedded["port"]``)."""
    from llmlab.serve import embedded

    return embedded.ensure_embedded(progress=False)


@pytest.fixture(scope="session")
def api_key(embedded) -> str:
    return embedded.key()
