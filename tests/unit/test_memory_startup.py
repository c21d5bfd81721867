"""The KV pool predicted before launch (llmlab.memory.startup) against the committed GPU runs: no engine.

Each reserved term is checked on its own against the bytes the rehearsal probe printed inside vLLM 0.26, and the
whole prediction against every committed server log's "GPU KV cache size" (``kv-before-launch.json``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from llmlab import memory as m
from llmlab import rehearse
from llmlab.memory import startup
from llmlab.ops.cli import main

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
MiB = 2**20

# (run, model, gpu, tp, pp): the runs whose rehearsal.json holds the probe's bytes for every GPU
PROBED = [("h100-llama3.1-8b-tp1", "llama3.1-8b", "H100-80", 1, 1),
          ("h200-llama3.1-8b-tp1", "llama3.1-8b", "H200-141", 1, 1),
          ("h200-llama3.1-8b-tp2", "llama3.1-8b", "H200-141", 2, 1),
          ("h200-llama3.1-70b-tp2", "llama3.1-70b", "H200-141", 2, 1),
          ("h100-gpt-oss-20b-tp1", "gpt-oss-20b", "H100-80", 1, 1)]


def _probe(run: str) -> dict:
    return json.loads((RESULTS / run / "rehearsal.json").read_text())["memory_probe"][0]


# The two held-out runs of a mixture of experts (qwen3-30b-a3b, on one H200 and on two H100s; issue 39) missed: the
# model predicted +1.07 % and +1.75 % too many KV tokens, mostly because the profile run's activation peak of this
# MoE is about 630 MiB above the model's (gpt-oss-20b, the MoE it was fitted on, is within 1 %).  Every dense run,
# the two dense held-out runs included, is within 1 %.  A model that fixes the MoE peak needs new held-out runs.
MOE_HELD_OUT_MISSES = [f"{run}/server-log-excerpt.txt"
                       for run in ("h100x2-qwen3-30b-a3b-tp2", "h200-qwen3-30b-a3b-tp1")]


def test_the_committed_table_is_what_todays_model_predicts_and_every_run_is_within_one_percent():
    """The table a reader sees is recomputed here from the committed logs; refresh it with
    ``rehearse.write_before_launch_table()`` after changing the model."""
    committed = json.loads((RESULTS / rehearse.BEFORE_LAUNCH_TABLE).read_text())
    rows = rehearse.before_launch_table(RESULTS)
    assert committed["rows"] == rows
    assert {r["run"] for r in rows} >= {f"{run}/server-log-excerpt.txt" for run, *_ in PROBED}
    assert len(rows) >= 20 and all(r["vllm_version"] == "0.26.0" for r in rows)
    assert {(r["tp"], r["pp"]) for r in rows} == {(1, 1), (2, 1), (1, 2)}
    assert {"fp8"} == {r["flags"].get("quantization") for r in rows} - {None}
    misses = [r["run"] for r in rows if abs(r["error"]) >= 0.01]
    assert misses == committed["misses"] == MOE_HELD_OUT_MISSES, [r for r in rows if abs(r["error"]) >= 0.01]
    assert committed["largest_error"] == max(abs(r["error"]) for r in rows)


def test_the_old_fixed_allowance_was_the_1_5_to_3_percent_miss_the_issue_names():
    """Issue 39's starting point: 3 GiB per GPU for activations and graphs, llmlab's own weights."""
    for run, before in (("h200-llama3.1-8b-tp1", 883_600), ("h200-llama3.1-8b-tp2", 1_889_744),
                        ("h100-llama3.1-8b-tp1", 436_656)):
        r = json.loads((RESULTS / run / "rehearsal.json").read_text())
        assert r["kv_tokens_predicted_before_start"] == before
        new = m.predict_kv_before_launch("llama3.1-8b", "H200" if "h200" in run else "H100", r["tp"]).kv_tokens
        assert abs(new - r["kv_tokens_logged"]) < abs(before - r["kv_tokens_logged"]) / 10


@pytest.mark.parametrize("run,model,card,tp,pp", PROBED, ids=[p[0] for p in PROBED])
def test_each_reserved_term_against_the_probes_bytes(run, model, card, tp, pp):
    """Requested share exact; dense weights within 30 MiB (the rotary cache modelled, a few buffers not); the
    activation peak within 150 MiB on the runs not fitted; non-torch exact on the fitted cases."""
    p, pred = _probe(run), m.predict_kv_before_launch(model, card, tp, pp)
    assert pred.total_bytes == p["total"] and pred.requested_bytes == p["requested"]
    weights_off = pred.weights_per_stage[0] - p["weights"]
    peak_off = pred.activation_peak_per_stage[0] - p["activation_peak"]
    if model == "gpt-oss-20b":  # MXFP4 experts: vLLM's kernel layout takes 218 MiB more than the checkpoint's bytes
        assert -240 * MiB < weights_off < -200 * MiB
        assert abs(peak_off) < 160 * MiB  # the older runner's sampler warm-up, counted from vLLM's source
        assert pred.cuda_graph_bytes == p["cudagraph_estimate"]  # fitted on this run
    else:
        assert -30 * MiB < weights_off <= 0
        assert abs(peak_off) < (2 * MiB if run in startup.FITTED["activation peak (ACT_PER_MLP, ACT_PER_HIDDEN)"]
                                else 150 * MiB)
        assert pred.non_torch_bytes == p["non_torch"] and pred.cuda_graph_bytes == 0


def test_the_budget_is_vllms_subtraction_and_the_parts_add_up_to_the_card():
    pred = m.predict_kv_before_launch("llama3.1-8b", "H100", 1)
    parts = pred.reserved()
    assert sum(parts.values()) == pred.total_bytes
    assert pred.requested_bytes == math.ceil(0.9 * pred.total_bytes)
    assert pred.kv_budget_per_stage[0] == (pred.requested_bytes - pred.weights_per_stage[0]
                                           - pred.activation_peak_per_stage[0] - pred.non_torch_bytes)
    assert pred.kv_tokens == pred.kv_blocks * 16 == m.kv_blocks(pred.kv_budget_per_stage[0], 131_072) * 16


def test_pipeline_stages_take_the_fullest_stage_and_tp_halves_the_mlp_term():
    pp2 = m.predict_kv_before_launch("llama3.1-8b", "H200", 1, 2)
    assert len(pp2.weights_per_stage) == 2 and pp2.non_torch_bytes == startup.NON_TORCH_PER_GPU_MULTI
    assert pp2.kv_blocks == min(b // pp2.bytes_per_block_per_stage[0] for b in pp2.kv_budget_per_stage)
    one, two = (m.activation_peak_bytes("llama3.1-8b", tp) for tp in (1, 2))
    assert one - two == pytest.approx(8192 * 2 * startup.ACT_PER_MLP * 14_336 / 2, abs=1)


def test_online_fp8_keeps_embeddings_and_head_in_16_bits_and_the_rotary_cache_is_one_table():
    assert m.rotary_cache_bytes("llama3.1-8b") == 131_072 * 128 * 2 == 32 * MiB
    fp8 = m.loaded_weight_bytes("llama3.1-8b", "fp8")[0]
    assert fp8 / m.GiB == pytest.approx(8.54, abs=0.06)  # "Model loading took 8.54 GiB" (h200x2-llama3.1-8b-fp8)
    assert fp8 > m.weight_bytes("llama3.1-8b", "fp8")  # every weight in fp8 would be too few
    assert m.predict_kv_before_launch("llama3.1-8b", "H200", dtype="fp8", kv_dtype="fp8").kv_tokens == \
        2 * m.predict_kv_before_launch("llama3.1-8b", "H200", dtype="fp8").kv_blocks * 16


def test_runner_and_scheduler_defaults_follow_vllm_026():
    assert startup.model_runner(m.model_spec("llama3.1-8b")) == "v2"
    assert startup.model_runner(m.model_spec("gpt-oss-20b")) == "v1"
    assert startup.scheduler_defaults(m.gpu("H100")) == (8192, 1024)
    assert startup.scheduler_defaults(m.gpu("A100-80")) == (2048, 256)
    assert m.gpu_of_total(79.18) == "H100-80" and m.gpu_of_total(139.8) == "H200-141"
    eager = m.predict_kv_before_launch("gpt-oss-20b", "H100", enforce_eager=True)
    assert eager.cuda_graph_bytes == 0


def test_cli_memory_prints_where_each_reserved_byte_goes(capsys):
    assert main(["memory", "llama3.1-8b", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "plan             TP=1 x PP=1" in out  # the existing output stays
    assert "KV pool predicted before launch" in out and "897,040 KV tokens" in out
    for term in ("weights as loaded", "activation peak (profile run)", "non-torch memory", "CUDA-graph estimate"):
        assert term in out
    assert main(["memory", "llama3.1-8b", "--gpu", "H200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["before_launch"]["kv_tokens"] == 897_040


@pytest.mark.parametrize("run,model,card,tp,pp", PROBED, ids=[p[0] for p in PROBED])
def test_each_rehearsal_json_keeps_todays_prediction_before_launch(run, model, card, tp, pp):
    r = rehearse.load_result(RESULTS / run)
    layout = rehearse.Layout(r["model"], r["tp"], r["pp"], r["max_model_len"], r["gpu_memory_utilization"])
    today = rehearse.predict_before_launch(layout, r["gpu_memory_gib"]).kv_tokens
    assert r["kv_tokens_predicted_before_launch"] == today
    assert abs(r["kv_error_before_launch"]) < 0.01 and rehearse.check_math(r) == []


def test_the_held_out_predictions_were_made_by_todays_model_and_hold_once_run():
    """``kv-before-launch-held-out.json``: predictions committed before their runs.  They must stay what the model
    says (a changed model needs new held-out runs, not edited predictions); a run's logged tokens, once filled in,
    must be within 1 %."""
    doc = json.loads((RESULTS / "kv-before-launch-held-out.json").read_text())
    assert len(doc["runs"]) >= 2
    for r in doc["runs"]:
        pred = m.predict_kv_before_launch(**r["inputs"])
        assert r["predicted_before_launch"] == pred.kv_tokens and r["reserved_bytes_per_gpu"] == pred.reserved()
    logged = [r for r in doc["runs"] if r["logged"] is not None]
    within = [r["name"] for r in logged if abs(r["predicted_before_launch"] - r["logged"]) < 0.01 * r["logged"]]
    assert len(within) >= 2 and sorted(r["name"] for r in logged if r["name"] not in within) == \
        sorted(m.split("/")[0] for m in MOE_HELD_OUT_MISSES)
