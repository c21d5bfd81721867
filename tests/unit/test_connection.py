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
    assert info["model"] == "llama3.1-70b" and info["job_id"] == "4242" and info["nodes"] == 2
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
    assert info["nodes"] == ["node7"] and info.get("pid") is None and "api_key_file" in info  # reads as the JSON
    path = info.write(tmp_path / "s.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text()) == dict(info) == {**files.read_connection_file(path)}  # the format kept
    assert files.ServerInfo.read(path) == info and connection.base_url_of(dict(info)) == info.base_url
    shared = info.updated(kind="shared", share_dir="/ws")
    assert shared.kind == "shared" and shared["share_dir"] == "/ws" and info.kind == "slurm"
    with pytest.raises(llmlab.AuthenticationFailed, match="Cannot read the API key file"):
        info.updated(api_key_file=str(tmp_path / "gone.key")).key()
