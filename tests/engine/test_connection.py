"""connect()'s search order and its errors, without a server where none is needed.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_connection.py
(the pure tests).
"""


import pytest

import llmlab
from llmlab.serve import info as files
from llmlab.serve.proc import free_port


def test_slurm_connection_file_wins_over_embedded_and_down_server_is_one_sentence(slurm_file):
    with pytest.raises(llmlab.ServerUnavailable) as err:
        llmlab.connect()
    message = str(err.value)
    assert "SLURM job 4242" in message and "squeue" in message and "\n" not in message


def test_env_url_to_closed_port_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("LLMLAB_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(llmlab.ServerUnavailable, match="unset it to use the embedded server"):
        llmlab.connect()


def test_connection_file_that_vanished(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(tmp_path / "gone.json"))
    with pytest.raises(llmlab.ServerUnavailable, match="not ready yet .* or the job that wrote it has ended"):
        llmlab.connect()


def test_server_still_loading_is_one_sentence(tmp_path, monkeypatch):
    key = files.write_private(tmp_path / "job.key", "k\n")
    path = files.write_connection_file(tmp_path / "77.json", kind="slurm", host="127.0.0.1", port=free_port(),
                                            model="llama3.1-405b", api_key_file=key, job_id="77", status="loading",
                                            phase="Loading safetensors checkpoint shards 40%")
    monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(path))
    with pytest.raises(llmlab.ServerUnavailable, match=r"SLURM job 77 is still loading the model \(Loading safe"):
        llmlab.connect()
