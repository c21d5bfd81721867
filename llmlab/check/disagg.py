"""Checks of notebook 18, prefill and decode apart (``llmlab.disagg``): the KV bytes one request hands from a
prefill engine to a decode engine, the time a link takes to move them, and the slowest link for which moving them
costs less than computing them again."""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: Llama 3.1 70B, an 8,192-token prompt, the KV cache in the model's own bfloat16, all of it (every GPU's
# share together).
EX1_MODEL, EX1_TOKENS = "llama3.1-70b", 8192

# Exercise 2: those bytes over one InfiniBand NDR port (400 Gb/s), in milliseconds.
EX2_LINK = "InfiniBand NDR (one port)"

# Exercise 3: Llama 3.1 8B, a 4,096-token prompt, the prefill at the lesson's MATMUL_FLOPS.
EX3_MODEL, EX3_TOKENS = "llama3.1-8b", 4096


def _near(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * abs(b)


def kv_moved_70b(n) -> None:
    """18: the bytes of KV cache a prefill engine hands over for one 8,192-token prompt of Llama 3.1 70B (bf16)."""
    from llmlab import disagg, memory

    n = _whole(n, "n")
    s = memory.model_spec(EX1_MODEL)
    good = disagg.kv_bytes(EX1_MODEL, EX1_TOKENS)
    require(n != good // 2, "that is the keys only (or the values only): each layer keeps both, K and V.")
    require(n != good * 2, "that is 4 bytes per number (float32); the model's KV cache is bfloat16, 2 bytes.")
    require(n != good * s.num_heads // s.num_kv_heads, f"that counts {s.num_heads} heads; keys and values have "
            f"{s.num_kv_heads} (grouped-query attention), so the cache is {s.num_heads // s.num_kv_heads}x smaller.")
    require(n != good // 8, "that is one GPU's share at TP=8; the question asks the whole request's KV cache.")
    require(n != good // s.num_layers, f"that is one layer; the model has {s.num_layers}.")
    require(n != disagg.kv_bytes(EX1_MODEL, EX1_TOKENS - 1), "the whole prompt moves: use all 8,192 tokens.")
    require(n == good, f"not {n:,}: multiply the KV bytes per token (memory.kv_bytes_per_token) by the prompt's "
            "tokens.")
    right(f"{n:,} bytes, {n / 2**30:.2f} GiB: what a 70B's decode engine must receive before its first step.")


def transfer_ms_ib(ms) -> None:
    """18: milliseconds to move exercise 1's bytes over one InfiniBand NDR port (400 Gb/s, one direction)."""
    from llmlab import disagg

    ms = _number(ms, "ms")
    b = disagg.kv_bytes(EX1_MODEL, EX1_TOKENS)
    good = b / disagg.LINKS[EX2_LINK] * 1000
    require(not _near(ms, b / 400e9 * 1000), "400 is gigabits per second; a byte is 8 bits, so one port moves "
            "50 GB/s.")
    require(not _near(ms, b / (50 * 2**30) * 1000), "a datasheet's GB/s is 10**9 bytes per second, not 2**30.")
    require(not _near(ms, b / disagg.LINKS["NVLink 4 (inside a node)"] * 1000), "that is NVLink, inside a node; "
            "the decode engine of this question is on another node, across InfiniBand.")
    require(not _near(ms, good / 1000), "that is seconds; the question asks milliseconds.")
    require(_near(ms, good), f"not {ms:g} ms: bytes / (bytes per second), then x 1000.")
    right(f"{good:.1f} ms over one port; a node's 8 GPUs have a port each, so TP=8 moves its 8 shares side by side "
          "in about 1/8 of that.")


def break_even_gbs(gbs) -> None:
    """18: the slowest link (GB/s) over which moving Llama 3.1 8B's KV for a 4,096-token prompt takes no longer than
    its prefill at ``disagg.MATMUL_FLOPS``."""
    from llmlab import disagg, memory

    gbs = _number(gbs, "gbs")
    good = disagg.break_even_bytes_per_s(EX3_MODEL, EX3_TOKENS) / 1e9
    kv = disagg.kv_bytes(EX3_MODEL, EX3_TOKENS)
    naive = kv / (2 * memory.param_count(EX3_MODEL) * EX3_TOKENS / disagg.MATMUL_FLOPS) / 1e9
    require(not _near(gbs, naive), "that prices the prefill at 2 x all parameters per token: the embedding is a "
            "look-up, the output head runs for the last token only, and attention adds its own arithmetic: use "
            "disagg.prefill_flops.")
    require(not _near(gbs, good * 8), "that is gigabits per second; the question asks gigabytes (8 bits each).")
    require(not _near(gbs, 1 / good, 0.05), "that is the inverse: bytes per second = bytes / seconds of prefill.")
    require(_near(gbs, good), f"not {gbs:g} GB/s: the KV bytes divided by the prefill's seconds "
            "(disagg.prefill_flops / disagg.MATMUL_FLOPS), in 10**9 bytes per second.")
    right(f"{good:.2f} GB/s ({good * 8:.0f} Gb/s): one InfiniBand port (50 GB/s) moves the KV in about "
          f"{good / 50 * 100:.0f} % of the prefill's time, a 25 Gb/s Ethernet port does not keep up.")
