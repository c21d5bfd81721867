"""Memory arithmetic (llmlab.memory): exact against published totals, vLLM's KV log, and bad input.

Pure tests run in a second.  The two tests marked ``server`` start the real embedded vLLM server
(``-m "not server"`` leaves them out).

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_memory.py (the tests that start the real engine).
"""

import json
import re
from pathlib import Path

import pytest

from llmlab import memory as m
from llmlab.ops.cli import main

PUBLISHED_PARAMS = {  # Hugging Face's totals for each shipped config
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "llama3.1-405b-fp8": 405_853_388_800,
    "llama2-7b": 6_738_415_616,
    "llama2-70b": 68_976_648_192,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-8b": 8_190_735_360,  # "8.2B"
    "qwen3-30b-a3b": 30_532_122_624,  # "30.5B in total, 3.3B activated"
    "deepseek-v3": 671_026_404_352,  # "671B" (the repository's 685B adds the 14B multi-token-prediction layer)
    "gpt-oss-20b": 20_914_757_184,  # "20.91B"
    "gpt-oss-120b": 116_829_156_672,  # "116.83B"
    "gemma2-9b": 9_241_705_984,
    "gemma3-1b": 999_885_952,
    "llama4-scout": 107_769_861_120,  # the language model of "109B" (the vision tower is not counted)
    "llama4-maverick": 400_711_848_960,  # "400B"
    "kimi-k2": 1_026_408_209_408,  # "1T total parameters"
}

TINY = {  # the tiny model as the course trains it (transformers 5 writes "dtype", not "torch_dtype")
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 4096, "hidden_size": 256,
    "intermediate_size": 640, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "dtype": "float32",
}


def llama(**changes) -> dict:
    cfg = json.loads(m.config_path("llama3.1-8b").read_text())
    cfg.update(changes)
    return cfg


# --- parameter counts -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_every_shipped_config_reproduces_its_published_total(name):
    assert m.param_count(name) == PUBLISHED_PARAMS[name]


def test_every_shipped_name_is_listed_and_loads():
    names = set(m.shipped_models())
    assert set(PUBLISHED_PARAMS) | {"llmlab-tiny"} == names
    for name in PUBLISHED_PARAMS:
        assert m.model_spec(name).hf_id, f"{name} has no Hugging Face id for the vllm serve line"


def test_tiny_model_spec_has_3_672_320_parameters_and_tied_embeddings():
    assert m.param_count(TINY) == 3_672_320
    assert "lm_head" not in m.param_breakdown(TINY)


def test_shipped_tiny_config_matches_the_course_facts():
    if not m.config_path("llmlab-tiny").is_file():
        pytest.skip("llmlab/models/llmlab-tiny/config.json is not there yet (the tiny model is being trained)")
    spec = m.model_spec("llmlab-tiny")
    assert m.param_count(spec) == 3_672_320 and spec.tie_word_embeddings
    assert spec.torch_dtype == "float32" and spec.max_position_embeddings == 512
    assert m.kv_bytes_per_token(spec) == 2048


def test_tied_embeddings_save_exactly_one_vocab_by_hidden_matrix():
    untied = dict(TINY, tie_word_embeddings=False)
    assert m.param_count(untied) - m.param_count(TINY) == 4096 * 256
    assert m.param_breakdown(untied)["lm_head"] == 4096 * 256


def test_breakdown_of_llama_3_1_8b():
    b = m.param_breakdown("llama3.1-8b")
    assert b["embedding"] == b["lm_head"] == 128_256 * 4096
    assert b["attention"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)  # GQA: k and v are 8 heads x 128
    assert b["mlp"] == 32 * 3 * 4096 * 14336
    assert b["norm"] == (2 * 32 + 1) * 4096
    assert sum(b.values()) == PUBLISHED_PARAMS["llama3.1-8b"]


def test_mixture_of_experts_counts_experts_router_and_active_parameters():
    b = m.param_breakdown("mixtral-8x7b")
    assert b["experts"] == 32 * 8 * 3 * 4096 * 14336
    assert b["router"] == 32 * 4096 * 8
    assert "mlp" not in b
    assert m.active_params("mixtral-8x7b") == 12_879_925_248  # 2 of 8 experts per token: "12.9B active"
    assert m.active_params("llama3.1-8b") == m.param_count("llama3.1-8b")


def test_explicit_head_dim_overrides_hidden_over_heads():
    nemo = {"architectures": ["MistralForCausalLM"], "vocab_size": 131072, "hidden_size": 5120,
            "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    spec = m.model_spec(nemo)
    assert spec.head_dim == 128  # not 5120 / 32 = 160
    q = next(t for t in m.tensors(spec) if t.name.endswith("0.self_attn.q_proj.weight"))
    assert q.shape == (32 * 128, 5120)
    assert m.param_count(nemo) == 12_247_782_400  # Mistral Nemo 12B
    assert m.kv_bytes_per_token(nemo) == 40 * 2 * 8 * 128 * 2
    assert m.model_spec({**nemo, "head_dim": None}).head_dim == 160  # null means "derive it"


def test_qwen2_has_qkv_biases_without_a_config_flag():
    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
            "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": 131072,
            "use_sliding_window": False}
    assert m.param_count(qwen) == 7_615_616_512  # Qwen2.5-7B
    names = {t.name for t in m.tensors(qwen)}
    assert "model.layers.0.self_attn.k_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    assert m.model_spec(qwen).sliding_window is None


def test_llama_attention_and_mlp_bias_flags_add_their_vectors():
    base = m.param_count("llama3.1-8b")
    assert m.param_count(llama(attention_bias=True)) - base == 32 * (4096 + 2 * 1024 + 4096)
    assert m.param_count(llama(mlp_bias=True)) - base == 32 * (2 * 14336 + 4096)


def test_transformers_defaults_are_applied_visibly():
    spec = m.model_spec("llama2-7b")  # Llama 2's config has no attention_bias / mlp_bias fields
    assert any(d.startswith("attention_bias=False") for d in spec.defaults_applied)
    no_kv = {k: v for k, v in llama().items() if k != "num_key_value_heads"}
    spec = m.model_spec(no_kv)
    assert spec.num_kv_heads == 32 and any("num_key_value_heads" in d for d in spec.defaults_applied)
    assert m.model_spec("llama3.1-8b").defaults_applied == ()


def test_model_can_be_a_path_a_directory_or_a_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    for model in (tmp_path, tmp_path / "config.json", str(tmp_path), TINY):
        assert m.param_count(model) == 3_672_320


# --- bytes --------------------------------------------------------------------------------------------

def test_weight_bytes_per_dtype():
    p = PUBLISHED_PARAMS["llama3.1-405b"]
    assert m.weight_bytes("llama3.1-405b") == m.weight_bytes("llama3.1-405b", "fp16") == 2 * p
    assert m.weight_bytes("llama3.1-405b", "float32") == 4 * p
    assert m.weight_bytes("llama3.1-405b", "fp8") == m.weight_bytes("llama3.1-405b", "int8") == p
    assert m.weight_bytes("llama3.1-405b", "int4") == p // 2
    assert m.weight_bytes("llama2-7b") == 2 * PUBLISHED_PARAMS["llama2-7b"]  # a float16 checkpoint
    assert m.weight_bytes(TINY) == 4 * 3_672_320  # a float32 checkpoint


def test_fp8_checkpoint_bytes_follow_its_quantization_config():
    mlp = 3 * 16384 * 53248                          # one layer's MLP parameters
    scales = (53248 + 53248 + 16384) * 4             # one float32 scale per output channel
    fp8 = 124 * (mlp + scales)                       # layers 1..124: FP8 MLPs
    bf16 = 2 * (PUBLISHED_PARAMS["llama3.1-405b"] - 124 * mlp)
    assert m.weight_bytes("llama3.1-405b-fp8") == fp8 + bf16 == 487_229_259_776


def test_kv_bytes_per_token_and_per_request():
    assert m.kv_bytes_per_token("llama3.1-8b") == 32 * 2 * 8 * 128 * 2 == 131_072
    assert m.kv_bytes_per_token("llama3.1-70b") == 327_680
    assert m.kv_bytes_per_token("llama3.1-405b") == 126 * 2 * 8 * 128 * 2 == 516_096
    assert m.kv_bytes_per_token("llama3.1-405b", kv_dtype="fp8") == 258_048
    assert m.kv_bytes_per_token("llama2-7b") == 32 * 2 * 32 * 128 * 2  # no GQA: 4x Llama 3.1 8B's
    assert m.kv_bytes_per_token(TINY) == 2048  # float32
    assert m.kv_bytes_per_token(TINY, dtype="bfloat16") == 1024
    assert m.kv_bytes_per_token("llama3.1-8b", dtype="int4") == 131_072  # activations stay bf16
    assert m.kv_cache_bytes("llama3.1-8b", 1000, concurrency=3) == 3000 * 131_072


def test_published_405b_kv_figure_is_twice_the_config():
    kv = m.kv_cache_bytes("llama3.1-405b", 128_000)
    assert round(kv / m.GiB, 2) == 61.52            # the config: 8 KV heads
    assert round(2 * kv / m.GiB, 2) == 123.05       # the published figure
    assert round(m.kv_cache_bytes("llama3.1-8b", 128_000) / m.GiB, 2) == 15.62   # published, right
    assert round(m.kv_cache_bytes("llama3.1-70b", 128_000) / m.GiB, 2) == 39.06  # published, right


def test_sliding_window_caps_the_tokens_held():
    assert m.kv_cache_bytes("mistral-7b", 32768) == 4096 * 131_072
    assert m.kv_cache_bytes("mistral-7b", 1000) == 1000 * 131_072
    assert m.kv_cache_bytes("mixtral-8x7b", 32768) == 32768 * 131_072  # sliding_window: null


# --- vLLM's KV block arithmetic ---------------------------------------------------------------------

def test_cpu_kv_capacity_reproduces_the_embedded_server_log():
    cap = m.embedded_kv_capacity(1, TINY)
    assert cap.block_size == 128 and cap.blocks == 4096
    assert cap.log_line("CPU") == ("CPU KV cache size: 524,288 tokens, "
                                   "Maximum concurrency for 512 tokens per request: 1024.00x")


def test_tokens_reported_are_concurrency_times_length_not_blocks_times_block_size():
    cap = m.embedded_kv_capacity(2, TINY, max_model_len=500)
    assert cap.blocks == 8192 and cap.max_concurrency == 2048.0
    assert cap.tokens == 1_024_000 != cap.blocks * cap.block_size  # ceil(500 / 128) = 4 blocks per request


def test_gpu_kv_capacity_reproduces_the_h100_log():
    # Llama 3.1 8B on one H100 logged 28,123 blocks: "GPU KV cache size: 449,968 tokens, ... 54.93x"
    budget = 28_123 * 16 * 131_072 + 100_000  # any budget short of one more block
    cap = m.kv_capacity(budget, 131_072, 16, 8192)
    assert cap.log_line() == ("GPU KV cache size: 449,968 tokens, "
                              "Maximum concurrency for 8,192 tokens per request: 54.93x")
    assert m.kv_tokens(budget, 131_072) == 449_968
    assert m.max_concurrency(budget, 131_072, 8192) == cap.max_concurrency
    # vLLM's budget from its own log figures: 0.9 x 79.18 GiB - 15.0 - 1.1 - 0.22 GiB
    est = m.kv_budget(m.GPUS["H100-80"].memory_bytes, m._gib(15.0), m._gib(1.1), m._gib(0.22))
    assert abs(est / m.GiB - 54.94) < 0.01


def test_kv_log_is_parsed():
    log = ("INFO 11-22 [kv_cache_utils.py:1] CPU KV cache size: 524,288 tokens, Maximum concurrency for 512 "
           "tokens per request: 1024.00x\n")
    assert m.parse_kv_log(log) == {"device": "CPU", "tokens": 524_288, "max_model_len": 512,
                                   "max_concurrency": 1024.0, "line": log.split("] ")[1].strip()}
    with pytest.raises(ValueError, match="KV cache size"):
        m.parse_kv_log("INFO Loading weights took 0.1 s")


def test_fractional_cpu_kv_space_is_refused_because_vllm_parses_an_int():
    with pytest.raises(ValueError, match="whole number of GiB"):
        m.embedded_kv_capacity(0.25, TINY)


# --- parallelism --------------------------------------------------------------------------------------

def test_pp_partition_matches_vllm():
    assert m.pp_partition(126, 2) == [63, 63]
    assert m.pp_partition(80, 3) == [27, 27, 26]
    assert m.pp_partition(10, 4) == [2, 3, 3, 2]
    with pytest.raises(m.PlanError):
        m.pp_partition(4, 5)


def test_tp_must_divide_heads_and_kv_heads_sensibly():
    assert m.valid_tp_sizes("llama3.1-405b", 16) == [1, 2, 4, 8, 16]
    assert m.valid_tp_sizes(TINY, 8) == [1, 2, 4, 8]  # 2 KV heads: replicated at TP 4 and 8
    with pytest.raises(m.PlanError, match="attention heads"):
        m.check_tp("llama3.1-8b", 3)
    assert m.kv_bytes_per_token("llama3.1-405b", tp=16) == 126 * 2 * 1 * 128 * 2  # one KV head per GPU


def test_weight_shares_add_up():
    total = m.weight_bytes("llama3.1-70b")
    assert m.weight_bytes_per_gpu("llama3.1-70b") == [total]
    assert sum(m.weight_bytes_per_gpu("llama3.1-70b", pp=2)) == total
    tp4 = m.weight_bytes_per_gpu("llama3.1-70b", tp=4)[0]
    norms = m.param_breakdown("llama3.1-70b")["norm"] * 2
    assert tp4 == (total - norms) // 4 + norms  # norms are replicated on every GPU
    tiny_pp2 = m.weight_bytes_per_gpu(TINY, pp=2)
    assert sum(tiny_pp2) == m.weight_bytes(TINY) + 4096 * 256 * 4  # the tied head is copied to the last stage


def test_gpus_needed_is_memory_over_usable_memory():
    assert m.gpus_needed("llama3.1-405b", "fp16").weights_whole == 12  # 11.07 H100s' worth
    assert m.gpus_needed("llama3.1-405b", "fp16", overhead_gib=2).weights_whole == 11  # the allowance matters
    assert m.gpus_needed("llama3.1-405b", "fp16", gpu_name="A100-40").weights_whole == 24
    count = m.gpus_needed("llama3.1-8b", tokens=131_072, concurrency=4)
    assert count.total > count.weights and count.total_whole == 2


@pytest.mark.parametrize("model,kw,layout", [
    ("llama3.1-8b", {}, (1, 1)),
    ("llama3.1-70b", {}, (4, 1)),                    # the 70B SLURM job: one node, TP=4
    ("llama3.1-405b", {}, (8, 2)),                   # the 405B SLURM job: two nodes, TP=8 x PP=2
    ("llama3.1-405b-fp8", {}, (8, 1)),               # vLLM's blog: FP8 405B on one 8 x H100 node
    ("llama3.1-405b-fp8", {"gpu_name": "A100-40", "context": 8192, "utilization": 0.95}, (8, 2)),  # blog 000
    ("llama3.1-405b", {"gpu_name": "H200-141"}, (8, 1)),
])
def test_planner_finds_the_layouts_people_run(model, kw, layout):
    p = m.plan(model, **kw)
    assert (p.tp, p.pp) == layout
    assert p.kv_tokens >= p.context and p.max_concurrency >= 1
    assert f"--tensor-parallel-size {p.tp}" in p.command and f"--max-model-len {p.context}" in p.command
    assert ("--pipeline-parallel-size" in p.command) == (p.pp > 1)


def test_plan_command_flags():
    assert "--kv-cache-dtype fp8" in m.plan("llama3.1-8b", kv_dtype="fp8").command
    assert "--quantization fp8" in m.plan("llama3.1-70b", dtype="fp8").command
    assert "--dtype float32" in m.plan(TINY, gpu_name="custom:4", gpus_per_node=1).command
    p = m.plan("llama3.1-8b", dtype="int4")
    assert any("pre-quantized" in n for n in p.notes)
    assert m.serve_command(TINY)[0].startswith("vllm serve config --dtype float32")  # a dict has no path
    assert m.serve_command(TINY, model_id="/models/tiny")[0].startswith("vllm serve /models/tiny ")


def test_plan_reports_kv_tokens_as_vllm_would():
    p = m.plan("llama3.1-8b", context=8192)
    budget = p.kv_budget_bytes_per_gpu
    assert p.kv_tokens == m.kv_tokens(budget, 131_072, 16, 8192)


def test_impossible_plan_says_what_to_change():
    with pytest.raises(m.PlanError, match="does not fit"):
        m.plan("llama3.1-405b", gpu_name="A100-40", gpus_per_node=1, max_nodes=4)
    with pytest.raises(m.PlanError, match="leaves nothing"):
        m.plan(TINY, gpu_name="custom:1")


# --- one layout: layout_fit ---------------------------------------------------------------------------

def test_layout_fit_of_the_405b_job_is_vllms_block_arithmetic():
    f = m.layout_fit("llama3.1-405b", 8, 2, "H100-80")
    assert f.fits and f.why == "" and (f.tp, f.pp, f.gpu, f.context) == (8, 2, "H100-80", 131_072)
    assert f.weight_bytes_per_gpu == max(m.weight_bytes_per_gpu("llama3.1-405b", tp=8, pp=2))
    assert f.kv_bytes_per_token_per_gpu == m.kv_bytes_per_token("llama3.1-405b", tp=8, layers=63)
    assert f.kv_blocks == m.kv_blocks(f.kv_budget_bytes_per_gpu, f.kv_bytes_per_token_per_gpu)
    assert f.kv_tokens == m.kv_tokens(f.kv_budget_bytes_per_gpu, f.kv_bytes_per_token_per_gpu, 16, 131_072)
    assert f.max_concurrency == pytest.approx(5.336, abs=1e-3) and f.as_dict()["fits"] is True


def test_layout_fit_says_why_with_the_numbers():
    weights = m.layout_fit("llama3.1-405b", 4, 1, "A100-40")
    assert not weights.fits and weights.max_concurrency == 0 and weights.kv_tokens == 0
    assert ("llama3.1-405b in bfloat16 as TP=4 x PP=1 on A100-40: the weights take 189.0 GiB per GPU, more than "
            "the 32.6 GiB vLLM may use there (0.9 x 39.59 GiB minus 3 GiB for activations).") == weights.why
    kv = m.layout_fit("llama3.1-405b", 4, 3, "H100-80")  # the weights fit; one 128k request does not
    assert not kv.fits and kv.worst_stage == 2
    assert "63.3 GiB of the 68.3 GiB per GPU of pipeline stage 2" in kv.why
    assert "room for 123,248 tokens (7,703 blocks of 16 at 43,008 bytes per token): 0.94" in kv.why
    assert kv.why.endswith("less than one 131,072-token request.")
    many = m.layout_fit("llama3.1-405b", 8, 2, concurrency=6)
    assert not many.fits and "5.34 full-length requests, less than the 6 requests of 131,072 tokens" in many.why
    assert "vLLM may use nothing per GPU" in m.layout_fit(TINY, gpu_name="custom:1").why


def test_layout_fit_counts_a_sliding_window_as_vllm_reserves_it():
    """A 4,096-token window on every layer: vLLM reserves the window - 1 plus two 8,192-token steps in flight,
    in 16-token blocks, plus one block for the window's ragged start: 1,281 blocks, not 32,768 / 16 = 2,048."""
    f = m.layout_fit("mistral-7b", 1, 1, "custom:24", context=32_768, concurrency=40)
    assert m.kv_tokens_held("mistral-7b", 32_768) == 4096
    assert f.max_concurrency == f.kv_blocks / (-(-(4095 + 16_384) // 16) + 1) == f.kv_blocks / 1281
    assert not f.fits and "(32 of its 32 layers keep a 4,096-token window" in f.why


@pytest.mark.parametrize("model,kw", [
    ("llama3.1-70b", {"context": 8192}),
    ("llama3.1-70b", {}),
    ("llama3.1-405b", {}),
    ("llama3.1-405b-fp8", {"gpu_name": "A100-40", "context": 8192, "utilization": 0.95}),
    ("llama3.1-8b", {"context": 131_072, "concurrency": 9, "kv_dtype": "fp8"}),
])
def test_plan_is_the_first_layout_that_layout_fit_accepts(model, kw):
    p = m.plan(model, **kw)
    fit_kw = {k: v for k, v in kw.items() if k != "gpu_name"}
    for pp in range(1, p.pp + 1):
        for tp in m.valid_tp_sizes(model, 8):
            f = m.layout_fit(model, tp, pp, kw.get("gpu_name", "H100-80"), **fit_kw)
            if (pp, tp) < (p.pp, p.tp):
                assert not f.fits and f.why, (tp, pp)
            elif (pp, tp) == (p.pp, p.tp):
                assert f.fits
                assert (f.weight_bytes_per_gpu, f.kv_budget_bytes_per_gpu, f.kv_bytes_per_token_per_gpu, f.kv_blocks,
                        f.kv_tokens, f.max_concurrency) == (p.weight_bytes_per_gpu, p.kv_budget_bytes_per_gpu,
                                                            p.kv_bytes_per_token_per_gpu, p.kv_blocks, p.kv_tokens,
                                                            p.max_concurrency)


def test_launch_and_the_planner_share_layout_fit():
    from llmlab import cluster

    for name, job in cluster.load_settings().items():
        if job.engine != "gpu":
            continue
        report = cluster.layout_report(job)
        f = m.layout_fit(job.model, job.tp, job.pp, job.gpu, dtype=job.dtype, kv_dtype=job.kv_dtype,
                         context=job.context, utilization=job.gpu_memory_utilization)
        assert (report["fits"], report["why"], report["kv_tokens"]) == (f.fits, f.why, f.kv_tokens), name


@pytest.mark.parametrize("args,kw,message", [
    ((0, 1), {}, "tensor parallel size must be a whole number >= 1, got 0"),
    ((1.5, 1), {}, "got 1.5"),
    ((True, 1), {}, "got True"),
    ((1, -2), {}, "pipeline parallel size must be a whole number >= 1, got -2"),
    ((1, 200), {}, "between 1 and the 80 layers"),
    ((3, 1), {}, "64 attention heads do not divide into 3"),
    ((1, 1), {"context": 0}, "context must be a whole number >= 1"),
    ((1, 1), {"concurrency": 0}, "concurrency must be a whole number >= 1"),
    ((1, 1), {"utilization": 1.5}, "gpu_memory_utilization must be in"),
])
def test_layout_fit_refuses_bad_input(args, kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        m.layout_fit("llama3.1-70b", *args, **kw)


def test_layout_fit_refuses_an_unknown_gpu():
    with pytest.raises(m.UnknownName, match="Unknown GPU 'B300'"):
        m.layout_fit("llama3.1-70b", 4, 1, "B300")


# --- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,message", [
    ({"hidden_size": None}, "no 'hidden_size' field"),
    ({"num_hidden_layers": "32"}, "'num_hidden_layers' should be a positive integer"),
    ({"vocab_size": 0}, "'vocab_size' should be a positive integer"),
    ({"intermediate_size": True}, "'intermediate_size' should be a positive integer"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported"),
    ({"architectures": "LlamaForCausalLM"}, "should be a list"),
    ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' should be true or false"),
    ({"hidden_size": 4100}, "not divisible by num_attention_heads"),
    ({"torch_dtype": "complex64"}, "torch_dtype 'complex64'"),
    ({"torch_dtype": "int8"}, "should be a float type"),
])
def test_malformed_configs_name_the_field(change, message):
    cfg = {k: v for k, v in llama(**change).items() if v is not None}
    with pytest.raises(m.ConfigError, match=message):
        m.model_spec(cfg)


def test_unsupported_model_without_architectures():
    with pytest.raises(m.ConfigError, match="model_type"):
        m.model_spec({"model_type": "gpt2", "n_embd": 768})


def test_mixtral_needs_its_expert_fields():
    cfg = json.loads(m.config_path("mixtral-8x7b").read_text())
    del cfg["num_local_experts"]
    with pytest.raises(m.ConfigError, match="num_local_experts"):
        m.model_spec(cfg)


def test_missing_dtype_is_an_error_only_when_the_checkpoint_bytes_are_asked_for():
    cfg = {k: v for k, v in llama().items() if k != "torch_dtype"}
    assert m.param_count(cfg) == PUBLISHED_PARAMS["llama3.1-8b"]
    assert m.weight_bytes(cfg, "bf16") == 2 * PUBLISHED_PARAMS["llama3.1-8b"]
    with pytest.raises(m.ConfigError, match="no torch_dtype"):
        m.weight_bytes(cfg)


def test_unmodelled_quantization_is_refused_for_checkpoint_bytes():
    cfg = llama(quantization_config={"quant_method": "awq", "bits": 4})
    assert m.param_count(cfg) == PUBLISHED_PARAMS["llama3.1-8b"]
    with pytest.raises(m.ConfigError, match="'awq' is not modelled"):
        m.weight_bytes(cfg)
    assert m.weight_bytes(cfg, "int4") == PUBLISHED_PARAMS["llama3.1-8b"] // 2


def test_bad_files_and_names(tmp_path):
    with pytest.raises(m.UnknownName, match="neither a shipped model"):
        m.model_spec("llama9-1t")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(m.ConfigError, match="not valid JSON"):
        m.model_spec(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(m.ConfigError, match="not an object"):
        m.model_spec(tmp_path)
    with pytest.raises(m.ConfigError, match="shipped name"):
        m.model_spec(42)


def test_dtype_and_gpu_names():
    assert m.normalize_dtype("BF16") == "bfloat16" and m.bytes_per_param("int4") == 0.5
    with pytest.raises(m.UnknownName, match="Unknown dtype 'fp6'"):
        m.weight_bytes("llama3.1-8b", "fp6")
    with pytest.raises(m.UnknownName, match="Unknown KV cache dtype"):
        m.kv_bytes_per_token("llama3.1-8b", kv_dtype="int4")
    assert m.gpu("h100").name == "H100-80" and m.gpu("A100-40GB").name == "A100-40"
    assert m.gpu("custom:48").memory_bytes == 48 * m.GiB == m.gpu(48).memory_bytes == m.gpu("48").memory_bytes
    with pytest.raises(m.UnknownName, match="Unknown GPU"):
        m.gpu("X100")
    with pytest.raises(m.UnknownName, match="custom:<GiB>"):
        m.gpu("custom:lots")


# --- the CLI ------------------------------------------------------------------------------------------

def test_cli_memory_json_has_the_grader_keys(capsys):
    assert main(["memory", "llama3.1-405b", "--dtype", "fp16", "--tokens", "128000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == PUBLISHED_PARAMS["llama3.1-405b"]
    assert out["weight_bytes"] == 2 * out["params"]
    assert out["kv_bytes_per_token"] == 516_096
    assert out["kv_cache_bytes"] == 516_096 * 128_000
    assert out["gpus_needed"] == 12 and out["plan"]["tp"] == 8 and out["plan"]["pp"] == 2


def test_cli_memory_text_and_errors(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    assert main(["memory", str(tmp_path / "config.json"), "--gpu", "custom:4", "--gpus-per-node", "1"]) == 0
    assert "3,672,320" in capsys.readouterr().out
    assert main(["memory", "llama3.1-8b", "--kv-dtype", "int4"]) == 2
    assert "Unknown KV cache dtype" in capsys.readouterr().err


# --- every family: transformers referees the parameters, the engine referees the KV cache ------------

FAMILIES = Path(__file__).parents[1] / "fixtures" / "families"  # small random models, one config per architecture


@pytest.mark.parametrize("name", [*m.shipped_models(), *sorted(p.name for p in FAMILIES.glob("*.json"))])
def test_parameter_formulas_equal_transformers_meta_device_count(name):
    """Every shipped config and every family fixture: llmlab's per-tensor sum is transformers' own count."""
    model = FAMILIES / name if name.endswith(".json") else name
    assert m.param_count(model) == m.transformers_param_count(model)


def test_qwen3_reads_its_own_head_dim_and_counts_qk_norms():
    spec = m.model_spec("qwen3-30b-a3b")
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_heads  # 2048 / 32 = 64: the config's field wins
    assert m.kv_bytes_per_token("qwen3-30b-a3b") == 48 * 2 * 4 * 128 * 2
    no_head_dim = {k: v for k, v in json.loads(m.config_path("qwen3-8b").read_text()).items() if k != "head_dim"}
    assert m.model_spec(no_head_dim).head_dim == 128  # Qwen3Config's default, applied visibly
    assert any("head_dim=128" in d for d in m.model_spec(no_head_dim).defaults_applied)


def test_qwen3_moe_active_parameters_and_dense_layers():
    assert m.active_params("qwen3-30b-a3b") == 3_353_032_704  # 8 of 128 experts: "3.3B activated"
    spec = m.model_spec(FAMILIES / "qwen3_moe.json")  # decoder_sparse_step 2 and mlp_only_layers [3]
    assert sorted(spec.dense_layers) == [0, 2, 3] and spec.is_moe_layer(1)
    bad = {**json.loads((FAMILIES / "qwen3_moe.json").read_text()), "mlp_only_layers": [9]}
    with pytest.raises(m.ConfigError, match="mlp_only_layers should be a list of layer numbers below 4"):
        m.model_spec(bad)
    with pytest.raises(m.PlanError, match="MLP width 128 does not divide by TP=3"):
        m.check_tp({**bad, "mlp_only_layers": [], "num_attention_heads": 6, "num_key_value_heads": 3}, 3)


def test_deepseek_v3_latent_attention_and_experts():
    """671B in all, 37B active; the KV cache holds one 576-value latent per token and layer, on every GPU."""
    assert m.param_count("deepseek-v3") == 671_026_404_352  # transformers' count: the MTP layer is not the model's
    assert m.active_params("deepseek-v3") == 37_552_282_624  # 8 of 256 routed experts + the shared one: "37B"
    assert m.kv_bytes_per_token("deepseek-v3") == 61 * (512 + 64) * 2 == 70_272
    assert m.kv_bytes_per_token("deepseek-v3", tp=8) == 70_272  # not divided: each GPU keeps the whole latent
    assert m.kv_bytes_per_token("deepseek-v3", "fp8") == 35_136
    assert m.kv_bytes_per_token("llama3.1-405b") == 516_096  # 7.3x more per token than DeepSeek-V3's


def test_kimi_k2_is_deepseek_v3_with_more_experts_and_fewer_heads():
    """Kimi K2 ships DeepSeek-V3's code under its own model_type: 384 experts instead of 256, 64 heads instead of
    128, one dense layer instead of three.  Its latent is DeepSeek's, so its KV cache per token is too."""
    assert m.model_spec("kimi-k2").is_mla and m.model_spec("kimi-k2").num_experts == 384
    assert m.active_params("kimi-k2") == 32_861_477_888  # "32B activated"
    assert m.kv_bytes_per_token("kimi-k2") == m.kv_bytes_per_token("deepseek-v3") == 70_272
    assert m.serve_command("kimi-k2", tp=8, pp=2)[0].startswith("vllm serve moonshotai/Kimi-K2-Instruct ")


def test_deepseek_v3_fp8_checkpoint_stores_one_scale_per_128_x_128_block():
    b = m.param_breakdown("deepseek-v3")
    fp8 = b["attention"] + b["mlp"] + b["experts"]  # every projection matrix; norms, router, embeddings stay bf16
    bf16 = b["embedding"] + b["lm_head"] + b["router"] + b["norm"]
    # scale blocks by hand: attention q_a 12x56 + q_b 192x12 + kv_a 5x56 + kv_b 256x4 + o 56x128 = 11,448;
    # a dense MLP 3 x 144x56 = 24,192; an MoE layer's 256 routed + 1 shared experts 257 x 3 x 16x56 = 690,816
    blocks = 3 * (11_448 + 24_192) + 58 * (11_448 + 690_816)
    assert m.weight_bytes("deepseek-v3") == fp8 + 2 * bf16 + 4 * blocks == 673_150_552_416


def test_gpt_oss_mxfp4_experts_and_openai_s_published_figures():
    """OpenAI: 116.83B and 20.91B parameters, 5.13B and 3.61B active (the embedding table not counted: a lookup,
    no compute), checkpoints of 60.8 GiB and 12.8 GiB (experts in MXFP4: 4 bits + one 8-bit scale per 32)."""
    for name, active, gib in (("gpt-oss-120b", 5_132_849_472, 60.8), ("gpt-oss-20b", 3_608_307_264, 12.8)):
        assert m.active_params(name) - m.param_breakdown(name)["embedding"] == active
        assert round(m.weight_bytes(name) / m.GiB, 1) == gib
    experts = m.param_breakdown("gpt-oss-20b")["experts"]
    biases = 24 * 32 * (2 * 2880 + 2880)  # per expert: gate and up biases of the MLP width, down's of the hidden
    assert m.weight_bytes("gpt-oss-20b", "bfloat16") - m.weight_bytes("gpt-oss-20b") == \
        (experts - biases) * 2 - (experts - biases) * 17 // 32  # 16 bits against 4.25 per expert weight


def test_sliding_window_layers_and_vllm_s_kv_cache_groups():
    gemma3 = m.model_spec("gemma3-1b")  # sliding_window_pattern 6: every sixth layer attends to everything
    assert sorted(set(range(26)) - gemma3.sliding_layers) == [5, 11, 17, 23]
    assert m.kv_groups("gemma3-1b") == (("full", 4),) + (("sliding", 4),) * 6  # 22 sliding: 6 groups, one padded
    assert m.kv_groups("gpt-oss-20b") == (("full", 12), ("sliding", 12))
    assert m.kv_groups("llama3.1-8b") == (("full", 32),) and m.kv_groups("mistral-7b") == (("sliding", 32),)
    uneven = {**json.loads((FAMILIES / "gpt_oss.json").read_text()), "num_hidden_layers": 7,
              "layer_types": ["sliding_attention", "full_attention"] * 3 + ["full_attention"]}
    assert m.kv_groups(uneven) == (("full", 4), ("sliding", 4))  # 4 full < 1.5 x 3 sliding: pad the sliding group
    uneven = {**uneven, "num_hidden_layers": 5, "layer_types": uneven["layer_types"][2:]}
    assert m.kv_groups(uneven) == (("full", 2), ("full", 2), ("sliding", 2))  # 3 full = 1.5 x 2: groups of 2
    with pytest.raises(m.ConfigError, match="layer_types should list 'sliding_attention' or 'full_attention'"):
        m.model_spec({**uneven, "layer_types": ["sliding_attention"] * 4})


def test_a_window_saves_blocks_only_beyond_the_window_plus_the_steps_in_flight():
    # gpt-oss-120b at 131,072 tokens: 18 full layers take 8,192 blocks per request, the 18 sliding ones
    # ceil((127 + 16,384) / 16) + 1 = 1,033: 9,225 in all, where full attention everywhere would take 16,384
    assert m.kv_layout("gpt-oss-120b", 131_072).blocks_per_request == 8192 + 1033
    # Gemma 2 at its 8,192-token context: window + in-flight exceed the context, so the window saves nothing
    assert m.kv_layout("gemma2-9b", 8192).blocks_per_request == 512 + 513
    assert m.kv_cache_bytes("gemma2-9b", 8192) == (21 * 8192 + 21 * 4096) * 2 * 8 * 256 * 4  # what the tokens fill
    assert m.kv_cache_bytes("gpt-oss-20b", 100_000) == (12 * 100_000 + 12 * 128) * 2 * 8 * 64 * 2


def test_expert_parallelism_deals_whole_experts_out():
    """--enable-expert-parallel: each GPU holds ceil(experts / TP) whole experts instead of a slice of each."""
    odd = {**json.loads(m.config_path("qwen3-30b-a3b").read_text()), "moe_intermediate_size": 770}
    assert m.valid_tp_sizes(odd, 8) == [1, 2] and m.valid_tp_sizes(odd, 8, expert_parallel=True) == [1, 2, 4, 8]
    spec = m.model_spec("qwen3-30b-a3b")
    one_expert = 3 * 768 * 2048 * 2  # bf16 bytes
    sliced, whole = (m.weight_bytes_per_gpu("qwen3-30b-a3b", tp=8, expert_parallel=ep)[0] for ep in (False, True))
    assert sliced == whole  # 128 experts over 8 GPUs: 16 whole ones or 1/8 of each, the same bytes
    hundred = {**odd, "moe_intermediate_size": 768, "num_experts": 100}  # 100 experts over 8 GPUs: 13 on the first
    sliced, whole = (m.weight_bytes_per_gpu(hundred, tp=8, expert_parallel=ep)[0] for ep in (False, True))
    assert whole - sliced == spec.num_layers * (13 - 12.5) * one_expert
    p = m.plan("qwen3-30b-a3b", gpu_name="A100-40", expert_parallel=True, context=40_960)
    assert "--enable-expert-parallel" in p.command and p.tp == 2
    with pytest.raises(m.PlanError, match="llama3.1-8b has no experts"):
        m.plan("llama3.1-8b", expert_parallel=True)
    with pytest.raises(m.PlanError, match="slices of 64, not whole 128-row blocks of its FP8 scales"):
        m.check_tp("deepseek-v3", 32)


def test_llama4_interleaves_experts_and_caches_chunked_attention_in_full():
    """Scout: 16 experts in every layer; Maverick: 128 in every other one; both 17B active (one routed expert
    and the shared one).  Their chunked local attention is cached like full attention, as vLLM does by default."""
    assert round(m.active_params("llama4-scout") / 1e9, 1) == round(m.active_params("llama4-maverick") / 1e9, 1) == 17.2
    maverick = m.model_spec("llama4-maverick")
    assert sorted(maverick.dense_layers) == list(range(0, 48, 2)) and maverick.intermediate_size == 16384
    assert m.kv_bytes_per_token("llama4-scout") == 48 * 2 * 8 * 128 * 2
    assert m.kv_groups("llama4-scout") == (("full", 48),)
    assert any("vision tower" in d for d in maverick.defaults_applied)
    assert any("chunked local attention" in d for d in maverick.defaults_applied)
    no_text = {"architectures": ["Llama4ForConditionalGeneration"], "vision_config": {}}
    with pytest.raises(m.ConfigError, match="keeps its language model in 'text_config'"):
        m.model_spec(no_text)


def test_an_architecture_transformers_does_not_know_is_one_sentence():
    with pytest.raises(m.ConfigError, match="does not know model_type 'no-such-model'"):
        m.transformers_param_count({"model_type": "no-such-model", "hidden_size": 8})
    with pytest.raises(m.ConfigError, match="has no 'model_type'"):
        m.transformers_param_count({"hidden_size": 8})


# The real vLLM CPU engine served a random model of each family (tests/*/test_vllm_versions.py, make test-versions,
# which rewrites these logs with LLMLAB_UPDATE_FIXTURES=1); its start-up log is committed, one per family and KV dtype.
FAMILY_LOGS = FAMILIES / "logs"
LOGGED = sorted(p.stem.rsplit("-", 1) for p in FAMILY_LOGS.glob("*.log"))


def test_a_second_budget_and_an_odd_context_are_what_the_engine_logged():
    """2 GiB of KV and a context (500) that is not a multiple of the 128-token block, as the real engine logged it
    (tests/engine/test_memory.py starts it in make test-versions)."""
    logged = m.parse_kv_log((FAMILIES.parent / "kv" / "llmlab-tiny-2gib-500.log").read_text(errors="replace"))
    predicted = m.embedded_kv_capacity(2, "llmlab-tiny", max_model_len=500)
    assert logged["line"] == predicted.log_line("CPU") and logged["tokens"] == 1_024_000


def test_every_family_and_the_fp8_cases_have_a_committed_engine_log():
    families = {p.stem for p in FAMILIES.glob("*.json")}
    assert {f for f, kv in LOGGED if kv == "auto"} == families
    assert {f for f, kv in LOGGED if kv == "fp8"} == {"qwen3", "deepseek_v2", "gpt_oss"}  # grouped, latent, windowed


@pytest.mark.parametrize("family,kv_dtype", LOGGED)
def test_the_kv_cache_vllm_logged_for_each_family_is_what_llmlab_predicts(family, kv_dtype):
    """vLLM's own KV line for a random model of each family (1 GiB of KV space), to the token."""
    log = (FAMILY_LOGS / f"{family}-{kv_dtype}.log").read_text(errors="replace")
    logged = m.parse_kv_log(log)
    assert logged["line"] == m.embedded_kv_capacity(1, FAMILIES / f"{family}.json", kv_dtype=kv_dtype).log_line("CPU")


def test_a_wrong_prediction_against_a_committed_log_is_caught():
    log = (FAMILY_LOGS / "qwen3-auto.log").read_text(errors="replace")
    logged = m.parse_kv_log(log)["line"]
    assert logged == m.embedded_kv_capacity(1, FAMILIES / "qwen3.json").log_line("CPU")
    assert logged != m.embedded_kv_capacity(1, FAMILIES / "qwen3.json", kv_dtype="fp8").log_line("CPU")


def test_cli_memory_plans_expert_parallel_and_refuses_it_for_a_dense_model(capsys):
    assert main(["memory", "qwen3-30b-a3b", "--gpu", "A100-40", "--tokens", "40960", "--expert-parallel"]) == 0
    out = capsys.readouterr().out
    assert "--enable-expert-parallel" in out and "3,353,032,704 active per token" in out
    assert main(["memory", "llama3.1-8b", "--expert-parallel"]) == 2
    assert "has no experts" in capsys.readouterr().err


def test_an_architecture_without_formulas_gets_transformers_count_and_nothing_guessed(tmp_path, capsys):
    """Phi-3-mini: transformers counts its 3.8B parameters; llmlab, with no formulas for it, computes nothing else."""
    phi3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    with pytest.raises(m.UnsupportedArchitecture, match="'Phi3ForCausalLM' is not supported"):
        m.model_spec(phi3)
    report = m.memory_report(phi3)
    assert report == {"model": "config", "supported": False, "why": report["why"], "params": 3_821_079_552}
    (tmp_path / "config.json").write_text(json.dumps(phi3))
    assert main(["memory", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "3,821,079,552 (transformers' count" in out and "does not guess its KV cache" in out
    assert main(["memory", str(tmp_path / "config.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["supported"] is False


def test_the_calculators_picture_adds_up_to_the_card():
    """Notebook 01's bar: the parts of the plan's fullest GPU sum to the card, the weights are the plan's share,
    the KV the requests fill never exceeds what is left; a model that fits nowhere is drawn against one card."""
    import matplotlib

    matplotlib.use("Agg")
    r = m.memory_report("llama3.1-70b", None, "auto", 8192, 4, "H100-80", 8)
    parts = m.gpu_parts(r)
    assert sum(parts.values()) == r["gpu_memory_bytes"] and min(parts.values()) >= 0
    assert parts["weights"] == r["plan"]["weight_bytes_per_gpu"]
    assert parts["KV cache the requests fill"] == r["plan"]["kv_bytes_per_token_per_gpu"] * 8192 * 4
    ax = m.plot_gpu(r)
    assert ax.get_title() == "one of 4 x H100-80 (TP=4 x PP=1)" and len(ax.patches) == 5  # 4 x 8k: TP=2 is full
    huge = m.memory_report("llama3.1-405b", None, "auto", 131_072, 64, "H100-80", 1)
    assert huge["plan"] is None and m.plot_gpu(huge).get_title().startswith("does not fit: ")
