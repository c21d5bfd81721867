"""Determinism (notebook 14, ``llmlab.determinism``): the kernel-level cause without a server, and the live
engine's answers repeated -- idle, under load, from the prefix cache -- and sampled with a seed.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_determinism.py (the tests that start the real engine).
"""

import pytest
import torch

from llmlab import determinism


def test_a_row_computed_alone_is_its_own_reference_and_bad_sizes_are_refused():
    table = determinism.batch_rows(rows=8, inner=64, outer=64)
    assert list(table.index) == [1, 2, 4, 8]
    assert table.loc[1, "bitwise equal to batch 1"] and table.loc[1, "largest difference"] == 0.0
    assert (table["largest difference"] < 1e-3).all()  # the same sums in another order: last bits only
    first = determinism.first_varying_batch(8, 64, 64)
    assert first is None or first > 1  # one row alone is row 0 alone
    for bad in ({"rows": 0}, {"inner": 0}, {"outer": -1}):
        with pytest.raises(ValueError, match="sizes of 1 or more"):
            determinism.batch_rows(**bad)


def test_the_tiny_model_in_pytorch_gives_a_batch_the_same_greedy_token():
    table = determinism.batched_logits("And God said,", ["In the beginning God created the heaven", "The LORD"])
    assert list(table.index) == [2, 3]
    assert (table["largest difference"] < 1e-4).all() and table["same greedy token"].all()
    with pytest.raises(ValueError, match="at least one other prompt"):
        determinism.batched_logits("And God said,", [])


def test_torch_sums_depend_on_their_order():
    values = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    assert values.sum().item() != values.flip(0).sum().item()  # the lesson's section 2, as it prints


def test_the_committed_h200_run_of_batch_invariant_mode():
    """benchmarks/results/h200-llama3.1-8b-determinism (notebook 14, section 7): both settings ran, the table counts
    each repetition that matched its first answer to the bit, and the mode's speed is read from its own sweep."""
    import json

    from llmlab.rehearse import LOG_EXCERPT, parse_memory_log

    table = determinism.gpu_table()
    assert list(table.index) == ["default kernels", "batch-invariant"]
    runs = json.loads(determinism.GPU_RESULTS.read_text())
    for name, row in table.iterrows():
        run = runs[name]
        same = sum(r["same_tokens"] and r["max_logprob_diff"] == 0 for r in run["alone"])
        assert row["alone: same bits"] == f"{same} of {len(run['alone'])}"
        assert row["batch 1 tok/s"] == round(1 / run["batch1"]["tpot_p50"])
        excerpt = (determinism.GPU_RESULTS.parent / name.replace(" ", "-") / LOG_EXCERPT).read_text()
        assert parse_memory_log(excerpt).kv_tokens > 0
        assert ("VLLM_BATCH_INVARIANT=1" in run["serve_line"]) == (name == "batch-invariant")
    assert table.loc["batch-invariant", "c=64 tok/s"] < table.loc["default kernels", "c=64 tok/s"]
