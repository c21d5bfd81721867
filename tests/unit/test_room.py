"""The room's parts that need no root and no SLURM (``llmlab.ops.roomtrace``, ``llmlab.ops.roomreport``): what a
learner's kernel records of its requests, the report's figures, the replay's schedule.  The room itself runs in
tests/cluster/test_room.py."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmlab.ops import roomreport, roomtrace

ROOT = Path(__file__).resolve().parents[2]


class FakeServer(http.server.BaseHTTPRequestHandler):
    """Just enough of an OpenAI-compatible server: a JSON completion, or a stream of 3 tokens with usage."""

    def do_POST(self):  # noqa: N802 -- http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                chunk = {"choices": [{"text": f"t{i}", "finish_reason": "length" if i == 2 else None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return
        answer = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                             "choices": [{"index": 0, "text": "hi", "finish_reason": "length", "logprobs": None}],
                             "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self):  # noqa: N802
        answer = (json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                          "owned_by": "x"}]}).encode()
                  if self.path.endswith("/v1/models") else b"ok")  # what connect() asks first
        self.send_response(200)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


KERNEL = """
import sys, urllib.request
import openai, httpx
from llmlab.ops import roomtrace
import llmlab.loadtest as lt
roomtrace.install(sys.argv[2], "03_online_inference")
url = sys.argv[1]
client = openai.OpenAI(base_url=url, api_key="secret-key")
client.completions.create(model="m", prompt="In the beginning", max_tokens=2, temperature=0)
list(client.completions.create(model="m", prompt="Stream", max_tokens=3, stream=True))
lt.run(client, "m", ["A", "B"], concurrency=2, max_tokens=3, progress=False, ignore_eos=True)
urllib.request.urlopen(url.removesuffix("/v1") + "/metrics").read()
httpx.get(url.removesuffix("/v1") + "/metrics")
"""


def test_trace_records_every_stack_the_path_uses(fake_url, tmp_path):
    """openai (httpx2), loadtest (aiohttp), urllib and httpx: one line each, with the prompt, max_tokens and the
    usage, and never the key.  In a subprocess: the recorder patches those libraries for its whole process."""
    trace = tmp_path / "trace.jsonl"
    out = subprocess.run([sys.executable, "-c", KERNEL, fake_url, str(trace)], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    lines = roomtrace.read(trace)
    assert "secret-key" not in trace.read_text()
    gen = [line for line in lines if roomtrace.is_generation(line)]
    assert len(gen) == 4 and len(lines) == 6, lines
    plain, streamed, *loadtest = gen
    assert plain["prompt"] == "In the beginning" and plain["max_tokens"] == 2 and plain["completion_tokens"] == 2
    assert plain["lib"] in ("httpx", "httpx2") and plain["notebook"] == "03_online_inference"
    assert streamed["stream"] and streamed["completion_tokens"] == 3 and not streamed.get("tokens_counted")
    assert {line["lib"] for line in loadtest} == {"aiohttp"} and {line["prompt"] for line in loadtest} == {"A", "B"}
    assert all(line["completion_tokens"] == 3 and line["params"]["ignore_eos"] for line in loadtest)
    assert all(line["status"] == 200 and line["elapsed_s"] >= line["ttfb_s"] >= 0 for line in lines)
    assert {line["lib"] for line in lines if line["path"] == "/metrics"} == {"urllib", "httpx"}


def test_usage_of_a_stream_without_usage_counts_its_events():
    body = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'
    assert roomtrace._usage(body) == {"completion_tokens": 2, "tokens_counted": True}
    assert roomtrace._usage(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 1}}') == {
        "prompt_tokens": 3, "completion_tokens": 1}


def test_report_figures():
    results = {"a": {"start": 0, "end": 100, "notebooks": [{"notebook": "03", "failed": [
                   {"cell": 4, "error": "AssertionError: x", "raised_at": "assert x"}]}]},
               "b": {"start": 5, "end": 125, "notebooks": []},
               "c": {"start": 9, "end": 40, "notebooks": [], "refused": {"notebook": "03", "cell": 1, "sentence": "s"}}}
    assert roomreport.cells_failed(results) == [{"learner": "a", "notebook": "03", "cell": 4,
                                                 "error": "AssertionError: x", "raised_at": "assert x"}]
    seconds = roomreport.path_seconds(results)
    assert seconds == {"a": 100, "b": 120, "c": 31}
    assert roomreport.fairness(seconds, ["a", "b"]) == round(120 / 110, 3)  # the revoked learner c is left out
    rev = roomreport.revocation({"revoked": "c", "revoke_at": "03", "revocation": {"said": "gone"}}, results)
    assert rev["refused"] and rev["sentence"] == "s" and rev["others_refused"] == []


def test_replay_schedule_cycles_learners_and_keeps_their_offsets():
    traces = {"a": [{"start": 100.0, "prompt": "p", "completion_tokens": 7},
                    {"start": 102.5, "messages": [{"role": "user", "content": "hi"}], "completion_tokens": 0,
                     "max_tokens": 9}],
              "b": [{"start": 50.0, "prompt": "q", "completion_tokens": 3}]}
    plan = roomreport.schedule(traces, 3, stagger=1.0)
    assert [(at, job.id, job.max_tokens) for at, job in plan] == [
        (0.0, "0-0", 7), (1.0, "1-0", 3), (2.0, "2-0", 7), (2.5, "0-1", 9), (4.5, "2-1", 9)]
    assert plan[3][1].prompt == "hi"


def test_replay_sends_the_traces_for_each_room_size(fake_url, tmp_path):
    import openai

    traces = tmp_path / "traces"
    traces.mkdir()
    lines = [{"start": 10.0, "method": "POST", "path": "/v1/completions", "prompt": "a", "completion_tokens": 3},
             {"start": 10.2, "method": "GET", "path": "/v1/models"},
             {"start": 10.3, "method": "POST", "path": "/v1/chat/completions", "messages": [{"content": "b"}],
              "completion_tokens": 3}]
    (traces / "x.trace.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    client = openai.OpenAI(base_url=fake_url, api_key="k")
    report = roomreport.replay(tmp_path, (1, 3), stagger=0.05, client=client, model="m", out=tmp_path,
                               progress=lambda s: None)
    assert report["learners"] == [1, 3] and json.loads((tmp_path / "replay.json").read_text()) == report
    assert [(r["learners"], r["requests"], r["ok"], r["failures"]) for r in report["runs"]] == [(1, 2, 2, 0),
                                                                                                  (3, 6, 6, 0)]
    assert report["runs"][1]["ttft_ms"]["p50"] is not None
    import gzip  # every request kept, so that the percentiles can be recomputed from the records (issue 52)

    for k, n in ((1, 2), (3, 6)):
        with gzip.open(tmp_path / f"replay-{k}.records.jsonl.gz", "rt") as f:
            records = [json.loads(line) for line in f]
        assert len(records) == n and {r["status"] for r in records} == {"ok"}
        assert sorted(r["id"] for r in records) == sorted(f"{i}-{j}" for i in range(k) for j in range(2))
        assert "text" not in records[0] and all(round(r["ttft"], 6) == r["ttft"] for r in records)


def test_a_replay_without_out_writes_under_build_never_into_the_traces_folder(fake_url, tmp_path, monkeypatch):
    """Issue 47: the default was the traces' folder, which may be a committed result or the only recording."""
    from llmlab.ops.cli import main

    traces = tmp_path / "traces"
    traces.mkdir()
    line = {"start": 1.0, "method": "POST", "path": "/v1/completions", "prompt": "a", "completion_tokens": 2}
    (traces / "x.trace.jsonl").write_text(json.dumps(line) + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLMLAB_BASE_URL", fake_url)
    monkeypatch.setenv("LLMLAB_API_KEY", "k")
    assert main(["room", "--replay", str(traces), "--learners", "1", "--stagger", "0"]) == 0
    assert sorted(p.name for p in traces.iterdir()) == ["x.trace.jsonl"]
    assert (tmp_path / "build" / "room-replay" / "replay.json").is_file()


def test_find_max_bracket_is_met_then_missed_or_a_room_met_alone(tmp_path, capsys):
    """``--bracket 30,45`` (30 met, 45 missed earlier) or ``--bracket 44`` (44 met): anything else is one sentence,
    before any server is reached."""
    from llmlab.ops.cli import main

    for bad in ("45,30", "30,30", "30,40,45"):
        assert main(["room", "--replay", str(tmp_path), "--find-max", "--slo", "ttft_p99<2s", "--bracket", bad]) == 2
        err = capsys.readouterr().err
        assert f"--bracket '{bad}': give the room an earlier search met and the one it missed" in err


@pytest.mark.parametrize("given, named", [
    (["--slo", "ttft_p99<2s"], "--slo belongs"), (["--bracket", "30,45"], "--bracket belongs"),
    (["--repeats", "3", "--resolution", "0.1"], "--repeats, --resolution belong")])
def test_a_search_option_without_find_max_is_one_sentence_not_ignored(tmp_path, capsys, given, named):
    """``llmlab room --replay T --bracket 30,45`` without ``--find-max`` would replay 30 learners and ignore the
    bracket: a sentence instead, before any server is reached."""
    from llmlab.ops.cli import main

    assert main(["room", "--replay", str(tmp_path), *given]) == 2
    assert f"llmlab room: {named} to --find-max: add --find-max" in capsys.readouterr().err

def test_the_committed_gpu_replays_are_the_workshop_guides_sizing_table():
    """benchmarks/results/h100x2-llama3.1-8b-room-replay (issue 36): every replayed request answered, and each run's
    TTFT p50 / p99 is the row docs/workshop.md sizes rooms from."""
    folder = ROOT / "benchmarks" / "results" / "h100x2-llama3.1-8b-room-replay"
    guide = (ROOT / "docs" / "workshop.md").read_text()
    runs = {(d.name, r["learners"]): r for d in sorted(folder.glob("tp*"))
            for r in json.loads((d / "replay.json").read_text())["runs"]}
    assert set(runs) == {("tp1-gpu0", 300), ("tp1-gpu1", 30), ("tp1-gpu1", 100), ("tp2-gpu0-1", 300)}
    for r in runs.values():
        assert r["failures"] == 0 and r["ok"] == r["requests"] and r["server_peaks"]["waiting"] == 0
        assert f"{round(r['ttft_ms']['p50'])} ms / {round(r['ttft_ms']['p99'])} ms" in guide


def test_the_room_reads_learners_files_without_following_links_and_prints_no_escapes(tmp_path):
    """F8 of security-review-3: the room runs as root over its learners' files.  A trace made a symbolic link to a
    root-only file was copied into the 0644 report, an events line without "kind" stopped the room's loop, and a
    notebook name with escape sequences reached the instructor's terminal as it was."""
    import os

    from llmlab.ops import room as roommod

    me = "learner-1"
    r = roommod.Room(tag="t", group="g", learners=[me], work=tmp_path / "work", out=tmp_path / "out",
                     uids={me: os.getuid()})
    files = r.files(me)
    files.mkdir(parents=True)
    for sub in ("traces", "learners"):
        (r.out / sub).mkdir(parents=True)
    secret = tmp_path / "root-only"
    secret.write_text("ROOT-ONLY SECRET\n")
    (files / "trace.jsonl").symlink_to(secret)
    fake = "\x1b[31mFAKE: all learners done\x1b[0m"
    events = [{"kind": "notebook", "notebook": fake}, {"no kind": 1}, "junk",
              {"kind": "cell", "notebook": fake, "cell": 4}]
    (files / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + "{cut by a kill")
    (files / "results.json").write_text('{"cells": []}')
    assert roommod.where(r, me) == "?[ cell 4"  # ESC shown as ?, never sent to the terminal
    roommod.collect(r)
    assert not (r.out / "traces" / f"{me}.trace.jsonl").exists()  # a link: not read, not copied
    assert (r.out / "learners" / f"{me}.results.json").read_text() == '{"cells": []}'
    assert roommod.learner_file(r, "someone-else", "results.json") is None  # no uid known: nothing read
