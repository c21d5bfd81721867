"""The exercise checks of notebook 17 (``llmlab.check.lora``), each with the right answer and every wrong answer it
names: an adapter's parameters, the KV tokens adapter slots cost, and the engine steps of several adapters on fewer
slots.

Pure (no engine); tests/unit/test_lora.py tests the library itself and tests/engine/test_lora.py the engine.
"""

from __future__ import annotations

from check_helpers import not_yet, right

from llmlab import batching, check, memory
from llmlab.memory import lora as mlora


def test_adapter_params_70b(capsys):
    # 80 layers x 16 x (q 8192+8192, k 8192+1024, v 8192+1024, o 8192+8192)
    want = 80 * 16 * ((8192 + 8192) * 2 + (8192 + 1024) * 2)
    assert want == mlora.lora_params("llama3.1-70b", 16, mlora.ATTENTION) == 65_536_000
    assert "65,536,000 parameters, 0.093%" in right(capsys, check.adapter_params_70b, want)
    assert "131 MB" in right(capsys, check.adapter_params_70b, float(want))
    not_yet(check.adapter_params_70b, 80 * 16 * (8192 + 8192) * 4, hint="8 KV heads of 128")
    not_yet(check.adapter_params_70b, want // 2, hint="that is rank 8")
    not_yet(check.adapter_params_70b, mlora.lora_params("llama3.1-70b", 16), hint="adapts the MLP too")
    not_yet(check.adapter_params_70b, want // 80, hint="that is one layer; the model has 80")
    not_yet(check.adapter_params_70b, 80 * (8192 * 8192 * 2 + 8192 * 1024 * 2), hint="the attention's own weights")
    not_yet(check.adapter_params_70b, 80 * 16 * 8192 * 4, hint="the A matrices only")
    not_yet(check.adapter_params_70b, 80 * 16 * (8192 + 1024 + 1024 + 8192), hint="the B matrices only")
    not_yet(check.adapter_params_70b, 2 * want, hint="that is bytes in bfloat16")
    not_yet(check.adapter_params_70b, want + 1, hint="rank x (in + out) of q (8,192 -> 8,192)")
    not_yet(check.adapter_params_70b, want + 0.5, hint="whole number")
    not_yet(check.adapter_params_70b, "65536000", hint="should be a number")


def test_lora_slot_cost(capsys):
    # 4 slots x rank 64 x (per layer: q, k, v, o, gate, up, down's in + out) x 32 layers x 2 bytes
    per_layer = (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3
    want = 4 * 64 * per_layer * 32 * 2
    assert want == mlora.lora_slots_bytes("llama3.1-8b", 4, 64) == 1_342_177_280  # 1.25 GiB
    tokens = want // memory.kv_bytes_per_token("llama3.1-8b")
    assert tokens == want // (32 * 2 * 8 * 128 * 2) == 10_240
    out = right(capsys, check.lora_slot_cost, want, tokens)
    assert "1.25 GiB of slots, 10,240 tokens" in out and "2.3% of the 436,656 tokens one H100 holds" in out
    attention_rank8 = mlora.lora_slots_bytes("llama3.1-8b", 4, 8, mlora.ATTENTION)
    for gib in (1.25, want / 1e9, 1280, want / 1e6):
        not_yet(check.lora_slot_cost, gib, tokens, hint="in bytes, not GiB")
    not_yet(check.lora_slot_cost, attention_rank8, tokens, hint="sizes the slots by the adapters that will fill them")
    not_yet(check.lora_slot_cost, want // 8, tokens, hint="as large as --max-lora-rank (64)")
    not_yet(check.lora_slot_cost, mlora.lora_slots_bytes("llama3.1-8b", 4, 64, mlora.ATTENTION), tokens,
            hint="in every linear layer it can adapt")
    not_yet(check.lora_slot_cost, want // 4, tokens, hint="that is one slot")
    not_yet(check.lora_slot_cost, want // 2, tokens, hint="that counts parameters")
    not_yet(check.lora_slot_cost, want * 2, tokens, hint="that is float32")
    not_yet(check.lora_slot_cost, want + 2, tokens, hint="memory.lora.lora_slots_bytes adds them up")
    not_yet(check.lora_slot_cost, want, tokens // 16, hint="that is blocks of 16 tokens")
    not_yet(check.lora_slot_cost, want, tokens * 32, hint="divides by one layer's K and V")
    not_yet(check.lora_slot_cost, want, tokens * 2, hint="its keys and its values")
    not_yet(check.lora_slot_cost, want, tokens // 2, hint="bfloat16: 2 bytes a value, not 4")
    not_yet(check.lora_slot_cost, want, tokens + 1, hint="131,072 bytes one token's K and V take")
    not_yet(check.lora_slot_cost, want, 10_240.5, hint="whole number")
    not_yet(check.lora_slot_cost, True, tokens, hint="should be a number")


def test_adapter_steps(capsys):
    adapters, base = check.lora.EX3_ADAPTERS, check.lora.EX3_BASE
    # two slots: legal (120) and medical (200) start; at 120 kjv takes legal's slot (to 210), at 200 rv1909 takes
    # medical's (to 250); the base model's 150 runs beside them
    assert batching.continuous_steps([max(v) for v in adapters.values()], 2) == 250 > max(base)
    assert "250 steps with 2 slots; 460 with one, 200 with a slot for every adapter" in \
        right(capsys, check.adapter_steps, 250)
    not_yet(check.adapter_steps, 200, hint="runs all four adapters side by side")
    not_yet(check.adapter_steps, 230, hint="as if a slot were never idle")
    not_yet(check.adapter_steps, 200 + 90, hint="the next pair once both have ended")
    not_yet(check.adapter_steps, 120 + 200 + 90 + 50, hint="that is one slot")
    not_yet(check.adapter_steps, 580, hint="not one after another")
    not_yet(check.adapter_steps, 360, hint="take no slot")  # the base model's requests as a fifth adapter, last
    not_yet(check.adapter_steps, 320, hint="take no slot")  # ... or first
    not_yet(check.adapter_steps, batching.continuous_steps([m for v in adapters.values() for m in v], 2),
            hint="2 slots are not 2 places")
    not_yet(check.adapter_steps, 251, hint="batching.continuous_steps, with each adapter's longest request")
    not_yet(check.adapter_steps, 250.5, hint="whole number")


def test_the_named_wrong_answers_are_all_different():
    """A wrong answer that two mistakes share would get one mistake's sentence for the other's."""
    for variants in (check.lora._ex3_variants(), {k: v for k, v in check.lora._attention("llama3.1-70b", 16).items()
                                                  if k != "layers"}):
        values = list(variants.values())
        assert len(set(values)) == len(values), variants
