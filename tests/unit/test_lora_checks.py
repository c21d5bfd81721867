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
    # 80 layers x 16 x (q: A 8,192 whole + B 8,192 / 4;  v: A 8,192 whole + B 1,024 / 4): B cut, A whole
    want = 80 * 16 * ((8192 + 8192 // 4) + (8192 + 1024 // 4))
    assert want == mlora.lora_params("llama3.1-70b", 16, ("q_proj", "v_proj"), tp=4) == 23_920_640
    assert "23,920,640 parameters on each GPU, 73% of the adapter's 32,768,000" in \
        right(capsys, check.adapter_params_70b, want)
    right(capsys, check.adapter_params_70b, float(want))
    not_yet(check.adapter_params_70b, 80 * 16 * (8192 * 2 + 8192 + 1024), hint="that is the whole adapter")
    not_yet(check.adapter_params_70b, 80 * 16 * (8192 * 2 + 8192 + 1024) // 4, hint="cuts A and B both")
    not_yet(check.adapter_params_70b, 80 * 16 * ((8192 // 4 + 8192) + (8192 // 4 + 1024)), hint="cuts A and keeps B")
    not_yet(check.adapter_params_70b, 80 * 16 * 2 * (8192 + 8192 // 4), hint="8 KV heads of 128")
    not_yet(check.adapter_params_70b, mlora.lora_params("llama3.1-70b", 16, mlora.ATTENTION, tp=4),
            hint="adapts k_proj and o_proj too")  # k = v and o = q per GPU: also bytes in bfloat16
    not_yet(check.adapter_params_70b, want // 80, hint="that is one layer; the model has 80")
    not_yet(check.adapter_params_70b, 2 * want, hint="either bytes in bfloat16")
    not_yet(check.adapter_params_70b, want + 1, hint="B 2,048 x 16 (its quarter of the outputs)")
    not_yet(check.adapter_params_70b, want + 0.5, hint="whole number")
    not_yet(check.adapter_params_70b, "23920640", hint="should be a number")


def test_lora_slot_cost(capsys):
    # first start: 4 slots of rank 64 in the 7 linear matrices of 32 layers, the embedding and the LM head
    linear = (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3
    first = 4 * 64 * (32 * linear + 2 * (128_256 + 4096)) * 2
    second = 4 * 8 * 32 * ((4096 + 4096) * 2 + (4096 + 1024) * 2) * 2  # rank 8 on q, k, v, o only
    want = first - second
    assert (first, second) == (mlora.lora_slots_bytes("llama3.1-8b", 4, 64),
                               mlora.lora_slots_bytes("llama3.1-8b", 4, 8, mlora.ATTENTION))
    assert want == 1_423_179_776
    tokens = want // memory.kv_bytes_per_token("llama3.1-8b")
    assert tokens == want // (32 * 2 * 8 * 128 * 2) == 10_858
    out = right(capsys, check.lora_slot_cost, want, tokens)
    assert "1.33 GiB given back, 10,858 tokens" in out and "2.5% more than the 436,656 tokens one H100 holds" in out
    assert "129 MiB of it were the embedding's and the LM head's slots" in out
    for unit in (2**30, 1e9, 2**20, 1e6):
        not_yet(check.lora_slot_cost, want / unit, tokens, hint="in bytes, not GiB")
    not_yet(check.lora_slot_cost, want - 4 * 64 * 2 * (128_256 + 4096) * 2, tokens, hint="embedding (embed_tokens)")
    not_yet(check.lora_slot_cost, want - 4 * 8 * 2 * (128_256 + 4096) * 2, tokens, hint="get none")
    not_yet(check.lora_slot_cost, first, tokens, hint="what the first start reserves")
    not_yet(check.lora_slot_cost, first - mlora.lora_slots_bytes("llama3.1-8b", 4, 8), tokens,
            hint="shrinks every layer's slots to rank 8")
    not_yet(check.lora_slot_cost, first - mlora.lora_slots_bytes("llama3.1-8b", 4, 64, mlora.ATTENTION), tokens,
            hint="keeps the slots at rank 64")
    not_yet(check.lora_slot_cost, want // 4, tokens, hint="that is one slot")
    not_yet(check.lora_slot_cost, want // 2, tokens, hint="that counts parameters")
    not_yet(check.lora_slot_cost, want * 2, tokens, hint="that is float32")
    not_yet(check.lora_slot_cost, want + 2, tokens, hint="its targets for --lora-target-modules")
    not_yet(check.lora_slot_cost, want, tokens // 16, hint="that is blocks of 16 tokens")
    not_yet(check.lora_slot_cost, want, tokens * 32, hint="divides by one layer's K and V")
    not_yet(check.lora_slot_cost, want, tokens * 2, hint="its keys and its values")
    not_yet(check.lora_slot_cost, want, tokens // 2, hint="bfloat16: 2 bytes a value, not 4")
    not_yet(check.lora_slot_cost, want, tokens + 1, hint="131,072 bytes one token's K and V take")
    not_yet(check.lora_slot_cost, want, 10_858.5, hint="whole number")
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
    for variants in (check.lora._ex3_variants(), check.lora._ex2_variants(),
                     check.lora._per_gpu("llama3.1-70b", 16, ("q_proj", "v_proj"), 4)):
        values = list(variants.values())
        assert len(set(values)) == len(values), variants
