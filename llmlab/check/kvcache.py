"""Checks of notebook 02, KV caching (``llmlab.kvcache``): bytes per token, the real tensors, blocks, prefixes."""

from __future__ import annotations

from llmlab.check.verdict import _whole, require, right


def tiny_kv_without_gqa(context_bytes) -> None:
    """02: KV bytes one full-context request of the tiny model (float32) would keep without grouped-query attention:
    every query head its own key and value head, by hand from its config."""
    from llmlab import memory

    spec = memory.model_spec("llmlab-tiny")
    context = spec.max_position_embeddings
    gqa = memory.kv_bytes_per_token(spec)
    per_token = gqa * spec.num_heads // spec.num_kv_heads
    expected = context * per_token
    n = _whole(context_bytes, "bytes for the context")
    require(n != context * gqa, f"that is the cache with the {spec.num_kv_heads} KV heads, the lesson's (or the "
            f"{spec.num_heads} heads at 1 byte per value). Without grouped-query attention each of the "
            f"{spec.num_heads} query heads has its own key and value, of 4 bytes each (float32).")
    require(n != per_token, f"that is one token's keys and values; the full context keeps {context} tokens' worth.")
    require(n != expected // 2, "that is half: count both K and V (each token leaves a key AND a value per layer), "
            "at 4 bytes per value (float32, not bf16).")
    require(n == expected, f"use max_position_embeddings ({context}) x layers ({spec.num_layers}) x 2 (K and V) x "
            f"query heads ({spec.num_heads}, one KV head each) x head_dim ({spec.head_dim}) x 4 bytes (float32).")
    right(f"{n / 2**20:.0f} MiB for a {context}-token request, {per_token // gqa}x the {context * gqa / 2**20:.0f} MiB "
          "that grouped-query attention keeps.")


def cache_matches_arithmetic(measured_bytes, cached_tokens) -> None:
    """02: bytes of the real cached K/V tensors = cached tokens x the bytes per token of the lesson's arithmetic."""
    from llmlab import memory

    expected = memory.kv_bytes_per_token("llmlab-tiny")
    tokens = _whole(cached_tokens, "the number of cached tokens")
    measured = _whole(measured_bytes, "the measured bytes")
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

    tokens = "tokens come whole: count the whole blocks that fit with // (it rounds down), then times the block size."
    g, c = _whole(gpu_hit, "gpu_hit", tokens), _whole(cpu_hit, "cpu_hit", tokens)
    require(g != 300 and c != 300, "the cache stores whole blocks only: round the shared 300 tokens down to a "
            "multiple of the block size.")
    require(g == kvcache.prefix_cache_hit_tokens(320, 300, memory.GPU_BLOCK_SIZE),
            "with blocks of 16: how many whole blocks fit in the 300 shared tokens, times 16?")
    require(c == kvcache.prefix_cache_hit_tokens(320, 300, memory.CPU_BLOCK_SIZE),
            "with blocks of 128: whole blocks in 300 tokens, times 128.")
    right(f"{g} tokens on a GPU, {c} on vLLM-CPU: smaller blocks reuse more of a shared prefix.")
