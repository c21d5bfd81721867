"""Several launcher runs in a row on one lent GPU machine, each a job of its own (``benchmarks/launcher_on_gpu.py``).

Why: a lent machine comes for 30 minutes at a time and a large model's start is the longest part of a run, so one
detached command goes through the layouts in the order they matter and keeps each one's results as soon as it
ends; a lease that runs out keeps every layout that finished and the partial ``launch.json`` of the one running.

    python benchmarks/launches_on_gpu.py --out DIR \\
        "70b-tp4 llama3.1-70b --gpu-type H200-141 --concurrency 1 8 64 256 --repeats 2" \\
        "405b-fp8-tp4 llama3.1-405b-fp8 --gpus-per-node 4 --tp 4 --max-model-len 32768 --gpu-type H200-141"

Each argument is ``TAG`` then the launcher's arguments; its results go to ``DIR/TAG/``, its output to
``DIR/TAG.log``.  Between two runs the GPUs are listed (``nvidia-smi``): a run that left memory behind shows.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("runs", nargs="+", metavar="'TAG ARGS...'")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for spec in a.runs:
        tag, *args = shlex.split(spec)
        print(f"=== {tag} ({time.strftime('%H:%M:%S', time.gmtime())} UTC): {' '.join(args)}", flush=True)
        t0 = time.monotonic()
        with open(a.out / f"{tag}.log", "w") as log:
            rc = subprocess.call([sys.executable, str(HERE / "launcher_on_gpu.py"), *args, "--out", str(a.out / tag)],
                                 stdout=log, stderr=subprocess.STDOUT)
        failed += rc != 0
        print(f"=== {tag}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
        print((a.out / f"{tag}.log").read_text()[-3000:], flush=True)
        subprocess.call(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
