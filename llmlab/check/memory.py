"""Checks of notebook 01, memory arithmetic (``llmlab.memory``): 405B's weights, GPUs, KV cache and layout.

Every expected figure comes from ``llmlab.memory``, which derives it from the model's ``config.json``.
"""

from __future__ import annotations

from llmlab.check.verdict import _is_number, _number, _whole, require, right


def weights_405b_fp16(nbytes) -> None:
    """01: bytes of Llama 3.1 405B's weights in fp16, from its config."""
    from llmlab import memory

    s = memory.model_spec("llama3.1-405b")
    params = memory.param_count(s)
    if _is_number(nbytes) and nbytes < 10**6:  # far too few bytes: a size in GB or GiB?
        require(abs(nbytes - 2 * params / 1e9) > 1 and abs(nbytes - 2 * params / 2**30) > 1,
                "that is the size in GB (or GiB); the question asks for bytes, a whole number.")
    n = _whole(nbytes, "the weight size in bytes", "bytes come whole: 2 bytes x the parameter count.")
    require(n != 405 * 10**9 * 2, "810 GB multiplies the rounded name (405B); count the parameters from the config.")
    require(n != params, "that is the parameter count; each fp16 parameter takes 2 bytes.")
    kv_per_layer = 2 * s.hidden_size * s.head_dim  # one K and one V head's projections
    gaps = {  # parameters a learner leaves out (or adds), each with the part it names
        s.vocab_size * s.hidden_size: "the LM head is missing: the embeddings are not tied, so the output layer "
        "is a second vocab x hidden matrix.",
        (2 * s.num_layers + 1) * s.hidden_size: "the norms are missing: two per layer and one at the end, "
        "hidden_size weights each.",
        s.num_layers * s.hidden_size * s.intermediate_size: "one MLP matrix is missing: each layer has three "
        "(gate, up and down), hidden x intermediate each.",
        -s.num_layers * kv_per_layer * (s.num_heads - s.num_kv_heads): "too many: k_proj and v_proj have "
        "num_key_value_heads (8) heads, not num_attention_heads (grouped-query attention).",
    }
    for gap, hint in gaps.items():
        require(n != 2 * (params - gap), hint)
    require(n == 2 * params, "that is not the config's count: check each part once, 2 bytes each -- the embeddings "
            "and the LM head (not tied), q/k/v/o with 8 KV heads, the 3 MLP matrices per layer and the norms.")
    right(f"{n:,} bytes = {n / 1e9:.1f} GB = {n / 2**30:.1f} GiB.")


def h100s_for_405b(cards, count) -> None:
    """01: H100s whose usable memory holds 405B's fp16 weights: the cards' worth before rounding, then the whole count.

    Why both: a GB taken for a GiB (the weights in GB over GiB per card, or the 80 on the card's label) lands on the
    same whole count here, so only the unrounded figure shows the slip that the lesson warns about
    (learner-review-1)."""
    from llmlab import memory

    need = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="H100-80")
    worth = _number(cards, "cards (the cards' worth before rounding)")
    weights_gb = memory.weight_bytes("llama3.1-405b", "float16") / 1e9  # 811.7
    weights_gib = memory.weight_bytes("llama3.1-405b", "float16") / 2**30  # 756.0
    reported = memory.GPUS["H100-80"].memory_gib  # 79.18
    slips = {  # the same division with a GB where a GiB belongs: each rounds up to the right count
        weights_gb / (0.9 * reported - 3): "that divides the weights in GB by a card in GiB: put both in bytes "
        "(a GB is 10**9 bytes, a GiB 2**30).",
        weights_gb / (0.9 * 80 - 3): "that uses the 80 GB on the card's label: vLLM sees the 79.18 GiB the card "
        "reports; put the weights and the card in bytes.",
        weights_gb / (0.9 * 80): "that uses the 80 GB on the label and leaves out the 3 GiB allowance: put the "
        "weights and 0.9 x 79.18 GiB - 3 GiB in bytes.",
        weights_gib / (0.9 * reported): "that leaves out the 3 GiB allowance (activations, CUDA graphs) per card.",
        weights_gib / reported: "that uses the whole card: vLLM takes gpu_memory_utilization = 0.9 of it, less the "
        "3 GiB allowance.",
    }
    for slip, hint in slips.items():
        require(abs(worth - slip) > 0.01, hint)
    require(1 < worth < 100, "cards is the weights divided by one card's usable memory: a number of cards (about "
            "ten), not a size.")
    direction = "many" if worth > need.weights else "few"
    require(abs(worth - need.weights) <= 0.01, f"{worth:.2f} cards' worth is too {direction}: divide the weights in "
            "bytes by 0.9 x 79.18 GiB - 3 GiB per card, in bytes.")
    n = _whole(count, "the number of H100s", "a GPU count rounds up (math.ceil): a part of a card is a whole card.")
    require(n != 16, "16 is what a layout on whole nodes of 8 needs (notebook 01, section 7); this question asks only "
            "for the memory: your cards' worth, rounded up.")
    require(n >= need.weights_whole, f"{n} H100s do not hold the weights: round your cards' worth up (math.ceil).")
    require(n == need.weights_whole, f"{n} H100s hold them, but fewer do: round your cards' worth up to the next "
            "whole card, no further.")
    right(f"{worth:.2f} cards' worth, so {n} H100s, with every size in bytes (the GB/GiB slip would have given "
          "11.3-11.9 here).")


def a100s_for_405b(count) -> None:
    """01: A100-40GB cards whose usable memory holds 405B's fp16 weights."""
    from llmlab import memory

    n = _whole(count, "the number of A100-40s")
    found = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="A100-40")
    require(n != 21, "21 divides by the datasheet 40 GB; vLLM only gets 0.9 x the 39.59 GiB the card reports, "
            "minus the 3 GiB allowance for activations and CUDA graphs.")
    require(n >= found.weights_whole, f"{n} A100-40s do not hold the weights: each gives vLLM only 0.9 x 39.59 GiB "
            "- 3 GiB; divide the weights by that (in bytes) and round up.")
    require(n == found.weights_whole, f"{n} A100-40s hold them, but fewer do: divide the weights by 0.9 x 39.59 GiB "
            "- 3 GiB (in bytes), then round up.")
    right(f"{n} A100-40s ({found.weights:.2f} cards' worth): twice the H100 count, for half the memory per card.")


def kv_405b(per_token, at_128k) -> None:
    """01: KV cache bytes per token of 405B with an fp8 KV cache, and for one request of 131,072 tokens."""
    from llmlab import memory

    expected = memory.kv_bytes_per_token("llama3.1-405b", kv_dtype="fp8")
    bf16 = memory.kv_bytes_per_token("llama3.1-405b")
    per = _whole(per_token, "bytes per token")
    require(per != bf16, "that is the bf16 cache of the lesson (2 bytes per value); --kv-cache-dtype fp8 stores "
            "each key and value in 1 byte.")
    require(per != 2 * bf16, "that is twice the bf16 cache: like the published 123.05 GB figure. Count K and V "
            "once each, with the config's 8 KV heads, at 1 byte each.")
    require(per == expected, "each token leaves one key and one value per layer and KV head: layers x 2 (K and V) "
            "x num_key_value_heads x head_dim x 1 byte (fp8).")
    total = _whole(at_128k, "bytes for 131,072 tokens")
    require(total == 131_072 * expected, "every token of the request keeps its own K and V: multiply the bytes per "
            "token by 131,072 tokens (128 x 1024).")
    published = 123.05 * 2**30 / (128_000 * expected)
    right(f"{per:,} bytes per token; {total / 2**30:.2f} GiB for one 131,072-token request. The published 123.05 GB "
          f"is {published:.1f}x the fp8 cache of 128,000 tokens: 2 for bf16, 2 for K and V counted twice.")


def layout_405b(tp, pp) -> None:
    """01: TP x PP for 405B in bf16 on nodes of 8 H100s, one 128k request, TP inside a node, PP across nodes."""
    from llmlab import memory

    best = memory.plan("llama3.1-405b", gpu_name="H100-80", gpus_per_node=8, context=131_072)
    tp, pp = _whole(tp, "tp"), _whole(pp, "pp")
    require(tp <= 8, "tensor parallelism stays inside a node (8 GPUs): it all-reduces twice per layer.")
    require(128 % tp == 0 and (8 % tp == 0 or tp % 8 == 0), f"TP={tp} does not divide the 128 heads and 8 KV heads.")
    fit = memory.layout_fit("llama3.1-405b", tp, pp, "H100-80", context=131_072)
    require(fit.fits, f"TP={tp} x PP={pp} does not hold it: {fit.why}")
    require((tp, pp) == (best.tp, best.pp), f"TP={tp} x PP={pp} fits but is not the smallest: each pipeline stage "
            f"takes a whole node, so fewer nodes come first (PP={best.pp}), then the fewest GPUs per node "
            f"(TP={best.tp}).")
    right(f"TP={tp} x PP={pp} = {tp * pp} H100s on {pp} nodes; {best.kv_tokens:,} KV tokens, "
          f"{best.max_concurrency:.1f} full-length requests at once.")


def embedded_kv_tokens(tokens) -> None:
    """01: the tokens the embedded server logs with 3 GiB of KV space and --max-model-len 300."""
    from llmlab import memory

    space, length = 3, 300
    n = _whole(tokens, "the logged token count")
    cap = memory.embedded_kv_capacity(kv_cache_gib=space, model="llmlab-tiny", max_model_len=length)
    per_request = -(-length // cap.block_size)
    require(n != cap.blocks * cap.block_size, f"that is blocks x {cap.block_size}: vLLM logs int(concurrency x "
            f"max_model_len), and each {length}-token request takes ceil({length} / {cap.block_size}) = "
            f"{per_request} whole blocks.")
    require(n != int(cap.blocks * cap.block_size / length) * length, "concurrency is counted in whole blocks: "
            f"blocks / ceil({length} / {cap.block_size}), not tokens / {length}.")
    require(n == cap.tokens, f"bytes per token = 4 layers x 2 x 2 KV heads x 32 x 4 bytes (float32); {space} GiB "
            f"in blocks of {cap.block_size} tokens; concurrency = blocks / ceil({length} / {cap.block_size}); "
            f"tokens = int(concurrency x {length}).")
    right(f"{n:,} tokens, {cap.max_concurrency:.2f}x: the line the server will log.")


def kv_2026(deepseek_request, gpt_oss_blocks) -> None:
    """01: the KV bytes one GPU keeps for one full-context request of DeepSeek-V3 at TP=8 (latent attention: the
    latent is not split), and the blocks one 32,768-token request of gpt-oss-20b takes on an H100 (half its layers
    keep a 128-token window)."""
    from llmlab import memory

    s = memory.model_spec("deepseek-v3")
    context = s.max_position_embeddings
    per = memory.kv_bytes_per_token(s, tp=8)
    got = _whole(deepseek_request, "DeepSeek-V3's KV bytes per GPU")
    require(got != context * per // 8, "tensor parallelism does not split the latent: every head needs all of "
            "it, so each of the 8 GPUs keeps the whole of it.")
    mha = s.num_layers * s.num_heads * (s.head_dim + s.v_head_dim) * 2
    require(got not in (context * mha, context * mha // 8), "that is what 128 heads of keys and values would take; "
            "latent attention caches none of them: one latent of kv_lora_rank values and one rotary key of "
            "qk_rope_head_dim per layer.")
    require(got != 2 * context * per, "the latent stands for keys and values together: store it once per layer, "
            "not twice (no factor 2 for K and V).")
    require(got != context * s.num_layers * s.kv_lora_rank * 2, "add the rotary key: qk_rope_head_dim values per "
            "layer sit beside the latent.")
    require(got != 131_072 * per, f"DeepSeek-V3's full context is its max_position_embeddings: {context:,} tokens.")
    require(got == context * per, f"{context:,} tokens x 61 layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes "
            "(bf16), on every GPU.")
    o = memory.model_spec("gpt-oss-20b")
    tokens = 32_768
    blocks = _whole(gpt_oss_blocks, "blocks per request")
    full = -(-tokens // memory.GPU_BLOCK_SIZE)
    in_flight = memory.GPU_IN_FLIGHT_TOKENS
    window = -(-(o.sliding_window - 1 + in_flight) // memory.GPU_BLOCK_SIZE)
    require(blocks != 2 * full, f"that is full attention on every layer: only the {o.num_layers // 2} "
            f"full-attention layers' group keeps all {tokens:,} tokens; the sliding group keeps its window.")
    require(blocks != full + o.sliding_window // memory.GPU_BLOCK_SIZE, "vLLM frees a window's blocks only once "
            f"the tokens after them are processed: add the {in_flight:,} tokens in flight (two steps of 8,192) to "
            "the window - 1.")
    require(blocks != full + window, "one block more for the window: it rarely starts at a block's edge.")
    expected = memory.kv_layout("gpt-oss-20b", tokens).blocks_per_request
    require(blocks == expected, f"one group of full layers ({tokens:,} / 16 blocks) plus one sliding group: "
            f"ceil((128 - 1 + {in_flight:,}) / 16) + 1 blocks.")
    llama = context * memory.kv_bytes_per_token("llama3.1-405b", tp=8)
    right(f"{got / 2**30:.2f} GiB on each GPU, more than Llama 3.1 405B's {llama / 2**30:.2f} GiB at TP=8 for as many "
          f"tokens; {blocks:,} blocks per request where full attention would take {2 * full:,}.")
