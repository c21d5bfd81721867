"""Rehearsals on real GPUs, the lesson of notebook 09: what vLLM's start-up log says, and the arithmetic it checks.

Why: whether Llama 3.1 70B fits the 4 GPUs of a partition, with what context and how many learners, is
otherwise learnt after a 140 GB download and a 40-minute load.  vLLM starts any architecture with random
weights (``--load-format dummy``) from its ``config.json`` alone, so ``llmlab rehearse`` (the runner is
``llmlab.ops.rehearsal``) starts a job's own layout with dummy weights and checks the course's arithmetic
against the hardware.  This module holds what a learner reads of that:

- **memory**: the start-up log's weights, peak activation, non-torch and CUDA-graph memory and KV cache
  (:func:`parse_memory_log`); the KV tokens ``llmlab.memory`` predicts from those figures must equal the
  logged ones exactly (:func:`predict_kv_from_log`), and the prediction made *before* start-up with llmlab's
  own weights and allowance (:func:`predict_kv_before_start`) is reported with its error;
- **bandwidth and roofline**: a batch-1 decode step reads every weight once, so bandwidth / bytes per step
  (:func:`bytes_per_decode_step`, :func:`roofline_tok_s`) is the ceiling on tokens/s;
- **the committed results** (``benchmarks/results/``) and your own: :func:`load_results`, :func:`load_result`,
  :func:`results_table`, :func:`plot_rehearsal`, :func:`check_math`.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from llmlab import memory
from llmlab.serve.paths import RESULTS_DIR

GiB = memory.GiB
PROBE_TAG = "llmlab-rehearse-probe "
DEFAULT_CONCURRENCY = (1, 8, 64)
READY_TIMEOUT = 1800.0
LOG_EXCERPT = "server-log-excerpt.txt"


class RehearseError(RuntimeError):
    """A rehearsal cannot run (no GPU, too few GPUs, a bad layout); the message says what to do."""


# --------------------------------------------------------------------------------------------------
# Parsing vLLM's start-up log
# --------------------------------------------------------------------------------------------------

_NUM = r"([\d.]+)"
_PATTERNS = {
    "weights_gib": re.compile(r"Model loading took " + _NUM + r" ?GiB"),
    "available_kv_gib": re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"),
    "kv_tokens": re.compile(r"KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: " + _NUM + "x"),
    "graph": re.compile(r"Graph capturing finished in " + _NUM + r" secs?, took " + _NUM + " GiB"),
    "startup": re.compile(r"Free memory on device \(" + _NUM + "/" + _NUM + r" GiB\) on startup\. Desired GPU "
                          r"memory utilization is \(" + _NUM + ", " + _NUM + r" GiB\)"),
    "usage": re.compile(r"Actual usage is " + _NUM + r" GiB for weight, " + _NUM + r" GiB for peak activation, "
                        + _NUM + r" GiB for non-torch memory, and " + _NUM + " GiB for CUDAGraph memory"),
    "graph_estimate": re.compile(r"CUDA graph pool memory: " + _NUM + r" GiB \(actual\), " + _NUM
                                 + r" GiB \(estimated\)"),
    "version": re.compile(r"(?:vLLM (?:API )?server version |\u2588 +version |LLM engine \(v)(\d[\w.+-]*\w)"),
}
_ESTIMATE_APPLIED = "CUDA graph memory profiling is enabled"
_ESTIMATE_OFF = "CUDA graph memory profiling is disabled"


@dataclass
class MemoryLog:
    """The memory figures of one vLLM start-up log (GiB as logged, rounded to 0.01) and the exact bytes
    per GPU worker where the probe plugin printed them (``probe``: one dict per rank)."""

    weights_gib: float | None = None
    available_kv_gib: float | None = None
    kv_tokens: int | None = None
    max_model_len: int | None = None
    max_concurrency: float | None = None
    graph_capture_s: float | None = None
    graph_gib: float | None = None
    free_gib: float | None = None
    total_gib: float | None = None
    utilization: float | None = None
    requested_gib: float | None = None
    activation_peak_gib: float | None = None
    non_torch_gib: float | None = None
    cuda_graph_gib: float | None = None
    cuda_graph_estimate_gib: float | None = None
    cuda_graph_estimate_applied: bool | None = None
    vllm_version: str | None = None
    probe: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "lines"}


def parse_memory_log(text: str) -> MemoryLog:
    """Every memory line of a vLLM server log, as numbers (the first worker's where each GPU logs one).

    Reads both layouts vLLM has used: "GPU KV cache size: N tokens" and "Maximum concurrency ..." on two
    lines (0.26) or on one (the CPU build, 0.32).  Missing lines stay None; :func:`require_kv` says which.
    """
    out = MemoryLog()
    for line in text.splitlines():
        if PROBE_TAG in line:  # the JSON, then whatever Ray appends ("[repeated 2x across cluster]")
            with contextlib.suppress(ValueError):
                out.probe.append(json.JSONDecoder().raw_decode(line.split(PROBE_TAG, 1)[1])[0])
            continue
        hit = False
        for key, pat in _PATTERNS.items():
            m = pat.search(line)
            if not m:
                continue
            hit = True
            _store(out, key, m)
        if _ESTIMATE_APPLIED in line:
            out.cuda_graph_estimate_applied, hit = True, True
        elif _ESTIMATE_OFF in line:
            out.cuda_graph_estimate_applied, hit = False, True
        if hit:
            out.lines.append(line.rstrip())
    # one per rank, in rank order: vLLM and Ray may print a worker's line more than once
    out.probe = sorted({p.get("rank") or 0: p for p in out.probe}.values(), key=lambda p: p.get("rank") or 0)
    return out


def _store(out: MemoryLog, key: str, m: re.Match) -> None:
    first = {  # each GPU worker logs its own line: keep the first (rank 0's, or the only one)
        "weights_gib": ("weights_gib",), "available_kv_gib": ("available_kv_gib",),
        "graph": ("graph_capture_s", "graph_gib"),
        "startup": ("free_gib", "total_gib", "utilization", "requested_gib"),
        "usage": ("weights_gib", "activation_peak_gib", "non_torch_gib", "cuda_graph_gib"),
        "graph_estimate": ("cuda_graph_gib", "cuda_graph_estimate_gib"),
    }
    if key == "kv_tokens":
        out.kv_tokens = int(m[1].replace(",", ""))
    elif key == "max_concurrency":
        out.max_model_len, out.max_concurrency = int(m[1].replace(",", "")), float(m[2])
    elif key == "version":
        out.vllm_version = out.vllm_version or m[1]
    else:
        for name, value in zip(first[key], m.groups(), strict=True):
            if key == "usage" and name == "weights_gib" and out.weights_gib is not None:
                continue
            if getattr(out, name) is None or key == "usage":
                setattr(out, name, float(value))


def require_kv(mem: MemoryLog) -> int:
    """The logged KV tokens, or an error naming the missing line."""
    if mem.kv_tokens is None:
        raise RehearseError("The server log has no 'KV cache size: N tokens' line: the engine did not finish "
                            "sizing its KV cache (read server.log in the output folder).")
    return mem.kv_tokens


# --------------------------------------------------------------------------------------------------
# The arithmetic: KV tokens predicted, bytes per decode step, roofline
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """What the arithmetic needs of a rehearsed layout."""

    model: str
    tp: int = 1
    pp: int = 1
    max_model_len: int | None = None
    utilization: float = memory.DEFAULT_UTILIZATION
    dtype: str | None = None
    kv_dtype: str = "auto"
    engine: str = "gpu"
    kv_cache_gib: int = 1

    @property
    def context(self) -> int:
        return self.max_model_len or memory.model_spec(self.model).require_context()

    @property
    def block_size(self) -> int:
        if self.engine == "cpu":
            return memory.CPU_MLA_BLOCK_SIZE if memory.model_spec(self.model).is_mla else memory.CPU_BLOCK_SIZE
        return memory.GPU_BLOCK_SIZE

    def kv_layouts(self) -> list[memory.KVLayout]:
        """vLLM's KV layout on one GPU of each pipeline stage: its groups, bytes per block, blocks per request."""
        s = memory.model_spec(self.model)
        in_flight = memory.CPU_BATCHED_TOKENS if self.engine == "cpu" else memory.GPU_IN_FLIGHT_TOKENS
        return [memory.kv_layout(s, self.context, self.block_size, in_flight, self.kv_dtype, self.dtype, self.tp,
                                 layers) for layers in memory.stage_layers(s.num_layers, self.pp)]

    def kv_per_token_per_stage(self) -> list[int]:
        """KV bytes one token takes on one GPU of each pipeline stage (its KV heads, its layers)."""
        s = memory.model_spec(self.model)
        return [memory.kv_bytes_per_token(s, self.kv_dtype, self.dtype, self.tp, n)
                for n in memory.pp_partition(s.num_layers, self.pp)]

    def weights_per_stage(self) -> list[int]:
        return memory.weight_bytes_per_gpu(self.model, self.dtype, self.tp, self.pp)


def _tokens(layout: Layout, budgets: list[int]) -> int:
    """vLLM's KV tokens for one budget per pipeline stage: whole blocks, the smallest count over the GPUs."""
    stages = layout.kv_layouts()
    blocks = min(max(0, b) // stages[i % len(stages)].bytes_per_block for i, b in enumerate(budgets))
    per_request = max(st.blocks_per_request for st in stages)
    return memory.kv_capacity(0, max(layout.kv_per_token_per_stage()), layout.block_size, layout.context,
                              blocks=blocks, blocks_per_request=per_request).tokens


def predict_kv_before_start(layout: Layout, gpu_bytes: int | None,
                            overhead_gib: float = memory.DEFAULT_OVERHEAD_GIB) -> int:
    """The KV tokens llmlab predicts before start-up: utilization x the GPU's memory, minus llmlab's own
    weight count and its fixed allowance for activations and CUDA graphs (``memory.DEFAULT_OVERHEAD_GIB``).
    On the CPU engine the budget is the configured KV space, so the prediction is exact."""
    if layout.engine == "cpu":
        return _tokens(layout, [layout.kv_cache_gib * GiB])
    usable = int(layout.utilization * gpu_bytes) - round(overhead_gib * GiB)
    return _tokens(layout, [usable - w for w in layout.weights_per_stage()])


def graph_estimate_subtracted(probe: dict) -> bool:
    """Whether vLLM took its CUDA-graph estimate off this GPU's KV budget, read from the probe's bytes: the KV
    memory it returned is the requested memory minus weights, peak activation and non-torch memory, and minus
    the estimate only when it subtracted one.  The probe's own ``cudagraph_estimate_applied`` reports vLLM's
    setting (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``), which vLLM 0.26 had on although it computed no
    estimate (``cudagraph_estimate`` 0) and subtracted nothing: its logs and bytes say so."""
    estimate = int(probe.get("cudagraph_estimate") or 0)
    need = ("requested", "weights", "activation_peak", "non_torch", "available_kv")
    if estimate <= 0 or any(k not in probe for k in need):
        return False
    gap = probe["requested"] - probe["weights"] - probe["activation_peak"] - probe["non_torch"] - probe["available_kv"]
    return abs(gap - estimate) < abs(gap)


def predict_kv_from_log(layout: Layout, mem: MemoryLog) -> tuple[int, str]:
    """The KV tokens llmlab predicts given what vLLM measured (weights as loaded, peak activation,
    non-torch memory, the CUDA-graph estimate where vLLM subtracts it): ``memory.kv_budget`` per GPU,
    then whole blocks.  Returns (tokens, basis): basis "exact bytes" when the probe printed every GPU's
    figures, else "rounded log figures" (each ±0.005 GiB, so a few blocks either way)."""
    if layout.engine == "cpu":
        return _tokens(layout, [layout.kv_cache_gib * GiB]), "configured KV space (VLLM_CPU_KVCACHE_SPACE)"
    ranks = [p for p in mem.probe if "weights" in p]
    if [p.get("rank") for p in ranks] == list(range(layout.tp * layout.pp)):  # every GPU's figures
        budgets = [memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"],
                                    p["cudagraph_estimate"] if graph_estimate_subtracted(p) else 0,
                                    layout.utilization) for p in ranks]
        # global rank = pp_rank x TP + tp_rank: group the budgets by stage, in order
        by_stage = [min(budgets[k * layout.tp:(k + 1) * layout.tp]) for k in range(layout.pp)]
        return _tokens(layout, by_stage), "exact bytes (probe)"
    need = ("total_gib", "weights_gib", "activation_peak_gib", "non_torch_gib")
    missing = [k for k in need if getattr(mem, k) is None]
    if missing:
        raise RehearseError(f"The server log lacks the memory figures {', '.join(missing)}: it is not a complete "
                            "vLLM GPU start-up log (read server.log in the output folder).")
    graphs = (mem.cuda_graph_estimate_gib or 0.0) if mem.cuda_graph_estimate_applied else 0.0
    b = memory.kv_budget(round(mem.total_gib * GiB), round(mem.weights_gib * GiB),
                         round(mem.activation_peak_gib * GiB), round(mem.non_torch_gib * GiB), round(graphs * GiB),
                         layout.utilization)
    return _tokens(layout, [b] * layout.pp), "rounded log figures"


def kv_record(log_text: str, layout: Layout) -> tuple[dict, dict]:
    """A launch result's ``memory_log`` and ``kv_tokens``: what vLLM's log(s) say and what llmlab predicts from them.

    Why one function: the GPU run that writes them and the test that re-derives them from the committed logs must
    agree, so that a result file never keeps a prediction an older parser made (``launch-pp2.json`` once did)."""
    mem = parse_memory_log(log_text)
    predicted, basis = predict_kv_from_log(layout, mem)
    kv = {"logged": require_kv(mem), "predicted": predicted, "basis": basis}
    if layout.engine != "cpu" and mem.total_gib is not None:
        kv["predicted_before_launch"] = predict_before_launch(layout, mem.total_gib).kv_tokens
    return mem.as_dict(), kv


def predict_before_launch(layout: Layout, total_gib: float, args: dict | None = None) -> memory.StartupMemory:
    """:func:`llmlab.memory.predict_kv_before_launch` for a rehearsed layout on the card whose total memory a log
    reports (79.18 GiB: an H100; 139.8 GiB: an H200): the model of every reserved byte, with no vLLM figure.
    ``args``: the server's other engine arguments (a log's "non-default args"), of which the token budget, the
    sequence limit and eager mode move the reserved bytes."""
    args = args or {}
    return memory.predict_kv_before_launch(layout.model, memory.gpu_of_total(total_gib), layout.tp, layout.pp,
                                           dtype=layout.dtype, kv_dtype=layout.kv_dtype,
                                           max_model_len=layout.max_model_len, utilization=layout.utilization,
                                           max_num_batched_tokens=args.get("max_num_batched_tokens"),
                                           max_num_seqs=args.get("max_num_seqs"),
                                           enforce_eager=bool(args.get("enforce_eager")))


def bytes_per_decode_step(layout: Layout) -> int:
    """Bytes one GPU reads per batch-1 decode step, summed over the pipeline stages (they run one after the
    other; the GPUs of one stage read their shards at once): every weight once, except the input
    embedding, of which one row is read, and the experts a token is not routed to (a mixture of experts reads
    experts_per_token of each layer's; TP slices every expert alike).  KV reads are left out (a few MB at short
    contexts)."""
    s = memory.model_spec(layout.model)
    stages = layout.weights_per_stage()
    unrouted = (memory.weight_bytes(s, layout.dtype) - memory.active_weight_bytes(s, layout.dtype)) // layout.tp
    embed = memory.tensors(s)[0]
    rows = -(-(-(-embed.shape[0] // 64) * 64) // layout.tp)  # vLLM pads the vocabulary to 64, then shards it
    bits = memory.DTYPE_BITS[memory.serve_dtype(s, layout.dtype)]
    embed_shard = rows * embed.shape[1] * bits // 8
    row = embed.shape[1] * bits // 8
    return sum(stages) - embed_shard + row - unrouted


def roofline_tok_s(layout: Layout, bandwidth_bytes_s: float) -> float:
    """The batch-1 ceiling: a decode step cannot be faster than reading its bytes at the measured bandwidth."""
    return bandwidth_bytes_s / bytes_per_decode_step(layout)


# --------------------------------------------------------------------------------------------------
# Results for notebook 09
# --------------------------------------------------------------------------------------------------

def load_result(folder: str | Path) -> dict:
    """The ``rehearsal.json`` of one rehearsal's folder (``llmlab rehearse --out FOLDER``), with its ``folder``; a
    bare name that is no folder here is a committed run's (``"h100-llama3.1-8b-tp1"``: ``benchmarks/results/``)."""
    folder = Path(folder)
    if len(folder.parts) == 1 and not folder.is_dir():
        folder = Path(RESULTS_DIR) / folder
    path = folder / "rehearsal.json"
    if not path.is_file():
        raise RehearseError(f"No {path}: the rehearsal did not finish (its output says why), or ran with another "
                            "--out.")
    r = json.loads(path.read_text())
    r["folder"] = path.parent.name
    probe = [q for q in r.get("memory_probe") or [] if "weights" in q]
    if probe:  # from the bytes, not from the probe's flag (see graph_estimate_subtracted)
        r["cuda_graph_estimate_subtracted"] = graph_estimate_subtracted(probe[0])
    return r


def load_results(root: str | Path | None = None) -> list[dict]:
    """Every committed ``rehearsal.json`` under ``benchmarks/results`` (or ``root``), each with its ``folder``."""
    root = Path(root or RESULTS_DIR)
    return [load_result(p.parent) for p in sorted(root.glob("*/rehearsal.json"))]


def results_table(results: list[dict] | None = None):
    """One row per rehearsal: layout, memory, KV (logged / predicted / before start), bandwidth, decode."""
    import pandas as pd

    rows = []
    for r in results if results is not None else load_results():
        best = max(r["sweep"], key=lambda s: s["output_tokens_per_s"]) if r["sweep"] else {}
        gpus = max(r["gpu_count"], 1)
        rows.append({"run": r["folder"] if "folder" in r else r["job"], "gpu": r["gpu_label"],
                     "model": r["model"], "TP": r["tp"], "PP": r["pp"], "start-up s": r["startup_s"],
                     "weights GiB/GPU": round(r["weights_gib"], 2), "KV tokens logged": r["kv_tokens_logged"],
                     "KV predicted": r["kv_tokens_predicted"],
                     "KV before start": r["kv_tokens_predicted_before_start"],
                     "KV before launch": r.get("kv_tokens_predicted_before_launch"),
                     "TB/s": round(r["bandwidth_tb_s"], 2), "roofline tok/s": round(r["roofline_tok_s"], 1),
                     "batch-1 tok/s": round(r["decode_tok_s_batch1"], 1),
                     "of roofline": round(r["decode_vs_roofline"], 2),
                     "best tok/s": round(best.get("output_tokens_per_s", 0)),
                     "best tok/s per GPU": round(best.get("output_tokens_per_s", 0) / gpus)})
    return pd.DataFrame(rows).set_index("run")


BEFORE_LAUNCH_TABLE = "kv-before-launch.json"
_ARGS = re.compile(r"non-default args: (\{.*\})")
_DTYPE_OF_QUANT = {"fp8": "fp8"}


def _server_logs(root: Path) -> list[Path]:
    """Every committed vLLM GPU server log under ``root`` that sized a KV cache (workers' logs left out)."""
    logs = [*root.rglob(LOG_EXCERPT), *root.rglob("vllm-*.log")]
    return sorted(p for p in logs if not p.name.startswith("vllm-worker-")
                  and not p.relative_to(root).parts[0].startswith("cpu-"))


def log_layout(text: str) -> tuple[Layout, dict]:
    """The layout a vLLM log was started with, read from its "non-default args: {...}" line, and those args."""
    import ast

    m = _ARGS.search(text)
    if not m:
        raise RehearseError("No 'non-default args' line in this log: it is not a vLLM server's start-up log.")
    args = ast.literal_eval(m[1])
    names = args.get("served_model_name") or [args["model"]]
    layout = Layout(names[0], args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1),
                    args.get("max_model_len"), args.get("gpu_memory_utilization", memory.DEFAULT_UTILIZATION),
                    _DTYPE_OF_QUANT.get(args.get("quantization")), args.get("kv_cache_dtype", "auto"))
    return layout, args


def before_launch_row(path: Path, root: Path) -> dict:
    """One committed run: the KV tokens vLLM logged and those llmlab predicts before launch, and the error."""
    text = path.read_text(errors="replace")
    layout, args = log_layout(text)
    mem = parse_memory_log(text)
    pred = predict_before_launch(layout, mem.total_gib, args)
    logged = require_kv(mem)
    flags = {k: args[k] for k in ("quantization", "kv_cache_dtype", "enforce_eager", "max_num_batched_tokens",
                                  "max_num_seqs") if k in args}
    return {"run": str(path.relative_to(root)), "gpu": pred.gpu, "model": layout.model, "tp": layout.tp,
            "pp": layout.pp, "flags": flags, "vllm_version": mem.vllm_version, "runner": pred.runner,
            "logged": logged, "predicted_before_launch": pred.kv_tokens,
            "error": round((pred.kv_tokens - logged) / logged, 6)}


def before_launch_table(root: str | Path | None = None) -> list[dict]:
    """Logged vs predicted-before-launch KV tokens for every committed GPU run under ``root`` (default
    ``benchmarks/results``): the table committed as ``kv-before-launch.json``, which a unit test recomputes."""
    root = Path(root or RESULTS_DIR)
    return [before_launch_row(p, root) for p in _server_logs(root)]


def write_before_launch_table(root: str | Path | None = None) -> Path:
    """Write ``kv-before-launch.json`` under ``root``: :func:`before_launch_table`, which constants were fitted on
    which runs, and the largest error.  Refresh after changing the model: ``python -c "from llmlab import rehearse;
    rehearse.write_before_launch_table()"``; ``tests/unit/test_memory_startup.py`` fails while it is stale."""
    root = Path(root or RESULTS_DIR)
    rows = before_launch_table(root)
    doc = {"about": "KV tokens vLLM logged vs llmlab.memory.predict_kv_before_launch (no vLLM figure used), per "
                    "committed GPU server log; error = (predicted - logged) / logged",
           "fitted_on": {k: list(v) for k, v in memory.FITTED.items()},
           "largest_error": max((abs(r["error"]) for r in rows), default=0.0),
           "misses": [r["run"] for r in rows if abs(r["error"]) >= 0.01], "rows": rows}
    path = root / BEFORE_LAUNCH_TABLE
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def plot_rehearsal(result: dict, axes=None, path: str | Path | None = None):
    """Three panels: batch-1 decode vs the roofline, throughput vs concurrency, KV tokens predicted vs logged."""
    import matplotlib

    if path is not None and axes is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    a, b, c = axes
    a.bar(["roofline", "measured"], [result["roofline_tok_s"], result["decode_tok_s_batch1"]],
          color=["lightgrey", "tab:blue"])
    a.set(ylabel="tokens / s (one request)", title=f"Batch-1 decode: {result['decode_vs_roofline']:.0%} of roofline")
    conc = [s["concurrency"] for s in result["sweep"]]
    tput = [s["output_tokens_per_s"] for s in result["sweep"]]
    b.plot(conc, tput, "o-")
    b.set_xscale("log", base=2)
    b.minorticks_off()
    b.set_xticks(conc, [str(x) for x in conc])
    b.set(xlabel="requests in flight", ylabel="output tokens / s", title="Throughput vs concurrency")
    vals = [result["kv_tokens_predicted_before_start"], result["kv_tokens_predicted"], result["kv_tokens_logged"]]
    c.bar(["llmlab\nbefore start", "llmlab given\nvLLM's figures", "vLLM\nlogged"], vals,
          color=["lightgrey", "tab:green", "tab:blue"])
    c.set(ylabel="KV cache tokens", title="KV cache: predicted vs allocated")
    fig = a.figure
    fig.suptitle(f"{result['model']} TP={result['tp']} x PP={result['pp']} on {result['gpu']}")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return axes


def check_math(result: dict) -> list[str]:
    """What a committed result must satisfy; [] when it does (the notebook and the tests assert this)."""
    problems = []
    if result["kv_tokens_predicted"] != result["kv_tokens_logged"]:
        problems.append(f"KV tokens predicted {result['kv_tokens_predicted']:,} != "
                        f"logged {result['kv_tokens_logged']:,}")
    launch = result.get("kv_tokens_predicted_before_launch")
    if launch is not None and result["kv_tokens_logged"] and \
            abs(launch - result["kv_tokens_logged"]) >= 0.01 * result["kv_tokens_logged"]:
        problems.append(f"KV tokens predicted before launch {launch:,} are not within 1 % of "
                        f"logged {result['kv_tokens_logged']:,}")
    if not math.isclose(result["decode_vs_roofline"], result["decode_tok_s_batch1"] / result["roofline_tok_s"],
                        rel_tol=1e-9):
        problems.append("decode_vs_roofline is not decode / roofline")
    return problems
