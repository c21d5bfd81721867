"""The KV pool predicted before launch: what vLLM 0.26 reserves on a GPU besides the KV cache, term by term.

Why: lesson 01 promises "how many tokens fit, before you spend a GPU hour".  A fixed allowance
(``DEFAULT_OVERHEAD_GIB``) lands 1.5-3 % low on the committed GPU runs; the exact figure needs vLLM's own
measurements.  This module models those measurements from the config, the GPU and the flags, with no vLLM
running.  vLLM's CUDA worker (``vllm/v1/worker/gpu_worker.py``, ``determine_available_memory``) sizes the pool as

    available = ceil(utilization x total)              the requested share of the card
                - weights as loaded                     torch's allocated bytes grown during load_model
                - torch peak increase of the profile    one dummy forward of max_num_batched_tokens tokens
                                                        (attention skipped) plus the sampler warm-up
                - non-torch increase                    CUDA context, cuBLAS workspaces, NCCL
                - the CUDA-graph estimate               only where the runner computes one (see below)

(0.26's arithmetic: the probe's bytes satisfy it exactly on every committed run; 0.27's source measures the
consumed memory another way), and ``kv_cache_utils.py`` turns ``available`` into whole blocks of 16 tokens (a
block is one page of every layer of a KV cache group), the smallest count over all GPUs, and the tokens it logs.

Each term here is a formula; the two that vLLM measures rather than computes carry constants fitted on the
committed runs, and say so (:data:`FITTED`): the activation peak (two constants) and non-torch memory (one
constant per case, one GPU or several).  The CUDA-graph memory of vLLM 0.26's default model runner for dense
models ("model runner V2", ``vllm/v1/worker/gpu/model_runner.py``) is *not* subtracted: its
``profile_cudagraph_memory`` returns 0, so the graphs (0.45-1.52 GiB on the committed runs) come out of the
1 - utilization share.  The older runner (``gpu_model_runner.py``, which 0.26 used for gpt-oss) captures two
graphs of each mode to estimate them and subtracts that; the estimate depends on the kernels captured, and is
modelled here as the committed run's measured figure per graph (a constant, not a formula:
:data:`V1_GRAPH_BYTES_PER_GRAPH`).

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read after kv, gpus and fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from llmlab.memory.gpus import GPU, gpu
from llmlab.memory.kv import GPU_IN_FLIGHT_TOKENS, kv_capacity, kv_layout
from llmlab.memory.model import (
    DEFAULT_UTILIZATION,
    DTYPE_BITS,
    GPU_BLOCK_SIZE,
    GiB,
    ModelSpec,
    model_spec,
    normalize_dtype,
    serve_dtype,
)
from llmlab.memory.weights import _shard, _stage_of, stage_layers, tensors, weight_bytes_per_gpu

MiB = 2**20

# Total memory as CUDA reports it (torch.cuda.mem_get_info), read from the committed runs' probe bytes; what
# vLLM multiplies by gpu_memory_utilization.  Other cards: llmlab.memory.GPUS' figure (to 0.01 GiB).
REPORTED_TOTAL_BYTES = {"H100-80": 85_017_493_504, "H200-141": 150_109_880_320}

# vLLM's scheduler defaults for the API server on a card of >= 70 GiB other than an A100
# (vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args); smaller cards get 2,048 / 256.
LARGE_GPU_BATCHED_TOKENS, LARGE_GPU_MAX_SEQS = 8192, 1024
SMALL_GPU_BATCHED_TOKENS, SMALL_GPU_MAX_SEQS = 2048, 256

# The activation peak of vLLM's profile run (torch's "allocated_bytes.all.peak" grown during it), per token of
# max_num_batched_tokens and per byte of activation dtype: ACT_PER_MLP x the MLP width one GPU holds
# (intermediate_size / TP; routed experts x their width for a mixture of experts) + ACT_PER_HIDDEN x hidden_size.
# The MLP's gate_up output (2 x width) and its SiLU product (1 x width) alone give 3; the compiled graph's
# temporaries the rest.  Fitted exactly on h100-llama3.1-8b-tp1 (1,184,948,736 B) and h200-llama3.1-70b-tp2
# (1,247,855,104 B), then rounded; every other committed run is a check (h200-llama3.1-8b-tp2 measured 765,722,624 B).
ACT_PER_MLP = 4.78
ACT_PER_HIDDEN = 0.94

# vLLM's "non-torch increase" from worker creation to the end of profiling: 230 MiB on one GPU
# (h100-llama3.1-8b-tp1, the same bytes on every one-GPU Llama run), 68 MiB per GPU when the workers are
# separate processes with NCCL set up before the baseline snapshot (h200-llama3.1-70b-tp2; 66-68 MiB on
# every TP=2 and PP=2 run).
NON_TORCH_ONE_GPU = 241_172_480
NON_TORCH_PER_GPU_MULTI = 71_303_168

# The older runner's CUDA-graph estimate per graph it will capture, from h100-gpt-oss-20b-tp1
# (618,659,840 B for 83 PIECEWISE + 83 FULL graphs): a measured figure, not a formula.  It was fitted on the only
# committed run of that runner, so gpt-oss is no check of it (without it gpt-oss would be 1.7 % high).
V1_GRAPH_BYTES_PER_GRAPH = 618_659_840 / 166
V1_GRAPHS = 166

FITTED = {
    "activation peak (ACT_PER_MLP, ACT_PER_HIDDEN)": ("h100-llama3.1-8b-tp1", "h200-llama3.1-70b-tp2"),
    "non-torch (NON_TORCH_ONE_GPU, NON_TORCH_PER_GPU_MULTI)": ("h100-llama3.1-8b-tp1", "h200-llama3.1-70b-tp2"),
    "older runner's CUDA-graph estimate (V1_GRAPH_BYTES_PER_GRAPH)": ("h100-gpt-oss-20b-tp1",),
}


@dataclass(frozen=True)
class StartupMemory:
    """One layout's KV pool predicted before launch, with every reserved byte per GPU of each pipeline stage.

    ``*_per_stage`` tuples have one entry per stage (one GPU of it: TP shards alike); ``kv_blocks`` is the
    smallest count over the stages, which vLLM gives every GPU; ``kv_tokens`` is what it logs as
    "GPU KV cache size".
    """

    model: str
    gpu: str
    tp: int
    pp: int
    max_model_len: int
    utilization: float
    runner: str                                   # "v2" (dense) or "v1" (what 0.26 used for gpt-oss)
    max_num_batched_tokens: int
    total_bytes: int                              # the card as CUDA reports it
    requested_bytes: int                          # ceil(utilization x total)
    weights_per_stage: tuple[int, ...]
    activation_peak_per_stage: tuple[int, ...]
    non_torch_bytes: int
    cuda_graph_bytes: int                         # subtracted from the pool (0 on the V2 runner)
    kv_budget_per_stage: tuple[int, ...]
    bytes_per_block_per_stage: tuple[int, ...]
    kv_blocks: int
    kv_tokens: int
    max_concurrency: float

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def worst_stage(self) -> int:
        """The stage whose GPUs hold the fewest blocks (vLLM gives every GPU that many)."""
        blocks = [b // p for b, p in zip(self.kv_budget_per_stage, self.bytes_per_block_per_stage, strict=True)]
        return min(range(self.pp), key=lambda k: blocks[k])

    def reserved(self, stage: int | None = None) -> dict[str, int]:
        """Where each byte of one GPU goes (the deciding stage's by default), in the order vLLM subtracts them."""
        k = self.worst_stage if stage is None else stage
        return {"weights as loaded": self.weights_per_stage[k],
                "activation peak (profile run)": self.activation_peak_per_stage[k],
                "non-torch memory": self.non_torch_bytes,
                "CUDA-graph estimate": self.cuda_graph_bytes,
                "KV cache": self.kv_budget_per_stage[k],
                "left to vLLM (1 - utilization)": self.total_bytes - self.requested_bytes}

    def lines(self) -> list[str]:
        """The prediction in words: one line per reserved term of the deciding GPU, then the pool."""
        k = self.worst_stage
        where = "per GPU" if self.pp == 1 else f"per GPU of pipeline stage {k} (the fullest)"
        out = [f"KV pool predicted before launch ({self.model}, TP={self.tp} x PP={self.pp} on {self.gpu}, "
               f"vLLM 0.26 {self.runner.upper()} model runner), {where}:",
               f"  {self.total_bytes / GiB:8.2f} GiB  the card as CUDA reports it",
               f"  {self.requested_bytes / GiB:8.2f} GiB  vLLM may use ({self.utilization:g} x total)"]
        for name, b in self.reserved(k).items():
            if name.startswith("left"):
                continue
            out.append(f"  {b / GiB:8.2f} GiB  {name}")
        out.append(f"  = {self.kv_blocks:,} blocks of {GPU_BLOCK_SIZE} tokens: {self.kv_tokens:,} KV tokens, "
                   f"{self.max_concurrency:.2f} requests of {self.max_model_len:,} tokens at once")
        if self.runner == "v2":
            out.append("  (CUDA graphs are captured after sizing and come out of the 1 - utilization share)")
        return out


def gpu_of_total(total_gib: float) -> str:
    """The GPU name whose reported total memory a log's "Free memory on device (free/TOTAL GiB)" gives."""
    for name, b in REPORTED_TOTAL_BYTES.items():
        if abs(b / GiB - total_gib) < 0.01:
            return name
    return f"custom:{total_gib}"


def reported_total_bytes(card: GPU) -> int:
    """The card's total memory as CUDA reports it: measured bytes where a committed run read them."""
    return REPORTED_TOTAL_BYTES.get(card.name, card.memory_bytes)


def scheduler_defaults(card: GPU) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) vLLM's API server picks for this card when not told."""
    large = card.memory_bytes >= 70 * GiB and not card.name.startswith("A100")
    return (LARGE_GPU_BATCHED_TOKENS, LARGE_GPU_MAX_SEQS) if large else (SMALL_GPU_BATCHED_TOKENS, SMALL_GPU_MAX_SEQS)


def model_runner(s: ModelSpec) -> str:
    """Which of vLLM's model runners serves the model: the V2 runner (``model_runner.py``) for a model without
    experts, the older one (``gpu_model_runner.py``) for a mixture of experts, as vLLM's
    ``VllmConfig.use_v2_model_runner`` decides when ``VLLM_USE_V2_MODEL_RUNNER`` is unset (read in 0.27's source;
    a few MoE architectures it lists default to V2 there, none of llmlab's shipped ones).  The committed 0.26
    logs agree: ``model_runner.py`` for the Llamas, ``gpu_model_runner.py`` for gpt-oss."""
    return "v1" if s.num_experts else "v2"


def _online_fp8(s: ModelSpec, dtype: str | None) -> bool:
    return dtype is not None and normalize_dtype(dtype) == "fp8" and s.quant_method is None


def loaded_weight_bytes(model, dtype: str | None = None, tp: int = 1, pp: int = 1) -> list[int]:
    """Bytes one GPU of each stage holds once vLLM has loaded the model, as its "Model loading took" counts them.

    The parameters (``weight_bytes_per_gpu``), except that online FP8 (``--quantization fp8`` on a 16-bit
    checkpoint) quantizes only the linear layers' matrices (one byte each, plus a float32 scale per matrix)
    and keeps embeddings, LM head and norms in 16 bits; plus the rotary embedding's cos/sin cache, one
    (max_position_embeddings x rotary dim) table in the compute dtype, built with the model on every GPU.
    """
    s = model_spec(model)
    if _online_fp8(s, dtype):
        per_stage = _online_fp8_bytes(s, tp, pp)
    else:
        per_stage = weight_bytes_per_gpu(s, dtype, tp, pp)
    return [w + rotary_cache_bytes(s, dtype) for w in per_stage]


def _online_fp8_bytes(s: ModelSpec, tp: int, pp: int) -> list[int]:
    wide = DTYPE_BITS[serve_dtype(s, "fp8")] // 8
    stages = stage_layers(s.num_layers, pp)
    out = [0] * pp
    for t in tensors(s):
        numel, _ = _shard(s, t, tp)
        b = numel + 4 if t.is_matrix else numel * wide
        for k in _stage_of(t, stages):
            out[k] += b
    return out


def rotary_cache_bytes(model, dtype: str | None = None) -> int:
    """vLLM's rotary cos/sin cache: max_position_embeddings x rotary dim values in the compute dtype (one table,
    shared by the layers); 32 MiB for Llama 3.1's 131,072 positions x 128."""
    s = model_spec(model)
    rotary = s.qk_rope_head_dim if s.is_mla else s.head_dim
    return (s.max_position_embeddings or 0) * rotary * DTYPE_BITS[serve_dtype(s, dtype)] // 8


def mlp_width_per_gpu(model, tp: int = 1) -> int:
    """The MLP width one GPU computes per token: intermediate_size / TP, or for a mixture of experts the routed
    experts' (and shared experts') widths, each split TP ways."""
    s = model_spec(model)
    if s.num_experts:
        return (s.experts_per_token + s.shared_experts) * s.expert_width // tp
    return s.intermediate_size // tp


def activation_peak_bytes(model, tp: int = 1, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                          dtype: str | None = None, max_num_seqs: int = LARGE_GPU_MAX_SEQS) -> int:
    """The torch peak increase of vLLM's profile run: max_num_batched_tokens tokens through the model at once.

    Per token and per activation byte, ACT_PER_MLP x the MLP width one GPU holds + ACT_PER_HIDDEN x
    hidden_size (fitted constants: see their comment).  The same on every pipeline stage: the layers run one
    after another, so the peak is one layer's.  On the older runner the sampler warm-up can be higher
    (:func:`v1_sampler_peak_bytes`); the peak is the larger of the two.
    """
    s = model_spec(model)
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    per_token = ACT_PER_MLP * mlp_width_per_gpu(s, tp) + ACT_PER_HIDDEN * s.hidden_size
    layers = round(batched_tokens * act * per_token)
    if model_runner(s) == "v2":
        return layers
    return max(layers, v1_sampler_peak_bytes(s, tp, batched_tokens, dtype, max_num_seqs))


def v1_sampler_peak_bytes(model, tp: int = 1, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                          dtype: str | None = None, max_num_seqs: int = LARGE_GPU_MAX_SEQS) -> int:
    """The older runner's sampler warm-up (``gpu_model_runner.py``, ``_dummy_sampler_run``): logits for
    max_num_seqs rows of the (64-padded) vocabulary in the compute dtype, then three float32 tensors of that
    shape alive at once in the sampler (the float32 logits, the softmax probabilities, the exponential noise
    they are divided by), while the profile forward's hidden states (batched tokens x hidden) are still held.
    Counted from vLLM's source, not fitted; 2.7 GiB for gpt-oss-20b's 201,088-token vocabulary."""
    s = model_spec(model)
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    vocab = -(-s.vocab_size // 64) * 64
    return max_num_seqs * vocab * (act + 3 * 4) + batched_tokens * s.hidden_size * act


def non_torch_bytes(gpus: int) -> int:
    """vLLM's non-torch increase per GPU: measured constants, one GPU or several (see their comment)."""
    return NON_TORCH_ONE_GPU if gpus == 1 else NON_TORCH_PER_GPU_MULTI


def cuda_graph_bytes(runner: str, enforce_eager: bool = False) -> int:
    """The CUDA-graph memory vLLM 0.26 takes off the pool: none on the V2 runner, its estimate on the older one."""
    if enforce_eager or runner == "v2":
        return 0
    return round(V1_GRAPH_BYTES_PER_GRAPH * V1_GRAPHS)


def predict_kv_before_launch(model, gpu_name="H100-80", tp: int = 1, pp: int = 1, *, dtype: str | None = None,
                             kv_dtype: str = "auto", max_model_len: int | None = None,
                             utilization: float = DEFAULT_UTILIZATION, max_num_batched_tokens: int | None = None,
                             max_num_seqs: int | None = None, enforce_eager: bool = False,
                             block_size: int = GPU_BLOCK_SIZE) -> StartupMemory:
    """The KV tokens vLLM 0.26 will log for this layout, and every byte it reserves besides them, with no vLLM.

    ``dtype`` is the weights' (None: the checkpoint's; "fp8" on a 16-bit checkpoint: ``--quantization fp8``),
    ``kv_dtype`` the cache's (``--kv-cache-dtype``); ``max_num_batched_tokens`` and ``max_num_seqs`` default to
    what vLLM picks for the card.  Mirrors ``determine_available_memory``: the requested share minus weights as
    loaded, the profile run's activation peak, non-torch memory and (older runner only) the CUDA-graph estimate;
    then whole blocks, the smallest count over the stages.
    """
    s = model_spec(model)
    card = gpu(gpu_name)
    context = max_model_len or s.require_context()
    batched = max_num_batched_tokens or scheduler_defaults(card)[0]
    seqs = max_num_seqs or scheduler_defaults(card)[1]
    runner = model_runner(s)
    total = reported_total_bytes(card)
    requested = math.ceil(total * utilization)
    weights = loaded_weight_bytes(s, dtype, tp, pp)
    peak = activation_peak_bytes(s, tp, batched, dtype, seqs)
    non_torch = non_torch_bytes(tp * pp)
    graphs = cuda_graph_bytes(runner, enforce_eager)
    budgets = tuple(requested - w - peak - non_torch - graphs for w in weights)
    layouts = [kv_layout(s, context, block_size, GPU_IN_FLIGHT_TOKENS, kv_dtype, dtype, tp, r)
               for r in stage_layers(s.num_layers, pp)]
    blocks = min(max(0, b) // lay.bytes_per_block for b, lay in zip(budgets, layouts, strict=True))
    per_request = max(lay.blocks_per_request for lay in layouts)
    cap = kv_capacity(0, max(lay.bytes_per_block for lay in layouts) // block_size, block_size, context,
                      blocks=blocks, blocks_per_request=per_request)
    return StartupMemory(s.name, card.name, tp, pp, context, utilization, runner, batched, total, requested,
                         tuple(weights), (peak,) * pp, non_torch, graphs, budgets,
                         tuple(lay.bytes_per_block for lay in layouts), blocks, cap.tokens, cap.max_concurrency)
