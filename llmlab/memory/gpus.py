"""GPUs: their memory as the driver reports it, the share vLLM may use, and how many cards a model needs.

Why: a datasheet's "80 GB" is not what vLLM multiplies by ``gpu_memory_utilization``; the driver reports
79.18 GiB for an H100, and the activation allowance comes off every GPU before the weights and KV cache.

Part of ``llmlab.memory`` (its ``__init__`` says how the parts fit); read them in the order model, weights,
kv, gpus, fit, planner.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from llmlab.memory.kv import kv_cache_bytes
from llmlab.memory.model import DEFAULT_OVERHEAD_GIB, DEFAULT_UTILIZATION, GiB, PlanError, UnknownName
from llmlab.memory.weights import weight_bytes


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
