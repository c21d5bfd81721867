"""Continuous batching and the scheduler made visible (notebook 16): the running batch step by step, static against
continuous batching, the server's limits, and preemption when the KV cache runs out.

Why: lesson 06 showed that requests in flight together are served faster than one after another; this is why.
vLLM's scheduler (``vllm/v1/core/sched/scheduler.py``) runs the model one **step** at a time, and before each step
it decides which requests take part: every running request gets its next token, and while the step's token
budget (``--max-num-batched-tokens``) and the cap on running requests (``--max-num-seqs``) allow, waiting requests
join -- their prompts are prefilled in the same step.  A request that ends leaves the batch at once, and the
next waiting one takes its place at the next step: **continuous batching**.  Static batching (a batch of N sent
together, the next batch only once all N have ended) leaves the finished requests' places empty until the
longest one ends.

The engine counts its own steps: ``vllm:iteration_tokens_total`` is a histogram observed once per batch of outputs
the engine core sends that holds at least one request's output (``vllm/v1/engine/async_llm.py``'s output handler),
with the tokens credited to it (prompt tokens of the prompts it finished, plus one per request that got a token).
A step that only advances a chunk of a long prompt, while nobody gets a token, sends no request output and is not
counted; in the lesson's workloads every step gives some request a token, so the difference of its ``_count`` over a
run is the steps the run took and of its ``_sum`` the tokens.  Both are read with :func:`counters` (one scrape's
:class:`~llmlab.serve.metrics.Counters`; ``after - before`` is a run's), with the preemptions and how many requests
were preempted more than once (``vllm:request_num_preemptions``).
The pure arithmetic to hold them against: :func:`static_steps` and :func:`continuous_steps`
(the fewest steps either way can take), :func:`blocks_at_longest` and :func:`fit_without_preemption` (how many
requests the KV pool holds to their end).  At the edges: :func:`send_over_time` (requests arriving over time),
:func:`static` and :func:`continuous` (the two ways of batching, through :mod:`llmlab.loadtest`), :class:`Sampler`
(the running and waiting requests over time, through :mod:`llmlab.top`'s readings) and :func:`measure`, which
puts a run, its counters and its samples together.  The lesson's workloads, which
``benchmarks/continuous_batching.py`` sends again for the figures the lesson quotes: :func:`arriving_requests`,
:func:`short_and_long_requests`, :func:`burst_requests` and :func:`long_requests`.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from llmlab import loadtest, top
from llmlab.kvcache import blocks_for
from llmlab.serve.metrics import (  # noqa: F401 -- the names and the snapshot, re-exported: notebook 16 reads them here
    PREEMPTIONS,
    REQUEST_PREEMPTIONS,
    STEPS,
    Counters,
    counters,
    wait_for_request,
)

__all__ = ["static_steps", "continuous_steps", "blocks_at_longest", "fit_without_preemption", "counters",
           "Counters", "Sampler", "Measured", "send_over_time", "static", "continuous", "measure",
           "compare_table", "plot_timeline", "in_flight", "SEED", "arriving_requests", "short_and_long_requests",
           "burst_requests", "long_requests"]


# --------------------------------------------------------------------------------------------------
# 1. The arithmetic: steps of static and continuous batching, KV blocks per request
# --------------------------------------------------------------------------------------------------

def _lengths(lengths, n) -> list[int]:
    lengths = list(lengths)
    if not lengths or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in lengths):
        raise ValueError(f"lengths={lengths!r}: give each request's output tokens as a whole number, at least 1.")
    _batch(n)
    return lengths


def _batch(n) -> int:
    """``n``, the batch (or the requests in flight), or one sentence for what it cannot be."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: the batch (or the requests in flight) is a whole number, at least 1.")
    return n


def static_steps(lengths, n: int) -> int:
    """The fewest engine steps static batching takes: the requests in batches of ``n`` (in the order given), a
    batch sent only once the one before has ended.  A request of m output tokens takes part in m steps (its
    prompt is prefilled in the step that gives its first token), so a batch lasts as long as its longest request:
    the sum, over the batches, of their longest."""
    lengths = _lengths(lengths, n)
    return sum(max(lengths[i:i + n]) for i in range(0, len(lengths), n))


def continuous_steps(lengths, n: int) -> int:
    """The fewest engine steps continuous batching takes with ``n`` requests in flight: each request (in the order
    given) joins the batch at the step after one has left, as a client that keeps ``n`` in flight sends the next.
    Requests that arrive later than that (a round trip, a busy CPU) only add steps, so a run takes at least this."""
    lengths = _lengths(lengths, n)
    ends = [0] * min(n, len(lengths))  # when each place in the batch is free again (a heap)
    for m in lengths:
        heapq.heappush(ends, heapq.heappop(ends) + m)
    return max(ends)


def blocks_at_longest(prompt_tokens: int, output_tokens: int, block_size: int) -> int:
    """KV blocks a request holds at its longest: its prompt and every output token but the last (sampled, never
    fed back), in whole blocks."""
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("a request has at least one prompt token and asks for at least one output token.")
    return blocks_for(prompt_tokens + output_tokens - 1, block_size)


def fit_without_preemption(pool_blocks: int, block_size: int, prompt_tokens: int, output_tokens: int) -> int:
    """How many such requests the pool holds at their longest, all at once: more running together and some are
    preempted before they end.  ``pool_blocks`` is vLLM's ``num_gpu_blocks``; one of them is its null block, never
    given to a request (``vllm/v1/core/block_pool.py``), so ``pool_blocks - 1`` are shared out."""
    if pool_blocks < 2:
        raise ValueError(f"pool_blocks={pool_blocks}: vLLM keeps one block aside, so a pool needs at least 2.")
    return (pool_blocks - 1) // blocks_at_longest(prompt_tokens, output_tokens, block_size)


# --------------------------------------------------------------------------------------------------
# 2. The engine's own counters, and the running batch over time
# --------------------------------------------------------------------------------------------------

class Sampler:
    """Scrape a server's ``/metrics`` every ``every`` seconds in a thread, keeping :mod:`llmlab.top`'s points
    (running and waiting requests, KV-cache use, the counters) until the ``with`` block ends.

    ``every=None``: a scrape at the start and one at the end only.  On two cores the scrapes compete with the client
    and the engine's front end: lesson 16's continuous run scraped every 0.1 s took 530 steps, unwatched 324 (medians
    of 3 rounds, ``benchmarks/results/cpu-continuous-batching/``), so a run whose point is its steps goes unwatched."""

    def __init__(self, client, every: float | None = 0.1):
        self.top = top.Top(top.target(client), size=100_000)
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmlab-batching-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.top.sample()
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self.top.sample()
        if self.every is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.top.sample()

    @property
    def points(self) -> list[top.Point]:
        return list(self.top.history.points)

    def peak(self, name: str) -> int:
        """The largest value a gauge (``"running"``, ``"waiting"``) had at any scrape."""
        return int(max((getattr(p, name) or 0) for p in self.points))


# --------------------------------------------------------------------------------------------------
# 3. Sending: over time, static batches, continuous
# --------------------------------------------------------------------------------------------------

def one_session(records, concurrency: int | None, session: str) -> loadtest.LoadResult:
    """Records of several sends as one run: their wall time is the run's, not the sum of theirs."""
    records = list(records)
    for r in records:
        r.session = session
    return loadtest.LoadResult(records, concurrency=concurrency)


def send_over_time(client, model: str, jobs: list, arrivals: list[float], **sampling) -> loadtest.LoadResult:
    """Send ``jobs[i]`` ``arrivals[i]`` seconds after the start (each as soon as it arrives, whatever is in
    flight), as users do; each asks for its own ``max_tokens`` (:class:`llmlab.loadtest.Job`).  Greedy and
    ``ignore_eos`` unless ``sampling`` says otherwise, so that each answer is exactly as long as asked."""
    if len(jobs) != len(arrivals):
        raise ValueError(f"{len(jobs)} jobs but {len(arrivals)} arrival times: give one time per job.")
    sampling = {"temperature": 0, "ignore_eos": True, "progress": False, **sampling}

    async def arrive(job, at, start):
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        return await loadtest.run_async(client, model, [job], concurrency=1, **sampling)

    async def everyone():
        start = time.monotonic()
        return await asyncio.gather(*(arrive(j, a, start) for j, a in zip(jobs, arrivals, strict=True)))

    runs = loadtest.in_a_loop(everyone())
    return one_session([r for run in runs for r in run.records], len(jobs), "over time").raise_on_failure()


def static(client, model: str, jobs: list, n: int, **sampling) -> loadtest.LoadResult:
    """Static batching from the client: ``n`` jobs sent together, the next ``n`` only when all of them ended."""
    _batch(n)
    sampling = {"temperature": 0, "ignore_eos": True, "progress": False, **sampling}
    records = []
    for i in range(0, len(jobs), n):
        records += loadtest.run(client, model, jobs[i:i + n], concurrency=n, **sampling).records
    return one_session(records, n, f"static {n}").raise_on_failure()


def continuous(client, model: str, jobs: list, n: int, **sampling) -> loadtest.LoadResult:
    """Continuous batching from the client's side: ``n`` in flight, the next job sent as soon as one ends
    (:func:`llmlab.loadtest.run`); the server then keeps its batch full."""
    sampling = {"temperature": 0, "ignore_eos": True, "progress": False, **sampling}
    return loadtest.run(client, model, jobs, concurrency=n, **sampling).raise_on_failure()


@dataclass(frozen=True)
class Measured:
    """A run and the server around it (:func:`measure`): the client's ``result`` and its ``summary``, ``delta`` --
    the server's :class:`~llmlab.serve.metrics.Counters` after the run less before it (engine ``steps`` and the
    ``step_tokens`` vLLM credits them with, ``preemptions``, ``generated``, ``finished``) -- the ``sampler``'s points,
    and ``alone``: the server generated exactly this run's tokens meanwhile, so its counters are this run's only (on
    a server others share, they add everyone's requests).

    A step's tokens are what vLLM credits it with: the answer tokens it gave, and a prompt's computed tokens in the
    step that finishes the prompt (``vllm/v1/metrics/stats.py``), so one step of a chunked prompt can show more than
    the budget; a preempted request's recomputation is not credited at all."""

    result: loadtest.LoadResult
    summary: dict
    delta: Counters
    sampler: Sampler
    alone: bool


def measure(client, send, *args, every: float | None = 0.1, **kwargs) -> Measured:
    """``send(*args, **kwargs)`` (one of the senders above) while a :class:`Sampler` watches the server, and its
    counters around it."""
    before = counters(client)
    with Sampler(client, every) as sampler:
        result = send(*args, **kwargs)
    delta = _settled(client, before, len(result.records)) - before
    return Measured(result, result.summary(), delta, sampler,
                    alone=delta.generated == sum(r.output_tokens for r in result.records))


def _settled(client, before: Counters, requests: int, timeout: float = 30.0) -> Counters:
    """The server's counters once it has counted ``requests`` more finished requests
    (:func:`~llmlab.serve.metrics.wait_for_request`: vLLM records a request just after its answer may have reached
    the client); after ``timeout`` seconds, the counters as they are."""
    try:
        return wait_for_request(client, before, requests, timeout)
    except TimeoutError:
        return counters(client)


# --------------------------------------------------------------------------------------------------
# 4. Reading a run: a table, a picture, the batch a client kept
# --------------------------------------------------------------------------------------------------

def in_flight(result: loadtest.LoadResult) -> float:
    """The mean number of this run's requests in flight (Little's law): the time each spent in the server, summed,
    over the run's wall time."""
    ok = result.ok
    duration = loadtest.duration_of(result.records)
    if not ok or duration <= 0:
        raise ValueError("no successful request, or a run of no duration: nothing was in flight.")
    return sum(r.end - r.start for r in ok) / duration


def compare_table(runs: dict[str, Measured]) -> pd.DataFrame:
    """One row per :func:`measure` result: wall time, output tokens/s, TTFT, TPOT and latency (p50), the engine's
    steps and tokens per step, the most requests running and waiting at one scrape (none for a run measured with
    ``every=None``), and preemptions."""
    def scaled(value, factor=1.0):  # a percentile of no sample (e.g. TPOT of one-token answers) is None
        return math.nan if value is None else value * factor

    rows = {}
    for name, run in runs.items():
        s, d = run.summary, run.delta
        rows[name] = {"wall (s)": s["duration_s"], "output tok/s": s["output_tokens_per_s"],
                      "TTFT p50 (ms)": scaled(s["ttft_p50"], 1e3), "TPOT p50 (ms)": scaled(s["tpot_p50"], 1e3),
                      "latency p50 (s)": scaled(s["latency_p50"]),
                      "engine steps": d.steps, "tokens/step": d.step_tokens / d.steps if d.steps else 0,
                      **{f"peak {g}": math.nan if run.sampler.every is None else run.sampler.peak(g)
                         for g in ("running", "waiting")},
                      "preemptions": d.preemptions}
    return pd.DataFrame(rows).T.round({"wall (s)": 2, "output tok/s": 0, "TTFT p50 (ms)": 0, "TPOT p50 (ms)": 1,
                                       "latency p50 (s)": 2, "tokens/step": 1})


def plot_timeline(run: Measured, ax=None, title: str = ""):
    """Above: each request as a bar, from its sending to its first token (light: waiting and prefill) and on to its
    last (dark: decoding).  Below: the running and waiting requests the server reported at each scrape."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(2, 1, figsize=(9, 5), sharex=True, height_ratios=[3, 2], layout="constrained")
    bars, gauges = ax
    records = sorted(run.result.records, key=lambda r: r.start)
    t0 = records[0].start
    for i, r in enumerate(records):
        first = r.start + (r.ttft or 0.0)
        bars.barh(i, first - r.start, left=r.start - t0, color="tab:orange", alpha=0.4)
        bars.barh(i, r.end - first, left=first - t0, color="tab:blue")
    bars.set_ylabel("request (by arrival)")
    bars.yaxis.get_major_locator().set_params(integer=True)
    bars.invert_yaxis()
    bars.set_title(title or "light: sent -> first token, dark: decoding", fontsize=9)
    points = [p for p in run.sampler.points if p.running is not None]
    x = [p.t - t0 for p in points]
    gauges.step(x, [p.running for p in points], where="post", label="running")
    gauges.step(x, [p.waiting for p in points], where="post", label="waiting")
    gauges.set_xlabel("seconds since the first request was sent")
    gauges.set_ylabel("requests")
    gauges.yaxis.get_major_locator().set_params(integer=True)
    gauges.legend(fontsize=8, loc="upper right")
    for a in ax:
        a.grid(alpha=0.3)
    return ax


# --------------------------------------------------------------------------------------------------
# 5. The lesson's workloads: notebook 16 and benchmarks/continuous_batching.py send the same requests
# --------------------------------------------------------------------------------------------------

SEED = 16  # one generator draws section 1's arrival times and lengths, then section 2's lengths


def _drawn(seed: int) -> tuple[list[float], list[int], list[int]]:
    """Sections 1 and 2's random figures, from one generator in this order: the arrival times and lengths of the
    requests arriving over time, then the short and long requests' lengths, shuffled."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.1, size=16)).round(3).tolist()
    arriving = rng.integers(16, 193, size=16).tolist()
    mixed = rng.permutation(rng.integers(8, 33, size=18).tolist() + rng.integers(160, 241, size=6).tolist()).tolist()
    return arrivals, arriving, mixed


def arriving_requests(seed: int = SEED) -> tuple[list[loadtest.Job], list[float]]:
    """Section 1's sixteen users: each sends one request at a random moment (gaps of 0.1 s on average, drawn from an
    exponential distribution: about a second and a half in all) and asks for 16 to 192 tokens.  Returns the jobs
    and each one's arrival time in seconds, for :func:`send_over_time`."""
    arrivals, lengths, _ = _drawn(seed)
    jobs = [loadtest.Job(id=i, prompt=f"User {i + 1} asks: how does a server answer many people at once?", max_tokens=m)
            for i, m in enumerate(lengths)]
    return jobs, arrivals


def short_and_long_requests(seed: int = SEED) -> list[loadtest.Job]:
    """Section 2's twenty-four requests, like a chat service's: 18 short answers of 8 to 32 tokens and 6 long ones
    of 160 to 240, in no particular order (drawn after :func:`arriving_requests`'s figures, by the same
    generator)."""
    *_, lengths = _drawn(seed)
    return [loadtest.Job(id=i, prompt=f"Request {i + 1}: tell me a story about the number {i + 1}.", max_tokens=m)
            for i, m in enumerate(lengths)]


# Sections 3 and 4's second engine: at most 8 running, 256 tokens a step, a KV pool of 12 blocks of 128 tokens.
SMALL_ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--num-gpu-blocks-override", "12"]


def burst_requests() -> list[loadtest.Job]:
    """Section 3's burst: 24 prompts of 64 random tokens (65 with the start token), 32 answer tokens each."""
    return loadtest.synthetic_workload(24, input_len=64, output_len=32, seed=16)


def long_requests() -> list[loadtest.Job]:
    """Section 4's six long requests: prompts of 60 random tokens (61 with the start token), 300 answer tokens
    each, enough to outgrow a small KV pool."""
    return loadtest.synthetic_workload(6, input_len=60, output_len=300, seed=17)
