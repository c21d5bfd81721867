#!/usr/bin/env bash
# llmlab's shared SLURM launcher: brings up one vLLM server for the job it runs in, and takes it down again.
#
# The per-model job scripts next to this file end with `exec bash llmlab-serve.sh JOB`; JOB names a table of
# models.toml (nodes, GPUs, TP, PP, dtype, context).  What this script does, in order:
#   1. renders the job (llmlab.ops.launcher): the vllm serve line and the Ray layout and its ports;
#   2. writes a random API key to a 0600 file under $LLMLAB_HOME (default ~/.llmlab) -- never printed;
#   3. starts llmlab.serve.proxy, which checks the key (read from its file: not in `ps`, not in any log) on every
#      request and forwards only /v1/*, /health and /metrics, on a free port it binds itself -- bind, then publish:
#      only a port the proxy holds is ever published, so nobody can squat it and receive the learners' keys;
#   4. publishes the server early: a connection file with status "loading" (and the load phase), so that
#      llmlab.connect() says the server is still loading instead of starting the embedded tiny model;
#   5. multi-node only: starts Ray with srun (head on the first node, one worker per other node), with token
#      authentication (RAY_AUTH_MODE=token, a per-job 0600 token file), and waits until `ray status` shows
#      every node and GPU; a node whose Ray exits is retried (a bad argument is not), and the job fails with
#      that node's log, or with the missing nodes after the time-out; then starts vLLM on a Unix socket in a
#      private (0700) directory behind the proxy, prints the model-load progress, waits for /health, rewrites
#      the connection file as "ready" and prints how to use the server.  Backend "mp" (no Ray): vLLM starts on the
#      head first, with a master port drawn at random for the job; the other nodes' headless vLLM start only once
#      the head's own vLLM listens on that port (anyone else there fails the job before they start);
#   6. ends the job when vLLM or the proxy exits on its own (a dead proxy must not hold the GPUs);
#   7. on exit, scancel or the time limit, within SLURM's KillWait: removes the connection file (leaving
#      servers/job-ID.ended: connect() says the job ended), the key (and its curl config) and the Ray token first, then stops vLLM, the proxy and Ray at once, and removes the socket and Ray's folders.
#
# Knobs (environment; sbatch passes yours to the job): LLMLAB_HOME, LLMLAB_PYTHON, LLMLAB_MODEL_PATH,
# LLMLAB_MODEL_DIR, LLMLAB_CACHE_DIR, LLMLAB_MAX_MODEL_LEN, LLMLAB_EXTRA_VLLM_ARGS, LLMLAB_RAY_TIMEOUT,
# LLMLAB_READY_TIMEOUT, LLMLAB_STAGE_DIR (a node-local folder: the weights are copied there first), LLMLAB_NCCL_IB=1,
# LLMLAB_RAY_*, LLMLAB_KEYS (a file or directory of registered
# 'sha256:<hex>' key digests the proxy also accepts), LLMLAB_SHARE_DIR + LLMLAB_SHARE_GROUP (a workshop server:
# llmlab.serve.share), LLMLAB_MP_PORTS + LLMLAB_HOST_IFACE (backend "mp": the master port's range, the private
# interface vLLM binds on); LLMLAB_DRY_RUN=1 prints what would run and exits.
# slurm/README.md explains each.  Partition, account and time come from sbatch's own flags or SBATCH_*.
set -euo pipefail
umask 077  # everything this job writes (key, connection file, logs) is readable by its user only
# The job's output.  slurmstepd creates a job's --output file before the script runs, under the umask of the shell
# that ran sbatch (often 0644), so the shipped scripts send it to /dev/null, and the launcher writes its own output
# to a file it creates now, under umask 077, in ~/.llmlab/logs (0700): where `llmlab launch` puts it too, and where
# `llmlab status` and `llmlab logs` read it.  An --output of your own (sbatch --output=FILE) is kept as you chose.
if [[ -n ${SLURM_JOB_ID:-} && $(readlink -f "/proc/$$/fd/1") == /dev/null ]]; then
  mkdir -p "${LLMLAB_HOME:-$HOME/.llmlab}/logs"  # 0700: umask 077
  exec >>"${LLMLAB_HOME:-$HOME/.llmlab}/logs/llmlab-$SLURM_JOB_ID.out" 2>&1
fi
unset VLLM_API_KEY  # vLLM behind the proxy takes no key; one inherited from the user's shell would refuse the proxy
# Ray takes RAY_AUTH_TOKEN before RAY_AUTH_TOKEN_PATH: one inherited from the user's shell (sbatch passes it on) would
# replace the job's own token (its 0600 file) in Ray, vLLM and every srun step, and is passed to processes that Ray
# starts in their environment.  The job's token comes from its file only.
unset RAY_AUTH_TOKEN
# Nor may the user's shell reopen runtime LoRA loading, which vLLM's resolvers do by a request's "model" alone
# (the proxy closes only the two HTTP routes): llmlab.serve.vllm.INHERITED_OPENERS.
unset VLLM_ALLOW_RUNTIME_LORA_UPDATING VLLM_LORA_RESOLVER_CACHE_DIR VLLM_LORA_RESOLVER_HF_REPO_LIST

say() { printf '[llmlab %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { say "FAILED: $*"; exit 1; }

job=${1:?usage: llmlab-serve.sh JOB  (a table of slurm/models.toml, e.g. llama3.1-70b)}
PY=${LLMLAB_PYTHON:-python3}
dry_run=${LLMLAB_DRY_RUN:-0}
"$PY" -c 'import llmlab.ops.launcher' 2>/dev/null ||
  die "'$PY' cannot import llmlab: activate the llmlab environment before sbatch (the job inherits it), or set LLMLAB_PYTHON"

job_id=${SLURM_JOB_ID:-}
if [[ -z $job_id ]]; then
  [[ $dry_run == 1 ]] || die "not inside a SLURM job: submit a job script with sbatch (LLMLAB_DRY_RUN=1 only prints)"
  job_id=dry-run
fi
if [[ -n ${LLMLAB_NODES:-} ]]; then
  read -ra node_list <<<"$LLMLAB_NODES"
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  mapfile -t node_list < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
  node_list=()
fi

# Set by the rendered settings below (declared here for readers and for shellcheck).
summary='' engine='' served_model='' host='' port='' expected_nodes='' tp='' pp='' ray_timeout='' ready_timeout=''
serve_line='' ray_address='' ray_expected_gpus=0 ray_head_cmd='' ray_temp_dir='' bind_host='' uds=''
serve_argv=() nodes=() ray_worker_cmds=() mp_master='' mp_port=0 mp_worker_cmds=() stage_argv=()
run_dir='' ray_dir=''
if [[ $dry_run != 1 ]]; then  # vLLM's socket: a private directory on the head node's local disk (mktemp -d makes it 0700)
  run_dir=$(mktemp -d "${TMPDIR:-/tmp}/llmlab-run-$job_id.XXXXXX")
  export LLMLAB_RUN_DIR=$run_dir
  # Ray's folder (multi-node jobs), made before anything starts: an unpredictable name, mode 0700.  Ray makes its
  # own folders 0777 (any local user could replace its sockets); inside this one nobody else reaches them.  Short:
  # Ray's socket paths have at most 107 bytes (a long $TMPDIR falls back to /tmp; LLMLAB_RAY_TMPDIR is taken as is).
  ray_root=${LLMLAB_RAY_TMPDIR:-${TMPDIR:-/tmp}}
  [[ -n ${LLMLAB_RAY_TMPDIR:-} ]] || ((${#ray_root} <= 18)) || ray_root=/tmp
  ray_dir=$(mktemp -d "$ray_root/llmlab-ray.XXXXXX")
  export LLMLAB_RAY_DIR=$ray_dir
fi
rendered=$("$PY" -m llmlab.ops.launcher render "$job" --shell --job-id "$job_id" --nodes "${node_list[*]}" \
  --python "$PY") || { [[ -n $run_dir ]] && rm -rf -- "$run_dir" "$ray_dir"; exit 1; }
eval "$rendered"
if [[ -n $ray_dir && -z $ray_head_cmd ]]; then  # one node: no Ray
  rmdir -- "$ray_dir"
  ray_dir=''
fi

if [[ $dry_run == 1 ]]; then
  echo "$summary"
  if [[ -n $ray_head_cmd ]]; then
    echo "Ray head:   srun --overlap --nodes=1 --ntasks=1 -w ${nodes[0]} $ray_head_cmd"
    for i in "${!ray_worker_cmds[@]}"; do
      echo "Ray worker: srun --overlap --nodes=1 --ntasks=1 -w ${nodes[i + 1]} ${ray_worker_cmds[i]}"
    done
    echo "Ray wait:   $expected_nodes nodes, $ray_expected_gpus GPUs at $ray_address (time-out ${ray_timeout} s)"
  fi
  echo "vLLM:       $serve_line"
  ((${#mp_worker_cmds[@]})) && echo "then, once the head's vLLM holds port $mp_port:"
  for i in "${!mp_worker_cmds[@]}"; do
    echo "vLLM node:  srun --overlap --nodes=1 --ntasks=1 -w ${nodes[i + 1]} ${mp_worker_cmds[i]}"
  done
  echo "runs as:    ${serve_argv[*]}"
  echo "proxy:      $PY -m llmlab.serve.proxy --listen $bind_host:$port --upstream unix:$uds --key-file KEY_FILE" \
    "--watch-pid JOB_SHELL --ready-file RUN_DIR/proxy.ready   (started first; its bound port is then published)"
  env_lines=$(grep '^export ' <<<"$rendered" | sed 's/^export /            /') || true
  echo "env:"
  echo "$env_lines"
  exit 0
fi

home=${LLMLAB_HOME:-$HOME/.llmlab}
log_dir=$home/logs/job-$job_id
key_file=$home/keys/job-$job_id.key
conn_file=$home/servers/job-$job_id.json
vllm_log=$log_dir/vllm.log
mkdir -p "$log_dir" "$home/keys" "$home/servers"
printf '%s' "$rendered" >"$log_dir/rendered.sh"  # what ran, for the record (no secret in it)

vllm_pid='' proxy_pid='' helper_pid='' cleaned=''
ray_pids=() ray_steps=() attempt=1 mp_pids=() mp_steps=()
# The clean-up must end within SLURM's KillWait (scancel and the time limit send SIGTERM, then SIGKILL that many
# seconds later; 30 by default): its grace for the processes leaves room for the rest.
kill_wait=$(timeout 10 scontrol show config 2>/dev/null | sed -n 's/^KillWait *= *\([0-9]*\).*/\1/p') || true
kill_wait=${kill_wait:-30}
stop_grace=${LLMLAB_STOP_GRACE:-20}
if ((stop_grace > kill_wait - 8)); then
  stop_grace=$((kill_wait > 9 ? kill_wait - 8 : 1))
fi

# shellcheck disable=SC2329  # wait_gone, cleanup and on_signal run from the traps below
# Waits at most $2 seconds for every process in "$1" (pids; "-PGID" for a process group) to end.
wait_gone() {
  local t
  for ((t = 0; t < $2; t++)); do
    local alive=0 p
    for p in $1; do kill -0 -- "$p" 2>/dev/null && alive=1; done
    ((alive)) || return 0
    sleep 1
  done
  return 1
}

# shellcheck disable=SC2329
cleanup() {
  [[ -n $cleaned ]] && return
  cleaned=1
  # A second signal (scancel again, the time limit, a closed terminal) must not cut the clean-up short: a SIGTERM
  # that arrived while vLLM was being stopped once left the key behind (seen on the H100: a failed start, then
  # the SIGTERM that scancel sends).
  trap '' TERM INT HUP
  local t0=$SECONDS procs=()
  # First, in milliseconds: the published address (nobody connects to a server that is going away) and the
  # secrets (the proxy holds the key in memory, Ray its token), before anything that can take seconds.
  rm -f "$conn_file" "$key_file" "${key_file%.key}.curl"
  # In its place, a word that the job ended: llmlab.connect() then says so instead of starting the tiny model.
  printf '%s\n' "$served_model" >"$home/servers/job-$job_id.ended" 2>/dev/null || true
  # The room's server.json only if it is still this job's: after a hand-over it names the new job, which serves.
  if [[ -n ${LLMLAB_SHARE_DIR:-} ]]; then
    "$PY" -m llmlab.ops.launcher unpublish --share-dir "$LLMLAB_SHARE_DIR" --job-id "$job_id" || true
  fi
  [[ -n $ray_head_cmd ]] && rm -f "$RAY_AUTH_TOKEN_PATH"
  # Then every process at once, under one grace period: SLURM's SIGKILL comes KillWait seconds after its SIGTERM.
  [[ -n $helper_pid ]] && { kill -TERM "$helper_pid" 2>/dev/null || true; }
  if [[ -n $vllm_pid ]] && kill -0 -- "-$vllm_pid" 2>/dev/null; then
    say "stopping vLLM (pid $vllm_pid)"
    kill -TERM -- "-$vllm_pid" 2>/dev/null || true
    procs+=("-$vllm_pid")
  fi
  [[ -n $proxy_pid ]] && kill -TERM "$proxy_pid" 2>/dev/null && procs+=("$proxy_pid")
  if ((${#ray_pids[@]})); then
    say "stopping Ray on ${nodes[*]}"
    kill -TERM "${ray_pids[@]}" 2>/dev/null || true  # srun passes it to `ray start --block`, which stops its node's Ray
    procs+=("${ray_pids[@]}")
  fi
  if ((${#mp_pids[@]})); then
    say "stopping vLLM on ${nodes[*]:1}"
    kill -TERM "${mp_pids[@]}" 2>/dev/null || true  # srun passes it to each node's headless vLLM
    procs+=("${mp_pids[@]}")
  fi
  if ((${#procs[@]})) && ! wait_gone "${procs[*]}" "$stop_grace"; then
    kill -KILL -- "${procs[@]}" 2>/dev/null || true
    wait_gone "${procs[*]}" 2 || true
  fi
  ray_pids=()
  # Ray's folder on this (the head) node, once no process of this job's user uses it any more (an agent that
  # outlives its raylet by a second would recreate files), within the budget; other nodes' copies are private
  # too (0700) and stay in their temporary folder.
  if [[ -n $ray_dir && -d $ray_dir ]]; then
    while ((SECONDS - t0 < kill_wait - 4)) && pgrep -u "$UID" -f -- "$ray_dir" >/dev/null; do sleep 1; done
    rm -rf -- "$ray_dir" || true
  fi
  [[ -n $run_dir ]] && rm -rf -- "$run_dir"
  say "stopped; connection file and key removed (clean-up $((SECONDS - t0)) s; SLURM's KillWait ${kill_wait} s)"
}
# shellcheck disable=SC2329
on_signal() {
  say "received $1 (scancel or time limit): shutting down"
  cleanup
  exit "$2"
}
trap cleanup EXIT
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGHUP 129' HUP

say "job $job_id on ${nodes[*]}"
echo "$summary"
"$PY" -c 'import secrets; print(secrets.token_urlsafe(32))' >"$key_file"
say "API key written to $key_file (mode 0600)"
if [[ -n $ray_head_cmd ]]; then  # RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH come from the rendered settings
  "$PY" -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH"
  say "Ray token written to $RAY_AUTH_TOKEN_PATH (mode 0600); Ray accepts no connection without it"
fi

# Helpers run in the background and are awaited, so that a signal reaches the trap at once.
run_helper() {
  "$PY" -m llmlab.ops.launcher "$@" &
  helper_pid=$!
  local rc=0
  wait "$helper_pid" || rc=$?
  helper_pid=''
  return "$rc"
}

# The key-checking proxy first, on a port it binds itself (port 0), before anything is published: a port chosen
# ahead and published could be taken by another user first, who would then receive the learners' keys.  Until
# vLLM listens on $uds the proxy answers 503 "still loading".  It follows the job's shell ($$): a job that ends in
# any way leaves no proxy behind.
keys_arg=()
# A workshop server (llmlab launch --share GROUP): the learners register their key digests in the share's keys/.
[[ -n ${LLMLAB_SHARE_DIR:-} ]] && LLMLAB_KEYS=${LLMLAB_KEYS:-$LLMLAB_SHARE_DIR/keys}
[[ -n ${LLMLAB_KEYS:-} ]] && keys_arg=(--keys "$LLMLAB_KEYS")
"$PY" -m llmlab.serve.proxy --listen "$bind_host:$port" --upstream "unix:$uds" --key-file "$key_file" \
  --watch-pid $$ --ready-file "$run_dir/proxy.ready" "${keys_arg[@]}" >"$log_dir/proxy.log" 2>&1 </dev/null &
proxy_pid=$!
run_helper wait-bound --ready-file "$run_dir/proxy.ready" --pid "$proxy_pid" --log "$log_dir/proxy.log" \
  >"$run_dir/proxy.port" || die "the key-checking proxy did not start (the line above says why); nothing was published"
port=$(<"$run_dir/proxy.port")
say "key-checking proxy listening on $bind_host:$port (log: $log_dir/proxy.log)"

# The connection file, from now on: "loading" with the phase (llmlab.connect() then says the server is still
# loading instead of starting the embedded tiny model), rewritten as the load goes on and "ready" at READY.
pub_args=(--host "$host" --port "$port" --model "$served_model" --key-file "$key_file" --connection-file "$conn_file"
  --job-id "$job_id" --engine "$engine" --tp "$tp" --pp "$pp" --nodes "${nodes[*]}" --ray-address "$ray_address")
phase=$([[ -n $ray_head_cmd ]] && echo "starting Ray on ${#nodes[@]} nodes" || echo "starting vLLM")
if ((${#stage_argv[@]})); then
  # LLMLAB_STAGE_DIR: the weights copied to each node's own disk before vLLM reads them (llmlab weights stage: timed,
  # under a temporary name then renamed, skipped where a verified copy is there already).
  run_helper loading "${pub_args[@]}" --phase "copying the weights to node-local disk" ||
    die "could not write the connection file $conn_file"
  say "staging the weights on ${nodes[*]}: ${stage_argv[*]}"
  if ((${#nodes[@]} == 1)); then
    "${stage_argv[@]}" </dev/null &  # awaited in the background, so that a signal reaches the trap at once
    helper_pid=$!
    wait "$helper_pid" || die "staging the weights failed (the lines above say why); without LLMLAB_STAGE_DIR the job reads them where they are"
    helper_pid=''
  else
    stage_pids=()
    for node in "${nodes[@]}"; do
      srun --overlap --nodes=1 --ntasks=1 -w "$node" "${stage_argv[@]}" >"$log_dir/stage-$node.log" 2>&1 </dev/null &
      stage_pids+=("$!")
    done
    for i in "${!stage_pids[@]}"; do
      wait "${stage_pids[i]}" || die "staging the weights on ${nodes[i]} failed; the end of $log_dir/stage-${nodes[i]}.log:
$(tail -n 5 "$log_dir/stage-${nodes[i]}.log")"
      # its result line, not its last: srun relays the task's stdout (the result) and stderr (the bar) apart
      say "${nodes[i]}: $(grep -E '^staged | already holds this stage.s verified copy ' "$log_dir/stage-${nodes[i]}.log" | tail -n 1)"
    done
  fi
fi
run_helper loading "${pub_args[@]}" --phase "$phase" || die "could not write the connection file $conn_file"

# Ray's folder on each node: the head node's mktemp -d, or the same (unpredictable) name made 0700 on a worker
# node, in the step that then runs `ray start`; a folder of that name that is not this user's own 0700 one (made by
# someone else, a link) is refused.
# shellcheck disable=SC2016  # expanded by the bash of that step
private_dir_then='d=$1; shift
mkdir -m 700 -- "$d" 2>/dev/null || [[ -d $d && ! -L $d && -O $d && $(stat -c %a -- "$d") == 700 ]] ||
  { echo "llmlab: $d on $(hostname) is not a private (0700) folder of $(id -un): Ray is not started in it" >&2; exit 1; }
exec "$@"'

start_ray() {  # node, command (a shlex-quoted string from the renderer)
  local node=$1 args=() log=$log_dir/ray-$1.log
  eval "args=($2)"
  [[ -e $log ]] && mv -f "$log" "$log.attempt$((attempt - 1))"  # keep a failed attempt's log
  say "Ray on $node: ${args[*]}"
  srun --overlap --nodes=1 --ntasks=1 -w "$node" bash -c "$private_dir_then" llmlab-ray "$ray_dir" "${args[@]}" \
    >"$log" 2>&1 </dev/null &
  ray_pids+=("$!")
  ray_steps+=(--step "$node:$!:$log")
}

stop_ray() {
  ((${#ray_pids[@]})) || return 0
  kill -TERM "${ray_pids[@]}" 2>/dev/null || true
  wait_gone "${ray_pids[*]}" "$stop_grace" || kill -KILL "${ray_pids[@]}" 2>/dev/null || true
  ray_pids=()
}

# Returns 0 once `ray status` shows every node and GPU; 1 if a node's Ray exited, 3 on the time-out.
bring_up_ray() {
  ray_pids=() ray_steps=()
  start_ray "${nodes[0]}" "$ray_head_cmd"
  # The workers look the head up in its GCS: start them once the head has registered, then wait until every
  # node has started and `ray status` shows all nodes and GPUs.
  run_helper wait-ray --started-only --address "$ray_address" --nodes 1 --timeout "$ray_timeout" \
    --ray-temp-dir "$ray_temp_dir" "${ray_steps[@]}" || return
  for i in "${!ray_worker_cmds[@]}"; do
    start_ray "${nodes[i + 1]}" "${ray_worker_cmds[i]}"
  done
  run_helper wait-ray --address "$ray_address" --nodes "$expected_nodes" --gpus "$ray_expected_gpus" \
    --timeout "$ray_timeout" --ray-temp-dir "$ray_temp_dir" "${ray_steps[@]}"
}

if [[ -n $ray_head_cmd ]]; then
  # A node's Ray that exits while starting is retried (LLMLAB_RAY_ATTEMPTS, default 3), after a pause that
  # grows: Ray 2.60's raylet aborts when its dashboard agent takes more than a fixed 15 s to start, which
  # happens on an overloaded node or a slow shared file system; a later start, with warm caches, usually works.
  attempts=${LLMLAB_RAY_ATTEMPTS:-3}
  for ((attempt = 1; ; attempt++)); do
    rc=0
    bring_up_ray || rc=$?
    ((rc == 0)) && break
    # A `ray start` that rejected its arguments (exit code 2, a usage error) fails the same way every time.
    usage_error=0
    for pid in "${ray_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null && continue
      code=0
      wait "$pid" || code=$?
      ((code == 2)) && usage_error=1
    done
    stop_ray
    # Only now FAILED, the word `llmlab status` reports: an attempt that will be retried is not the job's end.
    ((usage_error)) && die "Ray: ray start rejected its arguments (check LLMLAB_RAY_HEAD_ARGS / LLMLAB_RAY_WORKER_ARGS); not retried"
    ((rc == 3)) && die "Ray did not start on every node within LLMLAB_RAY_TIMEOUT (the lines above name the missing ones)"
    ((attempt < attempts)) || die "Ray did not start on every node in $attempt attempt(s) (the lines above say why)"
    say "Ray did not start on every node (attempt $attempt of $attempts); starting it again in $((10 * attempt)) s"
    sleep $((10 * attempt)) &
    wait $!
  done
  say "Ray cluster complete: $expected_nodes nodes, $ray_expected_gpus GPUs"
fi

if ((${#mp_worker_cmds[@]})); then
  # Backend "mp": vLLM's own multi-node mode.  Each other node runs `vllm serve --headless` (its GPUs' workers,
  # no API server); they meet the head at $mp_master (torch.distributed), a port drawn at random for this job.
  say "no Ray: vLLM's own processes on ${#nodes[@]} nodes, meeting at $mp_master"
fi
say "starting vLLM (log: $vllm_log)"
echo "$serve_line"
# setsid makes vLLM and its engine processes one group, so the clean-up can stop them all.  vLLM listens on
# $uds only; the proxy is the job's one listener that other users can reach (its key comes from the key file).
setsid "${serve_argv[@]}" >"$vllm_log" 2>&1 </dev/null &
vllm_pid=$!
if ((${#mp_worker_cmds[@]})); then
  # The head first: the workers dial $mp_master and trust whatever answers there, so they start only once the
  # head's own vLLM (its process group) listens on that port; anyone else there fails the job before they start.
  run_helper wait-master --port "$mp_port" --pid "$vllm_pid" --log "$vllm_log" --timeout "$ready_timeout" || exit 1
  for i in "${!mp_worker_cmds[@]}"; do
    node=${nodes[i + 1]}
    eval "args=(${mp_worker_cmds[i]})"
    say "vLLM on $node (headless): ${args[*]}"
    srun --overlap --nodes=1 --ntasks=1 -w "$node" "${args[@]}" >"$log_dir/vllm-$node.log" 2>&1 </dev/null &
    mp_pids+=("$!")
    mp_steps+=(--step "$node:$!:$log_dir/vllm-$node.log")
  done
fi
# The wait ends before the job's time limit does (squeue's %L: the time left), so a load that cannot finish in
# time fails with that reason instead of being killed mid-load.
time_left=$(squeue -h -j "$job_id" -o %L 2>/dev/null || true)
# The key goes to /health only while the proxy started here lives and holds the port (not a squatter on it).
run_helper wait-ready "${pub_args[@]}" --pid "$vllm_pid" --log "$vllm_log" --proxy-pid "$proxy_pid" \
  --proxy-log "$log_dir/proxy.log" --timeout "$ready_timeout" --elapsed "$SECONDS" --time-left "$time_left" \
  --stop-grace "$stop_grace" "${mp_steps[@]}" || exit 1

# Serving: the job ends (clean-up included) as soon as vLLM or its proxy exits, whichever goes first; a dead proxy
# would otherwise leave nobody able to reach the server while the job holds its GPUs until the time limit.
# (A poll, not `wait -n PID PID`: bash before 5.1, as on RHEL 8, waits there for any job, a Ray step included.)
nodes_alive() {  # every other node's headless vLLM (backend mp)
  local pid
  for pid in "${mp_pids[@]}"; do kill -0 "$pid" 2>/dev/null || return 1; done
}
while kill -0 "$vllm_pid" 2>/dev/null && kill -0 "$proxy_pid" 2>/dev/null && nodes_alive; do
  sleep 2 &
  wait $! || true
done
rc=0
if kill -0 "$vllm_pid" 2>/dev/null && kill -0 "$proxy_pid" 2>/dev/null; then
  for i in "${!mp_pids[@]}"; do
    kill -0 "${mp_pids[i]}" 2>/dev/null && continue
    node=${nodes[i + 1]}
    die "vLLM's headless workers on $node exited: the model is incomplete, so the job ends now. Last lines of
$log_dir/vllm-$node.log:
$(tail -n 20 "$log_dir/vllm-$node.log")"
  done
fi
if kill -0 "$vllm_pid" 2>/dev/null; then
  wait "$proxy_pid" || rc=$?
  proxy_pid=''
  die "the key-checking proxy exited on its own (code $rc): nobody can reach vLLM any more, so the job ends now
instead of holding its nodes until the time limit. Last lines of $log_dir/proxy.log:
$(tail -n 20 "$log_dir/proxy.log")"
fi
wait "$vllm_pid" || rc=$?
vllm_pid=''
die "vLLM exited on its own (code $rc). Last lines of $vllm_log:
$(tail -n 20 "$vllm_log")"
