#!/usr/bin/env bash
# Run `llmlab rehearse` on a GPU machine that cannot download anything (the course's lent H100/H200s).
#
# Why a script: vLLM and the packages the machine lacks travel as one tar.xz cut into pieces of at most
# 45 MB (each call of the machine's tool carries 64 MiB including the repository), so the pieces arrive in
# successive calls; this script stages each call's piece, unpacks the set once all are there, and runs
# the rehearsals given as arguments (MODEL:TP[:PP] ...), leaving one tar.gz of results in $OUT.
#
#   PIECES=3 benchmarks/rehearse_on_device.sh                      # a call that only brings a piece
#   PIECES=3 benchmarks/rehearse_on_device.sh llama3.1-8b:1 llama3.1-8b:2
#   PIECES=3 benchmarks/rehearse_on_device.sh proxy --model llama3.1-8b ...   # benchmarks/proxy_overhead.py
#   PIECES=3 benchmarks/rehearse_on_device.sh launch llama3.1-8b               # benchmarks/launcher_on_gpu.py
#   PIECES=2 benchmarks/rehearse_on_device.sh lessons quant                    # benchmarks/lessons_on_gpu.py
#   PIECES=3 benchmarks/rehearse_on_device.sh room --traces benchmarks/results/cpu-room-10 --wave 1@0:300 ...
#                                                                   # benchmarks/room_on_gpu.py (issue 36)
#   PIECES=3 benchmarks/rehearse_on_device.sh python benchmarks/kv_held_out_on_gpu.py ...   # any script, the set
#                                                                   # on its path (issue 39's held-out runs)
#
# A run longer than one call of the machine's tool (10 minutes) goes on after the call returns: DETACH=1 starts it
# in a session of its own (setsid), with its output, exit status and results in /tmp/llmlab-detached; each later
# call `benchmarks/rehearse_on_device.sh wait SECONDS` waits up to SECONDS for it to end, prints the end of its log
# and leaves what it has written so far in $OUT/detached.tar.gz (the machine must be kept warm: call back to back).
#
#   DETACH=1 PIECES=3 benchmarks/rehearse_on_device.sh room ...   # returns at once
#   benchmarks/rehearse_on_device.sh wait 560                     # repeat until it says "ended"
#
# Carry what a detached run reads from the checkout (PYTHON_FIRST's folder) in the `wait` calls too: an ignored
# folder that a later call did not carry was gone from the checkout during that call (2026-11-27), while /tmp kept
# the staged pieces, the unpacked set and the results.
#
# With Ray (multi-node jobs), the set and Ray's own tar.xz travel as one byte stream cut into BUNDLE pieces of
# 46.4 MB (bundle.NN: site.tar.xz's SITE_BYTES bytes, then ray.tar.xz), three calls instead of four:
#
#   BUNDLE=3 SITE_BYTES=108045892 benchmarks/rehearse_on_device.sh launch llama3.1-8b --nodes 2 --tp 1 --pp 2 ...
#
# Environment: PIECES (how many pieces make the set), WHL_DIR (where this call's pieces are, default .whl), OUT
# (results folder), CONCURRENCY (default 1,8,64,256), READY_TIMEOUT (seconds for /health, default 420), DETACH,
# PYTHON_FIRST (the python mode: a folder before the set on PYTHONPATH, e.g. a copy of llmlab that the working trees
# of later calls cannot change under a detached run).
# NVLink multicast stays off (the lending workplace asks it: NCCL_NVLS_ENABLE=0 and friends), and so does vLLM's
# symmetric-memory all-reduce, which would use it.
set -euo pipefail
stage=/tmp/llmlab-stage
site=/tmp/llmlab-site
out=${OUT:-/tmp/llmlab-out}
detached=/tmp/llmlab-detached
if [ "${1:-}" = wait ]; then  # a DETACH=1 run: wait for it up to $2 seconds, bring back what it wrote so far
    end=$((SECONDS + ${2:-540}))
    while [ ! -f "$detached/rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
    tail -n 60 "$detached/log" || true
    mkdir -p "${OUT:?}"
    tar -czf "$OUT/detached.tar.gz" --exclude='*/model' -C "$detached" . || true
    if [ -f "$detached/rc" ]; then
        echo "ended, exit $(cat "$detached/rc")"
        exit "$(cat "$detached/rc")"
    fi
    echo "still running"
    exit 0
fi
mkdir -p "$stage" "$out"
if [ -n "${BUNDLE:-}" ]; then
    pattern='bundle.*' PIECES=$BUNDLE
else
    pattern='site.tar.xz.*'
fi
whl=${WHL_DIR:-.whl}
if compgen -G "$whl/$pattern" > /dev/null; then
    # shellcheck disable=SC2086  # the pattern is a glob
    cp "$whl"/$pattern "$stage"/
fi
have=$(find "$stage" -name "$pattern" | wc -l)
echo "pieces staged: $have of ${PIECES:?set PIECES}"
if [ "$#" -eq 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    exit 0
fi
if [ "$have" -lt "$PIECES" ]; then
    echo "missing pieces: send the others first" >&2
    exit 3
fi
if [ -n "${DETACH:-}" ]; then
    rm -rf "$detached" && mkdir -p "$detached/out"
    # shellcheck disable=SC2016  # the inner bash expands them: the command, then its exit status into rc
    DETACH='' OUT=$detached/out setsid bash -c '"$@"; echo $? >"$0/rc"' "$detached" bash "$0" "$@" \
        >"$detached/log" 2>&1 </dev/null &
    echo "detached (pid $!): call \`$0 wait SECONDS\` back to back until it has ended"
    exit 0
fi
if [ ! -f "$site/.complete" ]; then
    mkdir -p "$site"
    if [ -n "${BUNDLE:-}" ]; then
        sha256sum "$stage"/bundle.*
        cat "$stage"/bundle.* >"$stage/bundle"  # one file: head on a pipe would end cat with SIGPIPE
        head -c "${SITE_BYTES:?set SITE_BYTES}" "$stage/bundle" | xz -d | tar -x -C "$site"
        tail -c +$((SITE_BYTES + 1)) "$stage/bundle" | xz -d | tar -x -C "$site"
        rm -f "$stage/bundle"
    else
        cat "$stage"/site.tar.xz.* | xz -d | tar -x -C "$site"
    fi
    touch "$site/.complete"
fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
python3 -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__)"
if [ "$1" = launch ]; then  # the SLURM launcher's GPU path, end to end (benchmarks/launcher_on_gpu.py)
    shift
    status=0
    PYTHONPATH=$site:$PWD python3 benchmarks/launcher_on_gpu.py "$@" --out "$out/launch${LAUNCH_TAG:-}" || status=$?
    tar -czf "$out/launch${LAUNCH_TAG:-}.tar.gz" -C "$out" "launch${LAUNCH_TAG:-}" && rm -rf "$out/launch${LAUNCH_TAG:-}"
    exit "$status"
fi
if [ "$1" = lessons ]; then  # lessons 11 and 15 on GPUs (benchmarks/lessons_on_gpu.py quant|replicas)
    shift
    status=0
    PYTHONPATH=$site:$PWD python3 benchmarks/lessons_on_gpu.py "$@" --out "$out/lessons" || status=$?
    tar -czf "$out/lessons-$1.tar.gz" --exclude='*/model' -C "$out/lessons" "$1" || true
    exit "$status"
fi
if [ "$1" = room ]; then  # a room's traces replayed against the llama3.1-8b job (benchmarks/room_on_gpu.py)
    shift
    status=0
    PYTHONPATH=$site:$PWD python3 "$(dirname "$0")/room_on_gpu.py" "$@" --out "$out" || status=$?
    tar -czf "$out/room.tar.gz" --exclude='*/model' -C "$out" room || true
    exit "$status"
fi
if [ "$1" = python ]; then  # any script of this checkout with the set on its path (benchmarks/kv_held_out_on_gpu.py)
    shift
    PYTHONPATH=${PYTHON_FIRST:+$PYTHON_FIRST:}$site:$PWD exec python3 "$@"
fi
if [ "$1" = proxy ]; then  # the proxy's cost on a GPU node (its proxy subprocess imports llmlab from here)
    shift
    PYTHONPATH=$site:$PWD exec python3 benchmarks/proxy_overhead.py "$@"
fi
status=0
for spec in "$@"; do
    IFS=: read -r model tp pp <<< "$spec"
    echo "=== rehearse $model TP=$tp PP=${pp:-1} ($(date -u +%T))"
    python3 -c "
import sys
from llmlab.ops import rehearsal
conc = tuple(int(c) for c in sys.argv[4].split(','))
rehearsal.rehearse(sys.argv[1], tp=int(sys.argv[2]), pp=int(sys.argv[3]), concurrency=conc, progress=False,
                  ready_timeout=float(sys.argv[5]))
" "$model" "$tp" "${pp:-1}" "${CONCURRENCY:-1,8,64,256}" "${READY_TIMEOUT:-420}" || status=$?
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader || true
done
tar -czf "$out/rehearsals.tar.gz" --exclude='*/model' --exclude='*/probe' rehearsals
exit "$status"
