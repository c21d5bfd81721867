"""The SLURM launcher (slurm/) and llmlab.cluster.

Two kinds of tests:
- pure ones (settings, rendering, parsing, the GPU jobs' commands checked against llmlab.memory's planner):
  they run the job scripts in dry-run mode with bash and need no SLURM;
- CPU-mode jobs under a real slurmctld + two slurmd on this machine (tests/slurm_testbed.py): a server
  that comes up over Ray on 2 nodes, answers with its key, refuses without it, and leaves nothing behind
  after scancel; and a job whose Ray worker cannot start, which must fail fast with the reason.
  They are skipped, with the reason, only where the SLURM binaries (or root, for slurmd) are missing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import slurm_testbed

import llmlab
from llmlab import cluster, memory
from llmlab.ops import launcher
from llmlab.serve.info import read_key, servers_dir
from llmlab.serve.proc import free_port

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


# --------------------------------------------------------------------------------------------------
# Settings and job scripts: one source
# --------------------------------------------------------------------------------------------------

def test_every_job_script_has_settings_and_agrees_with_them():
    jobs = cluster.load_settings()
    scripts = {p.stem for p in SLURM.glob("*.sh")} - {"llmlab-serve"}
    assert scripts == set(jobs), "each slurm/<job>.sh needs a [<job>] table in models.toml, and back"
    for name, job in jobs.items():
        path = SLURM / f"{name}.sh"
        d = sbatch_directives(path)
        assert int(d["nodes"]) == job.nodes, f"{path}: --nodes differs from models.toml"
        assert int(d.get("gpus-per-node", 0)) == job.gpus_per_node, f"{path}: --gpus-per-node differs"
        assert d["ntasks-per-node"] == "1"
        assert "partition" not in d and "account" not in d, "partition/account come from sbatch flags or SBATCH_*"
        assert path.read_text().rstrip().endswith(f'exec bash "$here/llmlab-serve.sh" {name}')


def test_shipped_jobs_are_the_issue_layouts():
    jobs = cluster.load_settings()
    layouts = {n: (j.nodes, j.gpus_per_node, j.tp, j.pp) for n, j in jobs.items()}
    assert layouts == {"llama3.1-8b": (1, 1, 1, 1), "llama3.1-70b": (1, 4, 4, 1), "llama3.1-405b-fp8": (1, 8, 8, 1),
                       "llama3.1-405b": (2, 8, 8, 2), "llama3.1-405b-tp16": (2, 8, 16, 1),
                       "gpt-oss-120b": (1, 1, 1, 1), "qwen3-30b-a3b": (1, 1, 1, 1),
                       CPU_JOB: (2, 0, 1, 1), "llmlab-wide-cpu": (2, 0, 1, 1)}
    assert jobs["llmlab-wide-cpu"].model.endswith("tests/fixtures/llmlab-wide")  # resolved against models.toml


@pytest.mark.parametrize("name", GPU_JOBS)
def test_gpu_job_renders_the_planner_command_and_ray_layout(name):
    """The job script, run for real in dry-run mode, prints the vllm serve line and Ray layout that
    llmlab.memory's planner gives for its settings, and the layout holds the weights and a full-context request."""
    job = cluster.job_settings(name)
    out = dry_run(name)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    serve = next(line for line in text.splitlines() if line.startswith("vLLM:")).split(None, 1)[1]
    planner_line, _ = memory.serve_command(job.model, tp=job.tp, pp=job.pp, max_model_len=job.context,
                                           dtype=job.dtype, gpu_memory_utilization=job.gpu_memory_utilization)
    argv = shlex.split(serve)
    assert argv[:3] == shlex.split(planner_line)[:3]  # vllm serve <the model's HF id>
    flags = argv[3:]
    # every flag of the planner's line, in its order, then name, host and port
    planned = shlex.split(planner_line)[3:]
    assert flags[: len(planned)] == planned
    assert flags[flags.index("--served-model-name") + 1] == name
    assert flags[flags.index("--tensor-parallel-size") + 1] == str(job.tp)
    assert ("--pipeline-parallel-size" in flags) == (job.pp > 1)
    assert ("--distributed-executor-backend" in flags) == (job.nodes > 1)
    heads = [line for line in text.splitlines() if line.startswith("Ray head:")]
    workers = [line for line in text.splitlines() if line.startswith("Ray worker:")]
    if job.nodes == 1:
        assert not heads and not workers and "Ray: not needed" in text
    else:
        assert len(heads) == 1 and "-w node1 ray start --head" in heads[0]
        assert [w.split("-w ")[1].split()[0] for w in workers] == [f"node{i}" for i in range(2, job.nodes + 1)]
        assert all(f"--num-gpus={job.gpus_per_node}" in line for line in heads + workers)
        assert f"Ray wait:   {job.nodes} nodes, {job.gpus} GPUs" in text
    report = cluster.layout_report(job)
    assert report["fits"], f"{name}: the layout does not hold one {job.context}-token request: {report}"
    if name != "llama3.1-405b-tp16":
        assert (report["planner"]["tp"], report["planner"]["pp"]) == (job.tp, job.pp), report
    else:  # the planner keeps TP inside a node; TP=16 is the InfiniBand variant of the same 16 GPUs
        assert report["tp_crosses_nodes"] and report["planner"]["gpus"] == job.gpus


def test_dry_run_takes_model_dir_cache_and_extra_args_from_the_environment(tmp_path):
    out = dry_run("llama3.1-70b", LLMLAB_MODEL_DIR="/models", LLMLAB_CACHE_DIR=str(tmp_path),
                  LLMLAB_EXTRA_VLLM_ARGS="--enable-chunked-prefill --override-generation-config '{\"a\": 1}'",
                  LLMLAB_MAX_MODEL_LEN="8192")
    assert out.returncode == 0, out.stderr
    serve = next(line for line in out.stdout.splitlines() if line.startswith("vLLM:")).split(None, 1)[1]
    argv = shlex.split(serve)
    assert argv[2] == "/models/Llama-3.1-70B-Instruct"
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[-3:] == ["--enable-chunked-prefill", "--override-generation-config", '{"a": 1}']
    assert f"HF_HOME={tmp_path}/huggingface" in out.stdout
    assert "NCCL_" not in out.stdout  # InfiniBand knobs are opt-in
    ib = dry_run("llama3.1-405b-tp16", LLMLAB_NCCL_IB="1", NCCL_IB_HCA="mlx5_0")
    assert "NCCL_IB_DISABLE=0" in ib.stdout and "NCCL_IB_HCA=mlx5_0" in ib.stdout


def test_launcher_outside_slurm_says_to_use_sbatch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SLURM / "llmlab-serve.sh"), "llama3.1-8b"], capture_output=True, text=True,
                         env={**env, "LLMLAB_PYTHON": sys.executable}, timeout=60)
    assert out.returncode == 1 and "not inside a SLURM job: submit a job script with sbatch" in out.stdout


def test_wrong_node_count_and_unknown_job_are_one_sentence():
    out = dry_run("llama3.1-405b", LLMLAB_NODES="gpu01")
    assert out.returncode == 1 and "needs 2 node(s) but the job has 1 (gpu01): submit it with --nodes=2" in out.stderr
    env = {**os.environ, "LLMLAB_DRY_RUN": "1", "LLMLAB_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(SLURM / "llmlab-serve.sh"), "llama9"], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "No job 'llama9'" in out.stderr and "llama3.1-70b" in out.stderr


def test_bad_settings_are_named(tmp_path):
    bad = tmp_path / "models.toml"
    bad.write_text('["x"]\nmodel = "llama3.1-70b"\nnodes = 1\ngpus_per_node = 4\ntp = 8\npp = 1\n')
    with pytest.raises(cluster.SettingsError, match=r"\[x\]: TP=8 x PP=1 = 8 GPUs, but the job has 1 node"):
        cluster.load_settings(bad)
    bad.write_text('["x"]\nmodel = "llama3.1-70b"\nnodes = 1\ngpus_per_node = 4\ntp = 4\npp = 1\ngpus = 3\n')
    with pytest.raises(cluster.SettingsError, match="unknown key"):
        cluster.load_settings(bad)
    bad.write_text('["x"]\nmodel = "llama3.1-70b"\nnodes = 1\ngpus_per_node = 3\ntp = 3\npp = 1\n')
    with pytest.raises(cluster.SettingsError, match="do not divide into 3"):
        cluster.load_settings(bad)


def test_backend_mp_runs_vllm_on_every_node_without_ray(tmp_path):
    """`backend = "mp"` (llmlab launch --backend mp): no Ray; the head's vllm serve gets --nnodes and node rank 0,
    every other node a headless vllm serve of its own rank through srun, all meeting at the head's port."""
    settings = tmp_path / "models.toml"
    settings.write_text('["405b-mp"]\nmodel = "llama3.1-405b"\nnodes = 2\ngpus_per_node = 8\ntp = 8\npp = 2\n'
                        'backend = "mp"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(LLMLAB_DRY_RUN="1", LLMLAB_PYTHON=sys.executable, LLMLAB_SETTINGS_FILE=str(settings),
               LLMLAB_RAY_HEAD_IP="10.1.2.3", LLMLAB_NODES="gpu-a gpu-b")
    out = subprocess.run(["bash", str(SLURM / "llmlab-serve.sh"), "405b-mp"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ray head:" not in out.stdout and "RAY_ADDRESS" not in out.stdout and "no Ray: vLLM's own" in out.stdout
    head = shlex.split(line_of(out.stdout, "vLLM:").removeprefix("vLLM:"))
    node = shlex.split(line_of(out.stdout, "vLLM node:").split("-w ", 1)[1])
    port = head[head.index("--master-port") + 1]
    for argv, rank in ((head, "0"), (node, "1")):
        flag = {name: argv[argv.index(name) + 1] for name in ("--distributed-executor-backend", "--nnodes",
                                                               "--node-rank", "--master-addr", "--master-port")}
        assert list(flag.values()) == ["mp", "2", rank, "10.1.2.3", port], flag
    assert node[0] == "gpu-b" and node[-1] == "--headless" and "--uds" not in node and "--uds" in head
    assert node[3:6] == ["vllm.entrypoints.cli.main", "serve", "meta-llama/Llama-3.1-405B-Instruct"]

    settings.write_text('["x"]\nmodel = "llama3.1-70b"\nnodes = 2\ngpus_per_node = 4\ntp = 4\npp = 2\n'
                        'backend = "mpi"\n')
    with pytest.raises(cluster.SettingsError, match=r"\[x\]: backend must be 'ray' .* or 'mp'"):
        cluster.load_settings(settings)


def line_of(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_rendered_shell_survives_quotes_and_spaces():
    """The launcher evals the renderer's output: every value must come back exactly."""
    env = {"LLMLAB_EXTRA_VLLM_ARGS": "--chat-template '/a dir/t.jinja' --x \"$(touch /tmp/pwned)\" ;ls",
           "LLMLAB_RAY_HEAD_IP": "10.1.2.3"}
    r = launcher.render("llama3.1-405b", job_id="77", nodes=["gpu-a", "gpu-b"], port=9000, env=env)
    script = r.shell() + 'printf "%s\\n" "${serve_argv[@]}"; echo ---; eval "w=(${ray_worker_cmds[0]})"; ' \
                         'printf "%s\\n" "${w[@]}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    argv, worker = out.split("---\n")
    assert argv.splitlines() == r.argv
    assert "/a dir/t.jinja" in argv.splitlines() and '$(touch /tmp/pwned)' in argv.splitlines()
    assert worker.splitlines() == r.ray.worker_command(1)
    assert not Path("/tmp/pwned").exists()


def test_ray_ports_are_disjoint_per_node_and_outside_ephemeral_range():
    r = launcher.render("llama3.1-405b", job_id="12345", nodes=["a", "b"], port=9000, env={"LLMLAB_RAY_HEAD_IP": "x"})
    ports = []
    for cmd in [r.ray.head_command(), r.ray.worker_command(1)]:
        lo = hi = None
        for arg in cmd:
            m = re.match(r"--([\w-]+)=(\d+)$", arg)
            if m and m[1].endswith("port") and "worker-port" not in m[1]:
                ports.append(int(m[2]))
            lo = int(arg.split("=")[1]) if arg.startswith("--min-worker-port") else lo
            hi = int(arg.split("=")[1]) if arg.startswith("--max-worker-port") else hi
        ports += range(lo, hi + 1)
    assert len(ports) == len(set(ports)), "two Ray components of one job share a port"
    assert max(ports) < 32768 and min(ports) >= 20000
    other = launcher.render("llama3.1-405b", job_id="12346", nodes=["a", "b"], port=9000,
                           env={"LLMLAB_RAY_HEAD_IP": "x"})
    assert other.ray.port_base != r.ray.port_base


# --------------------------------------------------------------------------------------------------
# Parsing: ray status, vLLM's load progress
# --------------------------------------------------------------------------------------------------

RAY_STATUS = """======== Autoscaler status: 2026-11-22 18:04:08.340433 ========
Node status
---------------------------------------------------------------
Active:
 1 node_9acade65f5d4df9f3086c15921d9d9e747b266f1eed056faa7791b64
 1 node_e90dc91e8abb2b69662af47814c88ef95acac282a203624b855b3e79
Pending:
 (no pending nodes)
Recent failures:
 (no failures)

Resources
---------------------------------------------------------------
Total Usage:
 0.0/4.0 CPU
 0.0/16.0 GPU
 0B/30.68GiB memory
 0B/13.15GiB object_store_memory
"""


def test_parse_ray_status():
    assert launcher.parse_ray_status(RAY_STATUS) == (2, 16.0)
    assert launcher.parse_ray_status(RAY_STATUS.replace(" 0.0/16.0 GPU\n", "")) == (2, 0.0)
    assert launcher.parse_ray_status("") == (0, 0.0)


def test_wait_for_ray_times_out_with_the_numbers(tmp_path, capsys):
    fake = tmp_path / "ray"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n" + RAY_STATUS.replace(" 1 node_e90", " 0 node_e90") + "EOF\n")
    fake.chmod(0o755)
    log = tmp_path / "ray-node1.log"
    log.write_text("... Ray runtime started.\n")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        ok = launcher.wait_for_ray("127.0.0.1:1", 2, 16, timeout=0.5, poll=0.2, ray_bin=str(fake),
                                  steps={"node1": (sleeper.pid, str(log))})
        assert not ok
        out = capsys.readouterr().out
        assert "Ray started on node1" in out and "Ray incomplete after" in out and "FAILED" not in out
        assert "ray status shows 1/2 nodes and 16/16 GPUs" in out and "LLMLAB_RAY_TIMEOUT" in out
        # a node that never says "Ray runtime started" is named
        ok = launcher.wait_for_ray("127.0.0.1:1", 2, 16, timeout=0.5, ray_bin=str(fake),
                                  steps={"node2": (sleeper.pid, str(tmp_path / "none.log"))})
        assert not ok and "Ray has not started on node2" in capsys.readouterr().out
    finally:
        sleeper.kill()


def test_wait_for_ray_fails_at_once_when_a_step_exits(tmp_path, capsys):
    log = tmp_path / "ray-node2.log"
    log.write_text("Error: No such option: --bogus\n")
    done = subprocess.Popen(["true"])
    done.wait()
    start = time.monotonic()
    ok = launcher.wait_for_ray("127.0.0.1:1", 2, 0, timeout=60, ray_bin="/bin/false",
                              steps={"node2": (done.pid, str(log))})
    assert not ok and time.monotonic() - start < 5
    out = capsys.readouterr().out  # the helper reports; the launcher decides whether that fails the job
    assert "Ray on node2 exited" in out and "FAILED" not in out


def test_raylet_failure_quotes_the_fatal_line_of_the_current_session(tmp_path):
    for name, line in [("session_old", "Check failed: an older attempt"),
                       ("session_new", "Check failed: Timed out waiting for file .../dashboard_agent_listen_port")]:
        (tmp_path / name / "logs").mkdir(parents=True)
        (tmp_path / name / "logs" / "raylet.out").write_text(f"[2026-11-22 C 1 1] (raylet) node_manager.cc:1: {line}\n")
    (tmp_path / "session_latest").symlink_to(tmp_path / "session_new")
    assert launcher.raylet_failure(str(tmp_path)).endswith("dashboard_agent_listen_port")
    assert launcher.raylet_failure(str(tmp_path / "none")) is None


LOG_405B = ("INFO ... non-default args: {'model': 'meta-llama/Llama-3.1-405B-Instruct'}\n"
            "INFO ... Resolved architecture: LlamaForCausalLM\n"
            "Loading safetensors checkpoint shards:   0% Completed | 0/191 [00:00<?, ?it/s]\r"
            "Loading safetensors checkpoint shards:   1% Completed | 2/191 [00:09<15:58,  5.07s/it]\r"
            "Loading safetensors checkpoint shards:  23% Completed | 44/191 [05:10<17:18,  7.06s/it]\r")


def test_load_progress_reads_the_shard_bar():
    p = cluster.load_progress(LOG_405B)
    assert (p.phase, p.shards_done, p.shards_total, p.elapsed, p.eta) == ("loading weights", 44, 191, "05:10", "17:18")
    assert str(p) == "loading weights: 44/191 shards (23%), elapsed 05:10, ETA 17:18"
    done = cluster.load_progress(LOG_405B + "\nINFO Loading weights took 1810.2 seconds\nINFO KV cache size: 1 tokens")
    assert done.phase == "KV cache allocated" and not done.ready
    assert cluster.load_progress(LOG_405B + "\nINFO:     Application startup complete.\n").ready
    assert cluster.load_progress(Path("/nonexistent/vllm.log")).phase == "waiting for the job to start vLLM"


def test_tp_vs_pp_arithmetic():
    tp8, tp16 = cluster.tp_vs_pp("llama3.1-405b", [(8, 2), (16, 1)])
    message = 16384 * 2  # hidden size x 2 bytes (bf16), one token
    assert tp8["allreduces"] == tp16["allreduces"] == 2 * 126
    assert tp8["allreduce_bytes_per_gpu"] == 2 * 7 / 8 * message
    assert tp8["tp_link"] == "NVLink" and tp16["tp_link"] == "InfiniBand"
    # per direction: NVLink's 900 GB/s counts both ways; between nodes, one 50 GB/s port per GPU, 8 per node
    assert tp8["tp_us"] == pytest.approx(252 * 2 * 7 / 8 * message / 450e9 * 1e6)
    assert tp16["tp_us"] == pytest.approx(252 * 2 * 15 / 16 * message / (8 * 50e9) * 1e6)
    assert tp8["tp_bytes_per_gpu"] == 126 * 2 * 7 / 8 * message  # a GPU of TP=8 x PP=2 holds 63 layers
    assert tp8["pp_bytes"] == message and tp16["pp_transfers"] == 0
    # with InfiniBand the two layouts cost about the same (vLLM's blog: "similar"): 14.1 vs 15.6 ms at 256 tokens
    busy = {r["layout"]: r["comm_us"] / 1e3 for r in cluster.tp_vs_pp(tokens=256, allreduce_latency_us=22.5)}
    assert busy == {"TP=8 x PP=2": pytest.approx(14.06, abs=0.01), "TP=16 x PP=1": pytest.approx(15.58, abs=0.01)}
    # without it (one 100 Gb/s Ethernet port per node) TP=16's communication is 20x TP=8 x PP=2's: PP is essential
    slow = cluster.tp_vs_pp(tokens=256, allreduce_latency_us=22.5, ib_gbps=12.5, nics_per_node=1)
    assert slow[1]["comm_us"] / slow[0]["comm_us"] > 20
    # the old reading (900 GB/s one way, one port for the whole node) is still there as parameters
    old = cluster.tp_vs_pp(tokens=256, allreduce_latency_us=22.5, nvlink_gbps=900, nics_per_node=1)
    assert [round(r["comm_us"] / 1e3) for r in old] == [10, 85]
    assert tp8["weights_gib_per_gpu"] == max(memory.weight_bytes_per_gpu("llama3.1-405b", None, 8, 2)) / 2**30


def test_servers_lists_connection_files_without_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path))
    from llmlab.serve.info import write_connection_file

    key = tmp_path / "keys" / "job-7.key"
    key.parent.mkdir()
    key.write_text("s3cret\n")
    port = free_port("127.0.0.1")  # nothing listens there
    write_connection_file(servers_dir() / "job-7.json", kind="slurm", host="127.0.0.1", port=port,
                          model="llama3.1-70b", api_key_file=key, job_id="7", nodes=["gpu01"], tp=4, pp=1)
    (servers_dir() / "job-8.json").write_text("{not json")
    rows = cluster.servers()
    good = next(r for r in rows if r.get("job_id") == "7")
    assert good["alive"] is False and good["url"] == f"http://127.0.0.1:{port}/v1" and good["tp"] == 4
    assert "s3cret" not in json.dumps(rows)
    assert any("not valid JSON" in r.get("error", "") for r in rows)
    assert cluster.connection_file_of("7") == servers_dir() / "job-7.json"
    assert cluster.job_progress("7").phase == "waiting for the job to start vLLM"


# --------------------------------------------------------------------------------------------------
# Under a real SLURM (CPU mode)
# --------------------------------------------------------------------------------------------------

needs_slurm = pytest.mark.skipif(slurm_testbed.skip_reason() is not None, reason=slurm_testbed.skip_reason() or "")


@pytest.fixture(scope="module")
def slurm_env():
    """The test bed (started if needed) and the environment a job needs: this venv first on PATH, and the
    test session's private LLMLAB_HOME (sbatch hands the submitter's environment to the job)."""
    env = slurm_testbed.ensure()
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["LLMLAB_PYTHON"] = sys.executable
    return env


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


@needs_slurm
def test_cpu_job_serves_with_its_key_and_cleans_up_after_scancel(slurm_env, tmp_path, monkeypatch):
    t0 = time.monotonic()
    job_id = submit(slurm_env, tmp_path)
    output = tmp_path / f"slurm-{job_id}.out"
    conn = servers_dir() / f"job-{job_id}.json"

    def ready():
        state, _ = job_state(slurm_env, job_id)
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} ended ({state}) before its server was ready:\n"
                                 f"{output.read_text() if output.exists() else '(no output)'}")
        return status_of(conn) == "ready"  # the file is there, "loading", from the job's first seconds

    try:
        wait_for(ready, 900, f"the connection file of job {job_id}", poll=2)
        t_ready = time.monotonic() - t0
        info = json.loads(conn.read_text())
        key = read_key(info["api_key_file"])
        assert info["kind"] == "slurm" and info["job_id"] == job_id and info["host"] == "127.0.0.1"
        assert info["model"] == CPU_JOB and info["nodes"] == ["node1", "node2"] and info["started"]
        assert stat.S_IMODE(conn.stat().st_mode) == 0o600
        assert stat.S_IMODE(Path(info["api_key_file"]).stat().st_mode) == 0o600
        text = output.read_text()
        assert "Ray: 2/2 nodes, 0/0 GPUs joined" in text and "READY: llmlab-tiny-cpu at http://127.0.0.1:" in text
        assert "client, model = llmlab.connect()" in text and f"$(cat {info['api_key_file']})" in text

        # the notebook's way: the newest connection file
        monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
        client, model = llmlab.connect(quiet=True)
        assert model == CPU_JOB
        r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=5,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        url = f"http://127.0.0.1:{info['port']}/v1/models"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 401
        assert [s for s in cluster.servers() if s.get("job_id") == job_id][0]["alive"]

        # the key is in no log and no process's arguments
        logs = [output, *cluster.job_log_dir(job_id).glob("*")]
        assert all(key not in p.read_text(errors="replace") for p in logs)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
        assert any("raylet" in p for p in job_processes(job_id)), "Ray should run on the job's nodes"
    finally:
        t1 = time.monotonic()
        subprocess.run(["scancel", job_id], env=slurm_env, check=True)
        wait_for(lambda: not conn.exists(), 60, "the connection file to go")
        t_gone = time.monotonic() - t1
        wait_for(lambda: job_state(slurm_env, job_id)[0] not in ("RUNNING", "COMPLETING", "CONFIGURING"), 90,
                 "the job to end")
        wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
        t_clean = time.monotonic() - t1
    assert not Path(info["api_key_file"]).exists()
    assert not ray_folder(job_id).parent.exists(), "Ray's per-job session files should be removed"
    text = output.read_text()
    assert "received SIGTERM (scancel or time limit): shutting down" in text
    assert "stopped; connection file and key removed" in text
    print(f"\nSLURM CPU job {job_id}: sbatch -> connection file {t_ready:.1f} s; scancel -> connection file "
          f"gone {t_gone:.1f} s, every process of the job gone {t_clean:.1f} s")


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


def test_a_log_without_any_known_line_says_the_phase_is_unknown():
    """A vLLM release whose start-up lines changed: 'phase unknown', never a stale phase, never a crash."""
    renamed = "".join(f"(EngineCore pid=7) INFO 11-23 10:00:{i:02d} [core.py:{i}] a line llmlab does not know\n"
                      for i in range(cluster.UNKNOWN_AFTER + 1))
    assert cluster.load_progress(renamed).phase.startswith("phase unknown")
    assert cluster.load_progress(renamed[:200]).phase == "importing vLLM"  # a few lines: still importing
    known = renamed + "(APIServer pid=6) INFO 11-23 10:01:00 [api_utils.py:273] non-default args: {}\n"
    assert cluster.load_progress(known).phase == "reading the model config"


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
        while "starting vLLM" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        key = home / "keys" / "job-777.key"
        assert key.exists(), out.read_text()
        job.send_signal(subprocess.signal.SIGTERM)
        while "stopping vLLM" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.send_signal(subprocess.signal.SIGTERM)  # while vLLM is being stopped
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    text = out.read_text()
    assert "stopped; connection file and key removed" in text, text
    assert not key.exists() and not list((home / "servers").glob("*.json"))


def test_the_readiness_wait_never_outlasts_the_jobs_time_limit():
    assert launcher.seconds_left("1-02:03:04") == 93784 and launcher.seconds_left("02:03:04") == 7384
    assert launcher.seconds_left("03:04") == 184 and launcher.seconds_left("UNLIMITED") is None
    assert launcher.seconds_left("") is None and launcher.seconds_left("NOT_SET") is None
    assert launcher.capped_timeout(5400, "UNLIMITED", 20) == (5400, None)
    assert launcher.capped_timeout(600, "2:00:00", 20) == (600, None)
    timeout, why = launcher.capped_timeout(5400, "30:00", 20)  # a 405B job submitted with --time=00:30:00
    assert timeout == 1800 - 20 - 30 and "time limit leaves 1800 s" in why and "--time" in why
    assert launcher.capped_timeout(5400, "00:40", 20)[0] == 0


# --------------------------------------------------------------------------------------------------
# Issue 26: Ray's folder, the "loading" connection file, the clean-up's budget, a proxy that dies
# --------------------------------------------------------------------------------------------------

def test_rays_folder_is_the_launchers_private_one_not_a_name_made_of_the_job_id():
    """Ray makes its --temp-dir and its session/sockets/logs folders 0777; /tmp/llmlab-ray-<job id> was also
    predictable.  Now the folder is ray/ inside the launcher's mktemp -d (LLMLAB_RAY_DIR), on every node."""
    env = {"LLMLAB_RAY_HEAD_IP": "10.0.0.1", "LLMLAB_RAY_DIR": "/tmp/llmlab-ray.Ab3dE9"}
    r = launcher.render("llama3.1-405b", job_id="4242", nodes=["a", "b"], port=9000, env=env)
    assert r.ray.temp_dir == "/tmp/llmlab-ray.Ab3dE9/ray"
    for cmd in (r.ray.head_command(), r.ray.worker_command(1)):
        assert [a for a in cmd if a.startswith("--temp-dir")] == ["--temp-dir=/tmp/llmlab-ray.Ab3dE9/ray"]
    assert "ray_temp_dir=/tmp/llmlab-ray.Ab3dE9/ray" in r.shell()
    shown = launcher.render("llama3.1-405b", job_id="4242", nodes=["a", "b"], port=9000,
                            env={"LLMLAB_RAY_HEAD_IP": "x", "TMPDIR": "/local"})
    assert shown.ray.temp_dir == "/local/llmlab-ray.XXXXXX/ray"  # what the launcher's mktemp makes
    with pytest.raises(cluster.SettingsError, match="too long for Ray's Unix sockets.*LLMLAB_RAY_TMPDIR"):
        launcher.render("llama3.1-405b", nodes=["a", "b"], port=9000,
                        env={"LLMLAB_RAY_HEAD_IP": "x", "LLMLAB_RAY_DIR": "/scratch/" + "x" * 40})
    dry = dry_run("llama3.1-405b")
    assert "llmlab-ray.XXXXXX/ray --block" in dry.stdout, dry.stdout


@needs_slurm
def test_cpu_job_says_loading_then_ready_and_its_clean_up_fits_in_killwait(slurm_env, tmp_path, monkeypatch):
    """While the job starts, its connection file says "loading" with the phase, and connect() says so instead of
    starting the embedded tiny model; then "ready".  Ray's folder is private; after scancel the key and the token
    are gone at once, and the clean-up ends within the test bed's KillWait (15 s; SIGKILL comes after it)."""
    from llmlab.serve import embedded

    def no_fallback(*args, **kwargs):
        raise AssertionError("connect() started the embedded tiny model while the job's server was loading")

    monkeypatch.setattr(embedded, "ensure_embedded", no_fallback)
    monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
    job_id = submit(slurm_env, tmp_path)
    output = tmp_path / f"slurm-{job_id}.out"
    conn = servers_dir() / f"job-{job_id}.json"
    keys = Path(os.environ["LLMLAB_HOME"]) / "keys"
    secrets = [keys / f"job-{job_id}.key", keys / f"ray-job-{job_id}.token"]
    seen: list[tuple[str, str]] = []

    def watch(until: str | None):
        """Record each (status, phase) the connection file goes through; done when its status is ``until``
        (None: as soon as there is a file)."""
        def look():
            state, _ = job_state(slurm_env, job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING"):
                raise AssertionError(f"job {job_id} ended ({state}):\n{output.read_text() if output.exists() else ''}")
            status = status_of(conn)
            if status:
                info = json.loads(conn.read_text())
                if not seen or seen[-1] != (status, info.get("phase")):
                    seen.append((status, info.get("phase")))
            return status is not None and (until is None or status == until)
        return look

    try:
        wait_for(watch(None), 600, f"job {job_id}'s connection file", poll=0.5)
        assert seen[0][0] == "loading", f"the first connection file said {seen[0]}, not loading"
        assert seen[0][1] == "starting Ray on 2 nodes"
        assert stat.S_IMODE(conn.stat().st_mode) == 0o600
        with pytest.raises(llmlab.ServerUnavailable) as err:
            llmlab.connect(quiet=True)
        message = str(err.value)
        assert f"SLURM job {job_id} is still loading the model" in message and "\n" not in message
        assert f"llmlab status --wait {job_id}" in message

        wait_for(lambda: "Ray cluster complete" in output.read_text(), 600, "Ray on both nodes", poll=1)
        folder = ray_folder(job_id)
        # mktemp's six random characters, not the job id (a digit of a short id may occur among them by chance)
        assert folder.name == "ray" and re.fullmatch(r"llmlab-ray\.[A-Za-z0-9]{6}", folder.parent.name), folder
        st = folder.parent.lstat()
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert (folder / "session_latest" / "sockets").is_dir()

        wait_for(watch("ready"), 900, f"job {job_id}'s server to be ready", poll=0.5)
        assert len({phase for status, phase in seen if status == "loading"}) >= 2, seen  # the phase follows the load
        client, model = llmlab.connect(quiet=True)
        assert model == CPU_JOB and json.loads(conn.read_text())["api_key_file"] == str(secrets[0])
        assert all(p.exists() for p in secrets)
    finally:
        t0 = time.monotonic()
        subprocess.run(["scancel", job_id], env=slurm_env, check=True)
        wait_for(lambda: not any(p.exists() for p in secrets), 30, "the key and the token to go", poll=0.1)
        t_secrets = time.monotonic() - t0
        wait_for(lambda: job_state(slurm_env, job_id)[0] not in ("RUNNING", "COMPLETING", "CONFIGURING"), 90,
                 "the job to end")
        wait_for(lambda: not job_processes(job_id), 60, f"job {job_id}'s processes to end")
        t_gone = time.monotonic() - t0
    text = output.read_text()
    took = re.search(r"stopped; connection file and key removed \(clean-up (\d+) s; SLURM's KillWait (\d+) s\)", text)
    assert took, text[-2000:]
    assert int(took[2]) == 15 and int(took[1]) <= 15 - 3, took[0]  # the launcher read the test bed's KillWait
    assert t_secrets < 5, f"the key and the Ray token went {t_secrets:.1f} s after scancel"
    assert not conn.exists() and not ray_folder(job_id).parent.exists()
    print(f"\nSLURM CPU job {job_id}: loading file states {[s for s, _ in seen]}; after scancel the key and the "
          f"token went in {t_secrets:.1f} s, the launcher's clean-up took {took[1]} s (KillWait 15 s), every "
          f"process of the job was gone after {t_gone:.1f} s")


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


def test_the_readiness_check_sends_the_key_only_to_the_jobs_own_proxy(tmp_path, capsys):
    """L1: the port is chosen when the job is rendered and printed in its output; if another user listens there
    first, the job's proxy cannot bind, and /health -- with the owner's key -- went to the squatter, who answered
    200 and was published as READY.  Now the key goes only to a listener that the job's proxy process holds."""
    import http.server
    import threading

    heard = []

    class Squatter(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            heard.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    squatter = http.server.HTTPServer(("127.0.0.1", 0), Squatter)
    port = squatter.server_address[1]
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    proxy = subprocess.Popen(["sleep", "60"])  # the job's proxy: alive, but it does not hold the port
    log = tmp_path / "vllm.log"
    log.write_text("")
    try:
        ok = launcher.wait_until_ready("127.0.0.1", port, os.getpid(), log, timeout=20, poll=0.2,
                                       api_key="owner-key", proxy_pid=proxy.pid, proxy_log=tmp_path / "proxy.log")
        assert ok is False and heard == [], heard
        assert f"another process listens on port {port}, not this job's proxy" in capsys.readouterr().out
        assert launcher.port_holder(port, proxy.pid) == "other" and launcher.port_holder(port, os.getpid()) == "ours"
        # the same check passes when the listener is the proxy's own (here: this process holds the socket)
        assert launcher.wait_until_ready("127.0.0.1", port, os.getpid(), log, timeout=20, poll=0.2,
                                         api_key="owner-key", proxy_pid=os.getpid())
        assert heard == ["Bearer owner-key"]
        proxy.kill()
        proxy.wait()
        assert launcher.wait_until_ready("127.0.0.1", port, os.getpid(), log, timeout=20, poll=0.2,
                                         api_key="owner-key", proxy_pid=proxy.pid) is False
        assert "the key-checking proxy (pid" in capsys.readouterr().out and len(heard) == 1
    finally:
        squatter.shutdown()
        squatter.server_close()
        if proxy.poll() is None:
            proxy.kill()


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
