"""Two replicas behind llmlab's router against one engine with TP=2, on the embedded engine: notebook 15's figures.

Starts, side by side, one embedded engine of the tiny model (vLLM's own core binding), two replicas of it (a core
each) behind the router (``llmlab.replicas.Replicas``, least-loaded) and one engine with ``--tensor-parallel-size
2`` (a core per rank), then measures each with ``llmlab.replicas.measure`` (the notebook's own function) at each
concurrency, the layouts in a new order every round; prints the median and range over ``--rounds``.

    .venv/bin/python benchmarks/replicas_vs_tp.py --rounds 3
"""

import argparse
import statistics

import pandas as pd

from llmlab import connect, loadtest, replicas
from llmlab.serve.embedded import EmbeddedServer

FIGURES = {"output tok/s": "output_tokens_per_s", "TTFT p50 (ms)": "ttft_p50", "TTFT p99 (ms)": "ttft_p99",
           "TPOT p50 (ms)": "tpot_p50", "latency p50 (ms)": "latency_p50"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--requests", type=int, default=96)
    args = ap.parse_args()
    print(f"cores: {replicas.split_cores(1)[0]}; replicas bound to {replicas.split_cores(2)}, TP=2 ranks to "
          f"{'|'.join(replicas.split_cores(2))}")
    work = loadtest.synthetic_workload(args.requests, input_len=64, output_len=64, seed=1)
    with EmbeddedServer() as one, replicas.Replicas(2) as pool, replicas.tp_engine(2) as tp:
        layouts = {"1 engine": connect(one.base_url, one.api_key, quiet=True), "2 replicas": pool.connect(),
                   "TP=2": connect(tp.base_url, tp.api_key, quiet=True)}
        names, runs = list(layouts), {}
        for r in range(args.rounds):
            for c in args.concurrency:
                for name in names[r % 3:] + names[:r % 3]:
                    runs.setdefault((c, name), []).append(replicas.measure(*layouts[name], work, c))
    rows = {}
    for (c, name), summaries in runs.items():
        row = {}
        for label, key in FIGURES.items():
            scale = 1 if key == "output_tokens_per_s" else 1000
            values = sorted(scale * s[key] for s in summaries)
            digits = 1 if key == "tpot_p50" else 0
            row[label] = f"{statistics.median(values):.{digits}f} [{values[0]:.{digits}f}-{values[-1]:.{digits}f}]"
        rows[(c, name)] = row
    table = pd.DataFrame(rows).T.rename_axis(["in flight", "layout"]).sort_index()
    print(f"median [range] of {args.rounds} rounds, {args.requests} requests of 64 tokens in, 64 out")
    print(table.to_string())


if __name__ == "__main__":
    main()
