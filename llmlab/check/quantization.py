"""Checks of notebook 11, quantization (``llmlab.quantization``): an fp8 KV cache's tokens, the 405B in fp8, and
what a measured decode step spends beside reading the weights.

The expected figures come from ``llmlab.memory`` (the first one the lesson also read in vLLM's own log) and from
the committed H200 runs (``quantization.gpu_table``).
"""

from __future__ import annotations

from llmlab.check.verdict import _number, _whole, require, right


def fp8_kv_tokens(tokens) -> None:
    """11: the KV tokens a CPU server of Llama 3.1 8B logs with 6 GiB of KV space and --kv-cache-dtype fp8 (the lesson
    measured the tiny model's; this is the same arithmetic on a model whose shapes the learner reads)."""
    from llmlab import memory

    n = _whole(tokens, "the KV token count")
    model, gib = "llama3.1-8b", 6
    expected = memory.embedded_kv_capacity(gib, model, max_model_len=8192, kv_dtype="fp8").tokens
    per_token = memory.kv_bytes_per_token(model, "fp8")
    require(n != expected // 2, "that is 2 bytes per value, the 8B's bf16 cache; fp8 stores each K and V value in "
            "1 byte.")
    require(n != expected // 4, "that is 4 bytes per value (float32, as the tiny model's server has it); fp8 takes 1.")
    require(n != per_token, "that is the bytes one token takes; divide the 6 GiB of KV space by it.")
    require(n not in (gib * 10**9 // per_token, gib * 10**9 // per_token // 128 * 128),
            "VLLM_CPU_KVCACHE_SPACE counts GiB (2**30 bytes), not GB (10**9).")
    require(n != 2 * expected, "K and V are both stored: count 2 values per layer, KV head and head dimension.")
    require(n != memory.embedded_kv_capacity(1, memory.TINY_NAME, kv_dtype="fp8").tokens,
            "that is the lesson's tiny model on 1 GiB; this server holds the 8B (memory.model_spec('llama3.1-8b')) "
            "in 6 GiB.")
    require(n == expected, "bytes per token = 32 layers x 2 (K and V) x 8 KV heads x 128 (head_dim) x 1 byte; tokens "
            "= 6 GiB / that, in whole blocks of 128 tokens.")
    right(f"{n:,} tokens, {per_token:,} bytes each: {n // 8192} requests of the full 8,192-token context at once.")


def h100s_for_405b_fp8(nbytes, count) -> None:
    """11: bytes of Llama 3.1 405B's weights with every weight in fp8, and the H100s whose usable memory holds them."""
    from llmlab import memory

    params = memory.param_count("llama3.1-405b")
    n = _whole(nbytes, "the weight size in bytes")
    require(n != 2 * params, "that is bf16 (2 bytes per parameter); fp8 stores each in 1 byte.")
    require(n != 405 * 10**9, "405 x 10**9 is the rounded name; count the parameters from the config "
            "(memory.param_count).")
    expected = memory.weight_bytes("llama3.1-405b", "fp8")
    require(n == expected, f"expected 1 byte x {params:,} parameters (memory.weight_bytes('llama3.1-405b', 'fp8')).")
    k = _whole(count, "the number of H100s")
    found = memory.gpus_needed("llama3.1-405b", "fp8", gpu_name="H100-80")
    bf16 = memory.gpus_needed("llama3.1-405b", "bfloat16", gpu_name="H100-80").weights_whole
    require(k != bf16, f"{bf16} H100s is the bf16 count; the fp8 weights are half as large.")
    require(k >= found.weights_whole, f"{k} H100s do not hold the weights: each gives vLLM 0.9 x 79.18 GiB - 3 GiB; "
            "divide the weights by that (in bytes) and round up.")
    require(k == found.weights_whole, f"{k} H100s hold them, but fewer do: divide the weights by 0.9 x 79.18 GiB "
            "- 3 GiB (in bytes), then round up.")
    right(f"{n / 1e9:.1f} GB on {k} H100s ({found.weights:.2f} cards' worth), half of bf16's {bf16}: one node of 8 "
          "holds the weights and leaves room for the KV cache, where bf16 needs two nodes.")


def step_overhead(extra_bf16, extra_fp8) -> None:
    """11: milliseconds of a measured batch-1 step (the 8B on an H200, ``quantization.gpu_table``) beyond the time to
    read the weights once, in bf16 and with fp8 weights."""
    from llmlab import quantization

    table = quantization.gpu_table()
    step = 1000 / table["batch 1 tok/s"]
    reading = 1000 / table["ceiling tok/s"]
    for name, value, what in (("bf16", extra_bf16, "extra_bf16"), ("fp8 weights", extra_fp8, "extra_fp8")):
        x = _number(value, what)
        require(abs(x - step[name]) > 0.05, f"{what} is the whole step (1000 / its batch 1 tok/s); subtract the time "
                "to read the weights once, 1000 / its ceiling tok/s.")
        require(abs(x - reading[name]) > 0.05, f"{what} is the reading time alone; the question is the rest of the "
                "step: the measured step minus it.")
        require(abs(x + step[name] - reading[name]) > 0.05, f"{what} is negative: the measured step is the longer "
                "one, so subtract the ceiling's step from it.")
        require(abs(x * 1000 - (step[name] - reading[name])) > 0.05, f"{what} looks like seconds; give milliseconds.")
        require(abs(x - (step[name] - reading[name])) <= 0.05, f"{what}: 1000 / batch 1 tok/s - 1000 / ceiling tok/s, "
                f"from the '{name}' row.")
    right(f"{extra_bf16:.2f} ms in bf16 and {extra_fp8:.2f} ms with fp8 weights: the part of a step that is not "
          "reading weights did not shrink (fp8 even adds the quantizing of each activation), so halving the bytes "
          f"took the step from {step['bf16']:.2f} to {step['fp8 weights']:.2f} ms, not to half.")
