"""Lessons 11, 14 and 15 on real GPUs: what the CPU build cannot run, measured with vLLM's CUDA build and dummy
weights.

    python benchmarks/lessons_on_gpu.py quant --out DIR      # lesson 11: bf16, --quantization fp8, and fp8 + an
                                                             #   fp8 KV cache, one GPU each, as many at once as fit
    python benchmarks/lessons_on_gpu.py replicas --out DIR   # lesson 15: two TP=1 replicas behind llmlab's router,
                                                             #   then one TP=2 engine, on the same two GPUs
    python benchmarks/lessons_on_gpu.py tp2 --vllm-args "--api-server-count 2" --out DIR  # TP=2 alone, with flags,
                                                             #   and the CPU of its processes at 256 in flight
    python benchmarks/lessons_on_gpu.py determinism --out DIR  # lesson 14: one GPU, default kernels against
                                                             #   VLLM_BATCH_INVARIANT=1, a request alone and amid 63

On the course's lent machines, which download nothing: ``benchmarks/rehearse_on_device.sh lessons quant ...``.

Every engine is the rehearsal's (``llmlab.ops.rehearsal``): the launcher's ``vllm serve`` line for the
``llama3.1-8b`` job of ``slurm/models.toml`` (full 131,072-token context, ``--gpu-memory-utilization 0.9``) with
``--load-format dummy``, on a private Unix socket behind llmlab's proxy, each on the GPUs ``CUDA_VISIBLE_DEVICES``
gives it; the load is the rehearsal's too (prompts of 64 random token ids, 256 tokens out, greedy, ``ignore_eos``,
streamed through ``llmlab.loadtest``).  Dummy weights answer nonsense, so no output is compared here: speed, memory
and KV tokens only.  Each result is written to ``--out`` as soon as it is measured, so a run cut short keeps what
it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmlab import kvcache, loadtest
from llmlab.connection import connect
from llmlab.ops import rehearsal
from llmlab.rehearse import parse_memory_log
from llmlab.replicas import Router

MODEL = "llama3.1-8b"
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
CONCURRENCY = (1, 8, 64, 128, 256)
QUANT = {"bf16": (), "fp8 weights": ("--quantization", "fp8"),
         "fp8 weights + fp8 KV": ("--quantization", "fp8", "--kv-cache-dtype", "fp8")}


class Engine:
    """One vLLM of the ``llama3.1-8b`` job on ``gpus``, with ``extra`` flags, behind its own proxy (started, not
    waited for: several start side by side)."""

    def __init__(self, name: str, gpus: list[int], out: Path, extra=(), tp: int = 1, env=None, **job):
        self.name, self.gpus, self.dir = name, gpus, out / slug(name)
        job = rehearsal.rehearsal_job(MODEL, tp=tp, **job)
        self.job = dataclasses.replace(job, extra_args=(*job.extra_args, *extra))
        self.tokens = rehearsal.make_dummy_model(MODEL, self.dir / "model")["prompt_ids"]
        self.run_dir = Path(tempfile.mkdtemp(prefix="llmlab-vllm-"))
        argv, serve_env, line = rehearsal.serve_argv(self.job, self.dir / "model", 0, uds=self.socket)
        self.line = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), line])  # the setting's own variables
        env = {**os.environ, **serve_env, **(env or {}), "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
               "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
        self.srv = rehearsal.server(argv, env, self.dir / "server.log", self.run_dir)
        self.t0 = time.monotonic()
        self.srv.start()
        rehearsal.bound_port(self.srv, self.run_dir)

    @property
    def socket(self) -> Path:
        return self.run_dir / "vllm.sock"

    def ready(self, timeout: float) -> float:
        self.srv.wait_ready(timeout, progress=False)
        self.startup_s = time.monotonic() - self.t0
        return self.startup_s

    def memory(self) -> dict:
        mem = parse_memory_log(self.srv.log_path.read_text(errors="replace"))
        return {"weights_gib": mem.weights_gib, "available_kv_gib": mem.available_kv_gib,
                "kv_tokens": mem.kv_tokens, "max_concurrency": mem.max_concurrency,
                "cuda_graph_gib": mem.cuda_graph_gib or mem.graph_gib, "vllm_version": mem.vllm_version}

    def requests_finished(self) -> float:
        return kvcache.counters(self.srv).finished

    def stop(self) -> None:
        self.srv.stop(grace=30)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        excerpt = rehearsal.log_excerpt(self.srv.log_path)
        (self.dir / rehearsal.LOG_EXCERPT).write_text(excerpt)
        shutil.rmtree(self.dir / "model", ignore_errors=True)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def save(out: Path, name: str, result: dict) -> None:
    """Add ``result`` under ``name`` to ``out/<phase>.json`` at once (a cut-short run keeps what it measured)."""
    path = out / f"{out.name}.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = result
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"saved {name} to {path}", flush=True)


def start_all(engines: list[Engine], timeout: float) -> None:
    for e in engines:
        print(f"{e.name}: /health after {e.ready(timeout):.0f} s ({e.line})", flush=True)


def quant(out: Path, gpus: int, timeout: float) -> None:
    """bf16, fp8 weights and fp8 weights + fp8 KV cache: memory lines, batch-1 decode, c=8 and c=64."""
    names = list(QUANT)
    for first in range(0, len(names), gpus):
        wave = []
        try:
            for i, n in enumerate(names[first:first + gpus]):
                wave.append(Engine(n, [i], out, QUANT[n]))
            start_all(wave, timeout)
            for e in wave:
                bench = rehearsal.benchmark(e.srv, e.job.name, e.tokens, concurrency=(8, 64), progress=False)
                save(out, e.name, {"serve_line": e.line, "startup_s": round(e.startup_s, 1), **e.memory(), **bench})
        finally:
            for e in wave:
                e.stop()


def replicas(out: Path, timeout: float, concurrency=CONCURRENCY) -> None:
    """Two TP=1 engines (GPU 0, GPU 1) behind llmlab's router (least-loaded), then one TP=2 engine on both GPUs:
    the same sweep through one proxy hop each; how the router dealt the requests, from each engine's /metrics."""
    pair = []
    try:
        for i in range(2):
            pair.append(Engine(f"replica {i}", [i], out))
        start_all(pair, timeout)
        before = [e.requests_finished() for e in pair]
        with Router([e.socket for e in pair], "least-loaded") as router:
            bench = rehearsal.benchmark(router, pair[0].job.name, pair[0].tokens, concurrency=concurrency,
                                        progress=False)
        dealt = [round(e.requests_finished() - b) for e, b in zip(pair, before, strict=True)]
        save(out, "2 replicas", {"serve_line": pair[0].line, "startup_s": [round(e.startup_s, 1) for e in pair],
                                 "memory": [e.memory() for e in pair], "requests_per_replica": dealt, **bench})
    finally:
        for e in pair:
            e.stop()
    tp2(out, timeout, concurrency)


def tp2(out: Path, timeout: float, concurrency=CONCURRENCY, extra=()) -> None:
    """One TP=2 engine on GPUs 0 and 1 (with ``extra`` flags), the same sweep; then the CPU each of its processes
    used while 256 requests streamed (is the GPU the limit, or a process of the engine?)."""
    name = " ".join(("TP=2", *extra))
    tp = Engine(name, [0, 1], out, extra, tp=2)
    try:
        start_all([tp], timeout)
        bench = rehearsal.benchmark(tp.srv, tp.job.name, tp.tokens, concurrency=concurrency, progress=False)
        save(out, name, {"serve_line": tp.line, "startup_s": round(tp.startup_s, 1), "memory": tp.memory(), **bench})
        jobs = rehearsal.workload(512, tp.tokens, 64, 256, seed=5)
        client = connect(tp.srv.base_url, tp.srv.api_key, quiet=True)[0]
        run = lambda: loadtest.run(client, tp.job.name, jobs, concurrency=256, max_tokens=256,  # noqa: E731
                                   progress=False, temperature=0, ignore_eos=True).summary()
        summary, cpu = busy(tp.srv.pid, run)
        save(out, name + " cpu at c=256", {"output_tokens_per_s": summary["output_tokens_per_s"],
                                           "tpot_p50": summary["tpot_p50"], "cpu_percent": cpu})
    finally:
        tp.stop()


def determinism(out: Path, timeout: float, others: int = 63, rounds: int = 3) -> None:
    """Notebook 14 on a GPU: the ``llama3.1-8b`` job on GPU 0 with vLLM's default kernels, then with
    ``VLLM_BATCH_INVARIANT=1``.  On each, one greedy request (64 prompt tokens, 48 out, with logprobs) alone
    ``rounds`` times, then ``rounds`` times amid ``others`` requests: the same tokens, the same bits?  Then what the
    mode costs: batch 1 and 64 in flight.  An engine that does not start is recorded with its log's errors."""
    from llmlab.quantization import error_lines

    for name, env in {"default kernels": {}, "batch-invariant": {"VLLM_BATCH_INVARIANT": "1"}}.items():
        e = Engine(name, [0], out, env=env)
        try:
            try:
                start_all([e], timeout)
            except Exception as err:  # noqa: BLE001 -- recorded; the other setting still runs
                errors = error_lines(e.srv.log_path.read_text(errors="replace"))[:8]
                save(out, name, {"serve_line": e.line, "failed": str(err)[-1500:], "errors": errors})
                continue
            alone, amid = repeat_request(e, others, rounds)
            bench = rehearsal.benchmark(e.srv, e.job.name, e.tokens, concurrency=(64,), batch1_requests=3,
                                        progress=False)
            save(out, name, {"serve_line": e.line, "startup_s": round(e.startup_s, 1), "alone": alone,
                             "amid_others": amid, "others": others, **bench})
        finally:
            e.stop()


def repeat_request(e: Engine, others: int, rounds: int) -> tuple[list, list]:
    """One greedy request ``rounds`` times alone and ``rounds`` times sent while ``others`` are running, each
    compared with its first answer (:func:`compare`)."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=e.srv.base_url, api_key=e.srv.api_key, max_retries=0, timeout=300)
    jobs = rehearsal.workload(others + 1, e.tokens, 64, 48, seed=3)

    def ask(prompt):
        r = client.completions.create(model=e.job.name, prompt=prompt, max_tokens=48, temperature=0, logprobs=1)
        return r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs

    reference = ask(jobs[0].prompt)
    alone = [compare(reference, ask(jobs[0].prompt)) for _ in range(rounds)]
    amid = []
    with ThreadPoolExecutor(others) as pool:
        for _ in range(rounds):
            crowd = [pool.submit(ask, j.prompt) for j in jobs[1:]]
            time.sleep(0.2)  # the others are running: the request joins their batch
            amid.append(compare(reference, ask(jobs[0].prompt)))
            for f in crowd:
                f.result()
    return alone, amid


def compare(reference: tuple, answer: tuple) -> dict:
    """Two (tokens, logprobs) answers to one greedy request: the same tokens?  Where they part, and the largest
    logprob difference before that (0.0: the same bits)."""
    (t0, l0), (t1, l1) = reference, answer
    parted = next((i for i, (a, b) in enumerate(zip(t0, t1, strict=False)) if a != b), None)
    upto = parted if parted is not None else min(len(l0), len(l1))
    diffs = [abs(a - b) for a, b in zip(l0[:upto], l1[:upto], strict=True) if a is not None and b is not None]
    return {"same_tokens": t0 == t1, "parted_at": parted, "max_logprob_diff": max(diffs, default=0.0)}


def busy(pid: int, fn) -> tuple:
    """Run ``fn()`` while sampling, every 0.5 s, the CPU use of process ``pid`` and all its descendants; returns
    (fn's result, {process title: mean CPU % over the run}) (100 % = one core kept busy)."""
    import psutil

    root = psutil.Process(pid)
    procs = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for p in procs.values():
        p.cpu_percent(None)
    samples: dict[str, list[float]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            for p in procs.values():
                with contextlib.suppress(psutil.Error):
                    title = f"{' '.join(p.cmdline())[:60]} [{p.pid}]"
                    samples.setdefault(title, []).append(p.cpu_percent(None))

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        result = fn()
    finally:
        done.set()
        watcher.join()
    return result, {t: round(statistics.mean(v), 1) for t, v in samples.items() if v and max(v) > 5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["quant", "replicas", "tp2", "determinism"])
    ap.add_argument("--vllm-args", default="", help="tp2: extra vllm serve flags, e.g. '--api-server-count 2'")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=400.0, help="seconds for each engine's /health")
    args = ap.parse_args()
    facts = rehearsal.gpu_facts()
    if facts.get("count", 0) < (1 if args.phase == "determinism" else 2):
        sys.exit(f"{facts.get('count', 0)} GPU(s) here: this phase needs 2 (replicas and TP=2 share them).")
    out = args.out / args.phase
    out.mkdir(parents=True, exist_ok=True)
    save(out, "machine", {"gpu": facts["name"], "gpus": facts["count"], "bandwidth_tb_s": facts["bandwidth_bytes_s"]
                          / 1e12, "torch": facts.get("torch"), "date": time.strftime("%Y-%m-%d")})
    if args.phase == "quant":
        quant(out, facts["count"], args.timeout)
    elif args.phase == "replicas":
        replicas(out, args.timeout)
    elif args.phase == "determinism":
        determinism(out, args.timeout)
    else:
        tp2(out, args.timeout, (64, 128, 256), tuple(args.vllm_args.split()))


if __name__ == "__main__":
    main()
