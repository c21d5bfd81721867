"""The course's tests, in three tiers, each a folder with its own conftest (``llmlab.ops.testing`` is the plugin all
three share: a private LLMLAB_HOME, the session's embedded server, the executed notebooks):

- ``tests/unit`` (``make unit``): no engine, no SLURM, no root, no browser; the whole folder in seconds, and a guard
  that fails a test which starts one of them;
- ``tests/engine``: the real vLLM engine (the session's embedded server and engines of a test's own), JupyterLab
  and a browser, root where a test fills a disk;
- ``tests/cluster``: the SLURM test bed (tests/slurm_testbed.py), the launcher's jobs, Open OnDemand, sharing a
  server with a class, a second UNIX user attacking it, and cluster mode (tests/cluster_mode.py).

Helpers that several test modules use live beside this file (``slurm_helpers``, ``proxy_helpers``, ``slurm_testbed``,
``cluster_mode``, ``lab_browser``), never in a test module: no test module imports another.
"""


import pytest  # noqa: E402  (after the docstring's long explanation)


@pytest.fixture
def slurm_file(tmp_path):
    """A SLURM job's connection file pointing at a closed port; removed afterwards, as the job's trap does
    (tests/unit and tests/engine's test_connection)."""
    from llmlab.serve import info as files
    from llmlab.serve.proc import free_port

    key = files.write_private(tmp_path / "job.key", "secret-key\n")
    path = files.servers_dir() / "4242.json"
    files.write_connection_file(path, kind="slurm", host="127.0.0.1", port=free_port(), model="llama3.1-70b",
                                api_key_file=key, job_id="4242", nodes=2)
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def _no_word_of_an_earlier_tests_ended_job():
    """A SLURM job that ends leaves ``servers/job-ID.ended``, and ``connect()`` then refuses the embedded tiny model
    (as it must for a learner); each test starts without the word of another test's job."""
    yield
    from llmlab.serve.info import ended_jobs

    for marker in ended_jobs():
        marker.unlink(missing_ok=True)
