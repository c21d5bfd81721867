"""Check cells for the exercises: ``llmlab.check.<exercise>(answer)`` says right or wrong.

Each function prints one line starting with "Right:" when the answer is correct, and otherwise raises
``NotYet`` whose message says what is still wrong -- so an unsolved exercise fails loudly in nbval,
and a learner sees a hint instead of a bare assertion.
"""

from __future__ import annotations


class NotYet(AssertionError):
    """The answer is not right yet; the message says why."""


def require(condition: bool, hint: str) -> None:
    if not condition:
        raise NotYet(f"Not yet: {hint}")


def right(message: str) -> None:
    print(f"Right: {message}")


def first_completion(response, expected_tokens: int = 5) -> None:
    """00_setup: a completion of exactly ``expected_tokens`` tokens, cut by the length limit."""
    require(response is not None and hasattr(response, "usage"),
            "pass the object that client.completions.create(...) returned.")
    require(getattr(response, "object", None) == "text_completion",
            f"expected a completion (object 'text_completion'), got {getattr(response, 'object', None)!r}; "
            "use client.completions.create, not chat.")
    n = response.usage.completion_tokens
    require(n == expected_tokens, f"the server generated {n} tokens; ask for max_tokens={expected_tokens}.")
    reason = response.choices[0].finish_reason
    require(reason == "length", f"finish_reason is {reason!r}: the model stopped on its own before "
            f"{expected_tokens} tokens. Add ignore_eos through extra_body, or try another prompt.")
    right(f"{n} tokens, finish_reason 'length': the server stopped because max_tokens was reached.")


# --- 01_memory_arithmetic -------------------------------------------------------------------------

def _whole(value, what: str) -> int:
    require(isinstance(value, int | float) and not isinstance(value, bool), f"{what} should be a number.")
    require(float(value).is_integer(), f"{what} should be a whole number: GPUs, bytes and tokens come whole "
            "(round GPUs up with math.ceil).")
    return int(value)


def weights_405b_fp16(nbytes) -> None:
    """01: bytes of Llama 3.1 405B's weights in fp16, from its config."""
    from llmlab import memory

    params = memory.param_count("llama3.1-405b")
    n = _whole(nbytes, "the weight size in bytes")
    require(n != 405 * 10**9 * 2, "810 GB multiplies the rounded name (405B); count the parameters from the config.")
    require(n != params, "that is the parameter count; each fp16 parameter takes 2 bytes.")
    require(n == 2 * params, f"expected 2 bytes x {params:,} parameters; check the embeddings (not tied: two "
            "vocab x hidden matrices), q/k/v/o with 8 KV heads, the 3 MLP matrices and the norms.")
    right(f"{n:,} bytes = {n / 1e9:.1f} GB = {n / 2**30:.1f} GiB.")


def h100s_for_405b(count) -> None:
    """01: H100s whose usable memory holds 405B's fp16 weights (no layout constraints yet)."""
    from llmlab import memory

    n = _whole(count, "the number of H100s")
    expected = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="H100-80").weights_whole
    require(n != 16, "16 is a layout that vLLM accepts (TP must divide the heads); this question asks only for "
            "the memory: usable bytes per GPU, divided into the weights, rounded up.")
    require(n >= expected, f"{n} H100s do not hold the weights: use 0.9 x 79.18 GiB - 3 GiB per card, and round up.")
    require(n == expected, f"{n} H100s hold them, but fewer do: divide the weights by 0.9 x 79.18 GiB - 3 GiB "
            "(in bytes), then round up.")
    right(f"{n} H100s: the weights fill {memory.gpus_needed('llama3.1-405b', 'float16').weights:.2f} cards' worth.")


def a100s_for_405b(count) -> None:
    """01: A100-40GB cards whose usable memory holds 405B's fp16 weights."""
    from llmlab import memory

    n = _whole(count, "the number of A100-40s")
    found = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="A100-40")
    require(n != 21, "21 divides by the datasheet 40 GB; vLLM only gets 0.9 x the 39.59 GiB the card reports, "
            "minus the 3 GiB allowance for activations and CUDA graphs.")
    require(n == found.weights_whole, f"expected the weights over 0.9 x 39.59 GiB - 3 GiB, rounded up (not {n}).")
    right(f"{n} A100-40s ({found.weights:.2f} cards' worth): twice the H100 count, for half the memory per card.")


def kv_405b(per_token, at_128k) -> None:
    """01: KV cache bytes per token of 405B (bf16), and for one request of 131,072 tokens."""
    from llmlab import memory

    expected = memory.kv_bytes_per_token("llama3.1-405b")
    per = _whole(per_token, "bytes per token")
    require(per != 2 * expected, "that is twice the config's value: like the published 123.05 GB figure. "
            "Count K and V once each (the 2), with the config's 8 KV heads.")
    require(per == expected, "use layers x 2 (K and V) x num_key_value_heads x head_dim x 2 bytes.")
    total = _whole(at_128k, "bytes for 131,072 tokens")
    require(total == 131_072 * expected, "multiply the bytes per token by 131,072 tokens (128 x 1024).")
    right(f"{per:,} bytes per token; {total / 2**30:.2f} GiB for one 131,072-token request.")


def layout_405b(tp, pp) -> None:
    """01: TP x PP for 405B in bf16 on nodes of 8 H100s, one 128k request, TP inside a node, PP across nodes."""
    from llmlab import memory

    best = memory.plan("llama3.1-405b", gpu_name="H100-80", gpus_per_node=8, context=131_072)
    tp, pp = _whole(tp, "tp"), _whole(pp, "pp")
    require(tp <= 8, "tensor parallelism stays inside a node (8 GPUs): it all-reduces twice per layer.")
    require(128 % tp == 0 and (8 % tp == 0 or tp % 8 == 0), f"TP={tp} does not divide the 128 heads and 8 KV heads.")
    require((tp, pp) != (4, 3), "TP=4 x PP=3 fits in 12 GPUs, but puts two stages on one node: here each "
            "pipeline stage is a whole node.")
    require((tp, pp) == (best.tp, best.pp), f"TP={tp} x PP={pp} is not the smallest layout that fits: per GPU, the "
            "weights share plus one 131,072-token KV cache must fit 0.9 x 79.18 GiB - 3 GiB.")
    right(f"TP={tp} x PP={pp} = {tp * pp} H100s on {pp} nodes; {best.kv_tokens:,} KV tokens, "
          f"{best.max_concurrency:.1f} full-length requests at once.")


def embedded_kv_tokens(tokens) -> None:
    """01: the tokens the embedded server logs with 2 GiB of KV space and --max-model-len 500."""
    from llmlab import memory

    n = _whole(tokens, "the logged token count")
    require(n != 2 * 2**30 // 2048, "that is blocks x 128: vLLM logs int(concurrency x max_model_len), and each "
            "500-token request takes ceil(500 / 128) = 4 whole blocks.")
    expected = memory.kv_capacity(2 * 2**30, 2048, memory.CPU_BLOCK_SIZE, 500).tokens
    require(n == expected, "bytes per token = 4 layers x 2 x 2 KV heads x 32 x 4 bytes (float32); blocks of 128 "
            "tokens; concurrency = blocks / ceil(500 / 128); tokens = int(concurrency x 500).")
    right(f"{n:,} tokens, 2048.00x: the line the server will log.")


def ended_by_model(response, at_least: int) -> None:
    """03: the model ended the text itself (EOS, not a stop string), after at least ``at_least`` tokens."""
    choice = response.choices[0]
    n = response.usage.completion_tokens
    require(choice.finish_reason == "stop", f"finish_reason is {choice.finish_reason!r}: give the model room "
            "(a larger max_tokens), and sample (temperature > 0) so it does not loop.")
    require(choice.stop_reason is None, f"it stopped at your stop string {choice.stop_reason!r}; leave `stop` out.")
    require(n >= at_least, f"only {n} tokens: ask the server to mask the end-of-text token until {at_least} "
            "tokens with extra_body={'min_tokens': ...}.")
    right(f"{n} tokens, then the model's own end-of-text token (finish_reason 'stop', stop_reason None).")


def stopped_at(response, stop: str) -> None:
    """03: generation ended at the stop string ``stop`` (which is not part of the text)."""
    choice = response.choices[0]
    require(choice.stop_reason == stop, f"stop_reason is {choice.stop_reason!r}; pass stop=[{stop!r}].")
    require(stop not in choice.text, "the stop string should not appear in the text.")
    right(f"finish_reason {choice.finish_reason!r}, stop_reason {choice.stop_reason!r}: cut before the first {stop!r}.")


def same_text(a: str, b: str) -> None:
    """04: two generations that must be identical."""
    require(isinstance(a, str) and isinstance(b, str), "store the generated *text* (choices[0].text) in both.")
    require(len(a) > 0, "the text is empty: did you set max_tokens?")
    require(a == b, f"they differ:\n  {a!r}\n  {b!r}\nOnly greedy decoding (temperature 0, or top_k=1) is "
            "deterministic without a seed.")
    right("identical: with only one candidate left at each step, sampling has nothing to choose from.")


def survivors(answer: int, client, model: str, prompt: str, **params) -> None:
    """04: how many of the top-20 next tokens survive the given sampling parameters."""
    import numpy as np

    from llmlab import sampling

    top = sampling.next_token_distribution(client, model, prompt, k=20)
    expected = int(np.count_nonzero(sampling.probabilities(
        sampling.apply_processors(top.logits, sampling.SamplingParams(**params)))))
    require(answer == expected, f"{answer} is not what the processors leave; apply temperature first, then top_p "
            "(sampling.apply_processors does both, in vLLM's order), and count the non-zero probabilities.")
    right(f"{expected} tokens survive {params}.")


def prompt_rank(answer: int, client, model: str, text: str, token: str) -> None:
    """05: the rank of ``token`` inside ``text``'s prompt logprobs."""
    from llmlab import logprobs

    table = logprobs.score_text(client, model, text)
    expected = int(table.loc[table["token"] == token, "rank"].iloc[0])
    require(answer == expected, f"{answer} is not the rank the server reports. Request "
            "extra_body={'prompt_logprobs': 1} and read the 'rank' of that position (logprobs.score_text does).")
    right(f"{token!r} ranks {expected} among the model's candidates at its position.")


def best_choice(answer: str, client, model: str, prompt: str, options: list[str]) -> None:
    """05: the option with the highest summed logprob after ``prompt``."""
    from llmlab import logprobs

    expected = logprobs.score_choices(client, model, prompt, options).loc[0, "option"]
    require(answer in options, f"{answer!r} is not one of {options} (keep the leading space).")
    require(answer == expected, f"{answer!r} is not the most likely: sum the logprobs of each option's tokens "
            "after the prompt and take the largest.")
    right(f"{expected!r} has the highest summed log-probability.")


# --- 02_kv_caching --------------------------------------------------------------------------------

def tiny_kv_bytes_per_token(per_token) -> None:
    """02: KV bytes per token of the tiny model (float32), by hand from its config."""
    from llmlab import memory

    spec = memory.model_spec("llmlab-tiny")
    expected = memory.kv_bytes_per_token(spec)
    n = _whole(per_token, "bytes per token")
    require(n != expected // 2, "that is half: count both K and V (each token leaves a key AND a value per layer), "
            "at 4 bytes per value (float32, not bf16).")
    require(n != expected * spec.num_heads // spec.num_kv_heads,
            f"that uses the {spec.num_heads} query heads; K and V exist only for the {spec.num_kv_heads} KV heads "
            "(grouped-query attention).")
    require(n == expected, f"use layers ({spec.num_layers}) x 2 (K and V) x KV heads ({spec.num_kv_heads}) x "
            f"head_dim ({spec.head_dim}) x 4 bytes (float32).")
    right(f"{n:,} bytes per token: a 512-token context holds {512 * n / 2**20:.0f} MiB of keys and values.")


def cache_matches_arithmetic(measured_bytes, cached_tokens, per_token) -> None:
    """02: bytes of the real cached K/V tensors = cached tokens x the bytes per token computed by hand."""
    from llmlab import memory

    expected = memory.kv_bytes_per_token("llmlab-tiny")
    tokens = _whole(cached_tokens, "the number of cached tokens")
    measured = _whole(measured_bytes, "the measured bytes")
    require(_whole(per_token, "bytes per token") == expected, "first get the bytes per token right (exercise 1).")
    require(measured != tokens * expected // memory.model_spec("llmlab-tiny").num_layers,
            "that is one layer's share: add up all layers (len(kvcache.cache_tensors(past))).")
    require(measured != tokens * expected // 2, "that is half: add the values to the keys.")
    require(measured % expected == 0, "sum numel() x element_size() over the keys AND values of every layer.")
    require(measured // expected == tokens, f"the tensors hold {measured // expected} tokens' worth, not {tokens}: "
            "count the tokens that went through the model (shape[2] of a cached tensor).")
    right(f"{measured:,} bytes = {tokens} tokens x {expected:,}: the tensors hold exactly what the arithmetic says.")


def request_blocks(gpu_blocks, cpu_blocks, cpu_unused) -> None:
    """02: blocks of a request of 1,000 prompt + 200 output tokens, with GPU (16) and CPU (128) blocks."""
    from llmlab import kvcache, memory

    tokens = 1_200
    g, c, u = (_whole(x, what) for x, what in ((gpu_blocks, "gpu_blocks"), (cpu_blocks, "cpu_blocks"),
                                                 (cpu_unused, "cpu_unused")))
    require(g != kvcache.blocks_for(1_000, 16), "the request holds its output tokens too: 1,000 + 200.")
    require(g == kvcache.blocks_for(tokens, memory.GPU_BLOCK_SIZE), "divide 1,200 by 16 and round UP: vLLM "
            "never gives a request part of a block.")
    require(c == kvcache.blocks_for(tokens, memory.CPU_BLOCK_SIZE), "divide 1,200 by 128 and round up.")
    require(u == c * memory.CPU_BLOCK_SIZE - tokens, "unused slots = blocks x 128 - 1,200.")
    right(f"{g} blocks of 16 (all full) or {c} blocks of 128 with {u} slots unused in the last one.")


def prefix_hits(gpu_hit, cpu_hit) -> None:
    """02: tokens the prefix cache serves for the second of two requests sharing a 300-token prefix (320 in all)."""
    from llmlab import kvcache, memory

    g, c = _whole(gpu_hit, "gpu_hit"), _whole(cpu_hit, "cpu_hit")
    require(g != 300 and c != 300, "the cache stores whole blocks only: round the shared 300 tokens down to a "
            "multiple of the block size.")
    require(g == kvcache.prefix_cache_hit_tokens(320, 300, memory.GPU_BLOCK_SIZE),
            "with blocks of 16: how many whole blocks fit in the 300 shared tokens, times 16?")
    require(c == kvcache.prefix_cache_hit_tokens(320, 300, memory.CPU_BLOCK_SIZE),
            "with blocks of 128: whole blocks in 300 tokens, times 128.")
    right(f"{g} tokens on a GPU, {c} on vLLM-CPU: smaller blocks reuse more of a shared prefix.")


# --- 08_distributed_serving ----------------------------------------------------------------------

def _number(value, what: str) -> float:
    require(isinstance(value, int | float) and not isinstance(value, bool), f"{what} should be a number.")
    return float(value)


def tp8_allreduce_bytes(nbytes) -> None:
    """08: bytes one GPU sends in the TP all-reduces of one decode step (one token) of 405B at TP=8, bf16."""
    from llmlab import cluster

    expected = cluster.tp_vs_pp("llama3.1-405b", [(8, 1)])[0]["tp_bytes_per_gpu"]
    n = _whole(nbytes, "the bytes per GPU")
    message = 16384 * 2
    require(n != 252 * message, "that is the message size times the all-reduces: in a ring all-reduce each GPU "
            "sends 2 x (TP-1)/TP of the message (half to reduce, half to share the result).")
    require(n != 126 * 2 * (7 / 8) * message, "each layer all-reduces twice: after attention and after the MLP.")
    require(n != 2 * expected, "the hidden state travels in bf16: 2 bytes per value, not 4.")
    require(n == expected, "use 2 all-reduces x 126 layers x 2 x (8-1)/8 x hidden_size 16,384 x 2 bytes.")
    right(f"{n:,} bytes per GPU per token: {n / 2**20:.1f} MiB each decode step, in 252 small messages.")


def tp_link_times(tp8_us, tp16_us) -> None:
    """08: microseconds per token of TP all-reduce traffic: TP=8 on NVLink (900 GB/s), TP=16 across nodes on
    InfiniBand (50 GB/s), bandwidth term only."""
    from llmlab import cluster

    tp8, tp16 = cluster.tp_vs_pp("llama3.1-405b", [(8, 1), (16, 1)])
    a, b = _number(tp8_us, "tp8_us"), _number(tp16_us, "tp16_us")
    require(abs(a * 1e6 - tp8["tp_us"]) > 0.01 * tp8["tp_us"], "that looks like seconds: multiply by 10**6 for µs.")
    require(abs(a - tp8["tp_us"]) <= 0.01 * tp8["tp_us"], f"TP=8: bytes per GPU per token / 900e9 B/s, in µs "
            f"(expected about {tp8['tp_us']:.1f}).")
    require(abs(b - tp16["tp_us"]) <= 0.01 * tp16["tp_us"], "TP=16: each GPU sends 2 x 15/16 of the message per "
            "all-reduce, and the ring waits for its slowest link, InfiniBand at 50e9 B/s.")
    right(f"TP=8 {a:.1f} µs vs TP=16 {b:.0f} µs per token: {b / a:.0f}x more time on the wire once TP leaves "
          "the node.")


def pp_boundary(nbytes, us) -> None:
    """08: bytes of one token's hidden state crossing the PP=2 stage boundary, and µs at InfiniBand's 50 GB/s."""
    n = _whole(nbytes, "the bytes across the boundary")
    require(n != 16384, "the hidden state has 16,384 values of 2 bytes each (bf16).")
    require(n == 16384 * 2, "one token's hidden state: hidden_size x 2 bytes, sent once, point to point.")
    ratio = 126 * 2 * 2 * 7 / 8 * n / n
    t = _number(us, "the microseconds")
    require(abs(t - n / 50e9 * 1e6) <= 0.01 * n / 50e9 * 1e6, "divide the bytes by 50e9 B/s and multiply by 1e6.")
    right(f"{n:,} bytes, {t:.2f} µs per token: {ratio:.0f}x less than one GPU sends in TP=8's all-reduces, "
          "and once per stage boundary.")


def load_eta_minutes(minutes) -> None:
    """08: minutes left for 405B's weights, from the shard line 44/191 after 05:10, at the average rate so far."""
    m = _number(minutes, "the minutes")
    expected = 310 / 44 * (191 - 44) / 60
    require(abs(m - 310 / 44 * 191 / 60) > 0.3, "that is the whole load: only 191 - 44 shards are left.")
    require(abs(m - expected * 60) > 0.05 * expected * 60, "that is seconds: divide by 60.")
    require(abs(m - expected) <= 0.25, f"05:10 is 310 s for 44 shards; the 147 shards left take 147 x 310/44 s "
            f"(about {expected:.1f} min).")
    right(f"about {m:.1f} minutes left (tqdm's own estimate: 17:18); the whole load takes ~22 min here.")


# --- 06_threaded_requests -------------------------------------------------------------------------

def job_queue(send_all, workers: int = 4) -> None:
    """06: ``send_all(ask, prompts, workers)`` keeps ``workers`` requests in flight, answers in prompt order.

    The learner's function is run on a stand-in ``ask`` that sleeps instead of calling a server (so the
    check is fast and sends no load) and counts how many calls run at the same time.
    """
    import random
    import threading
    import time

    lock, state = threading.Lock(), {"now": 0, "max": 0, "calls": 0}

    def ask(prompt: str) -> str:
        with lock:
            state["now"] += 1
            state["calls"] += 1
            state["max"] = max(state["max"], state["now"])
        time.sleep(random.Random(prompt).uniform(0.02, 0.08))  # unequal times: answers finish out of order
        with lock:
            state["now"] -= 1
        return prompt.upper()

    prompts = [f"prompt {i}" for i in range(6 * workers)]
    answers = send_all(ask, prompts, workers)
    require(answers is not None, "send_all returned None: return the list of answers.")
    answers = list(answers)
    require(state["calls"] == len(prompts), f"ask was called {state['calls']} times for {len(prompts)} prompts: "
            "call it exactly once per prompt.")
    require(sorted(answers) == sorted(p.upper() for p in prompts), "return what ask(prompt) returned, one answer "
            "per prompt.")
    require(answers == [p.upper() for p in prompts], "the answers are not in the order of the prompts: they "
            "finish in any order, so put each one at its prompt's index (or use pool.map, which keeps the order).")
    require(state["max"] > 1, "only one request was in flight at a time: submit all the prompts to the "
            "ThreadPoolExecutor first, then collect the results.")
    require(state["max"] <= workers, f"{state['max']} requests ran at once for workers={workers}: create the pool "
            "with max_workers=workers.")
    require(state["max"] == workers, f"at most {state['max']} of the {workers} workers were busy at once: give "
            "the pool max_workers=workers and all the prompts up front.")
    right(f"{len(prompts)} answers in order, {workers} requests in flight at once.")


def tpot_by_hand(tpot, record) -> None:
    """06: the time per output token of one record, from its TTFT, latency and output tokens."""
    require(isinstance(tpot, int | float) and not isinstance(tpot, bool), "tpot should be a number of seconds.")
    n, ttft, latency = record.output_tokens, record.ttft, record.latency
    expected = (latency - ttft) / (n - 1)
    require(abs(tpot - latency / n) > 1e-12, "latency / tokens counts the wait for the first token too: TPOT "
            "leaves out the TTFT.")
    require(abs(tpot - (latency - ttft) / n) > 1e-12, "after the first token come tokens - 1 more, not tokens: "
            "divide by output_tokens - 1.")
    require(abs(tpot - expected) <= 1e-9 * max(1.0, expected), "TPOT = (latency - ttft) / (output_tokens - 1), "
            "all from the record.")
    right(f"{tpot * 1000:.2f} ms per token after the first; the mean gap between tokens is the same "
          f"({sum(record.itl) / len(record.itl) * 1000:.2f} ms).")


def knee(answer, table, share: float = 0.8) -> None:
    """06: the smallest concurrency of a sweep that reaches ``share`` of its best throughput."""
    tput = table["output_tokens_per_s"]
    best = tput.max()
    expected = int(min(c for c in table.index if tput[c] >= share * best))
    require(answer in set(table.index), f"{answer!r} is not a concurrency of the sweep ({list(table.index)}).")
    require(answer != int(tput.idxmax()) or answer == expected, "that is where throughput peaks; the question is "
            f"the *smallest* concurrency that already gets {share:.0%} of the peak.")
    require(int(answer) == expected, f"compare each level's output_tokens_per_s with {share:.0%} of the best "
            f"({share * best:.0f} tokens/s) and take the smallest concurrency that reaches it.")
    gain = best / tput[expected] - 1
    right(f"concurrency {expected} gives {tput[expected]:.0f} of the best {best:.0f} output tokens/s; more requests "
          f"in flight add latency for at most {gain:.0%} more throughput.")


def resumed(path, count: int) -> None:
    """06: a run saved in ``path`` that failed and was resumed: ``count`` requests, all ok in the end."""
    import json
    from pathlib import Path

    from llmlab import loadtest

    result = loadtest.load(path)  # the last record of each request
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    sessions = {json.loads(line).get("session") for line in lines}  # every attempt
    require(len(result.records) == count, f"the file holds {len(result.records)} requests, not {count}: save every "
            "attempt to the same file.")
    require(len(sessions) >= 2 or not result.failed, "only one run is in the file: run again with the same "
            "save= path and resume=True.")
    first = result.failed[0].error[:80] if result.failed else ""
    require(not result.failed, f"{len(result.failed)} requests still failed ({first}): resume against the "
            "working server (client), with resume=True.")
    require(len(sessions) >= 2, "all ok at once? The exercise starts with a run against the server that is down.")
    right(f"all {count} requests ok after {len(sessions)} runs; the file keeps every attempt.")


# --- 07_offline_inference --------------------------------------------------------------------------

def chat_prompt_ids(ids, messages) -> None:
    """07: the token ids of a chat prompt, from the tiny model's tokenizer and its own chat template."""
    from llmlab import offline

    require(not isinstance(ids, str), "that is text: vLLM tokenizes a text prompt again and adds a second <s>. "
            "Ask apply_chat_template for token ids (tokenize=True).")
    require(not hasattr(ids, "keys"), "apply_chat_template returned a BatchEncoding: take its ['input_ids'].")
    ids = list(ids)
    require(ids and all(isinstance(t, int) for t in ids), "pass a list of token ids (integers).")
    tok = offline.load_tokenizer()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    require(ids != tok(text)["input_ids"], "that is the template's text tokenized again: it starts with two <s> "
            f"({tok.bos_token_id}, {tok.bos_token_id}). Let apply_chat_template tokenize (tokenize=True).")
    require(ids != offline.chat_token_ids(tok, messages, add_generation_prompt=False),
            "the prompt stops after the last message: add_generation_prompt=True appends 'Assistant:', the cue "
            "for the model to answer.")
    require(ids == offline.chat_token_ids(tok, messages), "apply the tokenizer's own chat template to these "
            "messages (tokenize=True, add_generation_prompt=True); do not write the template by hand.")
    right(f"{len(ids)} tokens, one <s>, ending in 'Assistant:': the prompt the server's chat endpoint builds.")


def offline_sampling(online: dict, offline_kwargs: dict) -> None:
    """07: keyword arguments for ``vllm.SamplingParams`` carrying an online request's sampling parameters."""
    import dataclasses

    from llmlab import sampling

    require(isinstance(offline_kwargs, dict), "build a dict of keyword arguments for vllm.SamplingParams.")
    require("extra_body" not in offline_kwargs, "offline there is no HTTP body: what travels in extra_body online "
            "(top_k, repetition_penalty, ...) is a plain field of vllm.SamplingParams.")
    flat = {k: v for k, v in online.items() if k not in ("model", "prompt", "messages", "extra_body", "stream")}
    flat.update(online.get("extra_body") or {})
    for name, value in flat.items():
        require(name in offline_kwargs, f"{name} is missing: the online request sets it to {value!r}.")
        require(offline_kwargs[name] == value, f"{name} is {offline_kwargs[name]!r} offline but {value!r} online.")
    known = {f.name for f in dataclasses.fields(sampling.SamplingParams)}
    unknown = sorted(set(offline_kwargs) - known)
    require(not unknown, f"{', '.join(unknown)}: not a sampling parameter of vllm.SamplingParams.")
    right(f"the same {len(flat)} values: {', '.join(sorted(flat))}; only where they travel differs.")


def offline_batch(batch, tokens_per_s, engine) -> None:
    """07: 32 greedy prompts of 32 tokens each in one offline batch, tokens/s by hand, the engine closed."""
    from llmlab import offline

    require(hasattr(batch, "completions"), "pass what engine.generate(...) returned (a BatchResult).")
    n = len(batch.completions)
    require(n == 32, f"{n} prompts: send all 32 in one generate call.")
    require({c.output_tokens for c in batch.completions} == {32},
            "every completion should have 32 tokens: max_tokens=32 and ignore_eos=True.")
    require(batch.params.get("temperature") == 0, "use greedy decoding: temperature=0.")
    require(isinstance(tokens_per_s, int | float) and not isinstance(tokens_per_s, bool) and tokens_per_s > 0,
            "tokens_per_s should be a positive number.")
    expected = batch.output_tokens / batch.seconds
    require(abs(tokens_per_s - 32 / batch.seconds) > 1e-9 * expected,
            "that counts one prompt's tokens: add up the output tokens of all 32 completions.")
    require(abs(tokens_per_s - expected) <= 1e-6 * expected,
            "divide the output tokens of all completions (sum of c.output_tokens) by batch.seconds.")
    require(not engine.running and offline.memory_of(engine.pid)["processes"] == 0,
            "close the engine (engine.close(), or a with block): until then it holds its memory.")
    right(f"{batch.output_tokens:,} tokens in {batch.seconds:.2f} s = {tokens_per_s:,.0f} tokens/s, and the "
          "engine's memory is back.")


# --- 09_real_gpus ---------------------------------------------------------------------------------

def rehearsal_kv_tokens(kv_tokens, run: dict) -> None:
    """09: the KV tokens vLLM logged for a rehearsal at TP=2, from its measured figures in bytes."""
    from llmlab import memory

    n = _whole(kv_tokens, "the KV cache size in tokens")
    p, logged, length = run["memory_probe"][0], run["kv_tokens_logged"], run["max_model_len"]
    util = run["gpu_memory_utilization"]
    budget = memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"], utilization=util)
    whole_model = memory.kv_capacity(budget, memory.kv_bytes_per_token(run["model"]), 16, length).tokens
    require(n != budget, "that is the budget in bytes: divide by the bytes of one token (times 16 per block) and "
            "keep whole blocks, as memory.kv_capacity does.")
    heads = memory.model_spec(run["model"]).num_kv_heads
    require(n != whole_model, f"that counts the KV bytes of all {heads} KV heads; at TP={run['tp']} each GPU holds "
            f"its share: memory.kv_bytes_per_token(model, tp={run['tp']}).")
    full = memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"], utilization=1.0)
    per_gpu = memory.kv_bytes_per_token(run["model"], tp=run["tp"])
    require(n != memory.kv_capacity(full, per_gpu, 16, length).tokens,
            f"vLLM may use only gpu_memory_utilization = {util} of the memory: pass utilization={util}.")
    require(n == logged, f"vLLM logged {logged:,} tokens: budget = {util} x total - weights - activation_peak - "
            "non_torch, in bytes, then whole blocks of 16 tokens.")
    right(f"{n:,} tokens, exactly what vLLM allocated: {n / length:.2f} requests of the full {length:,}-token "
          "context.")


def rehearsal_roofline(roofline_tok_s, run: dict) -> None:
    """09: the batch-1 ceiling, measured bandwidth over the bytes one GPU reads per step."""
    require(isinstance(roofline_tok_s, int | float) and not isinstance(roofline_tok_s, bool) and roofline_tok_s > 0,
            "roofline_tok_s should be a positive number of tokens per second.")
    exact = run["roofline_tok_s"]
    require(roofline_tok_s > 1e-3, "bandwidth_tb_s is in terabytes per second: multiply it by 1e12 for bytes "
            "per second.")
    require(abs(roofline_tok_s * run["tp"] / exact - 1) > 0.03,
            f"that divides by the whole model's bytes; at TP={run['tp']} each GPU reads only its shard, at the "
            "same time as the others: use one GPU's bytes (weight_bytes_per_gpu).")
    require(abs(roofline_tok_s / exact - 1) <= 0.03,
            f"expected about {exact:.1f} tokens/s: bandwidth (bytes/s) / one GPU's weight bytes.")
    right(f"{roofline_tok_s:.1f} tokens/s at most (llmlab's exact figure, without the unread embedding rows: "
          f"{exact:.1f}); measured {run['decode_tok_s_batch1']:.1f}, {run['decode_vs_roofline']:.0%} of it.")


def rehearsal_tp_per_gpu(per_gpu_ratio, one: dict, two: dict) -> None:
    """09: TP=2's throughput per GPU over TP=1's, at 64 requests in flight."""
    require(isinstance(per_gpu_ratio, int | float) and not isinstance(per_gpu_ratio, bool),
            "per_gpu_ratio should be a number.")
    a = next(s for s in one["sweep"] if s["concurrency"] == 64)["output_tokens_per_s"]
    b = next(s for s in two["sweep"] if s["concurrency"] == 64)["output_tokens_per_s"]
    require(abs(per_gpu_ratio - b / a) > 1e-9, "that is the ratio of the totals: TP=2 uses two GPUs, so divide "
            "its throughput by 2 first.")
    require(abs(per_gpu_ratio - a / (b / 2)) > 1e-9, "upside down: TP=2 per GPU divided by TP=1.")
    require(abs(per_gpu_ratio - b / 2 / a) <= 1e-6 * (b / 2 / a), "take output_tokens_per_s at concurrency 64 "
            "from each sweep; TP=2's per GPU is half of its total.")
    right(f"{per_gpu_ratio:.2f}: each GPU of the TP=2 server serves {per_gpu_ratio:.0%} of what the single GPU "
          f"serves, while the pair serves {b / a:.2f}x as much in total.")
