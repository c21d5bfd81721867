"""The SLURM launcher (slurm/) and llmlab.cluster.

Two kinds of tests:
- pure ones (settings, rendering, parsing, the GPU jobs' commands checked against llmlab.memory's planner):
  they run the job scripts in dry-run mode with bash and need no SLURM;
- CPU-mode jobs under a real slurmctld + two slurmd on this machine (tests/slurm_testbed.py), submitted with
  sbatch as a person submits the ready-made scripts: a job whose Ray worker cannot start, which must fail fast
  with the reason; a proxy that dies after READY; output private from its creation.  The server that comes up
  over Ray on 2 nodes, answers with its key, refuses without it and leaves nothing behind after scancel is
  tests/cluster/test_jobs.py's launched job (one submission for all of it: each costs a minute or more here).
  They are skipped, with the reason, only where the SLURM binaries (or root, for slurmd) are missing.

This file holds the tests under the SLURM test bed; the rest are in tests/unit/test_slurm.py (the pure tests).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import (
    CPU_JOB,
    SLURM,
    job_processes,
    job_state,
    needs_slurm,
    ray_folder,
    status_of,
    submit,
    wait_for,
)

import llmlab
from llmlab.ops import launcher
from llmlab.serve.info import servers_dir
from llmlab.serve.proc import free_port

# --------------------------------------------------------------------------------------------------
# Settings and job scripts: one source


# --------------------------------------------------------------------------------------------------
# Parsing: ray status, vLLM's load progress


# --------------------------------------------------------------------------------------------------
# Under a real SLURM (CPU mode)
# --------------------------------------------------------------------------------------------------


@needs_slurm
def test_job_whose_ray_worker_cannot_start_fails_fast_with_the_reason(slurm_env, tmp_path):
    t0 = time.monotonic()
    job_id = submit(slurm_env, tmp_path, LLMLAB_RAY_WORKER_ARGS="--no-such-option")
    output = tmp_path / f"slurm-{job_id}.out"
    wait_for(lambda: job_state(slurm_env, job_id)[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"),
             420, f"job {job_id} to fail")  # fast here means seconds after the worker exits, not the 600 s time-out
    elapsed = time.monotonic() - t0
    state, code = job_state(slurm_env, job_id)
    text = output.read_text()
    assert state == "FAILED" and code.startswith("1:"), (state, code, text)
    assert "Ray on node2 exited before the cluster was complete" in text
    assert "No such option '--no-such-option'" in text  # the reason, from the worker's own log
    # a usage error is not retried (a head that failed under load before it may have been: that is fine)
    after = text.split("No such option '--no-such-option'", 1)[1]
    assert "FAILED: Ray: ray start rejected its arguments" in after and "not retried" in after
    assert "starting it again" not in after
    assert "starting vLLM" not in text
    assert not (servers_dir() / f"job-{job_id}.json").exists()
    wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
    assert not ray_folder(job_id).parent.exists()
    print(f"\nSLURM job {job_id} with a broken Ray worker: FAILED after {elapsed:.1f} s")


def one_node_launcher(tmp_path: Path, home: Path, out: Path, job_id: str, **env_extra) -> subprocess.Popen:
    """The launcher itself, without sbatch: a one-node CPU job ``cpu1`` of the tiny model as SLURM would start it
    (``SLURM_JOB_ID``, one node), its output in ``out``, its own session so a signal reaches the whole job."""
    settings = tmp_path / "models.toml"
    settings.write_text('["cpu1"]\nmodel = "llmlab-tiny"\nengine = "cpu"\nnodes = 1\ngpus_per_node = 0\n'
                        'tp = 1\npp = 1\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(LLMLAB_PYTHON=sys.executable, LLMLAB_HOME=str(home), LLMLAB_SETTINGS_FILE=str(settings),
               SLURM_JOB_ID=job_id, LLMLAB_NODES="node1", **env_extra)
    with out.open("w") as f:
        return subprocess.Popen(["bash", str(SLURM / "llmlab-serve.sh"), "cpu1"], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def test_a_second_sigterm_during_the_clean_up_still_removes_the_key(tmp_path):
    """scancel, then the time limit (or scancel twice): the clean-up must finish, secrets included.  Before the fix,
    the second SIGTERM killed the launcher while it stopped vLLM, and the key stayed (seen on the H100)."""
    home, out = tmp_path / "home", tmp_path / "job.out"
    job = one_node_launcher(tmp_path, home, out, "777", LLMLAB_STOP_GRACE="20")
    try:
        deadline = time.monotonic() + 120
        # vLLM runs once its log has lines: a SIGTERM right after "starting vLLM" could come before the launcher
        # noted vLLM's pid, and the clean-up then had no vLLM to stop (the test waited out its deadline, 120 s)
        while not (m := re.search(r"starting vLLM \(log: (\S+)\)", out.read_text())) or \
                not Path(m[1]).exists() or not Path(m[1]).stat().st_size:
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.5)
        key = home / "keys" / "job-777.key"
        assert key.exists(), out.read_text()
        job.send_signal(subprocess.signal.SIGTERM)
        while "stopping vLLM" not in out.read_text():
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.05)
        job.send_signal(subprocess.signal.SIGTERM)  # while vLLM is being stopped
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    text = out.read_text()
    assert "stopped; connection file and key removed" in text, text
    assert not key.exists() and not list((home / "servers").glob("*.json"))


# --------------------------------------------------------------------------------------------------
# Issue 26: Ray's folder, the "loading" connection file, the clean-up's budget, a proxy that dies
# --------------------------------------------------------------------------------------------------


def test_a_job_whose_proxy_dies_after_ready_ends_and_cleans_up(tmp_path):
    """Bind, then publish: the first connection file ("loading") names a port that the job's own proxy already
    holds -- before, the launcher published a port it had picked, and another user could bind it first.
    A dead proxy: before, the launcher waited on vLLM alone, so a dead proxy (a crash, the OOM killer) left the job
    holding its nodes, unreachable, until the time limit.  Now the job ends with the reason, clean-up included."""
    home, out = tmp_path / "home", tmp_path / "job.out"
    conn = home / "servers" / "job-778.json"
    job = one_node_launcher(tmp_path, home, out, "778")
    try:
        wait_for(lambda: job.poll() is None and status_of(conn) is not None, 120, "the first connection file",
                 poll=0.02)
        first = json.loads(conn.read_text())
        proxies = [line.split(":")[0] for line in _processes_of(job.pid) if "llmlab.serve.proxy" in line]
        assert first["status"] == "loading" and len(proxies) == 1, (first, _processes_of(job.pid))
        assert launcher.port_holder(first["port"], int(proxies[0])) == "ours"

        def ready():
            assert job.poll() is None, out.read_text()
            return "READY:" in out.read_text()

        wait_for(ready, 600, "the server to be ready", poll=1)
        info = json.loads(conn.read_text())
        assert info["status"] == "ready" and info["port"] == first["port"]
        key = Path(info["api_key_file"])
        proxies = [line.split(":")[0] for line in _processes_of(job.pid) if "llmlab.serve.proxy" in line]
        assert len(proxies) == 1, _processes_of(job.pid)
        t0 = time.monotonic()
        os.kill(int(proxies[0]), 9)  # as the OOM killer would
        rc = job.wait(timeout=60)
        ended = time.monotonic() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    text = out.read_text()
    assert rc == 1 and "FAILED: the key-checking proxy exited on its own" in text, text[-2000:]
    assert "stopped; connection file and key removed" in text
    assert not key.exists() and not conn.exists()
    with pytest.raises(ProcessLookupError):
        os.killpg(info["pid"], 0)  # vLLM's whole group is gone
    assert ended < 30, f"the job took {ended:.1f} s to end after its proxy died"
    print(f"\nproxy killed: the job ended {ended:.1f} s later, cleaned up")


def _processes_of(session: int) -> list[str]:
    """"PID: command line" of every process in session ``session`` (the launcher's, started with a session)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3]) == session:
                found.append(f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_a_learner_of_a_room_whose_server_is_loading_is_told_so(tmp_path, monkeypatch):
    """The room's server.json, as the launcher publishes it while the instructor's job loads: a learner's connect()
    names the room's job and its phase, and never starts the embedded tiny model instead."""
    from llmlab.serve import embedded
    from llmlab.serve.info import write_connection_file

    def no_fallback(*args, **kwargs):
        raise AssertionError("connect() started the embedded tiny model")

    monkeypatch.setattr(embedded, "ensure_embedded", no_fallback)
    room = write_connection_file(tmp_path / "server.json", kind="shared", host="127.0.0.1", port=free_port(),
                                 model=CPU_JOB, api_key_file="/nonexistent/owner.key", job_id="88", status="loading",
                                 phase="loading weights: 3/8 shards", share_dir=str(tmp_path), group="ws")
    monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(room))
    with pytest.raises(llmlab.ServerUnavailable) as err:
        llmlab.connect(quiet=True)
    assert "The room's server (job 88) is still loading the model (loading weights: 3/8 shards" in str(err.value)
    assert "llmlab status --wait" in str(err.value) and "\n" not in str(err.value)


@needs_slurm
def test_a_plain_sbatch_jobs_output_is_private_from_its_creation(slurm_env, tmp_path):
    """``sbatch slurm/llmlab-tiny-cpu.sh`` from a umask 022 shell (LLMLAB_DRY_RUN: the job prints its plan and
    ends): slurmstepd made ``%x-%j.out`` 0644 in the submit folder before the script's umask 077 ran; now nothing
    lands there, and the job's output is the launcher's own 0600 file in LLMLAB_HOME/logs."""
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    res = subprocess.run(["bash", "-c", 'umask 022; exec sbatch --parsable "$0"', str(SLURM / f"{CPU_JOB}.sh")],
                         capture_output=True, text=True, cwd=submit_dir, timeout=60,
                         env={**slurm_env, "LLMLAB_DRY_RUN": "1"})
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    out = Path(os.environ["LLMLAB_HOME"]) / "logs" / f"llmlab-{job_id}.out"
    wait_for(lambda: job_state(slurm_env, job_id)[0] not in {"PENDING", "RUNNING", "COMPLETING", "CONFIGURING"},
             300, f"job {job_id} to end")
    assert list(submit_dir.iterdir()) == []
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and "vLLM:" in out.read_text()


# --------------------------------------------------------------------------------------------------
# Backend "mp" (security review 2, finding 7): the head holds its master port before any worker dials it
# --------------------------------------------------------------------------------------------------

FAKE_VLLM = r'''
import os, socket, subprocess, sys, time
port = int(sys.argv[sys.argv.index("--master-port") + 1])
listen = ("import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind(('', int(sys.argv[1]))); s.listen(); open(sys.argv[2], 'a').write(sys.argv[3] + '\\n'); "
          "time.sleep(120)")
events = os.environ["FAKE_EVENTS"]
if os.environ["FAKE_MODE"] == "squatted":  # another user takes the port first: a process outside vLLM's group
    subprocess.Popen([sys.executable, "-c", listen, str(port), events, "squatter listens"], start_new_session=True)
else:  # vLLM's rank-0 worker, a child in vLLM's process group, binds it as torch's TCPStore does (*:PORT)
    subprocess.Popen([sys.executable, "-c", listen, str(port), events, "head listens"])
time.sleep(120)
'''


def mp_launcher(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The launcher itself on a two-node mp job, without SLURM: ``srun`` is a stand-in that records its call and
    exits, and vLLM a stand-in whose rank-0 worker listens on the master port (or a squatter does, ``mode``)."""
    bin_dir, events = tmp_path / "bin", tmp_path / "events"
    bin_dir.mkdir()
    (tmp_path / "fake_vllm.py").write_text(FAKE_VLLM)
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*" >>"$FAKE_EVENTS"\n')
    (bin_dir / "python").write_text(f'#!/bin/bash\nfor a in "$@"; do [[ $a == vllm.entrypoints.* ]] && '
                                    f'exec {sys.executable} {tmp_path / "fake_vllm.py"} "$@"; done\n'
                                    f'exec {sys.executable} "$@"\n')
    for name in ("srun", "python"):
        (bin_dir / name).chmod(0o755)
    settings = tmp_path / "models.toml"
    settings.write_text('["mp2"]\nmodel = "llmlab-tiny"\nengine = "cpu"\nnodes = 2\ngpus_per_node = 0\n'
                        'tp = 1\npp = 2\nbackend = "mp"\nready_timeout = 20\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", LLMLAB_PYTHON=str(bin_dir / "python"),
               LLMLAB_HOME=str(tmp_path / "home"), LLMLAB_SETTINGS_FILE=str(settings), SLURM_JOB_ID="4711",
               LLMLAB_NODES="node1 node2",
               LLMLAB_STOP_GRACE="3", FAKE_MODE=mode, FAKE_EVENTS=str(events))
    job = subprocess.run(["bash", str(SLURM / "llmlab-serve.sh"), "mp2"], capture_output=True, text=True, env=env,
                         timeout=180, start_new_session=True)
    return job, events


def test_mp_headless_workers_are_started_only_after_the_head_holds_the_master_port(tmp_path):
    """Before, the launcher `srun`ed the headless workers first, then the head: whoever listened on the master port
    in between received the workers' connections.  Now the head's own vLLM listens there first."""
    job, events = mp_launcher(tmp_path, "good")
    text = job.stdout + job.stderr
    lines = events.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["head", "srun"], text + "\n".join(lines)
    assert "-w node2" in lines[1] and "held by the head's own vLLM: starting the headless workers" in text


def test_mp_job_fails_fast_when_another_process_holds_the_master_port(tmp_path):
    t0 = time.monotonic()
    job, events = mp_launcher(tmp_path, "squatted")
    text = job.stdout + job.stderr
    assert job.returncode != 0 and time.monotonic() - t0 < 60, text
    assert events.read_text().splitlines() == ["squatter listens"], "a headless worker was started"
    port = re.search(r"listens on the master port (\d+)", text)
    assert port and f"FAILED: another process, not this job's vLLM, listens on the master port {port[1]}: the " \
                    "headless workers were not started" in text, text
