"""The exercise checks of notebook 19 (``llmlab.check.troubleshoot``), each with the right answer and every wrong answer
it names: the committed H100 job's cause and memory share, the longest context a 4 GiB pool holds for Llama 3.1 8B,
and the pending job that never starts.  Pure (no engine)."""

from __future__ import annotations

from check_helpers import not_yet, right

from llmlab import check

PER_TOKEN_8B = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head size x bf16
LONGEST = (4 * 2**30 // (PER_TOKEN_8B * 16) - 1) * 16  # whole blocks of 16, less the null block


def test_oom_at_start(capsys):
    assert "7.9 GiB, and the 8B's weights alone are 15.0 GiB" in right(capsys, check.oom_at_start, "no-kv-memory", 0.1)
    not_yet(check.oom_at_start, "kv-at-start", 0.1, hint="names a max seq len")
    not_yet(check.oom_at_start, "core-exited", 0.1, hint="read up to the root cause")
    not_yet(check.oom_at_start, "tp-heads", 0.1, hint="which sign's sentence")
    not_yet(check.oom_at_start, "out of memory", 0.1, hint="one of the signs' names")
    not_yet(check.oom_at_start, "no-kv-memory", 0.9, hint="keeps the last")
    not_yet(check.oom_at_start, "no-kv-memory", 10, hint="a fraction")
    not_yet(check.oom_at_start, "no-kv-memory", 0.2, hint="the last --gpu-memory-utilization")
    not_yet(check.oom_at_start, "no-kv-memory", "0.1", hint="should be a number")


def test_longest_context(capsys):
    assert LONGEST == 32_752
    assert "32,752 tokens (131,072 bytes a token)" in right(capsys, check.longest_context, LONGEST)
    not_yet(check.longest_context, 32_768, hint="null block", hides=LONGEST)
    not_yet(check.longest_context, 16_376, hint="that is half", hides=LONGEST)
    not_yet(check.longest_context, 16_384, hint="that is half", hides=LONGEST)
    not_yet(check.longest_context, 65_504, hint="twice the answer", hides=LONGEST)
    not_yet(check.longest_context, (4 * 2**30 // (PER_TOKEN_8B * 4 * 16) - 1) * 16, hint="32 query heads",
            hides=LONGEST)
    not_yet(check.longest_context, (4 * 10**9 // (PER_TOKEN_8B * 16) - 1) * 16, hint="10**9 bytes", hides=LONGEST)
    not_yet(check.longest_context, 32_750, hint="whole number of them", hides=LONGEST)
    not_yet(check.longest_context, 32_000, hint="less one, times 16", hides=LONGEST)
    not_yet(check.longest_context, 32_752.5, hint="whole number")


def test_never_starts(capsys):
    assert "PartitionTimeLimit: The job's time limit exceeds" in right(capsys, check.never_starts,
                                                                      "PartitionTimeLimit")
    not_yet(check.never_starts, "Resources", hint="the normal wait")
    not_yet(check.never_starts, "Priority", hint="in its turn")
    not_yet(check.never_starts, "QOSGrp*Limit", hint="when one of them ends")
    not_yet(check.never_starts, "ReqNodeNotAvail", hint="one of the four lines' reasons")


def test_cut_off(capsys):
    good = {"A": "revoked", "B": "unread", "C": "bad-key"}
    assert "with client.completions.create" in right(capsys, check.cut_off, good, "b")
    not_yet(check.cut_off, {**good, "A": "bad-key"}, "b", hint="its owner revoked it")
    not_yet(check.cut_off, {**good, "C": "revoked"}, "b", hint="never knew")
    not_yet(check.cut_off, {**good, "B": "engine-died"}, "b", hint="the engine is fine")
    not_yet(check.cut_off, {"A": "revoked", "B": "unread", "C": "no-model"}, "b", hint="match each excerpt")
    not_yet(check.cut_off, {"A": "revoked"}, "b", hint="a dict with the excerpts")
    not_yet(check.cut_off, {**good, "B": "back-pressure"}, "b", hint="one of the signs' names")
    not_yet(check.cut_off, good, "a", hint="a longer time-out")
    not_yet(check.cut_off, good, "c", hint="fewer tokens")
    not_yet(check.cut_off, good, "d", hint="the server is fine")
    not_yet(check.cut_off, good, "e", hint="one of the letters")
