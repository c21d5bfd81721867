"""The planner: the smallest TP x PP layout that fits, its ``vllm serve`` line, and one report.

Why: a learner asks "what do I run on these GPUs?"; the answer is the first layout, in the order a cluster
allocates (fewest nodes, then fewest GPUs per node), that :func:`layout_fit` says holds the requests.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, gpus, fit, planner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmlab.memory.fit import layout_fit
from llmlab.memory.gpus import _usable_or_fail, gpu, gpus_needed
from llmlab.memory.kv import kv_bytes_per_token, kv_cache_bytes
from llmlab.memory.model import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_UTILIZATION,
    FLOAT_DTYPES,
    GPU_BLOCK_SIZE,
    PlanError,
    UnsupportedArchitecture,
    model_spec,
    normalize_dtype,
    normalize_kv_dtype,
    serve_dtype,
)
from llmlab.memory.reference import transformers_param_count
from llmlab.memory.weights import active_params, check_tp, param_count, valid_tp_sizes, weight_bytes

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


def plan(model, dtype: str | None = None, kv_dtype: str = "auto", gpu_name="H100-80", gpus_per_node: int = 8,
         context: int | None = None, concurrency: int = 1, utilization: float = DEFAULT_UTILIZATION,
         overhead_gib: float = DEFAULT_OVERHEAD_GIB, max_nodes: int = 64,
         block_size: int = GPU_BLOCK_SIZE, expert_parallel: bool = False) -> Plan:
    """The smallest valid layout that holds the weights and ``concurrency`` requests of ``context`` tokens.

    Tensor parallelism stays inside a node (it all-reduces twice per layer: it needs NVLink), and
    pipeline parallelism spans nodes, one stage per node (it only passes activations between stages).
    "Smallest" means fewest nodes first, then fewest GPUs per node.  vLLM would also accept PP inside a
    node, which sometimes needs fewer GPUs in all (405B in bf16: TP=1 x PP=13 = 13 H100s for one 128k
    request); this planner keeps stages on node boundaries, as clusters allocate whole nodes.  Each
    candidate is judged by :func:`layout_fit`, the same check ``llmlab launch`` and ``llmlab generate`` make.
    ``expert_parallel``: a mixture of experts deals its experts out whole to the TP group's GPUs.
    """
    s = model_spec(model)
    context = context or s.require_context()
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    _usable_or_fail(gpu_name, utilization, overhead_gib)
    if expert_parallel:
        check_tp(s, 1, expert_parallel)  # a dense model: one sentence, not "no layout fits"
    tps = valid_tp_sizes(s, gpus_per_node, expert_parallel)
    if not tps:
        raise PlanError(f"{s.name}: no tensor-parallel size up to {gpus_per_node} divides its heads and widths.")
    candidates = sorted(((tp, pp) for pp in range(1, min(max_nodes, s.num_layers) + 1) for tp in tps),
                        key=lambda c: (c[1], c[0]))
    for tp, pp in candidates:
        fit = layout_fit(s, tp, pp, gpu_name, dtype=dtype, kv_dtype=kv_dtype, context=context,
                         concurrency=concurrency, utilization=utilization, overhead_gib=overhead_gib,
                         block_size=block_size, expert_parallel=expert_parallel)
        if not fit.fits:
            continue
        cmd, notes = serve_command(s, tp=tp, pp=pp, max_model_len=context, dtype=dtype, kv_dtype=kv_dtype,
                                   gpu_memory_utilization=utilization, expert_parallel=expert_parallel)
        if s.sliding_window and context > s.sliding_window:
            notes.append(f"sliding window of {s.sliding_window} tokens on {len(s.sliding_layers)} of {s.num_layers} "
                         "layers: vLLM reserves the window plus two steps of 8,192 tokens for each, as an H100 or "
                         "H200 schedules them (--max-num-batched-tokens changes that)")
        return Plan(s.name, dtype or "checkpoint", kv_dtype, fit.gpu, gpus_per_node, tp, pp, pp, tp * pp, context,
                    concurrency, utilization, fit.weight_bytes_per_gpu, fit.kv_budget_bytes_per_gpu,
                    fit.kv_bytes_per_token_per_gpu, fit.kv_blocks, fit.kv_tokens, fit.max_concurrency, cmd, notes)
    raise PlanError(f"{s.name} does not fit {concurrency} request(s) of {context:,} tokens on up to {max_nodes} "
                    f"nodes of {gpus_per_node} x {gpu(gpu_name).name}: use a smaller dtype or context, or more "
                    "GPUs per node.")


def serve_command(model, tp: int = 1, pp: int = 1, max_model_len: int | None = None, dtype: str | None = None,
                  kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_UTILIZATION,
                  model_id: str | None = None, expert_parallel: bool = False) -> tuple[str, list[str]]:
    """The ``vllm serve`` line for a layout (:func:`serve_args`, joined for reading), and notes on what it
    assumes."""
    args, notes = serve_args(model, tp, pp, max_model_len, dtype, kv_dtype, gpu_memory_utilization, model_id,
                             expert_parallel)
    return " ".join(args), notes


def serve_args(model, tp: int = 1, pp: int = 1, max_model_len: int | None = None, dtype: str | None = None,
               kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_UTILIZATION,
               model_id: str | None = None, expert_parallel: bool = False) -> tuple[list[str], list[str]]:
    """The ``vllm serve`` argv for a layout (``vllm serve MODEL`` and :func:`serve_flags`), and its notes."""
    s = model_spec(model)
    local = str(Path(s.source).parent) if s.source.endswith(".json") else s.name
    flags, notes = serve_flags(model, tp, pp, max_model_len, dtype, kv_dtype, gpu_memory_utilization,
                               expert_parallel)
    return ["vllm", "serve", model_id or s.hf_id or local, *flags], notes


def serve_flags(model, tp: int = 1, pp: int = 1, max_model_len: int | None = None, dtype: str | None = None,
                kv_dtype: str = "auto", gpu_memory_utilization: float = DEFAULT_UTILIZATION,
                expert_parallel: bool = False) -> tuple[list[str], list[str]]:
    """The flags of a layout's ``vllm serve`` line, and notes on what they assume.  Only flags that differ from
    vLLM's defaults are written, except the parallel sizes, context and utilization, which are the plan.  The
    SLURM launcher and the rehearsals run these flags (``llmlab.cluster.job_flags``) as an argv: never a string
    split back into a list."""
    s = model_spec(model)
    notes: list[str] = []
    args: list[str] = []
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
    if expert_parallel:
        args.append("--enable-expert-parallel")
    if pp > 1:
        args += ["--pipeline-parallel-size", str(pp), "--distributed-executor-backend", "ray"]
        notes.append("PP > 1 spans nodes: start a Ray cluster over them first (the SLURM launcher does)")
    if max_model_len:
        args += ["--max-model-len", str(max_model_len)]
    args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    return args, notes


# --------------------------------------------------------------------------------------------------
# One report (the CLI's --json, and the notebook's calculator)
# --------------------------------------------------------------------------------------------------

def memory_report(model, dtype: str | None = None, kv_dtype: str = "auto", tokens: int | None = None,
                  concurrency: int = 1, gpu_name="H100-80", gpus_per_node: int = 8,
                  utilization: float = DEFAULT_UTILIZATION, overhead_gib: float = DEFAULT_OVERHEAD_GIB,
                  expert_parallel: bool = False) -> dict:
    """Everything about one model on one GPU type, as plain numbers.  ``tokens`` defaults to the model's
    full context (max_position_embeddings).  ``plan`` is None (and ``plan_error`` says why) if nothing fits.
    An architecture llmlab has no formulas for gets ``supported`` False, transformers' parameter count and
    ``why``: nothing else, since its KV cache would be a guess."""
    try:
        s = model_spec(model)
    except UnsupportedArchitecture as e:  # transformers can count it; the rest would be a guess
        name = str(model) if isinstance(model, str | Path) else "config"
        return {"model": name, "supported": False, "why": str(e), "params": transformers_param_count(model)}
    if expert_parallel:
        check_tp(s, 1, expert_parallel)
    tokens = s.require_context() if tokens is None else tokens
    count = gpus_needed(s, dtype, kv_dtype, tokens, concurrency, gpu_name, utilization, overhead_gib)
    report = {
        "model": s.name, "architecture": s.architecture, "source": s.source,
        "params": param_count(s), "active_params": active_params(s),
        "dtype": dtype and normalize_dtype(dtype) or f"checkpoint ({s.torch_dtype}"
                 f"{f', {s.quant_method} matrices' if s.quant_method else ''})",
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
        "expert_parallel": expert_parallel, "supported": True,
        "plan": None, "plan_error": None,
    }
    try:
        report["plan"] = plan(s, dtype, kv_dtype, gpu_name, gpus_per_node, tokens, concurrency, utilization,
                              overhead_gib, expert_parallel=expert_parallel).as_dict() if tokens else None
    except PlanError as e:
        report["plan_error"] = str(e)
    report["before_launch"] = _before_launch(s, report["plan"], dtype, kv_dtype, gpu_name, tokens, utilization,
                                             expert_parallel)
    return report


def _before_launch(s, the_plan: dict | None, dtype, kv_dtype, gpu_name, tokens, utilization,
                   expert_parallel: bool) -> dict | None:
    """The plan's layout as vLLM 0.26 will size its KV pool (:func:`predict_kv_before_launch`): every reserved
    byte of one GPU and the tokens it will log; None without a plan (or with expert parallelism, not modelled)."""
    if not the_plan or expert_parallel:
        return None
    from llmlab.memory.startup import predict_kv_before_launch

    try:
        pred = predict_kv_before_launch(s, gpu_name, the_plan["tp"], the_plan["pp"], dtype=dtype, kv_dtype=kv_dtype,
                                        max_model_len=tokens, utilization=utilization)
    except (ValueError, KeyError):
        return None
    return {**pred.as_dict(), "reserved": pred.reserved(), "lines": pred.lines()}
