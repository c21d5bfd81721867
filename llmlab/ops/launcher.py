"""The SLURM launcher's Python side: what ``slurm/llmlab-serve.sh`` runs, and how it waits.

Why here, not in the lesson: notebook 08 teaches the layouts (``llmlab.cluster``: settings, the ``vllm serve``
flags, TP vs PP, what a job renders, a server's load progress); this module starts what the rendering says and
watches it come up.  It is the launcher's own code, run by ``python -m llmlab.ops.launcher``:

- **Rendering** is ``llmlab.cluster.render`` (:func:`render`, :class:`RenderedJob`, :class:`RayLayout`,
  pure); this module adds the node's own addresses (``hostname -I``) for the head.
- **Ray** (:func:`wait_for_ray`): a wait that fails fast, with the node's log, when a node's Ray exits.
- **Readiness** (:func:`wait_until_ready`): poll ``/health`` through the proxy, print the load progress in the
  job's output, end before the job's time limit, then write the connection file.

``python -m llmlab.ops.launcher render|wait-ray|wait-ready|progress`` are internal helpers (the user-facing
commands are ``llmlab launch/status``).  No secret passes through here: the API key stays in its 0600 file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmlab import memory
from llmlab.cluster import SettingsError, load_progress
from llmlab.cluster.render import (
    LOOPBACK_RAY_IP,
    RenderedJob,
    parse_ray_status,
    render,
)
from llmlab.ops.weights import CACHE, WeightsError, private_folder
from llmlab.serve import vllm
from llmlab.serve.info import ServerError, ServerInfo, read_key, write_private


def node_addresses() -> list[str]:
    """This node's addresses, as ``hostname -I`` lists them: where the head's hostname resolves to loopback,
    the first real one is what the workers dial (``llmlab.cluster.render.head_ip``)."""
    return subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()


def ipv4_on(ip_output: str) -> str | None:
    """The first IPv4 address in ``ip -4 -o addr show dev IFACE``'s output, None if it lists none."""
    m = re.search(r"\binet (\d+\.\d+\.\d+\.\d+)/", ip_output)
    return m[1] if m else None


def interface_address(iface: str) -> str:
    """This node's IPv4 address on ``iface`` (``LLMLAB_HOST_IFACE``), or a :class:`SettingsError` that says what to
    set instead: a node without that interface would otherwise bind vLLM's queues on its default address."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    ip = ipv4_on(out)
    if ip is None:
        raise SettingsError(f"LLMLAB_HOST_IFACE={iface}: {socket.gethostname()} has no IPv4 address on {iface} "
                            f"(`ip -4 addr show dev {iface}` lists none): set LLMLAB_HOST_IFACE to the interface of "
                            "the cluster's private network that every node of the job has (`ip -br addr` lists "
                            "them), or unset it.")
    return ip


def say(message: str, file=None) -> None:
    """One line in the job's output, time-stamped like the launcher's own lines."""
    print(f"[llmlab {time.strftime('%H:%M:%S')}] {message}", flush=True, file=file or sys.stdout)


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


def port_is_free(port: int) -> bool:
    """Nobody listens on ``port`` on this node and it can be bound on every address, as torch's TCPStore binds its
    master port (``*:PORT``).  Used to draw backend "mp"'s master port (``render.choose_mp_port``)."""
    if listening_inodes(port):
        return False
    try:
        with socket.socket() as s:
            s.bind(("", port))
    except OSError:
        return False
    return True


def group_socket_inodes(pgid: int) -> set[str]:
    """Inodes of the sockets that the processes of process group ``pgid`` hold: vLLM runs under ``setsid``, so its
    API server, engine and worker processes are one group, and no other user's process can join it."""
    from llmlab.serve.proc import _stat

    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(entry.name)) and stat[2] == str(pgid):
            found |= socket_inodes(int(entry.name))
    return found


def group_port_holder(port: int, pgid: int) -> str:
    """Like :func:`port_holder`, for a process group: "ours" when every socket listening on ``port`` belongs to a
    process of group ``pgid``, "nobody" (yet) or "other"."""
    listening = listening_inodes(port)
    if not listening:
        return "nobody"
    return "ours" if listening <= group_socket_inodes(pgid) else "other"


def wait_for_master_port(port: int, pgid: int, log: Path, timeout: float, poll: float = 0.5) -> bool:
    """Backend "mp": wait until the head's own vLLM (process group ``pgid``) listens on its master ``port``, before
    any headless worker is started.

    Why: the workers dial that port and trust whatever answers (torch.distributed's store, then vLLM's pickled
    message queues).  Started first, as before, they would connect to anyone who took the port before the head's
    vLLM bound it.  So the head starts first, and a port held by any process outside the head's vLLM fails the
    job at once, with no worker started.  Returns True once the port is the head's."""
    from llmlab.serve.proc import pid_alive

    start = time.monotonic()
    while True:
        holder = group_port_holder(port, pgid)
        if holder == "ours":
            say(f"vLLM's master port {port} is held by the head's own vLLM: starting the headless workers")
            return True
        if holder == "other":
            say(f"FAILED: another process, not this job's vLLM, listens on the master port {port}: the headless "
                "workers were not started (they would have connected to it). Submit the job again (it draws another "
                "port), and tell the cluster's administrators if it happens again.")
            return False
        if not pid_alive(pgid):
            say(f"FAILED: vLLM exited before it listened on its master port {port}. Last lines of {log}:\n"
                f"{tail(log, 25)}")
            return False
        if time.monotonic() - start > timeout:
            say(f"FAILED: vLLM did not listen on its master port {port} within {timeout:g} s; the headless workers "
                f"were not started. Last lines of {log}:\n{tail(log, 15)}")
            return False
        time.sleep(poll)


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


def check_cache_dir(env: dict) -> None:
    """``LLMLAB_CACHE_DIR``, where set, must be a folder only the job's user (and root) can change, as the stage
    folder must (:func:`llmlab.ops.weights.private_folder`, made 0700 if missing): vLLM runs the compiled code it
    finds in its cache and, for a model named by its id, serves the weights and chat template of the Hugging Face
    cache there, so whoever can write it chooses both.  Raises ``WeightsError`` naming the folder and the fix."""
    if env.get("LLMLAB_CACHE_DIR"):
        private_folder(env["LLMLAB_CACHE_DIR"], CACHE)


def check_mp_exposure(rendered: RenderedJob, env: dict) -> None:
    """Backend mp across nodes binds vLLM's unauthenticated message queues on each node's address (pickled scheduler
    outputs, prompts included; render.MP_EXPOSURE): without ``LLMLAB_HOST_IFACE`` that is the address the hostname
    resolves to, which every user of the cluster may reach (security-review-3, F11).  Such a job starts only when
    the instructor says so, ``LLMLAB_MP_ACCEPT_EXPOSURE=1`` (a firewall keeps other users off the nodes); a named
    interface and loopback (the CPU test bed, one host) need nothing.  Raises SettingsError naming both ways."""
    on_loopback = rendered.env.get(vllm.HOST_IP) == LOOPBACK_RAY_IP
    if (rendered.mp_workers and not on_loopback and not env.get("LLMLAB_HOST_IFACE")
            and env.get("LLMLAB_MP_ACCEPT_EXPOSURE") != "1"):
        raise SettingsError("backend mp across nodes would bind vLLM's unauthenticated message queues on each node's "
                            "public address, where any cluster user can read the prompts: set LLMLAB_HOST_IFACE to "
                            "the nodes' private interface (e.g. ib0; `ip -br addr` on a compute node lists them), or "
                            "LLMLAB_MP_ACCEPT_EXPOSURE=1 where a firewall keeps other users off the nodes, or use "
                            "Ray, the default (docs/security.md).")


def _cmd_render(a) -> int:
    check_cache_dir(os.environ)
    rendered = render(a.job, job_id=a.job_id, nodes=a.nodes.split() if a.nodes else None, port=a.port,
                      python=a.python, addresses=node_addresses, port_free=port_is_free,
                      iface_address=None if os.environ.get("LLMLAB_DRY_RUN") == "1" else interface_address)
    check_mp_exposure(rendered, os.environ)
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
    """Write the job's connection file (and at READY a room's ``server.json``): "loading" from the launcher's first
    seconds, with the phase, so that ``llmlab.connect()`` says the server is still loading instead of starting the
    embedded tiny model; "ready" once ``/health`` answered.  The key stays in its 0600 file."""
    extra = {"nodes": a.nodes.split(), "tp": a.tp, "pp": a.pp, "engine": a.engine, "ray_address": a.ray_address or None,
             **extra}
    if phase is not None:
        extra["phase"] = phase
    return publish_connection(Path(a.connection_file), kind="slurm", host=a.host, port=a.port, model=a.model,
                              api_key_file=a.key_file, job_id=a.job_id, status=status, **extra)


def publish_connection(path: Path, **fields) -> ServerInfo:
    """Write a job's connection file with ``fields``, and under ``llmlab launch --share GROUP`` (LLMLAB_SHARE_DIR)
    the room's ``server.json``, where the group's learners look (:func:`publish_room`).  ``started`` is the first
    publication's time, kept through every rewrite.  The launcher and the front of several models
    (``llmlab.ops.front``) both publish so."""
    if os.environ.get("LLMLAB_SHARE_DIR"):
        fields.update(share_dir=os.environ["LLMLAB_SHARE_DIR"], group=os.environ.get("LLMLAB_SHARE_GROUP"))
    try:
        before = ServerInfo.read(path)
        fields["started"] = before.started
    except ServerError:
        before = None
    info = ServerInfo.from_dict(fields)
    info.write(path)
    if fields.get("share_dir"):
        publish_room(fields["share_dir"], info, was_ready=before is not None and before.status == "ready")
    return info


def publish_room(share_dir: str, info: ServerInfo, was_ready: bool) -> None:
    """The room's ``server.json``: taken over at the job's first READY, updated after only while it is still this
    job's, and never written while the job loads.

    Why: a relaunch (a new job READY, then the old one stopped) must keep the room on the old server until the new
    one serves, and the old job's later rewrites must not take the room back from the new one."""
    from llmlab.serve import share

    if info.status == "ready" and (not was_ready or share.holder(share_dir) == info.job_id):
        share.publish(share_dir, info)


def _cmd_unpublish(a) -> int:
    """The job's clean-up: remove the room's ``server.json`` if this job wrote it (``share.unpublish``)."""
    from llmlab.serve import share

    if share.unpublish(a.share_dir, a.job_id):
        say(f"removed {a.share_dir}/server.json: the room has no server now")
    elif other := share.holder(a.share_dir):
        say(f"left {a.share_dir}/server.json to job {other}, which serves the room now")
    return 0


def _cmd_wait_bound(a) -> int:
    """Print the port the job's proxy bound, once its ready file says so: the launcher publishes nothing before."""
    from llmlab.serve.proc import pid_alive
    from llmlab.serve.proxy.command import wait_bound

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
    if info.extra.get("share_dir"):
        say(f"shared with group {info.extra.get('group')}: learners set "
            f"LLMLAB_CONNECTION_FILE={Path(info.extra['share_dir']) / 'server.json'}")
    say(f"READY: {a.model} at {url} (job {a.job_id}, {info.extra['ready_after_s']:g} s after the job started)")
    print(f"  notebook:  client, model = llmlab.connect()    # finds {a.connection_file}\n"
          f"  pinned:    LLMLAB_CONNECTION_FILE={a.connection_file}\n"
          f"  curl:      {curl_line(url, a.key_file)}", flush=True)
    return 0


def curl_config_file(key_file: Path | str) -> Path:
    """The curl config beside the key (``job-ID.curl``): the launcher's clean-up removes it with the key."""
    return Path(key_file).with_suffix(".curl")


def curl_line(url: str, key_file: Path | str) -> str:
    """The ``curl`` line the job prints at READY, after writing the key's header into a 0600 curl config.

    Why a config file: ``-H "Authorization: Bearer $(cat KEY)"`` puts the key into curl's arguments, which every
    user of the node reads in ``ps`` while curl runs; ``curl --config FILE`` reads the header from the file (any
    curl, RHEL 7's 7.29 included, knows ``--config``)."""
    config = curl_config_file(key_file)
    write_private(config, "# llmlab: this job's API key for curl (removed when the job ends)\n"
                          f'header = "Authorization: Bearer {read_key(key_file)}"\n')
    return f"curl --config {config} {url}/models"


def _cmd_wait_master(a) -> int:
    return 0 if wait_for_master_port(a.port, a.pid, Path(a.log), a.timeout, a.poll) else 1


def _cmd_on_node(a) -> int:
    """A headless node's vLLM (backend "mp") with ``VLLM_HOST_IP`` set to this node's own address, then exec'd:
    vLLM binds its unauthenticated message queues there (``render.on_node_prefix`` says why)."""
    from llmlab.cluster.render import head_ip

    ip = a.ip or (interface_address(a.iface) if a.iface else head_ip({}, False, node_addresses))
    os.environ[vllm.HOST_IP] = ip
    say(f"{socket.gethostname()}: vLLM's message queues bind to {ip} (VLLM_HOST_IP"
        f"{f', the address of {a.iface}' if a.iface else ''})", file=sys.stderr)
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    os.execvp(argv[0], argv)


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
    u = sub.add_parser("unpublish", help="remove the room's server.json if this job wrote it")
    u.add_argument("--share-dir", required=True)
    u.add_argument("--job-id", required=True)
    u.set_defaults(func=_cmd_unpublish)
    m = sub.add_parser("wait-master", help="backend mp: wait until the head's vLLM holds its master port")
    m.add_argument("--port", type=int, required=True)
    m.add_argument("--pid", type=int, required=True, help="the head's vLLM, leader of its process group (setsid)")
    m.add_argument("--log", required=True)
    m.add_argument("--timeout", type=float, default=600)
    m.add_argument("--poll", type=float, default=0.5)
    m.set_defaults(func=_cmd_wait_master)
    n = sub.add_parser("on-node", help="backend mp: set VLLM_HOST_IP to this node's address, then run the command")
    n.add_argument("--ip", help="the address itself (the CPU test bed's loopback)")
    n.add_argument("--iface", help="the interface whose address vLLM binds to (LLMLAB_HOST_IFACE)")
    n.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND...")
    n.set_defaults(func=_cmd_on_node)
    g = sub.add_parser("progress")
    g.add_argument("log")
    g.set_defaults(func=_cmd_progress)
    a = p.parse_args(argv)
    try:
        return a.func(a)
    except (SettingsError, memory.ConfigError, memory.PlanError, WeightsError) as e:
        say(f"FAILED: {e}", file=sys.stderr)  # stderr: the launcher captures render's stdout
        return 2


if __name__ == "__main__":
    sys.exit(main())
