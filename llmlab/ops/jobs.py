"""The cluster CLI's logic: launch a server as a SLURM job, follow it to READY, read its metrics and logs, stop it.

Why this module: in the workshop this course grew from, a learner edited log paths in an sbatch script,
polled ``sacct``, tailed a log for 40 minutes of "Loading safetensors checkpoint shards" and copied an IP
address into a notebook.  Here each of those steps is one function (and one ``llmlab`` sub-command):

- :func:`launch`: submit what ``llmlab.cluster.prepare`` planned (per-model defaults from ``slurm/models.toml``,
  overridden by the caller; the layout checked by ``llmlab.memory`` *before* anything is submitted; a job script
  rendered with those settings embedded), and save the script beside the job's logs.  The planning is the
  lesson's (``llmlab.cluster``: its ``layouts`` and ``plan``, pure).
- :func:`status`: PENDING -> STARTING -> LOADING -> READY, or FAILED with the reason, or STOPPED -- from
  SLURM (``scontrol``), the launcher's output, the vLLM log and the connection file.
- :func:`metrics`, :func:`logs`, :func:`stop`, :func:`listing`.

Everything a job writes stays under ``$LLMLAB_HOME`` (default ``~/.llmlab``), private to its user:
``jobs/ID.json`` (what was launched), ``logs/llmlab-ID.out`` (SLURM's output), ``logs/job-ID/`` (the job
script, its settings, vLLM's and Ray's logs), ``servers/job-ID.json`` (the connection file), ``keys/``.
No function here reads or prints a key: only the path of its file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from llmlab import cluster
from llmlab.cluster.layouts import JobError, check_layout
from llmlab.cluster.plan import Launch
from llmlab.serve.info import ServerError, ServerInfo, ended_jobs, ended_marker, llmlab_home, write_private

# SLURM states of a job that still holds its nodes, and those that mean it ended badly.
ACTIVE = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "RESIZING", "SIGNALING"}
SLURM_FAILED = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
ENDED = SLURM_FAILED | {"CANCELLED", "COMPLETED", "TIMEOUT", "REVOKED"}  # what SLURM says of a job that is over


def dry_run_lines(launch: Launch) -> str:
    """What the launcher would run for these settings: ``llmlab-serve.sh`` itself in dry-run mode, so that
    the printed ``vllm serve`` line and Ray layout are the job scripts' own, not a second rendering."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "settings.toml"
        path.write_text(launch.settings_text)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(LLMLAB_DRY_RUN="1", LLMLAB_SETTINGS_FILE=str(path), LLMLAB_PYTHON=sys.executable)
        out = subprocess.run(["bash", str(cluster.slurm_dir() / "llmlab-serve.sh"), launch.job.name],
                             capture_output=True, text=True, env=env, timeout=120)
    if out.returncode:
        raise JobError(f"The launcher's dry run failed: {(out.stderr or out.stdout).strip()}")
    return out.stdout


def require_slurm(command: str = "sbatch") -> None:
    if shutil.which(command) is None:
        raise JobError(f"`{command}` is not on PATH: this is not a SLURM login node. Run llmlab there (or use "
                       "`llmlab launch ... --dry-run` to see the job script).")


def _slurm(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a SLURM command; a machine whose SLURM cannot reach a controller gets one sentence, not its errors."""
    require_slurm(argv[0])
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if res.returncode and re.search(r"configuration source|Unable to contact slurm controller", res.stderr):
        raise JobError(f"`{argv[0]}` cannot reach a SLURM controller from this machine (no slurm.conf or the "
                       "controller is down): run llmlab on the cluster's login node.")
    return res


def jobs_dir() -> Path:
    path = llmlab_home() / "jobs"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


@dataclass(frozen=True)
class Submitted:
    """What :func:`launch` submitted: the job's id, where its script and output are, its layout.  Saved as JSON in
    :func:`jobs_dir` (``llmlab status`` reads it back with :func:`record_of`); ``llmlab launch --json`` prints
    :meth:`as_dict` beside the plan."""

    job_id: str
    name: str
    model: str
    script: str                  # the job script as submitted (0600), beside the job's logs
    output: str                  # SLURM's output file of the job
    submitted: str               # when, ISO 8601 UTC
    layout: dict                 # nodes, gpus, tp, pp, context
    share: dict | None = None    # {"group", "dir"} of a workshop server
    rehearse: bool = False       # a rehearsal (`llmlab launch --rehearse`), not a server

    def as_dict(self) -> dict:
        return asdict(self)


def launch(plan: Launch, name: str | None = None) -> Submitted:
    """Submit the rendered script with ``sbatch``; save it, its settings and a record beside the job's logs.
    ``name``: what the record and the first connection file call the job (default: the model's table), e.g. the
    front of several models (``llmlab.ops.front``)."""
    logs = llmlab_home() / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=logs, prefix="submit-", suffix=".sbatch", delete=False) as f:
        f.write(plan.script)
    try:
        res = _slurm("sbatch", "--parsable", f.name)
        if res.returncode:
            raise JobError(f"sbatch refused the job: {res.stderr.strip() or res.stdout.strip()}")
        job_id = res.stdout.strip().split(";")[0]
        log_dir = cluster.job_log_dir(job_id)
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        script = log_dir / "job.sbatch"
        os.replace(f.name, script)
    finally:
        Path(f.name).unlink(missing_ok=True)
    record = Submitted(job_id, name or plan.job.name, name or plan.job.model, str(script),
                       output=plan.sbatch_options["output"].replace("%j", job_id),
                       submitted=datetime.now(UTC).isoformat(timespec="seconds"),
                       layout={k: plan.report[k] for k in ("nodes", "gpus", "tp", "pp", "context")},
                       share={"group": plan.share[0], "dir": str(plan.share[1])} if plan.share else None,
                       rehearse=plan.rehearse)
    (jobs_dir() / f"{job_id}.json").write_text(json.dumps(record.as_dict(), indent=1))
    if not plan.rehearse:
        publish_queued(job_id, name or plan.job.name)
    return record


QUEUED = "waiting in SLURM's queue"


def publish_queued(job_id: str, name: str) -> None:
    """A "loading" connection file (the instructor's own) from the moment SLURM accepts the job.

    Why: a notebook that connects while the job waits for nodes must hear that the server is on its way, not get
    the embedded tiny model in its place.  The launcher rewrites the file with its address once its proxy
    listens; ``stop`` and ``status`` remove it when the job ends before the launcher ran.  A room's
    ``server.json`` is not written here: only the job, once READY (``share.publish``), so that a relaunch leaves
    the room on the server it has until the new one serves."""
    for marker in ended_jobs():  # a new job: connect() waits for it, no longer says an old one ended
        marker.unlink(missing_ok=True)
    info = ServerInfo(kind="slurm", host="", port=0, model=name, job_id=job_id, status="loading",
                      api_key_file=str(llmlab_home() / "keys" / f"job-{job_id}.key"), extra={"phase": QUEUED})
    info.write(cluster.connection_file_of(job_id))


def forget(job_id: str, ended: bool = False) -> None:
    """Remove what a job published, for a job whose launcher cannot do it any more: cancelled while queued, or
    killed before its clean-up ran.  ``connect()`` would otherwise keep saying that its server is loading.

    ``ended``: the job ended on its own (not ``llmlab stop``): its connection file is replaced by the marker its
    clean-up would have left (:func:`~llmlab.serve.info.ended_marker`), so ``connect()`` says it ended."""
    conn = cluster.connection_file_of(job_id)
    if ended and conn.exists():
        with contextlib.suppress(OSError, ServerError):
            write_private(ended_marker(job_id), ServerInfo.read(conn).model + "\n")
    conn.unlink(missing_ok=True)
    rec = record_of(job_id)
    if rec and rec.share:
        from llmlab.serve import share

        share.unpublish(rec.share["dir"], job_id)  # not a later job's publication


# --------------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------------

@dataclass
class JobStatus:
    """Where a server job is.  ``detail`` is the one line a person reads; the other fields are for scripts."""

    job_id: str
    state: str
    detail: str
    name: str | None = None
    slurm_state: str | None = None
    nodes: list[str] = field(default_factory=list)
    url: str | None = None
    model: str | None = None
    api_key_file: str | None = None
    use: str | None = None
    ray_nodes: tuple[int, int] | None = None
    progress: dict | None = None
    reason: str | None = None
    log_lines: list[str] = field(default_factory=list)
    output: str | None = None
    log_dir: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        head = f"job {self.job_id} ({self.name or '?'}): {self.state} - {self.detail}"
        more = [f"  use: {self.use}"] if self.use else []
        if self.log_lines:
            more += ["  last log lines:"] + [f"    {line}" for line in self.log_lines]
        return "\n".join([head, *more])


def scontrol_job(job_id: str) -> dict | None:
    """``scontrol show job -o ID`` as a dict; None once SLURM has forgotten the job (MinJobAge)."""
    if not re.fullmatch(r"\d+(_\d+)?", str(job_id)):
        raise JobError(f"{job_id!r} is not a SLURM job id (a number, e.g. 12345): `llmlab status` lists yours.")
    res = _slurm("scontrol", "show", "job", "-o", str(job_id))
    if res.returncode:
        if "Invalid job id" in res.stderr or "Invalid job id" in res.stdout:
            return None
        raise JobError(f"scontrol could not say where job {job_id} is: {res.stderr.strip()}")
    return dict(re.findall(r"(\w+)=(\S*)", res.stdout))


def record_of(job_id: str) -> Submitted | None:
    """What :func:`launch` saved of ``job_id``; None for a job llmlab did not submit (or an unreadable record)."""
    path = jobs_dir() / f"{job_id}.json"
    try:
        saved = json.loads(path.read_text())
        return Submitted(**{f.name: saved[f.name] for f in fields(Submitted) if f.name in saved})
    except (OSError, ValueError, TypeError):
        return None


def _read(path: Path | str | None) -> str:
    try:
        return Path(path).read_text(errors="replace") if path else ""
    except OSError:
        return ""


RAY_JOINED = re.compile(r"Ray: (\d+)/(\d+) nodes")
# (pattern in the launcher's output or vLLM's log, the reason in words); the first that matches names it.
FAILURES = [
    (re.compile(r"CUDA out of memory|OutOfMemoryError|No available memory for the cache blocks|"
                r"larger than the available KV cache memory|insufficient memory|Cannot allocate memory"),
     "out of memory: the weights and KV cache do not fit (try more GPUs, --max-model-len, or --dtype fp8)"),
    (re.compile(r"FAILED: Ray|Ray did not start on every node"),
     "Ray did not come up on every node (see the Ray logs in the job's log folder)"),
    (re.compile(r"does not appear to have a file named config\.json|is not a local folder|Can't load the "
                r"configuration|HFValidationError|Repo id must|No such file or directory: '[^']*config\.json'|"
                r"Invalid repository ID|not a valid model identifier|We couldn't connect to"),
     "the model path does not exist or holds no model (set LLMLAB_MODEL_PATH or LLMLAB_MODEL_DIR)"),
    # vLLM's own sentence (vllm/config/model.py:1549; llmlab.troubleshoot's "tp-heads" sign, lesson 19)
    (re.compile(r"must be divisible by tensor parallel size"),
     "the tensor-parallel size does not divide the model's attention heads (a TP that divides them, PP for the rest)"),
    (re.compile(r"api_server\.py: error:|error: unrecognized arguments|error: argument |invalid choice"),
     "vLLM rejected an argument (check --extra-vllm-args / LLMLAB_EXTRA_VLLM_ARGS)"),
    (re.compile(r"did not answer /health within"), "vLLM did not become ready in time (LLMLAB_READY_TIMEOUT)"),
    # vLLM's words when its engine core process ends without a word (vllm/v1/engine/core_client.py:818; lesson 19
    # kills one live, llmlab.troubleshoot's "core-exited" sign): something outside ended it
    (re.compile(r"engine core exited unexpectedly"),
     "vLLM's engine core was killed from outside, most often by the out-of-memory killer (`dmesg` on the node, "
     "`sacct -j JOB -o JobID,State,MaxRSS`)"),
    (re.compile(r"vLLM exited on its own"), "vLLM exited after it was ready"),
]
ERROR_LINE = re.compile(r"Error|FAILED|Traceback|Exception")
NOT_ERROR = re.compile(r"\b(WARNING|INFO|DEBUG)\b")


def failure(output: str, vllm_log: str) -> tuple[str, list[str]] | None:
    """(reason, relevant log lines) when the launcher reported a failure, else None."""
    launcher = [line for line in output.splitlines() if "FAILED:" in line]
    if not launcher:
        return None
    text = output + "\n" + vllm_log
    reason = next((why for pattern, why in FAILURES if pattern.search(text)), None)
    said = launcher[0].split("FAILED:", 1)[1].split(" Last lines of ")[0].strip().rstrip(".")
    lines = [line.strip() for line in (vllm_log or output).splitlines()
             if ERROR_LINE.search(line) and not NOT_ERROR.search(line)][-6:]
    return (f"{reason}: {said}" if reason else said), lines or output.splitlines()[-6:]


def _ready_status(st: JobStatus, conn: Path) -> JobStatus | None:
    """READY if the published server answers, FAILED if it stopped; None while the launcher's connection file
    still says "loading" (it publishes the server early, so that ``connect()`` can say so)."""
    try:
        info = ServerInfo.read(conn)
    except Exception as e:  # noqa: BLE001 - a broken file is reported, not raised
        return replace(st, state="FAILED", detail=f"its connection file is unreadable: {e}")
    if info.status == "loading":
        return None
    url = info.base_url
    st = replace(st, url=url, model=info.model, api_key_file=info.api_key_file, nodes=info.extra.get("nodes") or [],
                 use=f"client, model = llmlab.connect()  # or LLMLAB_CONNECTION_FILE={conn}")
    members = info.extra.get("members") or {}  # the front of several models (llmlab.ops.front)
    if cluster.is_alive(info, timeout=5):
        served = ", ".join(members) if members else info.model
        return replace(st, state="READY", detail=f"{served} at {url}{_shared(info)}")
    if members:  # its /health is 503 while any model is down: say which jobs to look at, not "the front failed"
        each = ", ".join(f"`llmlab status {job}` ({model})" for model, job in members.items())
        return replace(st, state="FAILED", detail=f"the front at {url} does not answer /health now: a model behind it "
                       f"is down, or the front itself; {each} says which", reason="a model or the front stopped",
                       use=None)
    return replace(st, state="FAILED", detail=f"the server at {url} was READY but does not answer /health now",
                   reason="the server stopped answering after READY", use=None)


def _shared(info: ServerInfo) -> str:
    """", shared with group G: N learners" for a workshop server (``llmlab launch --share``)."""
    if not info.extra.get("share_dir"):
        return ""
    from llmlab.serve import share

    who = share.learners(info.extra["share_dir"])
    active = sum(v == "registered" for v in who.values())
    revoked = len(who) - active
    return (f", shared with group {info.extra.get('group')}: {active} learner(s) registered"
            + (f", {revoked} revoked" if revoked else ""))


def revoke(job_id: str, name: str, undo: bool = False) -> str:
    """Shut one learner out of a shared server (``llmlab revoke JOB USER``), or give them back (``--undo``, for a
    revocation by mistake); the server keeps running either way."""
    from llmlab.serve import share

    info = server_info(job_id)
    if not info.extra.get("share_dir"):
        raise JobError(f"Job {job_id} is not shared (launch it with --share GROUP): there is nobody to revoke.")
    if undo:
        share.admit(info.extra["share_dir"], name)
        return f"{name} may use job {job_id}'s server again: their next llmlab.connect() registers their key"
    share.revoke(info.extra["share_dir"], name)
    return f"{name} can no longer use job {job_id}'s server (their key stops working within a second)"


def _rehearsal_status(st: JobStatus, slurm_state: str | None, output: str, result: Path) -> JobStatus:
    """A ``launch --rehearse`` job: running (its last progress line), done (where the results are), or failed."""
    lines = [line for line in output.splitlines() if line.strip()]
    if slurm_state in ACTIVE:
        return replace(st, state="LOADING", detail=f"rehearsing: {lines[-1] if lines else 'starting'}")
    if result.exists():
        return replace(st, state="STOPPED", detail=f"rehearsal done: {result}")
    return replace(st, state="FAILED", detail=f"the rehearsal wrote no {result.name} (SLURM: {slurm_state})",
                   reason="rehearsal failed", log_lines=lines[-6:])


def status(job_id: str) -> JobStatus:
    """The state of one llmlab server job, from SLURM and the files the launcher writes."""
    job_id = str(job_id)
    info, rec = scontrol_job(job_id), record_of(job_id)
    log_dir = cluster.job_log_dir(job_id)
    name = (rec.name if rec else None) or ((info or {}).get("JobName", "").removeprefix("llmlab-") or None)
    if rec is None and not log_dir.exists() and not (info or {}).get("JobName", "").startswith("llmlab-"):
        known = "SLURM knows it as " + repr(info.get("JobName")) if info else "SLURM does not know it"
        raise JobError(f"Job {job_id} is not an llmlab server ({known}, and {llmlab_home()} has no record of it): "
                       "`llmlab status` lists yours.")
    out_path = output_file(job_id, rec, info)
    output, vllm_log = _read(out_path), _read(log_dir / "vllm.log")
    slurm_state = (info or {}).get("JobState")
    st = JobStatus(job_id, "STARTING", "", name=name, slurm_state=slurm_state, output=out_path, log_dir=str(log_dir))
    if slurm_state != "PENDING" and rec and rec.rehearse:
        return _rehearsal_status(st, slurm_state, output, log_dir / "rehearsal" / "rehearsal.json")
    if slurm_state == "PENDING":
        reason = info.get("Reason", "None")
        return replace(st, state="PENDING", detail="waiting for nodes" + ("" if reason == "None" else
                                                                          f" (SLURM's reason: {reason})"))
    if slurm_state in ENDED:
        forget(job_id, ended=True)
    conn = cluster.connection_file_of(job_id)
    failed = failure(output, vllm_log)
    if slurm_state in ACTIVE and conn.exists():
        # A server that answers is READY, whatever its logs say on the way: a Ray attempt that failed and was
        # retried prints FAILED, and vLLM logs handled exceptions with tracebacks.
        ready = _ready_status(st, conn)
        if ready is not None and (ready.state == "READY" or not failed):
            return ready
    if failed:
        return replace(st, state="FAILED", detail=failed[0], reason=failed[0], log_lines=failed[1])
    if slurm_state in ACTIVE:
        if slurm_state == "COMPLETING" or "shutting down" in output:
            return replace(st, state="STOPPED", detail="stopping (the launcher is cleaning up)")
        if vllm_log or "starting vLLM" in output:
            progress = cluster.load_progress(vllm_log)
            detail = "vLLM answers; the launcher is publishing the connection file" if progress.ready else str(progress)
            return replace(st, state="LOADING", detail=detail, progress=asdict(progress))
        joined = RAY_JOINED.findall(output)
        if joined:
            n, total = map(int, joined[-1])
            return replace(st, detail=f"Ray: {n}/{total} nodes joined", ray_nodes=(n, total))
        return replace(st, detail="the job has started; bringing up Ray" if "Ray on " in output
                       else "the job has started")
    if slurm_state in SLURM_FAILED:
        return replace(st, state="FAILED", detail=f"SLURM ended the job: {slurm_state}", reason=slurm_state,
                       log_lines=output.splitlines()[-6:])
    why = {"CANCELLED": "was cancelled (scancel)", "COMPLETED": "ended", "TIMEOUT": "reached its time limit (--time)",
           None: "ended"}.get(slurm_state, slurm_state.lower())
    return replace(st, state="STOPPED", detail=f"the job {why}")


def my_jobs() -> list[str]:
    """Ids of this user's llmlab jobs: those SLURM has, those with a connection file, and recent records."""
    ids = set()
    if shutil.which("squeue"):
        res = subprocess.run(["squeue", "-h", "-u", os.environ.get("USER") or str(os.getuid()), "-o", "%i|%j"],
                             capture_output=True, text=True, timeout=60)
        ids |= {line.split("|")[0] for line in res.stdout.splitlines() if "|llmlab-" in line}
    ids |= {p.stem.removeprefix("job-") for p in cluster.servers_dir().glob("job-*.json")}
    day = time.time() - 86400
    ids |= {p.stem for p in jobs_dir().glob("*.json") if p.stat().st_mtime > day}
    return sorted(ids, key=lambda i: (len(i), i))


def latest_job() -> str:
    """The job id of the newest ``llmlab launch`` (what ``llmlab status --wait`` follows without an id)."""
    records = sorted(jobs_dir().glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not records:
        raise JobError("No job launched from this account yet: `llmlab launch MODEL` first, or name a job id.")
    return records[-1].stem


def all_status() -> list[dict]:
    """Every llmlab server of this user: SLURM jobs (newest last) and the embedded server."""
    from llmlab.serve import embedded

    rows = []
    if shutil.which("scontrol"):
        for job_id in my_jobs():
            try:
                rows.append(status(job_id).as_dict())
            except JobError as e:
                rows.append({"job_id": job_id, "state": "?", "detail": str(e)})
    emb = embedded.embedded_status()
    if emb:
        rows.append({"job_id": "embedded", "name": emb.model, "state": "READY" if emb.status == "ready" else "LOADING",
                     "detail": f"{emb.base_url} (pid {emb.pid})", "url": emb.base_url})
    return rows


def wait(job_id: str, timeout: float = 7200, poll: float = 2.0, on_change=None) -> JobStatus:
    """Poll :func:`status` until READY, FAILED or STOPPED; ``on_change(status)`` sees every new state/detail."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        st = status(job_id)
        if (st.state, st.detail) != last and on_change:
            on_change(st)
        last = (st.state, st.detail)
        if st.state in ("READY", "FAILED", "STOPPED"):
            return st
        if time.monotonic() > deadline:
            raise JobError(f"Job {job_id} is still {st.state} after {timeout:g} s ({st.detail}): "
                           f"`llmlab logs {job_id}` shows what it is doing.")
        time.sleep(poll)


# --------------------------------------------------------------------------------------------------
# Metrics, logs, stop, list
# --------------------------------------------------------------------------------------------------

def server_info(job_id: str) -> ServerInfo:
    """The connection file of a job's server (``"embedded"``: the embedded one): what ``llmlab metrics`` and
    ``llmlab top`` scrape, with its key file; a job without a server yet says where it is instead."""
    if job_id == "embedded":
        from llmlab.serve.embedded import state_file

        path = state_file()
    else:
        path = cluster.connection_file_of(job_id)
    if not path.exists():
        st = status(job_id) if job_id != "embedded" else None
        where = f"it is {st.state}: {st.detail}" if st else "the embedded server is not running (llmlab serve)"
        raise JobError(f"Job {job_id} has no server to ask ({where}).")
    return ServerInfo.read(path)


def histogram_quantile(metrics, name: str, q: float) -> float | None:
    """The ``q`` quantile of a Prometheus histogram (buckets summed over engines), interpolated inside the
    bucket as Prometheus' ``histogram_quantile`` does; None without observations."""
    from llmlab.serve.metrics import histogram

    try:
        return histogram(metrics, name).quantile(q)
    except KeyError:
        return None


def metrics(job_id: str, interval: float = 2.0) -> dict:
    """The server's load, from two ``/metrics`` scrapes ``interval`` seconds apart (rates need two)."""
    from llmlab.serve import metrics as vm  # vLLM's metric names: the one vocabulary

    info = server_info(job_id)
    url, key = info.base_url, info.key()
    first = vm.fetch_metrics(url, key)
    time.sleep(interval)
    m = vm.fetch_metrics(url, key)

    def rate(name: str) -> float:
        return (m.value(name, default=0.0) - first.value(name, default=0.0)) / interval

    queries = m.value(vm.PREFIX_QUERIES, default=0.0)
    out = {"job_id": job_id, "url": url, "requests_running": int(m.value(vm.RUNNING, default=0.0)),
           "requests_waiting": int(m.value(vm.WAITING, default=0.0)),
           "kv_cache_usage_pct": 100 * m.value(vm.KV_USAGE, default=0.0),
           "prompt_tokens_per_s": rate(vm.PROMPT_TOKENS),
           "generation_tokens_per_s": rate(vm.GENERATED),
           "prefix_cache_hit_rate": m.value(vm.PREFIX_HITS, default=0.0) / queries if queries else None,
           "requests_finished": int(m.value(vm.FINISHED, default=0.0)),
           "prompt_tokens_total": int(m.value(vm.PROMPT_TOKENS, default=0.0)),
           "generation_tokens_total": int(m.value(vm.GENERATED, default=0.0))}
    for label, name in (("latency", vm.E2E), ("ttft", vm.TTFT)):
        for q in (0.5, 0.9, 0.99):
            out[f"{label}_p{round(q * 100)}_s"] = histogram_quantile(m, name, q)
    return out


def metrics_rows(mx: dict) -> list[tuple[str, str]]:
    def s(x):
        return "-" if x is None else f"{x:.3f} s"

    hit = mx["prefix_cache_hit_rate"]
    return [("requests", f"{mx['requests_running']} running, {mx['requests_waiting']} waiting, "
                         f"{mx['requests_finished']} finished"),
            ("KV cache", f"{mx['kv_cache_usage_pct']:.1f} % in use"),
            ("tokens/s", f"{mx['prompt_tokens_per_s']:.1f} prompt, {mx['generation_tokens_per_s']:.1f} generated"),
            ("tokens so far", f"{mx['prompt_tokens_total']:,} prompt, {mx['generation_tokens_total']:,} generated"),
            ("prefix cache", "-" if hit is None else f"{100 * hit:.1f} % of looked-up tokens found"),
            ("latency p50/p90/p99", " / ".join(s(mx[f"latency_p{q}_s"]) for q in (50, 90, 99))),
            ("TTFT p50/p90/p99", " / ".join(s(mx[f"ttft_p{q}_s"]) for q in (50, 90, 99)))]


def output_file(job_id: str, rec: Submitted | None, info: dict | None) -> str | None:
    """The job's output: ``llmlab launch``'s record says where; a job of a plain ``sbatch slurm/NAME.sh`` has
    SLURM's ``StdOut`` at /dev/null, and its launcher writes ``~/.llmlab/logs/llmlab-ID.out`` itself (so that the
    file is private from its creation: slurm/llmlab-serve.sh says why)."""
    out = (rec.output if rec else None) or (info or {}).get("StdOut")
    return str(llmlab_home() / "logs" / f"llmlab-{job_id}.out") if out == "/dev/null" else out


def log_files(job_id: str) -> list[Path]:
    """The job's SLURM output, then vLLM's log, then each node's Ray log: those that exist."""
    rec, log_dir = record_of(job_id), cluster.job_log_dir(job_id)
    out = output_file(job_id, rec, None if rec else scontrol_job(job_id))
    paths = [Path(out)] if out else []
    paths += [log_dir / "vllm.log", *sorted(log_dir.glob("ray-*.log"))]
    found = [p for p in paths if p.exists()]
    if not found:
        raise JobError(f"Job {job_id} has written no log yet (or is not an llmlab job): `llmlab status {job_id}`.")
    return found


def stop(job_id: str, timeout: float = 120.0) -> JobStatus:
    """``scancel`` the job, then wait until the launcher has removed the connection file and key, stopped Ray
    and vLLM, and SLURM has released the nodes.  Raises if any of that is not confirmed in time.  The job's end is
    the user's wish: ``connect()`` is not told it ended (its marker goes), it falls back as without a job."""
    try:
        return _stop(job_id, timeout)
    finally:
        ended_marker(job_id).unlink(missing_ok=True)


def _stop(job_id: str, timeout: float) -> JobStatus:
    st = status(job_id)
    if st.slurm_state not in ACTIVE and st.slurm_state != "PENDING":
        return st
    res = _slurm("scancel", job_id)
    if res.returncode:
        raise JobError(f"scancel {job_id} failed: {res.stderr.strip()}")
    if st.slurm_state == "PENDING":  # its launcher never ran: nobody else removes the "queued" files
        forget(job_id)
    conn, deadline = cluster.connection_file_of(job_id), time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = scontrol_job(job_id)
        if (info is None or info.get("JobState") not in ACTIVE | {"PENDING"}) and not conn.exists():
            break
        time.sleep(1)
    else:
        raise JobError(f"Job {job_id} was cancelled but is still {status(job_id).slurm_state} after {timeout:g} s: "
                       f"check `squeue -j {job_id}` and `llmlab logs {job_id}`.")
    final = status(job_id)
    output = _read(final.output)
    if st.slurm_state != "PENDING" and "stopped; connection file and key removed" not in output:
        raise JobError(f"Job {job_id} ended but its launcher did not confirm the clean-up: `llmlab logs {job_id}`.")
    return final


def listing() -> list[dict]:
    """The shipped server settings with their checked plans (``llmlab list``)."""
    rows = []
    for job in cluster.load_settings().values():
        report = check_layout(job) if job.engine == "cpu" else cluster.layout_report(job)
        rows.append({"name": job.name, "model": job.model, "engine": job.engine, "nodes": job.nodes,
                     "gpus_per_node": job.gpus_per_node, "gpu": job.gpu if job.engine == "gpu" else None,
                     "tp": job.tp, "pp": job.pp, "dtype": job.dtype, "context": job.context,
                     "weights_gib_per_gpu": report["weights_gib_per_gpu"], "kv_tokens": report["kv_tokens"],
                     "max_concurrency": report["max_concurrency"], "fits": report["fits"],
                     "description": job.description})
    return rows
