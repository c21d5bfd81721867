"""Checks of notebook 18, prefill and decode apart (``llmlab.disagg``): the KV bytes one GPU of a TP=8 prefill pool
sends for a long 405B prompt, a request's time to first token when the transfer follows the prefill (NixlConnector),
and the link rate one GPU of a busy 70B prefill pool must sustain."""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: Llama 3.1 405B, a 16,384-token prompt, the KV cache in bfloat16, pools of TP=8: one GPU's share.
EX1_MODEL, EX1_TOKENS, EX1_TP = "llama3.1-405b", 16_384, 8

# Exercise 2: Llama 3.1 8B on one GPU per engine, an 8,192-token prompt behind one other of the same length in the
# prefill engine's queue, NixlConnector over one InfiniBand NDR port, the decode engine's first step 7.73 ms (the
# committed H100 sweep's TPOT at 64 in flight, benchmarks/results/h100-llama3.1-8b-tp1/rehearsal.json).
EX2_MODEL, EX2_TOKENS, EX2_LINK, EX2_STEP_S = "llama3.1-8b", 8_192, "InfiniBand NDR (one port)", 0.007728

# Exercise 3: one GPU of Llama 3.1 70B's TP=8 prefill pool, 8,192-token prompts back to back at MATMUL_FLOPS.
EX3_MODEL, EX3_TOKENS, EX3_TP = "llama3.1-70b", 8_192, 8


def _near(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * abs(b)


def kv_per_gpu_405b(n) -> None:
    """18: the bytes of KV cache one GPU of a TP=8 prefill pool sends for one 16,384-token Llama 3.1 405B prompt."""
    from llmlab import disagg, memory

    n = _whole(n, "n")
    s = memory.model_spec(EX1_MODEL)
    good = disagg.kv_bytes(EX1_MODEL, EX1_TOKENS, tp=EX1_TP)
    require(n != good * EX1_TP, "that is the whole request, all 8 GPUs' shares: with TP=8 each GPU holds one of "
            f"the {s.num_kv_heads} KV heads and sends that share over its own port.")
    require(n != good // 2, "that is half: the keys only (each layer keeps both, K and V), or a prompt of 8,192 "
            "tokens (this one has 16,384).")
    require(n != good * 2, "that is 4 bytes per number (float32); the KV cache is bfloat16, 2 bytes.")
    require(n != good * s.num_heads // s.num_kv_heads, f"that counts {s.num_heads} query heads; keys and values "
            f"have {s.num_kv_heads} (grouped-query attention).")
    require(n != good // s.num_layers, f"that is one layer; the model has {s.num_layers}.")
    require(n == good, f"not {n:,}: layers x 2 (K, V) x the KV heads one GPU holds x head size x 2 bytes, times "
            "the prompt's tokens.")
    right(f"{n:,} bytes, {n / 2**30:.2f} GiB per GPU, {n * EX1_TP / 2**30:.2f} GiB for the request: at 50 GB/s a "
          f"port, {n / 50e9 * 1000:.0f} ms with the 8 ports side by side.")


def ttft_apart_ms(ms) -> None:
    """18: the time to first token, in ms, of exercise 2's request: an 8,192-token Llama 3.1 8B prompt behind one
    other in the prefill engine, its KV over one InfiniBand port after the prefill, then the decode engine's first
    step of 7.73 ms."""
    from llmlab import disagg

    ms = _number(ms, "ms")
    rate = disagg.LINKS[EX2_LINK]
    parts = disagg.ttft_apart(EX2_MODEL, EX2_TOKENS, rate, EX2_STEP_S,
                              queue_s=disagg.prefill_flops(EX2_MODEL, EX2_TOKENS) / disagg.MATMUL_FLOPS)
    good = parts["total"] * 1000
    prefill, transfer = parts["prefill"] * 1000, parts["transfer"] * 1000
    hidden = disagg.ttft_apart(EX2_MODEL, EX2_TOKENS, rate, EX2_STEP_S, queue_s=parts["queue"], layer_by_layer=True)
    require(not _near(ms, good - parts["queue"] * 1000), "the request waited in the prefill engine's queue first: "
            "the prompt ahead of it filled that engine's token budget, so its whole prefill comes first.")
    require(not _near(ms, hidden["total"] * 1000) and not _near(ms, good - transfer),
            "NixlConnector does not overlap the transfer with the prefill: it starts once the prefill request has "
            "finished, so the whole transfer adds (disagg.WHEN_MOVED).")
    require(not _near(ms, good - EX2_STEP_S * 1000), "the decode engine still runs one step, 7.73 ms, that computes "
            "the prompt's last token and samples the first answer token.")
    doubled = 4 * disagg.prefill_flops(EX2_MODEL, 4_096) / disagg.MATMUL_FLOPS * 1000 + transfer + EX2_STEP_S * 1000
    require(not _near(ms, doubled), "that doubles section 4's 4,096-token prefill; attention's arithmetic grows "
            "with the square of the prompt, so use disagg.prefill_flops at 8,192.")
    require(not _near(ms, good / 1000), "that is seconds; the question asks milliseconds.")
    require(_near(ms, good), f"not {ms:g} ms: the queue (one prefill) + the prefill + the transfer "
            "(bytes / 50e9 bytes per second) + the first step, each in ms.")
    right(f"{good:.0f} ms: {prefill:.0f} waiting, {prefill:.0f} prefilling, {transfer:.1f} moving, "
          f"{EX2_STEP_S * 1000:.2f} for the first step. The transfer is small here; the queue is not, which is what "
          "sizing the prefill pool is for.")


def prefill_gpu_link_gbs(gbs) -> None:
    """18: the rate (GB/s) at which one GPU of Llama 3.1 70B's TP=8 prefill pool, computing 8,192-token prompts back
    to back at ``disagg.MATMUL_FLOPS``, sends KV cache."""
    from llmlab import disagg

    gbs = _number(gbs, "gbs")
    kv = disagg.kv_bytes(EX3_MODEL, EX3_TOKENS, tp=EX3_TP)
    seconds = disagg.prefill_flops(EX3_MODEL, EX3_TOKENS) / EX3_TP / disagg.MATMUL_FLOPS
    good = kv / seconds / 1e9
    require(not _near(gbs, good * EX3_TP), "8 times too much: that is the whole request's KV sent by one GPU (with "
            "TP=8 each GPU sends its eighth, one KV head of 8, over its own port), or gigabits per second (the "
            "question asks gigabytes, 8 bits each).")
    require(not _near(gbs, good / EX3_TP), "that prices the prefill on one GPU; with TP=8 the 8 GPUs share its "
            "arithmetic, so each prompt takes an eighth of the time.")
    require(not _near(gbs, 1 / good, 0.05), "that is the inverse: bytes per second = bytes / seconds of prefill.")
    require(_near(gbs, good), f"not {gbs:g} GB/s: one GPU's KV bytes for a prompt divided by the seconds the pool "
            "takes to prefill it, in 10**9 bytes per second.")
    right(f"{good:.2f} GB/s ({good * 8:.1f} Gb/s) per GPU, whatever the TP: both sides divide by 8. One InfiniBand "
          f"port keeps up with {50 / good:.0f} such GPUs; with NixlConnector each request still waits its own "
          "transfer after its prefill.")
