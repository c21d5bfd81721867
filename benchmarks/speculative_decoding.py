"""Speculative decoding on the embedded engine: the figures notebook 12 quotes.

Starts three embedded engines of the tiny model, one plain, one with n-gram drafting and one with the shipped draft
model (``llmlab-tiny-draft``, both k=4), and measures each on a repetitive and a varied workload at 1 and 32
requests in flight with ``llmlab.speculative.compare`` (the notebook's own function): latency p50, throughput,
acceptance and tokens per step, the median of ``--rounds``.

    .venv/bin/python benchmarks/speculative_decoding.py --rounds 3
"""

import argparse

from llmlab import connect, speculative
from llmlab.serve.embedded import EmbeddedServer

OPENERS = ["The LORD is my shepherd", "In the beginning", "And the king said unto", "Blessed are the poor",
           "Then Jesus answered and said", "The word of the LORD came", "And Moses went up", "Now there was a man"]
LOOP = "The LORD is my shepherd; I shall not want."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = ap.parse_args()
    with EmbeddedServer() as plain, EmbeddedServer(extra_args=speculative.ngram_args(k=args.k)) as drafting, \
            EmbeddedServer(extra_args=speculative.draft_args(k=args.k)) as drafted:
        servers = {"plain": connect(plain.base_url, plain.api_key, quiet=True),
                   "ngram": connect(drafting.base_url, drafting.api_key, quiet=True),
                   "draft model": connect(drafted.base_url, drafted.api_key, quiet=True)}
        for client, model in servers.values():  # first requests pay one-off costs
            speculative.measure(client, model, OPENERS, concurrency=8, max_tokens=16)
        table = speculative.compare(servers, {"repetitive": [LOOP], "varied": OPENERS},
                                    concurrencies=args.concurrency, rounds=args.rounds)
    print(table.to_string())
    latency = table["latency p50 (ms)"].unstack("server")
    for drafter in ("ngram", "draft model"):
        print(f"\nspeed-up of the median request (plain / {drafter} latency):")
        print((latency["plain"] / latency[drafter]).round(2).to_string())


if __name__ == "__main__":
    main()
