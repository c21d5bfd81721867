"""Quantization (notebook 11, ``llmlab.quantization``): the arithmetic of fp8 weights and an fp8 KV cache, the checks'
hints, and the real CPU engine with an fp8 KV cache -- its logged KV tokens and its logprobs.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_quantization.py (the tests that start the real engine).
"""

import json
import re

import pytest

from llmlab import memory, quantization
from llmlab.serve.paths import RESULTS_DIR

LOG = """\
\x1b[0;36m(APIServer pid=1)\x1b[0;0m WARNING 11-26 06:35:04 [system_utils.py:255] Found ulimit of 20000 and failed \
to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like \
`OSError: [Errno 24] Too many open files`.
(Worker pid=4298) ERROR 11-26 06:35:26 [multiproc_executor.py:953]     torch.ops._C.static_scaled_fp8_quant(x)
(Worker pid=4298) ERROR 11-26 06:35:26 [multiproc_executor.py:953] RuntimeError: _C::static_scaled_fp8_quant() \
expected at most 0 argument(s) but received 4 argument(s).
(EngineCore pid=4286) ERROR 11-26 06:35:27 [core.py:1510] Exception: WorkerProc initialization failed.
Exception: WorkerProc initialization failed.
RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_an_fp8_kv_cache_holds_four_times_the_float32_tokens_and_two_times_bf16():
    table = quantization.kv_table(("auto", "bfloat16", "fp8"))
    assert list(table["bytes per value"]) == [4, 2, 1]
    assert list(table["bytes per token"]) == [2048, 1024, 512]  # 4 layers x 2 x 2 KV heads x 32 x bytes
    assert list(table["KV tokens"]) == [524_288, 1_048_576, 2_097_152]  # 1 GiB / bytes per token
    with pytest.raises(memory.UnknownName, match="Unknown KV cache dtype 'int4'.*--kv-cache-dtype takes"):
        quantization.kv_table(("int4",))


def test_the_committed_h200_fp8_runs_hold_the_arithmetic():
    """benchmarks/results/h200x2-llama3.1-8b-fp8 (notebook 11, section 7): each setting's logged KV tokens are its
    log excerpt's, the fp8 cache holds twice the tokens in the same memory, the weights fp8 freed became KV tokens
    (to 2 %), and each ceiling is the bandwidth over the logged weights less one bf16 embedding."""
    from llmlab.rehearse import LOG_EXCERPT, parse_memory_log

    table = quantization.gpu_table()
    assert list(table.index) == ["bf16", "fp8 weights", "fp8 weights + fp8 KV"]
    folder = quantization.GPU_RESULTS.parent
    for name, row in table.iterrows():
        excerpt = folder / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") / LOG_EXCERPT
        mem = parse_memory_log(excerpt.read_text())
        assert (mem.kv_tokens, mem.weights_gib) == (row["KV tokens"], row["weights GiB"]), name
        assert 0.5 < row["of ceiling"] < 0.8, name  # a decode below its bandwidth ceiling, as in notebook 09
    kv = table["KV tokens"]
    assert abs(kv["fp8 weights + fp8 KV"] / kv["fp8 weights"] - 2) < 1e-3
    freed = (table.loc["bf16", "weights GiB"] - table.loc["fp8 weights", "weights GiB"]) * memory.GiB
    assert freed / memory.kv_bytes_per_token("llama3.1-8b") == pytest.approx(kv["fp8 weights"] - kv["bf16"], rel=0.02)
    runs = json.loads(quantization.GPU_RESULTS.read_text())
    embedding = 128_256 * 4096 * 2
    assert table.loc["bf16", "ceiling tok/s"] == round(runs["machine"]["bandwidth_tb_s"] * 1e12
                                                       / (15.0 * memory.GiB - embedding))
    assert table.loc["fp8 weights", "batch 1 tok/s"] > 1.3 * table.loc["bf16", "batch 1 tok/s"]


def test_the_405b_in_fp8_fits_one_node_where_bf16_needs_two():
    table = quantization.weight_table(["llama3.1-405b"])
    bf16, fp8 = table.loc[("llama3.1-405b", "as stored (bfloat16)")], table.loc[("llama3.1-405b", "fp8")]
    assert (bf16["layout"], bf16["GPUs"], bf16["GPUs (weights alone)"]) == ("TP=8 x PP=2", 16, 12)
    assert (fp8["layout"], fp8["GPUs"], fp8["GPUs (weights alone)"]) == ("TP=8 x PP=1", 8, 6)
    assert fp8["GB"] == pytest.approx(bf16["GB"] / 2, abs=0.1)
    meta = quantization.weight_table(["llama3.1-405b-fp8"], dtypes=(None,))  # attention layers kept in bf16
    assert list(meta.index) == [("llama3.1-405b-fp8", "as stored (fbgemm_fp8)")]
    assert fp8["GB"] < meta["GB"].iloc[0] < bf16["GB"] and meta["GPUs"].iloc[0] == 8
    with pytest.raises(memory.UnknownName, match="Unknown dtype 'fp6'"):
        quantization.weight_table(["llama3.1-8b"], dtypes=("fp6",))


def test_the_roofline_reproduces_the_h100_figure_and_fp8_halves_the_bytes():
    """Llama 3.1 8B in bf16 reads 15.01 GB a step (all but the input embedding); at the H100's measured copy
    bandwidth that is the committed H100 rehearsal's own roofline (lessons 09 and 11 quote both: 3.01 TB/s, 201)."""
    committed = json.loads((RESULTS_DIR / "h100-llama3.1-8b-tp1" / "rehearsal.json").read_text())
    assert quantization.H100_COPY_BYTES_S == pytest.approx(committed["bandwidth_tb_s"] * 1e12, rel=1e-4)
    assert quantization.step_bytes("llama3.1-8b") == pytest.approx(15.01e9, rel=1e-3)
    assert quantization.roofline_tok_s("llama3.1-8b") == pytest.approx(committed["roofline_tok_s"], rel=1e-4)
    assert quantization.step_bytes("llama3.1-8b", "fp8") * 2 == quantization.step_bytes("llama3.1-8b")
    kv = 64 * 8192 * memory.kv_bytes_per_token("llama3.1-8b")  # 64 requests of 8k tokens: K and V read each step
    assert quantization.step_bytes("llama3.1-8b", batch=64, context=8192) == quantization.step_bytes("llama3.1-8b") + kv
    assert quantization.step_bytes("llama3.1-8b", kv_dtype="fp8", batch=64, context=8192) == \
        quantization.step_bytes("llama3.1-8b") + kv // 2
    with pytest.raises(ValueError, match="batch >= 1"):
        quantization.step_bytes("llama3.1-8b", batch=0)
    with pytest.raises(ValueError, match="bytes per second"):
        quantization.roofline_tok_s("llama3.1-8b", bandwidth_bytes_s=0)


def test_error_lines_read_the_root_cause_first_without_colours_or_prefixes():
    assert quantization.error_lines(LOG) == [
        "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received 4 argument(s).",
        "Exception: WorkerProc initialization failed.",
        "RuntimeError: Engine core initialization failed. See root cause above."]
    assert quantization.error_lines("INFO all good") == []


def test_the_recorded_refusals_hold_both_attempts_and_a_wrong_record_is_one_sentence(tmp_path):
    """Notebook 11 prints the record; ``make test-versions`` asks the installed vLLM again and compares."""
    record = quantization.recorded_refusals()
    assert set(record["attempts"]) == {" ".join(a) for a in quantization.FP8_WEIGHT_ATTEMPTS}
    assert all(record["attempts"].values()) and record["vllm"] and record["recorded"]
    other = tmp_path / "refusals.json"
    other.write_text('{"attempts": {"--quantization fp8": ["x"]}}')
    with pytest.raises(ValueError, match="record them again with LLMLAB_UPDATE_FIXTURES=1 make test-versions"):
        quantization.recorded_refusals(other)
