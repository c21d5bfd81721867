"""The load generator (notebook 06): statistics by hand, nothing lost under faults, and real runs.

Every failure here is a real one, from the embedded vLLM server or from the network: a prompt longer than the
context (HTTP 400), a request past its time-out, a port where nothing listens, a private server killed in the
middle of a run, Ctrl-C, a full disk.
"""

import asyncio
import json
import os
import signal
import time
from dataclasses import asdict

import httpx
import openai
import pytest

import llmlab
from llmlab import loadtest as lt
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.proc import free_port


def nowhere():
    """A client for a port where nothing listens."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="none")


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


# --- against the embedded vLLM server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def conn(embedded):
    return llmlab.connect(quiet=True)


def too_long(client) -> str:
    """A prompt longer than the served model's context: vLLM refuses it with HTTP 400."""
    return "And the king said " * client.models.list().data[0].max_model_len


@pytest.mark.server
def test_timings_of_one_streamed_request(conn):
    client, model = conn
    job = lt.synthetic_workload(1, input_len=8, output_len=6, seed=5)[0]
    r = lt.run(client, model, [job], concurrency=1, progress=False, temperature=0,
               extra_body={"ignore_eos": True}).records[0]  # the openai client's way to pass vLLM's parameters
    assert r.status == "ok" and r.output_tokens == 6 and r.prompt_tokens == 9 and r.finish_reason == "length"
    assert len(r.itl) == 5 and all(g > 0 for g in r.itl) and r.text
    assert r.ttft + sum(r.itl) == pytest.approx(r.latency)
    assert r.tpot == pytest.approx((r.latency - r.ttft) / 5)
    assert 0 < r.t_response <= r.ttft and r.end >= r.start + r.latency


@pytest.mark.server
def test_every_job_is_accounted_for_under_real_failures(conn, tmp_path):
    client, model = conn
    path = tmp_path / "run.jsonl"
    jobs = [lt.Job(i, too_long(client) if i % 3 == 1 else f"In the beginning {i}", max_tokens=4) for i in range(12)]
    res = lt.run(client, model, jobs, concurrency=4, progress=False, save=path, ignore_eos=True, temperature=0)
    assert [r.id for r in res.records] == list(range(12))
    assert [r.status for r in res.records] == ["error" if i % 3 == 1 else "ok" for i in range(12)]
    refused = res.records[1].error
    assert refused.startswith("HTTP 400: the server refused the request") and "maximum context length" in refused
    s = res.summary()
    assert s["requests"] == s["ok"] + s["errors"] == 12 and s["ok"] == 8 and s["timeouts"] == 0
    lines = path.read_text().splitlines()  # one line per record, written as each finished
    assert len(lines) == 12 and sorted(json.loads(line)["id"] for line in lines) == list(range(12))
    assert {r.id: asdict(r) for r in lt.load(path).records} == {r.id: asdict(r) for r in res.records}

    slow = lt.run(client, model, [lt.Job("slow", "In the beginning", max_tokens=480)], timeout=0.2, progress=False,
                  ignore_eos=True)  # 480 tokens take far longer than 0.2 s
    r = slow.records[0]
    assert r.status == "timeout" and r.output_tokens < 480  # how far it got (0 where the first token came late)
    assert "timeout=0.2" in r.error or "sent nothing for 0.2 s" in r.error
    down = lt.run(nowhere(), model, jobs[:3], concurrency=2, progress=False)
    assert [r.status for r in down.records] == ["error"] * 3
    assert all(r.error.startswith("could not connect to the server at http://127.0.0.1:") and
               "nothing listens" in r.error for r in down.records)


@pytest.mark.server
def test_resume_sends_only_what_is_missing(conn, tmp_path):
    client, model = conn
    path = tmp_path / "run.jsonl"
    jobs = [lt.Job(i, f"In the beginning {i}", max_tokens=4) for i in range(10)]
    jobs[2] = lt.Job(2, too_long(client), max_tokens=4)  # refused each time: resuming sends it again
    first = lt.run(client, model, jobs[:6], concurrency=3, progress=False, save=path, ignore_eos=True)
    with pytest.raises(FileExistsError, match="resume=True"):
        lt.run(client, model, jobs, progress=False, save=path)
    res = lt.run(client, model, jobs, concurrency=3, progress=False, save=path, resume=True, ignore_eos=True)
    assert [r.id for r in res.records] == list(range(10))
    assert [r.status for r in res.records] == ["error" if i == 2 else "ok" for i in range(10)]
    saved = [json.loads(line) for line in path.read_text().splitlines()]  # appended: the history stays
    second = sorted(r["id"] for r in saved if r["session"] != first.records[0].session)
    assert len(saved) == 6 + 5 and second == [2, 6, 7, 8, 9]


@pytest.mark.server
def test_an_interrupted_run_keeps_what_finished_and_resumes(conn, tmp_path):
    """Ctrl-C (KeyboardInterrupt) in the middle: the requests in flight finish and are saved, no job twice."""
    client, model = conn
    path = tmp_path / "run.jsonl"
    jobs = lt.synthetic_workload(24, input_len=8, output_len=16, seed=3)

    def interrupt_after_four(record, seen=[]):  # noqa: B006 -- counts across calls on purpose
        seen.append(record)
        if len(seen) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lt.run(client, model, jobs, concurrency=4, progress=False, save=path, on_record=interrupt_after_four,
               ignore_eos=True)
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    assert 4 <= len(ids) < 24 and len(set(ids)) == len(ids)
    res = lt.run(client, model, jobs, concurrency=4, progress=False, save=path, resume=True, ignore_eos=True)
    assert [r.status for r in res.records] == ["ok"] * 24
    assert len(path.read_text().splitlines()) == 24  # the second run sent only the jobs the first had not saved


@pytest.mark.server
def test_torn_last_line_is_skipped_and_csv_round_trips(conn, tmp_path):
    client, model = conn
    jobs = [lt.Job(i, f"In the beginning {i}", max_tokens=4) for i in range(8)]
    res = lt.run(client, model, jobs[:6], concurrency=2, progress=False, ignore_eos=True)
    path = res.save(tmp_path / "run.jsonl")
    with open(path, "a") as f:
        f.write('{"id": 6, "status": "o')  # the process died while writing
    with pytest.warns(UserWarning, match="incomplete"):
        assert len(lt.load(path)) == 6
    with pytest.warns(UserWarning, match="line.s. 7 are incomplete"):  # resuming after the torn line
        again = lt.run(client, model, jobs, progress=False, save=path, resume=True, ignore_eos=True)
    assert [r.status for r in again.records] == ["ok"] * 8
    with pytest.warns(UserWarning, match="line.s. 7 are"):
        assert len(lt.load(path)) == 8
    back = lt.load(res.save(tmp_path / "run.csv"))
    assert [asdict(r) for r in back.records] == [asdict(r) for r in res.records]
    assert back.summary() == res.summary()


@pytest.mark.server
def test_a_client_side_connection_cap_is_caught(conn):
    """The load-generator pitfall: a pool of 2 connections under 4 threads gives 2 requests in flight; run()
    says so before it starts, and the records show it."""
    client, model = conn
    capped = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key,
                           http_client=httpx.Client(limits=httpx.Limits(max_connections=2)))
    with pytest.warns(UserWarning, match="at most 2 connections, fewer than the 4"):
        res = lt.run(capped, model, lt.synthetic_workload(12, 8, 16, seed=4), concurrency=4, progress=False,
                     ignore_eos=True)
    s = res.summary()
    assert s["max_concurrency_seen"] <= 2 and s["max_outstanding"] == 4 and len(res.ok) == 12


@pytest.mark.server
def test_threads_and_asyncio_measure_the_same_requests(conn):
    client, model = conn
    jobs = lt.synthetic_workload(8, input_len=16, output_len=48, seed=0)
    res = lt.run(client, model, jobs, concurrency=4, progress=False, ignore_eos=True, temperature=0)
    s = res.summary()
    # 4 sent at once; the server answers 4 at once, or fewer when it is starved of CPU
    assert s["ok"] == 8 and s["max_outstanding"] >= 3 and 1 <= s["max_concurrency_seen"] <= s["max_outstanding"]
    assert all(r.output_tokens == 48 and r.prompt_tokens == 17 and len(r.itl) <= 47 for r in res.records)
    assert all(r.ttft < r.latency and r.tpot > 0 for r in res.records)
    ares = asyncio.run(lt.run_async(client, model, jobs, concurrency=4, progress=False, ignore_eos=True,
                                    temperature=0))
    assert ares.summary()["ok"] == 8 and ares.summary()["max_outstanding"] >= 3
    assert [r.text for r in ares.records] == [r.text for r in res.records]  # greedy: the same answers
    assert all(r.ttft < r.latency and r.tpot > 0 and len(r.itl) == 47 for r in ares.records)  # token by token


@pytest.mark.server
def test_asyncio_failures_are_records_with_the_reason(conn):
    """run_async's requests go over aiohttp: a refusal, a time-out and a server that is not there each end
    as one record with a sentence, as run()'s do over the openai client."""
    client, model = conn
    context = client.models.list().data[0].max_model_len
    jobs = [lt.Job("ok", "In the beginning", max_tokens=4), lt.Job("too long", "And the king said " * context),
            lt.Job("slow", "In the beginning", max_tokens=480)]
    res = asyncio.run(lt.run_async(client, model, jobs[:2], concurrency=2, progress=False))
    slow = asyncio.run(lt.run_async(client, model, jobs[2:], timeout=0.2, progress=False,
                                    extra_body={"ignore_eos": True}))  # 480 tokens take far longer than 0.2 s
    assert [r.status for r in res.records + slow.records] == ["ok", "error", "timeout"]
    assert res.records[1].error.startswith("HTTP 400: the server refused the request") and \
        "maximum context length" in res.records[1].error
    nowhere = openai.OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="none")
    down = asyncio.run(lt.run_async(nowhere, model, jobs[:2], progress=False))
    assert [r.status for r in down.records] == ["error", "error"]
    assert down.records[0].error.startswith("could not connect to the server at http://127.0.0.1:")


@pytest.mark.server
def test_sweep_on_the_embedded_server(conn):
    import matplotlib

    matplotlib.use("Agg")
    client, model = conn
    jobs = lt.synthetic_workload(8, input_len=16, output_len=32, seed=1)
    slo = {"ttft": 60.0, "tpot": 60.0}  # a minute: every request meets it, whatever the machine
    table = lt.sweep(client, model, jobs, concurrencies=(1, 4), progress=False, ignore_eos=True, temperature=0,
                     slo=slo)
    assert list(table.index) == [1, 4] and (table["ok"] == 8).all()
    assert table.loc[1, "max_outstanding"] == 1 and table.loc[4, "max_outstanding"] >= 3
    assert (table["goodput_share"] == 1.0).all()
    assert (table["goodput_requests_per_s"] == table["requests_per_s"]).all()
    # Throughput figures belong to benchmarks/ (a starved 2-core machine can erase the batching gain).
    left, right, good = lt.plot_sweep(table)
    assert len(right.texts) == 2 and set(table.attrs["results"]) == {1, 4}
    assert good.texts[0].get_text().startswith("best: c=") and "ttft <= 60000 ms" in good.get_title()
    assert len(lt.plot_sweep(table.drop(columns=["goodput_requests_per_s"]))) == 2
    with pytest.raises(ValueError, match="unknown SLO 'itl'"):
        lt.sweep(client, model, jobs, concurrencies=(1,), slo={"itl": 0.1})


@pytest.mark.server
def test_server_killed_mid_run_loses_nothing(conn, tmp_path):
    """A private server is killed (SIGKILL, like a crash) after three answers; then the run is resumed."""
    client, model = conn
    path = tmp_path / "killed.jsonl"
    jobs = lt.synthetic_workload(16, input_len=16, output_len=48, seed=2)
    with EmbeddedServer(kv_cache_gib=1) as srv:
        private, _ = llmlab.connect(srv.base_url, srv.api_key, quiet=True)
        done, killed_at = [], []

        def kill_after_three(record):
            done.append(record)
            if len(done) == 3:
                killed_at.append(time.time())
                os.killpg(srv.proc.pid, signal.SIGKILL)

        res = lt.run(private, model, jobs, concurrency=4, timeout=30, progress=False, save=path,
                     on_record=kill_after_three, ignore_eos=True, temperature=0)
    assert [r.id for r in res.records] == list(range(16))
    failed = res.failed
    assert 3 <= len(res.ok) < 16 and failed
    # Answers can arrive while the third one is being recorded, so how many finish is a race; what is not: every
    # answer belongs to a request sent before the crash, and every request sent after it failed.
    assert all(r.start < killed_at[0] for r in res.ok)
    assert all(r.status == "error" for r in res.records if r.start > killed_at[0])
    for r in failed:
        assert r.status == "error", r
        assert "nothing listens" in r.error or "connection broke" in r.error, r.error
    assert any("nothing listens" in r.error for r in failed)  # the jobs sent after the crash
    lines = path.read_text().splitlines()
    assert len(lines) == 16 and {json.loads(x)["id"] for x in lines} == set(range(16))

    resumed = lt.run(client, model, jobs, concurrency=4, progress=False, save=path, resume=True,
                     ignore_eos=True, temperature=0)
    assert [r.status for r in resumed.records] == ["ok"] * 16
    assert all(r.output_tokens == 48 for r in resumed.records)
    assert lt.load(path).summary()["ok"] == 16


# --- a full disk (issue 26): what was measured stays measured ------------------------------------------------

SIXTY = [lt.Job(i, f"In the beginning {i}") for i in range(60)]  # 60 records of 40 tokens fill 16 KiB

@pytest.mark.server
def test_a_full_disk_loses_no_record_of_a_run(conn, tiny_disk):
    """Before: the ENOSPC of one record aborted the run, the interrupt handler wrote again and failed again, and a
    chained traceback replaced the LoadResult.  Now the file keeps whole lines, the run goes on, and it says so."""
    import warnings

    client, model = conn
    path = tiny_disk / "run.jsonl"
    with pytest.warns(UserWarning) as warned:
        res = lt.run(client, model, SIXTY, concurrency=3, max_tokens=40, progress=False, save=path, ignore_eos=True)
    assert [r.id for r in res.records] == list(range(60)) and [r.status for r in res.records] == ["ok"] * 60
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn line would warn
        kept = lt.load(path)
    assert 0 < len(kept) < 60
    assert {r.id: asdict(r) for r in kept.records} == {r.id: asdict(r) for r in res.records if r.id in
                                                       {k.id for k in kept.records}}
    said = " ".join(str(w.message) for w in warned)
    assert "No space left on device" in said
    assert f"{path} keeps {len(kept)} of the 60 records of this run" in said and ".save(" in said


@pytest.mark.server
def test_saving_over_a_file_on_a_full_disk_keeps_the_old_file(conn, tiny_disk):
    """Before: save() truncated the file first, so a full disk destroyed the earlier results as well."""
    import errno

    client, model = conn
    small = lt.run(client, model, SIXTY[:2], max_tokens=4, progress=False)
    big = lt.run(client, model, SIXTY, concurrency=3, max_tokens=40, progress=False, ignore_eos=True)
    for name in ("run.jsonl", "run.csv"):
        path = small.save(tiny_disk / name)
        before = path.read_bytes()
        with pytest.raises(OSError, match=rf"No space left on device.*{name} is unchanged") as err:
            big.save(path)
        assert err.value.errno == errno.ENOSPC
        assert path.read_bytes() == before, "the earlier results were damaged"
        path.unlink()
    assert list(tiny_disk.iterdir()) == [], "a temporary file was left behind"
    # a .csv run is written whole at its end: a full disk then warns, and the run's records are still returned
    with pytest.warns(UserWarning, match=r"run.csv: could not write the 60 records.*No space left"):
        res = lt.run(client, model, SIXTY, concurrency=3, max_tokens=40, progress=False, ignore_eos=True,
                     save=tiny_disk / "run.csv")
    assert len(res.ok) == 60 and list(tiny_disk.iterdir()) == []


def test_raise_on_failure_names_the_count_and_the_first_error():
    ok, bad = lt.Record(id=0, status="ok"), lt.Record(id=1, status="error", error="HTTP 400: prompt too long")
    assert lt.LoadResult([ok]).raise_on_failure().ok == [ok]
    with pytest.raises(RuntimeError, match="1 of 2 requests failed, the first: HTTP 400: prompt too long"):
        lt.LoadResult([ok, bad]).raise_on_failure()
