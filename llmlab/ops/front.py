"""Several models, one endpoint on a cluster (issue 41): ``llmlab launch llama3.1-8b llama3.1-70b``.

The design, the smallest that fits the launcher: each model is the job it always was (its own nodes, its own
``slurm/llmlab-serve.sh``, key, proxy and connection file: nothing in the launcher changes), and one more job, the
*front*, a single CPU task, waits until every model's job answers, then runs llmlab's proxy as a router in front of
them (``--upstream MODEL=http://node:port``, each with that job's own key file: :mod:`llmlab.serve.proxy`) and
publishes the one endpoint: its connection file and, with ``--share``, the room's ``server.json``.  Learners register
their keys with the front only; the models' jobs accept their owner's key alone.

Why not the router inside the first model's job: the 8B's job ending would take the 70B off the air with it, and
the launcher's shell would grow a second mode.  Why not one heterogeneous SLURM job: sites differ in whether they
allow them, and one model's failed load would end the others.  Why several models in one call and not a group in
``models.toml``: each model already has its table there; a set is a command line (``docs/workshop.md`` keeps it).

``python -m llmlab.ops.front --job ID --job ID`` is what the front job runs (:func:`serve_front`); :func:`launch_set`
submits the models' jobs and the front.  No secret passes through here: keys stay in their 0600 files.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmlab import cluster
from llmlab.cluster.layouts import JobError
from llmlab.cluster.plan import DEFAULT_TIME, Launch, _quoted, one_line
from llmlab.serve.info import ServerError, ServerInfo, ended_marker, llmlab_home, new_key_file, write_private

WAIT_POLL = 5.0  # seconds between two looks at the models' connection files
FRONT_TIMEOUT = 3 * 3600.0  # seconds the front waits for every model (a 405B loads in about 40 min)


def check_set(plans: list[Launch]) -> None:
    """Refuse a set the router could not tell apart: two jobs that serve one model name (requests name a model,
    so they would be replicas, each with a key of its own; launch replicas of one model as one job instead)."""
    if len(plans) < 2:
        raise JobError("a set is two models or more: `llmlab launch llama3.1-8b llama3.1-70b` (one model: "
                       "`llmlab launch MODEL`).")
    served = [plan.job.name for plan in plans]  # the name each job's vLLM serves (--served-model-name)
    if twice := sorted({n for n in served if served.count(n) > 1}):
        raise JobError(f"{', '.join(twice)} given twice: a set routes by the request's model, so give each model "
                       "once (`llmlab launch llama3.1-8b llama3.1-70b`).")


def front_script(job_ids: list[str], names: list[str], options: dict[str, str], extra_sbatch: list[str] = (),
                 share: tuple[str, Path] | None = None, python: str | None = None, command: str = "") -> str:
    """The front job's script: ``#SBATCH`` lines, then ``python -m llmlab.ops.front --job ID ...``.  Every value goes
    through :func:`~llmlab.cluster.plan.one_line`, as in the models' own job scripts."""
    command = one_line("the `llmlab launch` command line", command)
    lines = ["#!/bin/bash", f"# Rendered by `llmlab launch {command}`: one endpoint in front of "
             + ", ".join(f"job {j} ({one_line('a model name', n)})" for j, n in zip(job_ids, names, strict=True)),
             "# Resubmit as it is with `sbatch THIS_FILE` while those jobs run."]
    for k, v in options.items():
        lines.append(f"#SBATCH --{one_line('an #SBATCH option', k)}={one_line(f'#SBATCH --{k}', v)}")
    lines += [f"#SBATCH {one_line('the --sbatch option', a)}" for a in extra_sbatch]
    lines += ["set -euo pipefail", "umask 077", f"export LLMLAB_HOME={_quoted('LLMLAB_HOME', llmlab_home())}",
              f"export LLMLAB_PYTHON=${{LLMLAB_PYTHON:-{_quoted('the Python of the job', python or sys.executable)}}}",
              *([f"export LLMLAB_SHARE_GROUP={_quoted('the share group', share[0])}",
                 f"export LLMLAB_SHARE_DIR={_quoted('the share folder', share[1])}"] if share else []),
              'exec "$LLMLAB_PYTHON" -m llmlab.ops.front ' + " ".join(f"--job {_quoted('a job id', j)}"
                                                                    for j in job_ids)]
    return "\n".join(lines) + "\n"


def front_options(account: str | None, partition: str | None, time_limit: str | None,
                  plans: list[Launch] = ()) -> dict[str, str]:
    """The front's allocation: one task of two CPUs, no GPU (the router is an event loop and a parser), for
    ``time_limit`` or else as long as the longest of the models' jobs (``plans``): it must not end before them."""
    from llmlab.ops.launcher import seconds_left

    times = [p.sbatch_options["time"] for p in plans]
    longest = max(times, key=lambda t: seconds_left(t) or 0, default=DEFAULT_TIME)
    options = {"job-name": "llmlab-front", "nodes": "1", "ntasks-per-node": "1", "cpus-per-task": "2",
               "time": time_limit or longest}
    options.update({k: v for k, v in (("account", account), ("partition", partition)) if v})
    options["output"] = str(llmlab_home() / "logs" / "llmlab-%j.out")
    return options


def launch_set(plans: list[Launch], options: dict[str, str], extra_sbatch: list[str] = (),
               share: tuple[str, Path] | None = None, command: str = ""):
    """Submit every model's job (as ``llmlab launch MODEL`` would, not shared), then the front (shared, if asked);
    returns the models' records and the front's (:class:`llmlab.ops.jobs.Submitted` each)."""
    from llmlab.ops import jobs

    check_set(plans)
    members = []
    for plan in plans:
        try:
            members.append(jobs.launch(plan))
        except JobError as e:
            raise JobError(f"{e}{_left_running(members)} Nothing else was submitted.") from None
    script = front_script([m.job_id for m in members], [p.job.name for p in plans], options, extra_sbatch, share,
                          command=command)
    try:
        front = jobs.launch(Launch(plans[0].job, {"nodes": 1, "gpus": 0, "tp": 0, "pp": 0, "context": 0}, script,
                                   options, share=share), name="front: " + " + ".join(p.job.name for p in plans))
    except JobError as e:  # the models' jobs run on: keep the front's script for a resubmission
        saved = llmlab_home() / "logs" / f"front-{'-'.join(m.job_id for m in members)}.sbatch"
        saved.write_text(script)
        raise JobError(f"{e} (the front job){_left_running(members)} The front's script is saved: once the "
                            f"cause is fixed, `sbatch {saved}` submits it as it is.") from None
    return members, front


def _left_running(members) -> str:
    """A sentence naming the models' jobs already submitted when a later sbatch was refused (they run on)."""
    if not members:
        return ""
    named = ", ".join(f"{m.job_id} ({m.name})" for m in members)
    stops = "; ".join(f"llmlab stop {m.job_id}" for m in members)
    return f" The jobs already submitted keep going: {named}; stop them with `{stops}` if they are not wanted."


# -- inside the front job

def say(message: str) -> None:
    print(f"[llmlab {time.strftime('%H:%M:%S')}] {message}", flush=True)


def members_ready(job_ids: list[str]) -> tuple[list[ServerInfo], list[str]]:
    """The models' connection files that say "ready", and a phrase for each job still on its way.  Raises
    ServerError for a job whose connection file is gone: it ended, or was stopped, before it answered."""
    ready, waiting = [], []
    for job_id in job_ids:
        path = cluster.connection_file_of(job_id)
        try:
            info = ServerInfo.read(path)
        except ServerError:
            why = "it ended" if ended_marker(job_id).exists() else "it ended or was stopped"
            raise ServerError(f"job {job_id}'s connection file {path} is gone: {why} before the front could route "
                              f"to it; `llmlab status {job_id}` says why. Launch the set again.") from None
        if info.status == "ready":
            ready.append(info)
        else:
            waiting.append(f"job {job_id} ({info.model}: {info.extra.get('phase') or info.status})")
    return ready, waiting


def wait_for_members(job_ids: list[str], timeout: float = FRONT_TIMEOUT, poll: float = WAIT_POLL,
                     on_wait=None) -> list[ServerInfo]:
    """Wait until every model's job is ready; print what is awaited whenever it changes (``on_wait`` hears it too)."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        ready, waiting = members_ready(job_ids)
        if not waiting:
            return ready
        line = "waiting for " + ", ".join(waiting)
        if line != last:
            say(line)
            if on_wait is not None:
                on_wait(line)
            last = line
        if time.monotonic() > deadline:
            raise ServerError(f"not every model answered within {timeout:g} s: {line}. `llmlab status` shows each "
                              "job; stop the front (`llmlab stop`) and launch the set again once they load.")
        time.sleep(poll)


def ended_members(members: list[ServerInfo]) -> list[ServerInfo]:
    """The models whose jobs have ended since the front routed to them: the launcher's ``ended`` marker is there,
    or the job's connection file is gone."""
    return [m for m in members
            if ended_marker(m.job_id).exists() or not cluster.connection_file_of(m.job_id).exists()]


def watch_members(front: Front, members: list[ServerInfo], publish, poll: float = WAIT_POLL) -> int:
    """Serve until the router exits, looking at the models' jobs every ``poll`` seconds.  A model whose job ended is
    said once, in the job's output and in the front's connection file (``ended``); the router answers its requests
    503, since that job's port no longer proves it holds the job's key (``llmlab.serve.proxy``, security-review-3
    F1).  Once every model's job has ended the front ends too: nothing is left to route to.  Returns the exit code."""
    gone: list[str] = []
    while (code := front.router.poll()) is None:
        ended = [m.model for m in ended_members(members) if m.model not in gone]
        if ended:
            gone += ended
            say(f"the job of {', '.join(ended)} ended: requests for it now get 503 with that sentence"
                + ("" if len(gone) < len(members) else "; no model is left, so the front ends too"))
            publish(list(gone))
            if len(gone) == len(members):
                front.router.terminate()
                return 0
        time.sleep(poll)
    return code


def router_upstreams(members: list[ServerInfo]) -> tuple[dict[str, list[str]], dict[str, Path]]:
    """``{model: [its job's proxy URL]}`` and ``{model: its job's key file}``: what the router fronts."""
    return ({m.model: [f"http://{m.host}:{m.port}"] for m in members},
            {m.model: Path(m.api_key_file) for m in members})


class Front:
    """The front's own state: its key, its router process, its connection file; :meth:`close` removes them."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.log_dir = cluster.job_log_dir(job_id)
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.key_file = llmlab_home() / "keys" / f"job-{job_id}.key"
        self.conn_file = cluster.connection_file_of(job_id)
        self.share_dir = os.environ.get("LLMLAB_SHARE_DIR")
        self.host = os.environ.get("LLMLAB_ADVERTISE_HOST") or socket.gethostname()
        self.bind = os.environ.get("LLMLAB_BIND_HOST") or "0.0.0.0"
        self.router: subprocess.Popen | None = None
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"llmlab-front-{job_id}."))  # 0700: the router's ready file

    def publish(self, status: str, port: int = 0, models: list[str] = (), **extra) -> ServerInfo:
        """The front's connection file (and the room's ``server.json``): what ``llmlab.connect()`` finds."""
        from llmlab.ops.launcher import publish_connection

        return publish_connection(self.conn_file, kind="slurm", host=self.host if port else "", port=port,
                                  model=models[0] if models else "several models", status=status,
                                  api_key_file=str(self.key_file), job_id=self.job_id, models=list(models), **extra)

    def start_router(self, members: list[ServerInfo]) -> int:
        """The router in front of the models' jobs, bound before anything names its port; returns the port."""
        from llmlab.serve.proxy.command import proxy_command, wait_bound

        new_key_file(self.key_file)
        upstreams, key_files = router_upstreams(members)
        keys = os.environ.get("LLMLAB_KEYS") or (f"{self.share_dir}/keys" if self.share_dir else None)
        ready, log = self.run_dir / "router.ready", self.log_dir / "router.log"
        cmd = proxy_command(f"{self.bind}:0", upstreams, self.key_file, keys=Path(keys) if keys else None,
                            ready_file=ready, upstream_key_files=key_files, watch_pid=os.getpid())
        with open(log, "w") as out:
            self.router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return wait_bound(ready, lambda: self.router.poll() is None, log)["port"]

    def close(self) -> None:
        """Secrets and publications first (the key, the connection files), then the router.  A second SIGTERM
        (SLURM signals every process of the step, and ``llmlab stop`` may follow) must not cut this short."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.conn_file.exists():
            write_private(ended_marker(self.job_id), "the front of several models\n")
        self.conn_file.unlink(missing_ok=True)
        if self.share_dir:
            from llmlab.serve import share

            share.unpublish(self.share_dir, self.job_id)  # not a later job's publication
        self.key_file.unlink(missing_ok=True)
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            self.router.wait(timeout=20)
        for leftover in self.run_dir.iterdir():
            leftover.unlink(missing_ok=True)
        self.run_dir.rmdir()


def serve_front(job_ids: list[str], job_id: str, timeout: float = FRONT_TIMEOUT, poll: float = WAIT_POLL) -> int:
    """The front job: wait for the models, route to them, publish the one endpoint, and serve until SLURM (or
    ``llmlab stop``) ends the job or the router exits.  Returns the exit code."""
    from llmlab.serve.info import read_key
    from llmlab.serve.proc import health

    front = Front(job_id)
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        front.publish("loading", phase="waiting for the models' jobs")
        members = wait_for_members(job_ids, timeout, poll, on_wait=lambda line: front.publish("loading", phase=line))
        models = [m.model for m in members]
        port = front.start_router(members)
        deadline = time.monotonic() + 60
        while not health(front.host, port, api_key=read_key(front.key_file)):
            if front.router.poll() is not None or time.monotonic() > deadline:
                raise ServerError(f"the router did not answer /health for every model within 60 s; its log "
                                  f"{front.log_dir / 'router.log'} says why.")
            time.sleep(1)
        jobs_of = {m.model: m.job_id for m in members}
        info = front.publish("ready", port, models, members=jobs_of)
        say(f"READY: {', '.join(models)} at {info.base_url} (job {job_id}, in front of jobs "
            f"{', '.join(m.job_id for m in members)})")
        print(f"  notebook:  client, model = llmlab.connect()    # then model=... one of {', '.join(models)}\n"
              f"  pinned:    LLMLAB_CONNECTION_FILE={front.conn_file}", flush=True)
        return watch_members(front, members, lambda gone: front.publish("ready", port, models, members=jobs_of,
                                                                        ended=gone), poll)
    except ServerError as e:
        say(f"FAILED: {e}")
        return 1
    finally:
        front.close()
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmlab.ops.front",
                                description="The front job of `llmlab launch MODEL MODEL ...` (not a user command).")
    p.add_argument("--job", action="append", required=True, help="a model's job id (one per model)")
    p.add_argument("--timeout", type=float, default=FRONT_TIMEOUT, help="seconds to wait for every model")
    p.add_argument("--poll", type=float, default=WAIT_POLL)
    a = p.parse_args(argv)
    return serve_front(a.job, os.environ.get("SLURM_JOB_ID", "0"), a.timeout, a.poll)


if __name__ == "__main__":
    sys.exit(main())
