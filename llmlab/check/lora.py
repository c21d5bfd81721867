"""Checks of notebook 17, many LoRA adapters on one server (``llmlab.lora``, ``llmlab.memory.lora``): an adapter's
parameters counted from a model's shapes, what ``--max-loras`` slots of ``--max-lora-rank`` take from the KV cache,
and the engine steps of requests of several adapters when slots are fewer than adapters."""

from __future__ import annotations

import math

from llmlab.check.verdict import _number, _whole, require, right

# Exercise 1: one adapter of Llama 3.1 70B, rank 16, on PEFT's default targets for Llama (q_proj and v_proj), in a
# slot of an engine with tensor parallelism over 4 GPUs: the parameters each GPU holds.
EX1_MODEL, EX1_RANK, EX1_TARGETS, EX1_TP = "llama3.1-70b", 16, ("q_proj", "v_proj"), 4

# Exercise 2: Llama 3.1 8B in bfloat16 on one H100, its adapters all rank 8 on q, k, v and o; started first with
# --max-loras 4 --max-lora-rank 64 (every layer vLLM can adapt), then with --max-lora-rank 8 --lora-target-modules
# q_proj k_proj v_proj o_proj: what the second start gives back to the KV cache.
EX2_MODEL, EX2_SLOTS, EX2_MAX_RANK, EX2_ADAPTER_RANK, EX2_GPU = "llama3.1-8b", 4, 64, 8, "H100-80"

# Exercise 3: requests sent all at once to a server with --max-loras 2, in this order, each asking for these
# numbers of tokens (ignore_eos: each answer exactly as long); the base model's requests name no adapter.
EX3_SLOTS = 2
EX3_ADAPTERS = {"legal": [40, 120, 60], "medical": [200, 30], "kjv": [90, 90, 90, 90], "rv1909": [50]}
EX3_BASE = [150, 20]


def _per_gpu(model: str, rank: int, targets, tp: int) -> dict:
    """Exercise 1's answer and the counts a learner may give instead, from the model's shapes: which of ``A``
    (``rank x in``) and ``B`` (``out x rank``) are cut over ``tp`` GPUs."""
    from llmlab.memory import lora as mlora

    matrices = mlora.adapted_matrices(model, targets)  # (name, out, in, split) of q and v in every layer
    hidden = matrices[0][2]

    def count(a_cut: int, b_cut: int, out=None) -> int:  # out: every matrix as wide as q (no GQA)
        return sum(rank * (n_in // a_cut + (out or n_out) // b_cut) for _, n_out, n_in, _ in matrices)

    right = mlora.lora_params(model, rank, targets, tp)
    return {"right": right, "whole": mlora.lora_params(model, rank, targets), "both cut": count(tp, tp),
            "A cut": count(tp, 1), "no GQA": count(1, tp, out=hidden),
            "one layer": right // (len(matrices) // len(targets)),
            "q k v o": mlora.lora_params(model, rank, mlora.ATTENTION, tp)}  # = 2 x right: k = v, o = q here


def adapter_params_70b(n) -> None:
    """17: the parameters each of 4 GPUs holds of a rank-16 adapter of Llama 3.1 70B on q_proj and v_proj."""
    from llmlab.memory import model_spec

    n = _whole(n, "n")
    v = _per_gpu(EX1_MODEL, EX1_RANK, EX1_TARGETS, EX1_TP)
    s, tp = model_spec(EX1_MODEL), EX1_TP
    kv = s.num_kv_heads * s.head_dim
    require(n != v["whole"], f"that is the whole adapter; with tensor parallelism over {tp} GPUs each holds its share "
            "of it (the lesson's last section: which matrix of each pair vLLM cuts).")
    require(n != v["both cut"], "that cuts A and B both, a quarter of the adapter (as --fully-sharded-loras does); "
            "by default vLLM cuts one matrix of each pair and keeps the other whole on every GPU.")
    require(n != v["A cut"], "that cuts A and keeps B whole; q_proj and v_proj are split by their output (each GPU "
            "computes some heads), so B (out x rank) is cut and A (rank x in) is whole on every GPU.")
    require(n != v["no GQA"], f"v_proj is not {s.hidden_size:,} wide: the model has {s.num_kv_heads} KV heads of "
            f"{s.head_dim} (grouped-query attention), {kv:,} outputs, {kv // tp} on each GPU.")
    require(n != v["q k v o"], "that is twice the answer: either bytes in bfloat16 (the question asks parameters) "
            "or an adapter that adapts k_proj and o_proj too (this one targets q_proj and v_proj only, PEFT's "
            "default for Llama).")
    require(n != v["one layer"], f"that is one layer; the model has {s.num_layers}.")
    require(n == v["right"], f"for each of the {s.num_layers} layers, q: A {EX1_RANK} x {s.hidden_size:,} whole and B "
            f"{s.num_heads * s.head_dim // tp:,} x {EX1_RANK} (its quarter of the outputs); v: A {EX1_RANK} x "
            f"{s.hidden_size:,} whole and B {kv // tp} x {EX1_RANK}.")
    right(f"{v['right']:,} parameters on each GPU, {v['right'] / v['whole']:.0%} of the adapter's {v['whole']:,}, "
          f"not 25 %: the A matrices, {s.num_layers} x 2 x {EX1_RANK} x {s.hidden_size:,}, are on every GPU.")


def _ex2_variants() -> dict[str, int]:
    """Exercise 2's bytes given back and the differences a learner may give instead."""
    from llmlab.memory import lora as mlora

    model, n, big, small, attention = EX2_MODEL, EX2_SLOTS, EX2_MAX_RANK, EX2_ADAPTER_RANK, mlora.ATTENTION
    first = mlora.lora_slots_bytes(model, n, big)
    second = mlora.lora_slots_bytes(model, n, small, attention)
    return {"right": first - second, "first only": first,
            "no vocabulary": mlora.lora_slots_bytes(model, n, big, mlora.ALL_LINEAR) - second,
            "vocabulary kept": first - mlora.lora_slots_bytes(model, n, small, attention + mlora.VOCABULARY),
            "rank only": first - mlora.lora_slots_bytes(model, n, small),
            "targets only": first - mlora.lora_slots_bytes(model, n, big, attention)}


def lora_slot_cost(saved_bytes, kv_tokens) -> None:
    """17: the bytes Llama 3.1 8B's engine gives back to the KV cache when its 4 slots shrink from rank 64 on every
    adaptable layer to the adapters' rank 8 on q, k, v and o, and the KV tokens they hold."""
    from llmlab.memory import kv_bytes_per_token, layout_fit, model_spec

    v = _ex2_variants()
    want, slots, per_token = v["right"], EX2_SLOTS, kv_bytes_per_token(EX2_MODEL)
    value = _number(saved_bytes, "saved_bytes")
    require(not any(math.isclose(value, want / unit, rel_tol=0.01) for unit in (2**30, 2**20, 1e9, 1e6)),
            "give saved_bytes in bytes, not GiB, MiB, GB or MB.")
    saved_bytes = _whole(saved_bytes, "saved_bytes")
    s = model_spec(EX2_MODEL)
    require(saved_bytes != v["no vocabulary"], f"by default vLLM also gives the embedding (embed_tokens) and the LM "
            f"head (lm_head) slots, each rank x (vocab + hidden) = {EX2_MAX_RANK} x ({s.vocab_size:,} + "
            f"{s.hidden_size:,}) a slot; the second start names neither, so they go too.")
    require(saved_bytes != v["vocabulary kept"], "--lora-target-modules names every layer that gets slots: the "
            "embedding and the LM head, not named, get none.")
    require(saved_bytes != v["first only"], "that is what the first start reserves; the second reserves slots too "
            "(rank 8, on q, k, v and o): give the difference.")
    require(saved_bytes != v["rank only"], "that shrinks every layer's slots to rank 8; the second start also names "
            "only q, k, v and o, so the MLP's, the embedding's and the LM head's slots go entirely.")
    require(saved_bytes != v["targets only"], "that keeps the slots at rank 64; the second start sets "
            "--max-lora-rank 8 too.")
    require(saved_bytes != want // slots, f"that is one slot; the engine keeps --max-loras = {slots} of them.")
    require(saved_bytes != want // 2, "that counts parameters; in bfloat16 each takes 2 bytes.")
    require(saved_bytes != want * 2, "that is float32 (4 bytes a parameter); the slots take the model's dtype, "
            "bfloat16: 2 bytes.")
    require(saved_bytes == want, f"the first start's {slots} slots of rank {EX2_MAX_RANK} (7 linear matrices a "
            f"layer, the embedding and the LM head) less the second's {slots} of rank {EX2_ADAPTER_RANK} on q, k, v "
            "and o, 2 bytes a parameter (memory.lora.lora_slots_bytes, its targets for --lora-target-modules).")
    kv_tokens = _whole(kv_tokens, "kv_tokens")
    tokens = want // per_token
    require(kv_tokens != tokens // 16, "that is blocks of 16 tokens; the question asks tokens.")
    require(kv_tokens != want // (per_token // s.num_layers), f"that divides by one layer's K and V; a token keeps K "
            f"and V in all {s.num_layers} layers (memory.kv_bytes_per_token counts them all).")
    require(kv_tokens != 2 * tokens, "a token's cache holds its keys and its values: twice what K alone takes.")
    require(kv_tokens != tokens // 2, "the KV cache takes the model's dtype here, bfloat16: 2 bytes a value, not 4.")
    require(kv_tokens == tokens, f"divide the {want:,} bytes by the {per_token:,} bytes one token's K and V take "
            "(memory.kv_bytes_per_token).")
    pool = layout_fit(EX2_MODEL, tp=1, gpu_name=EX2_GPU).kv_blocks * 16  # the lesson's arithmetic of one H100's pool
    vocabulary = v["right"] - v["no vocabulary"]
    right(f"{want / 2**30:.2f} GiB given back, {tokens:,} tokens of KV cache: {tokens / pool:.1%} more than the "
          f"{pool:,} tokens one H100 holds for this model. {vocabulary / 2**20:.0f} MiB of it were the embedding's "
          "and the LM head's slots, which the adapters never used.")


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
