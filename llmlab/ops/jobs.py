"""The cluster CLI's logic: launch a server as a SLURM job, follow it to READY, read its metrics and logs, stop it.

Why this module: in the workshop this course grew from, a learner edited log paths in an sbatch script,
polled ``sacct``, tailed a log for 40 minutes of "Loading safetensors checkpoint shards" and copied an IP
address into a notebook.  Here each of those steps is one function (and one ``llmlab`` sub-command):

- :func:`prepare` / :func:`launch`: per-model defaults from ``slurm/models.toml`` (the settings the job
  scripts use), overridden by the caller; the layout checked by ``llmlab.memory`` *before* anything is
  submitted; a job script rendered with those settings embedded, saved beside the job's logs.
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
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from llmlab import cluster, memory
from llmlab.serve.info import ServerInfo, llmlab_home

REHEARSAL_DIR = "$LLMLAB_HOME/logs/job-$SLURM_JOB_ID/rehearsal"  # where `launch --rehearse` writes its results
DEFAULT_TIME = "04:00:00"
# SLURM states of a job that still holds its nodes, and those that mean it ended badly.
ACTIVE = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STAGE_OUT", "RESIZING", "SIGNALING"}
SLURM_FAILED = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
ENDED = SLURM_FAILED | {"CANCELLED", "COMPLETED", "TIMEOUT", "REVOKED"}  # what SLURM says of a job that is over


class JobError(RuntimeError):
    """One sentence for the user: what is wrong and what to do.  The CLI prints it without a traceback."""


# --------------------------------------------------------------------------------------------------
# Settings: models.toml + the caller's overrides
# --------------------------------------------------------------------------------------------------

def settings(name: str, *, nodes: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None,
             tp: int | None = None, pp: int | None = None, dtype: str | None = None,
             max_model_len: int | None = None, extra_args: list[str] | None = None,
             backend: str | None = None, expert_parallel: bool | None = None) -> cluster.JobSettings:
    """The shipped settings of ``name`` with overrides applied and checked like models.toml's own.

    ``name`` is a job of models.toml, or any shipped model (``llmlab.memory.shipped_models``), which the planner
    lays out when no TP/PP is given.  Changing TP or PP without saying where the GPUs are keeps the course's
    rule: TP inside a node, one pipeline stage per node (``nodes = pp``, ``gpus_per_node = tp``).
    """
    if gpu is not None:
        try:
            gpu = memory.gpu(gpu).name
        except memory.ConfigError as e:
            raise JobError(str(e)) from None
    if dtype is not None:
        try:
            dtype = memory.normalize_dtype(dtype)
        except memory.ConfigError as e:
            raise JobError(str(e)) from None
    try:
        job = cluster.job_settings(name)
    except cluster.SettingsError as e:
        if name not in memory.shipped_models() or name == "llmlab-tiny":
            raise JobError(str(e)) from None
        job = _planned_job(name, gpu, dtype, max_model_len, gpus_per_node, bool(expert_parallel),
                           bool(tp or pp))
    changes = {k: v for k, v in dict(nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu, tp=tp, pp=pp, dtype=dtype,
                                     max_model_len=max_model_len, backend=backend,
                                     expert_parallel=expert_parallel).items() if v is not None}
    if extra_args:
        changes["extra_args"] = tuple(job.extra_args) + tuple(extra_args)
    if (tp or pp) and job.engine == "gpu" and nodes is None and gpus_per_node is None:
        changes.update(nodes=pp or job.pp, gpus_per_node=tp or job.tp)
    job = replace(job, **changes)
    try:
        cluster.check_settings(job, Path("llmlab launch"))
    except cluster.SettingsError as e:
        raise JobError(str(e).replace("llmlab launch [", "[")) from None
    return job


def _planned_job(model: str, gpu: str | None, dtype: str | None, context: int | None, node_gpus: int | None,
                 expert_parallel: bool, layout_given: bool) -> cluster.JobSettings:
    """A shipped model without a models.toml table: the planner's smallest layout on nodes of ``node_gpus``
    (default 8) GPUs, unless the learner gave TP/PP (then their layout is checked instead)."""
    base = cluster.model_job(model, nodes=1, gpus_per_node=1, tp=1, pp=1)
    if layout_given:
        return replace(base, description=f"{model}: the layout given on the command line")
    try:
        p = memory.plan(model, dtype, base.kv_dtype, gpu or base.gpu, node_gpus or 8, context,
                        utilization=base.gpu_memory_utilization, expert_parallel=expert_parallel)
    except (memory.PlanError, memory.ConfigError) as e:
        raise JobError(f"{model}: {e} Give a layout yourself (--tp, --pp, --gpu-type) or a shorter "
                       "--max-model-len.") from None
    return replace(base, nodes=p.pp, gpus_per_node=p.tp, tp=p.tp, pp=p.pp,
                   description=f"{model}: laid out by llmlab.memory's planner (the smallest layout that fits)")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # JSON's string escapes are valid in TOML basic strings


def settings_toml(job: cluster.JobSettings) -> str:
    """One models.toml table with every field spelled out: the job reads exactly what was planned."""
    lines = [f"[{json.dumps(job.name)}]"]
    for f in fields(job):
        value = getattr(job, f.name)
        if f.name != "name" and value is not None:
            lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The plan, checked before anything is submitted
# --------------------------------------------------------------------------------------------------

def check_layout(job: cluster.JobSettings) -> dict:
    """``cluster.layout_report`` of the job, or a :class:`JobError` with the numbers and a layout that fits.

    The verdict is ``llmlab.memory.layout_fit``'s, the one notebook 01's planner and ``llmlab generate`` use.
    """
    if job.engine == "cpu":
        cap = memory.embedded_kv_capacity(job.kv_cache_gib, job.model, job.max_model_len)
        return {"name": job.name, "model": job.model, "gpu": "CPU", "nodes": job.nodes, "gpus": 0, "tp": job.tp,
                "pp": job.pp, "context": job.context, "weights_gib_per_gpu": None, "kv_tokens": cap.tokens,
                "max_concurrency": cap.max_concurrency, "fits": True, "why": ""}
    report = cluster.layout_report(job)
    if report["fits"]:
        return report
    raise JobError(f"Refused before submitting {job.name} on {job.nodes} node(s) x {job.gpus_per_node} {job.gpu}: "
                   f"{report['why']} {_fitting_layout(job)}")


def _fitting_layout(job: cluster.JobSettings) -> str:
    try:
        p = memory.plan(job.model, job.dtype, job.kv_dtype, job.gpu, max(job.gpus_per_node, 1), job.context,
                        utilization=job.gpu_memory_utilization, expert_parallel=job.expert_parallel)
    except memory.PlanError as e:
        return f"No layout of {job.gpu} GPUs fits either: {e}"
    return (f"A layout that fits: {p.nodes} node(s) x {p.gpus_per_node} GPUs, TP={p.tp} x PP={p.pp}, "
            f"{p.weight_bytes_per_gpu / memory.GiB:.1f} GiB of weights per GPU, {p.kv_tokens:,} KV tokens: "
            f"llmlab launch {job.name} --nodes {p.nodes} --gpus-per-node {p.gpus_per_node} --tp {p.tp} --pp {p.pp}"
            f" --gpu-type {job.gpu}{' --expert-parallel' if job.expert_parallel else ''}"
            " (or a shorter --max-model-len, or --dtype fp8).")


def plan_rows(report: dict) -> list[tuple[str, str]]:
    """The plan as (label, value) rows for a terminal or a notebook."""
    gpus = "CPU engine (no GPU)" if report["gpu"] == "CPU" else f"{report['gpus']} x {report['gpu']}"
    conc = report["max_concurrency"]
    model = report["name"] if report["name"] == report["model"] else f"{report['name']} ({report['model']})"
    return [("model", model), ("nodes", str(report["nodes"])), ("GPUs", gpus),
            ("TP x PP", f"{report['tp']} x {report['pp']}"),
            ("weights per GPU", "-" if report["weights_gib_per_gpu"] is None
             else f"{report['weights_gib_per_gpu']:.1f} GiB"),
            ("KV cache", f"{report['kv_tokens']:,} tokens"),
            ("context", f"{report['context']:,} tokens"),
            ("max concurrency", f"{conc:.1f} requests of the full context" if conc is not None else "-")]


def table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# --------------------------------------------------------------------------------------------------
# The job script
# --------------------------------------------------------------------------------------------------

def shipped_directives(name: str) -> dict[str, str]:
    """``#SBATCH`` options of the shipped job script ``slurm/NAME.sh`` (time, CPUs): the per-model defaults."""
    path = cluster.slurm_dir() / f"{name}.sh"
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line)
            if m:
                out[m[1]] = m[2] or ""
    return out


@dataclass
class Launch:
    """Everything ``llmlab launch`` decided, before submission."""

    job: cluster.JobSettings
    report: dict
    script: str
    sbatch_options: dict[str, str]
    share: tuple[str, Path] | None = None
    rehearse: bool = False
    submitted: dict = field(default_factory=dict)

    @property
    def settings_text(self) -> str:
        return settings_toml(self.job)


def render_script(job: cluster.JobSettings, options: dict[str, str], extra_sbatch: list[str] = (),
                  python: str | None = None, command: str = "", share: tuple[str, Path] | None = None,
                  rehearse: bool = False) -> str:
    """The job script: ``#SBATCH`` lines, the settings embedded, then the shared launcher.  Resubmitting it
    with plain ``sbatch`` runs the same server again (it names this course's files by absolute path)."""
    home = llmlab_home()
    lines = ["#!/bin/bash", f"# Rendered by `llmlab launch{(' ' + command) if command else ''}` "
             f"on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
             f"# {job.description or job.name}", "# Resubmit as it is with `sbatch THIS_FILE`."]
    lines += [f"#SBATCH --{k}={v}" if v else f"#SBATCH --{k}" for k, v in options.items()]
    lines += [f"#SBATCH {a}" for a in extra_sbatch]
    settings_path = '"$LLMLAB_HOME/logs/job-$SLURM_JOB_ID/settings.toml"'
    lines += ["set -euo pipefail", "umask 077",
              f"export LLMLAB_HOME={shlex.quote(str(home))}",
              f"export LLMLAB_SLURM_DIR={shlex.quote(str(cluster.slurm_dir()))}",
              f"export LLMLAB_PYTHON=${{LLMLAB_PYTHON:-{shlex.quote(python or sys.executable)}}}",
              'mkdir -p "$LLMLAB_HOME/logs/job-$SLURM_JOB_ID"',
              *([f"export LLMLAB_SHARE_GROUP={shlex.quote(share[0])}",
                 f"export LLMLAB_SHARE_DIR={shlex.quote(str(share[1]))}"] if share else []),
              f"cat >{settings_path} <<'LLMLAB_SETTINGS'", settings_toml(job).rstrip(), "LLMLAB_SETTINGS",
              f"export LLMLAB_SETTINGS_FILE={settings_path}",
              f'exec "$LLMLAB_PYTHON" -m llmlab rehearse {shlex.quote(job.name)} --engine {job.engine} '
              f'--out "{REHEARSAL_DIR}"' if rehearse else
              f'exec bash "$LLMLAB_SLURM_DIR/llmlab-serve.sh" {shlex.quote(job.name)}']
    return "\n".join(lines) + "\n"


def prepare(name: str, *, account: str | None = None, partition: str | None = None, time_limit: str | None = None,
            extra_sbatch: list[str] = (), command: str = "", share: str | None = None,
            share_dir: str | None = None, rehearse: bool = False, **overrides) -> Launch:
    """Settings + overrides -> a checked layout and the rendered job script (nothing submitted).

    ``share``: a UNIX group whose members may use the server, each with a key of their own (``llmlab.serve.share``);
    ``share_dir`` (default ``$LLMLAB_SHARE_ROOT/GROUP``) is where they find it.  ``rehearse``: the job runs
    ``llmlab rehearse`` on the layout (dummy weights, one node) instead of serving it.
    """
    job = settings(name, **overrides)
    if rehearse and job.nodes > 1:
        raise JobError(f"A rehearsal runs on one node, and {job.name} spans {job.nodes}: rehearse a layout of one "
                       "node, --nodes 1 --gpus-per-node N --tp T --pp P with T x P = N (PP then stays inside it).")
    if rehearse and share:
        raise JobError("--rehearse and --share do not go together: a rehearsal serves nobody.")
    report = check_layout(job)
    shared = (share, share_directory(share, share_dir)) if share else None
    shipped = shipped_directives(name)
    options = {"job-name": f"llmlab-{job.name}", "nodes": str(job.nodes), "ntasks-per-node": "1"}
    if job.gpus_per_node:
        options["gpus-per-node"] = str(job.gpus_per_node)
        options["cpus-per-gpu"] = shipped.get("cpus-per-gpu", "8")
    options["time"] = time_limit or shipped.get("time", DEFAULT_TIME)
    if account:
        options["account"] = account
    if partition:
        options["partition"] = partition
    options["output"] = str(llmlab_home() / "logs" / "llmlab-%j.out")
    script = render_script(job, options, list(extra_sbatch), command=command, share=shared, rehearse=rehearse)
    return Launch(job, report, script, options, share=shared, rehearse=rehearse)


def share_directory(group: str, share_dir: str | None) -> Path:
    """Create the group's share directory (``llmlab.serve.share``) before submitting, so that a wrong group or path
    fails now, in one sentence, and not inside the job."""
    from llmlab.serve import share
    from llmlab.serve.info import ServerError

    where = share_dir or (os.environ.get("LLMLAB_SHARE_ROOT") and Path(os.environ["LLMLAB_SHARE_ROOT"]) / group)
    if not where:
        raise JobError("--share needs a folder your learners can reach: --share-dir DIR (e.g. /scratch/course/ws) "
                       "or LLMLAB_SHARE_ROOT.")
    try:
        return share.prepare_dir(where, group)
    except ServerError as e:
        raise JobError(str(e)) from None


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


def launch(plan: Launch) -> dict:
    """Submit the rendered script with ``sbatch``; save it, its settings and a record beside the job's logs."""
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
    record = {"job_id": job_id, "name": plan.job.name, "model": plan.job.model, "script": str(script),
              "output": plan.sbatch_options["output"].replace("%j", job_id),
              "submitted": datetime.now(UTC).isoformat(timespec="seconds"),
              "layout": {k: plan.report[k] for k in ("nodes", "gpus", "tp", "pp", "context")},
              "share": {"group": plan.share[0], "dir": str(plan.share[1])} if plan.share else None,
              "rehearse": plan.rehearse}
    (jobs_dir() / f"{job_id}.json").write_text(json.dumps(record, indent=1))
    if not plan.rehearse:
        publish_queued(job_id, plan.job.name, plan.share)
    plan.submitted = record
    return record


QUEUED = "waiting in SLURM's queue"


def publish_queued(job_id: str, name: str, shared: tuple[str, Path] | None = None) -> None:
    """A "loading" connection file (and a room's ``server.json``) from the moment SLURM accepts the job.

    Why: a notebook that connects while the job waits for nodes must hear that the server is on its way, not get
    the embedded tiny model in its place.  The launcher rewrites the file with its address once its proxy
    listens; ``stop`` and ``status`` remove it when the job ends before the launcher ran."""
    info = ServerInfo(kind="slurm", host="", port=0, model=name, job_id=job_id, status="loading",
                      api_key_file=str(llmlab_home() / "keys" / f"job-{job_id}.key"), extra={"phase": QUEUED})
    info.write(cluster.connection_file_of(job_id))
    if shared:
        from llmlab.serve import share

        share.publish(shared[1], info.updated(group=shared[0]))


def forget(job_id: str) -> None:
    """Remove what a job published, for a job whose launcher cannot do it any more: cancelled while queued, or
    killed before its clean-up ran.  ``connect()`` would otherwise keep saying that its server is loading."""
    cluster.connection_file_of(job_id).unlink(missing_ok=True)
    shared = (record_of(job_id) or {}).get("share")
    if not shared:
        return
    room = Path(shared["dir"]) / "server.json"
    with contextlib.suppress(OSError, ValueError):
        if json.loads(room.read_text()).get("job_id") == job_id:  # not a later job's publication
            room.unlink()


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


def record_of(job_id: str) -> dict | None:
    path = jobs_dir() / f"{job_id}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
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
    (re.compile(r"api_server\.py: error:|error: unrecognized arguments|error: argument |invalid choice"),
     "vLLM rejected an argument (check --extra-vllm-args / LLMLAB_EXTRA_VLLM_ARGS)"),
    (re.compile(r"did not answer /health within"), "vLLM did not become ready in time (LLMLAB_READY_TIMEOUT)"),
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
    st = replace(st, url=url, model=info.model, api_key_file=info.api_key_file, nodes=info.get("nodes") or [],
                 use=f"client, model = llmlab.connect()  # or LLMLAB_CONNECTION_FILE={conn}")
    if cluster.is_alive(info, timeout=5):
        return replace(st, state="READY", detail=f"{info.model} at {url}{_shared(info)}")
    return replace(st, state="FAILED", detail=f"the server at {url} was READY but does not answer /health now",
                   reason="the server stopped answering after READY", use=None)


def _shared(info: ServerInfo) -> str:
    """", shared with group G: N learners" for a workshop server (``llmlab launch --share``)."""
    if not info.get("share_dir"):
        return ""
    from llmlab.serve import share

    who = share.learners(info["share_dir"])
    active = sum(v == "registered" for v in who.values())
    revoked = len(who) - active
    return (f", shared with group {info.get('group')}: {active} learner(s) registered"
            + (f", {revoked} revoked" if revoked else ""))


def revoke(job_id: str, name: str) -> str:
    """Shut one learner out of a shared server (``llmlab revoke JOB USER``); the server keeps running."""
    from llmlab.serve import share

    info = _connection(job_id)
    if not info.get("share_dir"):
        raise JobError(f"Job {job_id} is not shared (launch it with --share GROUP): there is nobody to revoke.")
    share.revoke(info["share_dir"], name)
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
    name = (rec or {}).get("name") or ((info or {}).get("JobName", "").removeprefix("llmlab-") or None)
    if rec is None and not log_dir.exists() and not (info or {}).get("JobName", "").startswith("llmlab-"):
        known = "SLURM knows it as " + repr(info.get("JobName")) if info else "SLURM does not know it"
        raise JobError(f"Job {job_id} is not an llmlab server ({known}, and {llmlab_home()} has no record of it): "
                       "`llmlab status` lists yours.")
    out_path = (rec or {}).get("output") or (info or {}).get("StdOut")
    output, vllm_log = _read(out_path), _read(log_dir / "vllm.log")
    slurm_state = (info or {}).get("JobState")
    st = JobStatus(job_id, "STARTING", "", name=name, slurm_state=slurm_state, output=out_path, log_dir=str(log_dir))
    if slurm_state != "PENDING" and (rec or {}).get("rehearse"):
        return _rehearsal_status(st, slurm_state, output, log_dir / "rehearsal" / "rehearsal.json")
    if slurm_state == "PENDING":
        reason = info.get("Reason", "None")
        return replace(st, state="PENDING", detail="waiting for nodes" + ("" if reason == "None" else
                                                                          f" (SLURM's reason: {reason})"))
    if slurm_state in ENDED:
        forget(job_id)
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

def _connection(job_id: str) -> ServerInfo:
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
    buckets: dict[float, float] = {}
    for s in metrics[name + "_bucket"]:
        le = float(s.labels["le"])
        buckets[le] = buckets.get(le, 0.0) + s.value
    edges = sorted(buckets)
    if not edges or buckets[edges[-1]] == 0:
        return None
    rank, lower, below = q * buckets[edges[-1]], 0.0, 0.0
    for le in edges:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def metrics(job_id: str, interval: float = 2.0) -> dict:
    """The server's load, from two ``/metrics`` scrapes ``interval`` seconds apart (rates need two)."""
    from llmlab import kvcache

    info = _connection(job_id)
    url, key = info.base_url, info.key()
    first = kvcache.fetch_metrics(url, key)
    time.sleep(interval)
    m = kvcache.fetch_metrics(url, key)

    def rate(name: str) -> float:
        return (m.value(name, default=0.0) - first.value(name, default=0.0)) / interval

    queries = m.value(kvcache.PREFIX_QUERIES, default=0.0)
    out = {"job_id": job_id, "url": url, "requests_running": int(m.value("vllm:num_requests_running", default=0.0)),
           "requests_waiting": int(m.value("vllm:num_requests_waiting", default=0.0)),
           "kv_cache_usage_pct": 100 * m.value(kvcache.KV_USAGE, default=0.0),
           "prompt_tokens_per_s": rate(kvcache.PROMPT_TOKENS),
           "generation_tokens_per_s": rate("vllm:generation_tokens_total"),
           "prefix_cache_hit_rate": m.value(kvcache.PREFIX_HITS, default=0.0) / queries if queries else None,
           "requests_finished": int(m.value(kvcache.FINISHED, default=0.0)),
           "prompt_tokens_total": int(m.value(kvcache.PROMPT_TOKENS, default=0.0)),
           "generation_tokens_total": int(m.value("vllm:generation_tokens_total", default=0.0))}
    for label, name in (("latency", "vllm:e2e_request_latency_seconds"), ("ttft", kvcache.TTFT)):
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


def log_files(job_id: str) -> list[Path]:
    """The job's SLURM output, then vLLM's log, then each node's Ray log: those that exist."""
    rec, log_dir = record_of(job_id), cluster.job_log_dir(job_id)
    out = (rec or {}).get("output")
    if not out:
        info = scontrol_job(job_id)
        out = (info or {}).get("StdOut")
    paths = [Path(out)] if out else []
    paths += [log_dir / "vllm.log", *sorted(log_dir.glob("ray-*.log"))]
    found = [p for p in paths if p.exists()]
    if not found:
        raise JobError(f"Job {job_id} has written no log yet (or is not an llmlab job): `llmlab status {job_id}`.")
    return found


def stop(job_id: str, timeout: float = 120.0) -> JobStatus:
    """``scancel`` the job, then wait until the launcher has removed the connection file and key, stopped Ray
    and vLLM, and SLURM has released the nodes.  Raises if any of that is not confirmed in time."""
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
