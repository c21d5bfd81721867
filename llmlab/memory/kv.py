"""The KV cache: bytes per token, per request, and vLLM's block arithmetic.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmlab.memory.model import (
    CPU_BLOCK_SIZE,
    CPU_MLA_BLOCK_SIZE,
    DEFAULT_UTILIZATION,
    GPU_BLOCK_SIZE,
    TINY_NAME,
    GiB,
    kv_dtype_bytes,
    model_spec,
)
from llmlab.serve.vllm import cpu_kv_space

# --------------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------------

def kv_bytes_per_token(model, kv_dtype: str = "auto", dtype: str | None = None, tp: int = 1,
                       layers: int | None = None) -> int:
    """Bytes of K and V one token leaves in the cache: layers x 2 x kv_heads x head_dim x bytes.

    ``tp`` and ``layers`` give one GPU's share: its KV heads (at least one: vLLM replicates KV heads
    when TP exceeds them) and its pipeline stage's layers.  Multi-head latent attention (DeepSeek) caches
    no per-head K and V at all: one latent of kv_lora_rank values and one rotary key of qk_rope_head_dim
    per token and layer, from which every head's K and V are recomputed; each GPU keeps the whole latent,
    so TP does not divide it.
    """
    s = model_spec(model)
    n = s.num_layers if layers is None else layers
    if s.is_mla:
        return n * (s.kv_lora_rank + s.qk_rope_head_dim) * kv_dtype_bytes(s, kv_dtype, dtype)
    heads = s.num_kv_heads if tp == 1 else max(1, s.num_kv_heads // tp)
    return n * 2 * heads * s.head_dim * kv_dtype_bytes(s, kv_dtype, dtype)


def kv_tokens_held(model, tokens: int) -> int:
    """Tokens of one request that a sliding-window layer keeps: at most the window (Mistral 7B v0.1: 4,096;
    Gemma 2: 4,096; gpt-oss: 128); a full-attention layer keeps them all.  (vLLM reserves one scheduling
    step more per request: :func:`kv_layout` has the exact blocks.)"""
    s = model_spec(model)
    return tokens if s.sliding_window is None else min(tokens, s.sliding_window)


def kv_cache_bytes(model, tokens: int, concurrency: int = 1, kv_dtype: str = "auto",
                   dtype: str | None = None) -> int:
    """Bytes of KV cache for ``concurrency`` requests of ``tokens`` tokens each (prompt + output): every
    full-attention layer holds all the tokens, every sliding-window layer at most its window."""
    if tokens < 0 or concurrency < 0:
        raise ValueError(f"tokens and concurrency must be >= 0, got {tokens} and {concurrency}")
    s = model_spec(model)
    per_layer = kv_bytes_per_token(s, kv_dtype, dtype, layers=1)
    windowed = len(s.sliding_layers)
    held = (s.num_layers - windowed) * tokens + windowed * kv_tokens_held(s, tokens)
    return held * concurrency * per_layer


# Tokens vLLM's API server schedules in one step unless told otherwise (max_num_batched_tokens): 2,048 on
# the CPU engine, 8,192 on an H100 or H200 (vllm/engine/arg_utils.py).  A sliding-window layer frees a block
# only once the tokens after it are processed, so it holds its window plus the steps in flight: one on the CPU
# engine, two on a GPU (which schedules the next step while the last one runs: async scheduling).
CPU_BATCHED_TOKENS = 2048
GPU_IN_FLIGHT_TOKENS = 2 * 8192


@dataclass(frozen=True)
class KVLayout:
    """How vLLM lays out a model's KV cache (``vllm/v1/core/kv_cache_utils.py``).

    Layers of one kind (full or sliding-window attention) form groups of equal size; a block of the pool is
    one page of every layer of one group, so ``bytes_per_block`` is the group size x one layer's page; and a
    request of max_model_len tokens takes, from each group, all its tokens' blocks (full attention) or its
    window's plus the in-flight steps' (sliding), one block more for the window's ragged start.
    """

    groups: tuple[tuple[str, int], ...]  # (kind, layers) of each KV cache group
    bytes_per_block: int
    blocks_per_request: int


def kv_groups(model, layers: range | None = None) -> tuple[tuple[str, int], ...]:
    """vLLM's KV cache groups of the model (or of one pipeline stage's ``layers``): (kind, layers in it).

    One kind: one group.  Both kinds: groups as large as the rarer kind (Gemma 3: 4 full layers, 22
    sliding, so groups of 4, the last sliding one padded), or as the commoner kind when it has fewer than
    1.5 times as many (gpt-oss-20b's 12 and 12: two groups of 12).
    """
    s = model_spec(model)
    index = range(s.num_layers) if layers is None else layers
    sliding = sum(1 for i in index if i in s.sliding_layers)
    counts = {kind: n for kind, n in (("full", len(index) - sliding), ("sliding", sliding)) if n}
    size = min(counts.values())
    if max(counts.values()) < 1.5 * size:
        size = max(counts.values())
    return tuple((kind, size) for kind, n in counts.items() for _ in range(-(-n // size)))


def kv_layout(model, max_model_len: int, block_size: int = GPU_BLOCK_SIZE, in_flight_tokens: int =
              GPU_IN_FLIGHT_TOKENS, kv_dtype: str = "auto", dtype: str | None = None, tp: int = 1,
              layers: range | None = None) -> KVLayout:
    """The :class:`KVLayout` of a model (or one pipeline stage's ``layers``) serving ``max_model_len``."""
    s = model_spec(model)
    groups = kv_groups(s, layers)
    page = kv_bytes_per_token(s, kv_dtype, dtype, tp, layers=1) * block_size
    full = -(-max_model_len // block_size)
    if s.sliding_window is not None:
        window = -(-min(s.sliding_window - 1 + in_flight_tokens, max_model_len) // block_size) + 1
    per_request = sum(full if kind == "full" else window for kind, _ in groups)
    return KVLayout(groups, max(n for _, n in groups) * page, per_request)


@dataclass(frozen=True)
class KVCapacity:
    """What vLLM makes of a KV budget: whole blocks, the tokens it reports, and the concurrency."""

    budget_bytes: int
    bytes_per_token: int
    block_size: int
    blocks: int
    max_model_len: int | None
    tokens: int
    max_concurrency: float | None

    def log_line(self, device: str = "GPU") -> str:
        """The line vLLM logs at start-up, e.g. "CPU KV cache size: 524,288 tokens, Maximum concurrency ..."."""
        if self.max_model_len is None:
            raise ValueError("the log line needs max_model_len (the context length vLLM serves)")
        return (f"{device} KV cache size: {self.tokens:,} tokens, Maximum concurrency for "
                f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")


def kv_blocks(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE) -> int:
    """Whole blocks of ``block_size`` tokens that fit in the budget: vLLM never allocates a partial block."""
    if bytes_per_token <= 0 or block_size <= 0:
        raise ValueError("bytes_per_token and block_size must be positive")
    return max(0, int(budget_bytes)) // (bytes_per_token * block_size)


def kv_capacity(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE,
                max_model_len: int | None = None, blocks: int | None = None,
                blocks_per_request: int | None = None) -> KVCapacity:
    """vLLM's KV arithmetic (``vllm/v1/core/kv_cache_utils.py``), step by step.

    blocks = budget // (block_size x bytes per token); one request of max_model_len tokens needs
    ceil(max_model_len / block_size) blocks; concurrency = blocks / that (a float); and the "KV cache
    size" vLLM reports is int(concurrency x max_model_len) -- equal to blocks x block_size only when
    max_model_len is a multiple of the block size.  The float steps are kept as vLLM does them, so the
    result matches its log to the token.  ``bytes_per_token`` is one GPU's (see :func:`kv_bytes_per_token`);
    ``blocks`` overrides the computed count (vLLM takes the smallest over all GPUs); ``blocks_per_request``
    the full-attention ceil(max_model_len / block_size), for a model with sliding-window layers
    (:func:`kv_capacity_of` does both from the model).
    """
    n = kv_blocks(budget_bytes, bytes_per_token, block_size) if blocks is None else blocks
    if max_model_len is None:
        return KVCapacity(int(budget_bytes), bytes_per_token, block_size, n, None, n * block_size, None)
    per_request = blocks_per_request or -(-max_model_len // block_size)
    concurrency = n / per_request
    return KVCapacity(int(budget_bytes), bytes_per_token, block_size, n, max_model_len,
                      int(concurrency * max_model_len), concurrency)


def kv_capacity_of(model, budget_bytes: int, max_model_len: int, block_size: int = GPU_BLOCK_SIZE,
                   in_flight_tokens: int = GPU_IN_FLIGHT_TOKENS, kv_dtype: str = "auto", dtype: str | None = None,
                   tp: int = 1) -> KVCapacity:
    """:func:`kv_capacity` for one GPU's budget, from the model: its :func:`kv_layout` decides the blocks."""
    layout = kv_layout(model, max_model_len, block_size, in_flight_tokens, kv_dtype, dtype, tp)
    per_token = layout.bytes_per_block // block_size
    return kv_capacity(budget_bytes, per_token, block_size, max_model_len, budget_bytes // layout.bytes_per_block,
                       layout.blocks_per_request)


def kv_tokens(budget_bytes: int, bytes_per_token: int, block_size: int = GPU_BLOCK_SIZE,
              max_model_len: int | None = None) -> int:
    """Tokens of KV cache vLLM reports for a budget (see :func:`kv_capacity`)."""
    return kv_capacity(budget_bytes, bytes_per_token, block_size, max_model_len).tokens


def max_concurrency(budget_bytes: int, bytes_per_token: int, tokens_per_request: int,
                    block_size: int = GPU_BLOCK_SIZE) -> float:
    """vLLM's "Maximum concurrency for N tokens per request": full-length requests the cache holds at once."""
    return kv_capacity(budget_bytes, bytes_per_token, block_size, tokens_per_request).max_concurrency


def kv_budget(gpu_bytes: int, weights: int, activation: int, non_torch: int = 0, cuda_graphs: int = 0,
              utilization: float = DEFAULT_UTILIZATION) -> int:
    """The KV budget vLLM computes on one GPU: utilization x total memory, minus the weights, the profiled
    peak activation, non-torch memory and (vLLM 0.32 by default; not 0.26) its CUDA-graph estimate.
    With the figures from its start-up log the result is exact up to their rounding."""
    return int(utilization * gpu_bytes) - weights - activation - non_torch - cuda_graphs


KV_LOG = re.compile(r"(?P<device>\w+(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency "
                    r"for (?P<len>[\d,]+) tokens per request: (?P<conc>[\d.]+)x")


def parse_kv_log(text: str) -> dict:
    """The last "KV cache size ... Maximum concurrency ..." line in a vLLM log, as numbers."""
    found = list(KV_LOG.finditer(text))
    if not found:
        raise ValueError("No 'KV cache size: N tokens, Maximum concurrency for M tokens per request: Cx' line in "
                         "this log: the engine has not finished starting, or this is not a vLLM server log.")
    m = found[-1]
    return {"device": m["device"], "tokens": int(m["tokens"].replace(",", "")),
            "max_model_len": int(m["len"].replace(",", "")), "max_concurrency": float(m["conc"]),
            "line": m.group(0)}


def embedded_kv_capacity(kv_cache_gib: float = 1, model=TINY_NAME, max_model_len: int | None = None,
                         dtype: str | None = None, kv_dtype: str = "auto") -> KVCapacity:
    """What llmlab's embedded CPU server will log for a KV space of ``kv_cache_gib`` GiB.

    vLLM's CPU backend reads ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so only whole GiB work; it
    uses blocks of 128 tokens (16 for latent attention, whose CPU kernel takes no other size); the embedded
    server serves the checkpoint's dtype (float32) and schedules 2,048 tokens a step.
    """
    space = int(cpu_kv_space(kv_cache_gib))  # whole GiB, or the embedded server's own error
    s = model_spec(model)
    length = max_model_len or s.require_context()
    block = CPU_MLA_BLOCK_SIZE if s.is_mla else CPU_BLOCK_SIZE
    return kv_capacity_of(s, space * GiB, length, block, CPU_BATCHED_TOKENS, kv_dtype, dtype)
