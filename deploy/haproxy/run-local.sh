#!/usr/bin/env bash
# Two laneserve instances on loopback ports and HAProxy in front of them, in the foreground.
#
#   deploy/haproxy/run-local.sh [SERVE ARGS...]      e.g. --model /srv/models/LFM2-2.6B
#
# Every argument goes to both `laneserve serve` instances. Clients talk to HAProxy at
# $LANESERVE_LISTEN (127.0.0.1:8000); HAProxy's stats page is at $HAPROXY_STATS
# (127.0.0.1:8404)/stats. Environment: LANESERVE (the command, default `laneserve`),
# LANESERVE_PORTS ("8001 8002"), LOG_DIR (each instance's log; default a new temporary folder).
# Ctrl-C or SIGTERM drains both instances, then stops HAProxy. To watch one instance drain
# while the other keeps serving, `kill -TERM` the pid printed for it.
set -euo pipefail
set -m  # each child in its own process group: Ctrl-C reaches this script, which drains them in order

here="$(cd "$(dirname "$0")" && pwd)"
read -r -a laneserve <<< "${LANESERVE:-laneserve}"
read -r -a ports <<< "${LANESERVE_PORTS:-8001 8002}"
log_dir="${LOG_DIR:-$(mktemp -d -t laneserve-local.XXXXXX)}"
mkdir -p "$log_dir"
command -v haproxy >/dev/null || { echo "run-local.sh: haproxy is not on PATH (Debian: apt-get install haproxy; macOS: brew install haproxy)" >&2; exit 1; }
[ "${#ports[@]}" -eq 2 ] || { echo "run-local.sh: LANESERVE_PORTS must name two ports (haproxy.cfg lists two servers)" >&2; exit 1; }

pids=()
haproxy_pid=
cleanup() {
  trap - EXIT INT TERM
  # SIGTERM drains: each instance finishes its running streams (HAProxy still carries
  # them), then exits; HAProxy stops last.
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$haproxy_pid" ]; then kill -TERM "$haproxy_pid" 2>/dev/null || true; wait "$haproxy_pid" 2>/dev/null || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for i in 0 1; do
  port="${ports[$i]}"
  "${laneserve[@]}" serve --host 127.0.0.1 --port "$port" "$@" >"$log_dir/laneserve-$port.log" 2>&1 &
  pids+=("$!")
  echo "laneserve$((i + 1)): pid $! on 127.0.0.1:$port, log $log_dir/laneserve-$port.log"
done

# HAProxy would start anyway and add each instance once its /ready turns 200; waiting
# here only makes "ready" below mean that both instances are.
for i in 0 1; do
  port="${ports[$i]}"
  until curl -fsS -o /dev/null "http://127.0.0.1:$port/ready" 2>/dev/null; do
    kill -0 "${pids[$i]}" 2>/dev/null || { echo "run-local.sh: laneserve on port $port exited; see $log_dir/laneserve-$port.log" >&2; exit 1; }
    sleep 0.2
  done
done

export LANESERVE_1="127.0.0.1:${ports[0]}" LANESERVE_2="127.0.0.1:${ports[1]}"
echo "ready: http://${LANESERVE_LISTEN:-127.0.0.1:8000}/v1/chat/completions (stats: http://${HAPROXY_STATS:-127.0.0.1:8404}/stats)"
haproxy -db -f "$here/haproxy.cfg" &
haproxy_pid=$!
wait "$haproxy_pid"
