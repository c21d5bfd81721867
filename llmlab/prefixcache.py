"""Prefix caching and chunked prefill at the scale of a room (notebook 13): 30 learners, one server.

Why: notebook 02 showed one request reusing another's blocks.  A workshop is 30 learners sending the same system
prompt at the same moment, and two questions follow: how much of the room's prefill and KV memory does the
shared prompt save (the first learner computes it, the other 29 find its whole blocks), and what does a long
prompt arriving in the middle of everyone's answers do to the tokens they are waiting for.

vLLM names a block by a hash of its tokens chained to the block before it; a request's ``cache_salt`` enters the
first block's hash, so requests with different salts never share a block.  The same switch serves two ends:
:func:`room_salts` gives one salt for the room (sharing within it, and a cold cache on every run of the
notebook) or one per learner (no sharing at all, which is also what closes the timing side channel of a shared
server).  :func:`run_room` sends every learner's request at once through :mod:`llmlab.loadtest` and reads the
server's counters and KV gauge around it (:mod:`llmlab.kvcache`); :func:`expected_hits` and
:func:`expected_blocks` are the arithmetic to hold them against.  :func:`itl_while_prompts_arrive` measures the
gaps between the tokens of running requests while long prompts are prefilled, the figure chunked prefill is for.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass

import pandas as pd

from llmlab import kvcache, loadtest, memory
from llmlab.kvcache import blocks_for, blocks_in_use, prefix_cache_hit_tokens
from llmlab.memory import GPU_BLOCK_SIZE
from llmlab.serve.metrics import Counters, counters, wait_for_request

# The workshop's system prompt: 384 tokens of the tiny model's tokenizer, so with its start token three whole CPU
# blocks of 128 (twelve of the cluster-mode model's 32).  Another model's tokenizer splits it differently: the
# notebook counts the server's own tokens.
SYSTEM = (
    'You are the teaching assistant of a workshop on serving language models. Thirty learners sit in the room, '
    'and each of them sends you questions from a notebook. Answer in plain words, in two or three sentences, and '
    'never more than the question needs. When a learner asks about memory, explain it with the numbers of the '
    'model that the room is using: its layers, its heads, the bytes of every value, and the number of tokens that '
    'a request holds. When a learner asks about time, say which part of the work takes it: reading the prompt, '
    'which is done once and for all of its tokens together, or writing the answer, which is done one token at a '
    'time. When a learner asks why the server is slow, ask first how many requests were running, how long the '
    'prompts were, and whether the cache was already full. Do not guess a number that the server itself can tell: '
    'its metrics are there to be read. If a learner shows you an error, read it with them, say what it means in '
    'one sentence, and then say what to try next. Keep the same terms through the whole day: a block is a block, '
    'a request is a request, and the cache is the store of keys and values that the server keeps for every token '
    'it has read. The learners will often send the same question in different words; answer each of them as if it '
    "were the first time, since none of them sees what the others asked. Now the learner's question follows."
)

QUESTIONS = ["What does the server keep for every token?", "Why is the memory divided into blocks?",
             "When does a request wait in the queue?", "What is the time to first token?",
             "Why do two requests share a block?", "What happens when the pool is full?"]


def _count(value, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what}={value!r}: give a whole number, at least {least}.")
    return value


def room_prompts(system: str, learners: int = 30, questions: list[str] = QUESTIONS) -> list[str]:
    """One prompt per learner: the shared ``system`` prompt, then that learner's own question (numbered, so that
    no two prompts are the same even where the questions repeat)."""
    _count(learners, "learners")
    if not system or not questions:
        raise ValueError("give a non-empty system prompt and at least one question.")
    return [f"{system}\nLearner {i + 1}: {questions[i % len(questions)]}\nAnswer:" for i in range(learners)]


def room_salts(learners: int, shared: bool) -> list[str]:
    """``cache_salt`` per learner: one fresh salt for all (``shared``: the room shares its blocks, with nobody
    outside it, not even an earlier run) or a fresh one each (no learner can reuse, or time, another's blocks).
    43 random characters, the length vLLM's documentation asks for (256 bits)."""
    _count(learners, "learners")
    if shared:
        return [secrets.token_urlsafe(32)] * learners
    return [secrets.token_urlsafe(32) for _ in range(learners)]


@dataclass(frozen=True)
class Salted(kvcache.Timed):
    """:func:`salted_request`'s answer: the client's :class:`~llmlab.kvcache.Timed` and ``counted``, the server's
    prefix-cache hits around it."""

    counted: int = 0


def salted_request(client, model: str, prompt, salt: str) -> Salted:
    """One greedy token of ``prompt`` under ``cache_salt`` ``salt`` (:func:`llmlab.kvcache.timed_completion`: the
    TTFT and the request's own ``cached_tokens``), with the server's prefix-cache hit counter around it
    (``counted``).  Why both: ``cached_tokens`` is this request's alone but None from a server started without
    ``--enable-prompt-tokens-details``; the counter is there on every vLLM server, and adds everyone's requests
    that finished meanwhile."""
    before = counters(client)
    answer = kvcache.timed_completion(client, model, prompt, max_tokens=1, extra_body={"cache_salt": salt})
    return Salted(**asdict(answer), counted=(wait_for_request(client, before) - before).prefix_hits)


def server_lengths(client, model: str, prompts: list[str]) -> tuple[list[int], int]:
    """``(tokens of each prompt, tokens all prompts share at the start)`` as the server's tokenizer counts them
    (:func:`llmlab.kvcache.server_token_ids`: one echoed request each, which caches their blocks unsalted --
    ask after an experiment, or salt the experiment)."""
    ids = [kvcache.server_token_ids(client, model, p) for p in prompts]
    return [len(i) for i in ids], len(os.path.commonprefix(ids))


def expected_hits(prompt_tokens: list[int], shared_tokens: int, block_size: int, salts: list[str]) -> int:
    """Prefix-cache hit tokens of a room whose prompts begin with ``shared_tokens`` common tokens: the first
    request of each salt computes the shared prefix, every later one with that salt reuses its whole blocks
    (:func:`llmlab.kvcache.prefix_cache_hit_tokens`: full blocks only, the last prompt token always computed).

    It holds for requests that arrive together too: vLLM names a request's full blocks when it schedules them,
    so the next request scheduled, even in the same step, finds them."""
    if len(prompt_tokens) != len(salts):
        raise ValueError(f"{len(prompt_tokens)} prompt lengths but {len(salts)} salts: one of each per learner.")
    seen, hits = set(), 0
    for n, salt in zip(prompt_tokens, salts, strict=True):
        if salt in seen:
            hits += prefix_cache_hit_tokens(n, min(shared_tokens, n), block_size)
        seen.add(salt)
    return hits


def expected_blocks(prompt_tokens: list[int], shared_tokens: int, block_size: int, salts: list[str],
                    max_tokens: int) -> int:
    """KV blocks the room holds once every request has written all its tokens (the prompt and ``max_tokens - 1``
    answer tokens: the last one sampled is never fed back): each request's own blocks, less the shared blocks
    that later requests found instead of allocating (a shared block is held once, whoever uses it)."""
    _count(max_tokens, "max_tokens")
    hits = expected_hits(prompt_tokens, shared_tokens, block_size, salts)
    return sum(blocks_for(n + max_tokens - 1, block_size) for n in prompt_tokens) - hits // block_size


class _Watch:
    """Scrape ``/metrics`` in a thread until stopped, keeping the most KV blocks and running requests seen:
    the gauges count only requests running at the moment of the scrape."""

    def __init__(self, client, every: float = 0.01):
        self.client, self.every = client, every
        self.peak_blocks = self.peak_running = 0
        self.samples: list[tuple[float, float, int, int]] = []  # (scrape sent, answered, blocks, requests running)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="llmlab-kv-watch", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            sent = time.time()
            now = counters(self.client)
            blocks = blocks_in_use(now) if now.num_gpu_blocks is not None else 0
            running = int(now.running)
            self.samples.append((sent, time.time(), blocks, running))
            self.peak_blocks, self.peak_running = max(self.peak_blocks, blocks), max(self.peak_running, running)
            self.stop.wait(self.every)

    def __enter__(self) -> _Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


@dataclass(frozen=True)
class Room:
    """A room's run (:func:`run_room`) and the server around it.

    ``hits`` and ``computed``: prompt tokens the room's requests found in the prefix cache and computed; ``reported``:
    whether every request reported its cached tokens; ``peak_blocks`` and ``peak_running``: the most KV blocks held
    and requests running at one scrape; ``others``: a scrape saw more requests running than the room had in flight;
    ``delta``: the server's :class:`~llmlab.serve.metrics.Counters` after the run less before it; ``salts``: each
    learner's ``cache_salt``, as sent.

    Why two sources: ``hits`` and ``computed`` add the requests' own ``usage`` (cached tokens), so they are the
    room's whatever else the server does; the KV gauges and the ``delta`` counters are the server's.  Where
    ``others`` is true, another client ran requests meanwhile and the peak blocks include theirs.  A server started
    without vLLM's ``--enable-prompt-tokens-details`` reports no request's cached tokens (``reported`` is False,
    :data:`llmlab.kvcache.NOT_REPORTED` says how to turn it on): ``hits`` is then the server's hit counter around the
    run, the room's own only where nobody else used the server meanwhile."""

    result: loadtest.LoadResult
    summary: dict
    hits: int
    reported: bool
    computed: int
    peak_blocks: int
    peak_running: int
    others: bool
    delta: Counters
    salts: list[str]


async def _send_room(client, model, prompts, salts, max_tokens, progress, sampling):
    """One :func:`llmlab.loadtest.run_async` per salt, all at once: a salt travels in the request body, and one
    run sends one body for all its prompts."""
    from tqdm.auto import tqdm

    groups: dict[str, list] = {}
    for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True)):
        groups.setdefault(salt, []).append(loadtest.Job(id=i, prompt=prompt))
    bar = tqdm(total=len(prompts), desc=f"{len(prompts)} learners", unit="req", disable=not progress, leave=False)
    try:
        runs = await asyncio.gather(*(
            loadtest.run_async(client, model, jobs, concurrency=len(jobs), max_tokens=max_tokens, progress=False,
                               on_record=lambda _r: bar.update(1), extra_body={"cache_salt": salt}, **sampling)
            for salt, jobs in groups.items()))
    finally:
        bar.close()
    records = sorted((r for run in runs for r in run.records), key=lambda r: r.id)
    for r in records:  # one room, one session: the summary's wall time is the room's, not the sum of its runs'
        r.session = "room"
    return loadtest.LoadResult(records, concurrency=len(prompts))


def run_room(client, model: str, prompts: list[str], salts: list[str], max_tokens: int = 32,
             progress: bool = True, **sampling) -> Room:
    """Send every learner's prompt at once (each with its ``cache_salt``), greedily and ``ignore_eos`` (every
    answer ``max_tokens`` long), and read the server around it (:class:`Room`)."""
    if len(prompts) != len(salts) or not prompts:
        raise ValueError(f"{len(prompts)} prompts and {len(salts)} salts: give one salt per prompt "
                         "(room_salts(len(prompts), shared=...)).")
    _count(max_tokens, "max_tokens")
    sampling = {"temperature": 0, "ignore_eos": True, **sampling}
    before = counters(client)
    with _Watch(client) as watch:
        result = loadtest.in_a_loop(_send_room(client, model, prompts, salts, max_tokens, progress, sampling))
    result.raise_on_failure()
    delta = wait_for_request(client, before, len(prompts), timeout=30) - before
    records = result.records
    reported = all(r.cached_tokens is not None for r in records)
    hits = sum(r.cached_tokens for r in records) if reported else delta.prefix_hits
    return Room(result, result.summary(), hits, reported, sum(r.prompt_tokens for r in records) - hits,
                watch.peak_blocks, watch.peak_running, _others_ran(watch.samples, records), delta, list(salts))


GAUGE_LAG_S = 0.5  # how far behind a scrape the running gauge may be: the engine's last step, under a loaded CPU


def _others_ran(samples: list[tuple[float, float, int, int]], records) -> bool:
    """Whether a scrape saw more requests running than the room had in flight at any moment the gauge may speak
    of -- from :data:`GAUGE_LAG_S` before the scrape was sent to its answer (the gauge is the engine's last step,
    and a scrape on a busy CPU takes a while): then the server's gauges counted someone else's requests too."""
    return any(running > sum(r.start <= answered and r.end >= sent - GAUGE_LAG_S for r in records)
               for sent, answered, _, running in samples)


def room_table(rooms: dict[str, Room]) -> pd.DataFrame:
    """One row per :func:`run_room` result: hit rate, prompt tokens computed, TTFT p50/p99 and peak KV blocks."""
    rows = {}
    for name, room in rooms.items():
        s = room.summary
        rows[name] = {"hit rate": room.hits / (room.hits + room.computed),
                      "prompt tokens computed": room.computed,
                      "TTFT p50 (ms)": s["ttft_p50"] * 1e3, "TTFT p99 (ms)": s["ttft_p99"] * 1e3,
                      "peak KV blocks": room.peak_blocks}
    return pd.DataFrame(rows).T.round({"hit rate": 3, "TTFT p50 (ms)": 0, "TTFT p99 (ms)": 0})


# --- chunked prefill: the running requests' tokens while a long prompt arrives --------------------------------

def _generated(client) -> int:
    return counters(client).generated


class DecodersEnded(RuntimeError):
    """The decoding requests ended before the long prompts were sent: the round measured nothing."""


async def _wait_decoding(client, before: float, tokens: float, running: asyncio.Future, timeout: float = 60.0):
    """Wait until the server has generated ``tokens`` more output tokens than ``before``: the decoders are under
    way.  A counter, not the running-requests gauge: a counter cannot be missed between two scrapes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while await asyncio.to_thread(_generated, client) - before < tokens:
        if running.done():
            raise DecodersEnded("the decoding requests ended before the long prompts were sent: "
                                f"{running.result().summary()['errors']} of them failed; ask for more decode_tokens.")
        if loop.time() > deadline:
            raise TimeoutError(f"the server did not generate {tokens:.0f} tokens within {timeout:.0f} s: is it "
                               "busy with another client's requests?")
        await asyncio.sleep(0.01)


async def _decode_and_arrive(client, model, decoders, decode_tokens, long_prompts, salt):
    short = [loadtest.Job(id=f"decoder-{i}", prompt=f"Learner {i + 1} asks: tell me a story.")
             for i in range(decoders)]
    before = await asyncio.to_thread(_generated, client)
    running = asyncio.ensure_future(loadtest.run_async(
        client, model, short, concurrency=decoders, max_tokens=decode_tokens, progress=False, temperature=0,
        ignore_eos=True))
    await _wait_decoding(client, before, 4 * decoders, running)
    arrivals = await loadtest.run_async(client, model, long_prompts, concurrency=1, max_tokens=1, progress=False,
                                        temperature=0, extra_body={"cache_salt": salt})
    return await running, arrivals


def token_times(record) -> list[float]:
    """Unix times at which a streamed request's tokens arrived: its start, TTFT, then its inter-token gaps."""
    if record.ttft is None:
        return []
    times = [record.start + record.ttft]
    for gap in record.itl:
        times.append(times[-1] + gap)
    return times


def gaps_during(decoders, arrivals) -> tuple[list[float], list[float]]:
    """Split the running requests' inter-token gaps: those that overlap an arriving prompt's prefill (its
    sending to its first token) and all the others."""
    windows = [(a.start, a.start + a.ttft) for a in arrivals.ok]
    during, other = [], []
    for r in decoders.ok:
        times = token_times(r)
        for t0, t1 in itertools.pairwise(times):
            (during if any(t0 < end and t1 > start for start, end in windows) else other).append(t1 - t0)
    return during, other


@dataclass(frozen=True)
class Arrivals:
    """Long prompts arriving while others decode (:func:`itl_while_prompts_arrive`): the ``decoders``' and the
    ``arrivals``' runs, the decoders' gaps between tokens that overlapped a long prompt's prefill (``during``) and
    the ``other`` gaps, in seconds, and how many arrivals were prefilled while the decoders still ran
    (``overlapped``).  ``+`` pools two rounds of one server."""

    decoders: loadtest.LoadResult
    arrivals: loadtest.LoadResult
    during: list[float]
    other: list[float]
    overlapped: int

    def __add__(self, more: Arrivals) -> Arrivals:
        return Arrivals(loadtest.LoadResult(self.decoders.records + more.decoders.records),
                        loadtest.LoadResult(self.arrivals.records + more.arrivals.records),
                        self.during + more.during, self.other + more.other, self.overlapped + more.overlapped)


def itl_while_prompts_arrive(client, model: str, long_prompts: list, decoders: int = 8,
                             decode_tokens: int = 384, tries: int = 3) -> Arrivals:
    """``decoders`` requests decode ``decode_tokens`` tokens each; once they are under way (the server has
    generated 4 tokens per decoder), the ``long_prompts`` arrive one after another (each asking for one token,
    under a fresh salt: no cache hits).

    On a loaded machine a busy server may answer one ``/metrics`` scrape only after the decoders have finished (a
    clean clone's run saw it once, on two cores with another engine starting): such a round measured nothing and
    is run again, up to ``tries`` times in all, before its sentence is raised."""
    _count(decoders, "decoders")
    _count(decode_tokens, "decode_tokens", least=2)
    _count(tries, "tries")
    if not long_prompts:
        raise ValueError("give at least one long prompt to arrive while the others decode.")
    for attempt in range(1, tries + 1):
        try:
            running, arrivals = loadtest.in_a_loop(_decode_and_arrive(client, model, decoders, decode_tokens,
                                                                      long_prompts, secrets.token_urlsafe(32)))
            break
        except DecodersEnded:
            if attempt == tries:
                raise
    running.raise_on_failure()
    arrivals.raise_on_failure()
    last_token = min(token_times(r)[-1] for r in running.ok)
    overlapped = sum(a.start + a.ttft <= last_token for a in arrivals.ok)
    during, other = gaps_during(running, arrivals)
    return Arrivals(running, arrivals, during, other, overlapped)


def compare_itl(servers: dict, long_prompts: list, rounds: int = 2, decoders: int = 8,
                decode_tokens: int = 384) -> dict[str, Arrivals]:
    """:func:`itl_while_prompts_arrive` on every server (``{"name": (client, model)}``), ``rounds`` times,
    alternating the servers so that a busy moment of the machine does not land on one of them only; each
    server's rounds pooled into one result."""
    _count(rounds, "rounds")
    pooled: dict[str, Arrivals] = {}
    for _ in range(rounds):
        for name, (client, model) in servers.items():
            run = itl_while_prompts_arrive(client, model, long_prompts, decoders, decode_tokens)
            pooled[name] = pooled[name] + run if name in pooled else run
    return pooled


def itl_table(runs: dict[str, Arrivals]) -> pd.DataFrame:
    """One row per :func:`itl_while_prompts_arrive` result: the running requests' gaps (ms) while a long prompt
    was prefilled and otherwise, and the long prompts' own TTFT."""
    import numpy as np

    rows = {}
    for name, run in runs.items():
        ttft = [a.ttft for a in run.arrivals.ok]
        rows[name] = {"gap p50, otherwise": np.median(run.other) * 1e3,
                      "gap p50, during a prefill": np.median(run.during) * 1e3 if run.during else np.nan,
                      "gap max": max(run.during + run.other) * 1e3,
                      "gap p99": np.percentile(run.during + run.other, 99) * 1e3,
                      "long prompt TTFT p50": np.median(ttft) * 1e3}
    return pd.DataFrame(rows).T.round(1)


# --- KV offloading: a second tier for the prefix cache (on paper: the CPU build refuses it) --------------------

PAGE_BYTES = 4096  # mmap.PAGESIZE on x86-64 Linux: vLLM rounds each offloaded chunk up to it


def offload_tier(model, offload_gib: float, tp: int = 1, block_size: int = GPU_BLOCK_SIZE) -> dict:
    """What ``vllm serve --kv-offloading-size GiB`` buys a TP=``tp`` server of ``model``: the blocks and tokens
    of host memory vLLM's ``OffloadingConnector`` keeps next to the GPUs' KV pool.

    Why this arithmetic and not the GiB alone: the size is the whole server's, summed over the TP ranks, and vLLM
    cuts it into chunks of one block of every rank (each rank's block rounded to the page size), the way
    ``CPUOffloadingSpec.__init__`` does (``vllm/v1/kv_offload/cpu/spec.py``).  A block of 16 tokens of Llama 3.1
    70B is 16 x 327,680 bytes = 5 MiB over the server, so each GiB holds 204 blocks, 3,264 prefix tokens.

    Returns ``{"bytes_per_block": one chunk (all ranks), "blocks": chunks the tier holds, "tokens": blocks x
    block_size}``.  Only the prompt's blocks go there by default (``offload_prompt_only``), so these are prefix
    tokens, never answers."""
    s = memory.model_spec(model)
    _count(tp, "tp")
    _count(block_size, "block_size")
    if s.is_mla and tp > 1:
        raise ValueError(f"{s.name} caches one latent that every GPU holds whole, and vLLM may keep one copy of it "
                         "for all ranks: give tp=1 for such a model.")
    if isinstance(offload_gib, bool) or not isinstance(offload_gib, int | float) or offload_gib <= 0:
        raise ValueError(f"offload_gib={offload_gib!r}: give the --kv-offloading-size in GiB, a number above 0.")
    per_rank = block_size * memory.kv_bytes_per_token(s, tp=tp)
    chunk = -(-per_rank * tp // PAGE_BYTES) * PAGE_BYTES
    blocks = int(offload_gib * (1 << 30)) // chunk
    return {"bytes_per_block": chunk, "blocks": blocks, "tokens": blocks * block_size}
