"""Planning a SLURM server job: the settings with your changes, checked, and the job script, with nothing submitted.

Why in the lesson: ``llmlab launch`` refuses a layout that cannot work *before* it asks SLURM for GPUs, and
notebook 08 shows that check and the script it renders.  This module is that planning, pure (it reads the
settings and the shipped job scripts in ``slurm/``, and runs nothing):

- :func:`settings`: per-model defaults from ``slurm/models.toml`` (the settings the job scripts use), or the
  planner's layout for any shipped model, overridden by the caller and checked like models.toml's own;
- :func:`check_layout`: ``llmlab.memory``'s verdict, or a :class:`JobError` with the numbers and a layout that fits;
- :func:`prepare`: both, and the job script (:func:`render_script`) with those settings embedded: a :class:`Launch`.

Submitting, following and stopping the job (``sbatch``, ``scontrol``, ``scancel``) is ``llmlab.ops.jobs``, behind
the ``llmlab launch | status | metrics | stop`` commands.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import unicodedata
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from pathlib import Path

from llmlab import memory
from llmlab.cluster.layouts import (
    JobSettings,
    SettingsError,
    check_settings,
    job_settings,
    layout_report,
    model_job,
    slurm_dir,
)
from llmlab.serve.info import llmlab_home

REHEARSAL_DIR = "$LLMLAB_HOME/logs/job-$SLURM_JOB_ID/rehearsal"  # where `launch --rehearse` writes its results
DEFAULT_TIME = "04:00:00"


class JobError(RuntimeError):
    """One sentence for the user: what is wrong and what to do.  The CLI prints it without a traceback."""


# --------------------------------------------------------------------------------------------------
# Settings: models.toml + the caller's overrides
# --------------------------------------------------------------------------------------------------

def settings(name: str, *, nodes: int | None = None, gpus_per_node: int | None = None, gpu: str | None = None,
             tp: int | None = None, pp: int | None = None, dtype: str | None = None,
             max_model_len: int | None = None, extra_args: list[str] | None = None,
             backend: str | None = None, expert_parallel: bool | None = None) -> JobSettings:
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
        job = job_settings(name)
    except SettingsError as e:
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
        check_settings(job, Path("llmlab launch"))
    except SettingsError as e:
        raise JobError(str(e).replace("llmlab launch [", "[")) from None
    return job


def _planned_job(model: str, gpu: str | None, dtype: str | None, context: int | None, node_gpus: int | None,
                 expert_parallel: bool, layout_given: bool) -> JobSettings:
    """A shipped model without a models.toml table: the planner's smallest layout on nodes of ``node_gpus``
    (default 8) GPUs, unless the learner gave TP/PP (then their layout is checked instead)."""
    base = model_job(model, nodes=1, gpus_per_node=1, tp=1, pp=1)
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


def settings_toml(job: JobSettings) -> str:
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

def check_layout(job: JobSettings) -> dict:
    """``layout_report`` of the job, or a :class:`JobError` with the numbers and a layout that fits.

    The verdict is ``llmlab.memory.layout_fit``'s, the one notebook 01's planner and ``llmlab generate`` use.
    """
    if job.engine == "cpu":
        cap = memory.embedded_kv_capacity(job.kv_cache_gib, job.model, job.max_model_len)
        return {"name": job.name, "model": job.model, "gpu": "CPU", "nodes": job.nodes, "gpus": 0, "tp": job.tp,
                "pp": job.pp, "context": job.context, "weights_gib_per_gpu": None, "kv_tokens": cap.tokens,
                "max_concurrency": cap.max_concurrency, "fits": True, "why": ""}
    report = layout_report(job)
    if report["fits"]:
        return report
    raise JobError(f"Refused before submitting {job.name} on {job.nodes} node(s) x {job.gpus_per_node} {job.gpu}: "
                   f"{report['why']} {_fitting_context(job)}{_fitting_layout(job)}")


def _fitting_context(job: JobSettings) -> str:
    """The longest context (whole 1,024 tokens) for which this very layout holds one request, as a sentence; empty
    where none does (the weights alone do not fit).  Why: on the GPUs one has, a shorter context is often the
    answer (405B FP8 on four H200s holds 0.6 of a 131,072-token request by this check, all of a 65,536-token one)."""

    def fits(context: int) -> bool:
        return memory.layout_fit(job.model, job.tp, job.pp, job.gpu, dtype=job.dtype, kv_dtype=job.kv_dtype,
                                 context=context, utilization=job.gpu_memory_utilization,
                                 expert_parallel=job.expert_parallel).fits
    lo, hi = 0, job.context // 1024  # lo fits (0: nothing checked yet), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * 1024) else (lo, mid)
    if lo == 0:
        return ""
    return (f"This layout holds a context of up to {lo * 1024:,} tokens: llmlab launch {job.name} "
            f"--max-model-len {lo * 1024} (with the same --tp/--pp/--gpu-type). Or: ")


def _fitting_layout(job: JobSettings) -> str:
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
            *([("KV before launch", f"{report['kv_tokens_before_launch']:,} tokens (vLLM 0.26's figure, every "
                "reserved byte modelled)")] if report.get("kv_tokens_before_launch") else []),
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
    path = slurm_dir() / f"{name}.sh"
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

    job: JobSettings
    report: dict
    script: str
    sbatch_options: dict[str, str]
    share: tuple[str, Path] | None = None
    rehearse: bool = False

    @property
    def settings_text(self) -> str:
        return settings_toml(self.job)


def one_line(field: str, value) -> str:
    """``value`` as text for one line of the job script, or a :class:`JobError` naming ``field``.

    Why: a newline in a value (a models.toml ``description``, an ``#SBATCH`` option) would end its comment or
    ``#SBATCH`` line, and what follows would be a shell line; sbatch stops reading ``#SBATCH`` at the first line
    that is not a comment, so every directive after it, ``--output`` included, would be ignored.  Other control
    characters (a carriage return, ESC) have no place in a job script either."""
    text = str(value)
    bad = next((c for c in text if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        what = "a newline" if bad in "\n\r" else f"the control character {bad!r}"
        raise JobError(f"{field} holds {what} ({text[:60]!r}): every value goes on one line of the job script, so "
                       "write it on one line without control characters.")
    return text


def _quoted(field: str, value) -> str:
    """A value for the job script's shell lines: one line (:func:`one_line`), then quoted for the shell."""
    return shlex.quote(one_line(field, value))


# The settings that decide what a job loads and where it caches: ``llmlab launch`` writes those its shell had into
# the job script, so that resubmitting it (``sbatch THIS_FILE``) from a shell without them serves the same weights.
RECORDED = ("LLMLAB_MODEL_PATH", "LLMLAB_MODEL_DIR", "LLMLAB_STAGE_DIR", "LLMLAB_CACHE_DIR")


def render_script(job: JobSettings, options: dict[str, str], extra_sbatch: list[str] = (),
                  python: str | None = None, command: str = "", share: tuple[str, Path] | None = None,
                  rehearse: bool = False) -> str:
    """The job script: ``#SBATCH`` lines, the settings embedded, then the shared launcher.  Resubmitting it
    with plain ``sbatch`` runs the same server again (it names this course's files by absolute path).  Every
    value put into it is :func:`one_line` (the embedded settings are TOML strings, whose escapes keep them on one
    line each)."""
    home = llmlab_home()
    description = one_line(f"the description of job {job.name!r} (models.toml's `description`)",
                           job.description or job.name)
    command = one_line("the `llmlab launch` command line", command)
    lines = ["#!/bin/bash", f"# Rendered by `llmlab launch{(' ' + command) if command else ''}` "
             f"on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC.",
             f"# {description}", "# Resubmit as it is with `sbatch THIS_FILE`."]
    for k, v in options.items():
        key = one_line(f"the name of the #SBATCH option {k!r}", k)
        lines.append(f"#SBATCH --{key}={one_line(f'#SBATCH --{key}', v)}" if v else f"#SBATCH --{key}")
    lines += [f"#SBATCH {one_line('the --sbatch option', a)}" for a in extra_sbatch]
    q = _quoted
    name = q("the job's name", job.name)
    settings_path = '"$LLMLAB_HOME/logs/job-$SLURM_JOB_ID/settings.toml"'
    lines += ["set -euo pipefail", "umask 077",
              f"export LLMLAB_HOME={q('LLMLAB_HOME', home)}",
              f"export LLMLAB_SLURM_DIR={q('the folder of the slurm/ scripts', slurm_dir())}",
              f"export LLMLAB_PYTHON=${{LLMLAB_PYTHON:-{q('the Python of the job', python or sys.executable)}}}",
              *[f"export {k}={q(k, os.environ[k])}" for k in RECORDED if os.environ.get(k)],
              'mkdir -p "$LLMLAB_HOME/logs/job-$SLURM_JOB_ID"',
              *([f"export LLMLAB_SHARE_GROUP={q('the share group', share[0])}",
                 f"export LLMLAB_SHARE_DIR={q('the share folder', share[1])}"] if share else []),
              f"cat >{settings_path} <<'LLMLAB_SETTINGS'", settings_toml(job).rstrip(), "LLMLAB_SETTINGS",
              f"export LLMLAB_SETTINGS_FILE={settings_path}",
              f'exec "$LLMLAB_PYTHON" -m llmlab rehearse {name} --engine {q("the engine", job.engine)} '
              f'--out "{REHEARSAL_DIR}"' if rehearse else
              f'exec bash "$LLMLAB_SLURM_DIR/llmlab-serve.sh" {name}']
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
