"""llmlab's load generator against ``vllm bench serve`` (and GuideLLM) on a GPU server: paired repeats, intervals.

Why: benchmarks/loadtest_vs_vllm_bench.py showed parity on the 2-core CPU machine except for the TTFT p99, which
two shared cores decide (issue 39).  Here the server is vLLM's CUDA build with a dummy-weight 8B on a lent GPU
machine (16 cores), the setting a learner measures on a cluster.  At each level, ``--repeats`` times in
alternating order, the same prompts go through

- ``llmlab.loadtest.run`` (worker threads) and ``llmlab.loadtest.run_async`` (asyncio),
- ``vllm bench serve`` (in this process: vLLM's own parser and ``main``, as loadtest_vs_vllm_bench.py does),
- with ``--guidellm EXE``, GuideLLM at the ``--guidellm-levels`` concurrencies (its own synthetic prompts of the
  same length),

at fixed concurrencies (``--levels C:N``: C in flight, N requests) and at Poisson request rates (``--rates R:N``).
Before each level, uncounted: min(2C, N) of its requests through ``run`` at C in flight, then one ``vllm bench
serve`` run.  (The committed run of 2026-11-27 warmed up with at most 32 in flight and no vLLM run, and vLLM's tool,
which went first, read its first repeat of each level slower: ``--reanalyse PARITY_JSON --drop-first 1`` prints the
levels again without every tool's first repeat.)
llmlab's driver has no rate mode, so at a rate the llmlab side is llmlab's request timer
(``loadtest._send_async``) sent open-loop on the same arrival process as vLLM's (gamma with burstiness 1, the
gaps rescaled to N/R in all, as ``vllm bench serve`` does; other draws than vLLM's).

Verdict per level, llmlab / vLLM: output throughput and TPOT p50 within 5 %, TTFT p50 within 10 % (medians of
the per-repeat ratios), TTFT p99 within 25 %: the median of the per-repeat ratios with a bootstrap interval over
the repeats, and the p99 of all repeats' requests pooled, each tool's with ``loadtest.bootstrap_interval`` and
the ratio's interval from resampling both.  Each level is written to ``--out`` as soon as it is measured.

The server's view (issue 39: llmlab's TTFT p50 at 8 and 64 in flight was 11-17 % below vLLM's tool's, unexplained):
``/metrics`` is scraped just before and just after each tool's run, so the difference of the two
``vllm:time_to_first_token_seconds`` histograms is the server's TTFT of that run's requests alone -- from the moment
vLLM's front end took the request in (0.26: ``arrival_time`` in its renderer's ``render_cmpl_async``, after the
HTTP request was read and parsed, before the prompt is tokenized) to the one its output loop handled the first token
(``IterationStats.update_from_output``: before that token was detokenized, streamed and read).  The clients' clocks
(``vllm bench serve``'s and llmlab's ``_Timer``) start before ``session.post`` and stop when the first event with
``choices`` has been read and parsed, so a client's TTFT minus the server's is what the client and HTTP add.
Its mean (the difference of ``_sum`` over that of ``_count``) is exact; its p50 is interpolated inside a bucket (vLLM
0.26's edges are 20, 40, 60, 80, 100 and 250 ms around these figures), so it is as coarse as that bucket, which is said
beside it; the shares of requests at or below each edge compare client and server without interpolating.
Each run's requests seen by the server are counted beside those sent (``vllm bench serve`` 0.26 sends no ready-check
request: ``--ready-check-timeout-sec`` is 0 by default).
``parity-server-ttft.json`` and ``.txt`` hold each tool's TTFT beside the server's, level by level.

    python benchmarks/loadtest_parity_on_gpu.py --base-url http://127.0.0.1:8000/v1 --model llama3.1-8b \\
        --tokenizer MODEL_DIR --repeats 8 --out DIR
    # on the lent machines: benchmarks/kv_held_out_on_gpu.py ... --parity "..." starts the server first

Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest_vs_vllm_bench import guidellm_run, llmlab_figures, vllm_bench, vllm_bench_args, vllm_figures

import llmlab
from llmlab import kvcache, loadtest
from llmlab.serve.metrics import Histogram, histogram

VLLM = "vllm bench serve"
GOALS = {"output_tokens_per_s": 0.05, "tpot_p50": 0.05, "ttft_p50": 0.10, "ttft_p99": 0.25}
KEEP = ("requests_per_s", "output_tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50",
        "latency_p50", "errors", "client_cpu_s", "max_concurrency_seen", "ttft_mean")
DRAWS = 2000


def level_list(text: str) -> list[tuple[float, int]]:
    return [(float(a), int(b)) for a, b in (item.split(":") for item in text.split(",") if item)]


def cpu_time() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` requests at ``rate`` per second: exponential gaps, the first at 0,
    rescaled so that the last is at n / rate, as ``vllm bench serve`` (0.26) spaces its requests."""
    import numpy as np

    gaps = np.random.default_rng(seed).gamma(1.0, 1.0 / rate, size=n)
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist() if times[-1] > 0 else times.tolist()


async def open_loop(base_url: str, api_key: str, model: str, jobs, rate: float, seed: int, max_tokens: int):
    """llmlab's request timer (``loadtest._send_async``) sent open-loop at ``rate`` (see :func:`arrivals`)."""
    cfg = loadtest._Settings(model, max_tokens, 120.0, {"ignore_eos": True, "temperature": 0}, "open-loop",
                             len(jobs), base_url)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with await loadtest.driver._open_session(len(jobs), 120.0) as session:
        t0 = time.perf_counter()

        async def send(job, at):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await loadtest._send_async(session, f"{base_url}/completions", headers, job, cfg)

        records = await asyncio.gather(*(send(j, at) for j, at in zip(jobs, arrivals(len(jobs), rate, seed),
                                                                       strict=True)))
    return loadtest.LoadResult(list(records), len(jobs))


def median_ci(values: list[float], seed: int = 0) -> tuple[float, float, float]:
    """The median of ``values`` and its 95 % bootstrap interval (resampling the values: here, the repeats)."""
    import numpy as np

    v = np.asarray(values, dtype=float)
    meds = np.median(np.random.default_rng(seed).choice(v, size=(DRAWS, len(v))), axis=1)
    return float(np.median(v)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def pooled_p99(ttfts: list[float]) -> dict:
    lo, hi = loadtest.bootstrap_interval(ttfts, 99) or (None, None)
    return {"p99": loadtest.percentile(sorted(ttfts), 99), "low": lo, "high": hi, "samples": len(ttfts),
            "tail": loadtest.tail_samples(len(ttfts), 99)}


def pooled_ratio(ours: list[float], theirs: list[float], seed: int = 1) -> tuple[float, float, float]:
    """p99(ours) / p99(theirs) over the pooled requests, with a 95 % interval from resampling each set."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(ours), np.asarray(theirs)
    ra = np.percentile(rng.choice(a, size=(DRAWS, len(a))), 99, axis=1)
    rb = np.percentile(rng.choice(b, size=(DRAWS, len(b))), 99, axis=1)
    ratios = ra / rb
    return (float(np.percentile(a, 99) / np.percentile(b, 99)), float(np.percentile(ratios, 2.5)),
            float(np.percentile(ratios, 97.5)))


def server_ttft(base_url: str, api_key: str) -> Histogram:
    """The server's TTFT histogram now (all engines); scrapes before and after a run give its requests'."""
    return histogram(kvcache.fetch_metrics(base_url, api_key, timeout=30.0), kvcache.TTFT)


def server_view(seen: Histogram) -> dict:
    """One run's requests as the server timed them (``seen``: after - before), in ms: the exact mean, the p50
    interpolated inside its bucket (whose edges go along), and the cumulative count at each finite edge."""
    p50, bucket = seen.quantile(0.5), seen.bucket_of(0.5)
    return {"requests": round(seen.count), "mean": 1000 * seen.mean if seen.count else None,
            "p50": None if p50 is None else 1000 * p50,
            "p50_bucket": None if bucket is None else [round(1000 * bucket[0], 3), round(1000 * bucket[1], 3)],
            "at_or_below": {f"{1000 * le:g}": round(n) for le, n in sorted(seen.buckets.items()) if le != float("inf")}}


def server_summary(runs: dict[str, list[dict]]) -> dict:
    """Each tool's TTFT beside the server's for the same requests, medians over the repeats (ms): p50s (the
    server's interpolated, with the buckets it fell in), means (the server's exact), the per-repeat difference of
    the means (what the client adds to each request on average: set-up, HTTP, tokenizing, streaming, reading),
    the share of requests at or below each bucket edge (pooled; the client's from its own TTFTs, so comparable
    edge by edge without interpolation), and the server's mean against its mean for vllm bench serve's runs
    (paired): whether the server itself saw different TTFTs."""
    out = {}
    for name, rs in runs.items():
        rs = [r for r in rs if r.get("server_ttft", {}).get("requests")]
        if not rs:
            continue
        med = statistics.median
        counts = {}
        for r in rs:
            for edge, n in r["server_ttft"]["at_or_below"].items():
                counts[edge] = counts.get(edge, 0) + n
        served = sum(r["server_ttft"]["requests"] for r in rs)
        mine = [t for r in rs for t in r["ttfts"]]
        shares = {edge: {"server": n / served, "client": sum(t <= float(edge) for t in mine) / len(mine)}
                  for edge, n in counts.items() if 0 < n < served}
        out[name] = {
            "repeats": len(rs), "requests_sent": [len(r["ttfts"]) for r in rs],
            "requests_seen_by_server": [r["server_ttft"]["requests"] for r in rs],
            "client_p50": med(r["ttft_p50"] for r in rs), "server_p50": med(r["server_ttft"]["p50"] for r in rs),
            "server_p50_buckets": sorted({tuple(r["server_ttft"]["p50_bucket"]) for r in rs}),
            "client_mean": med(r["ttft_mean"] for r in rs), "server_mean": med(r["server_ttft"]["mean"] for r in rs),
            "client_minus_server_mean": med(r["ttft_mean"] - r["server_ttft"]["mean"] for r in rs),
            "client_minus_server_mean_runs": [round(r["ttft_mean"] - r["server_ttft"]["mean"], 2) for r in rs],
            "share_at_or_below_ms": shares}
    for name, row in out.items():
        if name != VLLM:  # repeat i with vLLM's repeat i, as compare() pairs them (a failed GuideLLM run ends its list)
            pairs = [(a["server_ttft"]["mean"], b["server_ttft"]["mean"])
                     for a, b in zip(runs[name], runs.get(VLLM, []), strict=False)
                     if a.get("server_ttft", {}).get("requests") and b.get("server_ttft", {}).get("requests")]
            if pairs:
                row["server_mean_vs_vllm_runs"] = statistics.median(a / b for a, b in pairs)
    return out


def describe_server(label: str, summary: dict) -> list[str]:
    lines = [f"--- {label}: TTFT (ms), each tool's against the server's for its own requests (/metrics "
             "before and after each run; server p50 interpolated inside its bucket, server mean exact)",
             f"{'':24}{'client p50':>11}{'server p50':>11}{'  (bucket)':14}{'client mean':>12}{'server mean':>12}"
             f"{'client-server':>14}{'srv mean/vllm':>14}  requests seen/sent"]
    for name, s in summary.items():
        buckets = "(" + ",".join(f"{lo:g}-{hi:g}" for lo, hi in s["server_p50_buckets"]) + ")"
        ratio = s.get("server_mean_vs_vllm_runs")
        lines.append(f"{name:24}{s['client_p50']:11.2f}{s['server_p50']:11.2f}  {buckets:12}{s['client_mean']:12.2f}"
                     f"{s['server_mean']:12.2f}{s['client_minus_server_mean']:14.2f}"
                     f"{'' if ratio is None else f'{ratio:.3f}':>14}  {sum(s['requests_seen_by_server'])}/"
                     f"{sum(s['requests_sent'])}")
    edges = sorted({e for s in summary.values() for e in s["share_at_or_below_ms"]}, key=float)
    if edges:
        lines.append("share of requests at or below each edge, server / client: " + "; ".join(
            f"{e} ms: " + ", ".join(f"{n} {s['share_at_or_below_ms'][e]['server']:.2f}/"
                                    f"{s['share_at_or_below_ms'][e]['client']:.2f}"
                                    for n, s in summary.items() if e in s["share_at_or_below_ms"]) for e in edges))
    return lines


def compare(runs: dict[str, list[dict]]) -> dict:
    """Each tool against vllm bench serve: paired ratios (median, interval over repeats) and the pooled TTFT p99."""
    out = {}
    ref = runs[VLLM]
    for name, rs in runs.items():
        if name == VLLM or not rs:
            continue
        pairs = list(zip(rs, ref[: len(rs)], strict=True))
        row = {}
        for key, within in GOALS.items():
            ratios = [a[key] / b[key] for a, b in pairs if a.get(key) and b.get(key)]
            if len(ratios) < 2:
                continue
            med, lo, hi = median_ci(ratios)
            row[key] = {"median": med, "low": lo, "high": hi, "runs": [round(x, 4) for x in ratios],
                        "goal": within, "met": abs(med - 1) <= within,
                        "interval_within_goal": 1 - within <= lo and hi <= 1 + within}
        mine = [t for r in rs for t in r["ttfts"]]
        theirs = [t for r in ref for t in r["ttfts"]]
        if len(mine) > 1 and len(theirs) > 1:
            med, lo, hi = pooled_ratio(mine, theirs)
            row["ttft_p99_pooled"] = {"ratio": med, "low": lo, "high": hi, "met": abs(med - 1) <= GOALS["ttft_p99"]}
        out[name] = row
    return out


def describe(label: str, level: dict) -> list[str]:
    lines = [f"--- {label}: {level['requests']} requests x {level['repeats']} repeats "
             f"({level['input_len']} tokens in, {level['output_len']} out)"]
    head = f"{'':22}" + "".join(f"{n:>25}" for n in level["median"])
    lines.append(head)
    for key, name in (("output_tokens_per_s", "output tok/s"), ("requests_per_s", "requests/s"),
                      ("ttft_p50", "TTFT p50 (ms)"), ("ttft_p99", "TTFT p99 (ms)"), ("tpot_p50", "TPOT p50 (ms)"),
                      ("itl_p50", "ITL p50 (ms)"), ("latency_p50", "latency p50 (ms)"), ("errors", "failed"),
                      ("client_cpu_s", "client CPU (s)")):
        lines.append(f"{name:22}" + "".join(f"{m.get(key, float('nan')):25.2f}" for m in level["median"].values()))
    lines.append("pooled TTFT p99 (ms) [95 % interval] (samples, beyond p99): " + ", ".join(
        f"{n} {p['p99']:.1f} [{p['low']:.1f}-{p['high']:.1f}] ({p['samples']}, {p['tail']})"
        for n, p in level["pooled_ttft_p99"].items() if p["p99"] is not None))
    for name, row in level["vs_vllm"].items():
        parts = []
        for key, label_ in (("output_tokens_per_s", "throughput"), ("tpot_p50", "TPOT p50"),
                            ("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99")):
            if key in row:
                r = row[key]
                parts.append(f"{label_} {r['median']:.3f} [{r['low']:.3f}-{r['high']:.3f}]"
                             + ("" if r["met"] else " MISSED"))
        if "ttft_p99_pooled" in row:
            r = row["ttft_p99_pooled"]
            parts.append(f"pooled TTFT p99 {r['ratio']:.3f} [{r['low']:.3f}-{r['high']:.3f}]"
                         + ("" if r["met"] else " MISSED"))
        lines.append(f"  {name} / vllm: " + ", ".join(parts))
    return lines


def summarize_level(level: dict, runs: dict[str, list[dict]]) -> dict:
    """A level's medians, pooled TTFT p99s and comparison with vllm bench serve, from its tools' runs."""
    runs = {k: v for k, v in runs.items() if v}
    out = {**level, "median": {name: {k: statistics.median(r[k] for r in rs) for k in KEEP if k in rs[0]}
                               for name, rs in runs.items()},
           "pooled_ttft_p99": {name: pooled_p99([t for r in rs for t in r["ttfts"]]) for name, rs in runs.items()},
           "vs_vllm": compare(runs), "runs": runs}
    server = server_summary(runs)
    if server:
        out["server_ttft"] = server
    return out


def reanalyse(path: Path, drop_first: int) -> list[str]:
    """The committed levels again, leaving out each tool's first ``drop_first`` repeats (a level's first runs pay for
    whatever the warm-up did not reach); repeat i of every tool stays paired with repeat i of vLLM's."""
    doc = json.loads(path.read_text())
    lines = [f"{path}: the first {drop_first} repeat(s) of every tool left out"]
    for label, level in doc["levels"].items():
        if "runs" not in level:
            continue
        runs = {name: rs[drop_first:] for name, rs in level["runs"].items()}
        again = summarize_level({**level, "repeats": level["repeats"] - drop_first}, runs)
        lines += describe(label, again)
        if "server_ttft" in again:
            lines += describe_server(label, again["server_ttft"])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reanalyse", type=Path, metavar="PARITY_JSON",
                    help="no server: print a written parity.json's levels again, without --drop-first repeats")
    ap.add_argument("--drop-first", type=int, default=1)
    if argv is None:
        argv = sys.argv[1:]
    if "--reanalyse" in argv:
        a, _ = ap.parse_known_args(argv)
        print("\n".join(reanalyse(a.reanalyse, a.drop_first)))
        return 0
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default=os.environ.get("LLMLAB_API_KEY", "EMPTY"))
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--tokenizer", required=True, help="the served model's folder (vllm bench's --tokenizer)")
    ap.add_argument("--server", default="", help="what the server is (written into the results)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--levels", default="8:64,64:256,1:12", help="C:N,... concurrency C, N requests")
    ap.add_argument("--rates", default="10:64,40:64", help="R:N,... Poisson rate R per second, N requests")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--guidellm", metavar="EXE", help="the guidellm executable: GuideLLM too, at --guidellm-levels")
    ap.add_argument("--guidellm-levels", default="8,64")
    ap.add_argument("--guidellm-pythonpath", default="", help="put before PYTHONPATH for GuideLLM only")
    ap.add_argument("--guidellm-timeout", type=int, default=150, help="seconds one GuideLLM run may take")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no level after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-server-ttft", action="store_true",
                    help="do not scrape /metrics around each run (the server's TTFT histogram)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    client, model = llmlab.connect(a.base_url, a.api_key)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except FileNotFoundError:
        gpu = "none (no nvidia-smi)"
    doc = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "api_key"},
           "server": a.server, "gpu": gpu, "cpus": os.cpu_count(), "machine": platform.platform(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()), "goals": GOALS, "levels": {}}
    try:
        import vllm

        doc["vllm_version"] = vllm.__version__
    except ImportError:
        pass
    text: list[str] = []
    server_text: list[str] = []
    server_doc = {k: doc[k] for k in ("server", "gpu", "cpus", "date")} | {
        "about": "each tool's TTFT (ms) beside the server's vllm:time_to_first_token_seconds for the same requests: "
                 "the difference of /metrics scrapes just before and after each run; the server's p50 is "
                 "interpolated inside its bucket, its mean (sum / count) is exact", "levels": {}}
    work = Path(tempfile.mkdtemp(prefix="llmlab-parity-"))
    guide_levels = {int(c) for c in a.guidellm_levels.split(",") if c} if a.guidellm else set()
    if a.guidellm:  # its run under `timeout`: a GuideLLM that hangs must not spend the machine's time
        wrapper = work / "guidellm"
        wrapper.write_text(f'#!/bin/sh\nexec timeout {a.guidellm_timeout} {os.path.abspath(a.guidellm)} "$@"\n')
        wrapper.chmod(0o700)
    guide_error = None
    plan = [("concurrency", c, n) for c, n in level_list(a.levels)] + [("rate", r, n) for r, n in level_list(a.rates)]
    common = dict(progress=False, ignore_eos=True, temperature=0, max_tokens=a.output_len, timeout=120.0)
    for kind, value, n in plan:
        label = f"concurrency {int(value)}" if kind == "concurrency" else f"rate {value:g}/s"
        if time.monotonic() - started > a.budget_s:
            doc["levels"][label] = {"skipped": f"the time budget ({a.budget_s:.0f} s) was spent"}
            print(f"{label}: skipped (time budget)", flush=True)
            continue
        jobs = loadtest.synthetic_workload(n, a.input_len, a.output_len, seed=a.seed + int(value))
        dataset = work / f"{kind}-{value:g}.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": j.prompt, "output_tokens": j.max_tokens}) + "\n"
                                   for j in jobs))
        c = int(value) if kind == "concurrency" else n
        loadtest.run(client, model, jobs[: min(2 * c, n)], concurrency=c, **common)  # warm-up at the level's batch

        def bench_args(i: int, kind=kind, value=value, dataset=dataset, c=c, n=n) -> list[str]:
            args = vllm_bench_args(a.base_url, model, dataset, n, c, Path(a.tokenizer), work, f"{kind}-{value:g}-{i}")
            if kind == "rate":
                k = args.index("--max-concurrency")
                args[k:k + 2] = ["--request-rate", str(value), "--burstiness", "1.0", "--seed", str(a.seed + i)]
            return args

        tools = {VLLM: lambda i, bench_args=bench_args: vllm_figures(vllm_bench(bench_args(i), a.api_key, False))}
        if kind == "concurrency":
            tools["llmlab threads"] = lambda i, jobs=jobs, c=c: llmlab_figures(
                loadtest.run(client, model, jobs, concurrency=c, **common))
            tools["llmlab asyncio"] = lambda i, jobs=jobs, c=c: llmlab_figures(
                asyncio.run(loadtest.run_async(client, model, jobs, concurrency=c, **common)))
            if c in guide_levels:
                def guide(i, c=c, n=n):
                    old = os.environ.get("PYTHONPATH", "")
                    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (a.guidellm_pythonpath, old) if p)
                    try:
                        figures = guidellm_run(str(wrapper), a.base_url, a.api_key, model, Path(a.tokenizer), n, c,
                                               a.input_len, a.output_len, work, f"c{c}-{i}")
                        figures.pop("itl_p50", None)  # NaN: no per-gap distribution in its summary
                        return figures
                    finally:
                        os.environ["PYTHONPATH"] = old
                tools["guidellm"] = guide
        else:
            tools["llmlab timer, open loop"] = lambda i, jobs=jobs, value=value: llmlab_figures(asyncio.run(
                open_loop(a.base_url, a.api_key, model, jobs, value, a.seed + i, a.output_len)))
        vllm_bench(bench_args(a.repeats), a.api_key, False)  # vLLM's tool once, uncounted: its first run read slower
        runs: dict[str, list[dict]] = {name: [] for name in tools}
        order = list(tools)
        t_level = time.monotonic()
        for i in range(a.repeats):
            for name in order if i % 2 == 0 else order[::-1]:
                if name == "guidellm" and guide_error:
                    continue
                before = None if a.no_server_ttft else server_ttft(a.base_url, a.api_key)
                t0, cpu0 = time.perf_counter(), cpu_time()
                try:
                    figures = tools[name](i)
                except Exception as e:  # noqa: BLE001 -- GuideLLM travels apart; its failure ends only its part
                    if name != "guidellm":
                        raise
                    guide_error = f"{type(e).__name__}: {str(e)[-1500:]}"
                    print(f"guidellm failed, left out from here on: {guide_error}", flush=True)
                    continue
                figures["client_cpu_s"] = cpu_time() - cpu0
                if before is not None:  # every first token of the run was counted long before its last token
                    figures["server_ttft"] = server_view(server_ttft(a.base_url, a.api_key) - before)
                figures["ttft_mean"] = statistics.fmean(figures["ttfts"]) if figures["ttfts"] else float("nan")
                figures["ttfts"] = [round(t, 2) for t in figures["ttfts"]]
                runs[name].append({k: figures[k] for k in (*KEEP, "ttfts", "server_ttft") if k in figures})
                seen = figures.get("server_ttft")
                print(f"  {label} repeat {i + 1}/{a.repeats}: {name:24} {figures['output_tokens_per_s']:8.0f} tok/s "
                      f"TTFT p50 {figures['ttft_p50']:7.1f} p99 {figures['ttft_p99']:7.1f} ms, TPOT p50 "
                      f"{figures['tpot_p50']:6.2f} ms ({time.perf_counter() - t0:.1f} s)"
                      + (f"; server: TTFT mean {seen['mean']:.1f} (client {figures['ttft_mean']:.1f}), p50 "
                         f"{seen['p50']:.1f} ms in {seen['p50_bucket']}, {seen['requests']} requests"
                         if seen and seen["requests"] else ""), flush=True)
        level = summarize_level({"kind": kind, "value": value, "requests": n, "repeats": a.repeats,
                                 "input_len": a.input_len, "output_len": a.output_len,
                                 "seconds": round(time.monotonic() - t_level, 1)}, runs)
        if guide_error and "guidellm" in tools:
            level["guidellm_error"] = guide_error
        doc["levels"][label] = level
        text += describe(label, level)
        print("\n".join(describe(label, level)), flush=True)
        (a.out / "parity.json").write_text(json.dumps(doc, indent=1) + "\n")
        (a.out / "parity.txt").write_text("\n".join(text) + "\n")
        if "server_ttft" in level:
            server_doc["levels"][label] = level["server_ttft"]
            server_text += describe_server(label, level["server_ttft"])
            print("\n".join(describe_server(label, level["server_ttft"])), flush=True)
            (a.out / "parity-server-ttft.json").write_text(json.dumps(server_doc, indent=1) + "\n")
            (a.out / "parity-server-ttft.txt").write_text("\n".join(server_text) + "\n")
    if guide_error:
        doc["guidellm_error"] = guide_error
    (a.out / "parity.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
