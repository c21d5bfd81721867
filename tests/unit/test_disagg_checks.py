"""The exercise checks of notebook 18 (``llmlab.check.disagg``), each with the right answer and every wrong answer it
names: the KV bytes one GPU of a TP=8 pool sends for a 405B prompt, a request's time to first token when the
transfer follows the prefill, and the link rate one GPU of a busy 70B TP=8 prefill pool sends KV at.

Pure (no engine); tests/unit/test_disagg.py tests the library, and notebook 18 runs the engines.
"""

from __future__ import annotations

from check_helpers import not_yet, right

from llmlab import check

KV_405B_GPU = 126 * 2 * 1 * 128 * 2 * 16_384  # layers x (K, V) x one KV head of 8 x head size x bf16 x tokens
H100 = 989e12  # disagg.MATMUL_FLOPS, the datasheet's dense bf16


def _prefill_8b(t):  # disagg.prefill_flops by hand: matrices, causal attention, one output head
    matrices = 8_030_261_248 - 2 * 128_256 * 4096 - (2 * 32 + 1) * 4096  # no embedding, output head or norms
    return 2 * matrices * t + 2 * 32 * 32 * 128 * t**2 + 2 * 128_256 * 4096


def test_kv_per_gpu_405b(capsys):
    assert KV_405B_GPU == 1_056_964_608
    assert "0.98 GiB per GPU, 7.88 GiB for the request" in right(capsys, check.kv_per_gpu_405b, KV_405B_GPU)
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU * 8, hint="the whole request")
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU // 2, hint="the keys only")
    not_yet(check.kv_per_gpu_405b, 126 * 2 * 128 * 2 * 8_192, hint="a prompt of 8,192 tokens")
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU * 2, hint="float32")
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU * 16, hint="128 query heads")
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU // 126, hint="one layer")
    not_yet(check.kv_per_gpu_405b, KV_405B_GPU + 1, hint="layers x 2 (K, V)")
    not_yet(check.kv_per_gpu_405b, "1056964608", hint="should be a number")


def test_ttft_apart_ms(capsys):
    prefill = _prefill_8b(8192) / H100 * 1000
    transfer = 32 * 2 * 8 * 128 * 2 * 8192 / 50e9 * 1000
    ms = prefill + prefill + transfer + 7.728  # the prompt ahead, its own, the move after it, D's first step
    assert 295.5 < ms < 296.5
    assert "296 ms: 133 waiting, 133 prefilling, 21.5 moving" in right(capsys, check.ttft_apart_ms, ms)
    right(capsys, check.ttft_apart_ms, 296)  # rounded as a learner writes it
    not_yet(check.ttft_apart_ms, ms - prefill, hint="waited in the prefill engine's queue")
    not_yet(check.ttft_apart_ms, ms - transfer, hint="does not overlap")
    layer_by_layer = 2 * prefill + max(transfer / 32, transfer - prefill * 31 / 32) + 7.728
    not_yet(check.ttft_apart_ms, layer_by_layer, hint="does not overlap")
    not_yet(check.ttft_apart_ms, ms - 7.728, hint="one step, 7.73 ms")
    not_yet(check.ttft_apart_ms, 4 * _prefill_8b(4096) / H100 * 1000 + transfer + 7.728, hint="with the square")
    not_yet(check.ttft_apart_ms, ms / 1000, hint="that is seconds")
    not_yet(check.ttft_apart_ms, 250, hint="the queue (one prefill)")


def test_prefill_gpu_link_gbs(capsys):
    matrices = 70_553_706_496 - 2 * 128_256 * 8192 - (2 * 80 + 1) * 8192
    flops = 2 * matrices * 8192 + 2 * 80 * 64 * 128 * 8192**2 + 2 * 128_256 * 8192
    kv_gpu = 80 * 2 * 1 * 128 * 2 * 8192
    gbs = kv_gpu / (flops / 8 / H100) / 1e9
    assert 2.19 < gbs < 2.20
    assert "2.20 GB/s (17.6 Gb/s) per GPU" in right(capsys, check.prefill_gpu_link_gbs, gbs)
    right(capsys, check.prefill_gpu_link_gbs, 2.2)
    not_yet(check.prefill_gpu_link_gbs, gbs * 8, hint="8 times too much")
    not_yet(check.prefill_gpu_link_gbs, gbs / 8, hint="prices the prefill on one GPU")
    not_yet(check.prefill_gpu_link_gbs, 1 / gbs, hint="the inverse")
    not_yet(check.prefill_gpu_link_gbs, 8.62, hint="one GPU's KV bytes")
