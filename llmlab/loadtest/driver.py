"""A run: the job queue of threads (or asyncio), workloads of exact token lengths, a concurrency sweep.

Part of ``llmlab.loadtest`` (its ``__init__`` says what a load test measures); read them in the order records,
results, request, repeats, driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from llmlab.loadtest.records import TINY_TOKENIZER, Job, Record, as_jobs, check_slo, connection_limit, max_in_flight
from llmlab.loadtest.repeats import Repeated
from llmlab.loadtest.request import _send_async, _Settings
from llmlab.loadtest.results import LoadResult, _Appender, load

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


class _Streams:
    """One thread running an event loop with an aiohttp session: every worker thread's request streams there.

    Why not stream in each worker thread: on the course's 2-core machine, eight threads each woken by every
    token of its own stream left the server short of CPU and made the client's own latency tail -- 0.62 of
    ``vllm bench serve``'s throughput, TTFT p99 9.7x (benchmarks/loadtest_vs_vllm_bench.py).  One loop wakes
    once for all the streams that have data; a worker thread wakes once per request, when its record is done.
    """

    def __init__(self, limit: int, timeout: float, uds: str | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="llmlab-load-io", daemon=True)
        self.thread.start()
        self.session = self.call(_open_session(limit, timeout, uds))

    def call(self, coroutine):
        """Run ``coroutine`` on the loop; wait for its result in the calling thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.call(self.session.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _open_session(limit: int, timeout: float, uds: str | None = None):
    """An aiohttp session of ``limit`` connections; ``timeout`` bounds connecting and each silence.  ``uds``: every
    connection goes to this Unix socket instead (a server's owner reaching vLLM behind the proxy)."""
    import aiohttp

    connector = aiohttp.UnixConnector(path=uds, limit=limit) if uds else aiohttp.TCPConnector(limit=limit)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout))


def _endpoint(client, sampling: dict) -> tuple[str, dict, dict]:
    """(base URL, headers, request parameters) of an openai client: its URL and key, and the sampling
    parameters as one request body (the openai client's ``extra_body`` -- vLLM's own parameters -- merged in)."""
    params = dict(sampling)
    params.update(params.pop("extra_body", None) or {})
    return str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {client.api_key}"}, params


def unix_socket(client) -> str | None:
    """The Unix socket an openai client's httpx transport was made for (``httpx.HTTPTransport(uds=...)``), else None:
    the streams then go there too, as the client's own requests would (benchmarks/proxy_overhead.py's direct way)."""
    transport = getattr(getattr(client, "_client", None), "_transport", None)
    return getattr(getattr(transport, "_pool", None), "_uds", None)


def in_a_loop(coroutine):
    """Run ``coroutine`` to its end on a fresh event loop in a worker thread and return its result: this works in a
    script and in a notebook cell alike (a notebook's kernel already runs a loop of its own in the main thread)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def run(client, model: str, prompts: Iterable, *, concurrency: int = 8, max_tokens: int = 64,
        timeout: float = 60.0, progress: bool = True, save: str | Path | None = None, resume: bool = False,
        on_record: Callable[[Record], None] | None = None, **sampling) -> LoadResult:
    """Send every prompt with ``concurrency`` worker threads; as one request finishes, the next is sent.

    - ``client``: the ``openai.OpenAI`` of ``llmlab.connect()``: its URL, key and connection-pool size are
      used.  The streams themselves are read on one event loop (``_Streams`` says why).
    - ``prompts``: strings, token-id lists, ``Job``s (see ``synthetic_workload``) or dicts.
    - ``timeout``: seconds a request may take in all (checked at each chunk) or stay silent; it then ends
      as a ``timeout`` record.  Nothing is retried: a retry would hide a failure and count its time as latency.
    - ``save``: append each record to this JSONL file as it finishes (a ``.csv`` name is written at the
      end); ``resume=True`` skips the jobs the file already holds as ``ok`` and sends the rest again.
    - ``on_record(record)``: called after each request, in the calling thread (live plots, tests).
    - ``**sampling``: request parameters (``temperature=0``, ``seed``, ``ignore_eos=True``, ``top_k``...),
      vLLM's own ones too.

    Returns a ``LoadResult``: one record per prompt, in the order given, and ``.summary()``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: at least one request must be in flight.")
    jobs, previous, path = _prepare(prompts, save, resume)
    todo = [j for j in jobs if str(j.id) not in previous]
    pool_known = _check_pool(client, concurrency)
    base_url, headers, params = _endpoint(client, sampling)
    cfg = _Settings(model, max_tokens, timeout, params, uuid.uuid4().hex[:8], concurrency, base_url)
    appender, new = _Appender(path), {}

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=len(previous), desc=f"{concurrency} in flight", disable=not progress,
               unit="req", leave=False)
    streams = _Streams(min(concurrency, connection_limit(client) or concurrency), timeout, unix_socket(client))

    def send(job: Job) -> Record:
        return streams.call(_send_async(streams.session, f"{base_url}/completions", headers, job, cfg))

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="llmlab-load")
    _start_threads(pool, concurrency)
    futures = {}
    try:
        futures = {pool.submit(send, j): j for j in todo}
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                rec = fut.result()
            except Exception as e:  # noqa: BLE001 -- a bug in _send_async must not lose the job either
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
        streams.close()
    return _finish(jobs, previous, new, appender, concurrency, pool_known)


async def run_async(client, model: str, prompts: Iterable, *, concurrency: int = 8, max_tokens: int = 64,
                    timeout: float = 60.0, progress: bool = True, save: str | Path | None = None,
                    resume: bool = False, on_record: Callable[[Record], None] | None = None,
                    **sampling) -> LoadResult:
    """``run()`` with asyncio: ``concurrency`` coroutines pull jobs from one queue, in one thread.

    In a notebook: ``result = await loadtest.run_async(client, model, prompts)``.  ``client`` is the
    ``openai.OpenAI`` of ``llmlab.connect()`` or an ``AsyncOpenAI``: its URL and key are used, and the requests
    go over aiohttp, one connection per coroutine (``_send_async`` says why).  Records and summary are the
    same as ``run()``'s.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: at least one request must be in flight.")
    jobs, previous, path = _prepare(prompts, save, resume)
    base_url, headers, params = _endpoint(client, sampling)
    cfg = _Settings(model, max_tokens, timeout, params, uuid.uuid4().hex[:8], concurrency, base_url)
    appender, new = _Appender(path), {}
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for j in jobs:
        if str(j.id) not in previous:
            queue.put_nowait(j)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), initial=len(previous), desc=f"{concurrency} in flight (asyncio)",
               disable=not progress, unit="req", leave=False)

    async def worker(session):
        while True:
            try:
                job = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            rec = await _send_async(session, f"{base_url}/completions", headers, job, cfg)
            new[str(job.id)] = rec
            appender.write(rec)
            if on_record is not None:
                on_record(rec)
            bar.update(1)

    try:  # the pool is as large as the concurrency, by construction
        async with await _open_session(concurrency, timeout) as session:
            await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    finally:
        bar.close()
    return _finish(jobs, previous, new, appender, concurrency, pool_known=True)


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

def repeat(client, model: str, prompts: Iterable, repeats: int = 5, *, concurrency: int = 8, **kwargs) -> Repeated:
    """:func:`~llmlab.loadtest.run` the same prompts ``repeats`` times at one concurrency; each run is timed on its
    own (its throughput is its own), and the records of all of them give the intervals.  ``save``/``resume`` are
    per run, so they are refused here."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give a whole number of runs, at least 1 (5 or more for an interval "
                         "worth reading).")
    if "save" in kwargs or "resume" in kwargs:
        raise ValueError("repeat() takes no save= or resume=: save each run's records with "
                         "Repeated.results[i].save(path).")
    prompts = list(prompts)
    return Repeated([run(client, model, prompts, concurrency=concurrency, **kwargs) for _ in range(repeats)],
                    concurrency)


def sweep(client, model: str, prompts: Iterable, concurrencies: Iterable[int] = (1, 2, 4, 8), *, warmup: int = 1,
          progress: bool = True, slo: dict | None = None, repeats: int = 1, **kwargs):
    """Run the same prompts at each concurrency; return a pandas DataFrame, one summary row per level.

    ``warmup`` requests go first at each level and are not counted (the first request after a pause pays
    for waking the engine).  The ``LoadResult``s are in ``table.attrs["results"]`` by concurrency.  ``slo``
    (seconds, e.g. ``{"ttft": 0.5, "tpot": 0.05}``) adds each level's goodput (``good``, ``goodput_share``,
    ``goodput_requests_per_s``), which ``plot_sweep`` then draws.  ``repeats`` > 1 runs each level that many
    times (:func:`~llmlab.loadtest.repeat`): each figure is then the median of the runs, with ``<figure>_low`` /
    ``_high`` columns, and ``attrs["results"]`` holds a :class:`~llmlab.loadtest.Repeated` per level.
    """
    import pandas as pd

    check_slo(slo)  # before any request: a typo in an SLO should not cost a whole sweep
    jobs = as_jobs(prompts)
    rows, results = [], {}
    for c in concurrencies:
        if warmup:
            run(client, model, jobs[:warmup], concurrency=1, progress=False,
                **{k: v for k, v in kwargs.items() if k not in ("save", "resume", "on_record")})
        if repeats == 1:
            res = run(client, model, jobs, concurrency=c, progress=progress, **kwargs)
        else:
            res = repeat(client, model, jobs, repeats, concurrency=c, progress=progress, **kwargs)
        results[c] = res
        rows.append(res.summary(slo))
    table = pd.DataFrame(rows).set_index("concurrency")
    table.attrs["results"] = results
    return table


def plot_sweep(table, latency: str = "tpot_p50", axes=None):
    """Two panels: output tokens/s against concurrency (with perfect scaling from the first level), and
    ``latency`` (ms) against throughput, one labelled point per concurrency -- the trade-off curve.  A sweep
    with an ``slo`` gets a third: goodput (requests/s within the SLOs) beside raw requests/s."""
    import matplotlib.pyplot as plt

    goodput = "goodput_requests_per_s" in table.columns
    if axes is None:
        _, axes = plt.subplots(1, 3 if goodput else 2, figsize=(16 if goodput else 11, 3.8))
    left, right = axes[0], axes[1]
    if goodput:
        _plot_goodput(table, axes[2])
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
    top = lat
    if f"{latency}_low" in table.columns:  # a repeated sweep: each level's interval
        low, top = table[f"{latency}_low"].to_numpy() * 1000, table[f"{latency}_high"].to_numpy() * 1000
        right.errorbar(tput, lat, yerr=[lat - low, top - lat], fmt="none", capsize=3, color="C0")
    for x, y, n in zip(tput, lat, c, strict=True):
        right.annotate(f"c={n}", (x, y), textcoords="offset points", xytext=(5, 5))
    name = {"tpot": "time per output token", "ttft": "time to first token", "latency": "end-to-end latency",
            "itl": "inter-token latency"}.get(latency.rsplit("_", 1)[0], latency)
    right.set(xlabel="output tokens / s", ylabel=f"{name}, {latency.rsplit('_', 1)[-1]} (ms)",
              title="Latency vs throughput")
    right.set_ylim(0, max(top) * 1.2)
    right.figure.tight_layout()
    return axes


def _plot_goodput(table, ax) -> None:
    """Requests/s and goodput against concurrency, the best goodput marked: where users stop being served."""
    c = table.index.to_numpy()
    ax.plot(c, table["requests_per_s"].to_numpy(), "o:", color="grey", label="all requests")
    good = table["goodput_requests_per_s"].to_numpy()
    ax.plot(c, good, "o-", label="within the SLOs")
    best = int(good.argmax())
    ax.annotate(f"best: c={c[best]}", (c[best], good[best]), textcoords="offset points", xytext=(5, -14))
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in table["slo"].iloc[0].items())
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(c, [str(x) for x in c])
    ax.set(xlabel="requests in flight (concurrency)", ylabel="requests / s", title=f"Goodput ({slo})")
    ax.set_ylim(0, max(table["requests_per_s"].max(), good.max()) * 1.3)
    ax.legend()
