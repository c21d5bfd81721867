"""Many adapters on one CPU engine: the figures notebook 17 quotes.

Starts two engines of the tiny model serving the shipped adapters (``kjv``, ``rv1909``), one with ``--max-loras 1``
and one with ``--max-loras 2``, and sends each the same three mixes, all requests at once (``llmlab.lora.send_mixed``,
the notebook's own function): 16 requests of the base model, 16 of one adapter, 8 + 8 of two adapters.  For each:
the engine steps (the scheduler's own count: a step with one adapter slot runs one adapter's requests only), wall
time and output tokens/s, the median of ``--rounds``.

    .venv/bin/python benchmarks/lora_mixing.py --rounds 3
"""

import argparse
import statistics

import pandas as pd

from llmlab import batching, connect, lora
from llmlab.serve.embedded import EmbeddedServer

MIXES = {"16 base": {"llmlab-tiny": 16}, "16 kjv": {"kjv": 16}, "8 kjv + 8 rv1909": {"kjv": 8, "rv1909": 8}}


def measure(client, counts: dict, max_tokens: int, rounds: int) -> dict:
    runs = [batching.measure(client, lora.send_mixed, client, counts, max_tokens) for _ in range(rounds)]
    assert all(r.alone for r in runs), "another client used this benchmark's engine"
    return {"engine steps": statistics.median(r.delta.steps for r in runs),
            "wall (s)": round(statistics.median(r.summary["duration_s"] for r in runs), 2),
            "output tok/s": round(statistics.median(r.summary["output_tokens_per_s"] for r in runs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    rows = {}
    for slots in (1, 2):
        with EmbeddedServer(extra_args=lora.serve_args(max_loras=slots)) as srv:
            client, _ = connect(srv.base_url, srv.api_key, quiet=True)
            lora.send_mixed(client, {"kjv": 2, "rv1909": 2}, 8)  # first requests pay one-off costs
            for name, counts in MIXES.items():
                rows[(f"--max-loras {slots}", name)] = measure(client, counts, args.max_tokens, args.rounds)
    table = pd.DataFrame(rows).T
    print(table.to_string())
    steps = table["engine steps"].unstack(0)
    print(f"\nengine steps of the two-adapter mix over one adapter's ({args.max_tokens} tokens each):")
    print((steps.loc["8 kjv + 8 rv1909"] / steps.loc["16 kjv"]).round(2).to_string())


if __name__ == "__main__":
    main()
