"""The cluster CLI (llmlab.ops.jobs, ``llmlab launch | status | metrics | logs | stop | list``).

Pure tests (settings and overrides, the plan check, the rendered job script, the launcher's own dry run for
every shipped GPU model) need no SLURM.  The rest run every command against the real slurmctld + two slurmd
of tests/slurm_testbed.py with the CPU engine and the tiny model: launch -> the states in order -> a request
-> metrics -> logs -> a second UNIX user's attacks on the job (tests/attacker.py) -> stop -> STOPPED with nothing
left, all on one job (``launched``); a job whose model path is wrong -> FAILED with that reason.

This file holds the tests under the SLURM test bed; the rest are in tests/unit/test_jobs.py (the pure tests).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from attacker import (
    GCS_METHOD,
    as_attacker,
    attacker_http,
    grpc_status,
    needs_attacker,
    owner_http,
    owner_run,
    ray_folder_is_out_of_reach,
)
from slurm_helpers import (
    CPU_JOB,
    job_processes,
    needs_slurm,
    ray_folder,
    wait_for,
)

import llmlab
from llmlab import cluster, memory, rehearse
from llmlab.ops import jobs, weights
from llmlab.serve.info import read_key, servers_dir


def llmlab_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmlab", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ.copy())


# --------------------------------------------------------------------------------------------------
# Settings, plan and job script (no SLURM)


# --------------------------------------------------------------------------------------------------
# Under a real SLURM (CPU mode)
# --------------------------------------------------------------------------------------------------

def use_testbed(monkeypatch, env: dict) -> None:
    for key in ("SLURM_CONF", "PATH", "LLMLAB_PYTHON"):
        monkeypatch.setenv(key, env[key])


class FileWatch(threading.Thread):
    """Each (status, phase) a connection file goes through, polled every 0.25 s from before the job starts: the
    launcher rewrites the file at each phase, and a transition shorter than the poll is one a learner never sees."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.seen, self.done = path, [], threading.Event()

    def run(self):
        while True:
            stopping = self.done.wait(0.25)
            self.look()
            if stopping:  # one last look once told to stop: the state that made the caller stop is in the file
                return

    def look(self):
        try:
            info = json.loads(self.path.read_text())
        except (OSError, ValueError):  # not there yet, or gone
            return
        now = (info.get("status") or "(none)", info.get("phase"))
        if not self.seen or self.seen[-1] != now:
            self.seen.append(now)


@pytest.fixture(scope="class")
def launched(slurm_env):
    """One CPU job launched as a learner launches it (``llmlab launch llmlab-tiny-cpu``: two nodes, Ray), its weights
    staged first (``LLMLAB_STAGE_DIR``, as for a 405B on node-local disks), and waited for: what the lifecycle tests
    read and the second UNIX user attacks.  One job for all of them: a job takes the test bed's two nodes and more
    than a minute to start.  The class's last test stops it; this stops it too if that test did not run."""
    stage_dir = Path(tempfile.mkdtemp(prefix="llmlab-stage-"))  # "node-local disk": both test-bed nodes share it
    with pytest.MonkeyPatch.context() as mp:
        use_testbed(mp, slurm_env)
        mp.setenv("LLMLAB_STAGE_DIR", str(stage_dir))
        t0 = time.monotonic()
        record = jobs.launch(cluster.prepare(CPU_JOB))
        job_id, seen = record.job_id, []
        conn = servers_dir() / f"job-{job_id}.json"
        watch = FileWatch(conn)
        watch.start()
        try:
            ready = jobs.wait(job_id, timeout=900, poll=0.5, on_change=seen.append)
            watch.done.set()
            watch.join()  # jobs.wait can see "ready" between two of the watch's looks (a clean clone's CI run did)
            print(f"\nllmlab launch {CPU_JOB} -> {ready.state} in {time.monotonic() - t0:.1f} s")
            info = json.loads(conn.read_text()) if conn.exists() else {}
            yield {**info, "job_id": job_id, "record": record, "ready": ready, "seen": seen, "connection_file": conn,
                   "files_seen": watch.seen, "key": read_key(info["api_key_file"]) if info else None,
                   "output": Path(record.output), "info": info, "stage_dir": stage_dir,
                   "token_file": Path(os.environ["LLMLAB_HOME"]) / "keys" / f"ray-job-{job_id}.token"}
        finally:
            watch.done.set()
            if jobs.status(job_id).state != "STOPPED":
                jobs.stop(job_id)
            shutil.rmtree(stage_dir, ignore_errors=True)


@needs_slurm
class TestALaunchedJob:
    """launch -> PENDING/STARTING/LOADING/READY -> a request, metrics, status, logs -> the attacker's attempts ->
    stop -> STOPPED with nothing left, on one job."""

    def test_launch_goes_through_its_states_to_ready(self, launched):
        ready, record = launched["ready"], launched["record"]
        assert ready.state == "READY", f"{ready}\n{Path(ready.output).read_text() if ready.output else ''}"
        states = [s.state for s in launched["seen"]]
        order = [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]
        assert order[-3:] == ["STARTING", "LOADING", "READY"] and set(order[:-3]) <= {"PENDING"}, order
        print("\n".join(f"llmlab status {launched['job_id']}: {s.state} - {s.detail}" for s in launched["seen"]))
        script = Path(record.script).read_text()
        assert "#SBATCH --job-name=llmlab-llmlab-tiny-cpu\n#SBATCH --nodes=2\n" in script
        assert (cluster.job_log_dir(launched["job_id"]) / "settings.toml").read_text() in script  # what ran, as ran
        assert stat.S_IMODE(Path(record.script).stat().st_mode) == 0o600
        assert "Ray: 2/2 nodes" in launched["output"].read_text()

    def test_it_staged_the_weights_on_each_node_and_serves_that_copy(self, launched):
        """``LLMLAB_STAGE_DIR``: each node ran ``llmlab weights stage`` before vLLM (the test bed's two nodes share
        one disk, so one of them may find the other's copy in place), and vLLM loaded the staged copy."""
        job_id, staged = launched["job_id"], launched["stage_dir"] / "llmlab-tiny"
        shipped = memory.MODELS_DIR / memory.TINY_NAME  # what the CPU job loads without LLMLAB_STAGE_DIR
        logs = cluster.job_log_dir(job_id)
        assert "copying the weights to node-local disk" in [phase for _, phase in launched["files_seen"]]
        text = launched["output"].read_text()
        assert f"staging the weights on node1 node2: {sys.executable} -m llmlab weights stage " in text
        for node in ("node1", "node2"):  # srun relays the bar (stderr) and the result (stdout) apart: either may
            lines = (logs / f"stage-{node}.log").read_text().splitlines()  # come last in the node's log
            done = [line for line in lines if line.startswith(f"staged {shipped} -> {staged}: ") or
                    line == f"{staged} already holds this stage's verified copy of {shipped} (its manifest "
                            "matches): not copied again"]
            assert len(done) == 1, lines
            assert f"{node}: {done[0]}" in text
        assert weights.verify(staged, group=False).ok and weights.same_files(shipped, staged)
        assert [p.name for p in launched["stage_dir"].iterdir()] == ["llmlab-tiny"]  # no half copy left
        assert f"model='{staged}'" in (logs / "vllm.log").read_text()

    def test_its_connection_file_output_ray_folder_and_processes(self, launched):
        """What the launcher publishes on the way and once ready: the phases in the connection file (Ray, then the
        load's own), the ready file's fields, 0600 files, the output's instructions, Ray's private folder, the
        job's own processes, and the key in no log and no process's arguments."""
        job_id, key, info, files_seen = launched["job_id"], launched["key"], launched["info"], launched["files_seen"]
        loading = [phase for status, phase in files_seen if status == "loading"]
        assert files_seen[0][0] == "loading" and files_seen[-1][0] == "ready", files_seen  # never a silent gap
        assert "starting Ray on 2 nodes" in loading and len(set(loading) - {jobs.QUEUED}) >= 2, files_seen
        assert info["kind"] == "slurm" and info["job_id"] == job_id and info["host"] == "127.0.0.1"
        assert info["model"] == CPU_JOB and info["nodes"] == ["node1", "node2"] and info["started"]
        keys = Path(os.environ["LLMLAB_HOME"]) / "keys"
        secrets = [keys / f"job-{job_id}.key", launched["token_file"], keys / f"job-{job_id}.curl"]
        assert info["api_key_file"] == str(secrets[0]) and all(p.exists() for p in secrets)
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in [launched["connection_file"], *secrets])
        text = launched["output"].read_text()
        assert "Ray: 2/2 nodes, 0/0 GPUs joined" in text and "READY: llmlab-tiny-cpu at http://127.0.0.1:" in text
        assert "client, model = llmlab.connect()" in text and f"curl --config {secrets[2]} " in text

        folder = ray_folder(job_id)  # mktemp's six random characters, not the job id
        assert folder.name == "ray" and re.fullmatch(r"llmlab-ray\.[A-Za-z0-9]{6}", folder.parent.name), folder
        st = folder.parent.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert (folder / "session_latest" / "sockets").is_dir()
        assert any("raylet" in p for p in job_processes(job_id)), "Ray should run on the job's nodes"
        assert [s for s in cluster.servers() if s.job_id == job_id][0].alive

        with pytest.raises(urllib.error.HTTPError) as err:  # the owner too, without the key
            urllib.request.urlopen(f"http://127.0.0.1:{info['port']}/v1/models", timeout=10)
        assert err.value.code == 401
        logs = [launched["output"], *cluster.job_log_dir(job_id).glob("*")]
        assert all(key not in p.read_text(errors="replace") for p in logs if p.is_file())
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue

    def test_a_request_then_metrics_status_and_logs(self, launched, monkeypatch):
        job_id, key = launched["job_id"], launched["key"]
        monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(launched["connection_file"]))
        client, model = llmlab.connect(quiet=True)
        r = client.completions.create(model=model, prompt="In the beginning", max_tokens=6,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 6

        mx = jobs.metrics(job_id, interval=0.5)
        assert mx["requests_finished"] >= 1 and mx["generation_tokens_total"] >= 6 and mx["latency_p50_s"] > 0
        out = llmlab_cli("metrics", job_id, "--interval", "0.2")
        assert out.returncode == 0 and "finished" in out.stdout and "TTFT p50/p90/p99" in out.stdout

        out = llmlab_cli("status", "--wait", "--timeout", "60")  # no id: the newest launch, READY already
        assert out.returncode == 0 and "use: client, model = llmlab.connect()" in out.stdout, out.stdout

        out = llmlab_cli("status", job_id, "--json")
        info = json.loads(out.stdout)
        assert out.returncode == 0 and info["state"] == "READY" and info["url"] == launched["ready"].url
        assert key not in out.stdout and key not in llmlab_cli("status", "--json").stdout
        listed = json.loads(llmlab_cli("status", "--json").stdout)
        assert any(row["job_id"] == job_id and row["state"] == "READY" for row in listed)

        logs = llmlab_cli("logs", job_id, "-n", "200")
        assert logs.returncode == 0 and "vllm.log <==" in logs.stdout and "READY:" in logs.stdout
        assert key not in logs.stdout

    # -- another user of the cluster against the job (docs/security.md) -----------------------------------------

    @needs_attacker
    def test_completions_without_or_with_a_wrong_key_are_401(self, attacker, launched):
        url = f"http://{launched['host']}:{launched['port']}/v1/completions"
        body = {"model": launched["model"], "prompt": "Hello", "max_tokens": 4}
        assert attacker_http(attacker, url, method="POST", body=body) == 401
        assert attacker_http(attacker, url, key="wrong", method="POST", body=body) == 401

    @needs_attacker
    def test_unguarded_routes_and_traversal_are_refused(self, attacker, launched):
        base = f"http://{launched['host']}:{launched['port']}"
        for path in ("/invocations", "/tokenize", "/docs", "/openapi.json"):
            assert attacker_http(attacker, base + path, method="POST") == 401
            assert owner_http(base + path, launched["key"], "POST") == 404
        assert owner_http(base + "/v1/%2e%2e/invocations", launched["key"], "POST",
                          raw_path="/v1/%2e%2e/invocations") == 400

    @needs_attacker
    def test_ray_refuses_a_client_without_the_token(self, attacker, launched):
        ip, port = launched["ray_address"].rsplit(":", 1)
        attack = grpc_status(lambda *c, stdin=None: as_attacker(attacker, *c, stdin=stdin), ip, int(port),
                             GCS_METHOD)
        assert attack == "16"
        assert grpc_status(owner_run, ip, int(port), GCS_METHOD, read_key(launched["token_file"])) == "0"

    @needs_attacker
    def test_key_and_token_files_are_unreadable(self, attacker, launched):
        for path in (launched["api_key_file"], launched["token_file"]):
            out = as_attacker(attacker, "cat", str(path))
            assert out.returncode != 0 and not out.stdout

    @needs_attacker
    def test_secrets_are_in_no_ps_output_nor_job_output(self, attacker, launched):
        token = read_key(launched["token_file"])
        args = as_attacker(attacker, "ps", "-eo", "args").stdout.decode()
        assert "raylet" in args and "llmlab.serve.proxy" in args
        assert launched["key"] not in args and token not in args
        text = launched["output"].read_text()
        assert "READY" in text and launched["key"] not in text and token not in text
        client, model = llmlab.connect(f"http://{launched['host']}:{launched['port']}/v1", launched["key"],
                                       quiet=True)
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1

    @needs_attacker
    def test_ray_folder_is_private_and_unpredictable(self, attacker, launched):
        folder = ray_folder(launched["job_id"])
        # mktemp's six random characters, not the job id (a digit of a short id may occur among them by chance)
        assert re.fullmatch(r"llmlab-ray\.[A-Za-z0-9]{6}", folder.parent.name) and folder.name == "ray", \
            f"{folder}: a name another user can guess before the job"
        ray_folder_is_out_of_reach(attacker, folder)

    # -- last: stop ----------------------------------------------------------------------------------------------

    def test_stop_leaves_nothing_behind(self, launched):
        """``llmlab stop`` (scancel): the key and the Ray token go at once, the launcher's clean-up ends within the
        test bed's KillWait (15 s; SIGKILL comes after it), and nothing of the job is left: its processes, its
        connection file, Ray's session folder."""
        job_id = launched["job_id"]
        key_file = Path(launched["api_key_file"])
        secrets = [key_file, launched["token_file"], key_file.with_suffix(".curl")]
        gone = {}

        def time_the_secrets():
            while any(p.exists() for p in secrets) and time.monotonic() - t1 < 60:
                time.sleep(0.05)
            gone["after"] = time.monotonic() - t1

        t1 = time.monotonic()
        timer = threading.Thread(target=time_the_secrets, daemon=True)
        timer.start()
        stopped = jobs.stop(job_id)
        timer.join(60)
        assert stopped.state == "STOPPED", str(stopped)
        print(f"llmlab status {job_id}: {stopped.state} - {stopped.detail}; the key and the token went "
              f"{gone['after']:.1f} s after scancel")
        assert not launched["connection_file"].exists() and not any(p.exists() for p in secrets)
        assert gone["after"] < 5, f"the key and the Ray token went {gone['after']:.1f} s after scancel"
        wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
        text = launched["output"].read_text()
        assert "received SIGTERM (scancel or time limit): shutting down" in text
        took = re.search(r"stopped; connection file and key removed \(clean-up (\d+) s; SLURM's KillWait (\d+) s\)",
                         text)
        assert took, text[-2000:]
        assert int(took[2]) == 15 and int(took[1]) <= 15 - 3, took[0]  # the launcher read the test bed's KillWait
        assert not ray_folder(job_id).parent.exists(), "Ray's per-job session files should be removed"
        out = llmlab_cli("status", job_id)
        assert out.returncode == 0 and "STOPPED" in out.stdout


@needs_slurm
def test_a_wrong_model_path_fails_with_that_reason(slurm_env, monkeypatch):
    use_testbed(monkeypatch, slurm_env)
    monkeypatch.setenv("LLMLAB_MODEL_PATH", "/nonexistent/llmlab-model")
    record = jobs.launch(cluster.prepare(CPU_JOB, nodes=1))  # one node: no Ray, so it fails sooner
    out = llmlab_cli("status", record.job_id, "--wait", "--timeout", "600", "--poll", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    st = jobs.status(record.job_id)
    assert st.state == "FAILED" and st.reason.startswith("the model path does not exist"), str(st)
    assert any("/nonexistent/llmlab-model" in line for line in st.log_lines), st.log_lines
    assert not any("WARNING" in line for line in st.log_lines), st.log_lines
    assert "FAILED" in out.stdout and "the model path does not exist" in out.stdout
    print(f"\nllmlab status {record.job_id}: {st}")
    wait_for(lambda: not job_processes(record.job_id), 60, "the job's processes to end")


@needs_slurm
def test_a_queued_job_is_announced_as_loading_and_forgotten_when_cancelled(slurm_env, monkeypatch):
    """Before: while a job waited in SLURM's queue, no connection file existed and connect() started the embedded
    tiny model in its place.  Now `llmlab launch` publishes "loading" at once; a job cancelled before it started
    (by `llmlab stop`, or by a bare scancel that `llmlab status` then notices) leaves no file behind."""
    from llmlab.serve import embedded

    def no_fallback(*args, **kwargs):
        raise AssertionError("connect() started the embedded tiny model while the job waited in the queue")

    use_testbed(monkeypatch, slurm_env)
    monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
    monkeypatch.setattr(embedded, "ensure_embedded", no_fallback)
    held = [jobs.launch(cluster.prepare(CPU_JOB, nodes=1, extra_sbatch=["--hold"])).job_id for _ in range(2)]
    try:
        conn = [cluster.connection_file_of(job_id) for job_id in held]
        info = json.loads(conn[1].read_text())
        assert info["status"] == "loading" and info["phase"] == jobs.QUEUED and info["job_id"] == held[1]
        assert stat.S_IMODE(conn[1].stat().st_mode) == 0o600
        assert jobs.status(held[1]).state == "PENDING"
        with pytest.raises(llmlab.ServerUnavailable) as err:
            llmlab.connect(quiet=True)  # the newest file: the second job's
        assert f"SLURM job {held[1]} is still loading the model ({jobs.QUEUED}" in str(err.value)
        row = next(r for r in cluster.servers(embedded=False) if r.job_id == held[1])
        assert row.status == "loading" and row.url is None and row.alive is False

        assert jobs.stop(held[1]).state == "STOPPED" and not conn[1].exists()
        subprocess.run(["scancel", held[0]], check=True)  # behind llmlab's back
        wait_for(lambda: jobs.status(held[0]).state == "STOPPED", 60, f"job {held[0]} to be cancelled")
        assert not conn[0].exists()
        with pytest.raises(llmlab.ServerUnavailable, match=f"The server of SLURM job {held[0]} .* ended at"):
            llmlab.connect(quiet=True)  # it ended behind llmlab's back: said, not replaced by the tiny model
    finally:
        subprocess.run(["scancel", *held], check=False)


# The launcher's output while Ray is retried (seen in CI on a loaded machine: the first attempt's head timed out).






@needs_slurm
def test_launch_rehearse_runs_llmlab_rehearse_in_the_allocation(slurm_env, monkeypatch):
    use_testbed(monkeypatch, slurm_env)
    record = jobs.launch(cluster.prepare(CPU_JOB, nodes=1, rehearse=True))
    done = jobs.wait(record.job_id, timeout=900, poll=2)
    assert done.state == "STOPPED" and done.detail.startswith("rehearsal done"), str(done)
    folder = cluster.job_log_dir(record.job_id) / "rehearsal"
    r = json.loads((folder / "rehearsal.json").read_text())
    assert r["model"] == "llmlab-tiny" and "rehearsing llmlab-tiny" in Path(record.output).read_text()
    # the rehearsal's own checks (tests/engine/test_rehearse.py ran a second one outside SLURM until 2026-11-27)
    assert r["kv_tokens_logged"] == r["kv_tokens_predicted"] == r["kv_tokens_predicted_before_start"] == 524_288
    assert f"CPU KV cache size: {r['kv_tokens_logged']:,} tokens" in (folder / rehearse.LOG_EXCERPT).read_text()
    issue_keys = ("gpu", "gpu_count", "model", "tp", "pp", "vllm_version", "startup_s", "weights_gib",
                  "activation_peak_gib", "kv_tokens_logged", "kv_tokens_predicted", "kv_tokens_predicted_before_start",
                  "bandwidth_tb_s", "roofline_tok_s", "decode_tok_s_batch1", "sweep")
    assert all(k in r for k in issue_keys), [k for k in issue_keys if k not in r]
    assert [s["concurrency"] for s in r["sweep"]] == [1, 8, 64]  # llmlab rehearse's default levels
    assert all(s["ok"] == s["requests"] and s["output_tokens_per_s"] > 0 for s in r["sweep"])
    assert r["decode_tok_s_batch1"] > 0 and r["bandwidth_tb_s"] > 0 and rehearse.check_math(r) == []
    assert r["vllm_version"] and r["serve_line"].endswith("--load-format dummy") and r["server_stopped"]
    assert (folder / "rehearsal.png").stat().st_size > 10_000
    wait_for(lambda: not job_processes(record.job_id), 60, f"job {record.job_id}'s processes to end")
    with pytest.raises(cluster.JobError, match="A rehearsal runs on one node"):
        cluster.prepare(CPU_JOB, rehearse=True)  # two nodes


def test_a_refused_front_names_the_models_jobs_left_running_and_keeps_its_script(slurm_env, monkeypatch):
    """instructor-review-3, mismatch 4: when sbatch refused the front, its script was deleted and the models' jobs
    already submitted were not named.  The models' jobs are held (never started); the front asks for a partition
    the test bed does not have."""
    from llmlab.ops import front
    from llmlab.serve.info import llmlab_home

    use_testbed(monkeypatch, slurm_env)
    plans = [cluster.prepare(m, nodes=1, extra_sbatch=["--hold"]) for m in (CPU_JOB, "llmlab-wide-cpu")]
    before = {p.stem for p in jobs.jobs_dir().glob("*.json")}
    with pytest.raises(cluster.JobError) as refused:
        front.launch_set(plans, front.front_options(None, "no-such-partition", None, plans))
    held = sorted(({p.stem for p in jobs.jobs_dir().glob("*.json")} - before), key=int)
    try:
        message = str(refused.value)
        assert len(held) == 2 and "(the front job)" in message
        assert f"{held[0]} ({CPU_JOB}), {held[1]} (llmlab-wide-cpu)" in message
        assert f"llmlab stop {held[0]}; llmlab stop {held[1]}" in message
        saved = llmlab_home() / "logs" / f"front-{held[0]}-{held[1]}.sbatch"
        assert f"`sbatch {saved}`" in message and "llmlab.ops.front" in saved.read_text()
    finally:
        for job_id in held:  # through llmlab, which removes their "waiting in the queue" connection files too: a
            jobs.stop(job_id)  # bare scancel left them, and later tests' connect() found a server still "loading"



def test_the_launch_checks_from_a_compute_node_that_the_jobs_files_are_there(slurm_env, monkeypatch, tmp_path):
    """Issue 47, pre-flight: the job script names the checkout, its Python and the share and weights folders by
    absolute path; a one-second srun on a node of the partition looks for them before sbatch."""
    from llmlab.ops import preflight

    use_testbed(monkeypatch, slurm_env)
    plan = cluster.prepare(CPU_JOB, nodes=1)
    problem, found = preflight.compute_node_problem(plan)
    assert problem is None and found.startswith("a compute node sees ") and str(cluster.slurm_dir()) in found
    monkeypatch.setenv("LLMLAB_PYTHON", str(tmp_path / "login-node-only" / "python3"))
    problem, _ = preflight.compute_node_problem(plan)
    assert f"does not see {tmp_path / 'login-node-only' / 'python3'}" in problem
    assert "a file system every login and compute node mounts" in problem
    plan.sbatch_options["partition"] = "no-such-partition"  # srun refuses: said, not refused
    problem, found = preflight.compute_node_problem(plan)
    assert problem is None and found.startswith("not checked from a compute node (")
