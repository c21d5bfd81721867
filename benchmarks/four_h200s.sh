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
# ROUND picks the runs: 1 (default) is what ran on 2026-11-28 (benchmarks/results/h200x4-*); 2 and 3 are what that
# lease left undone, each sized for one 30-minute lease: 2, the 70B's larger rooms (100 and 300 learners, then 600
# and 1,000 while TTFT p99 stays under 2 s, learners starting 0.25 s apart; every request's record kept) and the proxy's cost measured with distinct prompts
# per way; 3, 405B FP8's rooms (30 and 100) and TP=2 x PP=2 again, with mp and with Ray (Ray travels as a second
# stream: BUNDLE=5 SITE_BYTES=<site.tar.xz's size>, see rehearse_on_device.sh).
# 4 needs one H200: ROUND=2's room of 100 waited seconds before vLLM's clock started (TTFT p99 7.1 s, vLLM's own
# histogram under 2.5 s for every request); the 8B's job replays the same room as shipped and with four API-server
# processes, each process's CPU sampled (launcher_on_gpu.CpuSampler), to tell which one-core process held them.
# What each run does and why: benchmarks/results/README.md, "Four H200s".
set -euo pipefail
snap=/tmp/llmlab-snap
rm -rf "$snap" && mkdir -p "$snap"
tar -C . --exclude=./.whl --exclude=./.venv --exclude=./.git -cf - . | tar -C "$snap" -xf -
traces=$snap/benchmarks/results/cpu-room-10
h200=(--gpu-type H200-141 --timeout 900 --greedy)
out=${OUT:-/tmp/llmlab-out}
[[ -z ${DETACH:-} ]] || out=/tmp/llmlab-detached/out  # where rehearse_on_device.sh's detached run keeps its results
fp8=(llama3.1-405b-fp8 --max-model-len 32768 "${h200[@]}")
pp2=(--nodes 2 --gpus-per-node 2 --tp 2 --pp 2)
case ${ROUND:-1} in
  1) runs=("70b-tp4 llama3.1-70b ${h200[*]} --concurrency 1 8 64 256 --repeats 2 --proxy-paired 256 --room $traces --learners 30"
           "405b-fp8-tp4 ${fp8[*]} --gpus-per-node 4 --tp 4 --concurrency 1 8 64"
           "405b-fp8-tp2-pp2-mp ${fp8[*]} ${pp2[*]} --backend mp --concurrency 1 64") ;;
  2) runs=("70b-tp4-rooms llama3.1-70b ${h200[*]} --concurrency 1 256 --proxy-paired 64 256 --room $traces --room-stagger 0.25 --learners 100 300 600 1000") ;;
  3) runs=("405b-fp8-tp4-rooms ${fp8[*]} --gpus-per-node 4 --tp 4 --concurrency 1 64 --room $traces --learners 30 100"
           "405b-fp8-tp2-pp2-ray ${fp8[*]} ${pp2[*]} --backend ray --concurrency 1 64"
           "405b-fp8-tp2-pp2-mp ${fp8[*]} ${pp2[*]} --backend mp --concurrency 1 64") ;;
  4) one=(llama3.1-8b --gpu-type H200-141 --timeout 600 --concurrency 1 --room "$traces" --room-stagger 0.25 --learners 100)
     runs=("8b-room ${one[*]}" "8b-room-api4 ${one[*]} --extra-vllm-args '--api-server-count 4'") ;;
  *) echo "ROUND=${ROUND}: give 1, 2, 3 or 4" >&2; exit 2 ;;
esac
PYTHON_FIRST=$snap exec benchmarks/rehearse_on_device.sh python "$snap/benchmarks/launches_on_gpu.py" \
    --out "$out/runs" "${runs[@]}"
