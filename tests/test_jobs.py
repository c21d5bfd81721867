"""The cluster CLI (llmlab.ops.jobs, ``llmlab launch | status | metrics | logs | stop | list``).

Pure tests (settings and overrides, the plan check, the rendered job script, the launcher's own dry run for
every shipped GPU model) need no SLURM.  The rest run every command against the real slurmctld + two slurmd
of tests/slurm_testbed.py with the CPU engine and the tiny model: launch -> the states in order -> a request
-> metrics -> logs -> stop -> STOPPED with nothing left; and a job whose model path is wrong -> FAILED with
that reason.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from test_slurm import (  # noqa: F401
    CPU_JOB,
    GPU_JOBS,
    dry_run,
    job_processes,
    line_of,
    needs_slurm,
    slurm_env,
    wait_for,
)

import llmlab
from llmlab import cluster, kvcache, memory
from llmlab.ops import jobs
from llmlab.serve.info import read_key, servers_dir, write_connection_file
from llmlab.serve.proc import free_port


def llmlab_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmlab", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ.copy())


# --------------------------------------------------------------------------------------------------
# Settings, plan and job script (no SLURM)
# --------------------------------------------------------------------------------------------------

def test_overrides_keep_tp_inside_a_node_and_round_trip_through_the_job_script(tmp_path):
    job = jobs.settings("llama3.1-405b", tp=8, pp=2, dtype="bf16", max_model_len=8192, extra_args=["--x", "a b"])
    assert (job.nodes, job.gpus_per_node, job.tp, job.pp, job.dtype, job.max_model_len) == (2, 8, 8, 2, "bfloat16",
                                                                                             8192)
    assert job.extra_args[-2:] == ("--x", "a b")
    path = tmp_path / "settings.toml"
    path.write_text(jobs.settings_toml(job))
    assert cluster.load_settings(path)[job.name] == job  # what the job reads is exactly what was planned
    plan = jobs.prepare("llama3.1-70b", account="acct", partition="gpu", time_limit="01:00:00")
    assert "#SBATCH --account=acct\n#SBATCH --partition=gpu\n" in plan.script
    assert "#SBATCH --gpus-per-node=4\n" in plan.script and "#SBATCH --time=01:00:00\n" in plan.script
    embedded = plan.script.split("<<'LLMLAB_SETTINGS'\n", 1)[1].split("LLMLAB_SETTINGS\n", 1)[0]
    assert tomllib.loads(embedded)["llama3.1-70b"]["tp"] == 4
    assert plan.script.rstrip().endswith('exec bash "$LLMLAB_SLURM_DIR/llmlab-serve.sh" llama3.1-70b')


@pytest.mark.parametrize("name", GPU_JOBS)
def test_launch_dry_run_renders_the_job_scripts_serve_line_and_ray_layout(name):
    """One source: ``llmlab launch --dry-run`` and ``sbatch slurm/NAME.sh`` (dry run) run the same vLLM and Ray."""
    out = llmlab_cli("launch", name, "--dry-run")
    assert out.returncode == 0, out.stderr
    script = dry_run(name).stdout
    for prefix in ("vLLM:", "runs as:", "Ray: ", "Ray head:", "Ray worker:", "Ray wait:"):
        ours = [line for line in out.stdout.splitlines() if line.startswith(prefix)]
        theirs = [line for line in script.splitlines() if line.startswith(prefix)]
        assert ours == theirs, prefix
    job = cluster.job_settings(name)
    assert re.search(rf"TP x PP +{job.tp} x {job.pp}\n", out.stdout)
    assert "--- job script (not submitted: --dry-run) ---" in out.stdout


UNLISTED = [m for m in memory.shipped_models() if m not in {j.model for j in cluster.load_settings().values()}]


@pytest.mark.parametrize("model", [m for m in UNLISTED if m != "llmlab-tiny"])
def test_any_shipped_model_launches_on_the_planners_layout(model):
    """No models.toml table needed: the planner's smallest layout, its serve line in the job's settings."""
    out = llmlab_cli("launch", model, "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    best = memory.plan(model)
    assert (plan["plan"]["tp"], plan["plan"]["pp"], plan["plan"]["nodes"]) == (best.tp, best.pp, best.nodes)
    assert plan["plan"]["fits"] and plan["plan"]["kv_tokens"] == best.kv_tokens
    embedded = tomllib.loads(plan["script"].split("<<'LLMLAB_SETTINGS'\n", 1)[1].split("LLMLAB_SETTINGS\n", 1)[0])
    assert embedded[model]["model"] == model and embedded[model]["tp"] == best.tp
    assert f"--tensor-parallel-size {best.tp}" in plan["launcher"] or best.tp == 1


def test_expert_parallel_reaches_the_serve_line_and_a_dense_model_is_refused():
    out = llmlab_cli("launch", "qwen3-30b-a3b", "--tp", "2", "--expert-parallel", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "--enable-expert-parallel" in out.stdout and "--tensor-parallel-size 2" in out.stdout
    out = llmlab_cli("launch", "qwen3-8b", "--expert-parallel", "--dry-run")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "experts" in out.stderr, out.stderr


def test_impossible_layout_is_refused_with_numbers_and_a_layout_that_fits(tmp_path):
    """Llama 3.1 405B in bf16 on one node of 4 x A100-40GB: refused before sbatch is ever called."""
    marker = tmp_path / "sbatch-was-called"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (fake_bin / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "LLMLAB_HOME": str(tmp_path / "home")}
    out = llmlab_cli("launch", "llama3.1-405b", "--nodes", "1", "--gpus-per-node", "4", "--tp", "4", "--pp", "1",
                     "--gpu-type", "A100-40", env=env)
    weights = max(memory.weight_bytes_per_gpu("llama3.1-405b", None, 4, 1)) / memory.GiB
    fit = memory.plan("llama3.1-405b", None, "auto", "A100-40", 4, 131072)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"the weights take {weights:.1f} GiB per GPU" in out.stderr
    suggested = f"llmlab launch llama3.1-405b --nodes {fit.nodes} --gpus-per-node 4 --tp {fit.tp} --pp {fit.pp}"
    assert suggested in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize("args, message", [
    (["launch", "llama9"], "No job 'llama9'"),
    (["launch", "llmlab-tiny"], "or any shipped model, laid out by llmlab.memory's planner: deepseek-v3"),
    (["launch", "llama3.1-70b", "--tp", "3"], "64 attention heads do not divide into 3"),
    (["launch", "llama3.1-70b", "--nodes", "1", "--gpus-per-node", "4", "--tp", "8"], "make them equal"),
    (["launch", "llama3.1-70b", "--gpu-type", "B300"], "B300"),
    (["status", "abc"], "is not a SLURM job id"),
])
def test_bad_input_is_one_sentence(args, message):
    out = llmlab_cli(*args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_no_sbatch_means_not_a_login_node(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # nothing on PATH: the interpreter is called by its full path
    out = llmlab_cli("launch", "llama3.1-8b", env=env)
    assert out.returncode == 2 and "`sbatch` is not on PATH: this is not a SLURM login node" in out.stderr
    assert "Plan for" not in out.stdout


def test_list_shows_every_shipped_server_with_its_plan():
    rows = json.loads(llmlab_cli("list", "--json").stdout)
    assert {r["name"] for r in rows} == set(cluster.load_settings())
    by_name = {r["name"]: r for r in rows}
    assert by_name["llama3.1-70b"]["kv_tokens"] == cluster.layout_report("llama3.1-70b")["kv_tokens"]
    assert all(r["fits"] for r in rows)


def test_histogram_quantile_interpolates_like_prometheus():
    m = kvcache.parse_prometheus('x_bucket{le="0.1"} 0\nx_bucket{le="0.5"} 5\nx_bucket{le="1.0"} 10\n'
                                     'x_bucket{le="+Inf"} 10\n')
    assert jobs.histogram_quantile(m, "x", 0.5) == pytest.approx(0.5)
    assert jobs.histogram_quantile(m, "x", 0.25) == pytest.approx(0.3)
    assert jobs.histogram_quantile(kvcache.parse_prometheus('x_bucket{le="+Inf"} 0\n'), "x", 0.5) is None


# --------------------------------------------------------------------------------------------------
# Under a real SLURM (CPU mode)
# --------------------------------------------------------------------------------------------------

def use_testbed(monkeypatch, env: dict) -> None:
    for key in ("SLURM_CONF", "PATH", "LLMLAB_PYTHON"):
        monkeypatch.setenv(key, env[key])


@needs_slurm
def test_launch_to_ready_then_request_metrics_logs_and_stop(slurm_env, monkeypatch, capsys):  # noqa: F811
    use_testbed(monkeypatch, slurm_env)
    t0 = time.monotonic()
    record = jobs.launch(jobs.prepare(CPU_JOB))
    job_id = record["job_id"]
    seen: list[jobs.JobStatus] = []
    try:
        ready = jobs.wait(job_id, timeout=900, poll=0.5, on_change=seen.append)
        with capsys.disabled():  # the figure for the record, shown in CI's log too
            print(f"\nllmlab launch {CPU_JOB} -> READY in {time.monotonic() - t0:.1f} s")
        assert ready.state == "READY", f"{ready}\n{Path(ready.output).read_text() if ready.output else ''}"
        states = [s.state for s in seen]
        order = [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]
        assert order[-3:] == ["STARTING", "LOADING", "READY"] and set(order[:-3]) <= {"PENDING"}, order
        print("\n".join(f"llmlab status {job_id}: {s.state} - {s.detail}" for s in seen))
        script = Path(record["script"]).read_text()
        assert "#SBATCH --job-name=llmlab-llmlab-tiny-cpu\n#SBATCH --nodes=2\n" in script
        assert (cluster.job_log_dir(job_id) / "settings.toml").read_text() in script  # what ran, as it ran
        assert stat.S_IMODE(Path(record["script"]).stat().st_mode) == 0o600
        assert "Ray: 2/2 nodes" in Path(record["output"]).read_text()

        monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(servers_dir() / f"job-{job_id}.json"))
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
        assert out.returncode == 0 and info["state"] == "READY" and info["url"] == ready.url
        key = read_key(info["api_key_file"])
        assert key not in out.stdout and key not in llmlab_cli("status", "--json").stdout
        listed = json.loads(llmlab_cli("status", "--json").stdout)
        assert any(row["job_id"] == job_id and row["state"] == "READY" for row in listed)

        logs = llmlab_cli("logs", job_id, "-n", "200")
        assert logs.returncode == 0 and "vllm.log <==" in logs.stdout and "READY:" in logs.stdout
        assert key not in logs.stdout
    finally:
        stopped = jobs.stop(job_id)
    assert stopped.state == "STOPPED", str(stopped)
    print(f"llmlab status {job_id}: {stopped.state} - {stopped.detail}")
    assert not (servers_dir() / f"job-{job_id}.json").exists() and not Path(info["api_key_file"]).exists()
    wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
    out = llmlab_cli("status", job_id)
    assert out.returncode == 0 and "STOPPED" in out.stdout


@needs_slurm
def test_a_wrong_model_path_fails_with_that_reason(slurm_env, monkeypatch):  # noqa: F811
    use_testbed(monkeypatch, slurm_env)
    monkeypatch.setenv("LLMLAB_MODEL_PATH", "/nonexistent/llmlab-model")
    record = jobs.launch(jobs.prepare(CPU_JOB, nodes=1))  # one node: no Ray, so it fails sooner
    out = llmlab_cli("status", record["job_id"], "--wait", "--timeout", "600", "--poll", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    st = jobs.status(record["job_id"])
    assert st.state == "FAILED" and st.reason.startswith("the model path does not exist"), str(st)
    assert any("/nonexistent/llmlab-model" in line for line in st.log_lines), st.log_lines
    assert not any("WARNING" in line for line in st.log_lines), st.log_lines
    assert "FAILED" in out.stdout and "the model path does not exist" in out.stdout
    print(f"\nllmlab status {record['job_id']}: {st}")
    wait_for(lambda: not job_processes(record["job_id"]), 60, "the job's processes to end")


@needs_slurm
def test_a_queued_job_is_announced_as_loading_and_forgotten_when_cancelled(slurm_env, monkeypatch):  # noqa: F811
    """Before: while a job waited in SLURM's queue, no connection file existed and connect() started the embedded
    tiny model in its place.  Now `llmlab launch` publishes "loading" at once; a job cancelled before it started
    (by `llmlab stop`, or by a bare scancel that `llmlab status` then notices) leaves no file behind."""
    from llmlab.serve import embedded

    def no_fallback(*args, **kwargs):
        raise AssertionError("connect() started the embedded tiny model while the job waited in the queue")

    use_testbed(monkeypatch, slurm_env)
    monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
    monkeypatch.setattr(embedded, "ensure_embedded", no_fallback)
    held = [jobs.launch(jobs.prepare(CPU_JOB, nodes=1, extra_sbatch=["--hold"]))["job_id"] for _ in range(2)]
    try:
        conn = [cluster.connection_file_of(job_id) for job_id in held]
        info = json.loads(conn[1].read_text())
        assert info["status"] == "loading" and info["phase"] == jobs.QUEUED and info["job_id"] == held[1]
        assert stat.S_IMODE(conn[1].stat().st_mode) == 0o600
        assert jobs.status(held[1]).state == "PENDING"
        with pytest.raises(llmlab.ServerUnavailable) as err:
            llmlab.connect(quiet=True)  # the newest file: the second job's
        assert f"SLURM job {held[1]} is still loading the model ({jobs.QUEUED}" in str(err.value)
        row = next(r for r in cluster.servers(embedded=False) if r["job_id"] == held[1])
        assert row["status"] == "loading" and row["url"] is None and row["alive"] is False

        assert jobs.stop(held[1]).state == "STOPPED" and not conn[1].exists()
        subprocess.run(["scancel", held[0]], check=True)  # behind llmlab's back
        wait_for(lambda: jobs.status(held[0]).state == "STOPPED", 60, f"job {held[0]} to be cancelled")
        assert not conn[0].exists()
    finally:
        subprocess.run(["scancel", *held], check=False)


@pytest.mark.parametrize("output, vllm_log, reason", [
    ("[llmlab 10:00:00] FAILED: vLLM exited while starting. Last lines of x/vllm.log:\n",
     "ERROR [core.py] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", "out of memory"),
    ("[llmlab 10:00:00] FAILED: Ray did not start on every node in 3 attempt(s) (the lines above say why)\n", "",
     "Ray did not come up on every node"),
    ("[llmlab 10:00:00] FAILED: vLLM exited while starting.\n",
     "api_server.py: error: unrecognized arguments: --bogus\n", "vLLM rejected an argument"),
    ("[llmlab 10:00:00] READY: m at http://h:1/v1\n[llmlab 11:00:00] FAILED: vLLM exited on its own (code 1). Last "
     "lines of x:\n", "INFO ... Application startup complete.\n", "vLLM exited after it was ready"),
    ("[llmlab 10:00:00] vLLM: loading weights\n", "ERROR something\n", None),
])
def test_failure_reasons_from_the_launchers_output(output, vllm_log, reason):
    found = jobs.failure(output, vllm_log)
    if reason is None:
        assert found is None  # no FAILED line from the launcher: not failed, whatever vLLM logged
    else:
        assert found[0].startswith(reason), found
        assert "Last lines of" not in found[0]


GPU_LOGS = Path(__file__).parent / "fixtures"


def replay(monkeypatch, tmp_path, output: str, vllm_log: str, job_id: str = "900001") -> list[str]:
    """``llmlab status`` at every line of a real job's logs, as a person polling it would have seen it."""
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path))
    out = tmp_path / "job.out"
    monkeypatch.setattr(jobs, "scontrol_job", lambda _: {"JobState": "RUNNING", "JobName": "llmlab-llama3.1-8b",
                                                         "StdOut": str(out)})
    log = cluster.job_log_dir(job_id) / "vllm.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out_lines = output.splitlines(keepends=True)
    started = next(i for i, line in enumerate(out_lines) if "starting vLLM" in line) + 1
    out.write_text("".join(out_lines[:started]))
    seen, text = [], ""
    for line in vllm_log.splitlines(keepends=True):
        text += line
        log.write_text(text)
        st = jobs.status(job_id)
        if not seen or seen[-1] != f"{st.state}: {st.detail}":
            seen.append(f"{st.state}: {st.detail}")
    out.write_text(output)
    st = jobs.status(job_id)
    seen.append(f"{st.state}: {st.detail}")
    return seen


def test_status_follows_the_gpu_launchers_real_log(tmp_path, monkeypatch):
    """The launcher's job on an H100 (vLLM 0.26.0, benchmarks/launcher_on_gpu.py): every phase, in order."""
    d = GPU_LOGS / "vllm" / "0.26.0"
    output = (d / "job.out").read_text().split("[llmlab 11:48:23] READY")[0]  # before READY: no server to ask now
    seen = replay(monkeypatch, tmp_path, output, (d / "vllm.log").read_text())
    assert seen == ["LOADING: importing vLLM", "LOADING: reading the model config", "LOADING: starting the engine",
                    "LOADING: weights loaded, warming up", "LOADING: compiling the model (torch.compile)",
                    "LOADING: KV cache allocated", "LOADING: capturing CUDA graphs",
                    "LOADING: starting the HTTP server",
                    "LOADING: vLLM answers; the launcher is publishing the connection file",
                    "LOADING: vLLM answers; the launcher is publishing the connection file"], seen


def test_status_names_the_out_of_memory_of_a_real_gpu_start(tmp_path, monkeypatch):
    """--gpu-memory-utilization 0.1 for an 8B model on an H100: FAILED, out of memory, with vLLM's own line."""
    d = GPU_LOGS / "launch" / "h100-llama3.1-8b-oom"
    seen = replay(monkeypatch, tmp_path, (d / "job.out").read_text(), (d / "vllm.log").read_text(), "900002")
    assert not any(s.startswith("FAILED") for s in seen[:-1]), seen  # tracebacks on the way are not the verdict
    st = jobs.status("900002")
    assert st.state == "FAILED" and st.reason.startswith("out of memory"), str(st)
    assert any("memory" in line.lower() for line in st.log_lines), st.log_lines


# The launcher's output while Ray is retried (seen in CI on a loaded machine: the first attempt's head timed out).
RETRYING = ("[llmlab 12:54:17] Ray on node1 exited before the cluster was complete. Last lines of r.log:\n"
            "Exception: The current node timed out during startup.\n"
            "[llmlab 12:54:18] Ray did not start on every node (attempt 1 of 3); starting it again in 10 s\n")
RETRIED = RETRYING + "[llmlab 12:54:40] Ray cluster complete: 2 nodes, 0 GPUs\n[llmlab 12:54:40] starting vLLM\n"


def job_files(tmp_path, monkeypatch, output: str, vllm_log: str = "", job_id: str = "4242") -> str:
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path))
    out = tmp_path / "job.out"
    out.write_text(output)
    cluster.job_log_dir(job_id).mkdir(parents=True, exist_ok=True)
    (cluster.job_log_dir(job_id) / "vllm.log").write_text(vllm_log)
    running = {"JobState": "RUNNING", "JobName": "llmlab-m", "StdOut": str(out)}
    monkeypatch.setattr(jobs, "scontrol_job", lambda _: running)
    return job_id


def test_a_ray_attempt_that_is_retried_is_not_a_failed_job(tmp_path, monkeypatch):
    """CI saw `llmlab status` say FAILED (and `--wait` give up) while the launcher was about to try Ray again."""
    st = jobs.status(job_files(tmp_path, monkeypatch, RETRYING))
    assert st.state == "STARTING", str(st)
    gave_up = RETRYING + "[llmlab 12:55:40] FAILED: Ray did not start on every node in 3 attempt(s) (see above)\n"
    st = jobs.status(job_files(tmp_path, monkeypatch, gave_up))
    assert st.state == "FAILED" and st.reason.startswith("Ray did not come up on every node"), str(st)


@pytest.mark.server
def test_a_server_that_answers_is_ready_whatever_its_logs_said(embedded, tmp_path, monkeypatch):
    """vLLM logs handled exceptions with tracebacks, and Ray may have needed a second attempt: a server that
    answers is READY; the same files with nobody answering are FAILED, saying so."""
    job_id = job_files(tmp_path, monkeypatch, RETRIED,
                       "(APIServer pid=9) ERROR 11-23 10:01:02 [serving.py:1] Traceback (most recent call last): x\n")
    conn = cluster.connection_file_of(job_id)
    write_connection_file(conn, kind="slurm", host=embedded["host"], port=embedded["port"], model=embedded["model"],
                          api_key_file=embedded["api_key_file"], job_id=job_id)
    assert jobs.status(job_id).state == "READY"
    write_connection_file(conn, kind="slurm", host="127.0.0.1", port=free_port("127.0.0.1"),
                          model="m", api_key_file=embedded["api_key_file"], job_id=job_id)
    st = jobs.status(job_id)
    assert st.state == "FAILED" and "does not answer /health now" in st.detail, str(st)


@needs_slurm
def test_launch_rehearse_runs_llmlab_rehearse_in_the_allocation(slurm_env, monkeypatch):  # noqa: F811
    use_testbed(monkeypatch, slurm_env)
    record = jobs.launch(jobs.prepare(CPU_JOB, nodes=1, rehearse=True))
    done = jobs.wait(record["job_id"], timeout=900, poll=2)
    assert done.state == "STOPPED" and done.detail.startswith("rehearsal done"), str(done)
    result = json.loads((cluster.job_log_dir(record["job_id"]) / "rehearsal" / "rehearsal.json").read_text())
    assert result["model"] == "llmlab-tiny" and result["kv_tokens_predicted"] == result["kv_tokens_logged"]
    assert "rehearsing llmlab-tiny" in Path(record["output"]).read_text()
    with pytest.raises(jobs.JobError, match="A rehearsal runs on one node"):
        jobs.prepare(CPU_JOB, rehearse=True)  # two nodes
