"""KV caching (llmlab.kvcache): numpy attention, paged-block arithmetic, the Prometheus parser, greedy decoding
with and without transformers' cache, and vLLM's prefix cache seen through the live server's /metrics.

Pure tests take a second; the transformers tests use a randomly initialised Llama of the tiny model's shape
(and the shipped weights when they are there); the ``server`` tests use the session's embedded vLLM server.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_kvcache.py (the tests that start the real engine).
"""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from llmlab import kvcache as kc
from llmlab import memory

FIXTURES = Path(__file__).parents[1] / "fixtures"
TINY_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True, rms_norm_eps=1e-5)


# --- numpy attention ---------------------------------------------------------------------------------

def test_attend_is_softmax_of_scaled_scores_with_a_causal_mask():
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=(5, 4)) for _ in range(3))
    out = kc.attend(q, k, v)
    for i in range(5):  # row by row, the textbook formula over keys 0..i
        s = q[i] @ k[: i + 1].T / 2.0
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        assert np.allclose(out[i], w @ v[: i + 1])


def test_one_query_against_a_cache_sees_every_cached_key():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(1, 4)), rng.normal(size=(7, 4)), rng.normal(size=(7, 4))
    s = (q @ k.T / 2.0)[0]
    w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert np.allclose(kc.attend(q, k, v)[0], w @ v)


def test_cached_and_uncached_decoding_give_the_same_outputs_with_linear_vs_quadratic_work():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(24, 16))
    wq, wk, wv = (rng.normal(size=(16, 8)) for _ in range(3))
    slow, slow_work = kc.decode_uncached(x, wq, wk, wv)
    fast, fast_work, (k_cache, v_cache) = kc.decode_cached(x, wq, wk, wv)
    assert np.allclose(slow, fast, atol=1e-12)
    assert np.allclose(slow, kc.attend(x @ wq, x @ wk, x @ wv))  # and both equal one causal pass
    assert (slow_work, fast_work) == (3 * 24 * 25 // 2, 3 * 24)
    assert k_cache.shape == v_cache.shape == (24, 8) and np.allclose(k_cache, x @ wk)


def test_tokens_processed_counts_the_prompt_once_with_the_cache():
    assert kc.tokens_processed(100, 1, True) == kc.tokens_processed(100, 1, False) == 100
    assert kc.tokens_processed(100, 10, True) == 109
    assert kc.tokens_processed(100, 10, False) == sum(range(100, 110))
    assert kc.tokens_processed(5, 0, False) == 0
    with pytest.raises(ValueError):
        kc.tokens_processed(0, 3, True)


# --- blocks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,block,expected", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2),
                                                   (1000, 16, 63), (1000, 128, 8), (512, 128, 4)])
def test_blocks_round_up(tokens, block, expected):
    assert kc.blocks_for(tokens, block) == expected


def test_blocks_reject_nonsense():
    with pytest.raises(ValueError):
        kc.blocks_for(-1)
    with pytest.raises(ValueError):
        kc.blocks_for(10, 0)


def test_allocator_hands_out_blocks_as_tokens_fill_them_and_tables_interleave():
    pool = kc.BlockAllocator(num_blocks=8, block_size=4)
    assert pool.append("a", 5) == [0, 1]          # a 5-token prompt: two blocks
    assert pool.append("b", 3) == [2]
    assert pool.append("a", 3) == [0, 1]          # tokens 6..8 fit in a's second block
    assert pool.append("a", 1) == [0, 1, 3]       # token 9 opens a third block, after b's
    assert pool.slot("a", 8) == (3, 0) and pool.slot("a", 4) == (1, 0)
    assert pool.used_blocks == 4 and pool.usage == 0.5
    pool.release("a")
    assert pool.used_blocks == 1 and pool.append("c", 12) == [4, 5, 6]
    with pytest.raises(MemoryError, match="needs 5 more blocks, 4 free"):
        pool.append("d", 20)
    with pytest.raises(IndexError):
        pool.slot("b", 3)


def test_paging_wastes_under_one_block_per_request_where_max_length_wastes_most():
    lengths = [37, 512, 100, 2048, 5, 900]
    table = kc.allocation_table(lengths, max_len=2048, block_size=16)
    assert (table["paged waste"] < 16).all() and (table["blocks"] == [3, 32, 7, 128, 1, 57]).all()
    s = kc.waste_summary(lengths, max_len=2048, block_size=16)
    assert s["used"] == sum(lengths) and s["naive_reserved"] == 6 * 2048
    assert s["paged_reserved"] == 16 * (3 + 32 + 7 + 128 + 1 + 57)
    assert s["naive_waste"] == pytest.approx(1 - 3602 / 12288) and s["paged_waste"] < 0.02
    with pytest.raises(ValueError, match="max_len"):
        kc.allocation_table([3000], max_len=2048)


def test_a_pool_holds_more_requests_when_paged():
    lengths = [100] * 50
    assert kc.requests_that_fit(8192, lengths, max_len=2048, block_size=16) == (4, 50)  # all 50 (73 would fit)
    assert kc.requests_that_fit(4096, lengths, max_len=2048, block_size=16) == (2, 36)  # 36 x 112 <= 4096


@pytest.mark.parametrize("prompt,shared,block,hit", [
    (400, 400, 128, 384),   # the same prompt twice: all whole blocks
    (384, 384, 128, 256),   # exactly 3 blocks, but the last token is always recomputed
    (500, 300, 128, 256),   # a 300-token shared prefix: its 2 whole blocks
    (100, 100, 128, 0),     # shorter than one block: nothing to reuse
    (100, 100, 16, 96),
    (1, 1, 16, 0),
])
def test_prefix_cache_reuses_whole_blocks_and_never_the_last_token(prompt, shared, block, hit):
    assert kc.prefix_cache_hit_tokens(prompt, shared, block) == hit


# --- Prometheus text ---------------------------------------------------------------------------------

EXPOSITION = r"""# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llmlab-tiny"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="llmlab-tiny"} 300.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llmlab-tiny"} 768.0
vllm:prefix_cache_hits_created{engine="0",model_name="llmlab-tiny"} 1.7640e+09
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llmlab-tiny"} 0.0009770395701025891
vllm:prompt_tokens_total{engine="0",model_name="llmlab-tiny"} 1500.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="llmlab-tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="llmlab-tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llmlab-tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llmlab-tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llmlab-tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llmlab-tiny"} 0.25
vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",num_cpu_blocks="None",\
num_gpu_blocks="4096"} 1.0
odd_label{path="C:\\dir",quote="say \"hi\"",nl="a\nb" , } NaN 1700000000000
neg -Inf
""".replace("\\\n", "")


def test_prometheus_parser_reads_names_labels_values_and_escapes():
    m = kc.parse_prometheus(EXPOSITION)
    assert m.types["vllm:prefix_cache_queries_total"] == "counter"
    assert m.value(kc.PREFIX_QUERIES) == 1500.0                       # summed over both engines
    assert m.value(kc.PREFIX_QUERIES, engine=1) == 300.0             # or one of them
    assert m.value("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 4.0
    odd = m["odd_label"][0]
    assert odd.labels == {"path": "C:\\dir", "quote": 'say "hi"', "nl": "a\nb"} and math.isnan(odd.value)
    assert m.value("neg") == -math.inf
    assert m.labels(kc.CACHE_CONFIG)["num_gpu_blocks"] == "4096"


def test_prometheus_parser_names_a_bad_line_and_a_missing_metric():
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        kc.parse_prometheus("good 1\nthis is not a metric line\n")
    with pytest.raises(ValueError, match="not a number"):
        kc.parse_prometheus("x{a=\"1\"} lots\n")
    with pytest.raises(ValueError, match="labels"):
        kc.parse_prometheus("x{a=1} 2\n")
    m = kc.parse_prometheus(EXPOSITION)
    with pytest.raises(KeyError, match="similar: vllm:prefix_cache"):
        m.value("vllm:prefix_cache_queries")                          # the name without _total
    assert m.value("absent", default=0.0) == 0.0


def test_counters_of_a_scrape_and_their_difference():
    from llmlab.serve.metrics import Histogram

    m = kc.parse_prometheus(EXPOSITION)
    snap = kc.read_counters(m)
    assert (snap.prefix_queries, snap.prefix_hits) == (1500, 768)
    assert (snap.block_size, snap.num_gpu_blocks, snap.prefix_caching) == (128, 4096, True)
    assert snap.num_cpu_blocks is None and snap.finished == 4
    later = dataclasses.replace(snap, prefix_queries=1900, prefix_hits=1152, kv_usage=0.0,
                                ttft=Histogram({le: n + 1 for le, n in snap.ttft.buckets.items()}, 0.3,
                                                  snap.ttft.count + 1))
    d = later - snap
    assert (d.prefix_queries, d.prefix_hits, d.finished) == (400, 384, 0)
    assert d.ttft.sum == pytest.approx(0.05) and d.ttft.count == 1
    assert d.kv_usage == 0.0 and d.num_gpu_blocks == 4096   # gauges and the configuration: the later scrape's
    assert not later.restarted_since(snap) and snap.restarted_since(later)


def test_a_histogram_between_two_scrapes_is_their_difference_with_an_exact_mean_and_a_bucketed_p50():
    """vLLM 0.26's real TTFT histogram (the committed fixture), then 40 more requests, 10 at or below 20 ms and 30 in
    (20, 40] ms, taking 1 s in all: what a benchmark reads for its own run (benchmarks/loadtest_parity_on_gpu.py)."""
    from llmlab.serve.metrics import histogram

    first = kc.parse_prometheus((FIXTURES / "vllm" / "0.26.0" / "metrics.txt").read_text())
    before = histogram(first, kc.TTFT)
    assert (before.count, before.buckets[0.02], before.buckets[0.04], before.buckets[math.inf]) == (160, 12, 51, 160)

    def grown(s: kc.Sample) -> kc.Sample:
        if s.name == kc.TTFT + "_bucket":
            le = float(s.labels["le"])
            return kc.Sample(s.name, s.labels, s.value + (0 if le < 0.02 else 10 if le < 0.04 else 40))
        add = {kc.TTFT + "_count": 40, kc.TTFT + "_sum": 1.0}.get(s.name, 0)
        return kc.Sample(s.name, s.labels, s.value + add)

    run = histogram(kc.Metrics([grown(s) for s in first.samples], first.types), kc.TTFT) - before
    assert run.count == 40 and run.mean == pytest.approx(0.025)          # 1 s / 40: exact
    assert run.buckets[0.01] == 0 and run.buckets[0.02] == 10 and run.buckets[0.04] == 40 == run.buckets[math.inf]
    assert run.bucket_of(0.5) == (0.02, 0.04)                           # the 20th of 40 is in (20, 40] ms
    assert run.quantile(0.5) == pytest.approx(0.02 + 0.02 * (20 - 10) / 30)  # interpolated, as Prometheus does
    assert run.quantile(0.25) == pytest.approx(0.02)


def test_a_histogram_sums_its_engines_and_says_what_it_lacks():
    from llmlab.serve.metrics import Histogram, histogram

    m = kc.parse_prometheus('h_bucket{engine="0",le="0.1"} 1\nh_bucket{engine="0",le="+Inf"} 2\n'
                            'h_bucket{engine="1",le="0.1"} 3\nh_bucket{engine="1",le="+Inf"} 3\n'
                            'h_sum{engine="0"} 0.5\nh_sum{engine="1"} 0.1\n'
                            'h_count{engine="0"} 2\nh_count{engine="1"} 3\n')
    h = histogram(m, "h")
    assert h == Histogram({0.1: 4.0, math.inf: 5.0}, pytest.approx(0.6), 5.0)
    assert histogram(m, "h", engine=1).buckets == {0.1: 3.0, math.inf: 3.0}
    assert h.quantile(0.9) == 0.1 and h.bucket_of(0.9) == (0.1, math.inf)  # beyond the last finite edge: that edge
    empty = h - h
    assert empty.mean is None and empty.quantile(0.5) is None and empty.bucket_of(0.5) is None
    with pytest.raises(KeyError, match="no histogram 'x'.*it has h"):
        histogram(m, "x")
    with pytest.raises(ValueError, match="different bucket edges"):
        h - Histogram({0.2: 1.0, math.inf: 1.0})

def test_blocks_in_use_inverts_vllms_usage_gauge():
    # vLLM: usage = 1 - free / (num_gpu_blocks - 1); 4 blocks held of 4,096 (one is the null block)
    assert kc.blocks_in_use(kc.Counters(kv_usage=4 / 4095, num_gpu_blocks=4096)) == 4
    assert kc.blocks_in_use(kc.Counters(kv_usage=0.0, num_gpu_blocks=4096)) == 0
    with pytest.raises(ValueError, match="cache_config_info"):
        kc.blocks_in_use(kc.Counters(kv_usage=0.5))


@pytest.mark.parametrize("url", ["http://h:8000/v1", "http://h:8000/v1/", "http://h:8000"])
def test_metrics_live_at_the_server_root(url):
    assert kc.metrics_url(url) == "http://h:8000/metrics"


def test_no_server_is_one_sentence():
    from llmlab.serve.info import ServerUnavailable
    from llmlab.serve.proc import free_port

    with pytest.raises(ServerUnavailable, match="No server answers"):
        kc.fetch_metrics(f"http://127.0.0.1:{free_port()}/v1", "key", timeout=2)


@pytest.mark.parametrize("code, error, words", [(503, "ServerUnavailable", "vLLM server behind it does not answer"),
                                                (401, "AuthenticationFailed", "refused the API key"),
                                                (404, "ServerError", "does not export Prometheus metrics")])
def test_what_a_proxy_answers_instead_of_metrics_is_one_sentence(code, error, words):
    """llmlab's proxy answers 503 while the vLLM behind it loads, restarts or is gone: the server is unavailable
    (``llmlab top`` waits for it), not a server without metrics."""
    import http.server
    import threading

    from llmlab.serve import info

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(code)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(getattr(info, error), match=words) as e:
            kc.fetch_metrics(f"http://127.0.0.1:{server.server_port}/v1", "key", timeout=5)
        assert type(e.value) is getattr(info, error)
    finally:
        server.shutdown()
        server.server_close()


# --- transformers: greedy decoding with and without the cache ----------------------------------------

@pytest.fixture(scope="module")
def random_tiny():
    """A randomly initialised Llama of the tiny model's shape: the cache logic does not need trained weights."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_SHAPE, dtype="float32")).eval()


def test_cached_and_uncached_greedy_give_identical_tokens(random_tiny):
    import torch

    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(1))
    cached = kc.greedy(random_tiny, prompt, 24, use_cache=True)
    uncached = kc.greedy(random_tiny, prompt, 24, use_cache=False)
    assert cached.tokens == uncached.tokens and len(cached.tokens) == 24
    assert cached.positions == uncached.positions == list(range(40, 64))
    reference = random_tiny.generate(prompt, max_new_tokens=24, do_sample=False)  # transformers' own loop
    assert reference[0, 40:].tolist() == cached.tokens
    assert uncached.cache_shapes == [] and len(cached.seconds) == 24


def test_cached_tensors_hold_exactly_the_bytes_memory_predicts(random_tiny):
    import torch

    per_token = memory.kv_bytes_per_token(dict(TINY_SHAPE, architectures=["LlamaForCausalLM"], dtype="float32"))
    assert per_token == 4 * 2 * 2 * 32 * 4 == 2048
    g = kc.greedy(random_tiny, torch.arange(1, 11), 6, use_cache=True)
    # after the pass that predicts token i, the cache holds every token that went in: prompt + i
    assert g.cache_shapes == [(1, 2, 10 + i, 32) for i in range(6)]
    assert g.cache_bytes == [(10 + i) * per_token for i in range(6)]


def test_shipped_tiny_model_caches_what_memory_predicts():
    if not (kc.TINY_MODEL / "model.safetensors").is_file():
        pytest.skip("the tiny model's weights are not there yet")
    model, tok = kc.load_model()
    ids = tok("In the beginning God created the heavens and the earth.", return_tensors="pt").input_ids
    cached, uncached = kc.greedy(model, ids, 16, True), kc.greedy(model, ids, 16, False)
    assert cached.tokens == uncached.tokens
    n = ids.shape[1]
    assert cached.cache_bytes[-1] == (n + 15) * memory.kv_bytes_per_token("llmlab-tiny")


def test_missing_model_directory_is_a_clear_error(tmp_path):
    from llmlab.serve.info import ServerError

    with pytest.raises(ServerError, match="No model at"):
        kc.load_model(tmp_path)
