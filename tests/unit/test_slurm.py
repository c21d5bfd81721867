"""The SLURM launcher (slurm/) and llmlab.cluster.

Two kinds of tests:
- pure ones (settings, rendering, parsing, the GPU jobs' commands checked against llmlab.memory's planner):
  they run the job scripts in dry-run mode with bash and need no SLURM;
- CPU-mode jobs under a real slurmctld + two slurmd on this machine (tests/slurm_testbed.py): a server
  that comes up over Ray on 2 nodes, answers with its key, refuses without it, and leaves nothing behind
  after scancel; and a job whose Ray worker cannot start, which must fail fast with the reason.
  They are skipped, with the reason, only where the SLURM binaries (or root, for slurmd) are missing.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/cluster/test_slurm.py (the tests under the SLURM test bed).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import (
    CPU_JOB,
    GPU_JOBS,
    SLURM,
    dry_run,
    line_of,
    sbatch_directives,
)

from llmlab import cluster, memory
from llmlab.cluster.render import MP_PORTS
from llmlab.ops import launcher
from llmlab.serve import vllm
from llmlab.serve.info import new_key_file, servers_dir
from llmlab.serve.proc import free_port

# --------------------------------------------------------------------------------------------------
# Settings and job scripts: one source
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", GPU_JOBS)
def test_every_gpu_job_passes_the_installed_vllms_own_checks_of_its_flags_and_quantization(name):
    """What a GPU job hands vLLM, checked by the installed vLLM as far as its CPU build can: the rendered flags
    through vLLM's own argument parser (an unknown or misspelt flag fails here, not on a cluster), and the
    checkpoint's quantization method against vLLM's known and deprecated methods.  vLLM refuses a deprecated method
    at start unless ``--allow-deprecated-quantization`` is given: Meta's 405B FP8 checkpoint (``fbgemm_fp8``) did
    so on four H200s (vLLM 0.26) while no test ran this check; the next deprecation fails CI, not a workshop."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.model_executor.layers.quantization import DEPRECATED_QUANTIZATION_METHODS, QUANTIZATION_METHODS
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    job = cluster.render(name)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", job.model_path, *job.flags])
    settings = cluster.job_settings(name)
    method = args.quantization or memory.model_spec(settings.model).quant_method
    if method is None:
        return
    assert method in QUANTIZATION_METHODS, f"{name}: vLLM knows no quantization method {method!r}"
    if method in DEPRECATED_QUANTIZATION_METHODS:
        assert args.allow_deprecated_quantization, (
            f"{name}: vLLM refuses {method!r} (deprecated) unless the job passes --allow-deprecated-quantization")


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


def test_a_cache_folder_others_can_change_is_refused_before_anything_starts(tmp_path):
    """LLMLAB_CACHE_DIR gets the stage folder's rule (security-review-3, "the same rule for the cache folder"): vLLM
    runs the compiled code of its cache and serves the Hugging Face cache's weights and chat template, and a folder
    another user can write, or owns, let them choose both.  The job (and its dry run) now fails before anything
    starts, naming the folder and the fix; a folder of the user's own is used, a missing one made 0700."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    out = dry_run("llama3.1-70b", LLMLAB_CACHE_DIR=str(shared / "cache"))
    assert out.returncode != 0 and "vLLM:" not in out.stdout and not (shared / "cache").exists()
    why = "(root's) can be changed by others" if os.geteuid() == 0 else "can be written by its group or others"
    assert f"Cannot use {shared / 'cache'} as LLMLAB_CACHE_DIR: {shared} {why}" in out.stderr, out.stderr
    assert "Set LLMLAB_CACHE_DIR to a folder only you can write" in out.stderr
    if os.geteuid() == 0:  # a folder another user made first
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        out = dry_run("llama3.1-70b", LLMLAB_CACHE_DIR=str(theirs))
        assert out.returncode != 0 and re.search(r"belongs to (user nobody|uid 65534)", out.stderr), out.stderr
    mine = tmp_path / "mine" / "cache"
    out = dry_run("llama3.1-70b", LLMLAB_CACHE_DIR=str(mine))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700 and f"HF_HOME={mine}/huggingface" in out.stdout


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
               LLMLAB_RAY_HEAD_IP="10.1.2.3", LLMLAB_NODES="gpu-a gpu-b", LLMLAB_MP_ACCEPT_EXPOSURE="1")
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
    shown = out.stdout.index  # the head first; the workers once it holds its master port
    assert shown("vLLM:") < shown(f"then, once the head's vLLM holds port {port}:") < shown("vLLM node:")
    vllm_argv = node[node.index("--") + 1:]
    assert vllm_argv[2:5] == ["vllm.entrypoints.cli.main", "serve", "meta-llama/Llama-3.1-405B-Instruct"]

    settings.write_text('["x"]\nmodel = "llama3.1-70b"\nnodes = 2\ngpus_per_node = 4\ntp = 4\npp = 2\n'
                        'backend = "mpi"\n')
    with pytest.raises(cluster.SettingsError, match=r"\[x\]: backend must be 'ray' .* or 'mp'"):
        cluster.load_settings(settings)


MP_ENV = {"LLMLAB_RAY_HEAD_IP": "10.1.2.3"}


def mp_job():
    return cluster.JobSettings(**{**cluster.job_settings("llama3.1-405b").as_dict(), "backend": "mp"})


def test_mp_master_port_is_drawn_at_random_not_derived_from_the_public_job_id():
    """Finding 7: the master port was 20000 + (job id % 6) * 2000, the job id is public (squeue), and the headless
    workers connect to whoever listens there.  Now it is drawn with secrets from a documented range, per job."""
    ports = [cluster.render(mp_job(), job_id="12345", nodes=["a", "b"], env=MP_ENV).mp_port for _ in range(6)]
    assert len(set(ports)) > 1, ports  # the same job id, different ports
    lo, hi = MP_PORTS
    assert all(lo <= p <= hi for p in ports) and hi < 32768  # below Linux's ephemeral range
    r = cluster.render(mp_job(), job_id="12345", nodes=["a", "b"], env=MP_ENV)
    assert r.flags[r.flags.index("--master-port") + 1] == str(r.mp_port) and r.mp_master == f"10.1.2.3:{r.mp_port}"
    assert f"mp_port={r.mp_port}" in r.shell().splitlines()
    assert all(w[w.index("--master-port") + 1] == str(r.mp_port) for w in r.mp_workers)


def test_mp_master_port_is_drawn_again_when_taken_and_the_range_is_an_admins_choice():
    from llmlab.cluster.render import choose_mp_port

    taken = {20001, 20002}
    drawn = iter([20001, 20002, 20003])

    class Rng:
        def randint(self, lo, hi):
            assert (lo, hi) == (20001, 20003)
            return next(drawn)

    assert choose_mp_port({"LLMLAB_MP_PORTS": "20001-20003"}, lambda p: p not in taken, Rng()) == 20003
    with pytest.raises(cluster.SettingsError, match=r"No free port .* drawn from 20001-20001 .* LLMLAB_MP_PORTS"):
        choose_mp_port({"LLMLAB_MP_PORTS": "20001-20001"}, lambda p: False)
    with pytest.raises(cluster.SettingsError, match=r"LLMLAB_MP_PORTS='80-90' is not a port range: write it LO-HI"):
        choose_mp_port({"LLMLAB_MP_PORTS": "80-90"})


def test_a_port_someone_listens_on_is_not_free_for_the_master_port():
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        assert launcher.port_is_free(port) is False
    assert launcher.port_is_free(port) is True


def _listener_in_its_own_session(tmp_path):
    """A process that listens on a port in a process group of its own, as the head's vLLM does under setsid."""
    ready = tmp_path / "port"
    code = ("import socket, sys, time, pathlib; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "pathlib.Path(sys.argv[1]).write_text(str(s.getsockname()[1])); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists() or not ready.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc, int(ready.read_text())


def test_headless_workers_start_only_once_the_heads_own_vllm_holds_the_master_port(tmp_path, capsys):
    """The launcher's wait before `srun`ing the headless workers: the port must be held by the head's vLLM (its
    process group, under setsid); a squatter on it fails the job in one sentence, no worker started."""
    log = tmp_path / "vllm.log"
    log.write_text("")
    head, port = _listener_in_its_own_session(tmp_path)
    try:
        assert launcher.wait_for_master_port(port, head.pid, log, timeout=20, poll=0.1)
        assert "held by the head's own vLLM" in capsys.readouterr().out
        other = subprocess.Popen(["sleep", "60"], start_new_session=True)  # the head's vLLM: alive, not holding it
        try:
            t0 = time.monotonic()
            assert launcher.wait_for_master_port(port, other.pid, log, timeout=20, poll=0.1) is False
            assert time.monotonic() - t0 < 5
        finally:
            other.kill()
            other.wait()
        out = capsys.readouterr().out
        assert (f"FAILED: another process, not this job's vLLM, listens on the master port {port}: the headless "
                "workers were not started") in out
    finally:
        head.kill()
        head.wait()


def test_mp_binds_vllms_queues_on_each_nodes_address_on_the_interface_the_admin_names():
    """Finding 7: vLLM's broadcast queue binds its XPUB on VLLM_HOST_IP, else on the default route's address; llmlab
    set none.  Now the head exports its own (the address of LLMLAB_HOST_IFACE, e.g. ib0) and every other node's
    vLLM starts through `on-node`, which sets that node's own before it execs vLLM."""
    env = {"LLMLAB_HOST_IFACE": "ib0"}
    r = cluster.render(mp_job(), nodes=["a", "b"], env=env, python="/py", iface_address=lambda i: f"10.10.0.1-{i}")
    assert r.env["VLLM_HOST_IP"] == "10.10.0.1-ib0" and r.mp_master.startswith("10.10.0.1-ib0:")
    assert "export VLLM_HOST_IP=10.10.0.1-ib0" in r.shell().splitlines()
    (worker,) = r.mp_workers
    assert worker[:7] == ["/py", "-m", "llmlab.ops.launcher", "on-node", "--iface", "ib0", "--"]
    assert worker[7:] == r.worker_argv(1)
    shown = cluster.render(mp_job(), nodes=["a", "b"], env=env)  # a dry run looks nothing up
    assert shown.env["VLLM_HOST_IP"] == "<ib0 address of a>"
    loop = cluster.render(dataclasses.replace(mp_job(), engine="cpu", gpus_per_node=0), nodes=["a", "b"], env={})
    assert loop.env["VLLM_HOST_IP"] == cluster.LOOPBACK_RAY_IP
    assert loop.mp_workers[0][4:7] == ["--ip", cluster.LOOPBACK_RAY_IP, "--"]


def test_on_node_sets_this_nodes_own_address_over_the_heads_inherited_one():
    show = [sys.executable, "-c", "import os; print(os.environ['VLLM_HOST_IP'])"]
    env = {**os.environ, "VLLM_HOST_IP": "10.0.0.1"}  # the head's, as srun hands it on
    run = [sys.executable, "-m", "llmlab.ops.launcher", "on-node"]
    out = subprocess.run([*run, "--ip", "10.0.0.2", "--", *show], capture_output=True, text=True, env=env)
    assert out.stdout == "10.0.0.2\n" and "vLLM's message queues bind to 10.0.0.2" in out.stderr
    out = subprocess.run([*run, "--iface", "lo", "--", *show], capture_output=True, text=True, env=env)
    assert out.stdout == "127.0.0.1\n", out.stderr
    out = subprocess.run([*run, "--iface", "nosuch0", "--", *show], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and out.stdout == ""
    assert "LLMLAB_HOST_IFACE=nosuch0: " in out.stderr and "has no IPv4 address on nosuch0" in out.stderr
    assert launcher.ipv4_on("3: ib0    inet 10.10.1.5/16 brd 10.10.255.255 scope global ib0\\") == "10.10.1.5"


def test_rendered_shell_survives_quotes_and_spaces():
    """The launcher evals the renderer's output: every value must come back exactly."""
    env = {"LLMLAB_EXTRA_VLLM_ARGS": "--chat-template '/a dir/t.jinja' --x \"$(touch /tmp/pwned)\" ;ls",
           "LLMLAB_RAY_HEAD_IP": "10.1.2.3"}
    r = cluster.render("llama3.1-405b", job_id="77", nodes=["gpu-a", "gpu-b"], port=9000, env=env)
    script = r.shell() + 'printf "%s\\n" "${serve_argv[@]}"; echo ---; eval "w=(${ray_worker_cmds[0]})"; ' \
                         'printf "%s\\n" "${w[@]}"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    argv, worker = out.split("---\n")
    assert argv.splitlines() == r.argv
    assert "/a dir/t.jinja" in argv.splitlines() and '$(touch /tmp/pwned)' in argv.splitlines()
    assert worker.splitlines() == r.ray.worker_command(1)
    assert not Path("/tmp/pwned").exists()


def test_ray_ports_are_disjoint_per_node_and_outside_ephemeral_range():
    r = cluster.render("llama3.1-405b", job_id="12345", nodes=["a", "b"], port=9000, env={"LLMLAB_RAY_HEAD_IP": "x"})
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
    other = cluster.render("llama3.1-405b", job_id="12346", nodes=["a", "b"], port=9000,
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
    assert cluster.parse_ray_status(RAY_STATUS) == (2, 16.0)
    assert cluster.parse_ray_status(RAY_STATUS.replace(" 0.0/16.0 GPU\n", "")) == (2, 0.0)
    assert cluster.parse_ray_status("") == (0, 0.0)


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
    # PP: the hidden state and the residual, each split over the stage's 8 GPUs, each slice over its own port, then
    # all-gathered over NVLink (vLLM's send_tensor_dict with the TP group)
    assert tp8["pp_bytes"] == 2 * message and tp8["pp_bytes_per_gpu"] == 2 * message / 8 and tp16["pp_transfers"] == 0
    assert tp8["pp_us"] == pytest.approx((2 * message / (8 * 50e9) + 7 / 8 * 2 * message / 450e9) * 1e6)
    # with InfiniBand the two layouts cost about the same (vLLM's blog: "similar"): 14.0 vs 15.6 ms at 256 tokens
    busy = {r["layout"]: r["comm_us"] / 1e3 for r in cluster.tp_vs_pp(tokens=256, allreduce_latency_us=22.5)}
    assert busy == {"TP=8 x PP=2": pytest.approx(13.97, abs=0.01), "TP=16 x PP=1": pytest.approx(15.58, abs=0.01)}
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
    good = next(r for r in rows if r.job_id == "7")
    assert good.alive is False and good.url == f"http://127.0.0.1:{port}/v1" and good.tp == 4
    assert good.key() == "s3cret"  # read from its file when asked, never kept in the entry
    assert "s3cret" not in json.dumps([r.as_dict() for r in rows])
    assert any("not valid JSON" in (r.error or "") for r in rows)
    assert "alive" not in cluster.servers(check=False)[0].as_dict()  # not asked, not claimed
    assert cluster.connection_file_of("7") == servers_dir() / "job-7.json"
    assert cluster.job_progress("7").phase == "waiting for the job to start vLLM"


# --------------------------------------------------------------------------------------------------
# Under a real SLURM (CPU mode)
# --------------------------------------------------------------------------------------------------


def test_a_log_without_any_known_line_says_the_phase_is_unknown():
    """A vLLM release whose start-up lines changed: 'phase unknown', never a stale phase, never a crash."""
    renamed = "".join(f"(EngineCore pid=7) INFO 11-23 10:00:{i:02d} [core.py:{i}] a line llmlab does not know\n"
                      for i in range(cluster.UNKNOWN_AFTER + 1))
    assert cluster.load_progress(renamed).phase.startswith("phase unknown")
    assert cluster.load_progress(renamed[:200]).phase == "importing vLLM"  # a few lines: still importing
    known = renamed + "(APIServer pid=6) INFO 11-23 10:01:00 [api_utils.py:273] non-default args: {}\n"
    assert cluster.load_progress(known).phase == "reading the model config"


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
    r = cluster.render("llama3.1-405b", job_id="4242", nodes=["a", "b"], port=9000, env=env)
    assert r.ray.temp_dir == "/tmp/llmlab-ray.Ab3dE9/ray"
    for cmd in (r.ray.head_command(), r.ray.worker_command(1)):
        assert [a for a in cmd if a.startswith("--temp-dir")] == ["--temp-dir=/tmp/llmlab-ray.Ab3dE9/ray"]
    assert "ray_temp_dir=/tmp/llmlab-ray.Ab3dE9/ray" in r.shell()
    shown = cluster.render("llama3.1-405b", job_id="4242", nodes=["a", "b"], port=9000,
                           env={"LLMLAB_RAY_HEAD_IP": "x", "TMPDIR": "/local"})
    assert shown.ray.temp_dir == "/local/llmlab-ray.XXXXXX/ray"  # what the launcher's mktemp makes
    with pytest.raises(cluster.SettingsError, match="too long for Ray's Unix sockets.*LLMLAB_RAY_TMPDIR"):
        cluster.render("llama3.1-405b", nodes=["a", "b"], port=9000,
                       env={"LLMLAB_RAY_HEAD_IP": "x", "LLMLAB_RAY_DIR": "/scratch/" + "x" * 40})
    dry = dry_run("llama3.1-405b")
    assert "llmlab-ray.XXXXXX/ray --block" in dry.stdout, dry.stdout


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


def test_the_printed_curl_line_keeps_the_key_out_of_curls_arguments(tmp_path):
    """Before: ``curl URL -H "Authorization: Bearer $(cat KEY)"``, whose expansion put the key into curl's argv,
    readable in ``ps`` by every user of the node (finding 10 of security-review-2)."""
    import http.server
    import threading

    key_file = tmp_path / "keys" / "job-41.key"
    key = new_key_file(key_file)
    seen = []

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.handle_request, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1"
    line = launcher.curl_line(url, key_file)
    config = tmp_path / "keys" / "job-41.curl"
    assert line == f"curl --config {config} {url}/models" and key not in line
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert '"${key_file%.key}.curl"' in (SLURM / "llmlab-serve.sh").read_text()  # the clean-up removes it
    if shutil.which("curl"):  # the printed line works as printed, and its argv holds no key
        argv = shlex.split(line)
        assert not any(key in a for a in argv)
        assert subprocess.run(argv + ["-sf"], timeout=30).returncode == 0 and seen == [f"Bearer {key}"]
    server.server_close()


def test_the_job_passes_no_inherited_ray_token_to_anything_it_starts(tmp_path):
    """sbatch passes the user's environment to the job; Ray takes RAY_AUTH_TOKEN before the job's token file
    (RAY_AUTH_TOKEN_PATH), so an inherited one replaced the job's own token everywhere (finding 10 of
    security-review-2).  Every process the launcher starts (Ray, vLLM, srun steps, the proxy) is a child of its
    shell: the Python it runs first records the environment it got."""
    dump = tmp_path / "env"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nenv -0 >>{shlex.quote(str(dump))}\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(LLMLAB_DRY_RUN="1", LLMLAB_PYTHON=str(python), RAY_AUTH_TOKEN="the-users-own-ray-token",
               VLLM_API_KEY="a-key", **dict.fromkeys(vllm.INHERITED_OPENERS, "1"))  # F10: no runtime LoRA either
    out = subprocess.run(["bash", str(SLURM / f"{CPU_JOB}.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = dump.read_text()
    assert "RAY_AUTH_TOKEN_PATH" in out.stdout and "LLMLAB_DRY_RUN=1" in seen  # a Ray layout; the probe ran
    assert "the-users-own-ray-token" not in seen and "RAY_AUTH_TOKEN=" not in seen and "VLLM_API_KEY=" not in seen
    assert not [name for name in vllm.INHERITED_OPENERS if f"{name}=" in seen]


def test_plain_sbatch_output_is_private_from_its_creation(tmp_path):
    """slurmstepd creates a job's --output file before the script runs, under the submitting shell's umask
    (0644 from a umask 022 shell, seen under the test bed), so the job's ``umask 077`` came too late for it
    (finding 10 of security-review-2).  The shipped scripts send it to /dev/null; the launcher makes its own."""
    for path in SLURM.glob("*.sh"):
        if path.name != "llmlab-serve.sh":
            assert sbatch_directives(path)["output"] == "/dev/null", path
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(LLMLAB_DRY_RUN="1", LLMLAB_PYTHON=sys.executable, SLURM_JOB_ID="4242", LLMLAB_HOME=str(home),
               LLMLAB_SLURM_DIR=str(SLURM))
    run = subprocess.run(["bash", "-c", 'umask 022; exec bash "$0"', str(SLURM / f"{CPU_JOB}.sh")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert run.returncode == 0 and run.stderr == ""  # stderr too goes to the private file
    out = home / "logs" / "llmlab-4242.out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and stat.S_IMODE(out.parent.stat().st_mode) == 0o700
    assert "vLLM:" in out.read_text()
    chosen = tmp_path / "mine.out"  # sbatch --output=FILE of the user's own: kept
    with chosen.open("w") as f:
        subprocess.run(["bash", str(SLURM / f"{CPU_JOB}.sh")], stdout=f, env=env, timeout=120, check=True)
    assert "vLLM:" in chosen.read_text()


def test_status_and_logs_find_a_plain_sbatch_jobs_own_output(monkeypatch):
    from llmlab.ops import jobs
    from llmlab.serve.info import llmlab_home

    own = llmlab_home() / "logs" / "llmlab-5151.out"
    own.parent.mkdir(parents=True, exist_ok=True)
    own.write_text("[llmlab 10:00:00] job 5151 on node1\n")
    assert jobs.output_file("5151", None, {"StdOut": "/dev/null"}) == str(own)
    assert jobs.output_file("5151", None, None) is None  # SLURM forgot the job, and no record of llmlab launch
    assert jobs.output_file("5151", None, {"StdOut": "/scratch/me/x.out"}) == "/scratch/me/x.out"
