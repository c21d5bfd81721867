#!/bin/bash
# Open OnDemand's job flow for a batch-connect app with the "basic" template, for tests/cluster/test_ood.py: the
# steps OnDemand's generated job script takes, in its order, written here without OnDemand.
#   sbatch ... tests/ood_flow.sh WORK_DIR     (WORK_DIR holds the rendered before.sh, script.sh, after.sh)
# cd WORK_DIR -> helper functions -> host -> source before.sh (sets port, password) -> script.sh & ->
# source after.sh (waits for the port) -> connection.yml (umask 077) -> wait for script.sh -> clean up.
# shellcheck disable=SC2329  # the helpers below are called by the sourced before.sh and after.sh
cd "$1" || exit 1

# the app's conn_params (submit.yml), space separated
read -ra extra_params <<< "${LLMLAB_OOD_CONN_PARAMS:-}"
conn_params=(host port password "${extra_params[@]}")

create_yml() {
  echo "Generating connection YAML file..."
  (
    umask 077
    for p in "${conn_params[@]}"; do
      echo "${p}: ${!p}"
    done > connection.yml
  )
}

clean_up() {
  echo "Cleaning up..."
  [[ -n ${SCRIPT_PID:-} ]] && pkill -P "${SCRIPT_PID}"
  pkill -P $$
  exit "${1:-0}"
}

# The helpers OnDemand defines for before.sh/after.sh (same names and arguments; port_used via bash's
# /dev/tcp, so that no netcat is needed).
port_used() {
  local host=${1%%:*} port=${1##*:}
  [[ $host == "$1" ]] && host=localhost
  timeout 2 bash -c "exec 3<>/dev/tcp/${host}/${port}" 2>/dev/null
}
find_port() {
  local host=${1:-localhost} port
  port=$(shuf -i "${2:-2000}-${3:-65535}" -n 1)
  while port_used "${host}:${port}"; do
    port=$(shuf -i "${2:-2000}-${3:-65535}" -n 1)
  done
  echo "${port}"
}
wait_until_port_used() {
  local i
  for ((i = 1; i <= ${2:-30} * 2; i++)); do
    port_used "$1" && return 0
    sleep 0.5
  done
  return 1
}
create_passwd() {
  tr -cd '[:alnum:]' < /dev/urandom 2>/dev/null | head -c"${1:-32}"
}
export -f port_used find_port wait_until_port_used create_passwd

host=$(hostname)
export host port

# shellcheck source=/dev/null
[[ -e before.sh ]] && source before.sh

echo "Script starting..."
./script.sh &
SCRIPT_PID=$!

# shellcheck source=/dev/null
[[ -e after.sh ]] && source after.sh

create_yml

wait "${SCRIPT_PID}" || clean_up 1
clean_up
