"""Open-loop load: requests that arrive when they arrive, whether or not the server keeps up.

Why: a closed loop (``run()``) sends the next request only when one has finished, so a slow server slows its own
load down, and its queue never grows past the concurrency.  A room does not wait like that: thirty learners press
Shift-Enter when they reach the cell.  An open loop sends each request at its arrival time; when the server falls
behind, its queue grows and the TTFT with it -- the overload a closed loop cannot show.  The arrival processes:

- :func:`poisson_arrivals`: independent users, exponential gaps at a rate, as ``vllm bench serve --request-rate``
  draws them (gamma gaps of shape ``burstiness``; 1 is Poisson), rescaled so the last arrives at n / rate;
- :func:`burst`: N learners send the same cell's request at the same moment;
- :func:`synthetic_sessions`: multi-turn conversations, each turn sent a think time after the last answer, with
  the conversation so far (what the prefix cache of lesson 13 keeps).

:func:`run_open` sends requests at given times, :func:`run_rate` at a Poisson rate, :func:`run_sessions`
conversations; ``chat=True`` uses ``/v1/chat/completions``.  The records are ``run()``'s, plus ``late``: how long
after its arrival time a request went out (a load generator that cannot keep up has stopped being open-loop, and
the summary's ``sent_late_p99_s`` says so).  ``stop=`` ends a run early: ``llmlab.loadtest.find_max`` uses it
once a run is certainly past its SLO.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from llmlab.loadtest.records import Job, Record, as_jobs
from llmlab.loadtest.request import _send_async, _Settings
from llmlab.loadtest.results import LoadResult, _Appender

# --- arrival processes (pure, seeded) -------------------------------------------------------------------


def poisson_arrivals(n: int, rate: float, *, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Arrival times (seconds from the start) of ``n`` requests at ``rate`` per second.

    As ``vllm bench serve --request-rate R --burstiness B`` spaces them (vllm/benchmarks/serve.py, ``get_request``):
    gaps drawn from a gamma distribution of shape B and mean 1/R (B = 1: exponential, a Poisson process; B < 1
    burstier), summed, then rescaled so that the last request arrives at exactly n / R -- so two seeds give the
    same average rate.  The same ``seed`` gives the same times (numpy's own generator, not vLLM's draws)."""
    import numpy as np

    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: give a whole number of requests, at least 1.")
    if not rate > 0 or rate == float("inf"):
        raise ValueError(f"rate={rate!r}: give requests per second > 0 (a burst, everyone at once, is burst()).")
    if not burstiness > 0:
        raise ValueError(f"burstiness={burstiness!r}: give a number > 0 (1 is Poisson, below 1 burstier).")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()


def burst(prompt, learners: int, *, max_tokens: int | None = None) -> list[Job]:
    """The same request from ``learners`` learners at the same moment: everyone ran the cell at once.  Send it with
    ``run_open(client, model, jobs, [0.0] * learners)``: the server receives them all before the first answer."""
    if not isinstance(learners, int) or learners < 1:
        raise ValueError(f"learners={learners!r}: give a whole number, at least 1.")
    return [Job(id=i, prompt=prompt, max_tokens=max_tokens) for i in range(learners)]


@dataclass
class Session:
    """One user's conversation: ``turns`` sent one after the other, each ``think`` seconds after the answer to the
    one before, carrying the conversation so far.  ``start``: seconds from the run's start to the first turn."""

    id: int | str
    start: float
    turns: list[Job]
    think: list[float] = field(default_factory=list)  # len(turns) - 1 pauses; missing ones are 0


def synthetic_sessions(n: int, turns: int = 3, *, rate: float | None = None, think: float = 2.0, seed: int = 0,
                       input_len: int = 32, output_len: int = 32, tokenizer=None) -> list[Session]:
    """``n`` conversations of ``turns`` turns, each turn a new user message of ``input_len`` random tokens asking for
    ``output_len`` tokens.  They start at Poisson arrivals of ``rate`` per second (None: all at once), and each user
    thinks an exponential time of mean ``think`` seconds between an answer and the next turn (AIPerf's user-centric
    timing, a learner reading the answer).  Seeded: the same seed gives the same sessions."""
    import numpy as np

    from llmlab.loadtest.driver import synthetic_workload

    if not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns={turns!r}: give a whole number of turns, at least 1.")
    if think < 0:
        raise ValueError(f"think={think!r}: give seconds >= 0 between an answer and the next turn.")
    starts = poisson_arrivals(n, rate, seed=seed) if rate is not None else [0.0] * n
    messages = synthetic_workload(n * turns, input_len, output_len, seed=seed, tokenizer=tokenizer)
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in range(n):
        mine = [replace(j, id=f"s{i}-t{t}") for t, j in enumerate(messages[i * turns:(i + 1) * turns])]
        pauses = rng.exponential(think, size=turns - 1).tolist() if think > 0 else [0.0] * (turns - 1)
        out.append(Session(id=f"s{i}", start=starts[i], turns=mine, think=pauses))
    return out


def _sessions_of(prompts: Iterable, times: Iterable[float]) -> list[Session]:
    jobs, times = as_jobs(prompts), list(times)
    if len(times) != len(jobs):
        raise ValueError(f"{len(jobs)} prompts but {len(times)} arrival times: give one time per prompt.")
    if any(not t >= 0 for t in times):
        raise ValueError("arrival times are seconds from the start of the run: give numbers >= 0.")
    return [Session(id=j.id, start=float(t), turns=[j]) for j, t in zip(jobs, times, strict=True)]


# --- the run --------------------------------------------------------------------------------------------

# stop(records so far, requests in flight as (seconds since sent, whether a token came), requests planned) -> a
# sentence saying why the run ends now, or None to go on.
Stop = Callable[[list[Record], list[tuple[float, bool]], int], str | None]


def _next_turn(history, job: Job, answer: Record | None, chat: bool):
    """The prompt of a session's next turn: the conversation so far, then the new user message."""
    if chat:
        history = list(history or [])
        if answer is not None:
            history.append({"role": "assistant", "content": answer.text})
        if isinstance(job.prompt, list) and all(isinstance(m, dict) for m in job.prompt):
            return [*history, *job.prompt]  # the job's own messages
        return [*history, {"role": "user", "content": job.prompt if isinstance(job.prompt, str) else str(job.prompt)}]
    if answer is None:
        return job.prompt
    return f"{history}{answer.text}\n{job.prompt}"


async def _drive(client, model: str, sessions: list[Session], *, chat: bool, max_tokens: int, timeout: float,
                 appender: _Appender, on_record, stop: Stop | None, bar, sampling: dict):
    from llmlab.loadtest.driver import _endpoint, _open_session, unix_socket

    base_url, headers, params = _endpoint(client, sampling)
    cfg = _Settings(model, max_tokens, timeout, params, uuid.uuid4().hex[:8], None, base_url, chat=chat)
    url = f"{base_url}{cfg.path}"
    planned = sum(len(s.turns) for s in sessions)
    done: list[Record] = []
    flying: dict[int, object] = {}  # id(timer) -> the _Timer of a request in flight
    stopped: list[str] = []
    finished = asyncio.Event()

    def keep(rec: Record) -> None:
        done.append(rec)
        appender.write(rec)
        if on_record is not None:
            on_record(rec)
        bar.update(1)
        if len(done) == planned:
            finished.set()

    def check() -> None:
        if stop is None or stopped:
            return
        now = time.perf_counter()
        why = stop(done, [(now - t.t0, t.rec.ttft is not None) for t in flying.values()], planned)
        if why:
            stopped.append(why)
            finished.set()

    async def converse(session, s: Session, t0: float):
        due, history, answer = t0 + s.start, None, None
        for k, job in enumerate(s.turns):
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            history = _next_turn(history, job, answer, chat)
            timer = cfg.timer(replace(job, prompt=history))
            flying[id(timer)] = timer
            sent = time.perf_counter()
            try:
                rec = await _send_async(session, url, headers, replace(job, prompt=history), cfg, timer)
            finally:
                flying.pop(id(timer), None)
            rec.late = max(0.0, sent - due)
            keep(rec)
            if rec.status != "ok":  # the user got no answer: the conversation ends, its other turns are not sent
                for later in s.turns[k + 1:]:
                    keep(Record(id=later.id, status="error", session=cfg.session, start=rec.end, end=rec.end,
                                error=f"not sent: turn {k + 1} of session {s.id} failed ({rec.error})"))
                return
            answer = rec
            due = time.perf_counter() + (s.think[k] if k < len(s.think) else 0.0)

    async def watch():  # every half second, not at each record: a room of thousands of requests would pay
        while not finished.is_set():  # a scan of all of them per record out of the server's own CPU
            await asyncio.sleep(0.5)
            check()

    async with await _open_session(0, timeout, unix_socket(client)) as session:  # 0: no cap on connections
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(converse(session, s, t0)) for s in sessions]
        watcher = asyncio.ensure_future(watch())
        if planned:
            await finished.wait()
        for task in [*tasks, watcher]:
            task.cancel()  # a stop: requests not yet sent are not, those in flight are closed (vLLM aborts them)
        await asyncio.gather(*tasks, watcher, return_exceptions=True)
    return done, (stopped[0] if stopped else None)


def run_sessions(client, model: str, sessions: list[Session], *, chat: bool = False, max_tokens: int = 64,
                 timeout: float = 60.0, progress: bool = True, save: str | Path | None = None,
                 on_record: Callable[[Record], None] | None = None, stop: Stop | None = None,
                 rate: float | None = None, **sampling) -> LoadResult:
    """Send each session's turns open-loop: its first at ``start``, each next one ``think`` seconds after the answer.

    Every turn ends as one record, as in ``run()``; a turn that failed ends its conversation, and the turns never
    sent are records too (``error``: not sent, and why).  ``stop(records, in_flight, planned)`` is asked every half
    second (the records so far, and how long each request in flight has waited); a sentence ends the run (requests
    in flight are closed, the rest not sent) and the result's ``stopped`` holds it.  ``save``: a JSONL file the
    records are appended to as they finish.  Works in a script and in a notebook cell alike.
    """
    from tqdm.auto import tqdm

    from llmlab.loadtest.driver import in_a_loop
    from llmlab.serve.proc import raise_fd_limit

    path = Path(save) if save is not None else None
    if path is not None and path.exists() and path.stat().st_size:
        raise FileExistsError(f"{path} already holds records: choose another file (nothing was overwritten).")
    raise_fd_limit()  # hundreds of requests in flight at once need as many sockets
    appender = _Appender(path)
    planned = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=planned, desc="open loop", disable=not progress, unit="req", leave=False)
    try:
        records, stopped = in_a_loop(_drive(client, model, sessions, chat=chat, max_tokens=max_tokens,
                                            timeout=timeout, appender=appender, on_record=on_record, stop=stop,
                                            bar=bar, sampling=sampling))
    finally:
        bar.close()
    order = {str(j.id): i for i, j in enumerate(j for s in sessions for j in s.turns)}
    records.sort(key=lambda r: order.get(str(r.id), len(order)))
    appender.close(records)
    return LoadResult(records, None, rate=rate, planned=planned, stopped=stopped)


def run_open(client, model: str, prompts: Iterable, times: Iterable[float], **kwargs) -> LoadResult:
    """Send each prompt at its time (seconds from the start), whether or not earlier ones have been answered:
    :func:`run_sessions`'s keywords (``chat``, ``max_tokens``, ``timeout``, ``save``, ``stop``, sampling)."""
    return run_sessions(client, model, _sessions_of(prompts, times), **kwargs)


def run_rate(client, model: str, prompts: Iterable, rate: float, *, seed: int = 0, burstiness: float = 1.0,
             **kwargs) -> LoadResult:
    """Send the prompts at Poisson arrivals of ``rate`` per second (:func:`poisson_arrivals`, seeded): the open-loop
    workload of ``vllm bench serve --request-rate``.  :func:`run_sessions`'s keywords."""
    jobs = as_jobs(prompts)
    times = poisson_arrivals(len(jobs), rate, seed=seed, burstiness=burstiness)
    return run_sessions(client, model, _sessions_of(jobs, times), rate=rate, **kwargs)
