"""llmlab.disagg without an engine: the connector's flag, the tokens it moves, the bytes of a stored prompt, the
engine's histograms read as ranges, and the arithmetic of section 4 (KV bytes, prefill FLOPs, link times, the break-even
rate, a request's time to first token, the P:D ratio) against hand computations; the connectors it names against the
installed vLLM's registry and source.  Notebook 18 runs the two engines (the prefill, the decode, the counters by
source); tests/unit/test_disagg_checks.py tests its exercise checks."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from llmlab import disagg
from llmlab.serve.vllm import log_messages

KV_8B = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x KV heads x head size x bf16 bytes


def test_the_connector_flag_names_the_role_and_the_folder(tmp_path):
    flag, value = disagg.connector_args("kv_consumer", tmp_path)
    assert flag == "--kv-transfer-config"
    assert json.loads(value) == {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer",
                                 "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    with pytest.raises(ValueError, match="kv_producer, kv_consumer and kv_both"):
        disagg.connector_args("producer", tmp_path)


@pytest.mark.parametrize(("prompt", "kept"), [(1, 0), (129, 0), (130, 128), (134, 128), (257, 128), (258, 256)])
def test_whole_blocks_move_and_never_the_last_token(prompt, kept):
    # the connector's align_to_block_size(len(prompt) - 1): (len - 2) // 128 * 128
    assert disagg.kept_tokens(prompt) == kept


def test_a_stored_prompt_is_a_file_per_layer_of_its_tokens_kv(tmp_path):
    prompt = tmp_path / "5864a2706d192d0f8ef7d67ff6d9b683"
    prompt.mkdir()
    for layer in range(4):  # the tiny model's layout on the CPU build: (tokens, K and V, 2 heads x 32)
        save_file({"kv_cache": torch.zeros(128, 2, 64)}, prompt / f"model.layers.{layer}.self_attn.attn.safetensors")
    (tmp_path / "not-a-prompt.txt").write_text("ignored")
    files = disagg.stored(tmp_path)
    assert list(files["layer"]) == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert set(files["prompt"]) == {"5864a270"} and set(files["shape"]) == {(128, 2, 64)}
    assert (files["tokens"] == 128).all() and (files["dtype"] == "float32").all()
    assert files["kv_bytes"].sum() == disagg.kv_bytes("llmlab-tiny", 128) == 128 * 2048
    assert (files["file_bytes"] > files["kv_bytes"]).all()  # a safetensors header besides


def test_a_histograms_cumulative_counts_become_counts_per_range():
    cumulative = pd.Series({0.01: 296.0, 0.025: 297.0, 0.05: 297.0, 0.075: 298.0, float("inf"): 299.0})
    assert disagg._ranges(cumulative).to_dict() == {"0-10 ms": 296, "10-25 ms": 1, "25-50 ms": 0, "50-75 ms": 1,
                                                    "> 75 ms": 1}


def test_the_bytes_moved_are_the_prompts_kv_cache_and_each_gpu_moves_its_share():
    assert disagg.kv_bytes("llama3.1-8b", 4096) == KV_8B * 4096 == 536_870_912
    assert disagg.kv_bytes("llama3.1-8b", 4096, tp=8) == 536_870_912 // 8  # one of the 8 KV heads per GPU
    assert disagg.kv_bytes("llama3.1-8b", 4096, kv_dtype="fp8") == 536_870_912 // 2


def test_a_prefills_arithmetic_is_its_matrices_attention_and_one_output_head():
    vocab, hidden, layers, heads, head_dim = 128_256, 4096, 32, 32, 128
    matrices = 8_030_261_248 - 2 * vocab * hidden - (2 * layers + 1) * hidden  # no embedding, output head or norms
    for t in (1, 1000, 4096):
        want = 2 * matrices * t + 2 * layers * heads * head_dim * t**2 + 2 * vocab * hidden
        assert disagg.prefill_flops("llama3.1-8b", t) == pytest.approx(want, rel=1e-12)


def test_a_transfer_is_bytes_over_the_rate_and_breaks_even_with_the_prefill():
    table = disagg.transfer_table({"llama3.1-8b": 4096})
    row = table.loc[("llama3.1-8b", 4096)]
    assert row["KV MiB"] == 512
    assert row["InfiniBand NDR (one port) ms"] == pytest.approx(536_870_912 / 50e9 * 1000)
    assert row["Ethernet 100 Gb/s ms"] == pytest.approx(536_870_912 / 12.5e9 * 1000)
    assert disagg.MATMUL_FLOPS == 989e12  # the H100 datasheet's dense bf16, a spec: prefill times are lower bounds
    assert row["prefill ms (at best)"] == pytest.approx(disagg.prefill_flops("llama3.1-8b", 4096) / 989e12 * 1000)
    rate = disagg.break_even_bytes_per_s("llama3.1-8b", 4096)
    at_break_even = disagg.transfer_table({"llama3.1-8b": 4096}, links={"x": rate})
    assert at_break_even.iloc[0]["x ms"] == pytest.approx(at_break_even.iloc[0]["prefill ms (at best)"])
    # the 70B computes ~9x more per token for 2.5x the KV: it breaks even on a link ~4x slower
    assert 3.5 < rate / disagg.break_even_bytes_per_s("llama3.1-70b", 4096) < 4.0


def _vllm_source(relative: str) -> str:
    """A file of the installed vLLM, read as text (importing the connectors would start CUDA's and NIXL's imports)."""
    return (Path(importlib.util.find_spec("vllm").origin).parent / relative).read_text()


def test_the_connectors_the_lesson_names_are_vllms_and_nixl_moves_after_the_prefill():
    factory = _vllm_source("distributed/kv_transfer/kv_connector/factory.py")
    registered = set(re.findall(r'register_connector\(\s*"(\w+)"', factory))
    assert set(disagg.WHEN_MOVED) <= registered and "P2pNcclConnector" not in registered
    for name in ("NixlPullConnector", "NixlPushConnector", "OffloadingConnector", "MooncakeStoreConnector"):
        assert name in registered  # the lesson names them too
    nixl = _vllm_source("distributed/kv_transfer/kv_connector/v1/nixl/connector.py")
    assert "NixlConnector does not do layerwise saving." in nixl and "NixlConnector does not save explicitly." in nixl
    assert disagg.WHEN_MOVED["NixlConnector"] == disagg.WHEN_MOVED["MooncakeConnector"] == "after the prefill"
    example = _vllm_source("distributed/kv_transfer/kv_connector/v1/example_connector.py")
    assert "kv_role" not in example and "is_producer" not in example  # the demo connector never reads the role


def test_a_ttft_apart_adds_the_transfer_after_the_prefill_and_hides_it_layer_by_layer():
    rate, step = disagg.LINKS["Ethernet 100 Gb/s"], 0.007728
    serial = disagg.ttft_apart("llama3.1-8b", 4096, rate, step, queue_s=0.02)
    prefill = disagg.prefill_flops("llama3.1-8b", 4096) / 989e12
    assert serial["prefill"] == pytest.approx(prefill) and serial["transfer"] == pytest.approx(536_870_912 / 12.5e9)
    assert serial["total"] == pytest.approx(0.02 + prefill + 536_870_912 / 12.5e9 + step)
    fast = disagg.ttft_apart("llama3.1-8b", 4096, rate, step, layer_by_layer=True)
    assert fast["transfer"] == pytest.approx(serial["transfer"] / 32)  # the link keeps up: the last layer's share
    slow = disagg.ttft_apart("llama3.1-8b", 4096, disagg.LINKS["Ethernet 25 Gb/s"], step, layer_by_layer=True)
    assert slow["transfer"] == pytest.approx(536_870_912 / 3.125e9 - prefill * 31 / 32)  # it does not
    tp8 = disagg.ttft_apart("llama3.1-70b", 8192, 50e9, 0.0, tp=8)
    one = disagg.ttft_apart("llama3.1-70b", 8192, 50e9, 0.0)
    assert tp8["prefill"] == pytest.approx(one["prefill"] / 8) and tp8["transfer"] == pytest.approx(one["transfer"] / 8)


def test_the_pd_ratio_is_a_prefill_against_its_share_of_the_decode_steps():
    prefill = disagg.prefill_flops("llama3.1-8b", 4096) / 989e12
    assert disagg.pd_ratio("llama3.1-8b", 4096, 300, 0.007728, 64) == pytest.approx(prefill / (300 * 0.007728 / 64))
    assert 1.6 < disagg.pd_ratio("llama3.1-8b", 4096, 300, 0.007728, 64) < 1.8
    assert disagg.pd_ratio("llama3.1-8b", 1000, 300, 0.007728, 64) < 0.5  # short prompts: more decode GPUs


def test_log_messages_drop_colour_and_prefix_and_keep_one_source():
    log = ("\x1b[0;36m(EngineCore pid=31756)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m11-27 14:53:45\x1b[0m "
           "\x1b[90m[example_connector.py:292]\x1b[0m External Cache Hit!\n"
           "(Worker pid=31777) INFO 11-27 14:53:45 [example_connector.py:171] Inject KV cache of 128 tokens\n"
           "(APIServer pid=1) INFO 11-27 14:53:40 [api_server.py:1] Starting vLLM server\n"
           "$ python -m vllm.entrypoints.openai.api_server\n")
    assert log_messages(log, "example_connector.py") == [("EngineCore", "External Cache Hit!"),
                                                          ("Worker", "Inject KV cache of 128 tokens")]
    assert log_messages(log)[2:] == [("APIServer", "Starting vLLM server"),
                                     ("", "$ python -m vllm.entrypoints.openai.api_server")]
