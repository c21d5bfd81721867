"""What is sent and what is recorded: a job, a record per request, and the summary of a run.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, repeats, driver.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from llmlab.serve.paths import TINY_MODEL

STATUSES = ("ok", "error", "timeout")
PERCENTILES = (50, 90, 99)
TINY_TOKENIZER = TINY_MODEL / "tokenizer.json"


# --- what is sent, and what is recorded -------------------------------------------------------------

@dataclass
class Job:
    """One prompt to send.  ``max_tokens`` None means the run's ``max_tokens``; ``input_len`` is what a
    synthetic workload aimed for (the server's ``prompt_tokens`` adds the BOS token).  For the chat endpoint the
    prompt may be a list of messages (``{"role": ..., "content": ...}``): a conversation so far."""

    id: int | str
    prompt: str | list[int] | list[dict]
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
    cached_tokens: int | None = None  # prompt tokens this request found in the prefix cache (None: not reported)
    late: float | None = None  # open loop: seconds it was sent after its arrival time (None: a closed loop)

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        names = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in names}
        for key in ("prompt_tokens", "ttft", "tpot", "latency", "t_response", "finish_reason", "max_tokens",
                    "concurrency", "cached_tokens", "late"):
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
            jobs.append(Job(id=p.get("id", i), prompt=p["messages"] if "messages" in p else p["prompt"],
                            max_tokens=p.get("max_tokens"), input_len=p.get("input_len")))
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


SLO_NAMES = ("ttft", "tpot", "latency")


def check_slo(slo: dict | None) -> dict[str, float] | None:
    """The service-level objectives of a goodput, in seconds: ``{"ttft": 0.5, "tpot": 0.05}`` (any of
    ttft, tpot, latency).  A wrong name or value is one sentence."""
    if slo is None:
        return None
    if not isinstance(slo, dict) or not slo:
        raise ValueError(f"slo should be a dict such as {{'ttft': 0.5, 'tpot': 0.05}} (seconds), got {slo!r}.")
    for name, limit in slo.items():
        if name not in SLO_NAMES:
            hint = " (vLLM's e2el is llmlab's latency)" if name == "e2el" else ""
            raise ValueError(f"unknown SLO {name!r}{hint}: use {', '.join(SLO_NAMES)}.")
        if isinstance(limit, bool) or not isinstance(limit, int | float) or not limit >= 0:
            raise ValueError(f"the SLO {name}={limit!r} should be a number of seconds >= 0 (vllm bench serve "
                             "--goodput takes milliseconds; llmlab takes seconds, like every time it reports).")
    return {name: float(limit) for name, limit in slo.items()}


def meets_slo(record: Record, slo: dict[str, float]) -> bool:
    """Whether one request met every objective.  A failed request never does; a one-token answer has no
    TPOT and counts as 0, as ``vllm bench serve --goodput`` counts it."""
    if record.status != "ok":
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "latency": record.latency}
    return all(values[name] is not None and values[name] <= limit for name, limit in slo.items())


def series(records: list[Record]) -> dict[str, list[float]]:
    """The timings of the ok requests, by measure: TTFT, TPOT and latency one per request, ITL every gap."""
    ok = [r for r in records if r.status == "ok"]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "latency": [r.latency for r in ok if r.latency is not None],
    }


def summarize(records: list[Record], concurrency: int | None = None, slo: dict | None = None) -> dict:
    """Counts, throughput and p50/p90/p99 (seconds) of TTFT, TPOT, ITL and latency over the ok requests.

    ``errors`` counts every request that did not succeed (timeouts included; ``timeouts`` says how many of
    them), so ``requests == ok + errors`` always holds.  With ``slo`` (seconds, see :func:`check_slo`):
    ``good`` requests met every objective, ``goodput_share`` is their share of all requests and
    ``goodput_requests_per_s`` their rate -- vLLM's "request goodput" (DistServe): throughput that users
    would accept, which a server can lose while its raw throughput still climbs.
    """
    slo = check_slo(slo)
    ok = [r for r in records if r.status == "ok"]
    duration = duration_of(records)
    out_tokens = sum(r.output_tokens for r in ok)
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
    for name, values in series(records).items():
        s[f"{name}_mean"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            s[f"{name}_p{q}"] = percentile(values, q)
    late = [r.late for r in records if r.late is not None]
    if late:  # an open loop that sends late is no longer the load asked for: say how late
        s["sent_late_p99_s"] = percentile(late, 99)
    if slo:
        good = sum(meets_slo(r, slo) for r in records)
        s.update(slo=slo, good=good, goodput_share=good / len(records) if records else 0.0,
                 goodput_requests_per_s=good / duration if duration > 0 else 0.0)
    return s
