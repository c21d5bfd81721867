"""The SLURM launcher's Python side: what ``slurm/llmlab-serve.sh`` runs, and how it waits.

Why here, not in the lesson: notebook 08 teaches the layouts (``llmlab.cluster``: settings, the ``vllm serve``
flags, TP vs PP, a server's load progress); this module turns one layout and the job's nodes into commands and
watches them come up.  It is the launcher's own code, run by ``python -m llmlab.ops.launcher``:

- **Rendering** (:func:`render`): settings + the job's nodes -> the exact ``vllm serve`` line, its environment,
  and the Ray layout (head, workers, ports).  Pure, so a test can check every shipped GPU job against
  ``llmlab.memory``'s planner on a laptop.
- **Ray** (:class:`RayLayout`, :func:`wait_for_ray`): per-job ports and token authentication, and a wait that
  fails fast, with the node's log, when a node's Ray exits.
- **Readiness** (:func:`wait_until_ready`): poll ``/health`` through the proxy, print the load progress in the
  job's output, end before the job's time limit, then write the connection file.

``python -m llmlab.ops.launcher render|wait-ray|wait-ready|progress`` are internal helpers (the user-facing
commands are ``llmlab launch/status``).  No secret passes through here: the API key stays in its 0600 file.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llmlab import memory
from llmlab.cluster import (
    JobSettings,
    SettingsError,
    job_settings,
    load_progress,
    vllm_flags,
)
from llmlab.serve.info import Address, ServerError, ServerInfo, read_key
from llmlab.serve.vllm import drop_flag, serve_line, set_flag, split_args, vllm_env, vllm_serve


def model_path(job: JobSettings, env: dict) -> str:
    """What vLLM loads: ``LLMLAB_MODEL_PATH``, else ``$LLMLAB_MODEL_DIR/<repository name>``, else the Hugging
    Face id (read from, or downloaded into, ``$HF_HOME``).  The CPU test job serves the shipped tiny model."""
    if env.get("LLMLAB_MODEL_PATH"):
        return env["LLMLAB_MODEL_PATH"]
    if job.engine == "cpu" and job.model == memory.TINY_NAME:
        return str(memory.MODELS_DIR / memory.TINY_NAME)
    if Path(job.model).is_dir():  # a model folder that models.toml names
        return job.model
    hf_id = memory.HF_IDS.get(job.model, job.model)
    if env.get("LLMLAB_MODEL_DIR"):
        return str(Path(env["LLMLAB_MODEL_DIR"]) / hf_id.rsplit("/", 1)[-1])
    return hf_id


@dataclass
class RayLayout:
    """Ray over the job's nodes: a head on the first node, one worker per other node, per-job ports.

    Ports come from a per-job block (``port_base``), and every node has its own sub-block: on a real cluster
    two multi-node jobs may share a head node, and in the CI test bed all "nodes" are one machine, where
    Ray's fixed defaults (client server 10001, dashboard 8265, agent 52365) and overlapping worker-port
    ranges collide.  Block of node i: ``port_base + 100 * (i + 1)``; the head's GCS is ``port_base``.
    """

    nodes: list[str]
    head_ip: str
    port_base: int
    gpus_per_node: int
    loopback: bool = False
    job_id: str = "0"
    tmp_root: str = "/tmp"
    cpus_per_node: int | None = None
    extra_head_args: list[str] = field(default_factory=list)
    extra_worker_args: list[str] = field(default_factory=list)
    private_dir: str | None = None  # the launcher's ``mktemp -d`` (0700) on the head node; None: not made yet

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def workers(self) -> list[str]:
        return self.nodes[1:]

    @property
    def gcs_port(self) -> int:
        return self.port_base

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"

    @property
    def expected_gpus(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    def _node_ports(self, i: int) -> list[str]:
        b = self.port_base + 100 * (i + 1)
        return [f"--node-manager-port={b}", f"--object-manager-port={b + 1}",
                f"--dashboard-agent-listen-port={b + 2}", f"--dashboard-agent-grpc-port={b + 3}",
                f"--metrics-export-port={b + 4}", f"--runtime-env-agent-port={b + 5}",
                f"--min-worker-port={b + 10}", f"--max-worker-port={b + 99}"]

    def _ip(self) -> list[str]:
        return [f"--node-ip-address={LOOPBACK_RAY_IP}"] if self.loopback else []

    @property
    def temp_dir(self) -> str:
        """Ray's session files, per job, one level inside a private folder.

        Ray makes its ``--temp-dir`` and the session, ``sockets/`` and ``logs/`` folders in it mode 0777, so that
        any local user could replace the raylet's and the object store's sockets, and a predictable name
        (``/tmp/llmlab-ray-<job id>``) could be made by another user before the job starts.  So the launcher
        makes an unpredictable 0700 folder (``mktemp -d``, :data:`RAY_DIR_PATTERN`) before Ray starts, on the head
        node itself and on each worker node in the step that starts Ray there (same name, refused unless it is the
        job user's own 0700 folder), and Ray's folder is ``ray/`` inside it: out of every other user's reach.
        Before the launcher made it (a dry run, a notebook), the name shows the pattern."""
        return f"{self.private_dir or f'{self.tmp_root}/{RAY_DIR_PATTERN}'}/ray"

    def head_command(self) -> list[str]:
        """``ray start --head``: no dashboard (nobody needs it, and it would be one more open port)."""
        return (["ray", "start", "--head", f"--port={self.gcs_port}", *self._ip(),
                 f"--ray-client-server-port={self.port_base + 1}", "--include-dashboard=false",
                 f"--dashboard-port={self.port_base + 2}", *self._node_ports(0), *self._gpus(),
                 f"--temp-dir={self.temp_dir}", "--block"]
                + self.extra_head_args)

    def worker_command(self, i: int) -> list[str]:
        """``ray start`` on worker ``i`` (1-based: node 0 is the head)."""
        return (["ray", "start", f"--address={self.address}", *self._ip(), *self._node_ports(i), *self._gpus(),
                 f"--temp-dir={self.temp_dir}", "--block"] + self.extra_worker_args)

    def _gpus(self) -> list[str]:
        """GPUs as SLURM allocated them; CPUs too where SLURM says (Ray would count every core of a shared node,
        and it pre-starts one Python worker per CPU it counts)."""
        cpus = [f"--num-cpus={self.cpus_per_node}"] if self.cpus_per_node else []
        return [f"--num-gpus={self.gpus_per_node}", *cpus]

    def max_port(self) -> int:
        return self.port_base + 100 * (len(self.nodes) + 1) - 1


# Ray's private folder: ``mktemp -d $TMPDIR/llmlab-ray.XXXXXX`` in the launcher.  Short on purpose: Ray puts its
# Unix sockets at <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store(.N), and a socket path has at
# most 107 bytes; RAY_SOCKET_TAIL is that tail at its longest.
RAY_DIR_PATTERN = "llmlab-ray.XXXXXX"
RAY_SOCKET_TAIL = len("/session_2026-11-23_15-43-00_123456_4194304/sockets/plasma_store.99")
RAY_SOCKET_MAX = 107


# The CI test bed runs every "node" on one machine and keeps Ray on loopback.  Not 127.0.0.1: Ray 2.60 replaces
# 127.0.0.1 and localhost by the machine's outward address (services.resolve_ip_for_localhost), so that other
# machines could reach it; any other loopback address it uses as given.
LOOPBACK_RAY_IP = "127.0.0.2"


# Multi-node jobs take a block of ports below Linux's ephemeral range (32768+), where outgoing connections
# would take ports at random; six blocks of 2,000 ports leave room for 19 nodes each.
RAY_PORT_FIRST, RAY_BLOCK, RAY_BLOCKS = 20000, 2000, 6


def ray_port_base(job_id: str, env: dict) -> int:
    """The job's Ray port block: ``LLMLAB_RAY_PORT_BASE``, else chosen by the job id (two jobs that share a
    head node get different blocks unless their ids are 6 apart)."""
    if env.get("LLMLAB_RAY_PORT_BASE"):
        return int(env["LLMLAB_RAY_PORT_BASE"])
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    return RAY_PORT_FIRST + (int(digits) % RAY_BLOCKS) * RAY_BLOCK


def head_ip(env: dict, loopback: bool) -> str:
    """The head's address that the workers dial: ``LLMLAB_RAY_HEAD_IP``, 127.0.0.1 in loopback mode, else the
    node's address as ``hostname --ip-address`` gives it (the seeds' way), skipping loopback entries."""
    if env.get("LLMLAB_RAY_HEAD_IP"):
        return env["LLMLAB_RAY_HEAD_IP"]
    if loopback:
        return LOOPBACK_RAY_IP
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if ip.startswith("127."):  # Debian maps the hostname to 127.0.1.1: use the first real interface instead
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
        ip = next((a for a in out if not a.startswith("127.") and ":" not in a), ip)
    return ip




# The InfiniBand settings of the seeds' 405B run, applied only when asked for (LLMLAB_NCCL_IB=1): NCCL
# finds InfiniBand by itself on most clusters, and a wrong HCA or interface name makes it fail or fall back.
NCCL_IB_ENV = {"NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "0", "NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "ib0"}


@dataclass
class RenderedJob(Address):
    """What the launcher runs for one job, with nothing secret in it."""

    job: JobSettings
    job_id: str
    nodes: list[str]
    bind_host: str           # where the key-checking proxy listens (llmlab.serve.proxy)
    host: str                # what clients dial (the connection file's host)
    port: int                # the proxy's port, 0 until it has bound one; vLLM listens on the Unix socket ``uds`` only
    uds: str
    model_path: str
    flags: list[str]         # after the model: layout flags, then name/host/port, then extra args
    env: dict[str, str]      # exported for Ray and vLLM (no secret: Ray's token and the API key stay in files)
    ray: RayLayout | None
    python: str = "python3"
    mp_master: str = ""      # backend "mp" across nodes: the head's host:port for torch.distributed
    mp_workers: list[list[str]] = field(default_factory=list)  # ... and each other node's headless vLLM

    def worker_argv(self, rank: int) -> list[str]:
        """Node ``rank``'s ``vllm serve MODEL --headless``: the head's flags without its socket, this node's rank.

        Through vLLM's CLI (``vllm.entrypoints.cli.main serve``), not the OpenAI server module the head runs:
        only the CLI knows ``--headless`` (workers, no API server).  The CUDA build has the metadata it needs."""
        flags = drop_flag(self.flags, "--uds")  # a headless node serves no API: only the head listens, behind the proxy
        flags = set_flag(flags, "--node-rank", str(rank))
        return [self.python, "-m", "vllm.entrypoints.cli.main", "serve", self.model_path, *flags, "--headless"]

    @property
    def serve_line(self) -> str:
        """The command as ``vllm serve`` reads (the launcher runs the same through ``python -m``)."""
        return serve_line(self.model_path, self.flags)

    @property
    def argv(self) -> list[str]:
        """What the launcher executes: ``serve_line`` through :func:`llmlab.serve.vllm.vllm_serve`."""
        return vllm_serve(self.python, self.model_path, self.flags)

    def summary(self) -> str:
        """The layout in words, for the job's output and the notebook."""
        j = self.job
        lines = [f"{j.name}: {j.model} on {len(self.nodes)} node(s) x {j.gpus_per_node} GPU(s), TP={j.tp} x PP={j.pp}, "
                 f"engine {j.engine}, context {j.context:,} tokens"]
        if self.ray:
            lines.append(f"Ray: head on {self.ray.head} ({self.ray.address}), workers on "
                         f"{', '.join(self.ray.workers)}; ports {self.ray.port_base}-{self.ray.max_port()}")
        elif self.mp_workers:
            lines.append(f"no Ray: vLLM's own processes on each node (--nnodes {len(self.nodes)}), the head on "
                         f"{self.nodes[0]} ({self.mp_master}), headless workers on {', '.join(self.nodes[1:])}")
        else:
            lines.append("Ray: not needed (one node: vLLM starts its own worker processes)")
        if self.port:
            lines.append(f"vLLM listens on {self.uds} (private); its key-checking proxy on "
                         f"{self.bind_host}:{self.port}; clients use {self.base_url}")
        else:  # bind, then publish: a port chosen ahead could be taken by another user before the proxy binds it
            lines.append(f"vLLM listens on {self.uds} (private); its key-checking proxy on {self.bind_host}, on a free "
                         f"port it binds itself; clients use http://{self.host}:<that port>/v1 (the connection file "
                         "and the READY line name it)")
        return "\n".join(lines)

    def shell(self) -> str:
        """Bash assignments the launcher sources (every value quoted with shlex)."""
        q = shlex.quote
        out = [f"summary={q(self.summary())}", f"job_name={q(self.job.name)}", f"engine={q(self.job.engine)}",
               f"served_model={q(self.job.name)}",
               f"bind_host={q(self.bind_host)}", f"host={q(self.host)}", f"port={self.port}", f"uds={q(self.uds)}",
               f"expected_nodes={self.job.nodes}", f"tp={self.job.tp}", f"pp={self.job.pp}",
               f"ray_timeout={self.job.ray_timeout:g}", f"ready_timeout={self.job.ready_timeout:g}",
               f"serve_argv=({' '.join(map(q, self.argv))})", f"serve_line={q(self.serve_line)}",
               f"nodes=({' '.join(map(q, self.nodes))})"]
        out += [f"export {k}={q(v)}" for k, v in self.env.items()]
        if self.ray:
            out += [f"ray_address={q(self.ray.address)}", f"ray_expected_gpus={self.ray.expected_gpus}",
                    f"ray_temp_dir={q(self.ray.temp_dir)}",
                    f"ray_head_cmd={q(shlex.join(self.ray.head_command()))}",
                    "ray_worker_cmds=(" + " ".join(q(shlex.join(self.ray.worker_command(i)))
                                                   for i in range(1, len(self.nodes))) + ")"]
        else:
            out += ["ray_address=", "ray_expected_gpus=0", "ray_temp_dir=", "ray_head_cmd=", "ray_worker_cmds=()"]
        out += [f"mp_master={q(self.mp_master)}",
                "mp_worker_cmds=(" + " ".join(q(shlex.join(argv)) for argv in self.mp_workers) + ")"]
        return "\n".join(out) + "\n"


def render(job: JobSettings | str, *, job_id: str = "0", nodes: list[str] | None = None, port: int = 0,
           env: dict | None = None, python: str = "python3") -> RenderedJob:
    """Settings + the job's nodes -> the exact commands.  ``port=0`` leaves the port to the proxy, which binds a
    free one when the job starts and only then is it published (``wait-bound``).

    Environment knobs (all optional): ``LLMLAB_MODEL_PATH``, ``LLMLAB_MODEL_DIR``, ``LLMLAB_CACHE_DIR`` (HF
    and vLLM caches), ``LLMLAB_MAX_MODEL_LEN``, ``LLMLAB_EXTRA_VLLM_ARGS``, ``LLMLAB_BIND_HOST``,
    ``LLMLAB_ADVERTISE_HOST``, ``LLMLAB_LOOPBACK``, ``LLMLAB_RAY_HEAD_IP``, ``LLMLAB_RAY_PORT_BASE``,
    ``LLMLAB_RAY_HEAD_ARGS``, ``LLMLAB_RAY_WORKER_ARGS``, ``LLMLAB_RAY_TIMEOUT``, ``LLMLAB_READY_TIMEOUT``,
    ``LLMLAB_NCCL_IB``; ``LLMLAB_RUN_DIR`` (the launcher's private directory for vLLM's socket).
    """
    env = dict(os.environ if env is None else env)
    if isinstance(job, str):
        job = job_settings(job)
    overrides = {}
    if env.get("LLMLAB_MAX_MODEL_LEN"):
        overrides["max_model_len"] = int(env["LLMLAB_MAX_MODEL_LEN"])
    for key in ("ray_timeout", "ready_timeout"):
        if env.get(f"LLMLAB_{key.upper()}"):
            overrides[key] = float(env[f"LLMLAB_{key.upper()}"])
    if overrides:
        job = JobSettings(**{**job.as_dict(), **overrides})
    nodes = list(nodes or [f"node{i + 1}" for i in range(job.nodes)])
    if len(nodes) != job.nodes:
        raise SettingsError(f"{job.name} needs {job.nodes} node(s) but the job has {len(nodes)} "
                            f"({', '.join(nodes)}): submit it with --nodes={job.nodes}.")
    loopback = env.get("LLMLAB_LOOPBACK", "1" if job.engine == "cpu" else "0") == "1"
    bind_host = env.get("LLMLAB_BIND_HOST") or ("127.0.0.1" if loopback else "0.0.0.0")
    host = env.get("LLMLAB_ADVERTISE_HOST") or ("127.0.0.1" if loopback else socket.gethostname())
    path = model_path(job, env)
    # vLLM on a Unix socket in a 0700 directory: only the job's user reaches it; the proxy on bind_host:port checks
    # the key of every request and forwards only /v1/*, /health and /metrics (llmlab.serve.proxy says why).
    run_dir = env.get("LLMLAB_RUN_DIR") or f"{env.get('TMPDIR') or '/tmp'}/llmlab-run-{job_id}"
    uds = f"{run_dir}/vllm.sock"
    flags = vllm_flags(job) + ["--served-model-name", job.name, "--uds", uds]
    try:
        flags += list(job.extra_args) + split_args(env.get("LLMLAB_EXTRA_VLLM_ARGS", ""))
    except ValueError as e:
        raise SettingsError(f"LLMLAB_EXTRA_VLLM_ARGS: {e}") from None
    # The CPU test job serves a model on disk; a GPU job may load from (or download into) $HF_HOME.
    run_env = vllm_env(job.engine, kv_cache_gib=job.kv_cache_gib, run_dir=run_dir, offline=job.engine == "cpu")
    if env.get("LLMLAB_CACHE_DIR"):
        cache = Path(env["LLMLAB_CACHE_DIR"])
        run_env.update(HF_HOME=str(cache / "huggingface"), VLLM_CACHE_ROOT=str(cache / "vllm"))
    if env.get("LLMLAB_NCCL_IB") == "1":
        run_env.update({k: env.get(k, v) for k, v in NCCL_IB_ENV.items()})
    ray = None
    if job.uses_ray:
        ray = RayLayout(nodes, head_ip(env, loopback), ray_port_base(job_id, env), job.gpus_per_node, loopback,
                        str(job_id), env.get("LLMLAB_RAY_TMPDIR") or env.get("TMPDIR") or "/tmp",
                        int(env["SLURM_CPUS_ON_NODE"]) if env.get("SLURM_CPUS_ON_NODE", "").isdigit() else None,
                        shlex.split(env.get("LLMLAB_RAY_HEAD_ARGS", "")),
                        shlex.split(env.get("LLMLAB_RAY_WORKER_ARGS", "")),
                        private_dir=env.get("LLMLAB_RAY_DIR") or None)
        if len(ray.temp_dir.encode()) + RAY_SOCKET_TAIL > RAY_SOCKET_MAX:
            raise SettingsError(f"Ray's folder {ray.temp_dir} is too long for Ray's Unix sockets (at most "
                                f"{RAY_SOCKET_MAX} bytes with {RAY_SOCKET_TAIL} of Ray's own): set LLMLAB_RAY_TMPDIR "
                                "to a shorter folder of the node's local disk, e.g. /tmp.")
        # vLLM's ray.init() joins this cluster instead of starting its own.
        run_env["RAY_ADDRESS"] = ray.address
        # Draining waits up to 30 s on SIGTERM for work that a vLLM server never leaves; skip it, so that
        # scancel's clean-up ends within SLURM's KillWait.
        run_env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
        run_env["RAY_USAGE_STATS_ENABLED"] = "0"  # a compute node has no business phoning home
        # No Python workers started ahead of need (one per CPU by default): vLLM creates its own actors, and
        # the pre-started ones compete with Ray's agents, which must be up within a fixed 15 s.
        run_env["RAY_enable_worker_prestart"] = "0"
        # Token authentication for every Ray connection (head, workers, vLLM's ray.init): without it, anyone who
        # reaches the head node's ports can submit a Ray task, i.e. run code as the job's user.
        check_ray_tokens(env.get("LLMLAB_RAY_VERSION") or installed_ray_version(), env.get("RAY_AUTH_MODE"))
        run_env["RAY_AUTH_MODE"] = "token"
        run_env["RAY_AUTH_TOKEN_PATH"] = ray_token_file(job_id, env)  # the launcher writes it, 0600, per job
    rendered = RenderedJob(job, str(job_id), nodes, bind_host, host, port, uds, path, flags, run_env, ray, python)
    if job.uses_mp_nodes:
        # vLLM's own multi-node mode: the head runs the API server and its GPUs' workers, every other node
        # `--headless` workers; they meet at the head's torch.distributed port (the first of the job's block).
        master_host, master_port = head_ip(env, loopback), ray_port_base(job_id, env)
        rendered.flags += ["--node-rank", "0", "--master-addr", master_host, "--master-port", str(master_port)]
        rendered.mp_master = f"{master_host}:{master_port}"
        rendered.mp_workers = [rendered.worker_argv(i) for i in range(1, len(nodes))]
    return rendered


RAY_TOKEN_VERSION = (2, 52)  # the first Ray with RAY_AUTH_MODE=token


def installed_ray_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray")
    except PackageNotFoundError:
        return "0"


def check_ray_tokens(version: str, mode: str | None = None) -> None:
    """Refuse a multi-node layout whose Ray cannot require a token (or was told not to): an open Ray head lets
    every user of the cluster run code as you."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if parts < RAY_TOKEN_VERSION:
        raise SettingsError(f"Ray {version} has no token authentication (RAY_AUTH_MODE=token needs Ray >= "
                            f"{'.'.join(map(str, RAY_TOKEN_VERSION))}); without it anyone who reaches the head node "
                            "can run code as you. Upgrade Ray (pip install 'ray>=2.52') or use a one-node layout.")
    if mode and mode.lower() != "token":
        raise SettingsError(f"RAY_AUTH_MODE={mode}: llmlab starts Ray only with token authentication; unset "
                            "RAY_AUTH_MODE (the launcher sets it to token, with a per-job token file).")


def ray_token_file(job_id: str, env: dict) -> str:
    """The job's Ray token: a 0600 file under LLMLAB_HOME (on the shared home, so every node reads the same)."""
    home = env.get("LLMLAB_HOME") or str(Path.home() / ".llmlab")
    return f"{home}/keys/ray-job-{job_id}.token"


def say(message: str, file=None) -> None:
    """One line in the job's output, time-stamped like the launcher's own lines."""
    print(f"[llmlab {time.strftime('%H:%M:%S')}] {message}", flush=True, file=file or sys.stdout)


RAY_NODE = re.compile(r"^\s*\d+\s+node_[0-9a-f]+", re.M)


RAY_GPU = re.compile(r"([\d.]+)/([\d.]+)\s+GPU\b")


def parse_ray_status(text: str) -> tuple[int, float]:
    """(active nodes, total GPUs) from ``ray status`` output (Ray 2.x's "Active:" and "Usage" sections)."""
    active = text.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in text else ""
    nodes = sum(int(m.group(0).split()[0]) for m in RAY_NODE.finditer(active))
    gpus = RAY_GPU.search(text)
    return nodes, float(gpus.group(2)) if gpus else 0.0


def tail(path: Path | str, n: int = 12) -> str:
    from llmlab.serve.proc import last_lines

    return last_lines(Path(path), n)


RAY_STARTED = "Ray runtime started"


def _steps_started(steps: dict[str, tuple[int, str]]) -> list[str]:
    """Nodes whose ``ray start`` printed "Ray runtime started": it prints that only once its node is
    registered in the GCS, so reading the log is a free check (``ray status`` costs seconds of CPU)."""
    done = []
    for node, (_, log) in steps.items():
        try:
            if RAY_STARTED in Path(log).read_text(errors="replace"):
                done.append(node)
        except OSError:
            pass
    return done


def raylet_failure(temp_dir: str) -> str | None:
    """The raylet's fatal line on this node, if it died: e.g. Ray 2.60 aborts when its dashboard agent has not
    written its port file within 15 s ("Timed out waiting for file ...")."""
    found = None
    for path in sorted(Path(temp_dir).glob("session_latest/logs/raylet*.out")):  # this attempt's session
        for line in path.read_text(errors="replace").splitlines():
            for marker in ("Timed out waiting for file", "Check failed"):  # past Ray's "likely a bug" preamble
                if marker in line:
                    found = line[line.index(marker):].strip()[:300]
                    break
    return found


def _dead_step(steps: dict[str, tuple[int, str]]) -> str | None:
    from llmlab.serve.proc import pid_alive

    return next((node for node, (pid, _) in steps.items() if not pid_alive(pid)), None)


def ray_command() -> str | None:
    """The ``ray`` CLI of the job's environment (beside this Python), else the one on PATH -- where ``ray start``
    itself was found (an environment whose scripts are elsewhere, e.g. a ``--target`` install with a wrapper)."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else shutil.which("ray")


def wait_for_ray(address: str, nodes: int, gpus: int, timeout: float, steps: dict[str, tuple[int, str]],
                 poll: float = 5.0, ray_bin: str | None = None, started_only: bool = False,
                 temp_dir: str | None = None) -> bool:
    """Wait until every node's Ray has started, then until ``ray status`` shows ``nodes`` nodes and ``gpus`` GPUs.

    ``steps``: node name -> (pid of its ``srun ray start`` step, its log file).  A step that exits means that
    node's Ray cannot start: fail at once, naming the node and showing its log, instead of waiting out the
    time-out.  ``temp_dir``: Ray's session folder on this node, searched for the raylet's fatal error.
    ``started_only``: return once the steps' nodes have started (the launcher starts the workers
    only after the head has, so that they do not compete with it for CPU nor dial a head that is not
    registered yet).  Returns True on success; prints the reason and returns False otherwise.
    """
    ray_bin = ray_bin or ray_command()
    if ray_bin is None:
        say("FAILED: no `ray` command beside this Python nor on PATH, so the launcher cannot ask Ray whether every "
            "node joined: install Ray in the job's environment (pip install 'ray>=2.52').")
        return False
    start, last = time.monotonic(), None

    def failed() -> bool:
        node = _dead_step(steps)
        if node is None:
            return False
        log = steps[node][1]
        # Not "FAILED:" yet: the launcher may try again; it says FAILED when it gives up (llmlab status reads it).
        say(f"Ray on {node} exited before the cluster was complete. Last lines of {log}:\n{tail(log)}")
        if temp_dir and (why := raylet_failure(temp_dir)):
            print(f"The raylet's own last word (in {temp_dir}): {why}", flush=True)
        return True

    def timed_out(seen: str) -> bool:
        waited = time.monotonic() - start
        if waited <= timeout:
            return False
        say(f"Ray incomplete after {waited:.0f} s: {seen} (time-out LLMLAB_RAY_TIMEOUT={timeout:g} s). Last lines "
            "of each node's Ray log follow.")
        for node, (_, log) in steps.items():
            print(f"--- {node}: {log}\n{tail(log, 6)}", flush=True)
        return True

    while len(started := _steps_started(steps)) < len(steps):
        if failed():
            return False
        waiting = [n for n in steps if n not in started]
        if timed_out(f"Ray has not started on {', '.join(waiting)}"):
            return False
        time.sleep(0.5)
    say(f"Ray started on {', '.join(steps)}")
    if started_only:
        return True
    while True:
        seen = (0, 0.0)
        status = subprocess.Popen([ray_bin, "status", f"--address={address}"], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        try:  # `ray status` takes seconds: watch the steps meanwhile, so that a dead node fails the job at once
            asked = time.monotonic()
            while status.poll() is None and time.monotonic() - asked < 60:
                if failed():
                    return False
                time.sleep(0.5)
        finally:
            if status.poll() is None:
                status.kill()
            out = status.communicate()[0]
        if status.returncode == 0:
            seen = parse_ray_status(out)
        if seen != last:
            say(f"Ray: {seen[0]}/{nodes} nodes, {seen[1]:g}/{gpus} GPUs joined")
            last = seen
        if seen[0] >= nodes and seen[1] >= gpus:
            return True
        hint = (" GPUs are missing: does every node see its GPUs (--gpus-per-node, CUDA_VISIBLE_DEVICES)?"
                if seen[0] >= nodes else "")
        if timed_out(f"ray status shows {seen[0]}/{nodes} nodes and {seen[1]:g}/{gpus} GPUs.{hint}"):
            return False
        time.sleep(poll)


def listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets that listen on TCP ``port`` on this node, any address (``/proc/net/tcp`` and
    ``tcp6``, which every user may read)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(f[9])
    return found


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets process ``pid`` holds open (its ``/proc/PID/fd``: readable for our own processes)."""
    found = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def port_holder(port: int, pid: int) -> str:
    """Who listens on ``port`` here: "ours" (process ``pid`` holds every listening socket of it), "nobody" (yet),
    or "other".  The launcher sends the key to ``/health`` only when "ours": a squatter on the chosen port must
    never receive it (issue 26)."""
    listening = listening_inodes(port)
    if not listening:
        return "nobody"
    return "ours" if listening <= socket_inodes(pid) else "other"


def wait_until_ready(host: str, port: int, pid: int, log: Path, timeout: float, poll: float = 2.0,
                     api_key: str | None = None, proxy_pid: int | None = None, proxy_log: Path | None = None,
                     on_phase=None, steps: dict[str, tuple[int, str]] | None = None) -> bool:
    """Poll ``/health`` while vLLM loads; print the phase / shard progress whenever it changes, and tell
    ``on_phase(phase)`` (the launcher rewrites its "loading" connection file with it).

    ``proxy_pid``: the key-checking proxy, which must stay alive and be the one listening on ``port`` before the
    key goes there; if it exits (its port was taken, a crash) or another process holds the port, the wait fails
    at once.  ``steps``: node -> (pid, log) of the other nodes' headless vLLM (backend "mp"): one that exits fails
    the wait at once, instead of the head waiting for it until torch.distributed's time-out.  Returns True once
    /health answers 200; prints the reason (exit, time-out) with the log's last lines and returns False otherwise.
    """
    from llmlab.serve.proc import health, pid_alive

    start, last = time.monotonic(), ""
    while True:
        if proxy_pid is not None:
            if not pid_alive(proxy_pid):
                say(f"FAILED: the key-checking proxy (pid {proxy_pid}) exited while vLLM was starting. Last lines of "
                    f"{proxy_log}:\n{tail(proxy_log, 10) if proxy_log else ''}")
                return False
            holder = port_holder(port, proxy_pid)
            if holder == "other":
                say(f"FAILED: another process listens on port {port}, not this job's proxy (pid {proxy_pid}): the "
                    "key is not sent there. Submit the job again (it picks another free port).")
                return False
        else:
            holder = "ours"
        if holder == "ours" and health(host, port, api_key=api_key):
            return True
        if not pid_alive(pid):
            say(f"FAILED: vLLM exited while starting. Last lines of {log}:\n{tail(log, 25)}")
            return False
        if steps and (node := _dead_step(steps)):
            say(f"FAILED: vLLM's headless workers on {node} exited while starting. Last lines of {steps[node][1]}:\n"
                f"{tail(steps[node][1], 25)}")
            return False
        waited = time.monotonic() - start
        if waited > timeout:
            say(f"FAILED: vLLM did not answer /health within {timeout:g} s (LLMLAB_READY_TIMEOUT). Last lines of "
                f"{log}:\n{tail(log, 15)}")
            return False
        now = str(load_progress(log))
        if now != last:
            say(f"vLLM: {now}")
            last = now
            if on_phase is not None:
                on_phase(now)
        time.sleep(poll)


def _cmd_render(a) -> int:
    rendered = render(a.job, job_id=a.job_id, nodes=a.nodes.split() if a.nodes else None, port=a.port,
                      python=a.python)
    print(rendered.shell() if a.shell else rendered.summary() + "\n" + rendered.serve_line)
    from llmlab.serve.vllm import installed_vllm, vllm_outside_range

    if untested := vllm_outside_range(installed_vllm()):
        say(f"warning: {untested}", file=sys.stderr)  # in the job's output, before anything starts
    return 0


def _steps(specs: list[str]) -> dict[str, tuple[int, str]]:
    """``--step NODE:PID:LOG`` arguments (a node's srun step and its log) -> {node: (pid, log)}."""
    return {node: (int(pid), log) for node, pid, log in (spec.split(":", 2) for spec in specs)}


def _cmd_wait_ray(a) -> int:
    steps = _steps(a.step)
    if wait_for_ray(a.address, a.nodes, a.gpus, a.timeout, steps, a.poll, started_only=a.started_only,
                    temp_dir=a.ray_temp_dir or None):
        return 0
    return 1 if _dead_step(steps) else 3  # 1: a node's Ray exited (worth a retry); 3: the time-out


def seconds_left(squeue_l: str) -> int | None:
    """The job's remaining time from ``squeue -o %L`` ("1-02:03:04", "02:03:04", "03:04"); None if unlimited."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", squeue_l.strip())
    if not m:
        return None  # UNLIMITED, NOT_SET, INVALID, or no squeue
    days, hours, minutes, secs = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def capped_timeout(timeout: float, time_left: str, stop_grace: float) -> tuple[float, str | None]:
    """A wait that ends before SLURM kills the job: the time left minus the clean-up's grace and a margin.

    Why: a 405B load takes ~40 min; a job submitted with --time=00:30:00 would otherwise wait for /health until
    SLURM killed it mid-load, with no word on why.  Returns (seconds, the sentence to print when capped)."""
    left = seconds_left(time_left)
    if left is None:
        return timeout, None
    room = max(left - stop_grace - 30, 0)
    if room >= timeout:
        return timeout, None
    return room, (f"the job's time limit leaves {left} s, so the wait for vLLM ends after {room:g} s (before "
                  f"SLURM's kill), not after the {timeout:g} s of LLMLAB_READY_TIMEOUT: a longer --time gives it more")


def publish(a, status: str, phase: str | None = None, **extra) -> ServerInfo:
    """Write the job's connection file (and a room's ``server.json``): "loading" from the launcher's first
    seconds, with the phase, so that ``llmlab.connect()`` says the server is still loading instead of starting the
    embedded tiny model; "ready" once ``/health`` answered.  The key stays in its 0600 file."""
    extra = {"nodes": a.nodes.split(), "tp": a.tp, "pp": a.pp, "engine": a.engine, "ray_address": a.ray_address or None,
             **extra}
    if phase is not None:
        extra["phase"] = phase
    if os.environ.get("LLMLAB_SHARE_DIR"):  # llmlab launch --share GROUP: where the group's learners look
        extra.update(share_dir=os.environ["LLMLAB_SHARE_DIR"], group=os.environ.get("LLMLAB_SHARE_GROUP"))
    path = Path(a.connection_file)
    try:  # "started" is the first publication's time, kept through every rewrite
        extra["started"] = ServerInfo.read(path).started
    except ServerError:
        pass
    info = ServerInfo.from_dict(dict(kind="slurm", host=a.host, port=a.port, model=a.model, api_key_file=a.key_file,
                                     job_id=a.job_id, status=status, **extra))
    info.write(path)
    if extra.get("share_dir"):
        from llmlab.serve import share

        share.publish(extra["share_dir"], info)
    return info


def _cmd_wait_bound(a) -> int:
    """Print the port the job's proxy bound, once its ready file says so: the launcher publishes nothing before."""
    from llmlab.serve.proc import pid_alive
    from llmlab.serve.proxy import wait_bound

    try:
        bound = wait_bound(Path(a.ready_file), lambda: pid_alive(a.pid), Path(a.log), a.timeout)
    except ServerError as e:
        say(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(bound["port"])
    return 0


def _cmd_loading(a) -> int:
    publish(a, "loading", a.phase)
    return 0


def _cmd_wait_ready(a) -> int:
    t0 = time.monotonic()
    key = read_key(a.key_file)  # /health goes through the proxy, which wants the key
    timeout, why = capped_timeout(a.timeout, a.time_left, a.stop_grace)
    if why:
        say(f"note: {why}")
    if not wait_until_ready(a.host, a.port, a.pid, Path(a.log), timeout, a.poll, api_key=key,
                            proxy_pid=a.proxy_pid, proxy_log=Path(a.proxy_log) if a.proxy_log else None,
                            on_phase=lambda phase: publish(a, "loading", phase), steps=_steps(a.step)):
        return 1
    info = publish(a, "ready", log=a.log, pid=a.pid, ready_after_s=round(time.monotonic() - t0 + a.elapsed, 1))
    url = info.base_url
    if info.get("share_dir"):
        say(f"shared with group {info.get('group')}: learners set "
            f"LLMLAB_CONNECTION_FILE={Path(info['share_dir']) / 'server.json'}")
    say(f"READY: {a.model} at {url} (job {a.job_id}, {info['ready_after_s']:g} s after the job started)")
    print(f"  notebook:  client, model = llmlab.connect()    # finds {a.connection_file}\n"
          f"  pinned:    LLMLAB_CONNECTION_FILE={a.connection_file}\n"
          f"  curl:      curl {url}/models -H \"Authorization: Bearer $(cat {a.key_file})\"", flush=True)
    return 0


def _cmd_progress(a) -> int:
    print(load_progress(Path(a.log)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.ops.launcher",
                                description="Helpers of slurm/llmlab-serve.sh (not a user command).")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("job")
    r.add_argument("--job-id", default="0")
    r.add_argument("--nodes", default="")
    r.add_argument("--port", type=int, default=0)
    r.add_argument("--python", default=sys.executable)
    r.add_argument("--shell", action="store_true")
    r.set_defaults(func=_cmd_render)
    w = sub.add_parser("wait-ray")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--gpus", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600)
    w.add_argument("--poll", type=float, default=5)
    w.add_argument("--step", action="append", default=[], help="NODE:PID:LOG of each srun ray start")
    w.add_argument("--started-only", action="store_true", help="only wait until the steps' Ray has started")
    w.add_argument("--ray-temp-dir", default="", help="Ray's session folder, for the raylet's fatal error")
    w.set_defaults(func=_cmd_wait_ray)
    b = sub.add_parser("wait-bound", help="print the port the proxy bound, once it listens")
    b.add_argument("--ready-file", required=True)
    b.add_argument("--pid", type=int, required=True, help="the proxy")
    b.add_argument("--log", required=True, help="the proxy's log, for its sentence if it cannot start")
    b.add_argument("--timeout", type=float, default=60)
    b.set_defaults(func=_cmd_wait_bound)
    h = sub.add_parser("wait-ready")
    ld = sub.add_parser("loading", help="write the connection file with status 'loading'")
    for q in (h, ld):  # what the connection file says
        for name in ("host", "model", "key-file", "connection-file", "job-id", "engine"):
            q.add_argument(f"--{name}", required=True)
        for name in ("port", "tp", "pp"):
            q.add_argument(f"--{name}", type=int, required=True)
        q.add_argument("--nodes", default="")
        q.add_argument("--ray-address", default="")
    ld.add_argument("--phase", default="starting")
    ld.set_defaults(func=_cmd_loading)
    h.add_argument("--log", required=True)
    h.add_argument("--pid", type=int, required=True)
    h.add_argument("--proxy-pid", type=int, help="the key-checking proxy: must live and hold --port")
    h.add_argument("--proxy-log", default="")
    h.add_argument("--timeout", type=float, default=5400)
    h.add_argument("--poll", type=float, default=2)
    h.add_argument("--elapsed", type=float, default=0, help="seconds the job ran before vLLM started")
    h.add_argument("--time-left", default="", help="the job's remaining time as `squeue -o %%L` prints it")
    h.add_argument("--stop-grace", type=float, default=20, help="seconds the clean-up may take (LLMLAB_STOP_GRACE)")
    h.add_argument("--step", action="append", default=[], help="NODE:PID:LOG of each node's headless vLLM (mp)")
    h.set_defaults(func=_cmd_wait_ready)
    g = sub.add_parser("progress")
    g.add_argument("log")
    g.set_defaults(func=_cmd_progress)
    a = p.parse_args(argv)
    try:
        return a.func(a)
    except (SettingsError, memory.ConfigError, memory.PlanError) as e:
        say(f"FAILED: {e}", file=sys.stderr)  # stderr: the launcher captures render's stdout
        return 2


if __name__ == "__main__":
    sys.exit(main())
