"""The load generator (notebook 06): statistics by hand, nothing lost under faults, and real runs.

Every failure here is a real one, from the embedded vLLM server or from the network: a prompt longer than the
context (HTTP 400), a request past its time-out, a port where nothing listens, a private server killed in the
middle of a run, Ctrl-C, a full disk.

This file holds the pure tests (no engine, no SLURM, no root, no browser); the rest are in
tests/engine/test_loadtest.py (the tests that start the real engine).
"""

import json

import httpx
import openai
import pytest

from llmlab import loadtest as lt

# --- statistics against timings computed by hand ---------------------------------------------------------

def rec(i, ttft, latency, n, start, status="ok", t_response=0.01, session="a"):
    tpot = (latency - ttft) / (n - 1) if status == "ok" and n > 1 else None
    return lt.Record(id=i, status=status, prompt_tokens=10, output_tokens=n, ttft=ttft if status == "ok" else None,
                     tpot=tpot, latency=latency if status == "ok" else None, itl=[tpot] * (n - 1) if tpot else [],
                     start=start, end=start + (latency or 0.5), t_response=t_response, session=session)


def test_summary_equals_hand_computed_figures():
    records = [rec(0, 0.1, 1.1, 11, 100.0), rec(1, 0.2, 2.2, 21, 100.0), rec(2, 0.3, 1.3, 6, 101.0),
               rec(3, 0.4, 2.4, 5, 101.5), rec(4, None, None, 3, 103.0, status="error")]
    s = lt.LoadResult(records, concurrency=2).summary()
    assert (s["requests"], s["ok"], s["errors"], s["timeouts"]) == (5, 4, 1, 0)
    # duration: first send 100.0, last end 101.5 + 2.4 = 103.9
    assert s["duration_s"] == pytest.approx(3.9)
    assert s["output_tokens"] == 11 + 21 + 6 + 5
    assert s["output_tokens_per_s"] == pytest.approx(43 / 3.9)
    assert s["requests_per_s"] == pytest.approx(4 / 3.9)
    # ttft 0.1 0.2 0.3 0.4, linear interpolation: p50 = 0.25, p90 = 0.37, p99 = 0.397
    assert (s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]) == pytest.approx((0.25, 0.37, 0.397))
    # tpot = (latency - ttft) / (n - 1): 1/10, 2/20, 1/5, 2/4 -> sorted 0.1 0.1 0.2 0.5
    assert s["tpot_p50"] == pytest.approx(0.15) and s["tpot_p90"] == pytest.approx(0.41)
    assert s["tpot_mean"] == pytest.approx(0.9 / 4)
    # latency 1.1 1.3 2.2 2.4: p50 = 1.75, p99 = 2.2 + 0.97 * 0.2
    assert s["latency_p50"] == pytest.approx(1.75) and s["latency_p99"] == pytest.approx(2.394)
    # ITL: every gap of every ok request (10 x 0.1, 20 x 0.1, 5 x 0.2, 4 x 0.5): median 0.1
    assert s["itl_p50"] == pytest.approx(0.1) and s["itl_mean"] == pytest.approx((3.0 + 1.0 + 2.0) / 39)
    # in flight: [100.01, 101.1], [100.01, 102.2], [101.01, 102.3], [101.51, 103.9], [103.01, 103.5] -> 3
    assert s["max_concurrency_seen"] == 3
    # sent -> end: [100, 101.1], [100, 102.2], [101, 102.3], [101.5, 103.9], [103, 103.5] -> 3 at 101.5
    assert s["max_outstanding"] == 3


def test_goodput_counts_the_requests_within_every_slo_as_vllm_bench_does():
    records = [rec(0, 0.1, 1.1, 11, 100.0), rec(1, 0.2, 2.2, 21, 100.0), rec(2, 0.3, 1.3, 6, 101.0),
               rec(3, 0.4, 2.4, 5, 101.5), rec(4, None, None, 3, 103.0, status="error"),
               rec(5, 0.25, 0.25, 1, 101.0)]  # one token: no TPOT, which counts as 0
    # ttft 0.1 0.2 0.3 0.4 - 0.25; tpot 0.1 0.1 0.2 0.5 - (0); the failed one never counts
    s = lt.LoadResult(records).summary({"ttft": 0.3, "tpot": 0.2})
    assert s["good"] == 4 and s["goodput_share"] == pytest.approx(4 / 6)  # 0, 1, 2 (0.3 and 0.2: at the limit), 5
    assert s["goodput_requests_per_s"] == pytest.approx(4 / s["duration_s"])
    assert lt.LoadResult(records).summary({"latency": 1.2})["good"] == 2  # 1.1 and the one-token 0.25
    assert "good" not in lt.LoadResult(records).summary()
    for slo, message in (({"e2el": 1.0}, "vLLM's e2el is llmlab's latency"), ({"ttft": -1}, "seconds >= 0"),
                         ({}, "should be a dict"), ({"ttft": "500ms"}, "takes milliseconds; llmlab takes seconds")):
        with pytest.raises(ValueError, match=message):
            lt.LoadResult(records).summary(slo)


def test_sessions_add_up_and_back_to_back_requests_do_not_overlap():
    a = [rec(0, 0.1, 1.0, 5, 0.0, t_response=0.0), rec(1, 0.1, 1.0, 5, 1.0, t_response=0.0)]  # one worker
    b = [rec(2, 0.1, 2.0, 5, 500.0, session="b")]  # resumed much later: the pause is not load-test time
    assert lt.max_in_flight(a) == 1
    assert lt.duration_of(a + b) == pytest.approx(2.0 + 2.0)


def test_an_error_event_mid_stream_ends_the_record_with_the_servers_words():
    """vLLM reports an engine failure mid-answer as an ``error`` event in the stream (no HTTP status is left
    to send): the record keeps the tokens that came, and the server's message."""
    timer = lt._Settings("m", 8, 60.0, {}, "s", 1).timer(lt.Job(0, "x"))
    timer.sent()
    for i in range(2):
        timer.line("data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}))
    with pytest.raises(lt._ServerError) as err:
        timer.line("data: " + json.dumps({"error": {"message": "engine dead", "type": "InternalServerError"}}))
    r = timer.failed(err.value)
    assert (r.status, r.output_tokens, r.text) == ("error", 2, "t0 t1 ")
    assert r.error == "the server reported an error after 2 tokens and ended the answer: engine dead"


def test_the_client_pool_is_read_before_the_run():
    default = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x")
    capped = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="x",
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=2)))
    assert lt.connection_limit(default) == 1000 and lt.connection_limit(capped.with_options(timeout=1)) == 2
    assert lt.connection_limit(object()) is None
    with pytest.warns(UserWarning, match="at most 2 connections, fewer than the 8"):
        assert lt._check_pool(capped, 8) is True


def test_jobs_need_unique_ids():
    with pytest.raises(ValueError, match="twice"):
        lt.as_jobs([{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])


def test_synthetic_workload_has_exact_lengths_and_a_seed():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(lt.TINY_TOKENIZER))
    jobs = lt.synthetic_workload(20, input_len=24, output_len=10, seed=3)
    assert all(len(tok.encode(j.prompt, add_special_tokens=False).ids) == 24 for j in jobs)
    assert all(j.max_tokens == 10 and j.input_len == 24 for j in jobs)
    assert [j.prompt for j in jobs] == [j.prompt for j in lt.synthetic_workload(20, 24, 10, seed=3)]
    assert jobs[0].prompt != lt.synthetic_workload(1, 24, 10, seed=4)[0].prompt
    varied = lt.synthetic_workload(50, 40, 20, seed=0, range_ratio=0.5)
    assert all(20 <= j.input_len <= 60 and 10 <= j.max_tokens <= 30 for j in varied)
    assert len({j.input_len for j in varied}) > 10


# --- a full disk (issue 26): what was measured stays measured ------------------------------------------------


def test_raise_on_failure_names_the_count_and_the_first_error():
    ok, bad = lt.Record(id=0, status="ok"), lt.Record(id=1, status="error", error="HTTP 400: prompt too long")
    assert lt.LoadResult([ok]).raise_on_failure().ok == [ok]
    with pytest.raises(RuntimeError, match="1 of 2 requests failed, the first: HTTP 400: prompt too long"):
        lt.LoadResult([ok, bad]).raise_on_failure()


# --- repeats and intervals (llmlab.loadtest.repeats) ----------------------------------------------------------

def test_tail_samples_and_what_ten_take():
    assert lt.tail_samples(100, 99) == 1 and lt.tail_samples(1000, 99) == 10 and lt.tail_samples(99, 99) == 0
    assert lt.tail_samples(20, 50) == 10 and lt.needed_for_tail(99) == 1000 and lt.needed_for_tail(50) == 20
    assert lt.needed_for_tail(90) == 100


def test_bootstrap_interval_holds_the_percentile_and_narrows_with_more_samples():
    import numpy as np

    rng = np.random.default_rng(1)
    small, large = rng.exponential(1.0, 200), rng.exponential(1.0, 5000)
    true_p90 = -np.log(0.1)  # the exponential's 90th percentile, 2.303
    lo_s, hi_s = lt.bootstrap_interval(small, 90)
    lo_l, hi_l = lt.bootstrap_interval(large, 90)
    assert lo_s < np.percentile(small, 90) < hi_s and lo_l < true_p90 < hi_l
    assert hi_l - lo_l < (hi_s - lo_s) / 2
    assert lt.bootstrap_interval(small, 90) == (lo_s, hi_s)  # seeded: the same interval twice
    assert lt.bootstrap_interval([0.5], 50) is None and lt.bootstrap_interval([], 99) is None


def test_repeated_runs_give_medians_of_runs_intervals_and_a_note_for_a_thin_tail():
    runs = [lt.LoadResult([rec(i, 0.1 * (k + 1) + 0.01 * i, 1.0 + 0.1 * k + 0.01 * i, 11, 100.0 + k)
                           for i in range(20)], 4) for k in range(3)]
    rep = lt.Repeated(runs, 4)
    figures = rep.figures()
    ttft = figures["ttft_p50"]
    assert ttft.runs == [r.summary()["ttft_p50"] for r in runs] and ttft.median == sorted(ttft.runs)[1]
    assert ttft.low <= ttft.median <= ttft.high and ttft.samples == 60 and ttft.tail == 30 and ttft.note == ""
    p99 = figures["ttft_p99"]
    assert p99.tail == 0 and "rests on 0 sample(s)" in p99.note and "1,000" in p99.note
    tput = figures["output_tokens_per_s"]
    assert (tput.low, tput.high) == (min(tput.runs), max(tput.runs)) and tput.samples == 3
    s = rep.summary()
    assert s["requests"] == 60 and s["repeats"] == 3 and s["ttft_p50"] == ttft.median
    assert s["ttft_p99_low"] == p99.low and any("ttft_p99" in n for n in s["notes"])
    frame = rep.to_frame()
    assert frame.loc["ttft_p50 (ms)", "median"] == pytest.approx(ttft.median * 1000)
    assert frame.loc["output_tokens_per_s", "runs"] == [round(v, 3) for v in tput.runs]


def test_repeat_refuses_a_bad_count_and_save_before_any_request():
    nowhere = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="none")
    with pytest.raises(ValueError, match="whole number of runs"):
        lt.repeat(nowhere, "m", ["a"], repeats=0)
    with pytest.raises(ValueError, match="save="):
        lt.repeat(nowhere, "m", ["a"], repeats=2, save="x.jsonl")


def test_a_client_made_for_a_unix_socket_has_its_streams_sent_there(tmp_path):
    """benchmarks/proxy_overhead.py's direct way: an openai client over vLLM's Unix socket.  The streams are read by
    aiohttp, not by the client's httpx, so the socket must be carried over, else every request went to the URL's
    host name (``http://vllm``) and failed."""
    import asyncio

    import httpx
    import openai

    from llmlab.loadtest import driver

    sock = str(tmp_path / "vllm.sock")
    direct = openai.OpenAI(base_url="http://vllm/v1", api_key="unused",
                           http_client=httpx.Client(transport=httpx.HTTPTransport(uds=sock)))
    assert driver.unix_socket(direct) == sock
    assert driver.unix_socket(openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="k")) is None

    async def connector_path():
        session = await driver._open_session(4, 5.0, sock)
        try:
            return session.connector.path
        finally:
            await session.close()

    assert asyncio.run(connector_path()) == sock


# --- open loop: arrival processes, the chat stream, sessions (no engine) -------------------------------------

def test_poisson_arrivals_are_seeded_at_the_rate_and_rescaled_as_vllm_bench_does():
    a = lt.poisson_arrivals(2000, 10.0, seed=3)
    assert a == lt.poisson_arrivals(2000, 10.0, seed=3) and a != lt.poisson_arrivals(2000, 10.0, seed=4)
    assert all(x < y for x, y in zip(a, a[1:], strict=False)) and a[-1] == pytest.approx(200.0)  # n / rate
    gaps = [y - x for x, y in zip([0.0, *a], a, strict=False)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert mean == pytest.approx(0.1) and 0.9 < cv < 1.1  # exponential gaps: standard deviation = mean
    smooth = lt.poisson_arrivals(2000, 10.0, seed=3, burstiness=50.0)  # gamma of shape 50: nearly regular
    sgaps = [y - x for x, y in zip(smooth, smooth[1:], strict=False)]
    assert max(sgaps) < 0.2 and min(sgaps) > 0.04
    for bad, words in (((0, 1.0), "whole number"), ((5, 0.0), "rate=0.0"), ((5, float("inf")), "burst()")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            lt.poisson_arrivals(*bad)


def test_a_burst_is_the_same_request_from_every_learner():
    jobs = lt.burst("Explain the KV cache", 5, max_tokens=8)
    assert [j.id for j in jobs] == list(range(5)) and {j.prompt for j in jobs} == {"Explain the KV cache"}
    with pytest.raises(ValueError, match="learners=0"):
        lt.burst("x", 0)


def test_synthetic_sessions_are_seeded_with_a_think_time_per_gap():
    s = lt.synthetic_sessions(3, turns=4, rate=2.0, think=1.5, seed=7, input_len=8, output_len=4)
    assert [x.id for x in s] == ["s0", "s1", "s2"] and all(len(x.turns) == 4 and len(x.think) == 3 for x in s)
    assert [x.start for x in s] == lt.poisson_arrivals(3, 2.0, seed=7)
    assert s[1].turns[2].id == "s1-t2" and s[1].turns[2].max_tokens == 4
    again = lt.synthetic_sessions(3, turns=4, rate=2.0, think=1.5, seed=7, input_len=8, output_len=4)
    assert [x.think for x in s] == [x.think for x in again] and all(t >= 0 for x in s for t in x.think)
    assert {x.start for x in lt.synthetic_sessions(2, turns=1, think=0)} == {0.0}  # no rate: everyone at once


def test_a_chat_stream_times_the_role_event_as_the_first_token_as_vllm_bench_does():
    t = lt._Timer(lt.Job(1, "hi"), 3, 60.0, "s", "")
    t.sent()
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"delta": {"content": "Hel"}}]}, {"choices": [{"delta": {"content": "lo"}}]},
              {"choices": [{"delta": {"content": "!"}, "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}]
    for e in events:
        t.line("data: " + json.dumps(e))
    r = t.done()
    assert r.status == "ok" and r.text == "Hello!" and r.output_tokens == 3 and r.prompt_tokens == 9
    assert len(r.itl) == 2  # role event -> TTFT; the first token right behind it has no gap of its own
    cfg = lt._Settings("m", 8, 60.0, {}, "s", None, chat=True)
    assert cfg.request(lt.Job(0, "hi"))["messages"] == [{"role": "user", "content": "hi"}]
    convo = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert cfg.request(lt.Job(0, convo))["messages"] == convo and cfg.path == "/chat/completions"
    assert "prompt" in lt._Settings("m", 8, 60.0, {}, "s", None).request(lt.Job(0, "hi"))


def test_open_loop_arrival_times_must_match_the_prompts():
    from llmlab.loadtest.openloop import _sessions_of

    with pytest.raises(ValueError, match="3 prompts but 2 arrival times"):
        _sessions_of(["a", "b", "c"], [0.0, 1.0])
    with pytest.raises(ValueError, match=">= 0"):
        _sessions_of(["a"], [-1.0])


# --- the SLO and the search (no engine) ------------------------------------------------------------------------

def test_an_slo_is_read_as_written_and_a_malformed_one_is_one_sentence():
    slo = lt.parse_slo("ttft_p99<2s, tpot_p50<=50ms,failed=0,latency_mean<3s")
    o = {x.metric: x for x in slo.objectives}
    assert (o["ttft"].q, o["ttft"].limit, o["ttft"].strict) == (99.0, 2.0, True)
    assert (o["tpot"].q, o["tpot"].limit, o["tpot"].strict) == (50.0, 0.05, False)
    assert (o["failed"].limit, o["failed"].share) == (0.0, False) and o["latency"].q is None
    assert lt.parse_slo("failed<1%").objectives[0].limit == pytest.approx(0.01)
    for bad, words in [("ttft<2s", "says no statistic"), ("ttft_p99<2", "without its unit"),
                       ("ttft_p99>2s", "bounds a time"), ("ttft_p99=2s", "write ttft_p99<2s"), ("", "is empty"),
                       ("e2el_p99<2s", "e2el is llmlab's latency"), ("ttft_p99 under 2s", "cannot be read"),
                       ("failed<2ms", "failed counts requests"), ("ttft_p100<1s", "between p0 and p100")]:
        with pytest.raises(lt.SloError, match=words) as e:
            lt.parse_slo(bad)
        assert str(e.value).count(". ") <= 1 and str(e.value).endswith(".")


def slow_run(ttfts, failed=0, planned=None):
    records = [rec(i, t, t + 0.1, 5, 100.0 + i) for i, t in enumerate(ttfts)]
    records += [rec(len(ttfts) + i, None, None, 1, 200.0, status="error") for i in range(failed)]
    return lt.LoadResult(records, None, planned=planned)


def test_a_run_stops_once_its_own_requests_make_the_slo_unreachable():
    slo = lt.parse_slo("ttft_p99<1s,failed=0")
    # 200 planned: numpy's p99 of 200 lies past 1 s once the value at index floor(199 * 0.99) = 197 does, i.e. once
    # 200 - 197 = 3 requests are past it
    two = slow_run([0.1] * 50 + [1.5, 2.0]).records
    assert slo.stop(two, [], 200) is None
    assert "3 requests past ttft_p99<1s (1 of them still waiting)" in slo.stop(two, [(1.2, False)], 200)
    assert slo.stop(two, [(1.2, True)], 200) is None  # it has its first token: its TTFT may be below 1 s
    assert "1 request(s) failed" in slo.stop(slow_run([0.1], failed=1).records, [], 200)
    assert lt.parse_slo("failed<10%").stop(slow_run([0.1], failed=1).records, [], 20) is None
    assert lt.parse_slo("failed<10%").stop(slow_run([0.1], failed=2).records, [], 20)


def test_a_level_is_judged_on_its_runs_pooled_with_an_interval():
    slo = lt.parse_slo("ttft_p99<1s,failed=0")
    met, clear, why, figures = lt.judge(slo, [slow_run([0.1 + i / 1000 for i in range(300)])] * 2)
    assert (met, clear, why) == (True, True, "met") and figures["ttft_p99<1s"]["high"] < 1
    met, clear, why, _ = lt.judge(slo, [slow_run([0.1] * 300, failed=1)])
    assert (met, clear) == (False, True) and why == "missed failed=0 (1 failed)"
    edge = [0.1] * 290 + [0.9, 0.95, 0.99, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]  # p99 near the limit, tail of 10
    met, clear, why, f = lt.judge(slo, [slow_run(edge)])
    assert f["ttft_p99<1s"]["low"] < 1 < f["ttft_p99<1s"]["high"] and not clear
    stopped = lt.LoadResult(slow_run([0.1]).records, None, planned=100, stopped="3 requests past ttft_p99<1s")
    met, clear, why, f = lt.judge(slo, [stopped])
    assert (met, clear, why) == (False, True, "stopped early: 3 requests past ttft_p99<1s")
    assert f["ttft_p99<1s"]["partial"] and f["ttft_p99<1s"]["ok"]  # the finished requests alone look fine


def test_the_search_brackets_then_bisects_to_the_resolution():
    def levels(limit, **kw):
        tried, best, past = [], None, None
        while (x := lt.next_level(best, past, kw.pop("start", 30), **kw)) is not None:
            tried.append(x)
            if x <= limit:
                best = x if best is None else max(best, x)
            else:
                past = x if past is None else min(past, x)
        return tried, best, past

    assert levels(47, resolution=0.25) == ([30, 60, 45, 52], 45, 52)  # 52 - 45 = 7 <= 0.25 x 45
    assert levels(47, resolution=0.0) == ([30, 60, 45, 52, 48, 46, 47], 47, 48)
    assert levels(5, resolution=0.0) == ([30, 15, 8, 4, 6, 5], 5, 6)
    assert levels(0, resolution=0.0) == ([30, 15, 8, 4, 2, 1], None, 1)  # nothing met down to lowest
    assert levels(10**6, highest=100) == ([30, 60, 100], 100, None)  # everything met up to highest


def test_find_max_repeats_an_unclear_level_and_keeps_every_step():
    import numpy as np

    calls = []

    def measure(level, repeat, stop):  # a pretend server (no engine): exponential TTFTs whose mean grows with load
        calls.append((level, repeat))
        ttfts = np.random.default_rng(100 * level + repeat).exponential(0.02 * level, 400).tolist()
        records = [rec(i, t, t + 0.1, 5, 100.0 + i) for i, t in enumerate(ttfts)]
        return lt.LoadResult(records, None, planned=400, stopped=stop(records, [], 400))

    s = lt.find_max(measure, "ttft_p99<1s,failed=0", start=4, resolution=0.0, repeats=3, progress=None)
    # p99 of an exponential is 4.6 x its mean: the limit lies near level 1 / (0.02 x 4.6) = 10.9
    assert (s.best, s.past) == (10, 11) and [st.level for st in s.steps] == [4, 8, 16, 12, 10, 11]
    assert [len(st.runs) for st in s.steps] == [1, 1, 1, 1, 3, 1] and all(st.clear for st in s.steps)
    assert calls.count((10, 2)) == 1  # level 10's interval reached past 1 s twice: it ran until it was clear
    assert [st.met for st in s.steps] == [True, True, False, False, True, False]
    assert all(st.runs[0]["stopped"] for st in s.steps if not st.met)  # clearly past: stopped, no second run
    assert s.sentence().startswith("the largest load that met ttft_p99<1s,failed=0: 10; 11 missed (stopped early")
    assert list(s.to_frame().columns[:4]) == ["load", "met", "clear", "runs"]
    with pytest.raises(lt.SloError):
        lt.find_max(measure, "ttft<1s", start=4)
    easy = lt.find_max(lambda level, r, stop: lt.LoadResult([rec(0, 0.1, 0.2, 5, 100.0)], None), "ttft_p99<1s",
                       start=1, max_steps=5, progress=None)  # a load that never misses: the search still ends
    assert [st.level for st in easy.steps] == [1, 2, 4, 8, 16] and (easy.best, easy.past) == (16, None)


def test_find_max_starts_from_an_earlier_searchs_bracket_and_runs_neither_end_again():
    calls = []

    def measure(level, repeat, stop):  # a pretend server (no engine): every TTFT is level / 10 s, so 10 is the limit
        calls.append(level)
        records = [rec(i, level / 10 - 0.01, level / 10, 5, 100.0 + i) for i in range(200)]
        return lt.LoadResult(records, None, planned=200, stopped=stop(records, [], 200))

    s = lt.find_max(measure, "ttft_p99<1s", start=1, resolution=0.0, met=8, missed=16, progress=None)
    assert calls == [12, 10, 11] and (s.best, s.past) == (10, 11)  # bisected 8..16 at once: no 1, 2, 4, 8 or 16
    assert s.to_dict()["known"] == {"met": 8, "missed": 16}
    none_new = lt.find_max(measure, "ttft_p99<1s", start=1, resolution=0.0, met=10, missed=12, progress=None)
    assert [st.level for st in none_new.steps] == [11] and (none_new.best, none_new.past) == (10, 11)
    assert none_new.sentence().startswith("the largest load that met ttft_p99<1s: 10 (in the earlier search); 11 ")
    untouched = lt.find_max(measure, "ttft_p99<1s", start=1, met=10, missed=11, progress=None)
    assert untouched.steps == [] and untouched.sentence().endswith("11 missed (in the earlier search).")
    with pytest.raises(ValueError, match="met=16, missed=8"):
        lt.find_max(measure, "ttft_p99<1s", start=1, met=16, missed=8)
