"""``llmlab top`` against the real embedded engine: a load makes the lines move as predicted, and the command speaks
JSON and one sentence.  The logic on recorded scrapes is tests/unit/test_top.py."""

import json
import subprocess
import sys
import threading
import time

import pytest

import llmlab
from llmlab import loadtest as lt
from llmlab import top
from llmlab.serve.info import AuthenticationFailed

CONCURRENCY, REQUESTS, OUTPUT = 4, 12, 300


def settle(view: top.Top, timeout: float = 20.0) -> top.Point:
    """Scrape until the server is idle again: nothing running, and no token generated since the scrape before (vLLM
    counts a request's tokens in its output loop, a moment after the client may have its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.3)
        point = view.sample()
        if point.running == 0 and point.generation_tokens_per_s == 0:
            return point
        assert time.monotonic() < deadline, f"the server is not idle {timeout:g} s after the load: {point}"


@pytest.mark.server
def test_a_load_raises_running_requests_and_tokens_per_second_then_both_fall_back_to_zero(embedded):
    """Predictions: with 4 workers sending 12 requests of 300 tokens, the running batch holds several at its peak
    and never more than 4 (the server's limit, --max-num-seqs, is far above 4; the view samples the gauge between
    scrapes, which a loaded machine slows: a clean clone at load 16 saw a peak of 1 with 8 requests of 200 tokens,
    so the load is three rounds long and the peak asserted is "more than one"), generation tokens/s is above zero
    while they run, the KV cache holds their blocks, and the counters grow by exactly the tokens the requests
    report.  After the load: nothing running, 0 tokens/s, the KV cache empty (finished requests free their blocks;
    cached prefixes are free blocks)."""
    client, model = llmlab.connect(quiet=True)
    view = top.Top(top.target(client), size=10_000)
    before = settle(view)
    jobs = lt.synthetic_workload(REQUESTS, input_len=16, output_len=OUTPUT, seed=7)
    done = {}
    load = threading.Thread(target=lambda: done.update(result=lt.run(
        client, model, jobs, concurrency=CONCURRENCY, progress=False, temperature=0, ignore_eos=True)))
    load.start()
    while load.is_alive():
        view.sample()
        time.sleep(0.1)
    load.join()
    after = settle(view)
    records = done["result"].records
    assert [r.status for r in records] == ["ok"] * REQUESTS
    during = [p for p in view.history.points if before.t < p.t <= after.t]
    assert 2 <= max(p.running for p in during) <= CONCURRENCY  # several at once, never more than the client sends
    assert max(p.generation_tokens_per_s for p in during) > 0 and max(p.kv_usage for p in during) > 0
    assert (after.running, after.waiting, after.generation_tokens_per_s, after.kv_usage) == (0, 0, 0, 0)
    grew = {k: after.totals[k] - before.totals[k] for k in after.totals}
    assert grew["generation_tokens"] == REQUESTS * OUTPUT == sum(r.output_tokens for r in records)
    assert grew["prompt_tokens"] == sum(r.prompt_tokens for r in records) and grew["finished"] == REQUESTS
    # the rates add up to the counters: sum(rate x interval) over the points is the tokens generated
    spans = zip([before, *during], during, strict=False)
    assert sum(p.generation_tokens_per_s * (p.t - q.t) for q, p in spans) == pytest.approx(REQUESTS * OUTPUT)
    assert not any(p.restarted for p in during)


@pytest.mark.server
def test_llmlab_top_once_json_reads_the_embedded_server_and_never_prints_its_key(embedded, api_key):
    res = subprocess.run([sys.executable, "-m", "llmlab", "top", "--once", "--json", "--interval", "0.5"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["url"] == embedded.base_url and data["server"].startswith("the embedded server (llmlab-tiny)")
    assert data["running"] == 0 and data["generation_tokens_per_s"] == 0 and data["totals"]["finished"] >= 0
    assert api_key not in res.stdout + res.stderr


@pytest.mark.server
def test_a_wrong_key_is_one_sentence(embedded):
    with pytest.raises(AuthenticationFailed, match="refused the API key") as e:
        top.Top(top.Target(embedded.base_url, "not-the-key", "the embedded server")).sample(tolerate_down=True)
    assert "not-the-key" not in str(e.value)
