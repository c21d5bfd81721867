"""Rendering a SLURM server job: its settings and its nodes -> the exact commands, with nothing run.

Why in the lesson: notebook 08 shows what the launcher runs for a job before any job exists.  :func:`render`
turns one layout (``llmlab.cluster.layouts``) and the job's nodes into the ``vllm serve`` line, its
environment and the Ray layout (head, workers, per-job ports, token authentication).  It is pure: a test checks
every shipped GPU job against ``llmlab.memory``'s planner on a laptop, and the notebook renders a pretend
allocation.  The launcher inside the job (``llmlab.ops.launcher``) calls the same function, then starts Ray
and vLLM and waits for them; :func:`parse_ray_status` reads what it asks Ray.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmlab import memory
from llmlab.cluster.layouts import JobSettings, SettingsError, job_flags, job_settings
from llmlab.serve.info import Address
from llmlab.serve.vllm import (
    CACHE_ROOT,
    HOST_IP,
    drop_flag,
    serve_line,
    set_flag,
    split_args,
    unbound_cpu_env,
    vllm_env,
    vllm_serve,
)


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


def head_ip(env: dict, loopback: bool, addresses: Callable[[], list[str]] | None = None) -> str:
    """The head's address that the workers dial: ``LLMLAB_RAY_HEAD_IP``, :data:`LOOPBACK_RAY_IP` in loopback
    mode, else the node's address as its hostname resolves.  Where that is a loopback entry (Debian maps the
    hostname to 127.0.1.1), the first real one of ``addresses()``: the launcher inside the job passes the node's
    (``hostname -I``, the seeds' way); rendering here runs nothing, so without it the loopback entry stays."""
    if env.get("LLMLAB_RAY_HEAD_IP"):
        return env["LLMLAB_RAY_HEAD_IP"]
    if loopback:
        return LOOPBACK_RAY_IP
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if ip.startswith("127.") and addresses is not None:
        ip = next((a for a in addresses() if not a.startswith("127.") and ":" not in a), ip)
    return ip


# Backend "mp": the head's torch.distributed port (``--master-port``), drawn at random per job from this range
# (``LLMLAB_MP_PORTS=LO-HI`` changes it).  Below Linux's ephemeral range (32768+), so that no outgoing
# connection holds it by chance; wide, so that a user who reads the public job id cannot guess it.  Why it must not
# be guessed: the headless workers dial it, and whoever listens there first receives their connections.
MP_PORTS = (20000, 32767)
MP_PORT_TRIES = 50


def mp_port_range(env: dict) -> tuple[int, int]:
    """``LLMLAB_MP_PORTS`` ("LO-HI", e.g. the range a cluster's firewall opens between its nodes), else
    :data:`MP_PORTS`."""
    text = env.get("LLMLAB_MP_PORTS", "").strip()
    if not text:
        return MP_PORTS
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if not m or not 1024 <= int(m[1]) <= int(m[2]) <= 65535:
        raise SettingsError(f"LLMLAB_MP_PORTS={text!r} is not a port range: write it LO-HI, e.g. 20000-32767 "
                            "(ports 1024-65535, LO <= HI).")
    return int(m[1]), int(m[2])


def choose_mp_port(env: dict, is_free: Callable[[int], bool] | None = None,
                   rng: secrets.SystemRandom | None = None) -> int:
    """A master port nobody can predict: drawn with :mod:`secrets` from :func:`mp_port_range`, and free on this
    node where ``is_free`` can tell (the launcher passes a bind test; a dry run has none, so it only draws).

    Why not the job id: it is public (``squeue``), and a port derived from it can be taken before the job starts by
    anyone who wants the headless workers' connections.  A draw that is taken is drawn again; a range with
    nothing free after :data:`MP_PORT_TRIES` draws fails with the range named."""
    lo, hi = mp_port_range(env)
    rng = rng or secrets.SystemRandom()
    for _ in range(MP_PORT_TRIES):
        port = rng.randint(lo, hi)
        if is_free is None or is_free(port):
            return port
    raise SettingsError(f"No free port for vLLM's master port among {MP_PORT_TRIES} drawn from {lo}-{hi} on this "
                        "node (another user may be holding the range): set LLMLAB_MP_PORTS to a range with free "
                        "ports, or use backend 'ray'.")


def on_node_prefix(python: str, env: dict, loopback: bool) -> list[str]:
    """What runs before a headless node's vLLM: ``llmlab.ops.launcher on-node``, which sets ``VLLM_HOST_IP`` to
    this node's own address and then execs vLLM.

    Why: vLLM binds its message queues (ZeroMQ XPUB sockets, unauthenticated) on ``VLLM_HOST_IP``, else on the
    address of the node's default route, often the one every user of the cluster reaches.  The address must be each
    node's own (one address exported by the head would reach every node through srun), so each node looks it up:
    on the interface ``LLMLAB_HOST_IFACE`` names (the cluster's private network, e.g. ``ib0``), else the address
    its hostname resolves to; loopback in the CPU test bed."""
    if loopback:
        where = ["--ip", LOOPBACK_RAY_IP]
    elif env.get("LLMLAB_HOST_IFACE"):
        where = ["--iface", env["LLMLAB_HOST_IFACE"]]
    else:
        where = []
    return [python, "-m", "llmlab.ops.launcher", "on-node", *where, "--"]


def mp_head_ip(env: dict, loopback: bool, addresses: Callable[[], list[str]] | None,
               iface_address: Callable[[str], str] | None, head: str) -> str:
    """The head's address for backend "mp": its ``--master-addr`` and its ``VLLM_HOST_IP``.  On the interface
    ``LLMLAB_HOST_IFACE`` names where it is set (``iface_address`` looks it up on this node; without one, as in a
    dry run or a notebook, the address is shown as a placeholder), else as :func:`head_ip` says."""
    iface = env.get("LLMLAB_HOST_IFACE")
    if env.get("LLMLAB_RAY_HEAD_IP") or loopback or not iface:
        return head_ip(env, loopback, addresses)
    return iface_address(iface) if iface_address else f"<{iface} address of {head}>"


# Said wherever an mp job is planned or started (``llmlab launch``, its dry run, the job's output): what it exposes.
MP_EXPOSURE = ("warning: backend mp on a shared cluster: vLLM's message queues (ZeroMQ, unauthenticated) carry "
               "pickled scheduler outputs, prompt token ids included, on each node's address, and the workers "
               "unpickle what they receive, so anyone who reaches the nodes' ports can read the prompts and likely run "
               "code in the workers; Ray, token-authenticated, is the default (backend 'ray'): use mp only where a "
               "firewall keeps other users off the nodes (docs/security.md).")


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
    mp_port: int = 0         # ... that port (drawn at random per job: :func:`choose_mp_port`)
    mp_workers: list[list[str]] = field(default_factory=list)  # ... and each other node's headless vLLM
    stage_from: str = ""     # LLMLAB_STAGE_DIR: the shared model folder copied to each node's local disk first

    @property
    def stage_argv(self) -> list[str]:
        """``llmlab weights stage`` of the shared folder into the stage folder (``model_path`` is the copy there),
        which the launcher runs on every node before vLLM starts; empty without LLMLAB_STAGE_DIR."""
        if not self.stage_from:
            return []
        return [self.python, "-m", "llmlab", "weights", "stage", self.stage_from, "--to",
                str(Path(self.model_path).parent)]

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
            lines.append(MP_EXPOSURE)
        else:
            lines.append("Ray: not needed (one node: vLLM starts its own worker processes)")
        if self.stage_from:
            lines.append(f"weights: {self.stage_from} copied to {self.model_path} on each node before vLLM starts "
                         "(llmlab weights stage; skipped where a verified copy is there)")
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
               f"nodes=({' '.join(map(q, self.nodes))})", f"stage_argv=({' '.join(map(q, self.stage_argv))})"]
        out += [f"export {k}={q(v)}" for k, v in self.env.items()]
        if self.ray:
            out += [f"ray_address={q(self.ray.address)}", f"ray_expected_gpus={self.ray.expected_gpus}",
                    f"ray_temp_dir={q(self.ray.temp_dir)}",
                    f"ray_head_cmd={q(shlex.join(self.ray.head_command()))}",
                    "ray_worker_cmds=(" + " ".join(q(shlex.join(self.ray.worker_command(i)))
                                                   for i in range(1, len(self.nodes))) + ")"]
        else:
            out += ["ray_address=", "ray_expected_gpus=0", "ray_temp_dir=", "ray_head_cmd=", "ray_worker_cmds=()"]
        out += [f"mp_master={q(self.mp_master)}", f"mp_port={self.mp_port}",
                "mp_worker_cmds=(" + " ".join(q(shlex.join(argv)) for argv in self.mp_workers) + ")"]
        return "\n".join(out) + "\n"


def render(job: JobSettings | str, *, job_id: str = "0", nodes: list[str] | None = None, port: int = 0,
           env: dict | None = None, python: str = "python3",
           addresses: Callable[[], list[str]] | None = None,
           port_free: Callable[[int], bool] | None = None,
           iface_address: Callable[[str], str] | None = None) -> RenderedJob:
    """Settings + the job's nodes -> the exact commands.  ``port=0`` leaves the port to the proxy, which binds a
    free one when the job starts and only then is it published (``wait-bound``).

    Environment knobs (all optional): ``LLMLAB_MODEL_PATH``, ``LLMLAB_MODEL_DIR``, ``LLMLAB_CACHE_DIR`` (HF
    and vLLM caches), ``LLMLAB_MAX_MODEL_LEN``, ``LLMLAB_EXTRA_VLLM_ARGS``, ``LLMLAB_BIND_HOST``,
    ``LLMLAB_ADVERTISE_HOST``, ``LLMLAB_LOOPBACK``, ``LLMLAB_RAY_HEAD_IP``, ``LLMLAB_RAY_PORT_BASE``,
    ``LLMLAB_RAY_HEAD_ARGS``, ``LLMLAB_RAY_WORKER_ARGS``, ``LLMLAB_RAY_TIMEOUT``, ``LLMLAB_READY_TIMEOUT``,
    ``LLMLAB_NCCL_IB``, ``LLMLAB_MP_PORTS``,
    ``LLMLAB_HOST_IFACE``, ``LLMLAB_STAGE_DIR`` (a node-local folder: vLLM loads the copy that
    ``llmlab weights stage`` makes there); ``LLMLAB_RUN_DIR`` (the launcher's private directory for vLLM's socket).
    ``addresses``: the node's own addresses, where its hostname resolves to loopback (:func:`head_ip`).
    ``port_free``: backend "mp" only, whether a port is free on this (the head) node (:func:`choose_mp_port`);
    ``iface_address``: this node's IPv4 address on an interface (``LLMLAB_HOST_IFACE``, :func:`mp_head_ip`).
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
    stage_from = ""
    if env.get("LLMLAB_STAGE_DIR"):  # the weights from node-local disk: a copy made there before vLLM starts
        if path == memory.HF_IDS.get(job.model, job.model) and not Path(path).is_dir():
            raise SettingsError(f"LLMLAB_STAGE_DIR copies a model folder to each node's disk, and this job loads "
                                f"{path} through the Hugging Face cache: set LLMLAB_MODEL_DIR (or LLMLAB_MODEL_PATH) "
                                "to the folder that `llmlab weights fetch` filled.")
        stage_from, path = path, str(Path(env["LLMLAB_STAGE_DIR"]) / Path(path).name)
    # vLLM on a Unix socket in a 0700 directory: only the job's user reaches it; the proxy on bind_host:port checks
    # the key of every request and forwards only /v1/*, /health and /metrics (llmlab.serve.proxy says why).
    run_dir = env.get("LLMLAB_RUN_DIR") or f"{env.get('TMPDIR') or '/tmp'}/llmlab-run-{job_id}"
    uds = f"{run_dir}/vllm.sock"
    try:
        extra = split_args(env.get("LLMLAB_EXTRA_VLLM_ARGS", ""))
    except ValueError as e:
        raise SettingsError(f"LLMLAB_EXTRA_VLLM_ARGS: {e}") from None
    flags = job_flags(job, ["--uds", uds], extra)
    # The CPU test job serves a model on disk; a GPU job may load from (or download into) $HF_HOME.
    run_env = vllm_env(job.engine, kv_cache_gib=job.kv_cache_gib, run_dir=run_dir, offline=job.engine == "cpu")
    if job.engine == "cpu" and job.tp * job.pp == 1:
        run_env.update(unbound_cpu_env(env, flags))  # one process less to start: the worker in the engine core
    if env.get("LLMLAB_CACHE_DIR"):
        cache = Path(env["LLMLAB_CACHE_DIR"])
        run_env.update({"HF_HOME": str(cache / "huggingface"), CACHE_ROOT: str(cache / "vllm")})
    if env.get("LLMLAB_NCCL_IB") == "1":
        run_env.update({k: env.get(k, v) for k, v in NCCL_IB_ENV.items()})
    ray = None
    if job.uses_ray:
        ray = RayLayout(nodes, head_ip(env, loopback, addresses), ray_port_base(job_id, env), job.gpus_per_node,
                        loopback, str(job_id), env.get("LLMLAB_RAY_TMPDIR") or env.get("TMPDIR") or "/tmp",
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
    rendered = RenderedJob(job, str(job_id), nodes, bind_host, host, port, uds, path, flags, run_env, ray, python,
                           stage_from=stage_from)
    if job.uses_mp_nodes:
        # vLLM's own multi-node mode: the head runs the API server and its GPUs' workers, every other node
        # `--headless` workers; they meet at the head's torch.distributed port, drawn at random (the launcher starts
        # the workers only once the head's own process listens there).
        master_host = mp_head_ip(env, loopback, addresses, iface_address, nodes[0])
        master_port = choose_mp_port(env, port_free)
        rendered.flags += ["--node-rank", "0", "--master-addr", master_host, "--master-port", str(master_port)]
        rendered.mp_master, rendered.mp_port = f"{master_host}:{master_port}", master_port
        run_env[HOST_IP] = master_host  # the head's message queues; each other node sets its own (on-node)
        prefix = on_node_prefix(python, env, loopback)
        rendered.mp_workers = [prefix + rendered.worker_argv(i) for i in range(1, len(nodes))]
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



RAY_NODE = re.compile(r"^\s*\d+\s+node_[0-9a-f]+", re.M)


RAY_GPU = re.compile(r"([\d.]+)/([\d.]+)\s+GPU\b")


def parse_ray_status(text: str) -> tuple[int, float]:
    """(active nodes, total GPUs) from ``ray status`` output (Ray 2.x's "Active:" and "Usage" sections)."""
    active = text.split("Active:", 1)[1].split("Pending:", 1)[0] if "Active:" in text else ""
    nodes = sum(int(m.group(0).split()[0]) for m in RAY_NODE.finditer(active))
    gpus = RAY_GPU.search(text)
    return nodes, float(gpus.group(2)) if gpus else 0.0
