"""Checks of notebook 09, real GPUs (``llmlab.rehearse``): KV tokens, the roofline and TP's cost per GPU, from
measured runs.
"""

from __future__ import annotations

from llmlab.check.verdict import _whole, require, right


def rehearsal_kv_tokens(kv_tokens, run: dict, utilization: float = 0.95) -> None:
    """09: the KV tokens vLLM would log for a rehearsal at TP=2 started with another ``gpu_memory_utilization``
    (0.95), predicted from the figures it measured in bytes."""
    from llmlab import memory

    n = _whole(kv_tokens, "the KV cache size in tokens")
    p, logged, length = run["memory_probe"][0], run["kv_tokens_logged"], run["max_model_len"]
    util = run["gpu_memory_utilization"]
    per_gpu = memory.kv_bytes_per_token(run["model"], tp=run["tp"])

    def tokens(at: float, per_token: int = per_gpu) -> int:
        budget = memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"], utilization=at)
        return memory.kv_capacity(budget, per_token, 16, length).tokens

    budget = memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"], utilization=utilization)
    require(n != budget, "that is the budget in bytes: divide by the bytes of one token (times 16 per block) and "
            "keep whole blocks, as memory.kv_capacity does.")
    require(n != logged, f"that is what vLLM logged at gpu_memory_utilization = {util}, the lesson's figure; "
            f"predict the line at {utilization}: utilization={utilization}.")
    heads = memory.model_spec(run["model"]).num_kv_heads
    require(n != tokens(utilization, memory.kv_bytes_per_token(run["model"])), f"that counts the KV bytes of all "
            f"{heads} KV heads; at TP={run['tp']} each GPU holds its share: memory.kv_bytes_per_token(model, "
            f"tp={run['tp']}).")
    require(n != int(logged * utilization / util), f"only the first term of the budget grows: {utilization} x total; "
            "the weights, activation peak and non-torch memory stay, so the tokens grow by more than "
            f"{utilization} / {util}.")
    require(n != tokens(1.0), f"vLLM may use only gpu_memory_utilization = {utilization} of the memory: pass "
            f"utilization={utilization}.")
    expected = tokens(utilization)
    require(n == expected, f"budget = {utilization} x total - weights - activation_peak - non_torch, in bytes, then "
            f"whole blocks of 16 tokens of {per_gpu:,} bytes, and int(concurrency x {length:,}).")
    right(f"{n:,} tokens, {n - logged:,} more than the {logged:,} vLLM logged at {util}: "
          f"{n / length:.2f} requests of the full {length:,}-token context.")


def rehearsal_roofline(roofline_tok_s, run: dict) -> None:
    """09: the batch-1 ceiling, measured bandwidth over the bytes one GPU reads per step."""
    require(isinstance(roofline_tok_s, int | float) and not isinstance(roofline_tok_s, bool) and roofline_tok_s > 0,
            "roofline_tok_s should be a positive number of tokens per second.")
    exact = run["roofline_tok_s"]
    require(roofline_tok_s > 1e-3, "bandwidth_tb_s is in terabytes per second: multiply it by 1e12 for bytes "
            "per second.")
    require(abs(roofline_tok_s * run["tp"] / exact - 1) > 0.03,
            f"that divides by the whole model's bytes; at TP={run['tp']} each GPU reads only its shard, at the "
            "same time as the others: use one GPU's bytes (weight_bytes_per_gpu).")
    require(abs(roofline_tok_s / exact - 1) <= 0.03,
            f"expected about {exact:.1f} tokens/s: bandwidth (bytes/s) / one GPU's weight bytes.")
    right(f"{roofline_tok_s:.1f} tokens/s at most (llmlab's exact figure, without the unread embedding rows: "
          f"{exact:.1f}); measured {run['decode_tok_s_batch1']:.1f}, {run['decode_vs_roofline']:.0%} of it.")


def rehearsal_tp_per_gpu(per_gpu_ratio, one: dict, two: dict) -> None:
    """09: TP=2's throughput per GPU over TP=1's, at 64 requests in flight."""
    require(isinstance(per_gpu_ratio, int | float) and not isinstance(per_gpu_ratio, bool),
            "per_gpu_ratio should be a number.")
    a = next(s for s in one["sweep"] if s["concurrency"] == 64)["output_tokens_per_s"]
    b = next(s for s in two["sweep"] if s["concurrency"] == 64)["output_tokens_per_s"]
    require(abs(per_gpu_ratio - b / a) > 1e-9, "that is the ratio of the totals: TP=2 uses two GPUs, so divide "
            "its throughput by 2 first.")
    require(abs(per_gpu_ratio - a / (b / 2)) > 1e-9, "upside down: TP=2 per GPU divided by TP=1.")
    require(abs(per_gpu_ratio - b / 2 / a) <= 1e-6 * (b / 2 / a), "take output_tokens_per_s at concurrency 64 "
            "from each sweep; TP=2's per GPU is half of its total.")
    right(f"{per_gpu_ratio:.2f}: each GPU of the TP=2 server serves {per_gpu_ratio:.0%} of what the single GPU "
          f"serves, while the pair serves {b / a:.2f}x as much in total.")
