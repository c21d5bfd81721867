"""Checks of notebook 17, many LoRA adapters on one server (``llmlab.lora``, ``llmlab.memory.lora``): an adapter's
parameters counted from a model's shapes, what ``--max-loras`` slots of ``--max-lora-rank`` take from the KV cache,
and the engine steps of requests of several adapters when slots are fewer than adapters."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: one adapter of Llama 3.1 70B, rank 16, on the attention's four matrices only.
EX1_MODEL, EX1_RANK = "llama3.1-70b", 16

# Exercise 2: Llama 3.1 8B in bfloat16 on one H100, served with --max-loras 4 --max-lora-rank 64; the service's
# adapters are rank 8 on q, k, v and o only.
EX2_MODEL, EX2_SLOTS, EX2_MAX_RANK, EX2_ADAPTER_RANK, EX2_GPU = "llama3.1-8b", 4, 64, 8, "H100-80"

# Exercise 3: requests sent all at once to a server with --max-loras 2, in this order, each asking for these
# numbers of tokens (ignore_eos: each answer exactly as long); the base model's requests name no adapter.
EX3_SLOTS = 2
EX3_ADAPTERS = {"legal": [40, 120, 60], "medical": [200, 30], "kjv": [90, 90, 90, 90], "rv1909": [50]}
EX3_BASE = [150, 20]


def _attention(model: str, rank: int) -> dict:
    """Parts of Exercise 1's count (and the sums a learner may give instead), from the model's shapes."""
    from llmlab.memory import lora as mlora

    matrices = mlora.adapted_matrices(model, mlora.ATTENTION)  # (name, out, in, split) of q, k, v, o in every layer
    layers = len(matrices) // len(mlora.ATTENTION)
    return {"right": mlora.lora_params(model, rank, mlora.ATTENTION), "layers": layers,
            "one layer": mlora.lora_params(model, rank, mlora.ATTENTION) // layers,
            "A only": sum(rank * n_in for _, _, n_in, _ in matrices),
            "B only": sum(rank * n_out for _, n_out, _, _ in matrices),
            "the matrices": sum(n_in * n_out for _, n_out, n_in, _ in matrices),
            "no GQA": 4 * layers * rank * 2 * matrices[0][2],  # k and v as large as q
            "all linear": mlora.lora_params(model, rank)}


def adapter_params_70b(n) -> None:
    """17: the parameters of one rank-16 adapter of Llama 3.1 70B on q_proj, k_proj, v_proj and o_proj."""
    from llmlab.memory import lora as mlora
    from llmlab.memory import model_spec, param_count, weight_bytes

    n = _whole(n, "n")
    parts = _attention(EX1_MODEL, EX1_RANK)
    s = model_spec(EX1_MODEL)
    require(n != parts["no GQA"], f"k_proj and v_proj are not {s.hidden_size:,} x {s.hidden_size:,}: the model has "
            f"{s.num_kv_heads} KV heads of {s.head_dim} (grouped-query attention), so each gives "
            f"{s.num_kv_heads * s.head_dim:,} outputs.")
    require(n != mlora.lora_params(EX1_MODEL, EX1_RANK // 2, mlora.ATTENTION),
            f"that is rank {EX1_RANK // 2} (the lesson's table); this adapter has rank {EX1_RANK}.")
    require(n != parts["all linear"], "that adapts the MLP too (gate_proj, up_proj, down_proj); this adapter "
            "targets the attention's q, k, v and o only.")
    require(n != parts["one layer"], f"that is one layer; the model has {parts['layers']}.")
    require(n != parts["the matrices"], "that is the attention's own weights (in x out each); an adapter adds "
            "rank x (in + out) per matrix: A is rank x in, B is out x rank.")
    require(n != parts["A only"], "that counts the A matrices only (rank x in); add the B matrices (out x rank).")
    require(n != parts["B only"], "that counts the B matrices only (out x rank); add the A matrices (rank x in).")
    require(n != 2 * parts["right"], "that is bytes in bfloat16 (2 per parameter); the question asks parameters.")
    require(n == parts["right"], f"for each of the {parts['layers']} layers, rank x (in + out) of q ({s.hidden_size:,}"
            f" -> {s.num_heads * s.head_dim:,}), k and v ({s.hidden_size:,} -> {s.num_kv_heads * s.head_dim:,} each) "
            f"and o ({s.num_heads * s.head_dim:,} -> {s.hidden_size:,}).")
    total, adapter_mb = param_count(EX1_MODEL), mlora.lora_bytes(EX1_MODEL, EX1_RANK, mlora.ATTENTION) / 1e6
    right(f"{parts['right']:,} parameters, {parts['right'] / total:.3%} of the model's {total / 1e9:.1f} B: "
          f"{adapter_mb:.0f} MB in bfloat16 beside {weight_bytes(EX1_MODEL) / 1e9:.0f} GB of weights.")


def lora_slot_cost(slot_bytes, kv_tokens) -> None:
    """17: the bytes Llama 3.1 8B's engine reserves for --max-loras 4 --max-lora-rank 64 in bfloat16, and the KV
    tokens they would have held."""
    from llmlab.memory import kv_bytes_per_token, layout_fit, model_spec
    from llmlab.memory import lora as mlora

    model, slots, rank = EX2_MODEL, EX2_SLOTS, EX2_MAX_RANK
    want = mlora.lora_slots_bytes(model, slots, rank)
    per_token = kv_bytes_per_token(model)
    value = _number(slot_bytes, "slot_bytes")
    require(not any(math.isclose(value, want / unit, rel_tol=0.01) for unit in (2**30, 2**20, 1e9, 1e6)),
            "give slot_bytes in bytes, not GiB, MiB, GB or MB.")
    slot_bytes = _whole(slot_bytes, "slot_bytes")
    adapters_rank, attention = EX2_ADAPTER_RANK, mlora.ATTENTION
    require(slot_bytes != mlora.lora_slots_bytes(model, slots, adapters_rank, attention),
            "that sizes the slots by the adapters that will fill them (rank 8, attention only); vLLM sizes every "
            "slot at --max-lora-rank, in every linear layer it can adapt, before any adapter is loaded.")
    require(slot_bytes != mlora.lora_slots_bytes(model, slots, adapters_rank),
            f"a slot is as large as --max-lora-rank ({rank}), whatever rank the adapters have: that is why "
            "lora.serve_args sets it to the largest rank among the adapters served.")
    require(slot_bytes != mlora.lora_slots_bytes(model, slots, rank, attention),
            "vLLM makes a slot in every linear layer it can adapt (q, k, v, o, gate, up and down), whichever "
            "layers the adapters target.")
    require(slot_bytes != want // slots, f"that is one slot; the engine keeps --max-loras = {slots} of them.")
    require(slot_bytes != want // 2, "that counts parameters; in bfloat16 each takes 2 bytes.")
    require(slot_bytes != want * 2, "that is float32 (4 bytes a parameter); the slots take the model's dtype, "
            "bfloat16: 2 bytes.")
    require(slot_bytes == want, f"{slots} slots, each of rank {rank}: rank x (in + out) for each of the 7 linear "
            "matrices of each layer, 2 bytes a parameter (memory.lora.lora_slots_bytes adds them up).")
    kv_tokens = _whole(kv_tokens, "kv_tokens")
    layers = model_spec(model).num_layers
    tokens = want // per_token
    require(kv_tokens != tokens // 16, "that is blocks of 16 tokens; the question asks tokens.")
    require(kv_tokens != want // (per_token // layers), f"that divides by one layer's K and V; a token keeps K and V "
            f"in all {layers} layers (memory.kv_bytes_per_token counts them all).")
    require(kv_tokens != 2 * tokens, "a token's cache holds its keys and its values: twice what K alone takes.")
    require(kv_tokens != tokens // 2, "the KV cache takes the model's dtype here, bfloat16: 2 bytes a value, not 4.")
    require(kv_tokens == tokens, f"divide the slots' {want:,} bytes by the {per_token:,} bytes one token's K and V "
            "take (memory.kv_bytes_per_token).")
    pool = layout_fit(model, tp=1, gpu_name=EX2_GPU).kv_blocks * 16  # the lesson's arithmetic of one H100's pool
    right(f"{want / 2**30:.2f} GiB of slots, {tokens:,} tokens of KV cache: {tokens / pool:.1%} of the {pool:,} tokens "
          f"one H100 holds for this model; the adapters' own rank 8 on q, k, v and o would have needed "
          f"{mlora.lora_slots_bytes(model, slots, adapters_rank, attention) / want:.1%} of it.")


def _ex3_variants() -> dict[str, int]:
    """Exercise 3's answer and the sums a learner may give instead."""
    from llmlab.batching import continuous_steps, static_steps

    longest = [max(v) for v in EX3_ADAPTERS.values()]
    n = EX3_SLOTS
    return {"right": max(continuous_steps(longest, n), max(EX3_BASE)),
            "every adapter a slot": max(longest),
            "slots always busy": -(-sum(longest) // n),
            "in pairs": static_steps(longest, n),
            "one slot": sum(longest),
            "one after another": continuous_steps([sum(v) for v in EX3_ADAPTERS.values()], n),
            "base last": continuous_steps([*longest, max(EX3_BASE)], n),
            "base first": continuous_steps([max(EX3_BASE), *longest], n),
            "requests in places": continuous_steps([m for v in EX3_ADAPTERS.values() for m in v], n)}


def adapter_steps(steps) -> None:
    """17: the fewest engine steps Exercise 3's requests of four adapters and the base model take with
    --max-loras 2."""
    steps = _whole(steps, "steps")
    v = _ex3_variants()
    n = EX3_SLOTS
    require(steps != v["every adapter a slot"], f"that runs all four adapters side by side; with --max-loras {n} a "
            "step holds requests of two adapters at most, and the others wait.")
    require(steps != v["slots always busy"], "that is the adapters' work spread evenly over both slots, as if a slot "
            "were never idle; follow the order: which adapter takes the slot that frees first, and when does it end?")
    require(steps != v["in pairs"], "that runs the adapters in pairs, the next pair once both have ended; a slot "
            "frees when its adapter's last request ends, and the next waiting adapter takes it at the next step.")
    require(steps != v["one slot"], f"that is one slot, one adapter after another; there are {n}.")
    require(steps != v["one after another"], "an adapter's requests run side by side in its slot, not one after "
            "another: it holds the slot as long as its longest request.")
    require(steps not in (v["base last"], v["base first"]), "the base model's requests name no adapter and take no "
            "slot: they run in every step beside whichever adapters hold the slots.")
    require(steps != v["requests in places"], f"{n} slots are not {n} places for requests: any number of requests of "
            "one adapter run together in its slot.")
    require(steps == v["right"], f"each adapter holds a slot from the step its requests join until its longest "
            f"request ends, and the next adapter in the queue takes the first slot that frees: lesson 16's "
            f"batching.continuous_steps, with each adapter's longest request as its length and {n} places.")
    every = max(v["every adapter a slot"], max(EX3_BASE))
    right(f"{v['right']} steps with {n} slots; {v['one slot']} with one, {every} with a slot for every adapter. The "
          "base model's requests never wait for a slot.")
