"""Why ``find_max_rate``'s TTFT p99 stayed low at 64 requests/s with reused prompts (issue 50).

The level as ``find_max_rate`` sends it (200 prompts of 32 tokens taken in turn for 5 s), the same with distinct
prompts, 96/s both ways, and lesson 06's first open-loop cell (24 prompts at 64/s, one burst).  Prints one JSON line
per run and writes every request (ttft, send time, ``late``, ``cached_tokens``) to the file named on the command line:

    flock /tmp/llmlab-cpu.lock .venv/bin/python benchmarks/openloop_reused_prompts.py OUT.json
"""
import json
import sys
from dataclasses import asdict, replace

import llmlab
from llmlab import loadtest as lt

client, model = llmlab.connect(quiet=True)
out = {"server": str(client.base_url), "model": model, "runs": []}
reused = lt.synthetic_workload(200, input_len=32, output_len=32, seed=1)


def level(name, jobs, rate):
    res = lt.run_rate(client, model, jobs, rate, seed=0, progress=False, ignore_eos=True, temperature=0,
                      max_tokens=32)
    s = res.summary()
    recs = res.records
    starts = sorted(r.start for r in recs)
    cached = [r.cached_tokens for r in recs]
    row = {"name": name, "rate": rate, "requests": len(recs), "distinct_prompts": len({j.prompt for j in jobs}),
           "send_span_s": starts[-1] - starts[0], "served_per_s": s["requests_per_s"], "duration_s": s["duration_s"],
           "ttft_p50_ms": s["ttft_p50"] * 1e3, "ttft_p99_ms": s["ttft_p99"] * 1e3, "tpot_p50_ms": s["tpot_p50"] * 1e3,
           "latency_p50_ms": s["latency_p50"] * 1e3, "sent_late_p99_ms": s["sent_late_p99_s"] * 1e3,
           "max_in_flight": s["max_concurrency_seen"],
           "prompt_tokens_p50": sorted(r.prompt_tokens for r in recs)[len(recs) // 2],
           "cached_tokens_sum": sum(c or 0 for c in cached), "cached_reported": sum(c is not None for c in cached),
           "errors": s["errors"]}
    print(json.dumps(row), flush=True)
    out["runs"].append({**row, "records": [{k: v for k, v in asdict(r).items() if k not in ("text", "itl")}
                                           for r in recs]})


level("warm-up", reused[:16], 8)
level("helper-11's first cell: 24 prompts at 64/s", reused[:24], 64)
level("find_max_rate's 64/s level: 320 requests, 200 prompts cycled",
      [replace(reused[i % 200], id=i) for i in range(320)], 64)
level("64/s, 320 distinct prompts", lt.synthetic_workload(320, input_len=32, output_len=32, seed=2), 64)
level("find_max_rate's 96/s level: 480 requests, 200 prompts cycled",
      [replace(reused[i % 200], id=i) for i in range(480)], 96)
level("96/s, 480 distinct prompts", lt.synthetic_workload(480, input_len=32, output_len=32, seed=3), 96)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
