#!/usr/bin/env bash
# The four-H200 runs of issues 52 and 54 (2026-11-28), as one detached command on the lent machine: the 70B job at
# its own TP=4, 405B FP8 at TP=4, then 405B FP8 as two "nodes" of two GPUs (TP=2 x PP=2, vLLM's mp backend), each
# through the SLURM launcher (benchmarks/launcher_on_gpu.py), in that order, so that a lease that runs out keeps the
# layouts that finished.  The checkout is copied to /tmp/llmlab-snap first: the calls that follow (the waits) carry
# the working tree again, and a detached run must not see it change under it.
#
#   PIECES=4 WHL_DIR=.whl/p2 DETACH=1 benchmarks/four_h200s.sh     # the call that brings the last piece
#   benchmarks/rehearse_on_device.sh wait 560                        # back to back until "ended"
#
# What each run does and why: benchmarks/results/README.md, "Four H200s".
set -euo pipefail
snap=/tmp/llmlab-snap
rm -rf "$snap" && mkdir -p "$snap"
tar -C . --exclude=./.whl --exclude=./.venv --exclude=./.git -cf - . | tar -C "$snap" -xf -
traces=$snap/benchmarks/results/cpu-room-10
h200=(--gpu-type H200-141 --timeout 900 --greedy)
out=${OUT:-/tmp/llmlab-out}
[[ -z ${DETACH:-} ]] || out=/tmp/llmlab-detached/out  # where rehearse_on_device.sh's detached run keeps its results
PYTHON_FIRST=$snap exec benchmarks/rehearse_on_device.sh python "$snap/benchmarks/launches_on_gpu.py" \
    --out "$out/runs" \
    "70b-tp4 llama3.1-70b ${h200[*]} --concurrency 1 8 64 256 --repeats 2 --proxy-paired 256 --room $traces --learners 30" \
    "405b-fp8-tp4 llama3.1-405b-fp8 --gpus-per-node 4 --tp 4 --max-model-len 32768 ${h200[*]} --concurrency 1 8 64" \
    "405b-fp8-tp2-pp2-mp llama3.1-405b-fp8 --nodes 2 --gpus-per-node 2 --tp 2 --pp 2 --backend mp --max-model-len 32768 ${h200[*]} --concurrency 1 64"
