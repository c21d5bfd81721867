"""Replicas of one model behind a router (notebook 15): data parallelism, against one engine with TP=2.

Why: a model that fits one GPU can take two GPUs in two ways.  One engine with tensor parallelism (TP=2) splits
every layer across both and joins the halves with an all-reduce per layer per step: one batch, each token a
little sooner, twice the KV room.  Two engines of one GPU each (*replicas*, data parallelism) share nothing: a
router hands each request to one of them.  Which serves a room better is measured here, with the same
``llmlab.loadtest`` on both.

The router is llmlab's own key-checking proxy given several upstreams (:mod:`llmlab.serve.proxy`, ``--route``):
``least-loaded`` sends a request to the replica with the fewest in flight; ``prefix`` sends the same prompt
beginning to the same replica, so that a system prompt's cached blocks are found where they were computed
(notebook 13) instead of once per replica.  On the embedded engine a "GPU" is a CPU core:
``VLLM_CPU_OMP_THREADS_BIND`` gives each replica its own core, and each rank of the TP=2 engine one core.  What
two GPUs do is read from the committed runs on two H200s (:func:`gpu_runs`, :func:`gpu_table`, :func:`gpu_memory`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from llmlab import loadtest, prefixcache
from llmlab.connection import connect
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.info import ServerError, llmlab_home, new_key_file, read_key
from llmlab.serve.metrics import Counters, counters
from llmlab.serve.paths import RESULTS_DIR
from llmlab.serve.proxy.command import proxy_command, wait_bound
from llmlab.serve.proxy.router import BALANCE, PREFIX_CHARS, ROUTES, home_replica, prefix_key
from llmlab.serve.vllm import BIND, VLLMProcess

# benchmarks/lessons_on_gpu.py replicas, twice, on one host with 2 x H200 (2026-11-26): run1.json, run2.json.
GPU_RESULTS = RESULTS_DIR / "h200x2-llama3.1-8b-replicas-vs-tp2"
__all__ = ["BIND", "ROUTES", "Router", "Replicas", "split_cores", "tp_engine", "measure", "layout_table", "homes",
           "counted", "course_prompts", "run_room", "room_table", "gpu_runs", "gpu_table", "gpu_memory"]


def split_cores(parts: int, cores: list[int] | None = None) -> list[str]:
    """Give ``parts`` engines (or ranks) equal shares of ``cores`` (default: those this process may use), in
    ``VLLM_CPU_OMP_THREADS_BIND``'s spelling: 2 parts of cores 0-3 are ``["0-1", "2-3"]``."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= len(cores):
        raise ValueError(f"parts={parts!r}: this machine lets us use {len(cores)} core(s), so give 1 to "
                         f"{len(cores)} (each engine or rank needs a core of its own).")
    share = len(cores) // parts
    chunks = [cores[i * share:(i + 1) * share] for i in range(parts)]
    return [str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" for c in chunks]


def tp_engine(tp: int = 2, extra_args: list[str] = ()) -> EmbeddedServer:
    """An embedded engine of the tiny model with ``--tensor-parallel-size tp``, each rank bound to its own share
    of the cores (not started: use it as a context manager, or ``.start().wait_ready()``)."""
    # mp: a worker process per rank, each pinned to its cores (the embedded server's own "uni" keeps its one
    # worker in the engine process, unpinned: serve.vllm.engine_env)
    return EmbeddedServer(extra_args=["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp",
                                      *extra_args],
                          env={BIND: "|".join(split_cores(tp))})


class Router:
    """llmlab's proxy in front of several vLLM sockets, with a key of its own: what a learner connects to.

    ``sockets`` as a list: replicas of one model.  As a dict, ``{model: [socket or "http://host:port", ...]}``:
    several models behind one endpoint (issue 41), each request sent to the model its ``"model"`` names, each
    ``http://`` upstream with its own key file from ``upstream_key_files`` (by model), e.g. another server's proxy.

    Started as a :class:`~llmlab.serve.vllm.VLLMProcess` (the one way llmlab starts, waits for and stops a server's
    processes: its own process group, its log), bound before its port is used (``wait_bound``), stopped with its
    group.  Secrets only in 0600 files, as for every llmlab server."""

    def __init__(self, sockets: list[Path] | dict[str, list[Path | str]], route: str = "least-loaded", *,
                 balance: int = BALANCE, prefix_chars: int = PREFIX_CHARS,
                 upstream_key_files: dict[str, Path] | None = None):
        if route not in ROUTES:
            raise ValueError(f"route={route!r}: give one of {', '.join(ROUTES)}.")
        self.sockets = {m: list(p) for m, p in sockets.items()} if isinstance(sockets, dict) else list(sockets)
        self.route, self.balance, self.prefix_chars = route, balance, prefix_chars
        self.upstream_key_files = dict(upstream_key_files or {})
        self.process: VLLMProcess | None = None
        self.port: int | None = None
        self.run_dir: Path | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    def start(self) -> Router:
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmlab-router-"))  # 0700: the ready file and the key
        self.key_file = self.run_dir / "router.key"
        new_key_file(self.key_file)
        self.log_path = llmlab_home() / "logs" / f"router-{self.run_dir.name}.log"
        ready = self.run_dir / "ready"
        cmd = proxy_command("127.0.0.1:0", self.sockets, self.key_file, ready_file=ready, route=self.route,
                            balance=self.balance, prefix_chars=self.prefix_chars,
                            upstream_key_files=self.upstream_key_files,
                            watch_pid=os.getpid())  # no router left behind when the kernel that started it ends
        self.process = VLLMProcess(cmd, dict(os.environ), self.log_path, header="").start()
        try:
            self.port = wait_bound(ready, lambda: self.process.alive, self.log_path)["port"]
        except ServerError:
            self.stop()
            raise
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def api_key(self) -> str:
        return read_key(self.key_file)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(grace=5)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> Router:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Replicas:
    """``n`` embedded engines of the tiny model, each bound to its own cores, and a :class:`Router` in front::

        with Replicas(2, route="least-loaded") as pool:
            client, model = pool.connect()          # the router: one URL, one key, for every replica
            pool.use("prefix")                      # the same engines, another router

    ``metrics()`` reads each replica's own ``/metrics`` (the router forwards none: each engine counts its own)."""

    def __init__(self, n: int = 2, route: str = "least-loaded", *, extra_args: list[str] = (), **router_options):
        self.servers = [EmbeddedServer(extra_args=list(extra_args), env={BIND: cores})
                        for cores in split_cores(n)]
        self.route, self.router_options = route, router_options
        self.router: Router | None = None

    def start(self) -> Replicas:
        """Start every engine at once (they load side by side), wait for each, then the router."""
        try:
            for server in self.servers:
                server.start()
            for i, server in enumerate(self.servers):
                print(f"replica {i} (cores {server.env[BIND]}):", end=" ")
                server.wait_ready()
            self.use(self.route)
        except BaseException:
            self.stop()
            raise
        return self

    def use(self, route: str, **router_options) -> tuple:
        """Put a fresh router with ``route`` in front of the same engines; returns ``llmlab.connect()``'s
        ``(client, model)`` for it.  The engines (and their caches) stay as they are."""
        if self.router is not None:
            self.router.stop()
        self.route, self.router = route, None
        self.router = Router([s.uds for s in self.servers], route,
                             **{**self.router_options, **router_options}).start()
        return self.connect()

    def connect(self) -> tuple:
        """``llmlab.connect()`` to the router: ``(client, model)``."""
        return connect(self.router.base_url, self.router.api_key, quiet=True)

    def metrics(self) -> list[Counters]:
        """Each replica's :class:`~llmlab.serve.metrics.Counters`, read from the replica itself."""
        return [counters(s) for s in self.servers]

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for server in self.servers:
            server.stop()

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def measure(client, model: str, prompts, concurrency: int, max_tokens: int = 64, warmup: int = 4) -> dict:
    """One load run (``llmlab.loadtest.run``, greedy, every answer ``max_tokens`` long) after ``warmup``
    requests that are not counted; returns its summary.  Raises if any request failed: a rate over failures
    would flatter the layout that failed."""
    prompts = list(prompts)
    sampling = {"temperature": 0, "ignore_eos": True}
    if warmup:
        loadtest.run(client, model, prompts[:warmup], concurrency=warmup, max_tokens=8, progress=False, **sampling)
    result = loadtest.run(client, model, prompts, concurrency=concurrency, max_tokens=max_tokens, **sampling)
    return result.raise_on_failure().summary()


def layout_table(runs: dict[str, dict]) -> pd.DataFrame:
    """One row per layout (a :func:`measure` summary each): output tokens/s, requests/s, TTFT p50/p99, TPOT p50."""
    ms = lambda s: None if s is None else round(1000 * s, 1)  # noqa: E731
    return pd.DataFrame({name: {"output tok/s": round(s["output_tokens_per_s"]), "requests/s":
                                round(s["requests_per_s"], 2), "TTFT p50 (ms)": ms(s["ttft_p50"]),
                                "TTFT p99 (ms)": ms(s["ttft_p99"]), "TPOT p50 (ms)": ms(s["tpot_p50"])}
                         for name, s in runs.items()}).T.rename_axis("layout")


def homes(prompts: list[str], salts: list[str], replicas: int, prefix_chars: int = PREFIX_CHARS) -> list[int]:
    """The replica prefix routing sends each prompt to, as the router computes it (before its balance check)."""
    return [home_replica(prefix_key(json.dumps({"prompt": p, "cache_salt": s}).encode(), prefix_chars), replicas)
            for p, s in zip(prompts, salts, strict=True)]


def course_prompts(courses: list[str], learners: int) -> list[str]:
    """``learners`` prompts per course, in the order a room sends them (the courses interleaved): each course's
    own first line, then notebook 13's workshop system prompt and the learner's question."""
    per_course = {c: prefixcache.room_prompts(f"Course: {c}.\n{prefixcache.SYSTEM}", learners) for c in courses}
    return [per_course[c][i] for i in range(learners) for c in courses]


def counted(pool: Replicas, before: list[Counters], requests: int, timeout: float = 30.0) -> list[Counters]:
    """Each replica's counters since ``before`` (a :meth:`Replicas.metrics`: after less before), once together
    they have counted ``requests`` more finished requests: vLLM counts a request just after it answered
    (:func:`llmlab.serve.metrics.wait_for_request`)."""
    deadline = time.monotonic() + timeout
    while True:
        per = [after - b for b, after in zip(before, pool.metrics(), strict=True)]
        done = sum(d.finished for d in per)
        if done >= requests:
            return per
        if time.monotonic() > deadline:
            raise TimeoutError(f"the replicas counted {done:.0f} of {requests} requests within {timeout:.0f} s: "
                               "is another client using them?")
        time.sleep(0.05)


@dataclass(frozen=True)
class Room:
    """A room sent through the router (:func:`run_room`): its ``route``, the client's ``summary`` and each replica's
    counters around it (``per``, after less before), read as requests, prefix-cache hits and look-ups per replica."""

    route: str
    summary: dict
    per: list[Counters]

    @property
    def requests(self) -> list[int]:
        return [d.finished for d in self.per]

    @property
    def hits(self) -> list[int]:
        return [d.prefix_hits for d in self.per]

    @property
    def queries(self) -> list[int]:
        return [d.prefix_queries for d in self.per]


def run_room(pool: Replicas, prompts: list[str], salt: str, max_tokens: int = 32) -> Room:
    """Send ``prompts`` all at once through ``pool``'s router (greedy, one ``cache_salt`` for the room) and read
    every replica's counters around it: requests and prefix-cache hits per replica, and the client's summary."""
    client, model = pool.connect()
    before = pool.metrics()
    result = loadtest.run(client, model, prompts, concurrency=len(prompts), max_tokens=max_tokens, progress=False,
                          temperature=0, ignore_eos=True, extra_body={"cache_salt": salt}).raise_on_failure()
    return Room(pool.route, result.summary(), counted(pool, before, len(prompts)))


def room_table(rooms: list[Room]) -> pd.DataFrame:
    """One row per :func:`run_room`: requests per replica, prefix-cache hit rate, TTFT p50/p99."""
    rows = {}
    for room in rooms:
        s = room.summary
        rows[room.route] = {"requests per replica": " / ".join(map(str, room.requests)),
                            "hit rate": round(sum(room.hits) / max(1, sum(room.queries)), 3),
                            "TTFT p50 (ms)": round(1000 * s["ttft_p50"]), "TTFT p99 (ms)": round(1000 * s["ttft_p99"])}
    return pd.DataFrame(rows).T.rename_axis("route")


def gpu_runs(folder: Path | str = GPU_RESULTS) -> dict[str, dict]:
    """The committed GPU runs of ``benchmarks/lessons_on_gpu.py replicas``: ``{"run1": {"2 replicas": ...,
    "TP=2": ...}, ...}``, each layout's rehearsal sweep (``llmlab.ops.rehearsal.benchmark``) and memory lines."""
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(folder).glob("run*.json"))}
    if not runs:
        raise FileNotFoundError(f"no run*.json in {folder}: run benchmarks/lessons_on_gpu.py replicas there.")
    return runs


def gpu_table(runs: dict[str, dict] | None = None) -> pd.DataFrame:
    """Per total requests in flight: output tok/s, TPOT p50 and TTFT p50 of two TP=1 replicas behind the router
    and of one TP=2 engine, one column per run (the same load for both: 2c requests at c in flight)."""
    runs = runs if runs is not None else gpu_runs()
    figures = {"output tok/s": ("output_tokens_per_s", 1, 0), "TPOT p50 ms": ("tpot_p50", 1000, 2),
               "TTFT p50 ms": ("ttft_p50", 1000, 0)}
    cols = {}
    for label, (key, scale, digits) in figures.items():
        for layout in ("2 replicas", "TP=2"):
            for run, layouts in runs.items():
                cols[(label, layout, run)] = {s["concurrency"]: round(scale * s[key], digits)
                                              for s in layouts[layout]["sweep"]}
    table = pd.DataFrame(cols).rename_axis("in flight")
    return table.astype({c: int for c in table.columns if figures[c[0]][2] == 0})


def gpu_memory(runs: dict[str, dict] | None = None) -> pd.DataFrame:
    """Per layout (the first run): weights per GPU and KV tokens per engine as vLLM logged them, the KV tokens in
    all, and the most one request could use (one engine's pool)."""
    first = next(iter((runs if runs is not None else gpu_runs()).values()))
    rows = {}
    for layout in ("2 replicas", "TP=2"):
        mem = first[layout]["memory"]
        mem = mem if isinstance(mem, list) else [mem]
        tokens = [m["kv_tokens"] for m in mem]
        rows[layout] = {"engines": len(mem), "weights GiB per GPU": mem[0]["weights_gib"],
                        "KV tokens per engine": tokens[0], "KV tokens in all": sum(tokens),
                        "one request's pool": max(tokens)}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("on 2 x H200")

