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


# (run, model, gpu, tp): the held-out runs of a mixture of experts whose kv-held-out.json holds the probe's bytes
MOE_PROBED = [("h200-qwen3-30b-a3b-tp1", "qwen3-30b-a3b", "H200-141", 1),
              ("h100x2-qwen3-30b-a3b-tp2", "qwen3-30b-a3b", "H100-80", 2)]


def _probe(run: str) -> dict:
    if (RESULTS / run / "rehearsal.json").exists():
        return json.loads((RESULTS / run / "rehearsal.json").read_text())["memory_probe"][0]
    return json.loads((RESULTS / run / "kv-held-out.json").read_text())["probe"][0]


# The first two held-out runs of a mixture of experts (qwen3-30b-a3b, on one H200 and on two H100s; issue 39)
# missed: +1.07 % and +1.75 % too many KV tokens, the profile run's activation peak 630 MiB above that model's (it
# left out the fused-MoE workspace and the sampler's Triton buffer).  The model now counts them from vLLM's source
# and fits its MoE constants on those two runs and gpt-oss, so they are fit data, no longer held out; their
# original predictions and misses stay in kv-before-launch-held-out.json, and new held-out runs check the model.
MOE_HELD_OUT_MISSES = ["h100x2-qwen3-30b-a3b-tp2", "h200-qwen3-30b-a3b-tp1"]

# The held-out MoE runs made after the model above (predictions of 2026-11-27T12:35:50Z, runs 12:37-12:42 UTC on an
# H200; the H100 pair's predictions of 12:34:17Z, runs 17:42-17:47 UTC)
NEW_MOE_HELD_OUT = ["h200-qwen3-30b-a3b-tp1-util50-batched-16k", "h200-qwen3-30b-a3b-tp1-util50-seqs-256",
                    "h100-qwen3-30b-a3b-tp1-batched-16k", "h100-qwen3-30b-a3b-tp1-seqs-256"]

# Committed runs the model misses by 1 % or more (a held-out run that missed stays here, never refitted away)
TABLE_MISSES: list[str] = []


def test_the_committed_table_is_what_todays_model_predicts_and_every_run_is_within_one_percent():
    """The table a reader sees is recomputed here from the committed logs; refresh it with
    ``rehearse.write_before_launch_table()`` after changing the model."""
    committed = json.loads((RESULTS / rehearse.BEFORE_LAUNCH_TABLE).read_text())
    rows = rehearse.before_launch_table(RESULTS)
    assert committed["rows"] == rows
    assert {r["run"] for r in rows} >= {f"{run}/server-log-excerpt.txt" for run, *_ in PROBED}
    assert len(rows) >= 20 and all(r["vllm_version"] == "0.26.0" for r in rows)
    assert {(r["tp"], r["pp"]) for r in rows} == {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2)}
    assert {"fp8"} == {r["flags"].get("quantization") for r in rows} - {None}
    misses = [r["run"] for r in rows if abs(r["error"]) >= 0.01]
    assert misses == committed["misses"] == TABLE_MISSES, [r for r in rows if abs(r["error"]) >= 0.01]
    moe = [r for r in rows if r["runner"] == "v1"]
    assert {r["model"] for r in moe} >= {"gpt-oss-20b", "qwen3-30b-a3b"} and {r["tp"] for r in moe} == {1, 2}
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
    if model == "gpt-oss-20b":  # MXFP4 experts: vLLM's kernel layout takes 202 MiB more than the checkpoint's bytes
        assert -240 * MiB < weights_off < -200 * MiB
        assert abs(peak_off) < 1 * MiB  # the older runner's profile peak: vLLM's source plus V1_PEAK_EXTRA
        assert abs(pred.cuda_graph_bytes - p["cudagraph_estimate"]) <= 16 * MiB
        assert abs(pred.non_torch_bytes - p["non_torch"]) <= 4 * MiB
    else:
        assert -30 * MiB < weights_off <= 0
        assert abs(peak_off) < (2 * MiB if run in startup.FITTED["activation peak (ACT_PER_MLP, ACT_PER_HIDDEN)"]
                                else 150 * MiB)
        assert pred.non_torch_bytes == p["non_torch"] and pred.cuda_graph_bytes == 0


@pytest.mark.parametrize("run,model,card,tp", MOE_PROBED, ids=[p[0] for p in MOE_PROBED])
def test_the_moe_profile_peak_is_vllms_workspace_and_sampler_to_the_megabyte(run, model, card, tp):
    """qwen3-30b-a3b's probe (the same peak at TP=1 and TP=2, to the byte): Triton's MoE workspace (512 MiB, as
    2 x intermediate / TP <= hidden at both), the sampler's float32 logits and Triton buffer, the held hidden
    states, and the fitted 34 MiB; weights, non-torch and the CUDA-graph estimate within their fits."""
    p, pred = _probe(run), m.predict_kv_before_launch(model, card, tp, max_model_len=40960)
    assert pred.total_bytes == p["total"] and pred.requested_bytes == p["requested"]
    assert abs(pred.activation_peak_per_stage[0] - p["activation_peak"]) < 1 * MiB
    assert -3 * MiB < pred.weights_per_stage[0] - p["weights"] <= 0
    assert abs(pred.non_torch_bytes - p["non_torch"]) <= 4 * MiB
    assert abs(pred.cuda_graph_bytes - p["cudagraph_estimate"]) <= 16 * MiB
    assert abs(pred.kv_budget_per_stage[0] - p["available_kv"]) < 0.001 * p["available_kv"]


def test_the_moe_workspace_follows_tritons_shapes():
    """workspace13 = M x top_k x max(I/TP, K), workspace2 = M x top_k x max(2I/TP, K), in bf16 (qwen3-30b-a3b:
    I = 768, K = 2,048, top_k = 8); none for gpt-oss's monolithic MXFP4 kernel; linear in the batched tokens."""
    assert startup.moe_workspace_bytes("qwen3-30b-a3b", 1, 8192) == 2 * 8192 * 8 * 2048 * 2 == 512 * MiB
    assert startup.moe_workspace_bytes("qwen3-30b-a3b", 2, 8192) == 512 * MiB
    assert startup.moe_workspace_bytes("qwen3-30b-a3b", 1, 16384) == 1024 * MiB
    mixtral = 8192 * 2 * 14_336 * 2 + 8192 * 2 * 2 * 14_336 * 2  # experts wider than hidden: the workspace shrinks
    assert startup.moe_workspace_bytes("mixtral-8x7b", 1, 8192) == mixtral
    assert startup.moe_workspace_bytes("mixtral-8x7b", 2, 8192) == mixtral // 2
    assert startup.moe_workspace_bytes("gpt-oss-20b", 1, 8192) == 0
    assert startup.moe_workspace_bytes("llama3.1-8b", 1, 8192) == 0


def test_cuda_graph_counts_follow_vllms_capture_sizes():
    """The committed logs: "PIECEWISE=51 (largest=512), FULL=51" for qwen3-30b-a3b, 83 and 83 for gpt-oss-20b."""
    assert startup.cuda_graph_sizes("qwen3-30b-a3b", 8192, 1024) == (51, 51)
    assert startup.cuda_graph_sizes("gpt-oss-20b", 8192, 1024) == (83, 83)
    assert startup.cuda_graph_sizes("qwen3-30b-a3b", 8192, 256) == (51, 35)
    assert startup.cuda_graph_sizes("qwen3-30b-a3b", 8192, 64) == (19, 11)  # up to 2 x 64 = 128
    assert startup.cuda_graph_sizes("qwen3-30b-a3b", 300, 1024) == (38, 38)  # 3 + 31 + 256..288 + 300 itself


def test_pipeline_stages_other_than_the_last_skip_the_sampler_warm_up():
    pp2 = m.predict_kv_before_launch("qwen3-30b-a3b", "H200", 1, 2, max_model_len=40960)
    first, last = pp2.activation_peak_per_stage
    assert last == m.predict_kv_before_launch("qwen3-30b-a3b", "H200", max_model_len=40960).activation_peak_per_stage[0]
    assert first < last and first >= startup.moe_workspace_bytes("qwen3-30b-a3b", 1, 8192)


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
    must be within 1 %.  A run later used for fitting keeps its original prediction and miss, and today's model
    on it ('refit') must hold."""
    doc = json.loads((RESULTS / "kv-before-launch-held-out.json").read_text())
    held_out = [r for r in doc["runs"] if "used_for_fitting" not in r]
    fitted = [r for r in doc["runs"] if "used_for_fitting" in r]
    assert len(held_out) >= 4 and sorted(r["name"] for r in fitted) == sorted(MOE_HELD_OUT_MISSES)
    for r in held_out:
        pred = m.predict_kv_before_launch(**r["inputs"])
        assert r["predicted_before_launch"] == pred.kv_tokens and r["reserved_bytes_per_gpu"] == pred.reserved()
    for r in fitted:
        pred = m.predict_kv_before_launch(**r["inputs"])
        assert r["refit"]["predicted"] == pred.kv_tokens and r["refit"]["reserved_bytes_per_gpu"] == pred.reserved()
        assert abs(r["refit"]["predicted"] - r["logged"]) < 0.01 * r["logged"]
        assert abs(r["predicted_before_launch"] - r["logged"]) >= 0.01 * r["logged"]  # the miss stays recorded
    logged = [r for r in held_out if r["logged"] is not None]
    within = [r["name"] for r in logged if abs(r["predicted_before_launch"] - r["logged"]) < 0.01 * r["logged"]]
    assert len(within) >= 2 and sorted(r["name"] for r in logged if r["name"] not in within) == \
        sorted(run.split("/")[0] for run in TABLE_MISSES)
    # the model of the MoE terms has held-out runs of its own, made after its predictions were written
    moe = [r for r in logged if r["runner"] == "v1" and r["name"] in within]
    assert len(moe) >= 2 and all(r["predicted_at"] < r["ran_at"] for r in moe)


@pytest.mark.parametrize("run", NEW_MOE_HELD_OUT)
def test_where_the_new_moe_held_out_runs_differ_from_the_model(run):
    """The probe's bytes of the held-out MoE runs: the profile peak within 3 MiB (16,384 batched tokens: the
    workspace doubled to 1 GiB; 256 sequences: the sampler's rows a quarter), weights and non-torch as fitted; the
    CUDA-graph estimate is the weak term (-94 MiB with 35 FULL graphs instead of 51, see V1_GRAPH_BYTES_PER_LAYER)."""
    doc = json.loads((RESULTS / "kv-before-launch-held-out.json").read_text())
    inputs = next(r["inputs"] for r in doc["runs"] if r["name"] == run)
    p, pred = _probe(run), m.predict_kv_before_launch(**inputs)
    assert pred.requested_bytes == p["requested"]
    assert abs(pred.activation_peak_per_stage[0] - p["activation_peak"]) < 3 * MiB
    assert -3 * MiB < pred.weights_per_stage[0] - p["weights"] <= 0
    assert abs(pred.non_torch_bytes - p["non_torch"]) <= 4 * MiB
    assert abs(pred.cuda_graph_bytes - p["cudagraph_estimate"]) < 100 * MiB
