"""Load testing an OpenAI-compatible server with a job queue that loses nothing (notebook 06).

Why: one request at a time leaves a vLLM server mostly idle -- it batches every request it holds into
each forward pass, so a second request in flight costs it little.  A job queue of N worker threads keeps N
requests in flight: as one finishes, the next is sent.  ``run()`` does that and measures every request
the way the field does (and the way ``vllm bench serve`` does, so the two can be compared):

- **TTFT**, time to first token: sending the request → the first streamed chunk that carries a token;
- **ITL**, inter-token latencies: the gaps between the chunks that follow;
- **TPOT**, time per output token: (latency − TTFT) / (output tokens − 1);
- **latency**, end to end: sending → the last token;
- throughput: output tokens (and requests) of the successful requests per second of wall time.

A load test must also check the load it *got*: a client connection pool smaller than the concurrency caps
it silently.  ``max_concurrency_seen`` counts the requests the server was answering at once (from its HTTP
answer to the last token), ``max_outstanding`` the ones the client had sent; ``connection_limit()`` reads
the client's pool and ``run()`` warns before it starts when the pool is too small.

A load test that silently drops the requests that failed reports a server better than it is.  So every
prompt ends as exactly one record -- ``ok``, ``error`` or ``timeout`` -- with the error in words; records
can be appended to a JSONL file as they finish, and a run that stopped half-way is resumed from it.

``run_async()`` is the same measurement with asyncio instead of threads; ``sweep()`` repeats a workload at
growing concurrency and ``plot_sweep()`` draws the throughput-vs-latency trade-off.  ``synthetic_workload()``
makes prompts of an exact token length from a seed, like ``vllm bench serve --dataset-name random``.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import inspect
import json
import math
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

STATUSES = ("ok", "error", "timeout")
PERCENTILES = (50, 90, 99)
TINY_TOKENIZER = Path(__file__).parent / "models" / "llmlab-tiny" / "tokenizer.json"


# --- what is sent, and what is recorded -------------------------------------------------------------

@dataclass
class Job:
    """One prompt to send.  ``max_tokens`` None means the run's ``max_tokens``; ``input_len`` is what a
    synthetic workload aimed for (the server's ``prompt_tokens`` adds the BOS token)."""

    id: int | str
    prompt: str | list[int]
    max_tokens: int | None = None
    input_len: int | None = None


@dataclass
class Record:
    """What happened to one job.  Times are seconds; ``start``/``end`` are Unix times (wall clock), the
    rest are measured with ``time.perf_counter`` from the moment the request was sent."""

    id: int | str
    status: str = "error"  # 'ok' | 'error' | 'timeout'
    prompt_tokens: int | None = None  # from the server's usage (None if it never said)
    output_tokens: int = 0  # usage.completion_tokens; for a failed request: tokens received before it failed
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None  # to the last token (ok requests only)
    itl: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0  # Unix time the request was sent
    end: float = 0.0  # Unix time it finished or failed
    t_response: float | None = None  # sending -> the server's HTTP response (it accepted the request)
    finish_reason: str | None = None
    max_tokens: int | None = None
    text: str = ""
    session: str = ""  # one id per run() call: a resumed file holds several sessions
    concurrency: int | None = None  # the run's setting (worker threads or coroutines)

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        for key in ("prompt_tokens", "ttft", "tpot", "latency", "t_response", "finish_reason", "max_tokens",
                    "concurrency"):
            if key in d and _missing(d[key]):
                d[key] = None
        if isinstance(d.get("itl"), str):  # from CSV
            d["itl"] = json.loads(d["itl"]) if d["itl"] else []
        for key in ("error", "text", "session"):
            if key in d and _missing(d[key]):
                d[key] = ""
        return cls(**d)


def _missing(value) -> bool:
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def as_jobs(prompts: Iterable) -> list[Job]:
    """Accept strings, token-id lists, ``Job``s or dicts (``prompt`` plus optional ``id``/``max_tokens``);
    ids default to the position and must be unique, since resuming a run matches records by id."""
    jobs = []
    for i, p in enumerate(prompts):
        if isinstance(p, Job):
            jobs.append(p)
        elif isinstance(p, dict):
            jobs.append(Job(id=p.get("id", i), prompt=p["prompt"], max_tokens=p.get("max_tokens"),
                            input_len=p.get("input_len")))
        elif isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            jobs.append(Job(id=i, prompt=p))
        else:
            raise TypeError(f"prompt {i} is a {type(p).__name__}: pass strings, token-id lists, Job or dicts.")
    ids = [str(j.id) for j in jobs]
    if len(set(ids)) != len(ids):
        dup = next(x for x in ids if ids.count(x) > 1)
        raise ValueError(f"job id {dup!r} appears twice: ids must be unique (a resumed run matches records by id).")
    return jobs


# --- the summary --------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """numpy's default (linear) percentile, as ``vllm bench serve`` reports; None for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def duration_of(records: list[Record]) -> float:
    """Wall time the records took: per session, first send to last finish; sessions add up (a resumed
    run's pause between sessions is not load-test time)."""
    spans: dict[str, tuple[float, float]] = {}
    for r in records:
        lo, hi = spans.get(r.session, (r.start, r.end))
        spans[r.session] = (min(lo, r.start), max(hi, r.end))
    return sum(hi - lo for lo, hi in spans.values())


def max_in_flight(records: list[Record], answered: bool = True) -> int:
    """The most requests in flight at once.

    ``answered=True`` (``max_concurrency_seen``): from the server's HTTP answer to the end -- requests the
    server was answering together.  This is what catches a client-side cap: a request waiting for a free
    connection in the client's pool has no answer yet.  ``answered=False`` (``max_outstanding``): from
    sending to the end -- what the load generator kept outstanding.  Where the first is lower, requests
    waited somewhere: in the client's pool, or at a server too short of CPU to answer them (on an
    overloaded machine its HTTP front end can answer requests one by one, all tokens in a burst).
    """
    events = []
    for r in records:
        if not answered:
            events += [(r.start, 1), (r.end, -1)]
        elif r.t_response is not None:
            events += [(r.start + r.t_response, 1), (r.end, -1)]
    seen = now = 0
    for _, step in sorted(events):  # at equal times -1 sorts first: back-to-back requests do not overlap
        now += step
        seen = max(seen, now)
    return seen


def connection_limit(client) -> int | None:
    """How many connections the openai client's HTTP pool opens at most; None when it cannot tell.

    Why: a pool smaller than the concurrency caps the load silently (aiohttp's default is 100, a plain
    ``httpx.Client``'s 100, the openai client's own 1,000).  This reads the pool of httpx / httpx2 -- not a
    public interface, so anything unexpected answers None and the run relies on ``max_concurrency_seen``.
    """
    pool = getattr(getattr(getattr(client, "_client", None), "_transport", None), "_pool", None)
    limit = getattr(pool, "_max_connections", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def summarize(records: list[Record], concurrency: int | None = None) -> dict:
    """Counts, throughput and p50/p90/p99 (seconds) of TTFT, TPOT, ITL and latency over the ok requests.

    ``errors`` counts every request that did not succeed (timeouts included; ``timeouts`` says how many of
    them), so ``requests == ok + errors`` always holds.
    """
    ok = [r for r in records if r.status == "ok"]
    duration = duration_of(records)
    out_tokens = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "latency": [r.latency for r in ok if r.latency is not None],
    }
    s = {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "timeouts": sum(r.status == "timeout" for r in records),
        "concurrency": concurrency,
        "max_concurrency_seen": max_in_flight(records),
        "max_outstanding": max_in_flight(records, answered=False),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
    }
    for name, values in series.items():
        s[f"{name}_mean"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            s[f"{name}_p{q}"] = percentile(values, q)
    return s


# --- results ------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """The records of a run (one per job, in the order of the jobs) and what they add up to."""

    records: list[Record]
    concurrency: int | None = None

    def summary(self) -> dict:
        return summarize(self.records, self.concurrency)

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "ok"]

    @property
    def failed(self) -> list[Record]:
        return [r for r in self.records if r.status != "ok"]

    def to_frame(self):
        """One row per record (a pandas DataFrame); ``itl`` stays a list."""
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.records], columns=[f.name for f in fields(Record)])

    def save(self, path: str | Path) -> Path:
        """Write every record to ``path``: JSONL, or CSV if the name ends in .csv."""
        return save_records(self.records, path)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        s = self.summary()
        return (f"LoadResult({s['requests']} requests: {s['ok']} ok, {s['errors']} failed; "
                f"{s['output_tokens_per_s']:.0f} output tokens/s at concurrency {self.concurrency})")


def save_records(records: Iterable[Record], path: str | Path) -> Path:
    """JSONL (one record per line) or, for a .csv name, CSV with ``itl`` as a JSON list."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(r) for r in records]
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(Record)])
            writer.writeheader()
            for row in rows:
                writer.writerow({**row, "itl": json.dumps(row["itl"])})
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(path: str | Path) -> LoadResult:
    """Read saved records (JSONL or CSV).  Where an id appears more than once (a resumed run appends),
    the last record wins.  A torn line -- the process died while writing it -- is skipped with a warning."""
    path = Path(path)
    rows: list[dict] = []
    if path.suffix == ".csv":
        import pandas as pd

        frame = pd.read_csv(path, dtype={"id": str, "error": str, "text": str, "session": str})
        rows = [{k: (None if _missing(v) else v) for k, v in row.items()} for row in frame.to_dict("records")]
        for row in rows:
            row["id"] = int(row["id"]) if str(row["id"]).lstrip("-").isdigit() else row["id"]
            for key in ("prompt_tokens", "output_tokens", "max_tokens", "concurrency"):
                if row.get(key) is not None:
                    row[key] = int(row[key])
    else:
        torn = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    torn.append(n)
        if torn:
            warnings.warn(f"{path}: line(s) {', '.join(map(str, torn))} are incomplete (a run stopped while writing "
                          "them) and were skipped; resuming sends those requests again.", stacklevel=2)
    latest: dict[str, Record] = {}
    for row in rows:
        rec = Record.from_dict(row)
        latest.pop(str(rec.id), None)
        latest[str(rec.id)] = rec
    levels = {r.concurrency for r in latest.values()}
    return LoadResult(list(latest.values()), levels.pop() if len(levels) == 1 else None)


class _Appender:
    """Appends one JSON line per finished record, flushed at once, under a lock: a crash loses at most
    the line being written, and no two threads interleave their lines."""

    def __init__(self, path: Path | None):
        self.path, self.lock = path, threading.Lock()
        self.csv = path is not None and path.suffix == ".csv"
        self.f = None
        if path is not None and not self.csv:
            path.parent.mkdir(parents=True, exist_ok=True)
            torn = False
            if path.exists() and path.stat().st_size:
                with open(path, "rb") as f:
                    f.seek(-1, 2)
                    torn = f.read(1) != b"\n"
            self.f = open(path, "a")
            if torn:  # a run died mid-line: end that line, so the next record starts on its own
                self.f.write("\n")

    def write(self, record: Record) -> None:
        if self.f is not None:
            line = json.dumps(asdict(record)) + "\n"
            with self.lock:
                self.f.write(line)
                self.f.flush()

    def close(self, records: list[Record]) -> None:
        if self.f is not None:
            self.f.close()
        elif self.csv:
            save_records(records, self.path)  # CSV cannot be appended safely: written whole at the end


# --- one request --------------------------------------------------------------------------------------

class _Deadline(Exception):
    """The request ran past the run's ``timeout``."""


def _openai_params(sampling: dict, create: Callable) -> dict:
    """Move vLLM's extra sampling parameters (ignore_eos, top_k, min_tokens, ...) into ``extra_body``, so
    that ``run(..., ignore_eos=True)`` works: the openai client refuses keywords it does not know."""
    try:
        known = set(inspect.signature(create).parameters)
    except (TypeError, ValueError):
        return dict(sampling)
    params, extra = {}, dict(sampling.pop("extra_body", None) or {})
    for key, value in sampling.items():
        (params if key in known else extra)[key] = value
    if extra:
        params["extra_body"] = extra
    return params


class _ServerError(Exception):
    """The server sent an error event in the middle of a stream."""


def _event(line: str):
    """One line of a server-sent-events stream: its JSON payload, ``None`` for the blank lines and comments
    between events, and ``"[DONE]"`` at the end."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    return payload if payload == "[DONE]" else json.loads(payload)


class _Timer:
    """Turns the streamed events of one completion into a ``Record``; shared by the thread and the asyncio
    variants so that both measure exactly the same thing.

    Why raw events and not the openai client's typed chunks: building a typed object costs ~0.3 ms of CPU
    per token, so at a thousand tokens per second the load generator itself would eat a third of a core --
    taken from the server it measures when both share a machine.  The openai client still does the HTTP
    (URL, key, HTTP errors); each event is parsed with ``json.loads``, as ``vllm bench serve`` does.
    """

    def __init__(self, job: Job, max_tokens: int, timeout: float, session: str, base_url: str,
                 concurrency: int | None = None):
        self.rec = Record(id=job.id, max_tokens=max_tokens, session=session, concurrency=concurrency)
        self.timeout, self.base_url = timeout, base_url
        self.pieces: list[str] = []
        self.chunks = 0
        self.last: float | None = None
        self.t0 = 0.0
        self.t_end: float | None = None

    def sent(self) -> None:
        self.rec.start = time.time()
        self.t0 = time.perf_counter()

    def answered(self) -> None:
        self.rec.t_response = time.perf_counter() - self.t0

    def line(self, line: str) -> None:
        """Take one line of the stream: a token, the usage, an error event, or nothing."""
        now = self.t_end = time.perf_counter() - self.t0  # taken before the connection can be released
        data = _event(line)
        if data is None or data == "[DONE]":
            return
        if "error" in data or data.get("object") == "error":
            error = data.get("error", data)
            raise _ServerError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        usage = data.get("usage")
        if usage:
            self.rec.prompt_tokens = usage.get("prompt_tokens")
            self.rec.output_tokens = usage.get("completion_tokens") or 0
        choices = data.get("choices")
        if choices:  # a token (its text may be empty: a special token, half a UTF-8 character)
            if self.rec.ttft is None:
                self.rec.ttft = now
            else:
                self.rec.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
            self.pieces.append(choices[0].get("text") or "")
            if choices[0].get("finish_reason"):
                self.rec.finish_reason = choices[0]["finish_reason"]
        if now > self.timeout:
            raise _Deadline

    def done(self) -> Record:
        """The stream ended; its end is the last line read (the [DONE] event), before the connection went
        back to the pool -- on a starved machine a thread can wait long after that for the CPU, and another
        request would then seem to overlap it."""
        r = self._close(at=self.t_end)
        if r.ttft is None:
            r.status, r.error = "error", "the server answered but streamed no token."
        elif r.finish_reason is None:
            r.status, r.error = "error", (f"the stream ended after {r.output_tokens} tokens without a finish_reason: "
                                          "the server stopped sending mid-answer.")
        else:
            r.status = "ok"
            r.latency = self.last
            if r.output_tokens > 1:
                r.tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
        return r

    def failed(self, exc: BaseException) -> Record:
        r = self._close(at=None)  # the failure happened now
        r.status, r.error = describe_failure(exc, r.output_tokens, self.timeout, self.base_url)
        return r  # ttft and itl stay: they say how far the request got

    def _close(self, at: float | None) -> Record:
        r = self.rec
        r.end = r.start + (at if at is not None else time.perf_counter() - self.t0)
        r.text = "".join(self.pieces)
        if not r.output_tokens:  # no usage chunk (it comes last): count the token chunks received
            r.output_tokens = self.chunks
        return r


def _chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and what caused it: openai wraps the HTTP library's error, which names the problem."""
    out: list[BaseException] = []
    while exc is not None and all(exc is not e for e in out):
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _find(chain: list[BaseException], *names: str) -> BaseException | None:
    """The first exception in ``chain`` of a class named one of ``names`` (or derived from one).  By name:
    the openai client runs on httpx or on its fork httpx2, whose classes are distinct but named alike."""
    return next((e for e in chain if any(c.__name__ in names for c in type(e).__mro__)), None)


def describe_failure(exc: BaseException, tokens: int, timeout: float, base_url: str = "") -> tuple[str, str]:
    """(status, one sentence) for a request that failed: what happened, in words a learner can act on."""
    import openai

    from llmlab.client import describe_error

    chain = _chain(exc)
    where = f" at {base_url}" if base_url else ""
    got = f"after {tokens} token{'s' * (tokens != 1)}"
    if isinstance(exc, _Deadline):
        return "timeout", (f"no complete answer within timeout={timeout:g} s ({got}): the server is overloaded or "
                           "stuck; lower the concurrency or raise timeout.")
    if isinstance(exc, openai.APITimeoutError | TimeoutError) or _find(chain, "TimeoutException"):
        return "timeout", (f"the server{where} sent nothing for {timeout:g} s ({got}): it is overloaded, stuck, "
                           "or the client's connection pool is full; lower the concurrency or raise timeout.")
    if isinstance(exc, openai.APIStatusError):
        return "error", describe_error(exc)
    if isinstance(exc, _ServerError):
        return "error", f"the server reported an error {got} and ended the answer: {exc}"
    if isinstance(exc, json.JSONDecodeError):
        return "error", f"the server sent an event that is not JSON {got} ({exc}): is this an OpenAI-compatible API?"
    if (cause := _find(chain, "ConnectError")) is not None:
        return "error", (f"could not connect to the server{where} ({cause}): nothing listens there -- the server "
                         "is down, restarting, or the address is wrong.")
    if (cause := _find(chain, "RemoteProtocolError", "ReadError", "WriteError", "EndOfStream")) is not None:
        when, during = (got, "mid-answer") if tokens else ("before the first token", "before answering")
        return "error", (f"the connection broke {when} ({type(cause).__name__}: {cause}): the server closed it "
                         f"{during} -- it crashed, was stopped, or restarted.")
    if isinstance(exc, openai.APIError):
        return "error", f"the server reported an error {got}: {exc}"
    return "error", f"{type(exc).__name__} {got}: {exc}"


@dataclass
class _Settings:
    """What every request of one run shares."""

    model: str
    max_tokens: int
    timeout: float
    params: dict
    session: str
    concurrency: int
    base_url: str = ""

    def timer(self, job: Job) -> _Timer:
        return _Timer(job, job.max_tokens or self.max_tokens, self.timeout, self.session, self.base_url,
                      self.concurrency)

    def request(self, job: Job) -> dict:
        return dict(model=self.model, prompt=job.prompt, max_tokens=job.max_tokens or self.max_tokens, stream=True,
                    stream_options={"include_usage": True}, **self.params)


def _send(client, job: Job, cfg: _Settings) -> Record:
    """Send one streamed completion; never raises (apart from KeyboardInterrupt): a failure is a record."""
    timer = cfg.timer(job)
    timer.sent()
    try:
        with client.completions.with_streaming_response.create(**cfg.request(job)) as response:
            timer.answered()
            for line in response.iter_lines():
                timer.line(line)
        return timer.done()
    except Exception as e:  # noqa: BLE001 -- every failure becomes a record, none stops the run
        return timer.failed(e)


async def _send_async(client, job: Job, cfg: _Settings) -> Record:
    timer = cfg.timer(job)
    timer.sent()
    try:
        async with client.completions.with_streaming_response.create(**cfg.request(job)) as response:
            timer.answered()
            async for line in response.iter_lines():
                timer.line(line)
        return timer.done()
    except Exception as e:  # noqa: BLE001
        return timer.failed(e)


# --- a run ----------------------------------------------------------------------------------------------

def _prepare(prompts, save, resume) -> tuple[list[Job], dict[str, Record], Path | None]:
    jobs = as_jobs(prompts)
    path = Path(save) if save is not None else None
    previous: dict[str, Record] = {}
    if resume:
        if path is None:
            raise ValueError("resume=True needs save=PATH: the records of the earlier run are read from there.")
        if path.exists():
            wanted = {str(j.id) for j in jobs}
            previous = {str(r.id): r for r in load(path).records if r.status == "ok" and str(r.id) in wanted}
    elif path is not None and path.exists() and path.stat().st_size:
        raise FileExistsError(f"{path} already holds records: pass resume=True to finish that run, or choose "
                              "another file (nothing was overwritten).")
    return jobs, previous, path


def _finish(jobs, previous, new: dict[str, Record], appender: _Appender, concurrency: int,
            pool_known: bool) -> LoadResult:
    records = [previous.get(str(j.id)) or new.get(str(j.id)) for j in jobs]
    records = [r for r in records if r is not None]  # only jobs never started (an interrupt) are absent
    appender.close(records)
    result = LoadResult(records, concurrency)
    fresh = [new[str(j.id)] for j in jobs if str(j.id) in new]
    seen = max_in_flight(fresh)
    # Where the client's pool could not be read, the measured concurrency is the only clue to a cap.  A
    # busy server may answer a request only after another ended: one short (one in eight) is no cap.
    slack = max(1, concurrency // 8) if concurrency >= 4 else 0
    if not pool_known and len(fresh) >= 2 * concurrency and seen < concurrency - slack:
        warnings.warn(f"asked for {concurrency} requests in flight, but the server never answered more than {seen} "
                      "at once: a client connection-pool limit, too few worker threads, or a machine too busy to "
                      f"keep up? The figures describe concurrency {seen}.", stacklevel=3)
    return result


def _check_pool(client, concurrency: int) -> bool:
    """Warn before the run when the client's connection pool is smaller than the concurrency; return
    whether the pool could be read."""
    limit = connection_limit(client)
    if limit is not None and limit < concurrency:
        warnings.warn(f"the client's connection pool opens at most {limit} connections, fewer than the {concurrency} "
                      f"requests asked for: at most {limit} will be in flight. Give the client a larger pool "
                      "(http_client=httpx.Client(limits=httpx.Limits(max_connections=...))).", stacklevel=3)
    return limit is not None


def _start_threads(pool: ThreadPoolExecutor, n: int, timeout: float = 10.0) -> None:
    """Start all ``n`` worker threads before the first request, so that the load begins at once.

    The executor starts a thread at each submit; on a busy machine a thread started while others are
    already streaming can wait a long time for the CPU, and the first requests then run at less than the
    concurrency asked for.  Each thread waits at a barrier until all exist.
    """
    barrier = threading.Barrier(n + 1)
    for _ in range(n):
        pool.submit(barrier.wait, timeout)
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait(timeout)


def run(client, model: str, prompts: Iterable, *, concurrency: int = 8, max_tokens: int = 64,
        timeout: float = 60.0, progress: bool = True, save: str | Path | None = None, resume: bool = False,
        on_record: Callable[[Record], None] | None = None, **sampling) -> LoadResult:
    """Send every prompt with ``concurrency`` worker threads; as one request finishes, the next is sent.

    - ``prompts``: strings, token-id lists, ``Job``s (see ``synthetic_workload``) or dicts.
    - ``timeout``: seconds a request may take in all (checked at each chunk) or stay silent; it then ends
      as a ``timeout`` record.  The client does not retry (``max_retries=0``): a retry would hide a failure
      and count its time as latency.
    - ``save``: append each record to this JSONL file as it finishes (a ``.csv`` name is written at the
      end); ``resume=True`` skips the jobs the file already holds as ``ok`` and sends the rest again.
    - ``on_record(record)``: called in the worker thread after each request (live plots, tests).
    - ``**sampling``: request parameters (``temperature=0``, ``seed``, ``ignore_eos=True``, ``top_k``...);
      vLLM's own ones are moved into ``extra_body``.

    Returns a ``LoadResult``: one record per prompt, in the order given, and ``.summary()``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: at least one request must be in flight.")
    jobs, previous, path = _prepare(prompts, save, resume)
    todo = [j for j in jobs if str(j.id) not in previous]
    fast = client.with_options(timeout=timeout, max_retries=0)
    pool_known = _check_pool(fast, concurrency)
    cfg = _Settings(model, max_tokens, timeout, _openai_params(dict(sampling), fast.completions.create),
                    uuid.uuid4().hex[:8], concurrency, str(getattr(client, "base_url", "")))
    appender, new = _Appender(path), {}

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=len(previous), desc=f"{concurrency} in flight", disable=not progress,
               unit="req", leave=False)
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llmlab-load")
    _start_threads(pool, concurrency)
    futures = {}
    try:
        futures = {pool.submit(_send, fast, j, cfg): j for j in todo}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                rec = fut.result()
            except Exception as e:  # noqa: BLE001 -- a bug in _send must not lose the job either
                rec = Record(id=job.id, status="error", error=f"{type(e).__name__}: {e}", session=cfg.session,
                             start=time.time(), end=time.time(), concurrency=concurrency)
            new[str(job.id)] = rec
            appender.write(rec)
            if on_record is not None:
                on_record(rec)
            bar.update(1)
            bar.set_postfix(ok=sum(r.status == "ok" for r in new.values()) + len(previous),
                            failed=sum(r.status != "ok" for r in new.values()), refresh=False)
    except BaseException:  # an interrupt: requests in flight finish (bounded by timeout) and are kept
        pool.shutdown(wait=True, cancel_futures=True)
        for fut, job in futures.items():
            if str(job.id) not in new and fut.done() and not fut.cancelled() and fut.exception() is None:
                new[str(job.id)] = fut.result()
                appender.write(new[str(job.id)])
        _finish(jobs, previous, new, appender, concurrency, pool_known)
        raise
    finally:
        bar.close()
    pool.shutdown(wait=True)
    return _finish(jobs, previous, new, appender, concurrency, pool_known)


async def run_async(client, model: str, prompts: Iterable, *, concurrency: int = 8, max_tokens: int = 64,
                    timeout: float = 60.0, progress: bool = True, save: str | Path | None = None,
                    resume: bool = False, on_record: Callable[[Record], None] | None = None,
                    **sampling) -> LoadResult:
    """``run()`` with asyncio: ``concurrency`` coroutines pull jobs from one queue, in one thread.

    In a notebook: ``result = await loadtest.run_async(client, model, prompts)``.  ``client`` may be the
    synchronous ``openai.OpenAI`` of ``llmlab.connect()`` (an ``AsyncOpenAI`` with its URL and key is made)
    or an ``AsyncOpenAI``.  Records and summary are the same as ``run()``'s.
    """
    import openai

    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: at least one request must be in flight.")
    jobs, previous, path = _prepare(prompts, save, resume)
    made = not isinstance(client, openai.AsyncOpenAI)
    aclient = (openai.AsyncOpenAI(base_url=str(client.base_url), api_key=client.api_key) if made else client)
    fast = aclient.with_options(timeout=timeout, max_retries=0)
    pool_known = _check_pool(fast, concurrency)
    cfg = _Settings(model, max_tokens, timeout, _openai_params(dict(sampling), fast.completions.create),
                    uuid.uuid4().hex[:8], concurrency, str(aclient.base_url))
    appender, new = _Appender(path), {}
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for j in jobs:
        if str(j.id) not in previous:
            queue.put_nowait(j)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=len(previous), desc=f"{concurrency} in flight (asyncio)",
               disable=not progress, unit="req", leave=False)

    async def worker():
        while True:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rec = await _send_async(fast, job, cfg)
            new[str(job.id)] = rec
            appender.write(rec)
            if on_record is not None:
                on_record(rec)
            bar.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        bar.close()
        if made:
            await aclient.close()
    return _finish(jobs, previous, new, appender, concurrency, pool_known)


# --- workloads --------------------------------------------------------------------------------------------

def _codec(tokenizer):
    """(encode, decode, vocab size) for a tokenizers.Tokenizer, a transformers tokenizer, a path or a name."""
    if tokenizer is None:
        tokenizer = TINY_TOKENIZER
    if isinstance(tokenizer, str | Path):
        p = Path(tokenizer)
        if p.is_dir() and (p / "tokenizer.json").is_file():
            p = p / "tokenizer.json"
        if p.suffix == ".json" and p.is_file():
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(p))
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokenizer.get_vocab_size())
    return (lambda text: tokenizer.encode(text, add_special_tokens=False),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=True), len(tokenizer))


def random_prompt(rng, length: int, encode, decode, vocab: int, tries: int = 20) -> str:
    """Text of exactly ``length`` tokens (when ``tries`` allow): random ids, decoded, re-encoded, then cut
    or topped up until decoding and re-encoding keep the length -- neighbouring tokens can merge.  Ids that
    decode to nothing or to half a character (byte tokens: they come back as U+FFFD) are never drawn."""
    usable: dict[int, bool] = {}

    def draw(k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            for i in rng.integers(0, vocab, size=2 * (k - len(out)) + 4).tolist():
                if i not in usable:
                    piece = decode([i])
                    usable[i] = bool(piece.strip()) and "\ufffd" not in piece
                if usable[i] and len(out) < k:
                    out.append(i)
        return out

    ids = draw(length)
    for _ in range(tries):
        text = decode(ids)
        got = encode(text)
        if len(got) == length:
            break
        ids = got[:length] if len(got) > length else got + draw(length - len(got))
    return text


def synthetic_workload(n: int, input_len: int = 32, output_len: int = 32, *, seed: int = 0, tokenizer=None,
                       range_ratio: float = 0.0) -> list[Job]:
    """``n`` prompts of random tokens, ``input_len`` tokens each, asking for ``output_len`` tokens.

    Why random tokens: a benchmark must control the lengths, which decide the work (prefill ∝ input,
    decode steps = output); the same seed gives the same prompts.  ``range_ratio`` r draws each length
    uniformly from [len·(1−r), len·(1+r)].  Pass ``ignore_eos=True`` to ``run()`` so that every request
    really generates its ``max_tokens``.  ``tokenizer``: the served model's (a ``tokenizers``/transformers
    object, a path or a name); by default the shipped tiny model's.
    """
    import numpy as np

    encode, decode, vocab = _codec(tokenizer)
    rng = np.random.default_rng(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return int(rng.integers(lo, hi + 1))

    jobs = []
    for i in range(n):
        n_in, n_out = length(input_len), length(output_len)
        jobs.append(Job(id=i, prompt=random_prompt(rng, n_in, encode, decode, vocab), max_tokens=n_out, input_len=n_in))
    return jobs


# --- a concurrency sweep ----------------------------------------------------------------------------------

def sweep(client, model: str, prompts: Iterable, concurrencies: Iterable[int] = (1, 2, 4, 8), *, warmup: int = 1,
          progress: bool = True, **kwargs):
    """Run the same prompts at each concurrency; return a pandas DataFrame, one summary row per level.

    ``warmup`` requests go first at each level and are not counted (the first request after a pause pays
    for waking the engine).  The ``LoadResult``s are in ``table.attrs["results"]`` by concurrency.
    """
    import pandas as pd

    jobs = as_jobs(prompts)
    rows, results = [], {}
    for c in concurrencies:
        if warmup:
            run(client, model, jobs[:warmup], concurrency=1, progress=False,
                **{k: v for k, v in kwargs.items() if k not in ("save", "resume", "on_record")})
        res = run(client, model, jobs, concurrency=c, progress=progress, **kwargs)
        results[c] = res
        rows.append(res.summary())
    table = pd.DataFrame(rows).set_index("concurrency")
    table.attrs["results"] = results
    return table


def plot_sweep(table, latency: str = "tpot_p50", axes=None):
    """Two panels: output tokens/s against concurrency (with perfect scaling from the first level), and
    ``latency`` (ms) against throughput, one labelled point per concurrency -- the trade-off curve."""
    import matplotlib.pyplot as plt

    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    left, right = axes
    c = table.index.to_numpy()
    tput = table["output_tokens_per_s"].to_numpy()
    left.plot(c, tput, "o-", label="measured")
    left.plot(c, tput[0] * c / c[0], ":", color="grey", label="perfect scaling")
    left.set_xscale("log", base=2)
    left.set(xlabel="requests in flight (concurrency)", ylabel="output tokens / s", title="Throughput")
    left.minorticks_off()
    left.set_xticks(c, [str(x) for x in c])
    left.set_ylim(0, max(tput) * 1.3)
    left.legend()
    lat = table[latency].to_numpy() * 1000
    right.plot(tput, lat, "o-")
    for x, y, n in zip(tput, lat, c, strict=True):
        right.annotate(f"c={n}", (x, y), textcoords="offset points", xytext=(5, 5))
    name = {"tpot": "time per output token", "ttft": "time to first token", "latency": "end-to-end latency",
            "itl": "inter-token latency"}.get(latency.rsplit("_", 1)[0], latency)
    right.set(xlabel="output tokens / s", ylabel=f"{name}, {latency.rsplit('_', 1)[-1]} (ms)",
              title="Latency vs throughput")
    right.set_ylim(0, max(lat) * 1.2)
    right.figure.tight_layout()
    return axes
