"""GPUs and the planner: how many cards, which TP x PP layout, its ``vllm serve`` line, one report.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, planner.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmlab.memory.kv import kv_blocks, kv_bytes_per_token, kv_cache_bytes, kv_tokens_held
from llmlab.memory.model import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_UTILIZATION,
    FLOAT_DTYPES,
    GPU_BLOCK_SIZE,
    GiB,
    ModelSpec,
    PlanError,
    UnknownName,
    model_spec,
    normalize_dtype,
    normalize_kv_dtype,
    serve_dtype,
)
from llmlab.memory.weights import (
    active_params,
    param_count,
    pp_partition,
    valid_tp_sizes,
    weight_bytes,
    weight_bytes_per_gpu,
)

# --------------------------------------------------------------------------------------------------
# GPUs
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPU:
    """A GPU model: its datasheet label, and the total memory CUDA/ROCm report (what vLLM's
    gpu_memory_utilization multiplies)."""

    name: str
    label: str
    memory_bytes: int
    note: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


def _gib(x: float) -> int:
    return round(x * GiB)


GPUS = {
    "A100-40": GPU("A100-40", "40 GB", _gib(39.59), "A100-SXM4-40GB as PyTorch reports it"),
    "A100-80": GPU("A100-80", "80 GB", _gib(79.15), "A100-SXM4-80GB as PyTorch reports it"),
    "H100-80": GPU("H100-80", "80 GB", _gib(79.18), "H100 80GB HBM3, measured in vLLM's log"),
    "H200-141": GPU("H200-141", "141 GB", _gib(139.81), "H200 as PyTorch reports it"),
    "MI300X-192": GPU("MI300X-192", "192 GB", _gib(191.98), "MI300X as PyTorch (ROCm) reports it"),
}
_GPU_ALIASES = {"A100": "A100-80", "H100": "H100-80", "H200": "H200-141", "MI300X": "MI300X-192"}


def gpu(name) -> GPU:
    """A named GPU (``H100-80``, ``A100-40``, ...; case and a trailing "GB" do not matter), a
    :class:`GPU`, or a custom size: ``custom:48`` or the number 48 (GiB as the driver reports it)."""
    if isinstance(name, GPU):
        return name
    if isinstance(name, int | float) and not isinstance(name, bool):
        if name <= 0:
            raise UnknownName(f"A custom GPU needs a positive size in GiB, got {name}.")
        return GPU(f"custom-{name:g}", f"{name:g} GiB", _gib(name), "custom size")
    key = str(name).strip().upper().replace("_", "-").removesuffix("GB")
    if key.startswith("CUSTOM:"):
        try:
            return gpu(float(key.split(":", 1)[1]))
        except ValueError:
            raise UnknownName(f"{name!r}: write a custom GPU as custom:<GiB>, e.g. custom:48.") from None
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS and re.fullmatch(r"\d+(\.\d+)?", key):
        return gpu(float(key))
    if key not in GPUS:
        raise UnknownName(f"Unknown GPU {name!r}. Known: {', '.join(GPUS)}; or custom:<GiB> (e.g. custom:48).")
    return GPUS[key]


def usable_bytes(gpu_name, utilization: float = DEFAULT_UTILIZATION,
                 overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> int:
    """Memory per GPU left for weights and KV cache: utilization x total, minus the activation allowance."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    return int(utilization * gpu(gpu_name).memory_bytes) - _gib(overhead_gib)


def _usable_or_fail(gpu_name, utilization: float, overhead_gib: float) -> int:
    usable = usable_bytes(gpu_name, utilization, overhead_gib)
    if usable <= 0:
        raise PlanError(f"{gpu(gpu_name).name} at utilization {utilization} leaves nothing after the "
                        f"{overhead_gib} GiB activation allowance: use a larger GPU or a smaller allowance.")
    return usable


@dataclass(frozen=True)
class GPUCount:
    """How many GPUs' worth of usable memory a model needs (layout constraints not applied)."""

    weights: float            # fractional GPUs for the weights alone
    total: float              # ... for weights + KV cache
    weights_whole: int
    total_whole: int
    usable_bytes_per_gpu: int


def gpus_needed(model, dtype: str | None = None, kv_dtype: str = "auto", tokens: int = 0, concurrency: int = 1,
                gpu_name="H100-80", utilization: float = DEFAULT_UTILIZATION,
                overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> GPUCount:
    """Memory needed divided by what one GPU offers vLLM, rounded up.  A lower bound: a real layout
    must also divide the heads (see :func:`plan`), which often rounds it up further."""
    usable = _usable_or_fail(gpu_name, utilization, overhead_gib)
    w = weight_bytes(model, dtype)
    t = w + kv_cache_bytes(model, tokens, concurrency, kv_dtype, dtype)
    return GPUCount(w / usable, t / usable, math.ceil(w / usable), max(1, math.ceil(t / usable)), usable)


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """A layout that fits: TP within a node, one pipeline stage per node, and what it leaves for KV."""

    model: str
    dtype: str
    kv_dtype: str
    gpu: str
    gpus_per_node: int
    tp: int
    pp: int
    nodes: int
    gpus: int
    context: int
    concurrency: int
    utilization: float
    weight_bytes_per_gpu: int      # the fullest GPU's share
    kv_budget_bytes_per_gpu: int   # the emptiest GPU's KV budget
    kv_bytes_per_token_per_gpu: int
    kv_blocks: int
    kv_tokens: int                 # what vLLM would log as "KV cache size"
    max_concurrency: float         # at `context` tokens per request
    command: str
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _evaluate(s: ModelSpec, dtype, kv_dtype, tp, pp, usable, context, block_size):
    """(weights, KV budgets, KV bytes per token) per stage of a TP x PP layout, its KV blocks (the smallest
    over the stages, as vLLM takes) and the concurrency at ``context``; None if the weights do not fit."""
    weights = weight_bytes_per_gpu(s, dtype, tp, pp)
    budgets = [usable - w for w in weights]
    if min(budgets) <= 0:
        return None
    per_token = [kv_bytes_per_token(s, kv_dtype, dtype, tp, n) for n in pp_partition(s.num_layers, pp)]
    blocks = min(kv_blocks(b, p, block_size) for b, p in zip(budgets, per_token, strict=True))
    held = kv_tokens_held(s, context)  # a sliding-window model needs blocks for its window only
    concurrency = blocks / -(-held // block_size)
    return weights, budgets, per_token, blocks, concurrency


def plan(model, dtype: str | None = None, kv_dtype: str = "auto", gpu_name="H100-80", gpus_per_node: int = 8,
         context: int | None = None, concurrency: int = 1, utilization: float = DEFAULT_UTILIZATION,
         overhead_gib: float = DEFAULT_OVERHEAD_GIB, max_nodes: int = 64,
         block_size: int = GPU_BLOCK_SIZE) -> Plan:
    """The smallest valid layout that holds the weights and ``concurrency`` requests of ``context`` tokens.

    Tensor parallelism stays inside a node (it all-reduces twice per layer: it needs NVLink), and
    pipeline parallelism spans nodes, one stage per node (it only passes activations between stages).
    "Smallest" means fewest nodes first, then fewest GPUs per node.  vLLM would also accept PP inside a
    node, which sometimes needs fewer GPUs in all (405B in bf16: TP=4 x PP=3 = 12 H100s for one 128k
    request); this planner keeps stages on node boundaries, as clusters allocate whole nodes.
    """
    s = model_spec(model)
    context = context or s.require_context()
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    usable = _usable_or_fail(gpu_name, utilization, overhead_gib)
    tps = valid_tp_sizes(s, gpus_per_node)
    candidates = sorted(((tp, pp) for pp in range(1, min(max_nodes, s.num_layers) + 1) for tp in tps),
                        key=lambda c: (c[1], c[0]))
    for tp, pp in candidates:
        found = _evaluate(s, dtype, kv_dtype, tp, pp, usable, context, block_size)
        if found is None or found[4] < concurrency:
            continue
        weights, budgets, per_token, blocks, fits = found
        cmd, notes = serve_command(s, tp=tp, pp=pp, max_model_len=context, dtype=dtype, kv_dtype=kv_dtype,
                                   gpu_memory_utilization=utilization)
        if s.sliding_window and context > s.sliding_window:
            notes.append(f"sliding window of {s.sliding_window} tokens: concurrency is approximate "
                         "(vLLM reserves one scheduling chunk more per request)")
        return Plan(s.name, dtype or "checkpoint", kv_dtype, gpu(gpu_name).name, gpus_per_node, tp, pp, pp,
                    tp * pp, context, concurrency, utilization, max(weights), min(budgets), max(per_token),
                    blocks, int(fits * context), fits, cmd, notes)
    raise PlanError(f"{s.name} does not fit {concurrency} request(s) of {context:,} tokens on up to {max_nodes} "
                    f"nodes of {gpus_per_node} x {gpu(gpu_name).name}: use a smaller dtype or context, or more "
                    "GPUs per node.")


def serve_command(model, tp: int = 1, pp: int = 1, max_model_len: int | None = None, dtype: str | None = None,
                  kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_UTILIZATION,
                  model_id: str | None = None) -> tuple[str, list[str]]:
    """The ``vllm serve`` line for a layout, and notes on what it assumes.  Only flags that differ from
    vLLM's defaults are written, except the parallel sizes, context and utilization, which are the plan."""
    s = model_spec(model)
    notes: list[str] = []
    local = str(Path(s.source).parent) if s.source.endswith(".json") else s.name
    args = ["vllm", "serve", model_id or s.hf_id or local]
    if dtype is None:
        if s.require_dtype() == "float32":
            args += ["--dtype", "float32"]  # vLLM's "auto" would downcast a float32 checkpoint to bfloat16
    else:
        d = normalize_dtype(dtype)
        if d in FLOAT_DTYPES:
            args += ["--dtype", d]
        elif d == "fp8" and s.quant_method is None:
            args += ["--quantization", "fp8"]
            notes.append("--quantization fp8 quantizes the linear layers at load time; embeddings and norms "
                         "stay 16-bit, so memory is a little above the all-fp8 estimate")
        elif d in ("int8", "int4"):
            notes.append(f"{d} needs a pre-quantized checkpoint (GPTQ, AWQ, compressed-tensors): serve that "
                         "repository; vLLM reads its quantization from its config.json")
    kv = normalize_kv_dtype(kv_dtype)
    if kv not in ("auto", serve_dtype(s, dtype)):
        if kv == "float32":
            raise PlanError("vLLM stores a float32 KV cache only when it computes in float32: use dtype='float32' "
                            "with kv_dtype='auto'.")
        args += ["--kv-cache-dtype", kv]
    args += ["--tensor-parallel-size", str(tp)]
    if pp > 1:
        args += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "ray"]
        notes.append("PP > 1 spans nodes: start a Ray cluster over them first (the SLURM launcher does)")
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    return " ".join(args), notes


# --------------------------------------------------------------------------------------------------
# One report (the CLI's --json, and the notebook's calculator)
# --------------------------------------------------------------------------------------------------

def memory_report(model, dtype: str | None = None, kv_dtype: str = "auto", tokens: int | None = None,
                  concurrency: int = 1, gpu_name="H100-80", gpus_per_node: int = 8,
                  utilization: float = DEFAULT_UTILIZATION, overhead_gib: float = DEFAULT_OVERHEAD_GIB) -> dict:
    """Everything about one model on one GPU type, as plain numbers.  ``tokens`` defaults to the model's
    full context (max_position_embeddings).  ``plan`` is None (and ``plan_error`` says why) if nothing fits."""
    s = model_spec(model)
    tokens = s.require_context() if tokens is None else tokens
    count = gpus_needed(s, dtype, kv_dtype, tokens, concurrency, gpu_name, utilization, overhead_gib)
    report = {
        "model": s.name, "architecture": s.architecture, "source": s.source,
        "params": param_count(s), "active_params": active_params(s),
        "dtype": dtype and normalize_dtype(dtype) or f"checkpoint ({s.torch_dtype})",
        "weight_bytes": weight_bytes(s, dtype),
        "kv_dtype": kv_dtype, "kv_bytes_per_token": kv_bytes_per_token(s, kv_dtype, dtype),
        "tokens": tokens, "concurrency": concurrency,
        "kv_cache_bytes": kv_cache_bytes(s, tokens, concurrency, kv_dtype, dtype),
        "gpu": gpu(gpu_name).name, "gpu_memory_bytes": gpu(gpu_name).memory_bytes,
        "gpu_memory_utilization": utilization, "overhead_gib": overhead_gib,
        "usable_bytes_per_gpu": count.usable_bytes_per_gpu,
        "gpus_needed_weights": count.weights_whole, "gpus_needed": count.total_whole,
        "gpus_needed_exact": round(count.total, 3),
        "sliding_window": s.sliding_window, "defaults_applied": list(s.defaults_applied),
        "plan": None, "plan_error": None,
    }
    try:
        report["plan"] = plan(s, dtype, kv_dtype, gpu_name, gpus_per_node, tokens, concurrency, utilization,
                              overhead_gib).as_dict() if tokens else None
    except PlanError as e:
        report["plan_error"] = str(e)
    return report
