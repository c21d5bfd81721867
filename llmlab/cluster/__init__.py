"""Distributed serving, the lesson of notebook 08: the layouts of the SLURM servers, what a job runs, and the
servers running now.

Why this package: the workshop this course grew from started its 70B/405B servers with hand-edited sbatch
scripts, and learners copied IP addresses out of logs.  The course's launcher does that work from settings a
learner can read, and this package holds what a learner reads of it, all of it pure (nothing here submits a
job or starts a process):

- **Settings** (``layouts``: :func:`job_settings`): one machine-readable file, ``slurm/models.toml``, says per
  model how many nodes and GPUs, TP and PP, dtype and context.  The job scripts and ``llmlab launch`` both read
  it; :func:`vllm_flags` is the ``vllm serve`` line's layout part.  Your changes to a job (:func:`settings`) and
  their check by ``llmlab.memory`` (:func:`check_layout`) are there too: a layout that cannot work raises
  :class:`JobError` with one that can.
- **The TP-vs-PP arithmetic** (``layouts``: :func:`layout_report`, :func:`layouts_table`, :func:`tp_vs_pp`).
- **What a job runs** (``render``: :func:`render`): settings + the job's nodes -> the exact ``vllm serve``
  line, its environment and the Ray layout.
- **The plan before submitting** (``plan``: :func:`prepare`): the checked settings and the job script.
- **A server's start-up and the servers running** (``running``: :func:`load_progress`, :data:`PHASES`,
  :func:`servers`, :class:`RunningServer`, :func:`is_alive`).

What the launcher runs and waits for inside the job (Ray, the readiness wait) is ``llmlab.ops.launcher``;
submitting, following and stopping jobs is the ``llmlab launch | status | metrics | stop`` commands
(``llmlab.ops.jobs``).
"""

from llmlab.cluster.layouts import (
    IB_GBPS,
    NVLINK_GBPS,
    SLURM_DIR,
    JobError,
    JobSettings,
    SettingsError,
    check_layout,
    check_settings,
    job_flags,
    job_settings,
    layout_report,
    layouts_table,
    load_settings,
    model_job,
    settings,
    settings_file,
    slurm_dir,
    tp_vs_pp,
    vllm_flags,
)
from llmlab.cluster.plan import (
    DEFAULT_TIME,
    REHEARSAL_DIR,
    Launch,
    plan_rows,
    prepare,
    render_script,
    settings_toml,
    share_directory,
    shipped_directives,
    table,
)
from llmlab.cluster.render import (
    LOOPBACK_RAY_IP,
    NCCL_IB_ENV,
    RayLayout,
    RenderedJob,
    head_ip,
    model_path,
    parse_ray_status,
    ray_port_base,
    render,
)
from llmlab.cluster.running import (
    PHASE_UNKNOWN,
    SHARDS,
    UNKNOWN_AFTER,
    VLLM_RECORD,
    LoadProgress,
    RunningServer,
    connection_file_of,
    is_alive,
    job_log_dir,
    job_progress,
    load_progress,
    servers,
    servers_table,
)
from llmlab.serve.info import servers_dir
from llmlab.serve.vllm import PHASES  # the start-up phases load_progress and `llmlab status` name, marker first

__all__ = [
    "DEFAULT_TIME", "IB_GBPS", "LOOPBACK_RAY_IP", "NCCL_IB_ENV", "NVLINK_GBPS", "PHASES", "PHASE_UNKNOWN",
    "REHEARSAL_DIR", "SHARDS", "SLURM_DIR", "UNKNOWN_AFTER", "VLLM_RECORD", "JobError", "JobSettings", "Launch",
    "LoadProgress", "RayLayout", "RenderedJob", "RunningServer", "SettingsError", "check_layout", "check_settings",
    "connection_file_of", "head_ip", "is_alive", "job_log_dir", "job_progress", "job_settings", "layout_report",
    "layouts_table", "load_progress", "load_settings", "model_job", "model_path", "parse_ray_status", "plan_rows",
    "prepare", "ray_port_base", "render", "render_script", "servers", "servers_dir", "servers_table", "settings",
    "settings_file", "settings_toml", "share_directory", "shipped_directives", "slurm_dir", "table", "tp_vs_pp",
    "job_flags",
    "vllm_flags",
]
