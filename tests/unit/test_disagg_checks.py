"""The exercise checks of notebook 18 (``llmlab.check.disagg``), each with the right answer and every wrong answer it
names: the KV bytes one 70B request hands over, their time on one InfiniBand port, and the link rate at which moving
an 8B's prompt KV costs as much as computing it.

Pure (no engine); tests/unit/test_disagg.py tests the library, and notebook 18 runs the engines.
"""

from __future__ import annotations

from check_helpers import not_yet, right

from llmlab import check

KV_70B = 80 * 2 * 8 * 128 * 2 * 8192  # layers x (K, V) x KV heads x head size x bf16 bytes x tokens


def test_kv_moved_70b(capsys):
    assert KV_70B == 2_684_354_560
    assert "2.50 GiB" in right(capsys, check.kv_moved_70b, KV_70B)
    not_yet(check.kv_moved_70b, KV_70B // 2, hint="the keys only")
    not_yet(check.kv_moved_70b, KV_70B * 2, hint="float32")
    not_yet(check.kv_moved_70b, KV_70B * 8, hint="counts 64 heads")
    not_yet(check.kv_moved_70b, KV_70B // 8, hint="one GPU's share at TP=8")
    not_yet(check.kv_moved_70b, KV_70B // 80, hint="one layer")
    not_yet(check.kv_moved_70b, KV_70B - 327_680, hint="all 8,192 tokens")
    not_yet(check.kv_moved_70b, KV_70B + 1, hint="multiply the KV bytes per token")
    not_yet(check.kv_moved_70b, "2684354560", hint="should be a number")


def test_transfer_ms_ib(capsys):
    ms = KV_70B / 50e9 * 1000
    assert 53.68 < ms < 53.69
    assert "53.7 ms over one port" in right(capsys, check.transfer_ms_ib, ms)
    right(capsys, check.transfer_ms_ib, 53.7)  # rounded as a learner writes it
    not_yet(check.transfer_ms_ib, KV_70B / 400e9 * 1000, hint="a byte is 8 bits")
    not_yet(check.transfer_ms_ib, KV_70B / (50 * 2**30) * 1000, hint="10**9 bytes per second")
    not_yet(check.transfer_ms_ib, KV_70B / 450e9 * 1000, hint="that is NVLink")
    not_yet(check.transfer_ms_ib, ms / 1000, hint="that is seconds")
    not_yet(check.transfer_ms_ib, 60, hint="bytes / (bytes per second)")


def test_break_even_gbs(capsys):
    kv = 32 * 2 * 8 * 128 * 2 * 4096
    matrices = 8_030_261_248 - 2 * 128_256 * 4096 - (2 * 32 + 1) * 4096  # no embedding, output head or norms
    flops = 2 * matrices * 4096 + 2 * 32 * 32 * 128 * 4096**2 + 2 * 128_256 * 4096
    gbs = kv / (flops / 798e12) / 1e9
    assert 6.95 < gbs < 6.97
    assert "6.96 GB/s (56 Gb/s)" in right(capsys, check.break_even_gbs, gbs)
    not_yet(check.break_even_gbs, kv / (2 * 8_030_261_248 * 4096 / 798e12) / 1e9, hint="2 x all parameters")
    not_yet(check.break_even_gbs, gbs * 8, hint="gigabits")
    not_yet(check.break_even_gbs, 1 / gbs, hint="the inverse")
    not_yet(check.break_even_gbs, 12.5, hint="the KV bytes divided by the prefill's seconds")
