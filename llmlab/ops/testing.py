"""pytest plugin for the course's own suite (loaded with ``-p llmlab.ops.testing`` from pyproject).

- Gives the whole test session a private ``LLMLAB_HOME``, so tests never touch a learner's running server
  and nbval's notebook kernels (which inherit the environment) all find the one embedded server.
- ``embedded`` fixture: the real embedded vLLM server, started once per session, stopped at the end.
- Notebook cells tagged ``cluster-only`` are skipped with a visible reason: they need a GPU cluster.
"""

from __future__ import annotations

import os
import tempfile

import pytest

CLUSTER_ONLY = "cluster-only"
_HOME: str | None = None


def pytest_configure(config):
    global _HOME
    if "LLMLAB_TEST_HOME" in os.environ:
        os.environ["LLMLAB_HOME"] = os.environ["LLMLAB_TEST_HOME"]
    else:
        _HOME = tempfile.mkdtemp(prefix="llmlab-test-home-")
        os.environ["LLMLAB_HOME"] = _HOME
    for var in ("LLMLAB_BASE_URL", "LLMLAB_API_KEY", "LLMLAB_API_KEY_FILE", "LLMLAB_CONNECTION_FILE"):
        os.environ.pop(var, None)


def pytest_unconfigure(config):
    """Stop the session's embedded server (started by a fixture or by a notebook's connect())."""
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
