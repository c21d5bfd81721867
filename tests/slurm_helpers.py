"""Helpers of the SLURM tests (tests/cluster, and the dry runs of tests/unit): the job scripts run in dry-run mode,
jobs submitted to the test bed (tests/slurm_testbed.py), and what is left of them after."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_testbed

from llmlab import cluster
from llmlab.ops import jobs

ROOT = Path(__file__).resolve().parent.parent


SLURM = ROOT / "slurm"


GPU_JOBS = [name for name, job in cluster.load_settings().items() if job.engine == "gpu"]


CPU_JOB = "llmlab-tiny-cpu"


def dry_run(name: str, **env) -> subprocess.CompletedProcess:
    """``LLMLAB_DRY_RUN=1 bash slurm/NAME.sh``: what the job would run, without SLURM."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(LLMLAB_DRY_RUN="1", LLMLAB_PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(SLURM / f"{name}.sh")], capture_output=True, text=True, env=full, timeout=120)


def sbatch_directives(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line)
        if m:
            out[m[1]] = m[2]
    return out


def line_of(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


needs_slurm = pytest.mark.skipif(slurm_testbed.skip_reason() is not None, reason=slurm_testbed.skip_reason() or "")


def submit(env: dict, out_dir: Path, **extra) -> str:
    res = subprocess.run(["sbatch", "--parsable", f"--output={out_dir}/slurm-%j.out", str(SLURM / f"{CPU_JOB}.sh")],
                         capture_output=True, text=True, env={**env, **extra}, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0]


def job_state(env: dict, job_id: str) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\S+)", out)
    return (state[1] if state else "GONE"), (code[1] if code else "")


def job_processes(job_id: str) -> list[str]:
    """Processes that SLURM started for this job (their environment carries SLURM_JOB_ID)."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:150]
                found.append(f"{pid}: {args.decode(errors='replace')}")
        except OSError:
            continue
    return found


def status_of(conn: Path) -> str | None:
    """The connection file's status ("loading", "ready"), or None while there is none."""
    try:
        return json.loads(conn.read_text()).get("status") or "(none)"
    except (OSError, ValueError):
        return None


def ray_folder(job_id: str) -> Path:
    """Ray's --temp-dir of a job, as its launcher rendered it (~/.llmlab/logs/job-ID/rendered.sh)."""
    rendered = (cluster.job_log_dir(job_id) / "rendered.sh").read_text()
    return Path(shlex.split(re.search(r"^ray_temp_dir=(.*)$", rendered, re.M)[1])[0])


def wait_for(predicate, timeout: float, what: str, poll: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# A job that needed a second attempt at Ray, as its output says it (the launcher's lines)
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
