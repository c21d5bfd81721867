"""The cluster CLI (llmlab.ops.jobs, ``llmlab launch | status | metrics | logs | stop | list``).

Pure tests (settings and overrides, the plan check, the rendered job script, the launcher's own dry run for
every shipped GPU model) need no SLURM.  The rest run every command against the real slurmctld + two slurmd
of tests/slurm_testbed.py with the CPU engine and the tiny model: launch -> the states in order -> a request
-> metrics -> logs -> stop -> STOPPED with nothing left; and a job whose model path is wrong -> FAILED with
that reason.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/cluster/test_jobs.py (the tests under the SLURM test bed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from slurm_helpers import (
    GPU_JOBS,
    RETRYING,
    dry_run,
    job_files,
)

from llmlab import cluster, kvcache, memory
from llmlab.ops import jobs


def llmlab_cli(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmlab", *args], capture_output=True, text=True, timeout=timeout,
                          env=env or os.environ.copy())


# --------------------------------------------------------------------------------------------------
# Settings, plan and job script (no SLURM)
# --------------------------------------------------------------------------------------------------

def test_overrides_keep_tp_inside_a_node_and_round_trip_through_the_job_script(tmp_path):
    job = cluster.settings("llama3.1-405b", tp=8, pp=2, dtype="bf16", max_model_len=8192, extra_args=["--x", "a b"])
    assert (job.nodes, job.gpus_per_node, job.tp, job.pp, job.dtype, job.max_model_len) == (2, 8, 8, 2, "bfloat16",
                                                                                             8192)
    assert job.extra_args[-2:] == ("--x", "a b")
    path = tmp_path / "settings.toml"
    path.write_text(cluster.settings_toml(job))
    assert cluster.load_settings(path)[job.name] == job  # what the job reads is exactly what was planned
    plan = cluster.prepare("llama3.1-70b", account="acct", partition="gpu", time_limit="01:00:00")
    assert "#SBATCH --account=acct\n#SBATCH --partition=gpu\n" in plan.script
    assert "#SBATCH --gpus-per-node=4\n" in plan.script and "#SBATCH --time=01:00:00\n" in plan.script
    embedded = plan.script.split("<<'LLMLAB_SETTINGS'\n", 1)[1].split("LLMLAB_SETTINGS\n", 1)[0]
    assert tomllib.loads(embedded)["llama3.1-70b"]["tp"] == 4
    assert plan.script.rstrip().endswith('exec bash "$LLMLAB_SLURM_DIR/llmlab-serve.sh" llama3.1-70b')


def test_a_value_with_a_newline_never_reaches_the_job_script(tmp_path, monkeypatch):
    """Finding 9 of security-review-2: a models.toml description with a newline rendered a shell line before the
    #SBATCH lines, and sbatch ignored every directive after it (--output included).  Every value rendered into the
    script -- the description, each #SBATCH option, --sbatch, the paths -- is refused with a control character,
    in a sentence naming the field."""
    from dataclasses import replace

    shipped = cluster.settings("llama3.1-70b")
    (tmp_path / "models.toml").write_text(cluster.settings_toml(replace(shipped, description="70B\ntouch /tmp/pwned")))
    job = cluster.load_settings(tmp_path / "models.toml")["llama3.1-70b"]
    assert job.description == "70B\ntouch /tmp/pwned"  # TOML's escape: a real newline once loaded
    with pytest.raises(cluster.JobError, match=r"^the description of job 'llama3.1-70b' \(models.toml's "
                                               r"`description`\) holds a newline \('70B\\ntouch /tmp/pwned'\): every "
                                               r"value goes on one line of the job script"):
        cluster.render_script(job, {"time": "01:00:00"})
    env = {**os.environ, "LLMLAB_SLURM_DIR": str(tmp_path), "LLMLAB_HOME": str(tmp_path / "home")}
    out = llmlab_cli("launch", "llama3.1-70b", "--dry-run", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "holds a newline" in out.stderr, out.stderr
    assert "holds a newline" not in llmlab_cli("launch", "llama3.1-70b", "--dry-run").stderr  # the shipped one
    for field, kwargs in (("#SBATCH --account", {"account": "acct\n#SBATCH --output=/tmp/x"}),
                          ("#SBATCH --partition", {"partition": "gpu\r"}),
                          ("#SBATCH --time", {"time_limit": "1:00:00\x1b[2J"}),
                          ("the --sbatch option", {"extra_sbatch": ["--mail-user=a\nrm -rf ~"]}),
                          ("the `llmlab launch` command line", {"command": "llama3.1-70b --account 'a\nb'"})):
        with pytest.raises(cluster.JobError, match=f"^{re.escape(field)} holds "):
            cluster.prepare("llama3.1-70b", **kwargs)
    with pytest.raises(cluster.JobError, match="^the Python of the job holds a newline"):
        cluster.render_script(shipped, {}, python="/usr/bin/python3\nid")
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "a\nb"))
    with pytest.raises(cluster.JobError, match="^LLMLAB_HOME holds a newline"):
        cluster.render_script(shipped, {})


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


def test_launch_of_backend_mp_says_in_one_sentence_what_it_exposes_and_that_ray_is_the_default():
    """Finding 7: mp's exposure was a note in the job's output only, after the job had started, and it understated
    it.  Now `llmlab launch` and its dry run say it before anything is submitted; mp stays available."""
    from llmlab.cluster.render import MP_EXPOSURE

    out = llmlab_cli("launch", "llama3.1-405b", "--backend", "mp", "--dry-run",
                     env={**os.environ, "LLMLAB_MP_ACCEPT_EXPOSURE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(MP_EXPOSURE) == 1 and "--distributed-executor-backend mp" in out.stdout
    assert MP_EXPOSURE.count(". ") == 0 and "pickled scheduler outputs, prompt token ids included" in MP_EXPOSURE
    assert "Ray, token-authenticated, is the default" in MP_EXPOSURE
    assert "backend mp on a shared cluster" not in llmlab_cli("launch", "llama3.1-405b", "--dry-run").stdout


def test_an_mp_job_across_nodes_on_a_public_address_starts_only_when_the_instructor_accepts_it():
    """F11 of security-review-3: without LLMLAB_HOST_IFACE, a multi-node mp job bound vLLM's unauthenticated queues
    (pickled prompts) on each node's public address, and only a warning said so.  Now the job, and its dry run,
    fail before anything starts with one sentence naming the ways out (the nodes' private interface, or
    LLMLAB_MP_ACCEPT_EXPOSURE=1, or Ray); with either it starts as before."""
    launch = ("launch", "llama3.1-405b", "--backend", "mp", "--dry-run")
    env = {k: v for k, v in os.environ.items() if k not in ("LLMLAB_HOST_IFACE", "LLMLAB_MP_ACCEPT_EXPOSURE")}
    exposed = llmlab_cli(*launch, env=env)
    said = exposed.stdout + exposed.stderr
    assert exposed.returncode != 0 and "--distributed-executor-backend mp" not in exposed.stdout, said
    assert "set LLMLAB_HOST_IFACE to the nodes' private interface" in said, said
    assert "LLMLAB_MP_ACCEPT_EXPOSURE=1 where a firewall keeps other users off the nodes" in said
    for way in ({"LLMLAB_HOST_IFACE": "ib0"}, {"LLMLAB_MP_ACCEPT_EXPOSURE": "1"}):
        out = llmlab_cli(*launch, env={**env, **way})
        assert out.returncode == 0 and "--distributed-executor-backend mp" in out.stdout, out.stdout + out.stderr


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


@pytest.mark.parametrize("output, vllm_log, reason", [
    ("[llmlab 10:00:00] FAILED: vLLM exited while starting. Last lines of x/vllm.log:\n",
     "ERROR [core.py] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n", "out of memory"),
    ("[llmlab 10:00:00] FAILED: Ray did not start on every node in 3 attempt(s) (the lines above say why)\n", "",
     "Ray did not come up on every node"),
    ("[llmlab 10:00:00] FAILED: vLLM exited while starting.\n",
     "api_server.py: error: unrecognized arguments: --bogus\n", "vLLM rejected an argument"),
    ("[llmlab 10:00:00] READY: m at http://h:1/v1\n[llmlab 11:00:00] FAILED: vLLM exited on its own (code 1). Last "
     "lines of x:\n", "INFO ... Application startup complete.\n", "vLLM exited after it was ready"),
    ("[llmlab 10:00:00] READY: m at http://h:1/v1\n[llmlab 11:00:00] FAILED: vLLM exited on its own (code 1). Last "
     "lines of x:\n", "(APIServer pid=7) WARNING 11-29 [core_client.py:818] [shutdown] MPClient: engine core exited "
     "unexpectedly; starting cleanup\n", "vLLM's engine core was killed from outside"),
    ("[llmlab 10:00:00] FAILED: vLLM exited while starting.\n",  # vLLM 0.32's words (lesson 19 makes it live)
     "  Value error, Total number of attention heads (64) must be divisible by tensor parallel size (6). "
     "[type=value_error]\n", "the tensor-parallel size does not divide the model's attention heads"),
    ("[llmlab 10:00:00] vLLM: loading weights\n", "ERROR something\n", None),
])
def test_failure_reasons_from_the_launchers_output(output, vllm_log, reason):
    found = jobs.failure(output, vllm_log)
    if reason is None:
        assert found is None  # no FAILED line from the launcher: not failed, whatever vLLM logged
    else:
        assert found[0].startswith(reason), found
        assert "Last lines of" not in found[0]


GPU_LOGS = Path(__file__).parents[1] / "fixtures"


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




def test_a_ray_attempt_that_is_retried_is_not_a_failed_job(tmp_path, monkeypatch):
    """CI saw `llmlab status` say FAILED (and `--wait` give up) while the launcher was about to try Ray again."""
    st = jobs.status(job_files(tmp_path, monkeypatch, RETRYING))
    assert st.state == "STARTING", str(st)
    gave_up = RETRYING + "[llmlab 12:55:40] FAILED: Ray did not start on every node in 3 attempt(s) (see above)\n"
    st = jobs.status(job_files(tmp_path, monkeypatch, gave_up))
    assert st.state == "FAILED" and st.reason.startswith("Ray did not come up on every node"), str(st)
