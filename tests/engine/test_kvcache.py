"""KV caching (llmlab.kvcache): numpy attention, paged-block arithmetic, the Prometheus parser, greedy decoding
with and without transformers' cache, and vLLM's prefix cache seen through the live server's /metrics.

Pure tests take a second; the transformers tests use a randomly initialised Llama of the tiny model's shape
(and the shipped weights when they are there); the ``server`` tests use the session's embedded vLLM server.

This file holds the tests that start the real engine (or need root); the rest are in tests/unit/test_kvcache.py (the
pure tests).
"""

import secrets
import time

import pytest

from llmlab import kvcache as kc
from llmlab import memory

# --- live: the embedded vLLM server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(embedded):
    import llmlab
    from llmlab.serve.info import base_url_of, read_key

    key = read_key(embedded.api_key_file)
    client, model = llmlab.connect(base_url_of(embedded), key, quiet=True)
    return client, model, base_url_of(embedded), key


@pytest.mark.server
def test_live_metrics_parse_and_describe_the_cpu_cache(live):
    _, _, url, key = live
    m = kc.fetch_metrics(url, key)
    for name in (kc.PREFIX_QUERIES, kc.PREFIX_HITS, kc.KV_USAGE, kc.PROMPT_TOKENS, kc.TTFT + "_sum"):
        assert name in m, f"{name} missing from vLLM's /metrics: names changed? ({len(m.names)} metrics)"
    snap = kc.read_counters(m)
    assert snap.block_size == memory.CPU_BLOCK_SIZE and snap.prefix_caching is True
    assert snap.num_gpu_blocks == memory.embedded_kv_capacity(1, "llmlab-tiny").blocks
    assert 0.0 <= snap.kv_usage <= 1.0


@pytest.mark.server
def test_live_prefix_cache_hits_the_predicted_whole_blocks(live):
    client, model, url, key = live
    # token ids make the lengths exact; random first tokens make every block new to the cache
    prompt = [secrets.randbelow(4000) + 10 for _ in range(2)] + [(7 * i) % 4000 + 10 for i in range(298)]
    before = kc.counters(client)
    first = kc.timed_completion(client, model, prompt, max_tokens=2)
    middle = kc.wait_for_request(client, before)
    second = kc.timed_completion(client, model, prompt, max_tokens=2)
    after = kc.wait_for_request(client, middle)
    d1, d2 = middle - before, after - middle
    assert first.prompt_tokens == second.prompt_tokens == 300
    assert (d1.prefix_queries, d1.prefix_hits) == (300, 0)
    assert (d2.prefix_queries, d2.prefix_hits) == (300, kc.prefix_cache_hit_tokens(300, 300))
    assert d2.prefill_computed.sum == 300 - 256 and d1.prefill_computed.sum == 300
    assert (d1.prefill_computed.count, d2.prefill_computed.count) == (1, 1)
    assert first.text == second.text  # the cached keys and values give the same greedy tokens
    # the same hit, read from the request's own usage: what a learner of a shared server counts
    assert (first.cached_tokens, second.cached_tokens) == (0, d2.prefix_hits)


@pytest.mark.server
def test_live_kv_usage_counts_the_blocks_of_the_running_request(live):
    client, model, _, _ = live
    # 260..380 tokens: 3 blocks of 128 from the first token to the last, so a scrape answered late (the server is
    # busy streaming) still counts 3; with 300 + 100 tokens a fourth block came at the 85th token
    prompt = [secrets.randbelow(4000) + 10 for _ in range(260)]
    reading = kc.usage_while_running(client, model, prompt, max_tokens=120)
    assert reading.alone, f"(running, finished meanwhile) at each reading: {reading.tries}"
    assert reading.during.running == 1
    assert reading.blocks_held == kc.blocks_for(260 + 120, memory.CPU_BLOCK_SIZE) == 3
    assert reading.after.kv_usage == 0.0


@pytest.mark.server
def test_live_kv_usage_is_not_called_alone_while_another_request_runs(live):
    """A shared server: another client keeps requests running meanwhile, so the gauge is not this request's.  That
    client sends request after request (8 x 450 tokens) on two threads, the second starting half a request after
    the first, so that one is always mid-answer: on CI one request once ended before the reading, and two threads
    that started together once ended together, the reading falling into their common gap.  Its requests are not
    streamed: a streaming client on a starved machine can still be reading answers that have ended in vLLM (a clean
    clone read "alone" once more with streaming), while a whole answer reaches the client as vLLM ends it.  The
    reading starts once both threads have sent."""
    import threading

    client, model, _, _ = live
    done, first, sent = threading.Event(), [], [threading.Event(), threading.Event()]

    def other(i):
        if i == 1:
            while not first:  # half of the first request's time after thread 0 sent its second
                if done.wait(0.1):
                    return
            time.sleep(first[0] / 2)
        while not done.is_set():
            sent[i].set()
            t = time.monotonic()
            client.completions.create(model=model, prompt="In the beginning", max_tokens=450, n=8,
                                      temperature=1.0, extra_body={"ignore_eos": True})
            if not first:
                first.append(time.monotonic() - t)

    workers = [threading.Thread(target=other, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    try:
        assert all(event.wait(240) for event in sent), "the other client's threads did not both send"
        reading = kc.usage_while_running(client, model, "And the king said", max_tokens=20, attempts=2)
    finally:
        done.set()
        for worker in workers:
            worker.join()
    assert not reading.alone, reading.tries


def test_lesson_02_holds_against_a_server_started_without_llmlabs_flags(tmp_path, monkeypatch):
    """Issue 48, item 7: some sites give learners a vLLM endpoint of their own, started without
    --enable-prompt-tokens-details, so usage.prompt_tokens_details is missing and the lesson's per-request check
    stopped on a bare AssertionError.  Against such a server (the tiny model, that flag turned off, reached through
    LLMLAB_BASE_URL as a site's would be) the lesson says in one sentence what the server does not report and how to
    turn it on, checks the rule on the server's counters instead, and runs to the end."""
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient

    from llmlab import engines

    with engines.start(["--no-enable-prompt-tokens-details"], progress=False) as plain:
        monkeypatch.setenv("LLMLAB_BASE_URL", plain.base_url)
        monkeypatch.setenv("LLMLAB_API_KEY", plain.api_key)
        monkeypatch.setenv("LLMLAB_HOME", str(tmp_path / "home"))
        nb = nbformat.read(Path(__file__).parents[2] / "notebooks" / "02_kv_caching.ipynb", as_version=4)
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert kc.NOT_REPORTED in printed and "checked on its counters instead" in printed
