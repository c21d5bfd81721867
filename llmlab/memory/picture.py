"""A memory report as a picture: what one GPU of the plan holds, stacked against the card's size.

Why: the calculator of notebook 01 prints a dozen numbers; one bar shows at a glance which of them decides
the layout -- weights that leave no room, or a KV cache that the requests fill -- and how much is left.
"""

from __future__ import annotations

from llmlab.memory.model import GiB

# (label, colour) of each part of a GPU, bottom to top: what vLLM loads, what it keeps free, what it never takes
PARTS = (("weights", "#4c72b0"), ("activations, CUDA graphs (allowance)", "#8c8c8c"),
         ("KV cache the requests fill", "#dd8452"), ("KV cache free (head-room)", "#f6c89f"),
         ("not given to vLLM (1 - gpu_memory_utilization)", "#e5e5e5"))


def gpu_parts(report: dict) -> dict[str, int]:
    """Bytes of each part of the plan's fullest GPU, summing to the card's size.  The KV cache gets what that GPU
    has left once the weights and the allowance are in; the requests fill ``tokens`` x ``concurrency`` of it."""
    p = report["plan"]
    card = report["gpu_memory_bytes"]
    given = int(card * report["gpu_memory_utilization"])
    overhead = given - report["usable_bytes_per_gpu"]  # the allowance, as memory.usable_bytes takes it off
    room = max(0, report["usable_bytes_per_gpu"] - p["weight_bytes_per_gpu"])
    kv_used = min(p["kv_bytes_per_token_per_gpu"] * report["tokens"] * report["concurrency"], room)
    sizes = (p["weight_bytes_per_gpu"], overhead, kv_used, room - kv_used, card - given)
    return {label: size for (label, _), size in zip(PARTS, sizes, strict=True)}


def plot_gpu(report: dict, ax=None):
    """One horizontal bar: a GPU of the plan, its parts stacked, the card's size marked.  A report without a
    plan (nothing fits) shows what the model needs against one node's usable memory instead."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.2))
    if report.get("plan"):
        parts = gpu_parts(report)
        left = 0.0
        for (label, colour), size in zip(PARTS, parts.values(), strict=True):
            ax.barh(0, size / GiB, left=left, color=colour, edgecolor="white",
                    label=f"{label}: {size / GiB:,.1f} GiB")
            left += size / GiB
        p = report["plan"]
        title = f"one of {p['gpus']} x {report['gpu']} (TP={p['tp']} x PP={p['pp']})"
    else:
        need = (report["weight_bytes"] + report["kv_cache_bytes"]) / GiB
        ax.barh(0, report["weight_bytes"] / GiB, color=PARTS[0][1], label="weights")
        ax.barh(0, report["kv_cache_bytes"] / GiB, left=report["weight_bytes"] / GiB, color=PARTS[2][1],
                label="KV cache the requests need")
        left = need
        title = f"does not fit: {need:,.0f} GiB needed in all"
    card = report["gpu_memory_bytes"] / GiB
    ax.axvline(card, color="black", lw=1.5)
    right = max(card, left) * 1.02
    ax.annotate(f" {report['gpu']}: {card:,.0f} GiB ", (card, 0.45), va="bottom", fontsize=9,
                ha="right" if card > right / 3 else "left")  # inside the axes, whichever side has room
    ax.set(yticks=[], xlabel="GiB", title=title, xlim=(0, right), ylim=(-0.5, 0.75))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=2, fontsize=8, frameon=False)
    ax.figure.tight_layout()
    return ax
