"""connect()'s search order and its errors, without a server where none is needed.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_connection.py (the tests that start the real engine).
"""

import json
import os
import stat

import pytest

import llmlab
from llmlab import connection
from llmlab.serve import info as files


def test_connection_file_roundtrip_is_private(slurm_file):
    assert stat.S_IMODE(os.stat(slurm_file).st_mode) == 0o600
    info = files.read_connection_file(slurm_file)
    assert info.model == "llama3.1-70b" and info.job_id == "4242" and info.extra["nodes"] == 2
    assert "secret-key" not in slurm_file.read_text()  # the file names the key file, never the key


def test_malformed_connection_file_names_the_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"host": "n1", "port": 1}))
    with pytest.raises(llmlab.ServerError, match="model, api_key_file"):
        files.read_connection_file(bad)
    bad.write_text("{not json")
    with pytest.raises(llmlab.ServerError, match="not valid JSON"):
        files.read_connection_file(bad)


def test_missing_key_file_is_explained(tmp_path):
    with pytest.raises(llmlab.AuthenticationFailed, match="Cannot read the API key file"):
        connection.read_key(tmp_path / "nope.key")


def test_server_info_is_the_connection_file_typed(tmp_path):
    key = files.write_private(tmp_path / "k.key", "the-key\n")
    info = files.ServerInfo.from_dict({"kind": "slurm", "host": "node7", "port": "8123", "model": "m",
                                       "api_key_file": str(key), "job_id": "9", "nodes": ["node7"], "tp": 4})
    assert info.port == 8123 and info.base_url == "http://node7:8123/v1" and info.root_url == "http://node7:8123"
    assert info.key() == "the-key" and info.extra == {"nodes": ["node7"], "tp": 4}
    assert info.pid is None and "api_key_file" in info.as_dict()
    with pytest.raises(TypeError):
        info["model"]  # read by attribute: info.model, info.extra["nodes"]
    path = info.write(tmp_path / "s.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == info.as_dict() == files.read_connection_file(path).as_dict()
    assert files.ServerInfo.read(path) == info and connection.base_url_of(info.as_dict()) == info.base_url
    shared = info.updated(kind="shared", share_dir="/ws")
    assert shared.kind == "shared" and shared.extra["share_dir"] == "/ws" and info.kind == "slurm"
    with pytest.raises(llmlab.AuthenticationFailed, match="Cannot read the API key file"):
        info.updated(api_key_file=str(tmp_path / "gone.key")).key()


@pytest.fixture
def no_tiny_model(monkeypatch):
    """connect()'s last step, the embedded tiny model, recorded instead of started."""
    started = []

    def ensure_embedded(*args, **kwargs):
        started.append(True)
        raise RuntimeError("the embedded tiny model would start here")

    monkeypatch.setattr(connection.embedded, "ensure_embedded", ensure_embedded)
    monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
    for stale in files.servers_dir().glob("*"):
        stale.unlink()
    return started


@pytest.mark.parametrize("quiet", [True, False])
def test_after_a_job_ended_connect_says_so_instead_of_starting_the_tiny_model(no_tiny_model, quiet):
    """Before: the job's clean-up removed its connection file, and connect(quiet=True) started the tiny model
    without a word (finding 10 of security-review-2); a lesson then measured it as if it were the job's model."""
    files.ended_marker("4242").write_text("llama3.1-70b\n")  # what the job's clean-up leaves
    with pytest.raises(llmlab.ServerUnavailable) as err:
        llmlab.connect(quiet=quiet)
    said = str(err.value)
    assert said.startswith("The server of SLURM job 4242 (llama3.1-70b) ended at ") and "\n" not in said
    assert "`llmlab launch llama3.1-70b`" in said and "`llmlab stop 4242`" in said and not no_tiny_model


def test_with_no_job_at_all_connect_still_starts_the_tiny_model(no_tiny_model):
    with pytest.raises(RuntimeError, match="the embedded tiny model would start here"):
        llmlab.connect(quiet=True)
    assert no_tiny_model == [True]


def test_a_pinned_connection_file_of_an_ended_job_is_one_sentence_even_quiet(no_tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(tmp_path / "server.json"))
    with pytest.raises(llmlab.ServerUnavailable, match="not ready yet .* or the job that wrote it has ended.* or "
                                                       "unset LLMLAB_CONNECTION_FILE to use the embedded tiny model"):
        llmlab.connect(quiet=True)
    assert not no_tiny_model


def test_the_ended_word_is_left_by_the_clean_up_or_status_and_goes_with_a_new_launch_or_stop(no_tiny_model,
                                                                                              monkeypatch):
    from llmlab.ops import jobs

    script = (jobs.cluster.slurm_dir() / "llmlab-serve.sh").read_text()
    cleanup = script[script.index("cleanup() {"):script.index("on_signal() {")]
    assert '>"$home/servers/job-$job_id.ended"' in cleanup  # the launcher's clean-up, in place of the file
    key = files.write_private(files.llmlab_home() / "keys" / "job-77.key", "k\n")
    files.write_connection_file(jobs.cluster.connection_file_of("77"), kind="slurm", host="n1", port=1,
                                model="llama3.1-8b", api_key_file=key, job_id="77")
    jobs.forget("77", ended=True)  # `llmlab status` of a job killed before its clean-up ran
    assert [p.name for p in files.ended_jobs()] == ["job-77.ended"]
    assert not jobs.cluster.connection_file_of("77").exists()
    jobs.forget("77", ended=True)  # again (status runs often): no file, so no new word after a stop
    monkeypatch.setattr(jobs, "_stop", lambda job_id, timeout: None)
    jobs.stop("77")
    assert files.ended_jobs() == []
    files.ended_marker("78").write_text("x\n")
    monkeypatch.setattr(jobs.ServerInfo, "write", lambda self, path: path)
    jobs.publish_queued("79", "llama3.1-8b")  # a new launch: connect() waits for it instead
    assert files.ended_jobs() == []
