"""Does one TP x PP layout fit: the one answer behind ``plan``, ``llmlab launch``, ``llmlab generate``, notebook 01.

Why one function: "does this layout fit these GPUs" used to be computed in four places with three meanings
(whole KV blocks or raw tokens, a sliding window counted or not), so the planner, the job launcher and the
offline engine could disagree about the same layout.  :func:`layout_fit` is vLLM's own arithmetic, once:

1. each GPU may use ``utilization`` x its memory, minus the activation allowance (:func:`usable_bytes`);
2. it holds its shard of its pipeline stage's weights (:func:`weight_bytes_per_gpu`); the rest is its KV budget;
3. the budget holds whole blocks of ``block_size`` tokens at that stage's KV bytes per token, and vLLM gives
   every GPU the same number of blocks: the smallest over the stages, so the fullest stage decides;
4. a block is one page of each layer of a KV cache group (:func:`kv_layout`); one request of ``context`` tokens
   takes ceil(context / block_size) blocks of each full-attention group and its window's plus the in-flight
   steps' blocks of each sliding-window group, and the layout fits when the blocks hold ``concurrency`` such
   requests at once.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, gpus, fit, planner.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, replace

from llmlab.memory.gpus import gpu, usable_bytes
from llmlab.memory.kv import GPU_IN_FLIGHT_TOKENS, kv_bytes_per_token, kv_layout
from llmlab.memory.model import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_UTILIZATION,
    GPU_BLOCK_SIZE,
    GiB,
    PlanError,
    model_spec,
    normalize_dtype,
)
from llmlab.memory.weights import stage_layers, weight_bytes_per_gpu


@dataclass(frozen=True)
class Fit:
    """One layout's verdict and the numbers behind it; ``why`` says in one sentence what does not fit."""

    model: str
    gpu: str
    tp: int
    pp: int
    context: int                       # tokens per request (vLLM's max_model_len)
    concurrency: int                   # full-length requests that must fit at once
    utilization: float                 # vLLM's gpu_memory_utilization
    usable_bytes_per_gpu: int          # utilization x memory, minus the activation allowance
    weight_bytes_per_gpu: int          # the fullest GPU's weights
    kv_budget_bytes_per_gpu: int       # the emptiest GPU's KV budget (negative: the weights alone overflow)
    kv_bytes_per_token_per_gpu: int    # the largest stage's
    kv_blocks: int                     # per GPU, the smallest over the stages (vLLM takes that one)
    kv_tokens: int                     # what vLLM logs as "GPU KV cache size"
    max_concurrency: float             # ... and as "Maximum concurrency for `context` tokens per request"
    worst_stage: int                   # the pipeline stage (0 = first) whose GPUs decide
    weight_bytes_per_stage: tuple[int, ...]
    kv_bytes_per_token_per_stage: tuple[int, ...]
    fits: bool
    why: str = ""                      # empty when it fits

    def as_dict(self) -> dict:
        return asdict(self)


def _whole(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanError(f"{name} must be a whole number >= 1, got {value!r}.")
    return int(value)


def layout_fit(model, tp: int = 1, pp: int = 1, gpu_name="H100-80", *, dtype: str | None = None,
               kv_dtype: str = "auto", context: int | None = None, concurrency: int = 1,
               utilization: float = DEFAULT_UTILIZATION, overhead_gib: float = DEFAULT_OVERHEAD_GIB,
               block_size: int = GPU_BLOCK_SIZE, expert_parallel: bool = False) -> Fit:
    """Whether ``model`` as TP=``tp`` x PP=``pp`` on ``gpu_name`` GPUs holds ``concurrency`` requests of
    ``context`` tokens (default: the model's full context), with the figures vLLM would log.

    ``dtype`` is the weights' (None: the checkpoint's), ``kv_dtype`` the cache's ("auto" follows the compute
    dtype); ``expert_parallel`` deals a mixture of experts' experts out whole (``--enable-expert-parallel``).
    A layout vLLM would refuse outright (TP not dividing the heads, PP above the layers) or a bad argument
    raises :class:`PlanError`, an unknown GPU :class:`UnknownName` (both ``ValueError``); a layout that is
    valid but too small returns ``fits=False`` with ``why`` naming the numbers.
    """
    s = model_spec(model)
    tp, pp, concurrency, block_size = (_whole(n, v) for n, v in (
        ("tensor parallel size", tp), ("pipeline parallel size", pp), ("concurrency", concurrency),
        ("block_size", block_size)))
    context = _whole("context", s.require_context() if context is None else context)
    card = gpu(gpu_name)
    usable = usable_bytes(card, utilization, overhead_gib)
    weights = weight_bytes_per_gpu(s, dtype, tp, pp, expert_parallel)  # PlanError: a TP that does not divide
    stages = stage_layers(s.num_layers, pp)
    per_token = [kv_bytes_per_token(s, kv_dtype, dtype, tp, len(r)) for r in stages]
    layouts = [kv_layout(s, context, block_size, GPU_IN_FLIGHT_TOKENS, kv_dtype, dtype, tp, r) for r in stages]
    blocks = [max(0, usable - w) // lay.bytes_per_block for w, lay in zip(weights, layouts, strict=True)]
    worst = min(range(pp), key=lambda k: (blocks[k], usable - weights[k]))
    per_request = max(lay.blocks_per_request for lay in layouts)
    most = min(blocks) / per_request
    fit = Fit(s.name, card.name, tp, pp, context, concurrency, utilization, usable, max(weights),
              usable - max(weights), max(per_token), min(blocks), int(most * context), most, worst,
              tuple(weights), tuple(per_token), most >= concurrency)
    return fit if fit.fits else _explained(fit, s, dtype, overhead_gib, card.memory_gib, block_size)


def _dtype_label(s, dtype) -> str:
    if dtype:
        return normalize_dtype(dtype)
    return f"its {s.quant_method} checkpoint" if s.quant_method else s.torch_dtype or "its checkpoint's dtype"


def _explained(fit: Fit, s, dtype, overhead_gib: float, memory_gib: float, block_size: int) -> Fit:
    """``fit`` with its ``why``: the worst stage's weights against the usable memory, then its KV room."""
    k = fit.worst_stage
    weights, usable = fit.weight_bytes_per_stage[k], fit.usable_bytes_per_gpu
    where = f"{s.name} in {_dtype_label(s, dtype)} as TP={fit.tp} x PP={fit.pp} on {fit.gpu}"
    per_gpu = "per GPU" if fit.pp == 1 else f"per GPU of pipeline stage {k} (stages 0-{fit.pp - 1})"
    rule = f"{fit.utilization:g} x {memory_gib:.2f} GiB minus {overhead_gib:g} GiB for activations"
    if usable <= 0:
        why = f"{where}: vLLM may use nothing per GPU ({rule}); use a larger GPU or a higher utilization."
    elif weights >= usable:
        why = (f"{where}: the weights take {weights / GiB:.1f} GiB {per_gpu}, more than the {usable / GiB:.1f} GiB "
               f"vLLM may use there ({rule}).")
    else:
        asked = (f"one {fit.context:,}-token request" if fit.concurrency == 1 else
                 f"the {fit.concurrency} requests of {fit.context:,} tokens asked for")
        window = (f" ({len(s.sliding_layers)} of its {s.num_layers} layers keep a {s.sliding_window:,}-token window, "
                  f"plus the {GPU_IN_FLIGHT_TOKENS:,} tokens vLLM may have in flight)") if s.sliding_layers else ""
        why = (f"{where}: the weights take {weights / GiB:.1f} GiB of the {usable / GiB:.1f} GiB {per_gpu} ({rule}), "
               f"leaving KV room for {fit.kv_blocks * block_size:,} tokens ({fit.kv_blocks:,} blocks of {block_size} "
               f"at {fit.kv_bytes_per_token_per_stage[k]:,} bytes per token): {fit.max_concurrency:.2f} full-length "
               f"requests, less than {asked}{window}.")
    return replace(fit, why=why)
