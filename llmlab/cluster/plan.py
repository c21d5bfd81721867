"""Planning a SLURM server job: a launch's checked settings and the job script, with nothing submitted.

Why in the lesson: ``llmlab launch`` refuses a layout that cannot work *before* it asks SLURM for GPUs, and
notebook 08 shows that check and the script it renders.  This module is that planning, pure (it reads the
shipped job scripts in ``slurm/``, and runs nothing).  A job's settings, with the caller's changes, and their
check are ``llmlab.cluster.layouts`` (:func:`~llmlab.cluster.layouts.settings`,
:func:`~llmlab.cluster.layouts.check_layout`); this module calls them once each and never is called back:

- :func:`prepare`: the checked settings and the job script (:func:`render_script`) with those settings
  embedded (:func:`settings_toml`): a :class:`Launch`;
- :func:`plan_rows`, :func:`table`: the checked layout as rows for a terminal or a notebook.

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
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path

from llmlab.cluster.layouts import JobError, JobSettings, check_layout, settings, slurm_dir
from llmlab.serve.info import llmlab_home

REHEARSAL_DIR = "$LLMLAB_HOME/logs/job-$SLURM_JOB_ID/rehearsal"  # where `launch --rehearse` writes its results
DEFAULT_TIME = "04:00:00"


# --------------------------------------------------------------------------------------------------
# The settings, as the job script embeds them
# --------------------------------------------------------------------------------------------------

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
# The checked layout, shown
# --------------------------------------------------------------------------------------------------

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
