"""Continuous batching on the embedded engine: the figures notebook 16 quotes.

Runs lesson 16's experiments again, with its own workloads and functions (``llmlab.batching``), on two engines of
the tiny model that it starts itself, as the lesson has them: one with the default flags (the server
``connect()`` finds) and the lesson's small engine, ``--max-num-seqs 8 --max-num-batched-tokens 256
--num-gpu-blocks-override 12``.  One round sends, in the lesson's order and each measured with
``batching.measure``:

1. the 16 requests arriving over time (``batching.arriving_requests``, ``send_over_time``), default engine;
2. the 24 short and long requests (``batching.short_and_long_requests``), static 6 at a time, then continuous
   with 6 in flight, default engine; the fewest steps each way can take are ``static_steps``/``continuous_steps``;
   measured with ``every=None`` (no scrapes during the run: scraped every 0.1 s, the continuous run took 530 steps
   instead of 324);
3. the burst of 24 (``batching.burst_requests``), all sent at once, to the default engine, then the small one;
4. the six long requests (``batching.long_requests``) on the small engine's pool of 12 blocks: 3 in flight
   (what fits, ``fit_without_preemption``), then 6.

Each engine first answers a few requests that are not measured (one-off costs).  No prompt fills one of the CPU
build's 128-token KV blocks, so a later round finds none of its prompts in the prefix cache.  Prints each round's
``batching.compare_table``, then each figure's median over ``--rounds`` and its range.

    .venv/bin/python benchmarks/continuous_batching.py --rounds 3
"""

import argparse
import time

import pandas as pd

from llmlab import batching, connect, engines, loadtest
from llmlab.serve.embedded import EmbeddedServer

RUNS = ["1. 16 arriving over time", "2. static, 6 at a time", "2. continuous, 6 in flight",
        "3. burst of 24, default engine", "3. burst of 24, at most 8, 256 tokens a step",
        "4. 3 in flight (they fit)", "4. 6 in flight"]


def one_round(default, small, fit: int) -> dict[str, dict]:
    """The lesson's runs, once each, in its order: ``{run name: batching.measure's result}``."""
    (client, model), (small_client, small_model) = default, small
    jobs, arrivals = batching.arriving_requests()
    mixed = batching.short_and_long_requests()
    burst, long_jobs = batching.burst_requests(), batching.long_requests()
    sends = [(client, batching.send_over_time, (client, model, jobs, arrivals)),
             (client, batching.static, (client, model, mixed, 6)),
             (client, batching.continuous, (client, model, mixed, 6)),
             (client, batching.continuous, (client, model, burst, 24)),
             (small_client, batching.continuous, (small_client, small_model, burst, 24)),
             (small_client, batching.continuous, (small_client, small_model, long_jobs, fit)),
             (small_client, batching.continuous, (small_client, small_model, long_jobs, 6))]
    runs = {}
    for name, (c, send, args) in zip(RUNS, sends, strict=True):
        every = None if name.startswith("2.") else 0.1  # section 2 counts steps: unwatched, as the lesson runs it
        runs[name] = batching.measure(c, send, *args, every=every)
        if not runs[name].alone:
            print(f"note: {name}: the engine generated other tokens meanwhile; its counters include them")
    return runs


def spread(values: pd.Series) -> str:
    lo, hi = values.min(), values.max()
    return "" if pd.isna(lo) else f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def report(tables: list[pd.DataFrame]) -> None:
    """Each figure's median over the rounds and its range, then the lesson's arithmetic and the two ratios it quotes."""
    n = len(tables)
    rounds = pd.concat(tables).rename_axis("run").reset_index()
    figures = [c for c in rounds.columns if c not in ("run", "round")]
    by_run = rounds.groupby("run", sort=False)[figures]
    print(f"\nthe median of {n} rounds:\n{by_run.median().reindex(RUNS).to_string()}")
    print(f"\nthe range (lowest-highest) of {n} rounds:\n"
          f"{by_run.agg(spread).reindex(RUNS).to_string()}")

    lengths = [j.max_tokens for j in batching.short_and_long_requests()]
    wall = rounds.pivot(index="round", columns="run", values="wall (s)")
    gain = wall[RUNS[1]] / wall[RUNS[2]]
    cost = wall[RUNS[6]] / wall[RUNS[5]]
    arriving = [j.max_tokens for j in batching.arriving_requests()[0]]
    print(f"\n1. {len(arriving)} requests, {sum(arriving):,} answer tokens, the longest {max(arriving)}")
    print(f"2. {sum(lengths):,} answer tokens; the fewest steps: {batching.static_steps(lengths, 6)} static, "
          f"{batching.continuous_steps(lengths, 6)} continuous")
    print(f"2. static wall / continuous wall: median {gain.median():.2f} [{gain.min():.2f}-{gain.max():.2f}], "
          f"rounds {', '.join(f'{g:.2f}' for g in gain)}")
    prompts = sum(j.input_len + 1 for j in batching.burst_requests())  # the start token is added to each
    print(f"3. the burst's prompts: {prompts:,} tokens, at least {-(-prompts // 256)} steps of a 256-token budget")
    print(f"4. 6 in flight wall / 3 in flight wall: median {cost.median():.2f} [{cost.min():.2f}-{cost.max():.2f}], "
          f"rounds {', '.join(f'{c:.2f}' for c in cost)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", None)
    began = time.monotonic()
    with EmbeddedServer() as plain, engines.start(batching.SMALL_ENGINE, progress=False) as tight:
        default = connect(plain.base_url, plain.api_key, quiet=True)
        small = connect(tight.base_url, tight.api_key, quiet=True)
        pool = batching.counters(small[0])
        fit = batching.fit_without_preemption(pool.num_gpu_blocks, pool.block_size, 61, 300)
        print(f"engines ready after {time.monotonic() - began:.0f} s; the small engine's pool: "
              f"{pool.num_gpu_blocks} blocks of {pool.block_size} tokens, {fit} long requests fit")
        for client, model in (default, small):  # first requests pay one-off costs
            batching.continuous(client, model, loadtest.synthetic_workload(8, input_len=16, output_len=16), 8)
        tables = []
        for r in range(args.rounds):
            table = batching.compare_table(one_round(default, small, fit))
            print(f"\nround {r + 1} of {args.rounds}:\n{table.to_string()}", flush=True)
            tables.append(table.assign(round=r + 1))
    report(tables)
    print(f"\n{args.rounds} rounds in {time.monotonic() - began:.0f} s, the engines' start included")


if __name__ == "__main__":
    main()
