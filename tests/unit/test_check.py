"""The check cells' hints, tested with the wrong answers they name (and the right answer passing).

Every exercise ends with ``llmlab.check.<name>(answer)``, which prints "Right: ..." or raises ``NotYet`` with a
sentence aimed at one specific mistake: 810 GB for 405B's weights, the doubled KV figure, seconds for
microseconds, ...  Here each of those mistakes is made on purpose, and the sentence it must get is asserted.
Only the checks that need no server: ``survivors``, ``prompt_rank`` and ``best_choice`` ask the server for the
expected answer and are exercised by the solutions' nbval run.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from check_helpers import not_yet, right

from llmlab import check, cluster, memory, offline, quantization, rehearse
from llmlab.ops import course

SPEC_405B = memory.model_spec("llama3.1-405b")
MESSAGE_405B = SPEC_405B.hidden_size * 2  # one token's hidden state in bf16


# --- notebook 01: memory arithmetic ------------------------------------------------------------------------------

def test_weights_405b_fp16(capsys):
    """learner-review-1's wrong answers: each gap named without the total (the old fallback stated 2 bytes x the
    parameter count, one multiplication from the answer), GB for bytes, numpy's integers accepted."""
    s, params = SPEC_405B, memory.param_count("llama3.1-405b")
    answer = 2 * params
    H, L, V, F = s.hidden_size, s.num_layers, s.vocab_size, s.intermediate_size

    def wrong(value, hint):
        not_yet(check.weights_405b_fp16, value, hint=hint, hides=answer)

    wrong(810 * 10**9, "810 GB multiplies the rounded name (405B)")
    wrong(params, "that is the parameter count; each fp16 parameter takes 2 bytes")
    wrong(answer - 2 * V * H, "the LM head is missing")
    wrong(answer - 2 * (2 * L + 1) * H, "the norms are missing: two per layer and one at the end")
    wrong(answer + 2 * L * 2 * H * s.head_dim * (s.num_heads - s.num_kv_heads), "k_proj and v_proj have "
          "num_key_value_heads (8) heads")  # no grouped-query attention: k and v with all 128 heads
    wrong(answer - 2 * L * H * F, "one MLP matrix is missing")
    wrong(answer + 2, "that is not the config's count")  # a gap it does not name: the parts, no numbers
    wrong(811.7, "that is the size in GB (or GiB); the question asks for bytes")
    wrong(round(answer / 2**30, 1), "that is the size in GB (or GiB)")
    wrong(811.7e9 + 0.5, "bytes come whole")
    wrong("811.7 GB", "should be a number")
    assert "811.7 GB" in right(capsys, check.weights_405b_fp16, answer)
    right(capsys, check.weights_405b_fp16, np.int64(answer))  # what a numpy sum gives


def test_h100s_and_a100s_for_405b(capsys):
    found = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="H100-80")
    h100, cards = found.weights_whole, found.weights
    assert h100 == 12 and round(cards, 2) == 11.07
    # learner-review-1: a GB for a GiB reaches the same 12 three ways; the unrounded cards' worth shows each slip
    weights_gb = memory.weight_bytes("llama3.1-405b") / 1e9
    not_yet(check.h100s_for_405b, weights_gb / (0.9 * 79.18 - 3), 12, hint="the weights in GB by a card in GiB")
    not_yet(check.h100s_for_405b, weights_gb / (0.9 * 80 - 3), 12, hint="uses the 80 GB on the card's label")
    not_yet(check.h100s_for_405b, weights_gb / (0.9 * 80), 12, hint="80 GB on the label and leaves out the 3 GiB")
    weights_gib = memory.weight_bytes("llama3.1-405b") / 2**30
    not_yet(check.h100s_for_405b, weights_gib / (0.9 * 79.18), 11, hint="leaves out the 3 GiB allowance")
    not_yet(check.h100s_for_405b, weights_gib / 79.18, 10, hint="uses the whole card")
    not_yet(check.h100s_for_405b, weights_gib / (0.9 * 80 - 3), 11, hint="10.96 cards' worth is too few")
    not_yet(check.h100s_for_405b, 12, 12, hint="12.00 cards' worth is too many")
    not_yet(check.h100s_for_405b, weights_gib, 12, hint="a number of cards (about ten), not a size")
    not_yet(check.h100s_for_405b, "11.07", 12, hint="should be a number")
    not_yet(check.h100s_for_405b, cards, 16, hint="16 is what a layout on whole nodes of 8 needs")
    not_yet(check.h100s_for_405b, cards, h100 - 1, hint=f"{h100 - 1} H100s do not hold the weights")
    not_yet(check.h100s_for_405b, cards, h100 + 1, hint=f"{h100 + 1} H100s hold them, but fewer do")
    not_yet(check.h100s_for_405b, cards, 11.07, hint="a GPU count rounds up (math.ceil)")
    right(capsys, check.h100s_for_405b, np.float64(cards), np.int64(h100))
    assert "11.07 cards' worth, so 12 H100s" in right(capsys, check.h100s_for_405b, round(cards, 2), h100)

    a100 = memory.gpus_needed("llama3.1-405b", "float16", gpu_name="A100-40").weights_whole
    not_yet(check.a100s_for_405b, 21, hint="21 divides by the datasheet 40 GB")
    not_yet(check.a100s_for_405b, a100 - 1, hint="do not hold the weights")
    not_yet(check.a100s_for_405b, a100 + 1, hint="hold them, but fewer do")
    right(capsys, check.a100s_for_405b, a100)


def test_kv_405b(capsys):
    """Exercise 4 asks for the fp8 KV cache: the lesson prints only bf16's 516,096 bytes and 63.00 GiB."""
    per, bf16 = memory.kv_bytes_per_token("llama3.1-405b", kv_dtype="fp8"), memory.kv_bytes_per_token("llama3.1-405b")
    assert (per, bf16) == (258_048, 516_096)
    not_yet(check.kv_405b, bf16, bf16 * 131_072, hint="that is the bf16 cache of the lesson")
    not_yet(check.kv_405b, 2 * bf16, 2 * bf16 * 131_072, hint="that is twice the bf16 cache: like the published "
            "123.05 GB figure")
    not_yet(check.kv_405b, per // 2, per // 2 * 131_072, hint="layers x 2 (K and V) x num_key_value_heads")
    not_yet(check.kv_405b, per, per * 128_000, hint="multiply the bytes per token by 131,072 tokens")
    not_yet(check.kv_405b, per, per * 131_072 // 2**30, hint="multiply the bytes per token")  # GiB: not named
    not_yet(check.kv_405b, per + 8, (per + 8) * 131_072, hint="x 1 byte (fp8)")  # a wrong answer it does not name
    out = right(capsys, check.kv_405b, per, per * 131_072)
    assert "31.50 GiB" in out and "4.0x" in out


def test_layout_405b(capsys):
    not_yet(check.layout_405b, 16, 1, hint="tensor parallelism stays inside a node (8 GPUs)")
    not_yet(check.layout_405b, 3, 4, hint="TP=3 does not divide the 128 heads")
    not_yet(check.layout_405b, 4, 3, hint="TP=4 x PP=3 does not hold it: ")  # valid for vLLM, too small
    not_yet(check.layout_405b, 4, 4, hint="TP=4 x PP=4 fits but is not the smallest")
    assert "699,408 KV tokens" in right(capsys, check.layout_405b, 8, 2)


def test_kv_2026(capsys):
    """Exercise 7: DeepSeek-V3's full-context request on one GPU of TP=8 and gpt-oss-20b's blocks at 32,768 tokens,
    figures the lesson's tables (70,272 bytes per token; gpt-oss-120b's 9,225 blocks at 131,072) do not print."""
    per, context = 70_272, 163_840
    good, blocks = per * context, 2048 + 1033
    assert (memory.model_spec("deepseek-v3").max_position_embeddings, good) == (context, 11_513_364_480)
    assert memory.kv_layout("gpt-oss-20b", 32_768).blocks_per_request == blocks
    not_yet(check.kv_2026, good // 8, blocks, hint="tensor parallelism does not split the latent")
    not_yet(check.kv_2026, context * 61 * 128 * (192 + 128) * 2, blocks, hint="128 heads of keys and values")
    not_yet(check.kv_2026, 2 * good, blocks, hint="not twice")
    not_yet(check.kv_2026, context * 61 * 512 * 2, blocks, hint="add the rotary key")
    not_yet(check.kv_2026, 131_072 * per, blocks, hint="its max_position_embeddings: 163,840 tokens")
    not_yet(check.kv_2026, good + 1, blocks, hint="61 layers x (kv_lora_rank + qk_rope_head_dim)")  # not named
    not_yet(check.kv_2026, good, 4096, hint="full attention on every layer")
    not_yet(check.kv_2026, good, 2048 + 8, hint="add the 16,384 tokens in flight")
    not_yet(check.kv_2026, good, 2048 + 1032, hint="one block more")
    not_yet(check.kv_2026, good, 9225, hint="ceil((128 - 1 + 16,384) / 16) + 1")  # 120b's, at 131,072: not named
    out = right(capsys, check.kv_2026, good, blocks)
    assert "10.72 GiB on each GPU" in out and "9.84 GiB" in out and "3,081 blocks" in out


def test_embedded_kv_tokens(capsys):
    """Exercise 6 predicts 3 GiB and --max-model-len 300: the lesson prints the 2 GiB, 500-token server's line."""
    blocks = 3 * 2**30 // (128 * 2048)
    expected = memory.embedded_kv_capacity(3, "llmlab-tiny", max_model_len=300).tokens
    assert (blocks, expected) == (12_288, 1_228_800)
    not_yet(check.embedded_kv_tokens, blocks * 128, hint="that is blocks x 128")
    not_yet(check.embedded_kv_tokens, blocks * 128 // 300 * 300, hint="concurrency is counted in whole blocks")
    not_yet(check.embedded_kv_tokens, 1_024_000, hint="concurrency = blocks / ceil(300 / 128)")  # 2 GiB, 500: not named
    not_yet(check.embedded_kv_tokens, expected + 300, hint="4 layers x 2 x 2 KV heads x 32 x 4 bytes")
    assert "4096.00x" in right(capsys, check.embedded_kv_tokens, expected)


# --- notebook 02: KV caching -------------------------------------------------------------------------------------

def test_tiny_kv_without_gqa(capsys):
    """Exercise 1 asks what a full-context request of the tiny model would keep without GQA; the lesson prints its
    2,048 bytes per token with GQA."""
    spec = memory.model_spec("llmlab-tiny")
    gqa = memory.kv_bytes_per_token(spec)
    mha = spec.num_layers * 2 * spec.num_heads * spec.head_dim * 4
    assert (gqa, mha, spec.max_position_embeddings) == (2048, 8192, 512)
    not_yet(check.tiny_kv_without_gqa, 512 * gqa, hint="that is the cache with the 2 KV heads, the lesson's")
    not_yet(check.tiny_kv_without_gqa, mha, hint="that is one token's keys and values")
    not_yet(check.tiny_kv_without_gqa, 512 * mha // 2, hint="that is half: count both K and V")
    not_yet(check.tiny_kv_without_gqa, 512 * mha * 2, hint="x 4 bytes (float32)")  # 8 bytes a value: not named
    assert "4 MiB for a 512-token request, 4x the 1 MiB" in right(capsys, check.tiny_kv_without_gqa, 512 * mha)


def test_cache_matches_arithmetic(capsys):
    per, tokens = 2048, 10
    layers = memory.model_spec("llmlab-tiny").num_layers
    not_yet(check.cache_matches_arithmetic, tokens * per // layers, tokens, hint="that is one layer's share")
    not_yet(check.cache_matches_arithmetic, tokens * per // 2, tokens, hint="that is half: add the values")
    not_yet(check.cache_matches_arithmetic, tokens * per + 4, tokens, hint="not a whole number of tokens' worth")
    not_yet(check.cache_matches_arithmetic, 11 * per, tokens, hint="the tensors hold 11 tokens' worth, not 10")
    not_yet(check.cache_matches_arithmetic, tokens * per * 4, tokens, hint="the tensors hold 40 tokens' worth")
    right(capsys, check.cache_matches_arithmetic, tokens * per, tokens)


def test_request_blocks(capsys):
    not_yet(check.request_blocks, 63, 10, 80, hint="the request holds its output tokens too")
    not_yet(check.request_blocks, 74, 10, 80, hint="divide 1,200 by 16 and round UP")
    not_yet(check.request_blocks, 75, 9, 80, hint="divide 1,200 by 128 and round up")
    not_yet(check.request_blocks, 75, 10, 0, hint="the last block is only partly filled")
    right(capsys, check.request_blocks, 75, 10, 80)


def test_prefix_hits(capsys):
    """learner-review-1's wrong answers; a float of blocks gets "round down" (it told a learner to use math.ceil)."""
    def wrong(gpu, cpu, hint):
        with pytest.raises(check.NotYet) as e:
            check.prefix_hits(gpu, cpu)
        assert "math.ceil" not in str(e.value)
        not_yet(check.prefix_hits, gpu, cpu, hint=hint, hides=288)
        not_yet(check.prefix_hits, gpu, cpu, hint=hint, hides=256)

    wrong(300, 300, "the cache stores whole blocks only")
    for gpu, cpu in [(18, 2), (304, 384), (256, 288), (320, 320)]:  # block counts, rounded up, swapped, the prompt
        wrong(gpu, cpu, "with blocks of 16")
    wrong(288, 384, "with blocks of 128")
    wrong(300 / 16, 300 / 128, "tokens come whole: count the whole blocks that fit with // (it rounds down)")
    right(capsys, check.prefix_hits, 288, 256)
    right(capsys, check.prefix_hits, np.int64(288), np.int64(256))


# --- notebook 03 (and 00, 08): the server's answers, as response objects -------------------------------------------

def completion(tokens=5, finish_reason="length", stop_reason=None, text="x", obj="text_completion"):
    choice = SimpleNamespace(text=text, finish_reason=finish_reason, stop_reason=stop_reason)
    return SimpleNamespace(object=obj, choices=[choice], usage=SimpleNamespace(completion_tokens=tokens))


def test_first_completion(capsys):
    not_yet(check.first_completion, None, hint="pass the object that client.completions.create(...) returned")
    not_yet(check.first_completion, completion(obj="chat.completion"), hint="use client.completions.create, not chat")
    not_yet(check.first_completion, completion(tokens=16), hint="the server generated 16 tokens; ask for max_tokens=5")
    not_yet(check.first_completion, completion(finish_reason="stop"), hint="Add ignore_eos through extra_body")
    right(capsys, check.first_completion, completion())


def test_ended_by_model_and_stopped_at(capsys):
    not_yet(check.ended_by_model, completion(400, "length"), 40, hint="give the model room")
    not_yet(check.ended_by_model, completion(50, "stop", ","), 40, hint="it stopped at your stop string ','")
    not_yet(check.ended_by_model, completion(30, "stop"), 40, hint="only 30 tokens: ask the server to mask")
    not_yet(check.ended_by_model, completion(400, "length"), 40, hint="if it already samples and still loops, "
            "try another seed")
    not_yet(check.ended_by_model, "And it came to pass", 40, hint="that is the text; pass the whole response")
    not_yet(check.ended_by_model, completion(45, "stop").choices[0], 40, hint="that is one choice "
            "(response.choices[0]); pass the whole response")
    not_yet(check.ended_by_model, None, 40, hint="pass the response that client.completions.create(...) returned")
    right(capsys, check.ended_by_model, completion(45, "stop"), 40)

    not_yet(check.stopped_at, completion(12, "stop", None), ",", hint="stop_reason is None; pass stop=[',']")
    not_yet(check.stopped_at, completion(3, "stop", ",", text="The king said,"), ",", hint="',' is in the text")
    right(capsys, check.stopped_at, completion(3, "stop", ",", text="The king said"), ",")


# --- notebook 04: sampling (the check that needs no server) --------------------------------------------------------

def test_same_text(capsys):
    not_yet(check.same_text, None, "a", hint="store the generated *text*")
    not_yet(check.same_text, "", "", hint="the text is empty")
    not_yet(check.same_text, "a b", "a c", hint="Only greedy decoding")
    right(capsys, check.same_text, "a b", "a b")


def test_survivors(capsys, monkeypatch):
    """04 Exercise 3 with a stand-in for the server's top 20: temperature 0.7 then top_p 0.8 leave 4 of them,
    top_p alone 6."""
    from llmlab import sampling

    logits = np.linspace(0, -6, 20)
    monkeypatch.setattr(sampling, "next_token_distribution", lambda *a, **k: SimpleNamespace(logits=logits))

    def wrong(answer, hint):
        not_yet(check.survivors, answer, None, "m", "p", hint=hint, hides=4, temperature=0.7, top_p=0.8)

    wrong(6, "that is what top_p leaves at temperature 1: you skipped temperature")
    wrong(20, "too many: 20 tokens")
    wrong(5, "too many: 5 tokens")
    wrong(3, "too few: 3 tokens")
    probs = sampling.probabilities(sampling.apply_processors(logits, sampling.SamplingParams(temperature=0.7,
                                                                                           top_p=0.8)))
    wrong(probs, "that is the whole distribution; the answer is one number")
    wrong("4", "that is a string; store the count as a number")
    right(capsys, check.survivors, 4, None, "m", "p", temperature=0.7, top_p=0.8)
    right(capsys, check.survivors, np.int64(4), None, "m", "p", temperature=0.7, top_p=0.8)


# --- notebook 06: threaded requests --------------------------------------------------------------------------------

def in_order(ask, prompts, workers):
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(ask, prompts))


def as_they_finish(ask, prompts, workers):
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [f.result() for f in as_completed([pool.submit(ask, p) for p in prompts])]


def as_futures(ask, prompts, workers):
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [pool.submit(ask, p) for p in prompts]


def as_dict(ask, prompts, workers):
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(prompts, pool.map(ask, prompts), strict=True))


def test_job_queue(capsys):
    not_yet(check.job_queue, lambda ask, prompts, workers: [ask(p) for p in prompts],
            hint="only one request was in flight at a time")
    not_yet(check.job_queue, as_they_finish, hint="the answers are not in the order of the prompts")
    not_yet(check.job_queue, lambda ask, prompts, workers: in_order(ask, prompts, 2 * workers),
            hint="requests ran at once for workers=4")
    not_yet(check.job_queue, lambda ask, prompts, workers: in_order(ask, prompts * 2, workers)[:len(prompts)],
            hint="call it exactly once per prompt")
    not_yet(check.job_queue, lambda ask, prompts, workers: None, hint="send_all returned None")
    not_yet(check.job_queue, as_futures, hint="send_all returned futures: return a list of answers")
    not_yet(check.job_queue, as_dict, hint="send_all returned a dict: return a list of answers")
    right(capsys, check.job_queue, in_order)


def test_tpot_by_hand(capsys):
    record = SimpleNamespace(output_tokens=11, ttft=0.5, latency=1.5, itl=[0.1] * 10)
    not_yet(check.tpot_by_hand, 1.5 / 11, record, hint="latency / tokens counts the wait for the first token too")
    not_yet(check.tpot_by_hand, (1.5 - 0.5) / 11, record, hint="divide by output_tokens - 1")
    not_yet(check.tpot_by_hand, "0.1 s", record, hint="tpot should be a number of seconds")
    assert "100.00 ms" in right(capsys, check.tpot_by_hand, (1.5 - 0.5) / 10, record)


def test_knee(capsys):
    sweep = pd.DataFrame({"output_tokens_per_s": [100.0, 700.0, 900.0, 1000.0]},
                         index=pd.Index([1, 8, 64, 256], name="concurrency"))
    not_yet(check.knee, 32, sweep, hint="32 is not a concurrency of the sweep")
    not_yet(check.knee, 256, sweep, hint="that is where throughput peaks")
    not_yet(check.knee, 8, sweep, hint="take the smallest concurrency that reaches it")
    right(capsys, check.knee, 64, sweep)


def test_goodput(capsys):
    from llmlab import loadtest as lt

    def rec(i, ttft, tpot, status="ok"):
        return lt.Record(id=i, status=status, ttft=ttft, tpot=tpot, latency=1.0, output_tokens=8)

    result = lt.LoadResult([rec(0, 0.1, 0.01), rec(1, 0.5, 0.01), rec(2, 0.2, 0.05), rec(3, 0.2, 0.02),
                            rec(4, None, None, status="error")])
    slo = {"ttft": 0.2, "tpot": 0.02}  # good: 0 and 3 (at both limits) -> 2 of 5
    not_yet(check.goodput, 40, result, slo, hint="is not a share")
    not_yet(check.goodput, 2 / 4, result, slo, hint="divide by every request, failed ones too")
    not_yet(check.goodput, 1 / 5, result, slo, hint="use <=, as vLLM does")
    not_yet(check.goodput, 3 / 5, result, slo, hint="that counts only the ttft objective")
    not_yet(check.goodput, 0.0, result, slo, hint="are all within the SLOs")
    assert "2 of 5 requests met every SLO (40%)" in right(capsys, check.goodput, 2 / 5, result, slo)


# --- notebook 07: offline (the checks that need no engine) ----------------------------------------------------------

def test_chat_prompt_ids(capsys):
    tok = offline.load_tokenizer()
    messages = [{"role": "user", "content": "Name a planet."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    not_yet(check.chat_prompt_ids, text, messages, hint="that is text: vLLM tokenizes a text prompt again")
    not_yet(check.chat_prompt_ids, {"input_ids": [1, 2]}, messages, hint="take its ['input_ids']")
    not_yet(check.chat_prompt_ids, tok(text)["input_ids"], messages, hint="it starts with two <s>")
    not_yet(check.chat_prompt_ids, offline.chat_token_ids(tok, messages, add_generation_prompt=False), messages,
            hint="add_generation_prompt=True appends 'Assistant:'")
    right(capsys, check.chat_prompt_ids, offline.chat_token_ids(tok, messages), messages)


def test_offline_sampling(capsys):
    online = {"model": "m", "prompt": "p", "temperature": 0.7, "max_tokens": 32, "extra_body": {"top_k": 5}}
    not_yet(check.offline_sampling, online, {"temperature": 0.7, "max_tokens": 32, "extra_body": {"top_k": 5}},
            hint="offline there is no HTTP body")
    not_yet(check.offline_sampling, online, {"temperature": 0.7, "max_tokens": 32}, hint="top_k is missing")
    not_yet(check.offline_sampling, online, {"temperature": 0.7, "max_tokens": 32, "top_k": 3},
            hint="top_k is 3 offline but 5 online")
    not_yet(check.offline_sampling, online, {"temperature": 0.7, "max_tokens": 32, "top_k": 5, "stream": True},
            hint="stream: not a sampling parameter")
    right(capsys, check.offline_sampling, online, {"temperature": 0.7, "max_tokens": 32, "top_k": 5})


def test_offline_batch(capsys):
    outputs = [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 32)]) for _ in range(32)]
    not_yet(check.offline_batch, outputs[:31], 2.0, 496.0, hint="31 outputs: send all 32 prompts")
    short = outputs[:31] + [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * 7)])]
    not_yet(check.offline_batch, short, 2.0, 500.0, hint="ignore_eos=True make each one exactly 32")
    not_yet(check.offline_batch, outputs, 2.0, 32 / 2.0, hint="that counts one prompt's tokens")
    not_yet(check.offline_batch, outputs, 2.0, 32 * 32, hint="divide the output tokens of all outputs")
    right(capsys, check.offline_batch, outputs, 2.0, 32 * 32 / 2.0)  # no engine in this process: nothing left


# --- notebook 08: distributed serving -------------------------------------------------------------------------------

def test_tp8_allreduce_bytes(capsys):
    """learner-review-1's wrong answers: the lesson's TP=8 x PP=2 row (63 layers) named as such, not "all-reduces
    twice"; a fallback that states no number (it stated the whole formula); MiB for bytes."""
    expected = int(126 * 2 * 2 * 7 / 8 * MESSAGE_405B)
    assert expected == 14_450_688

    def wrong(value, hint):
        not_yet(check.tp8_allreduce_bytes, value, hint=hint, hides=expected)

    wrong(7_225_344, "that is one stage of TP=8 x PP=2")  # the lesson's value (63 layers); one all-reduce a layer
    wrong(252 * MESSAGE_405B, "each GPU sends 2 x (TP-1)/TP of the message")
    wrong(2 * expected, "the hidden state travels in bf16")
    wrong(expected * 80 // 126, "that is 70B's 80 layers")
    for other in (expected // 8, expected * 8, expected + 1):  # a wrong answer it does not name
        wrong(other, "per GPU it is all-reduces per layer x layers x the ring's share of the message")
    wrong(round(expected / 2**20, 2), "that is MiB (or MB); the question asks for bytes")
    assert "14,450,688 bytes" in right(capsys, check.tp8_allreduce_bytes, expected)
    right(capsys, check.tp8_allreduce_bytes, np.int64(expected))


def test_tp_link_times(capsys):
    """Per direction: NVLink 450e9 B/s (900 GB/s counts both ways); between nodes 8 ports x 50e9 B/s."""
    b8 = 2 * 126 * 2 * 7 / 8 * MESSAGE_405B
    b16 = 2 * 126 * 2 * 15 / 16 * MESSAGE_405B
    tp8, tp16 = b8 / 450e9 * 1e6, b16 / 400e9 * 1e6
    assert (round(tp8, 1), round(tp16, 1)) == (32.1, 38.7)
    not_yet(check.tp_link_times, tp8 / 1e6, tp16, hint="that looks like seconds")
    not_yet(check.tp_link_times, b8 / 900e9 * 1e6, b16 / 50e9 * 1e6,  # the model this course used to teach
            hint="900 GB/s is NVLink's figure for both directions together")
    not_yet(check.tp_link_times, tp8, tp16 / 1e6, hint="tp16_us looks like seconds")
    not_yet(check.tp_link_times, tp8, b16 / 50e9 * 1e6, hint="50e9 B/s is one InfiniBand port, but each of a node's "
            "8 GPUs has its own")
    not_yet(check.tp_link_times, tp8, b16 / 450e9 * 1e6, hint="the ring runs at its slowest link")
    not_yet(check.tp_link_times, tp8, b8 / 400e9 * 1e6, hint="that is TP=8's traffic")
    not_yet(check.tp_link_times, tp8, "38.7", hint="tp16_us should be a number")
    out = right(capsys, check.tp_link_times, tp8, tp16)
    assert "1.21x" in out and "similar with InfiniBand" in out
    # the check's expected figures are the lesson's
    rows = cluster.tp_vs_pp("llama3.1-405b", [(8, 1), (16, 1)])
    assert [r["tp_us"] for r in rows] == [pytest.approx(tp8), pytest.approx(tp16)]


def test_pp_boundary(capsys):
    """Exercise 3 asks for one GPU's share of a 2,048-token prefill's hand-off (hidden state and residual, split
    over 8 GPUs); the lesson's table prints one token's 65,536 / 8,192 bytes and 0.29 µs."""
    share = 2048 * 2 * MESSAGE_405B // 8
    assert share == 16_777_216
    not_yet(check.pp_boundary, 2 * MESSAGE_405B // 8, 0.16, hint="that is one token")
    not_yet(check.pp_boundary, share * 8, share * 8 / 50e9 * 1e6, hint="what the whole stage sends")
    not_yet(check.pp_boundary, share // 2, share / 100e9 * 1e6, hint="two messages cross for every token")
    not_yet(check.pp_boundary, share + 2, share / 50e9 * 1e6, hint="divided over the 8 GPUs")  # not named
    not_yet(check.pp_boundary, share, share / 50e9, hint="that is seconds: multiply by 1e6")
    not_yet(check.pp_boundary, share, share / 400e9 * 1e6, hint="each GPU sends over its own port")
    out = right(capsys, check.pp_boundary, share, share / 50e9 * 1e6)
    assert "16 MiB per GPU, 336 µs" in out and "882x" in out  # 63 layers x 2 all-reduces x 2 x 7/8, over 1/4


def test_load_eta_minutes(capsys):
    left = 310 / 44 * (191 - 44) / 60
    not_yet(check.load_eta_minutes, 310 / 44 * 191 / 60, hint="that is the whole load")
    not_yet(check.load_eta_minutes, left * 60, hint="that is seconds: divide by 60")
    not_yet(check.load_eta_minutes, 17.3 + 1, hint="the 147 shards left take 147 x 310/44 s")
    assert math.isclose(left, 17.26, abs_tol=0.01)
    right(capsys, check.load_eta_minutes, left)


# --- notebook 09: real GPUs (the committed results) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def results():
    return {r["folder"]: r for r in rehearse.load_results()}


def test_rehearsal_kv_tokens(capsys, results):
    """Exercise 1 predicts the 70B's KV tokens at gpu_memory_utilization 0.95; the lesson prints the 385,680 that
    vLLM logged at 0.9."""
    run = results["h200-llama3.1-70b-tp2"]
    p, length = run["memory_probe"][0], run["max_model_len"]

    def budget(util):
        return memory.kv_budget(p["total"], p["weights"], p["activation_peak"], p["non_torch"], utilization=util)

    per_gpu = memory.kv_bytes_per_token("llama3.1-70b", tp=2)
    good = memory.kv_capacity(budget(0.95), per_gpu, 16, length).tokens
    assert (run["kv_tokens_logged"], good) == (385_680, 431_488)
    whole = memory.kv_capacity(budget(0.95), memory.kv_bytes_per_token("llama3.1-70b"), 16, length).tokens
    not_yet(check.rehearsal_kv_tokens, budget(0.95), run, hint="that is the budget in bytes")
    not_yet(check.rehearsal_kv_tokens, 385_680, run, hint="that is what vLLM logged at gpu_memory_utilization = 0.9")
    not_yet(check.rehearsal_kv_tokens, whole, run, hint="that counts the KV bytes of all 8 KV heads")
    not_yet(check.rehearsal_kv_tokens, int(385_680 * 0.95 / 0.9), run, hint="only the first term of the budget grows")
    not_yet(check.rehearsal_kv_tokens, memory.kv_capacity(budget(1.0), per_gpu, 16, length).tokens, run,
            hint="pass utilization=0.95")
    not_yet(check.rehearsal_kv_tokens, good + 16, run, hint="budget = 0.95 x total")  # a wrong answer not named
    out = right(capsys, check.rehearsal_kv_tokens, good, run)
    assert "431,488 tokens, 45,808 more than the 385,680" in out


def test_rehearsal_roofline_and_tp_per_gpu(capsys, results):
    run = results["h200-llama3.1-70b-tp2"]
    per_gpu = memory.weight_bytes_per_gpu("llama3.1-70b", tp=2)[0]
    not_yet(check.rehearsal_roofline, run["bandwidth_tb_s"] / per_gpu, run, hint="multiply it by 1e12")
    not_yet(check.rehearsal_roofline, run["bandwidth_tb_s"] * 1e12 / (2 * per_gpu), run,
            hint="that divides by the whole model's bytes")
    not_yet(check.rehearsal_roofline, -1, run, hint="should be a positive number")
    right(capsys, check.rehearsal_roofline, run["bandwidth_tb_s"] * 1e12 / per_gpu, run)

    one, two = results["h200-llama3.1-8b-tp1"], results["h200-llama3.1-8b-tp2"]
    a, b = (next(s for s in r["sweep"] if s["concurrency"] == 64)["output_tokens_per_s"] for r in (one, two))
    not_yet(check.rehearsal_tp_per_gpu, b / a, one, two, hint="that is the ratio of the totals")
    not_yet(check.rehearsal_tp_per_gpu, a / (b / 2), one, two, hint="upside down")
    not_yet(check.rehearsal_tp_per_gpu, 0.5, one, two, hint="take output_tokens_per_s at concurrency 64")
    right(capsys, check.rehearsal_tp_per_gpu, b / 2 / a, one, two)


def test_the_job_queue_check_is_quick():
    """The stand-in ask sleeps 20-80 ms: a right answer takes well under a second with 4 workers."""
    start = time.perf_counter()
    check.job_queue(in_order)
    assert time.perf_counter() - start < 5


# --- progress: every verdict recorded, counted per lesson ------------------------------------------------------------

def test_progress_counts_each_lessons_exercises_passed(tmp_path, monkeypatch, capsys):
    from llmlab.check import progress
    from llmlab.ops.cli import main

    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("LLMLAB_PROGRESS_FILE", raising=False)
    sweep = pd.DataFrame({"output_tokens_per_s": [100.0, 700.0, 900.0, 1000.0]},
                         index=pd.Index([1, 8, 64, 256], name="concurrency"))
    not_yet(check.knee, 8, sweep, hint="take the smallest concurrency")
    right(capsys, check.knee, 64, sweep)
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/me/course/exercises/01_memory_arithmetic.ipynb")
    not_yet(check.kv_405b, 1, 1, hint="Not yet")  # tried in notebook 01, not passed
    verdicts = [(a["check"], a["ok"], a.get("notebook")) for a in progress.attempts()]
    assert verdicts == [("knee", False, None), ("knee", True, None), ("kv_405b", False, "01_memory_arithmetic")]
    rows = {r["lesson"]: r for r in progress.table()}
    assert set(rows) == {p.stem for p in (progress.COURSE / "exercises").glob("[0-9][0-9]_*.ipynb")}
    assert (rows["06_threaded_requests"]["passed"], rows["06_threaded_requests"]["total"]) == (1, 5)
    assert rows["06_threaded_requests"]["not yet"] == ["job_queue", "tpot_by_hand", "resumed", "goodput"]
    assert rows["01_memory_arithmetic"]["passed"] == 0 and rows["01_memory_arithmetic"]["last attempt"] != "-"
    assert rows["03_online_inference"]["last attempt"] == "-"
    (tmp_path / "progress.jsonl").open("a").write('{"check": "kn')  # a write cut short: skipped, not fatal
    assert main(["progress"]) == 0
    out = capsys.readouterr().out
    assert "06_threaded_requests" in out and "1 / 5" in out and "job_queue" in out


def test_a_room_collects_only_the_tables_its_learners_hand_in(tmp_path, monkeypatch, capsys):
    """Opt-in: a learner's `llmlab progress --hand-in DIR` puts their table -- no key, no answer -- in the room's
    folder as `<their UNIX name>.json` (whatever $USER says), readable by the group only; the instructor's
    `--room DIR` shows a learner a line.  (Two learners of two UNIX users: tests/cluster/test_progress_room.py.)"""
    import json
    import stat

    from llmlab.check import progress
    from llmlab.ops.cli import main

    me = progress.learner_name()
    folder = tmp_path / "room"
    folder.mkdir()
    folder.chmod(0o3770)  # the workshop's recipe: group-writable, sticky
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setenv("USER", "someone-else")  # anyone can set it: the name comes from the real uid
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "api_key").write_text("sk-secret-of-mine")  # what must never leave the home
    sweep = pd.DataFrame({"output_tokens_per_s": [100.0, 700.0, 900.0, 1000.0]},
                         index=pd.Index([1, 8, 64, 256], name="concurrency"))
    right(capsys, check.knee, 64, sweep)
    for _ in range(2):  # the second replaces the first
        path = progress.hand_in(folder)
    assert path == folder / f"{me}.json" and sorted(p.name for p in folder.iterdir()) == [f"{me}.json"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    handed = path.read_text()
    assert "secret" not in handed and set(json.loads(handed)) == {"user", "handed in", "lessons"}
    (folder / "someone-else.json").write_text(handed)  # a second file of the same user: not a second learner
    capsys.readouterr()
    rows = progress.room(folder)
    assert [r["user"] for r in rows] == [me]
    assert rows[0]["06_threaded_requests"] == "1/5" and rows[0]["passed"] == 1 and rows[0]["total"] > 20
    assert main(["progress", "--room", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["user", "the", "path", "all"] and out[1].startswith(me)
    # the path's lessons only (issue 47: the whole course's 19 columns buried the 8 a room is taught): 06's 1 of 5
    # counts toward the path's and the course's totals alike
    assert out[0].split()[6:] == [k[:2] for k in course.path_lessons()] and "06" in out[0] and "07" not in out[0]
    path_total = sum(r["total"] for r in progress.table() if r["lesson"] in course.path_lessons())
    assert out[1].split()[1:7] == ["1", "/", str(path_total), "1", "/", str(rows[0]["total"])]
    assert out[2].startswith("(the path: the lessons of the workshop's path")
    assert out[3] == f"skipped someone-else.json: it belongs to {me}, and only {me}.json can be theirs"
    assert main(["progress", "--room", str(folder), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [r["user"] for r in json.loads(out)] == [me] and "skipped someone-else.json" in err
    assert main(["progress", "--hand-in", str(tmp_path / "nowhere")]) == 2
    assert "ask your instructor for the room's progress folder" in capsys.readouterr().err
    assert progress.show_room(tmp_path / "bob", []).startswith("nobody has handed in yet")


def test_a_hand_in_folder_others_can_write_but_not_sticky_is_refused(tmp_path, monkeypatch, capsys):
    """Finding 1 of security-review-2: in a group-writable folder without the sticky bit (the old recipe, 2770) any
    learner can replace another's file or plant names before them; the hand-in refuses it and names the fix."""
    from llmlab.ops.cli import main

    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))
    folder = tmp_path / "room"
    folder.mkdir()
    for mode in (0o2770, 0o0777):
        folder.chmod(mode)
        assert main(["progress", "--hand-in", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err == (f"llmlab: {folder} is writable by other users but not sticky, so another learner could replace "
                       f"or pre-plant your file: ask your instructor to run `chmod 3770 {folder}`.\n")
        assert list(folder.iterdir()) == []
    folder.chmod(0o3770)
    assert main(["progress", "--hand-in", str(folder)]) == 0


def test_the_room_trusts_no_file_in_its_folder(tmp_path):
    """Finding 4 of security-review-2, the cases one UNIX user can make (impersonation by another user:
    tests/cluster/test_progress_room.py): a FIFO must not hang the room, a symlink to /dev/zero must not be read,
    a file of another shape is skipped with a note, never a traceback, one over 64 KiB is not read, and escape
    sequences in a file or its name never reach the instructor's terminal."""
    import json
    import os
    import threading

    from llmlab.check import progress

    me = progress.learner_name()
    folder = tmp_path / "room"
    folder.mkdir()
    good = {"user": "the instructor \x1b[2J", "handed in": "\x1b]0;pwned\x07now",
            "lessons": [{"lesson": "06_threaded_requests", "passed": 2, "total": 5}]}
    mine = folder / f"{me}.json"

    def room_of(content) -> tuple[list[dict], str]:
        if content is not ...:  # ...: the folder as it is
            mine.unlink(missing_ok=True)
            mine.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
        found = []
        reader = threading.Thread(target=lambda: found.append((progress.room(folder), progress.show_room(folder, []))),
                                  daemon=True)
        reader.start()
        reader.join(20)
        assert not reader.is_alive(), "the room's view hangs"
        return found[0]

    rows, text = room_of(good)
    assert rows == [{"user": me, "passed": 2, "total": 5, "handed in": "?]0;pwned?now", "06_threaded_requests": "2/5"}]
    assert "\x1b" not in text and "\x07" not in text and "instructor" not in text
    for bad, why in (({"lessons": [{}]}, "lesson 1 has no lesson name"), (["a", "list"], "no list of at most"),
                     ({"lessons": [{"lesson": "06_x", "passed": 9, "total": 5}]}, "lesson 1 has no counts"),
                     ({"lessons": [{"lesson": "06_x\x1b[31m", "passed": 1, "total": 5}]}, "no lesson name"),
                     ({"lessons": [{"lesson": "06_x", "passed": "1", "total": 5}]}, "no counts"),
                     (b'{"lessons": [', "not JSON"), (b"\xff\xfe", "not JSON"),
                     (b" " * (64 * 1024) + json.dumps(good).encode(), "larger than 64 KiB")):
        rows, text = room_of(bad)
        assert rows == [] and text.splitlines()[1].startswith(f"skipped {me}.json: ") and why in text, (bad, text)
    mine.unlink()
    os.mkfifo(mine)  # named after its owner: opened (without blocking), then refused
    os.mkfifo(folder / "fifo.json")
    (folder / "zero.json").symlink_to("/dev/zero")
    (folder / "\x1b[2J\x1b]0;pwned\x07.json").write_text("{}")
    rows, text = room_of(...)
    assert rows == [] and "\x1b" not in text and "\x07" not in text
    notes = set(text.splitlines()[1:])
    assert {f"skipped {me}.json: not a regular file", "skipped fifo.json: not a regular file",
            "skipped zero.json: a symbolic link"} < notes and len(notes) == 4
    for n in range(30):
        (folder / f"planted-{n:02}.json").write_text("{}")
    notes = room_of(...)[1].splitlines()[1:]
    assert len(notes) == 21 and notes[-1] == "... and 14 more files skipped"  # a flood of files costs one line


def test_structured_output_checks_name_what_is_wrong(capsys):
    """Notebook 10's checks: a pattern must take numbered books and verse ranges (the lesson's does neither), be
    bounded, and the answer finished; a reference as compact JSON, parsed."""
    good = r"([1-3] )?[A-Z][a-z]{1,12} [0-9]{1,3}:[0-9]{1,3}(-[0-9]{1,3})?"
    right(capsys, check.verse_regex, good, "Judah 12:4", "stop")
    right(capsys, check.verse_regex, good, "1 Kings 2:3-5", "stop")
    lesson = r"[A-Z][a-z]{1,10} [0-9]{1,3}:[0-9]{1,3}"  # lesson 10's own pattern, copied
    not_yet(check.verse_regex, lesson, "Judah 12:4", "stop", hint="does not match '1 Kings 2:3'")
    not_yet(check.verse_regex, r"([1-3] )?[A-Z][a-z]{1,12} [0-9]{1,3}:[0-9]{1,3}", "Judah 12:4", "stop",
            hint="does not match 'John 3:16-18'")
    not_yet(check.verse_regex, r"([0-9] )?[A-Z][a-z]{1,12} [0-9]{1,3}:[0-9]{1,3}(-[0-9]{1,3})?", "Judah 12:4", "stop",
            hint="'4 Kings 1:1'")
    not_yet(check.verse_regex, r"([1-3] )?[A-Za-z]{1,12} [0-9]{1,3}:[0-9]{1,3}(-[0-9]{1,3})?", "Judah 12:4", "stop",
            hint="'john 3:16'")
    not_yet(check.verse_regex, r"([1-3] )?[A-Z][a-z]+ [0-9]+:[0-9]+(-[0-9]+)?", "Judah 12:4", "stop",
            hint="bound every repetition")
    not_yet(check.verse_regex, r"([1-3] )?[A-Z][a-z]{1,} [0-9]{1,3}:[0-9]{1,3}(-[0-9]{1,3})?", "Judah 12:4", "stop",
            hint="bound every repetition")  # {1,} is as open as +
    not_yet(check.verse_regex, good, "Judahite", "length", hint="does not match your pattern")
    not_yet(check.verse_regex, good, "Judah 12:4", "length", hint="the answer was cut")
    ref = '{"book": "John", "chapter": 3, "verse": 16}'
    right(capsys, check.parsed_reference, {"book": "John", "chapter": 3, "verse": 16}, ref)
    not_yet(check.parsed_reference, ref, ref, hint="json.loads")
    not_yet(check.parsed_reference, {"name": "Elijah", "age": 40}, '{"name": "Elijah", "age": 40}',
            hint="book, chapter and verse")  # the lesson's object
    not_yet(check.parsed_reference, {"book": "John", "chapter": "3", "verse": 16},
            '{"book": "John", "chapter": "3", "verse": 16}', hint="not a string in quotes")
    not_yet(check.parsed_reference, {"book": "John", "chapter": 3, "verse": 16},
            '{ "book": "John", "chapter": 3, "verse": 16}', hint="not the compact layout")


# --- notebook 11: quantization ------------------------------------------------------------------------------------

def test_fp8_kv_tokens_check_names_each_mistake(capsys):
    """Llama 3.1 8B, 6 GiB, fp8: 65,536 bytes a token, 98,304 tokens (the lesson printed the tiny model's 2,097,152)."""
    for wrong, hint in ((49_152, "the 8B's bf16 cache"), (24_576, "4 bytes per value"),
                        (65_536, "the bytes one token takes"), (91_552, "GiB (2**30 bytes), not GB"),
                        (91_520, "not GB"), (196_608, "K and V are both stored"), (98_304.5, "whole number"),
                        (2_097_152, "the lesson's tiny model"), (100_000, "32 layers x 2 (K and V)")):
        not_yet(check.fp8_kv_tokens, wrong, hint=hint)
    assert right(capsys, check.fp8_kv_tokens, 98_304).startswith("Right: 98,304 tokens, 65,536 bytes each: 12 requests")


def test_h100s_for_405b_fp8_check_names_each_mistake(capsys):
    params = memory.param_count("llama3.1-405b")
    for answer, hint in (((2 * params, 6), "that is bf16"), ((405 * 10**9, 6), "rounded name"),
                         ((params + 1, 6), "expected 1 byte"), ((params, 12), "the bf16 count"),
                         ((params, 5), "do not hold the weights"), ((params, 7), "but fewer do")):
        not_yet(check.h100s_for_405b_fp8, *answer, hint=hint)
    assert right(capsys, check.h100s_for_405b_fp8, params, 6).startswith("Right: 405.9 GB on 6 H100s")


def test_step_overhead_check_names_each_mistake(capsys):
    table = quantization.gpu_table()
    step, reading = 1000 / table["batch 1 tok/s"], 1000 / table["ceiling tok/s"]
    extra = step - reading
    b, f = extra["bf16"], extra["fp8 weights"]
    for answer, hint in (((step["bf16"], f), "is the whole step"), ((b, reading["fp8 weights"]), "reading time alone"),
                         ((-b, f), "is negative"), ((b / 1000, f), "looks like seconds"), ((b, f + 0.3), "from the")):
        not_yet(check.step_overhead, *answer, hint=hint)
    out = right(capsys, check.step_overhead, b, f)
    assert out.startswith("Right: 1.32 ms in bf16 and 1.49 ms with fp8 weights"), out


# --- notebook 12: speculative decoding ---------------------------------------------------------------------------

def test_speculative_decoding_checks_name_what_is_wrong(capsys):
    """Notebook 12's checks: rates from the counters (per token drafted, per pass), and the formula's sum."""
    from llmlab.serve.metrics import Counters

    before = Counters(accepted_at=(0,) * 4)
    after = Counters(drafts=10, draft_tokens=40, accepted=25, generated=60, accepted_at=(8, 7, 5, 5))
    # 60 tokens in 35 passes: 25 passes saved of 60 (42 %); 40 drafted, 25 kept, 15 verified for nothing
    right(capsys, check.spec_savings, 25 / 60, 15, before, after)
    not_yet(check.spec_savings, 25 / 40, 15, before, after, hint="that is the acceptance rate")
    not_yet(check.spec_savings, 35 / 60, 15, before, after, hint="the model still ran")
    not_yet(check.spec_savings, 25 / 35, 15, before, after, hint="each accepted draft token is a pass not run")
    not_yet(check.spec_savings, 25 / 60, 25, before, after, hint="the model kept")
    not_yet(check.spec_savings, 25 / 60, 40, before, after, hint="subtract them")
    not_yet(check.spec_savings, 25 / 60, 10, before, after, hint="verified 40 drafted tokens and kept 25")
    not_yet(check.spec_savings, 0.5, 1.0, before, Counters(generated=5), hint="counted no drafts")
    per_step = [sum(0.6 ** i for i in range(k + 1)) for k in range(1, 9)]
    right(capsys, check.draft_length, per_step, 5)
    not_yet(check.draft_length, per_step[:4], 5, hint="a list of 8 numbers")
    not_yet(check.draft_length, [0.6 ** k for k in range(1, 9)], 5, hint="the whole draft is accepted")
    not_yet(check.draft_length, [v - 1 for v in per_step], 5, hint="one token of the model's own")
    not_yet(check.draft_length, per_step[:2] + [2.0] + per_step[3:], 5, hint="for k = 3 expect")
    not_yet(check.draft_length, per_step, 4, hint="a longer draft is needed")
    not_yet(check.draft_length, per_step, 8, hint="k = 5 already gives")
    not_yet(check.draft_length, per_step, 9, hint="one of 1 to 8")


# --- notebook 13: prefix caching and chunked prefill at scale ----------------------------------------------------

def test_prefix_caching_at_scale_checks_name_what_is_wrong(capsys):
    """Notebook 13's checks: the room's hit rate from its requests' usage, a GPU room's blocks (shared counted once)."""
    from llmlab.loadtest import LoadResult, Record
    from llmlab.prefixcache import Room
    from llmlab.serve.metrics import Counters

    def room_of(records) -> Room:  # what run_room returns, its server figures left empty: the check reads records
        result = LoadResult(records, concurrency=max(1, len(records)))
        return Room(result, result.summary(), 0, True, 0, 0, 0, False, Counters(), [""] * len(records))

    room = room_of([Record(id=i, prompt_tokens=410, cached_tokens=0 if i == 0 else 384) for i in range(10)])
    # the room: 4,100 sent, 3,456 found
    right(capsys, check.room_hit_rate, 3456 / 4100, 644, room)
    not_yet(check.room_hit_rate, 4100 / 3456, 644, room, hint="looked-up / found")
    not_yet(check.room_hit_rate, 100 * 3456 / 4100, 644, room, hint="not a percentage")
    not_yet(check.room_hit_rate, 0.5, 644, room, hint="found / sent")
    not_yet(check.room_hit_rate, 3456 / 4100, 3456, room, hint="the server computed the others")
    not_yet(check.room_hit_rate, 3456 / 4100, 600, room, hint="were not computed again")
    not_yet(check.room_hit_rate, 0.5, 10, room_of([]), hint="hold no prompt tokens")
    # 24 requests of 1,556 + 299 tokens: 116 blocks each; the 23 later ones find 93 whole system-prompt blocks
    right(capsys, check.room_blocks, 24 * 116 - 23 * 93, 24 * 116)
    not_yet(check.room_blocks, 645, 2783, hint="round up per request")
    not_yet(check.room_blocks, 645, 2760, hint="blocks_for(1556 + 300 - 1, 16) = 116")
    not_yet(check.room_blocks, 2784, 2784, hint="held once, not 24 times")
    not_yet(check.room_blocks, 24 * 116 - 24 * 93, 2784, hint="the first learner's request computes")
    not_yet(check.room_blocks, 24 * 116 - 23 * 94, 2784, hint="only *full* blocks are shared")
    not_yet(check.room_blocks, 605, 4230, hint="the lesson's room's blocks")  # copied from lesson 13's output
    not_yet(check.room_blocks, 600, 2784, hint="less the 93 whole system-prompt blocks")
    not_yet(check.room_blocks, 645.5, 2784, hint="whole number")


# --- notebook 14: determinism -------------------------------------------------------------------------------------

def test_determinism_checks_name_what_is_wrong(capsys):
    """Notebook 14's checks: the first batch whose row 0 moves (1-based, the smallest), and a seed that repeats."""
    from llmlab import determinism

    want = determinism.first_varying_batch(16, 512, 512, seed=1)
    right(capsys, check.first_varying_batch, want)
    if want is not None:
        not_yet(check.first_varying_batch, None, hint="row 0 does change on this machine")
        if want > 1:
            not_yet(check.first_varying_batch, want - 1, hint="0-based index")
        not_yet(check.first_varying_batch, want + 1, hint="already differs with fewer rows")
    three = ["a b", "c d", "e f"]  # one request, n=3, seed=7: the choices drew with seeds 7, 8 and 9
    right(capsys, check.seeded_choice, three, 9, "e f")
    not_yet(check.seeded_choice, three, 7, "a b", hint="repeats the first choice")
    not_yet(check.seeded_choice, three, 8, "c d", hint="the third choice, index 2, drew with 7 + 2")
    not_yet(check.seeded_choice, three, 9, "a b", hint="should be the third choice")
    not_yet(check.seeded_choice, ["a b"] * 3, 9, "a b", hint="temperature=1.0")
    not_yet(check.seeded_choice, three[:2], 9, "e f", hint="the three texts")
    not_yet(check.seeded_choice, three, 9, None, hint="the text of your single request")


# --- notebook 15: replicas behind a router ------------------------------------------------------------------------

def test_replica_checks_name_what_is_wrong(capsys):
    """Notebook 15's checks: one replica's and the TP=2 engine's KV pools and the 8k requests each layout holds, and
    the cold prefills of a room dealt in turn and routed by prefix."""
    from llmlab import memory, replicas

    pools = {tp: memory.layout_fit(memory.model_spec("llama3.1-8b"), tp, 1, memory.gpu("H200"), dtype="bfloat16",
                                   context=32768).kv_blocks * 16 for tp in (1, 2)}
    one, two, n = pools[1], pools[2], 32768
    assert (one, two, 2 * (one // n), two // n) == (883_680, 1_889_888, 52, 57)
    right(capsys, check.replica_kv, one, two, 2 * (one // n), two // n)
    not_yet(check.replica_kv, 436_656, 995_856, 26, 30, hint="an H100's pool, as the lesson printed it")
    not_yet(check.replica_kv, 2 * one, two, 2 * (one // n), two // n, hint="do not pool their caches")
    not_yet(check.replica_kv, one, two // 2, 2 * (one // n), two // n, hint="kv_blocks already counts")
    not_yet(check.replica_kv, one, two, one // n, two // n, hint="counts both replicas")
    not_yet(check.replica_kv, one, two, 2 * (one // n), two // n + 1, hint=f"hold {two // n} requests")


    courses = ["A", "B", "C", "D"]
    prompts = replicas.course_prompts(courses, 6)
    homes = replicas.homes(prompts, ["workshop-salt"] * len(prompts), 2)
    split = [homes.count(0), homes.count(1)]
    right(capsys, check.cold_prefills, 4, 4, split)
    not_yet(check.cold_prefills, 8, 4, split, hint="not every course lands on both replicas")
    not_yet(check.cold_prefills, 4, 8, split, hint="computed once there")
    not_yet(check.cold_prefills, 4, 4, split[::-1] if split[0] != split[1] else [0, 24], hint="replica 0 first")
    not_yet(check.cold_prefills, 4, 4, 24, hint="a list of two counts")


def test_replica_crossover_check_names_each_mistake(capsys):
    for answer, hint in (((100, 14870.5, 8011), "one of the measured levels"), ((128, 14870.5, 8011), "still ahead"),
                         ((256, 29741, 16022), "divide by 2"), ((256, 14640.5, 8011), "replicas_per_gpu"),
                         ((256, 14870.5, 8568), "tp2_per_gpu")):
        not_yet(check.replica_crossover, *answer, hint=hint)
    assert right(capsys, check.replica_crossover, 256, 14870.5, 8011).startswith("Right: from 256 in flight: 14,870")


def test_progress_outlives_a_session_whose_llmlab_home_is_its_own(tmp_path, monkeypatch, capsys):
    """OnDemand's tiny-model session gives llmlab a home of its own (its server's files) and points
    LLMLAB_PROGRESS_FILE at the learner's usual one (issue 47: progress started over with each session)."""
    from llmlab.check import progress

    kept = tmp_path / "home" / ".llmlab" / "progress.jsonl"
    kept.parent.mkdir(parents=True)
    monkeypatch.setenv("LLMLAB_PROGRESS_FILE", str(kept))
    for session in ("session-1", "session-2"):
        monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / session / "llmlab-home"))
        right(capsys, check.knee, 64, pd.DataFrame({"output_tokens_per_s": [100.0, 700.0, 900.0, 1000.0]},
                                                   index=pd.Index([1, 8, 64, 256], name="concurrency")))
    assert [a["check"] for a in progress.attempts()] == ["knee", "knee"]
    assert not (tmp_path / "session-1" / "llmlab-home" / "progress.jsonl").exists()


def test_in_a_room_each_check_hands_the_table_in_by_itself(tmp_path, monkeypatch, capsys):
    """Issue 47: with a ``progress`` folder beside the workshop's server.json (or LLMLAB_PROGRESS_DIR), a check cell
    hands the learner's table in -- no key, no answer -- without a command to remember; without one, nothing."""
    import json

    from llmlab.check import progress

    share = tmp_path / "ws"
    (share / "progress").mkdir(parents=True)
    (share / "progress").chmod(0o3770)
    monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLMLAB_PROGRESS_FILE", raising=False)
    monkeypatch.delenv("LLMLAB_PROGRESS_DIR", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    (tmp_path / "home").mkdir()
    sweep = pd.DataFrame({"output_tokens_per_s": [100.0, 700.0, 900.0, 1000.0]},
                         index=pd.Index([1, 8, 64, 256], name="concurrency"))
    monkeypatch.delenv("LLMLAB_CONNECTION_FILE", raising=False)
    right(capsys, check.knee, 64, sweep)
    assert list((share / "progress").iterdir()) == []  # not in a room: nothing leaves the home
    monkeypatch.setenv("LLMLAB_CONNECTION_FILE", str(share / "server.json"))
    right(capsys, check.knee, 64, sweep)
    handed = json.loads((share / "progress" / f"{progress.learner_name()}.json").read_text())
    assert {r["lesson"]: r["passed"] for r in handed["lessons"]}["06_threaded_requests"] == 1
    (share / "progress").chmod(0o777)  # not sticky: the hand-in refuses it, the check still answers
    right(capsys, check.knee, 64, sweep)



def test_a_wrong_answer_in_jupyter_shows_one_line_and_never_the_checks_source(capsys):
    """Issue 51: IPython printed a ~25-line traceback through the course's internals before the hint, with the
    check's source around the failure -- lines that compute the answer (01 Ex 2's memory.gpus_needed(...)).  The
    cell still fails (an error, as nbval sees it); what it shows is the hint alone."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    result = shell.run_cell("import llmlab.check\nllmlab.check.h100s_for_405b(11.07, 11)")
    shown = capsys.readouterr().out.strip().splitlines()
    assert not result.success and isinstance(result.error_in_exec, check.NotYet)
    assert len(shown) == 1 and shown[0].startswith("Not yet:"), shown
    assert "gpus_needed" not in "\n".join(shown) and "Traceback" not in shown[0]
