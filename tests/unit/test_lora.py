"""LoRA adapters (notebook 17, ``llmlab.lora`` and ``llmlab.memory.lora``): the parameter and slot arithmetic
against the shipped adapters' own files and transformers' shapes, the adapter reader's sentences for folders vLLM
would refuse, the serve flags, the voices, and the merge against the training layer.

This file holds the pure tests (no engine); tests/engine/test_lora.py serves the adapters with the real engine.
"""

from __future__ import annotations

import json
import shutil

import pytest

from llmlab import lora, memory
from llmlab.memory import lora as mlora
from llmlab.serve.paths import TINY_MODEL


def test_adapter_parameters_are_rank_times_in_plus_out_of_each_adapted_matrix():
    # the tiny model, per layer: q 256x256, k and v 64x256, o 256x256, gate and up 640x256, down 256x640
    per_layer = 8 * ((256 + 256) * 2 + (256 + 64) * 2 + (256 + 640) * 3)
    assert mlora.lora_params("llmlab-tiny", 8) == 4 * per_layer == 139_264
    assert mlora.lora_params("llmlab-tiny", 8, mlora.ATTENTION) == 4 * 8 * ((256 + 256) * 2 + (256 + 64) * 2)
    assert mlora.lora_bytes("llmlab-tiny", 8) == 139_264 * 4  # served in float32
    # Llama 3.1 8B at rank 16 on every linear layer: the 41.9 M of published adapter tables, 80 MiB in bfloat16
    assert mlora.lora_params("llama3.1-8b", 16) == 41_943_040
    assert mlora.lora_bytes("llama3.1-8b", 16) == 80 * 2**20
    assert mlora.lora_slots_bytes("llama3.1-8b", 4, 16, mlora.ALL_LINEAR) == 4 * 80 * 2**20
    assert mlora.lora_share("llama3.1-70b", 16) < 0.003 < mlora.lora_share("llmlab-tiny", 8)


def test_the_shipped_adapters_files_hold_what_the_arithmetic_says():
    adapters = lora.shipped()
    assert set(adapters) == {"kjv", "rv1909"}
    for name, path in adapters.items():
        a = lora.read(path)
        assert (a.name, a.rank, a.alpha, a.scale) == (name, 8, 16, 2.0)
        assert a.params == mlora.lora_params(TINY_MODEL, a.rank, a.targets) == 139_264
        assert len(a.shapes) == 2 * 7 * 4  # A and B of 7 matrices in 4 layers
        assert a.training["val_loss"] < a.training["base_val_loss"]  # the adapter learnt its voice


def test_slots_count_the_embedding_and_the_lm_head_as_vllm_makes_them():
    """vLLM 0.32 gives a Llama its slots in the seven linear layers of each block and in embed_tokens and lm_head
    (``LlamaForCausalLM.embedding_modules``, added by ``get_supported_lora_modules`` in ``vllm/lora/utils.py``).
    Each slot of rank r: the embedding's A vocab x r and B hidden x r (``VocabParallelEmbeddingWithLoRA``), the LM
    head's A r x hidden and B vocab x r (``LogitsProcessorWithLoRA``), whole on every GPU.  The tiny model's figure
    was read off a real CPU engine (``--enable-lora --max-loras 2 --max-lora-rank 8`` in bfloat16: the
    ``lora_a_stacked``/``lora_b_stacked`` tensors of its modules add up to 835,584 bytes)."""
    vocab, hidden, linear = 128_256, 4_096, (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3
    embed_tokens = 64 * vocab + 64 * hidden    # A vocab x 64, B hidden x 64
    lm_head = 64 * hidden + 64 * vocab         # A 64 x hidden, B vocab x 64
    want = 4 * (32 * 64 * linear + embed_tokens + lm_head) * 2  # 4 slots of rank 64, bfloat16
    assert want == mlora.lora_slots_bytes("llama3.1-8b", 4, 64) == 1_477_705_728  # not 1,342,177,280
    assert 4 * (embed_tokens + lm_head) * 2 == 135_528_448
    assert mlora.lora_slots_bytes("llama3.1-8b", 4, 64, mlora.ALL_LINEAR) == 1_342_177_280  # --lora-target-modules
    assert mlora.lora_slots_bytes("llmlab-tiny", 2, 8) == 1_671_168  # float32, not 1,114,112
    assert mlora.lora_slots_bytes("llmlab-tiny", 2, 8, dtype="bfloat16") == 835_584  # what the engine allocated
    assert mlora.lora_slots_bytes("llmlab-tiny", 2, 8, mlora.VOCABULARY) == 2 * 2 * 8 * (4096 + 256) * 4


def test_max_lora_rank_takes_only_vllms_values():
    assert [mlora.allowed_rank(r) for r in (1, 2, 8, 12, 24, 300, 512)] == [1, 8, 8, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="rank 512 at most"):
        mlora.allowed_rank(513)
    with pytest.raises(ValueError, match="--max-lora-rank takes only 1, 8, 16"):
        mlora.lora_slots_bytes("llama3.1-8b", 4, 12)


@pytest.mark.parametrize("targets, says", [(("lm_head",), "lm_head"), ((), "(none)")])
def test_unknown_targets_are_named(targets, says):
    with pytest.raises(memory.ConfigError, match=r"LoRA targets .*" + says.replace("(", r"\(").replace(")", r"\)")):
        mlora.lora_params("llmlab-tiny", 8, targets)


def test_a_rank_below_one_is_refused_with_the_usual_ranks():
    with pytest.raises(ValueError, match="8 and 16 are common"):
        mlora.lora_params("llmlab-tiny", 0)
    with pytest.raises(ValueError, match="at least 1 adapter slot"):
        mlora.lora_slots_bytes("llmlab-tiny", 0, 8)


def _copy(tmp_path):
    src = lora.shipped()["kjv"]
    dst = tmp_path / "kjv"
    shutil.copytree(src, dst)
    return dst


def test_folders_vllm_would_refuse_are_said_before_an_engine_starts(tmp_path):
    with pytest.raises(lora.AdapterError, match="needs adapter_config.json and adapter_model.safetensors"):
        lora.read(tmp_path)
    adapter = _copy(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(lora.AdapterError, match="not valid JSON"):
        lora.read(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    with pytest.raises(lora.AdapterError, match='peft_type must be "LORA"'):
        lora.read(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    with pytest.raises(lora.AdapterError, match="not of rank r=16.*different adapters"):
        lora.read(adapter)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / "adapter_model.safetensors").write_bytes(b"half a file")
    with pytest.raises(lora.AdapterError, match="not a readable safetensors file.*save the adapter again"):
        lora.read(adapter)


def test_serve_args_name_each_adapter_and_the_largest_rank():
    args = lora.serve_args(max_loras=1)
    assert args[:2] == ["--enable-lora", "--lora-modules"]
    assert [a.split("=")[0] for a in args[2:4]] == ["kjv", "rv1909"]
    assert args[4:] == ["--max-loras", "1", "--max-lora-rank", "8"]
    with pytest.raises(lora.AdapterError, match="rank above max_rank=1.*max_rank=8"):
        lora.serve_args(max_rank=1)
    with pytest.raises(lora.AdapterError, match="takes only 1, 8, 16.*pass 16"):
        lora.serve_args(max_rank=12)
    with pytest.raises(lora.AdapterError, match="No adapter to serve"):
        lora.serve_args({})
    with pytest.raises(lora.AdapterError, match="at least 1 adapter slot"):
        lora.serve_args(max_loras=0)


def test_voice_counts_the_marker_words_of_each_voice():
    assert lora.voice("And he said unto them, Thou hast done this.") == pytest.approx(
        {"kjv": 3 / 9, "rv1909": 0.0, "words": 9})
    v = lora.voice("Y dijo Dios: Sea la luz: y fué la luz.")
    assert v["rv1909"] == pytest.approx(5 / 10) and v["kjv"] == 0.0
    assert lora.voice("") == {"kjv": 0.0, "rv1909": 0.0, "words": 0}


def test_merged_weights_compute_what_the_adapted_layers_compute(tmp_path):
    """The training layer (base + scale x B A x, ``llmlab.ops.tinylora``), saved in PEFT's format and merged into
    the base weights by :func:`llmlab.lora.merge`, gives the same logits: what an adapter is, and why an engine may
    apply it either way."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmlab.ops import tinylora

    gen = torch.Generator().manual_seed(0)
    adapted = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()
    layers = tinylora.add_adapters(adapted, gen)
    with torch.no_grad():
        for layer in layers.values():
            layer.lora_B.normal_(0, 0.05, generator=gen)  # B starts at zero in training: make the delta visible
    tinylora.save_adapter(layers, tmp_path / "a")
    x = torch.tensor([[0, 523, 17, 940, 12, 88]])
    merged = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        want, base = adapted(input_ids=x).logits, merged(input_ids=x).logits
        got = lora.merge(merged, tmp_path / "a")(input_ids=x).logits
    assert not torch.allclose(base, want, atol=1e-2)  # the adapter changes the answer
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_merge_refuses_an_adapter_of_another_model(tmp_path):
    import torch
    from safetensors.torch import save_file

    adapter = _copy(tmp_path)
    save_file({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": torch.zeros(8, 256),
               "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": torch.zeros(640, 8)},
              adapter / "adapter_model.safetensors")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    with pytest.raises(lora.AdapterError, match="adapts model.layers.9.mlp.up_proj.*another base model"):
        lora.merge(Tiny(), adapter)


def test_with_tensor_parallelism_each_gpu_holds_more_than_its_share_of_the_slots():
    one = mlora.lora_slots_bytes("llama3.1-70b", 8, 16)
    four = mlora.lora_slots_bytes("llama3.1-70b", 8, 16, tp=4)
    # per layer, rank 16: q, k, v, gate, up keep A whole and cut B; o and down cut A and keep B whole
    h, kv, inter = 8192, 1024, 28672
    whole_a = h * 5                              # the in-width of q, k, v, gate, up
    cut_b = (h + kv + kv + inter + inter) // 4
    cut_a, whole_b = (h + inter) // 4, h * 2      # o: in h, out h; down: in 28,672, out h
    vocabulary = 16 * 2 * (128_256 + h)          # the embedding's and the LM head's slots: whole on every GPU
    assert four == 8 * (16 * 80 * (whole_a + cut_b + cut_a + whole_b) + vocabulary) * 2
    assert one / 4 < four < one
    assert mlora.lora_slots_bytes("llama3.1-70b", 8, 16, tp=1) == one
    with pytest.raises(ValueError, match="whole number of GPUs"):
        mlora.lora_slots_bytes("llama3.1-70b", 8, 16, tp=0)
    assert memory.lora is mlora  # reachable as llmlab.memory.lora after `from llmlab import memory`


def test_slot_states_reads_each_state_of_vllms_lora_gauge_latest_last(monkeypatch):
    from llmlab.serve.metrics import parse_prometheus

    text = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="rv1909,kjv",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="kjv",waiting_lora_adapters="rv1909"} 1.6e9
vllm:num_requests_running 0
"""
    monkeypatch.setattr(lora, "fetch_metrics", lambda url, key: parse_prometheus(text))
    client = type("Client", (), {"base_url": "http://x/v1", "api_key": "k"})()
    assert lora.slot_states(client).to_dict("records") == [{"running": "kjv", "waiting": "rv1909", "max_lora": 2},
                                                           {"running": "kjv, rv1909", "waiting": "", "max_lora": 2}]
    monkeypatch.setattr(lora, "fetch_metrics", lambda url, key: parse_prometheus("vllm:num_requests_running 0\n"))
    assert lora.slot_states(client).empty  # a server started without --enable-lora
