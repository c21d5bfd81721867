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

Each term here is a formula; those that vLLM measures rather than computes carry constants fitted on the
committed runs, and say so (:data:`FITTED`): the dense activation peak (two constants), non-torch memory (one
constant per case, one GPU or several, and what a mixture of experts adds), and the older runner's extra peak
bytes and CUDA-graph estimate.  The CUDA-graph memory of vLLM 0.26's default model runner for dense
models ("model runner V2", ``vllm/v1/worker/gpu/model_runner.py``) is *not* subtracted: its
``profile_cudagraph_memory`` returns 0, so the graphs (0.45-1.52 GiB on the committed runs) come out of the
1 - utilization share.

A mixture of experts runs on the older runner (``gpu_model_runner.py``), whose profile peak is counted from
vLLM's source rather than fitted (:func:`v1_profile_peak_bytes`): the sampler warm-up's float32 copies of
max_num_seqs rows of logits, while the MoE kernel's workspace (:func:`moe_workspace_bytes`: Triton's
``intermediate_cache1..3`` for max_num_batched_tokens x top_k rows, kept by vLLM's workspace manager), the
sampler's Triton top-k/top-p buffer and the profile forward's hidden states are still held, plus one fitted
34 MiB.  That runner also captures two graphs of each mode to estimate the CUDA graphs and subtracts the
estimate; it is modelled as a first capture plus a cost per further graph and per layer (two fitted constants:
:data:`V1_FIRST_CAPTURE`, :data:`V1_GRAPH_BYTES_PER_LAYER`), with the graph counts vLLM derives from the flags.

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
# (intermediate_size / TP) + ACT_PER_HIDDEN x hidden_size, on the V2 runner (dense models; a mixture of experts:
# v1_profile_peak_bytes).
# The MLP's gate_up output (2 x width) and its SiLU product (1 x width) alone give 3; the compiled graph's
# temporaries the rest.  Fitted exactly on h100-llama3.1-8b-tp1 (1,184,948,736 B) and h200-llama3.1-70b-tp2
# (1,247,855,104 B), then rounded; every other committed run is a check (h200-llama3.1-8b-tp2 measured 765,722,624 B).
ACT_PER_MLP = 4.78
ACT_PER_HIDDEN = 0.94

# vLLM's "non-torch increase" from worker creation to the end of profiling: 230 MiB on one GPU
# (h100-llama3.1-8b-tp1, the same bytes on every one-GPU Llama run), 68 MiB per GPU when the workers are
# separate processes with NCCL set up before the baseline snapshot (h200-llama3.1-70b-tp2; 66-68 MiB on
# every TP=2 and PP=2 run).  The older runner (a mixture of experts) leaves more: 12 MiB more on one GPU (the
# mean of gpt-oss-20b's 8 and qwen3-30b-a3b's 16 MiB), 36 MiB more per GPU on two (qwen3-30b-a3b, TP=2).
NON_TORCH_ONE_GPU = 241_172_480
NON_TORCH_PER_GPU_MULTI = 71_303_168
NON_TORCH_V1_EXTRA_ONE_GPU = 12 * MiB
NON_TORCH_V1_EXTRA_MULTI = 36 * MiB

# Streaming multiprocessors per card: the sampler's Triton top-k/top-p kernel keeps a float32 row of the
# vocabulary per program, one program per SM (vllm/v1/sample/ops/topk_topp_triton.py).  Other cards: 132.
SM_COUNT = {"H100-80": 132, "H200-141": 132, "A100-40": 108, "A100-80": 108, "MI300X-192": 304}
DEFAULT_SM_COUNT = 132

# What the older runner's profile peak holds beyond the tensors counted from vLLM's source
# (v1_profile_peak_bytes): 33.55 MiB on qwen3-30b-a3b (both layouts, to the byte), 34.55 MiB on gpt-oss-20b; the
# mean, fitted on those runs.  Not found in vLLM's source; most likely torch's 32 MiB cuBLAS workspace (made on
# the profile run's first matrix product, so inside the measured peak) plus small tensors (0.55 MiB on both).
# gpt-oss's is 1 MiB more; each run is within 0.5 MiB of the mean.
V1_PEAK_EXTRA = 35_702_784

# The older runner's CUDA-graph estimate (gpu_model_runner.py, profile_cudagraph_memory): per mode, the memory
# the largest graph took plus the second graph's times the graphs left; the modes share the first.  Modelled as
# V1_FIRST_CAPTURE + (graphs - 2) x layers x V1_GRAPH_BYTES_PER_LAYER (a graph's memory grows with its kernels),
# least squares on h100-gpt-oss-20b-tp1 (590 MiB for 83 + 83 graphs of 24 layers) and the two qwen3-30b-a3b runs
# (658 and 630 MiB for 51 + 51 graphs of 48 layers); each within 16 MiB.  The held-out run
# h200-qwen3-30b-a3b-tp1-util50-seqs-256 (51 + 35 graphs, the largest FULL one 256 tokens) checked it and found it
# weak: 596 MiB modelled, 502 MiB estimated by vLLM (-0.80 % of that pool, within 1 %; not refitted).  Fewer FULL
# graphs saved 156 MiB there, so FULL graphs (or the first FULL capture) cost more than this single rate says.
V1_FIRST_CAPTURE = 344 * MiB
V1_GRAPH_BYTES_PER_LAYER = 64 * 1024

FITTED = {
    "activation peak (ACT_PER_MLP, ACT_PER_HIDDEN)": ("h100-llama3.1-8b-tp1", "h200-llama3.1-70b-tp2"),
    "non-torch (NON_TORCH_ONE_GPU, NON_TORCH_PER_GPU_MULTI)": ("h100-llama3.1-8b-tp1", "h200-llama3.1-70b-tp2"),
    "older runner's non-torch extra (NON_TORCH_V1_EXTRA_ONE_GPU, NON_TORCH_V1_EXTRA_MULTI)": (
        "h100-gpt-oss-20b-tp1", "h200-qwen3-30b-a3b-tp1", "h100x2-qwen3-30b-a3b-tp2"),
    "older runner's profile-peak extra (V1_PEAK_EXTRA)": (
        "h100-gpt-oss-20b-tp1", "h200-qwen3-30b-a3b-tp1", "h100x2-qwen3-30b-a3b-tp2"),
    "older runner's CUDA-graph estimate (V1_FIRST_CAPTURE, V1_GRAPH_BYTES_PER_LAYER)": (
        "h100-gpt-oss-20b-tp1", "h200-qwen3-30b-a3b-tp1", "h100x2-qwen3-30b-a3b-tp2"),
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


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def moe_workspace_bytes(model, tp: int = 1, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                        dtype: str | None = None) -> int:
    """The fused-MoE kernel's workspace after the profile forward: what vLLM 0.26's workspace manager keeps.

    On Hopper an unquantized (or fp8) mixture of experts runs vLLM's Triton experts
    (``fused_moe/oracle/unquantized.py``, ``_get_priority_backends``: Triton first on SM90) through the modular
    kernel, which takes its buffers from the workspace manager (``modular_kernel.py``, ``_allocate_buffers``):
    workspace13 = M x top_k x max(I, K), holding ``intermediate_cache2`` (and the (M, K) output, smaller), and
    workspace2 = M x top_k x max(2I, K), holding ``intermediate_cache1`` (the gate_up product, M x top_k x 2I) and
    later ``intermediate_cache3`` (M x top_k x K) (``experts/triton_moe.py``, ``workspace_shapes``), in the
    activation dtype, each rounded up to 256 bytes (``v1/worker/workspace.py``, ``get_simultaneous``).  M is
    every token of the forward at once (max_num_batched_tokens: 0.26 passes M_full as the chunk, no chunking),
    I the expert width / TP (TP shards each expert's columns; K, the hidden size, is whole on every GPU), so
    while 2I/TP <= K the workspace does not shrink with TP.  The manager keeps the buffer after the forward
    (``_ensure_workspace_size`` only grows it), so it is still held while the sampler warms up.

    gpt-oss's MXFP4 experts run a monolithic kernel (``oracle/mxfp4.py``: OAI Triton, monolithic first) that
    takes no workspace from the manager: 0.
    """
    s = model_spec(model)
    if not s.num_experts or s.quant_method == "mxfp4":
        return 0
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    width, k, top_k = s.expert_width // tp, s.hidden_size, s.experts_per_token
    workspace13 = max(batched_tokens * top_k * max(width, k), batched_tokens * k) * act
    workspace2 = batched_tokens * top_k * max(2 * width, k) * act
    return _round_up(workspace13, 256) + _round_up(workspace2, 256)


def _dense_part_per_token(s: ModelSpec, tp: int) -> float:
    """ACT_PER_MLP x the widest dense MLP one GPU runs (a MoE's shared experts or dense layers) + ACT_PER_HIDDEN x
    hidden: the fitted per-token term, applied to the part of a MoE's forward that is a dense model's."""
    widths = [s.shared_experts * s.expert_width // tp]
    if s.dense_layers:
        widths.append(s.intermediate_size // tp)
    return ACT_PER_MLP * max(widths) + ACT_PER_HIDDEN * s.hidden_size


def activation_peak_bytes(model, tp: int = 1, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                          dtype: str | None = None, max_num_seqs: int = LARGE_GPU_MAX_SEQS,
                          sm_count: int = DEFAULT_SM_COUNT, last_stage: bool = True) -> int:
    """The torch peak increase of vLLM's profile run: max_num_batched_tokens tokens through the model at once.

    V2 runner (dense): per token and per activation byte, ACT_PER_MLP x the MLP width one GPU holds +
    ACT_PER_HIDDEN x hidden_size (fitted constants: see their comment).  The same on every pipeline stage: the
    layers run one after another, so the peak is one layer's.  Older runner (a mixture of experts):
    :func:`v1_profile_peak_bytes`.
    """
    s = model_spec(model)
    if model_runner(s) == "v1":
        return v1_profile_peak_bytes(s, tp, batched_tokens, dtype, max_num_seqs, sm_count, last_stage)
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    per_token = ACT_PER_MLP * mlp_width_per_gpu(s, tp) + ACT_PER_HIDDEN * s.hidden_size
    return round(batched_tokens * act * per_token) + fp8_input_copy_bytes(s, batched_tokens, dtype)


def fp8_input_copy_bytes(model, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS, dtype: str | None = None) -> int:
    """FP8 weights multiply FP8 inputs: vLLM quantizes a linear layer's input on the fly (dynamic scales: per
    tensor for ``--quantization fp8``, per token for an ``fbgemm_fp8`` checkpoint), and the quantized copy of the
    layer's input, one byte per hidden unit of every batched token, is held at the profile run's peak.

    One byte x hidden x max_num_batched_tokens: h200x2-llama3.1-8b-fp8 logged 1.13 GiB of peak activation against
    bf16's 1.10 (this term: 0.031 GiB); the first 405B FP8 start on four H200s (2026-11-28, vLLM 0.26, TP=4) logged
    1.40 against the 16-bit formula's 1.21 (this term: 0.125 GiB, so 0.07 GiB is still unexplained there)."""
    s = model_spec(model)
    if not (_online_fp8(s, dtype) or (dtype is None and s.quant_method == "fbgemm_fp8")):
        return 0
    return batched_tokens * s.hidden_size


def v1_sampler_phase_bytes(model, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS, dtype: str | None = None,
                           max_num_seqs: int = LARGE_GPU_MAX_SEQS, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The older runner's sampler warm-up (``gpu_model_runner.py``: ``profile_run``, ``_dummy_sampler_run``), the
    MoE workspace left out: counted from vLLM 0.26's source, plus the fitted :data:`V1_PEAK_EXTRA`.

    The dummy batch has R = min(max_num_batched_tokens, max_num_seqs) requests.  Held from the profile forward:
    its hidden states (batched tokens x hidden) and the last token's of each request (R x hidden), plus the
    random R x hidden the warm-up feeds the LM head.  The logits (R x the 64-padded vocabulary, compute dtype;
    TP all-gathers them whole on every GPU) stay held while the sampler makes their float32 copy
    (``sampler.py``: ``logits.to(torch.float32)``), the softmax probabilities and the exponential noise
    (``topk_topp_sampler.py``: ``forward_native``, ``random_sample``): three float32 R x vocab tensors at once.
    Top-k/top-p ran before them through Triton (R >= 8), which caches a float32 buffer of min(R, SMs) rows of the
    vocabulary (``topk_topp_triton.py``, ``apply_top_k_top_p_triton``) that stays allocated.
    """
    s = model_spec(model)
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    reqs = min(batched_tokens, max_num_seqs)
    vocab = s.vocab_size
    programs = min(sm_count, reqs)
    triton_rows = min(1 << (programs - 1).bit_length(), sm_count)
    held = batched_tokens * s.hidden_size * act + 2 * reqs * s.hidden_size * act
    logits = reqs * _round_up(vocab, 64) * act
    float32_copies = 3 * reqs * vocab * 4
    return held + logits + float32_copies + triton_rows * vocab * 4 + V1_PEAK_EXTRA


def v1_profile_peak_bytes(model, tp: int = 1, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                          dtype: str | None = None, max_num_seqs: int = LARGE_GPU_MAX_SEQS,
                          sm_count: int = DEFAULT_SM_COUNT, last_stage: bool = True) -> int:
    """The older runner's profile peak: the MoE workspace (:func:`moe_workspace_bytes`, kept by vLLM's workspace
    manager) plus the larger of the sampler warm-up (:func:`v1_sampler_phase_bytes`; last pipeline stage only)
    and the rest of the forward, modelled as the dense formula on the MoE's dense part (shared experts, dense
    layers) and the hidden size.  On every committed MoE run the sampler warm-up is the larger by over 1 GiB; the
    forward's term is checked by none."""
    s = model_spec(model)
    act = DTYPE_BITS[serve_dtype(s, dtype)] // 8
    forward = round(batched_tokens * act * _dense_part_per_token(s, tp))
    sampler = v1_sampler_phase_bytes(s, batched_tokens, dtype, max_num_seqs, sm_count) if last_stage else 0
    return moe_workspace_bytes(s, tp, batched_tokens, dtype) + max(forward, sampler)


def non_torch_bytes(gpus: int, runner: str = "v2") -> int:
    """vLLM's non-torch increase per GPU: measured constants, one GPU or several (see their comment)."""
    if runner == "v1":
        return (NON_TORCH_ONE_GPU + NON_TORCH_V1_EXTRA_ONE_GPU if gpus == 1
                else NON_TORCH_PER_GPU_MULTI + NON_TORCH_V1_EXTRA_MULTI)
    return NON_TORCH_ONE_GPU if gpus == 1 else NON_TORCH_PER_GPU_MULTI


def cuda_graph_sizes(model, batched_tokens: int = LARGE_GPU_BATCHED_TOKENS,
                     max_num_seqs: int = LARGE_GPU_MAX_SEQS) -> tuple[int, int]:
    """(PIECEWISE, FULL) graphs vLLM 0.26 captures by default: the capture sizes 1, 2, 4, 8..248 by 8, 256.. by 16 up
    to min(2 x max_num_seqs, 512) (1,024 for gpt-oss: ``models/config.py``, ``GptOssForCausalLMConfig``), never
    above max_num_batched_tokens (``config/vllm.py``, ``_set_cudagraph_sizes``); FULL graphs for the decode
    batches among them, sizes <= max_num_seqs (``v1/cudagraph_dispatcher.py``, ``initialize_cudagraph_keys``)."""
    s = model_spec(model)
    largest = 1024 if s.architecture == "GptOssForCausalLM" else min(2 * max_num_seqs, 512)
    largest = min(batched_tokens, largest)
    sizes = [n for n in (1, 2, 4) if n <= largest]
    if largest >= 8:
        sizes += list(range(8, min(largest + 1, 256), 8))
    if largest >= 256:
        sizes += list(range(256, largest + 1, 16))
    if batched_tokens <= largest:
        sizes.append(batched_tokens)
    sizes = sorted(set(sizes))
    return len(sizes), sum(1 for n in sizes if n <= max_num_seqs)


def cuda_graph_bytes(runner: str, enforce_eager: bool = False, model=None,
                     batched_tokens: int = LARGE_GPU_BATCHED_TOKENS, max_num_seqs: int = LARGE_GPU_MAX_SEQS) -> int:
    """The CUDA-graph memory vLLM 0.26 takes off the pool: none on the V2 runner, its estimate on the older one
    (``gpu_model_runner.py``, ``profile_cudagraph_memory``): the first capture, then per further graph of each mode
    the second graph's memory, modelled as V1_FIRST_CAPTURE + (graphs - 2) x layers x V1_GRAPH_BYTES_PER_LAYER."""
    if enforce_eager or runner == "v2":
        return 0
    s = model_spec(model)
    piecewise, full = cuda_graph_sizes(s, batched_tokens, max_num_seqs)
    further = max(piecewise - 1, 0) + max(full - 1, 0)
    return V1_FIRST_CAPTURE + further * s.num_layers * V1_GRAPH_BYTES_PER_LAYER


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
    sms = SM_COUNT.get(card.name, DEFAULT_SM_COUNT)
    peaks = tuple(activation_peak_bytes(s, tp, batched, dtype, seqs, sms, last_stage=k == pp - 1) for k in range(pp))
    non_torch = non_torch_bytes(tp * pp, runner)
    graphs = cuda_graph_bytes(runner, enforce_eager, s, batched, seqs)
    budgets = tuple(requested - w - peak - non_torch - graphs for w, peak in zip(weights, peaks, strict=True))
    layouts = [kv_layout(s, context, block_size, GPU_IN_FLIGHT_TOKENS, kv_dtype, dtype, tp, r)
               for r in stage_layers(s.num_layers, pp)]
    blocks = min(max(0, b) // lay.bytes_per_block for b, lay in zip(budgets, layouts, strict=True))
    per_request = max(lay.blocks_per_request for lay in layouts)
    cap = kv_capacity(0, max(lay.bytes_per_block for lay in layouts) // block_size, block_size, context,
                      blocks=blocks, blocks_per_request=per_request)
    return StartupMemory(s.name, card.name, tp, pp, context, utilization, runner, batched, total, requested,
                         tuple(weights), peaks, non_torch, graphs, budgets,
                         tuple(lay.bytes_per_block for lay in layouts), blocks, cap.tokens, cap.max_concurrency)
