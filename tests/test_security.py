"""The attacker's suite (docs/security.md): another user of the same machine attacks a running llmlab server.

A second UNIX account (``llmlab-attacker``, created with useradd; CI runs as root) runs curl, cat and ps
against the embedded server (vLLM on a private Unix socket behind llmlab.serve.proxy) and against a Ray head started
with token authentication exactly as the SLURM launcher starts it.  Each case is its own test.  After every
case the owner's request still works, and at the end the server is neither paused nor missing a request.
Only the attacker's commands drop privileges; the owner's checks run as the test's own user.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import llmlab
from llmlab import cluster
from llmlab.ops import launcher
from llmlab.serve.info import read_key, write_private
from llmlab.serve.proc import pid_alive

ATTACKER = "llmlab-attacker"
TOOLS = ("useradd", "setpriv", "curl", "ps")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(t) is None for t in TOOLS),
    reason=f"the attacker's suite creates a second UNIX user: it needs root and {', '.join(TOOLS)} (CI has them)")


@pytest.fixture(scope="module")
def attacker() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
        entry = pwd.getpwnam(ATTACKER)
    assert entry.pw_uid != os.geteuid()
    return entry.pw_uid, entry.pw_gid


def as_attacker(who: tuple[int, int], *cmd: str, stdin: bytes | None = None,
                timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``cmd`` as the other user, with a clean environment (nothing of ours leaks to it)."""
    uid, gid = who
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", *cmd],
                          input=stdin, capture_output=True, timeout=timeout,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C"})


def attacker_http(who, url: str, *, key: str | None = None, method: str = "GET", body: dict | None = None) -> int:
    """The status code the attacker gets (0: no HTTP answer at all).  ``--path-as-is``: curl sends ``..`` as is."""
    cmd = ["curl", "-s", "--path-as-is", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "20", "-X", method]
    if key:
        cmd += ["-H", f"Authorization: Bearer {key}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(body)]
    out = as_attacker(who, *cmd, url)
    return int(out.stdout.decode() or 0)


def owner_http(url: str, key: str, method: str = "GET", raw_path: str | None = None) -> int:
    """The owner's request; ``raw_path`` is sent byte for byte (urllib would keep it too, but say so)."""
    if raw_path is not None:
        host, port = url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port)), timeout=20) as s:
            s.sendall(f"{method} {raw_path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
            return int(s.recv(100).split()[1])
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=20) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def owner_get(url: str, key: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=20) as r:
        return r.status, r.read()


def socket_status(uds: str, method: str, path: str) -> int:
    """The owner asks vLLM itself on its Unix socket (only the owner can), with no key and an empty body."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(20)
        s.connect(uds)
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: vllm\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                  .encode())
        return int(s.recv(100).split()[1])


@pytest.fixture(scope="module")
def base(embedded) -> str:
    return f"http://127.0.0.1:{embedded['port']}"


@pytest.fixture(autouse=True)
def owner_keeps_working(request):
    """After every attack, the owner's own request still gets its tokens."""
    yield
    if "embedded" in request.fixturenames:
        client, model = llmlab.connect(quiet=True)
        r = client.completions.create(model=model, prompt="Still here", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3


COMPLETION = {"model": "llmlab-tiny", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "llmlab-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


# --------------------------------------------------------------------------------------------------
# The embedded server: the key on every request
# --------------------------------------------------------------------------------------------------

def test_completions_without_key_is_401(attacker, base):
    assert attacker_http(attacker, base + "/v1/completions", method="POST", body=COMPLETION) == 401


def test_completions_with_wrong_key_is_401(attacker, base):
    assert attacker_http(attacker, base + "/v1/completions", key="x" * 43, method="POST", body=COMPLETION) == 401


def test_chat_completions_without_key_is_401(attacker, base):
    assert attacker_http(attacker, base + "/v1/chat/completions", method="POST", body=CHAT) == 401


def test_chat_completions_with_wrong_key_is_401(attacker, base):
    assert attacker_http(attacker, base + "/v1/chat/completions", key="wrong", method="POST", body=CHAT) == 401


def test_health_and_metrics_need_the_key_too(attacker, base, api_key):
    assert attacker_http(attacker, base + "/health") == 401 and attacker_http(attacker, base + "/metrics") == 401
    assert owner_http(base + "/health", api_key) == 200  # the same request with the key: so it can fail


# Routes outside vLLM's key check.  EXPOSED: vLLM 0.32 serves them in this configuration (its own socket answers
# them without a key, checked below); the others exist in other configurations (RL, dev mode) or versions.
EXPOSED = [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"),
           ("GET", "/openapi.json"), ("GET", "/version"), ("POST", "/scale_elastic_ep")]
OTHER = [("POST", "/pause"), ("POST", "/abort_requests"), ("POST", "/update_weights"), ("POST", "/sleep")]


@pytest.mark.parametrize("method, path", EXPOSED + OTHER, ids=[p for _, p in EXPOSED + OTHER])
def test_unguarded_vllm_route_is_refused(attacker, base, api_key, embedded, method, path):
    if (method, path) in EXPOSED:  # the hole is real: vLLM itself answers it without a key
        assert socket_status(embedded["uds"], method, path) not in (401, 404)
    assert attacker_http(attacker, base + path, method=method) == 401
    # not on the allow-list: refused with the owner's key as well, by the proxy (vLLM never sees it)
    assert owner_http(base + path, api_key, method) == 404


TRAVERSALS = ["/v1/../invocations", "/v1/%2e%2e/invocations", "/v1/%2E%2E/pause", "/v1/..%2fpause",
              "/v1/%252e%252e/abort_requests", "/v1/./../tokenize", "/v1//../pause", "/v1\\..\\pause"]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_path_traversal_is_refused(attacker, base, api_key, path):
    assert attacker_http(attacker, base + path, method="POST") in (400, 401)
    assert owner_http(base + path, api_key, "POST", raw_path=path) == 400


def test_attacker_cannot_reach_vllm_on_its_socket(attacker, embedded):
    uds = embedded["uds"]
    out = as_attacker(attacker, "curl", "-s", "--max-time", "10", "--unix-socket", uds, "http://vllm/invocations")
    assert out.returncode == 7, out  # curl: "Failed to connect" (the 0700 directory)
    assert as_attacker(attacker, "ls", str(Path(uds).parent)).returncode != 0


def test_vllm_api_has_no_tcp_listener_besides_the_proxy(embedded):
    """The server's process group listens on TCP only on loopback, and the HTTP API only through the proxy.

    vLLM's CPU worker also listens on loopback ports of its own (torch.distributed's store and gloo): other
    users of the same machine can connect to those; docs/security.md lists this among what is not covered.
    """
    group = [p for p in filter(str.isdigit, os.listdir("/proc")) if _pgid(p) == embedded["pid"]]
    inodes = {}
    for pid in group:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                listening.append((f[1], _cmd(inodes[f[9]])))
    assert all(address.startswith(("0100007F:", "00000000000000000000000001000000:")) for address, _ in listening)
    api = [(address, cmd) for address, cmd in listening if "vllm.entrypoints" in cmd or "llmlab.serve.proxy" in cmd]
    assert [address for address, _ in api] == [f"0100007F:{embedded['port']:04X}"], listening
    assert "llmlab.serve.proxy" in api[0][1]


def _pgid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _cmd(pid: str) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def test_attacker_cannot_read_the_key_file(attacker, embedded):
    out = as_attacker(attacker, "cat", embedded["api_key_file"])
    assert out.returncode != 0 and b"Permission denied" in out.stderr and not out.stdout


def test_attacker_cannot_read_the_servers_environment(attacker, embedded):
    out = as_attacker(attacker, "cat", f"/proc/{embedded['pid']}/environ")
    assert out.returncode != 0 and not out.stdout


def test_ps_shows_no_secret(attacker, api_key):
    args = as_attacker(attacker, "ps", "-eo", "args").stdout.decode()
    assert "llmlab.serve.proxy" in args and "--key-file" in args  # the attacker does see the processes ...
    assert api_key not in args  # ... but no key in their arguments


# --------------------------------------------------------------------------------------------------
# Ray, started as the launcher starts it (token authentication, per-job token file, no dashboard)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_head():
    """A Ray head rendered by llmlab.cluster for the CPU job (loopback), its token written as the launcher does.
    Its home is short (Ray's socket paths must fit in 107 bytes) and private (mkdtemp: 0700)."""
    home = Path(tempfile.mkdtemp(prefix="llmlab-sec-"))
    port_base = 32000  # above the launcher's job blocks (20000-31999), below the ephemeral range
    env = {**os.environ, "LLMLAB_HOME": str(home), "LLMLAB_RAY_PORT_BASE": str(port_base),
           "LLMLAB_RAY_TMPDIR": str(home)}
    rendered = launcher.render("llmlab-tiny-cpu", job_id="sec", nodes=["node1", "node2"], port=1, env=env)
    token_file = Path(rendered.env["RAY_AUTH_TOKEN_PATH"])
    write_private(token_file, os.urandom(32).hex() + "\n")
    cmd = rendered.ray.head_command()
    cmd[0] = str(Path(sys.executable).with_name("ray"))
    log = home / "ray-head.log"
    for attempt in range(3):  # as the launcher: Ray 2.60's raylet gives up when its agent is slow on a busy machine
        proc = subprocess.Popen(cmd, env={**env, **rendered.env}, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        while launcher.RAY_STARTED not in log.read_text(errors="replace") and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        if proc.poll() is None:
            break
        assert attempt < 2, f"Ray's head did not start 3 times; its last log:\n{log.read_text()}"
        shutil.rmtree(rendered.ray.temp_dir, ignore_errors=True)
        time.sleep(5)
    yield {"ip": launcher.LOOPBACK_RAY_IP, "gcs": rendered.ray.gcs_port, "client": port_base + 1,
           "dashboard": port_base + 2, "raylet": port_base + 100, "runtime_env_agent": port_base + 100 + 5,
           "token_file": token_file,
           "token": read_key(token_file), "env": {**env, **rendered.env}, "cmd": cmd}
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
    shutil.rmtree(home, ignore_errors=True)


EMPTY_GRPC_MESSAGE = b"\0\0\0\0\0"  # a gRPC frame: not compressed, length 0 (an empty protobuf request)


def grpc_status(run, ip: str, port: int, method: str, token: str | None = None) -> str:
    """``grpc-status`` of one unary call over HTTP/2 (curl speaks it), or '' if nothing answered."""
    cmd = ["curl", "-s", "--http2-prior-knowledge", "--max-time", "15", "-X", "POST", "-D", "-", "-o", "/dev/null",
           "-H", "content-type: application/grpc", "-H", "te: trailers", "--data-binary", "@-"]
    if token:
        cmd += ["-H", f"authorization: Bearer {token}"]
    out = run(*cmd, f"http://{ip}:{port}/{method}", stdin=EMPTY_GRPC_MESSAGE)
    m = re.search(rb"grpc-status: *(\d+)", out.stdout)
    return m[1].decode() if m else ""


def _owner(*cmd, stdin=None):
    return subprocess.run(cmd, input=stdin, capture_output=True, timeout=30)


GCS_METHOD = "ray.rpc.NodeInfoGcsService/GetAllNodeInfo"


def test_ray_gcs_refuses_a_client_without_the_token(attacker, ray_head):
    attack = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ray_head["ip"],
                         ray_head["gcs"], GCS_METHOD)
    assert attack == "16"  # UNAUTHENTICATED
    assert grpc_status(_owner, ray_head["ip"], ray_head["gcs"], GCS_METHOD, ray_head["token"]) == "0"


def test_ray_gcs_refuses_a_wrong_token(attacker, ray_head):
    wrong = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ray_head["ip"],
                        ray_head["gcs"], GCS_METHOD, "0" * 64)
    assert wrong == "16"


def test_ray_status_without_the_token_fails(ray_head):
    """Ray's own client, from an environment without the token: the same code an attacker would run."""
    env = {k: v for k, v in ray_head["env"].items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(ray_head["token_file"].parent)  # no ~/.ray/auth_token to fall back on
    out = subprocess.run([ray_head["cmd"][0], "status", f"--address={ray_head['ip']}:{ray_head['gcs']}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "node_" not in out.stdout
    ok = subprocess.run([ray_head["cmd"][0], "status", f"--address={ray_head['ip']}:{ray_head['gcs']}"],
                        capture_output=True, text=True, env=ray_head["env"], timeout=120)
    assert ok.returncode == 0 and "node_" in ok.stdout


def test_ray_dashboard_is_not_listening(attacker, ray_head):
    for port in (ray_head["dashboard"], 8265):
        out = as_attacker(attacker, "curl", "-s", "--max-time", "10", f"http://{ray_head['ip']}:{port}/api/jobs/")
        assert out.returncode == 7, (port, out)  # connection refused: no dashboard, no job submission API


def test_ray_raylet_refuses_a_client_without_the_token(attacker, ray_head):
    method = "ray.rpc.NodeManagerService/GetNodeStats"
    attack = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ray_head["ip"],
                         ray_head["raylet"], method)
    assert attack == "16"
    assert grpc_status(_owner, ray_head["ip"], ray_head["raylet"], method, ray_head["token"]) == "0"


def test_ray_client_server_refuses_a_client_without_the_token(attacker, ray_head):
    attack = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ray_head["ip"],
                         ray_head["client"], "ray.rpc.RayletDriver/ClusterInfo")
    assert attack == "16"


def test_ray_runtime_env_agent_refuses_without_the_token(attacker, ray_head):
    url = f"http://{ray_head['ip']}:{ray_head['runtime_env_agent']}/get_or_create_runtime_env"
    assert attacker_http(attacker, url, method="POST") == 401


def test_attacker_cannot_read_the_ray_token(attacker, ray_head):
    out = as_attacker(attacker, "cat", str(ray_head["token_file"]))
    assert out.returncode != 0 and not out.stdout


def test_ps_shows_no_ray_token(attacker, ray_head):
    args = as_attacker(attacker, "ps", "-eo", "args").stdout.decode()
    assert "raylet" in args and ray_head["token"] not in args


# --------------------------------------------------------------------------------------------------
# The launcher's settings (no Ray, no server needed)
# --------------------------------------------------------------------------------------------------

def test_launcher_puts_vllm_on_a_socket_and_ray_on_tokens():
    r = launcher.render("llama3.1-405b", job_id="77", nodes=["a", "b"], port=9000,
                       env={"LLMLAB_RAY_HEAD_IP": "10.0.0.1", "LLMLAB_RUN_DIR": "/tmp/llmlab-run-77.x",
                            "LLMLAB_HOME": "/home/u/.llmlab"})
    assert "--host" not in r.flags and "--port" not in r.flags
    assert r.flags[r.flags.index("--uds") + 1] == "/tmp/llmlab-run-77.x/vllm.sock" == r.uds
    assert r.env["RAY_AUTH_MODE"] == "token" and r.env["RAY_AUTH_TOKEN_PATH"] == "/home/u/.llmlab/keys/ray-job-77.token"
    assert "--include-dashboard=false" in r.ray.head_command()
    assert "uds=/tmp/llmlab-run-77.x/vllm.sock" in r.shell()


def test_launcher_refuses_multi_node_without_ray_tokens():
    with pytest.raises(cluster.SettingsError, match=r"Ray 2.51.0 has no token authentication.*one-node layout"):
        launcher.render("llama3.1-405b", nodes=["a", "b"], port=9000,
                       env={"LLMLAB_RAY_HEAD_IP": "x", "LLMLAB_RAY_VERSION": "2.51.0"})
    with pytest.raises(cluster.SettingsError, match="RAY_AUTH_MODE=disabled"):
        launcher.render("llama3.1-405b", nodes=["a", "b"], port=9000,
                       env={"LLMLAB_RAY_HEAD_IP": "x", "RAY_AUTH_MODE": "disabled"})
    one_node = launcher.render("llama3.1-70b", nodes=["a"], port=9000, env={"LLMLAB_RAY_VERSION": "2.40.0"})
    assert one_node.ray is None  # one node needs no Ray, so no Ray version is required


# --------------------------------------------------------------------------------------------------
# After the suite: nothing paused, aborted or stopped
# --------------------------------------------------------------------------------------------------

def test_server_still_answers_and_is_not_paused_after_the_suite(embedded, api_key):
    assert pid_alive(embedded["pid"])
    status, metrics = owner_get(f"http://127.0.0.1:{embedded['port']}/metrics", api_key)
    assert status == 200 and re.search(rb"^vllm:num_requests_waiting\{[^}]*\} 0\.0$", metrics, re.M)
    client, model = llmlab.connect(quiet=True)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens >= 1


# --------------------------------------------------------------------------------------------------
# A real SLURM job (CPU mode, Ray over 2 nodes) under the CI test bed
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_job(tmp_path_factory):
    """The CPU job of slurm/, submitted to the test bed, once its connection file is there; cancelled after."""
    import slurm_testbed
    from test_slurm import job_processes, job_state, submit, wait_for

    if slurm_testbed.skip_reason():
        pytest.skip(slurm_testbed.skip_reason())
    env = slurm_testbed.ensure()
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", LLMLAB_PYTHON=sys.executable)
    out = tmp_path_factory.mktemp("slurm-attack")
    job_id = submit(env, out)
    conn = Path(os.environ["LLMLAB_HOME"]) / "servers" / f"job-{job_id}.json"

    def ready():
        state, _ = job_state(env, job_id)
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (out / f"slurm-{job_id}.out").read_text()
        return conn.exists()

    try:
        wait_for(ready, 900, f"job {job_id}'s connection file", poll=2)
        info = json.loads(conn.read_text())
        yield {**info, "key": read_key(info["api_key_file"]), "output": out / f"slurm-{job_id}.out",
               "token_file": Path(os.environ["LLMLAB_HOME"]) / "keys" / f"ray-job-{job_id}.token"}
    finally:
        subprocess.run(["scancel", job_id], env=env, check=True)
        wait_for(lambda: not job_processes(job_id), 90, f"job {job_id}'s processes to end")


def test_slurm_job_completions_without_or_with_wrong_key_is_401(attacker, slurm_job):
    url = f"http://{slurm_job['host']}:{slurm_job['port']}/v1/completions"
    assert attacker_http(attacker, url, method="POST", body={**COMPLETION, "model": slurm_job["model"]}) == 401
    assert attacker_http(attacker, url, key="wrong", method="POST", body=COMPLETION) == 401


def test_slurm_job_unguarded_routes_and_traversal_are_refused(attacker, slurm_job):
    base = f"http://{slurm_job['host']}:{slurm_job['port']}"
    for path in ("/invocations", "/tokenize", "/docs", "/openapi.json"):
        assert attacker_http(attacker, base + path, method="POST") == 401
        assert owner_http(base + path, slurm_job["key"], "POST") == 404
    assert owner_http(base + "/v1/%2e%2e/invocations", slurm_job["key"], "POST",
                      raw_path="/v1/%2e%2e/invocations") == 400


def test_slurm_job_ray_refuses_a_client_without_the_token(attacker, slurm_job):
    ip, port = slurm_job["ray_address"].rsplit(":", 1)
    attack = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ip, int(port), GCS_METHOD)
    assert attack == "16"
    assert grpc_status(_owner, ip, int(port), GCS_METHOD, read_key(slurm_job["token_file"])) == "0"


def test_slurm_job_key_and_token_files_are_unreadable(attacker, slurm_job):
    for path in (slurm_job["api_key_file"], slurm_job["token_file"]):
        out = as_attacker(attacker, "cat", str(path))
        assert out.returncode != 0 and not out.stdout


def test_slurm_job_secrets_are_in_no_ps_output_nor_job_output(attacker, slurm_job):
    token = read_key(slurm_job["token_file"])
    args = as_attacker(attacker, "ps", "-eo", "args").stdout.decode()
    assert "raylet" in args and "llmlab.serve.proxy" in args
    assert slurm_job["key"] not in args and token not in args
    text = slurm_job["output"].read_text()
    assert "READY" in text and slurm_job["key"] not in text and token not in text
    client, model = llmlab.connect(f"http://{slurm_job['host']}:{slurm_job['port']}/v1", slurm_job["key"], quiet=True)
    assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
